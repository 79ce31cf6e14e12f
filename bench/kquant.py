"""GGUF k-quant files of real size beside llama.cpp: load time, peak RSS, decode and prefill speed, in one run.

  python bench/kquant.py [--shapes 1b,8b] [--quant Q4_K_M] [--llama-quantize PATH] [--dir DIR] [--json out.json]

For each shape (Llama-3.2-1B and Llama-3.1-8B dimensions), a float16 GGUF of random weights is written once (streamed,
tensor by tensor, with a word-level vocabulary of the model's size) and turned into --quant by llama.cpp's own
`llama-quantize` (build it from the llama-cpp-python sdist: `pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`, then in vendor/llama.cpp `cmake -B build && cmake --build build --target llama-quantize`;
pass its path, or put it on PATH). Both engines then read that one file:
  load      seconds and peak RSS of loading it (each in a fresh process; tinyvllm's KV cache kept small)
  decode    batch-1 and batch-8 tok/s and prefill tok/s, from `python -m tinyvllm.bench ... --peers llamacpp` (the ratio
            column is tinyvllm / llama.cpp, measured in the same run), with % of the bandwidth roofline
The shape `default` is the default model (SmolLM2-135M, Q4_1) requantized by llama-quantize (--allow-requantize); for it
the run also compares the text: greedy continuations of a few prompts by both engines on that file (token ids fed to
both), each generated token's logprob under both, and every position's logprob when both read the same text
(llama.cpp's continuation given to tinyvllm as a prompt, its prompt_logprobs against llama.cpp's own), each against
a reference: the same file dequantized to float32 (tinyvllm with quantization="none": every weight exactly as gguf's
dequantizer gives it, float activations), which tells which engine's arithmetic moved the logprobs.
"""
from __future__ import annotations
import argparse, json, os, shutil, subprocess, sys, time
from pathlib import Path
import numpy as np
from real_size import SHAPES, measure_load

def write_f16_gguf(path: Path, shape: str) -> Path:
  """A random float16 Llama of `shape` as a GGUF file, each tensor generated and written in turn (never the whole model
  in memory); Q and K rows in llama.cpp's order (random weights: any order reads the same)."""
  import gguf
  if path.exists(): return path
  h, L, H, KVH, inter, V, tied = SHAPES[shape]
  D = h // H
  shapes = {"token_embd.weight": (V, h), "output_norm.weight": (h,)}
  if not tied: shapes["output.weight"] = (V, h)
  for i in range(L):
    shapes |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (H * D, h),
               f"blk.{i}.attn_k.weight": (KVH * D, h), f"blk.{i}.attn_v.weight": (KVH * D, h), f"blk.{i}.attn_output.weight": (h, H * D),
               f"blk.{i}.ffn_gate.weight": (inter, h), f"blk.{i}.ffn_up.weight": (inter, h), f"blk.{i}.ffn_down.weight": (h, inter)}
  part = path.with_suffix(".part")
  w = gguf.GGUFWriter(part, "llama")
  w.add_block_count(L); w.add_context_length(8192); w.add_embedding_length(h); w.add_feed_forward_length(inter)
  w.add_head_count(H); w.add_head_count_kv(KVH); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(500000.0)
  w.add_vocab_size(V); w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
  w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
  w.add_token_list(["t", "0"] + [f"t{i}" for i in range(V - 2)]); w.add_token_types([1] * V); w.add_token_merges(["t 0"])
  w.add_bos_token_id(0); w.add_eos_token_id(1)
  for name, s in shapes.items():
    dtype = np.float32 if len(s) == 1 else np.float16
    w.add_tensor_info(name, s, np.dtype(dtype), int(np.prod(s)) * np.dtype(dtype).itemsize)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
  rng = np.random.default_rng(0)
  from tqdm import tqdm
  for name, s in tqdm(shapes.items(), desc=f"writing {path.name}", file=sys.stderr):
    if len(s) == 1: w.write_tensor_data(np.ones(s, np.float32))
    else: w.write_tensor_data((rng.standard_normal(s, np.float32) * 0.02).astype(np.float16))
  w.close()
  part.rename(path)
  return path


def quantize(src: Path, quant: str, llama_quantize: str, dest: Path | None = None) -> Path:
  dest = dest or src.with_name(src.name.replace("-f16.gguf", f"-{quant}.gguf"))
  if not dest.exists():   # --allow-requantize: the default model is stored quantized (Q4_1)
    subprocess.run([llama_quantize, "--allow-requantize", str(src), str(dest.with_suffix(".part")), quant, str(os.cpu_count() or 1)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dest.with_suffix(".part").rename(dest)
  return dest


# each engine's imports and load, timed by real_size.measure_load (llama.cpp maps the file: one short step touches
# every weight once, as a first step would)
_LOAD = {"tinyvllm": ("from tinyvllm.engine.llm_engine import LLMEngine",
                      "engine = LLMEngine.from_kwargs(sys.argv[1], num_kv_blocks=16, max_model_len=256)"),
         "llama.cpp": ("import llama_cpp",
                       "llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, verbose=False, use_mmap=True); llm.eval([5, 6, 7])")}


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,",
           "The three primary colors are"]


def compare_text(path: Path, max_tokens: int = 32) -> dict:
  """Greedy continuations by tinyvllm and llama.cpp of the same token ids on one file, and their logprobs."""
  import llama_cpp
  from tinyvllm import LLM, SamplingParams
  ours, ref = LLM(str(path)), LLM(str(path), quantization="none")
  theirs = llama_cpp.Llama(str(path), n_ctx=256, n_threads=os.cpu_count(), logits_all=True, verbose=False)
  def log_softmax(v): v = np.asarray(v, np.float64); m = v.max(); return v - m - np.log(np.exp(v - m).sum())
  rows = []
  for prompt in PROMPTS:
    ids = ours.get_tokenizer().encode(prompt)
    theirs.reset(); theirs.eval(ids)
    their_ids, their_lp = [], []
    for _ in range(max_tokens):   # greedy, each step's full distribution from llama.cpp's logits
      lp = log_softmax(theirs.scores[theirs.n_tokens - 1])
      tok = int(lp.argmax()); their_ids.append(tok); their_lp.append(float(lp[tok]))
      theirs.eval([tok])
    out = ours.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True))[0].outputs[0]
    our_ids = list(out.token_ids)
    same = next((i for i, (a, b) in enumerate(zip(our_ids, their_ids)) if a != b), min(len(our_ids), len(their_ids)))
    our_lp = np.array([out.logprobs[i][t].logprob for i, t in enumerate(our_ids)])
    # the same text read by both: llama.cpp's continuation as a prompt, every position's logprob
    def forced(llm, continuation):   # every position's logprob, read in one prefill
      lp = llm.generate([ids + continuation], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
      return np.array([lp[len(ids) + i][t].logprob for i, t in enumerate(continuation)])
    forced_lp, ref_lp, their_lp = forced(ours, their_ids), forced(ref, their_ids), np.array(their_lp)
    decode_ref = forced(ref, our_ids)   # tinyvllm's decode steps (the GEMV, x in 16 bits) against float32 on its own text
    rows.append({"prompt": prompt, "same_tokens": same, "of": max_tokens, "text_tinyvllm": out.text,
                 "text_llamacpp": ours.get_tokenizer().decode(their_ids),
                 "greedy_logprob_max_abs_diff": float(np.abs(our_lp[:same] - their_lp[:same]).max(initial=0.0)),
                 "decode_vs_float32_max_abs_diff": float(np.abs(our_lp - decode_ref).max()),
                 "forced_logprob_max_abs_diff": float(np.abs(forced_lp - their_lp).max()),
                 "forced_logprob_mean_abs_diff": float(np.abs(forced_lp - their_lp).mean()),
                 "tinyvllm_vs_float32_max_abs_diff": float(np.abs(forced_lp - ref_lp).max()),
                 "tinyvllm_vs_float32_mean_abs_diff": float(np.abs(forced_lp - ref_lp).mean()),
                 "llamacpp_vs_float32_max_abs_diff": float(np.abs(their_lp - ref_lp).max()),
                 "llamacpp_vs_float32_mean_abs_diff": float(np.abs(their_lp - ref_lp).mean())})
  return {"prompts": rows}


def load(engine: str, path: Path) -> dict:
  imports, code = _LOAD[engine]
  return measure_load(path, imports, code, env={"DEV": "CPU"})


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="1b,8b")
  ap.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type name")
  ap.add_argument("--llama-quantize", default=shutil.which("llama-quantize"), help="path to llama.cpp's llama-quantize")
  ap.add_argument("--dir", type=Path, default=Path(os.environ.get("TINYVLLM_CACHE", Path.home() / ".cache" / "tinyvllm")) / "bench")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  if not args.llama_quantize: sys.exit("bench/kquant.py: llama-quantize not found: pass --llama-quantize (see the docstring)")
  args.dir.mkdir(parents=True, exist_ok=True)
  rows = []
  for shape in args.shapes.split(","):
    t = time.perf_counter()
    if shape == "default":
      from tinyvllm.model.fetch import default_model_path
      path = quantize(default_model_path(), args.quant, args.llama_quantize, args.dir / f"smollm2-135m-{args.quant}.gguf")
    else: path = quantize(write_f16_gguf(args.dir / f"llama-{shape}-f16.gguf", shape), args.quant, args.llama_quantize)
    row = {"shape": shape, "file": str(path), "file_bytes": path.stat().st_size, "quantize_seconds": time.perf_counter() - t}
    row["load"] = {engine: load(engine, path) for engine in _LOAD}
    out = args.dir / f"bench-{shape}.json"
    subprocess.run([sys.executable, "-m", "tinyvllm.bench", "--model", str(path), "--runs", "decode,prefill", "--batch-sizes", "1,8",
                    "--context-lens", "128", "--prefill-lens", "128", "--steps", str(args.steps), "--peers", "llamacpp",
                    "--json", str(out)], check=True)
    row["bench"] = json.loads(out.read_text())
    if shape == "default": row["text"] = compare_text(path)
    rows.append(row)
  print(f"\n{'shape':<6}{'file GB':>9}{'load s (ours/llama.cpp)':>26}{'peak RSS GB (ours/llama.cpp)':>31}")
  for r in rows:
    a, b = r["load"]["tinyvllm"], r["load"]["llama.cpp"]
    print(f"{r['shape']:<6}{r['file_bytes'] / 1e9:>9.2f}{a['load_seconds']:>13.1f} / {b['load_seconds']:<10.1f}"
          f"{a['peak_rss_bytes'] / 1e9:>16.2f} / {b['peak_rss_bytes'] / 1e9:<10.2f}")
  for r in rows:
    for t in r.get("text", {}).get("prompts", []):
      print(f"{r['shape']}: {t['prompt']!r}: greedy tokens equal {t['same_tokens']}/{t['of']}; logprob |diff| on llama.cpp's "
            f"text, max (mean): tinyvllm-llama.cpp {t['forced_logprob_max_abs_diff']:.4f} ({t['forced_logprob_mean_abs_diff']:.4f}), "
            f"tinyvllm-float32 {t['tinyvllm_vs_float32_max_abs_diff']:.4f} ({t['tinyvllm_vs_float32_mean_abs_diff']:.4f}), "
            f"llama.cpp-float32 {t['llamacpp_vs_float32_max_abs_diff']:.4f} ({t['llamacpp_vs_float32_mean_abs_diff']:.4f}); "
            f"tinyvllm's decode steps - float32, max {t['decode_vs_float32_max_abs_diff']:.4f}")
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
