"""Decode speed with each KV cache format, measured paired: one engine per format, their decode steps interleaved.

  DEV=CPU python bench/kv_cache_speed.py [--kv-cache-dtype auto,int8,int4] [--batch-sizes 1,8] [--context-lens 128,4096]
                                         [--steps 24] [--model PATH] [--json out.json]

`python -m tinyvllm.bench --kv-cache-dtype auto,int8` runs the formats one after the other, so on a shared machine
a change of load between them reads as a change of speed. Here every format's engine holds the same batch (same
random prompts, prefilled first), and each round times one decode step of every engine in turn, so load drift hits
them alike. Reported per (batch, context): the median step time of each format and its speed relative to the first.
"""
from __future__ import annotations
import argparse, json, statistics, sys, time
from pathlib import Path
import numpy as np
from tqdm import tqdm


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--kv-cache-dtype", default="auto,int8,int4")
  ap.add_argument("--batch-sizes", default="1,8")
  ap.add_argument("--context-lens", default="128,4096")
  ap.add_argument("--steps", type=int, default=24, help="timed rounds (one step of every engine each)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  from tinyvllm import SamplingParams
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.llm_engine import LLMEngine
  formats = args.kv_cache_dtype.split(",")
  batches, contexts = [int(x) for x in args.batch_sizes.split(",")], [int(x) for x in args.context_lens.split(",")]
  rows, rng = [], np.random.default_rng(0)
  for B in batches:
    for ctx in contexts:
      # sequences prefilled first decode while the later ones prefill (in chunks of the engine's default
      # max_num_batched_tokens): leave room for those tokens too, so every timed step decodes all B
      max_len = ctx + B * -(-ctx // EngineConfig.max_num_batched_tokens) + B + args.warmup + args.steps + 8
      blocks = B * -(-max_len // 16) + 1
      engines = [LLMEngine.from_kwargs(args.model, kv_cache_dtype=f, max_model_len=max_len, num_kv_blocks=blocks,
                                       max_num_seqs=B, enable_prefix_caching=False) for f in formats]
      vocab = engines[0].model_config.vocab_size
      prompts = [rng.integers(100, vocab - 100, ctx).tolist() for _ in range(B)]
      params = SamplingParams(max_tokens=max_len - ctx, temperature=0, ignore_eos=True)
      for e in tqdm(engines, desc=f"prefill B={B} ctx={ctx}", unit="engine", file=sys.stderr):
        for i, p in enumerate(prompts): e.add_request(str(i), p, params)
        while any(s.num_computed_tokens < ctx for s in e.scheduler.running + list(e.scheduler.waiting)): e.step()
      times = [[] for _ in engines]
      context = statistics.mean(s.num_computed_tokens for s in engines[0].scheduler.running)
      for r in tqdm(range(args.warmup + args.steps), desc=f"decode B={B} ctx={ctx}", unit="round", file=sys.stderr):
        for i, e in enumerate(engines):
          t = time.perf_counter()
          e.step()
          if r >= args.warmup: times[i].append(time.perf_counter() - t)
          assert len(e.scheduler.running) == B, "a sequence finished or was preempted inside the timed rounds"
      base = statistics.median(times[0])
      for f, e, ts in zip(formats, engines, times):
        med = statistics.median(ts)
        rows.append({"kv_cache_dtype": f, "batch_size": B, "context_len": ctx, "mean_context_at_start": context,
                     "median_step_ms": med * 1e3,
                     "tokens_per_s": B / med, "speed_vs_first": base / med, "steps_ms": [t * 1e3 for t in ts],
                     "kv_bytes_per_token": e.runner.kv_bytes_per_block // e.runner.block_size})
      del engines
  print(f"| batch | context | KV cache | ms/step (median) | tok/s | vs {formats[0]} | KV bytes/token |\n|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch_size']} | {r['context_len']} | {r['kv_cache_dtype']} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
          f"{r['speed_vs_first']:.2f}x | {r['kv_bytes_per_token']} |")
  if args.json: args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
