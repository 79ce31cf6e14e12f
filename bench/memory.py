"""Memory of a loaded model: the weight bytes tinyvllm holds, its share of the fp16 bytes, and the process's peak RSS.

  python bench/memory.py [--model PATH] [--quantization stored,int4,none] [--json out.json]

Each configuration is loaded in a fresh subprocess (peak RSS is a process-lifetime figure), which then generates
32 tokens so the KV cache, captured kernels and first activations are counted too. Columns:
  weights   bytes of every tensor the model reads (packed codes, scales and biases included), from the loaded
            model itself, not from the file
  of fp16   weights / (parameter count x 2 bytes), the parameter count being the dequantized model's
  KV cache  the paged cache as the engine sized it by default (a share of free memory, see EngineConfig)
  device    tinygrad's count of the device memory, after generating: weights and buffers (on the CPU device the
            weights are host memory the loader lends tinygrad, counted too: host_memory.py; the KV cache is memory
            the engine maps itself, committed as it fills, so it is not in this count)
  peak RSS  the process's high-water mark (ru_maxrss), which also holds Python, tinygrad, the tokenizer and, on
            load, the checkpoint as read from disk; `baseline` is the same before the model is loaded.
"""
from __future__ import annotations
import argparse, json, os, resource, subprocess, sys

_CHILD = r"""
import json, os, resource, sys
from tinygrad.helpers import GlobalCounters
from tinyvllm import SamplingParams
from tinyvllm.bench.runs import model_tensors
from tinyvllm.engine.llm_engine import LLMEngine
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model, quantization = sys.argv[1] or None, sys.argv[2]
engine = LLMEngine.from_kwargs(model, **({} if quantization == "stored" else {"quantization": quantization}))
engine.add_request("0", "Tell me about lighthouses.", SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
while engine.has_unfinished_requests(): engine.step()
cfg = engine.model_config
h, L, v, i = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
params = v * h * (1 if cfg.tie_word_embeddings else 2) + h + L * (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h)
print(json.dumps({"quantization": quantization, "kernel_backend": engine.kernel_backend,
                  "weight_bytes": sum(t.nbytes for t in model_tensors(engine.runner.model)),
                  "kv_cache_bytes": engine.block_manager.num_blocks * engine.runner.kv_bytes_per_block,
                  "fp16_bytes": 2 * params, "parameters": params, "device_bytes": GlobalCounters.mem_used,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "baseline_rss_bytes": baseline}))
"""


def measure(model: str | None, quantization: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _CHILD, model or "", quantization], capture_output=True, text=True,
                       env=os.environ | {"DEV": os.environ.get("DEV", "CPU")})
  if out.returncode != 0: sys.exit(f"bench/memory.py: loading with quantization={quantization} failed:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=None, help="HF directory, GGUF file or hub id (default: SmolLM2-135M-Instruct Q4_1 GGUF)")
  ap.add_argument("--quantization", default="stored,int4,none",
                  help="comma-separated: stored (the checkpoint as it is), int4, none")
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args()
  rows = []
  from tqdm import tqdm
  for q in tqdm(args.quantization.split(","), desc="configurations", file=sys.stderr):
    rows.append(measure(args.model, q.strip()))
  mb = lambda b: f"{b / 1e6:.1f} MB"
  print(f"{'quantization':<14}{'weights':>12}{'of fp16':>9}{'KV cache':>12}{'device':>12}{'peak RSS':>12}{'baseline':>12}")
  for r in rows:
    print(f"{r['quantization']:<14}{mb(r['weight_bytes']):>12}{r['weight_bytes'] / r['fp16_bytes']:>9.1%}{mb(r['kv_cache_bytes']):>12}"
          f"{mb(r['device_bytes']):>12}{mb(r['peak_rss_bytes']):>12}{mb(r['baseline_rss_bytes']):>12}")
  print(f"fp16 weights of this model: {mb(rows[0]['fp16_bytes'])} ({rows[0]['parameters'] / 1e6:.1f} M parameters)")
  if args.json:
    with open(args.json, "w") as f: json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
