"""Decode tok/s with tensor parallelism (`tensor_parallel_size`, model/tensor_parallel.py) against one device.

  python bench/tensor_parallel.py [--model M] [--sizes 1,2] [--batch-sizes 1,8] [--context-len 128] [--steps 32]
                                  [--repeats 3] [--json out.json]

For each model it runs, each engine in its own process, one after another: one device with the default kernels
(`auto`: the fused C layer on CPU), one device with the portable kernels (the kernels the sharded engine runs, so
the ratio to it is what splitting costs), and each tensor-parallel size of --sizes above 1. Each decode run is
`batch` sequences with `context`-token random prompts, --steps timed steps after a warm-up, --repeats times (the
median repeat is reported, every repeat kept in the JSON).

Without --model it measures the default model (SmolLM2-135M Q4_1: 9 query and 3 KV heads, which 2 devices cannot
split) and a twin of it with 8 query and 2 KV heads (`--twin`, written once into the tinyvllm cache): the same 30
layers, hidden size 576, FFN 1536, vocabulary 49152 and 4-bit linears in groups of 32, random weights. A size a
model cannot take is reported with the engine's error.
"""
from __future__ import annotations
import argparse, json, os, subprocess, sys
from pathlib import Path
import numpy as np

os.environ.setdefault("DEV", "CPU")


def twin_checkpoint(heads: int = 8, kv_heads: int = 2) -> Path:
  """The default model's shapes with `heads` query and `kv_heads` KV heads (head_dim 64), random weights, 4-bit
  linears in groups of 32 (MLX layout) and a float32 tied embedding (what a sharded engine loads the default
  model's 8-bit one as). A small byte-level BPE stands in for the tokenizer: the benchmark's prompts are token ids."""
  from safetensors.numpy import save_file
  from tinyvllm.model.fetch import cache_dir
  from tinyvllm.quant import int4
  out = cache_dir() / f"bench-twin-smollm2-{heads}h{kv_heads}kv"
  if (out / "model.safetensors").exists(): return out
  out.mkdir(parents=True, exist_ok=True)
  hidden, inter, layers, vocab, hd = 576, 1536, 30, 49152, 64
  cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
         "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
         "head_dim": hd, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
         "bos_token_id": 1, "eos_token_id": 2, "quantization": {"group_size": 32, "bits": 4}}
  rng = np.random.default_rng(0)
  w = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.05)
  tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
  for i in range(layers):
    p = f"model.layers.{i}."
    tensors |= {p + "input_layernorm.weight": np.ones(hidden, np.float32), p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                p + "mlp.down_proj.weight": w(hidden, inter)}
  save_file(int4.quantize_state_dict(tensors, group_size=32), str(out / "model.safetensors"))
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
  tok.train_from_iterator(["tensor parallel benchmark"] * 4, trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
  (out / "config.json").write_text(json.dumps(cfg))
  return out


def worker(spec: dict) -> dict:
  """One engine, every batch size: {"batch": {tok/s, ms/step, repeats}} or {"error": message}."""
  from tinyvllm.bench.runs import Driver, decode_run
  from tinyvllm.config import ConfigError
  from tinyvllm.engine.llm_engine import LLMEngine
  batches, context, steps, repeats = spec["batch_sizes"], spec["context_len"], spec["steps"], spec["repeats"]
  per_seq = context + spec["warmup"] + steps * repeats + 8
  try:
    engine = LLMEngine.from_kwargs(spec["model"], tensor_parallel_size=spec["tp"], kernel_backend=spec["backend"],
                                   max_model_len=per_seq, max_num_seqs=max(batches), num_kv_blocks=max(batches) * (per_seq // 16 + 2),
                                   max_num_batched_tokens=512)
  except ConfigError as e: return {"error": str(e)}
  drv, rng, out = Driver(engine), np.random.default_rng(0), {"backend": engine.kernel_backend}
  for b in batches:
    r = decode_run(drv, b, context, steps, spec["warmup"], rng, max_tokens=per_seq - context, repeats=repeats)
    out[str(b)] = {"tokens_per_s": r["tokens_per_s"], "ms_per_step": r["ms_per_step"], "tokens_per_s_repeats": r["tokens_per_s_repeats"]}
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", action="append", help="checkpoint (repeatable; default: the default model and its twin)")
  ap.add_argument("--twin", default="8,2", help="query,KV heads of the default model's twin (default: 8,2)")
  ap.add_argument("--sizes", default="1,2", help="tensor_parallel_size values (1 runs both auto and portable kernels)")
  ap.add_argument("--batch-sizes", default="1,8")
  ap.add_argument("--context-len", type=int, default=128)
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", help="write every result here")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(worker(json.loads(args.worker))))
    return
  from tinyvllm.model.weights import resolve_model
  models = args.model or [str(resolve_model(None)), str(twin_checkpoint(*map(int, args.twin.split(","))))]
  sizes, batches = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.batch_sizes.split(",")]
  configs = [(n, b) for n in sizes for b in (("auto", "portable") if n == 1 else ("auto",))]
  results = []
  for model in models:
    for tp, backend in configs:
      spec = dict(model=model, tp=tp, backend=backend, batch_sizes=batches, context_len=args.context_len, steps=args.steps,
                  warmup=args.warmup, repeats=args.repeats)
      proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
      lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
      res = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
      results.append(spec | {"result": res})
      print(f"{Path(model).name}: tensor_parallel_size={tp} kernel_backend={backend}: "
            + (res["error"] if "error" in res else ", ".join(f"B={b} {res[str(b)]['tokens_per_s']:.1f} tok/s" for b in batches)), flush=True)
  print(f"\n{'model':<36} {'tp':>3} {'kernels':<9} " + " ".join(f"{f'B={b} tok/s':>12} {'vs tp1':>7} {'vs tp1 portable':>16}" for b in batches))
  for model in models:
    rows = {(r["tp"], r["backend"]): r["result"] for r in results if r["model"] == model}
    for (tp, backend), res in rows.items():
      if "error" in res: continue
      cells = []
      for b in batches:
        rate = res[str(b)]["tokens_per_s"]
        ref = [rows.get((1, k), {}).get(str(b), {}).get("tokens_per_s") for k in ("auto", "portable")]
        cells.append(f"{rate:12.1f} " + " ".join(f"{rate / r:{w}.2f}x" if r else " " * (w + 1) for r, w in zip(ref, (6, 15))))
      print(f"{Path(model).name[:36]:<36} {tp:>3} {res['backend']:<9} " + " ".join(cells))
  if args.json: Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
