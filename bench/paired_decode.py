"""Decode speed beside llama.cpp on one GGUF file, in alternating rounds in one process: the ratio taken pair by pair.

  python bench/paired_decode.py MODEL.gguf [--batch-sizes 1] [--context 128] [--steps 16] [--rounds 6] [--json out.json]

`python -m tinyvllm.bench --peers llamacpp` times every tinyvllm run first and llama.cpp's after it, minutes apart. On a
shared machine whose speed drifts (another tenant's load moved this 2-core VM's measured bandwidth between 43 and 76
GB/s from run to run) those ratios scatter: the same 8B file gave 0.85x to 1.22x. Here both engines hold the model
at once and take turns, round by round (tinyvllm's `steps` decode steps, then llama.cpp's), so each ratio compares
two measurements taken seconds apart; the median ratio and its spread are reported. Both run on --threads threads.
Needs memory for both copies of the weights (tinyvllm's repacked tensors, llama.cpp's mapped file).
"""
from __future__ import annotations
import argparse, json, sys
from pathlib import Path
import numpy as np
from tqdm import tqdm


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("model", type=Path, help="a GGUF file both engines read")
  ap.add_argument("--batch-sizes", default="1")
  ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps")
  ap.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--threads", type=int, default=None, help="threads for each engine (default: every core)")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  if not args.model.is_file(): sys.exit(f"bench/paired_decode.py: {args.model} is not a file")
  from tinyvllm.bench.peers import LlamaCppPeer
  from tinyvllm.bench.runs import Driver, decode_run
  from tinyvllm.engine.llm_engine import LLMEngine
  batches = [int(b) for b in args.batch_sizes.split(",")]
  max_len = args.context + args.warmup + args.steps + 8
  engine = LLMEngine.from_kwargs(str(args.model), max_model_len=max_len, max_num_seqs=max(batches), num_threads=args.threads)
  drv = Driver(engine)
  peer = LlamaCppPeer(args.model, max(batches), max_len, args.threads)
  rng = np.random.default_rng(0)
  rows = []
  for b in batches:
    ours, theirs = [], []
    for _ in tqdm(range(args.rounds), desc=f"B={b} rounds", file=sys.stderr, disable=None, leave=False):
      ours.append(decode_run(drv, b, args.context, args.steps, args.warmup, rng, max_len - args.context)["tokens_per_s"])
      theirs.append(peer.decode(b, args.context, args.steps, args.warmup, rng)["tokens_per_s"])
    ratios = np.array(ours) / np.array(theirs)
    rows.append({"batch_size": b, "context_len": args.context, "steps": args.steps, "tinyvllm_tokens_per_s": ours,
                 "llamacpp_tokens_per_s": theirs, "ratios": ratios.tolist(), "median_ratio": float(np.median(ratios))})
  peer.close()
  print(f"{args.model.name}: {peer.precision} weights, {peer.threads} threads each, {args.rounds} rounds of {args.steps} steps")
  print(f"{'B':>3} {'tinyvllm tok/s (median)':>24} {'llama.cpp tok/s (median)':>25} {'ratio median':>13} {'min':>6} {'max':>6}")
  for r in rows:
    print(f"{r['batch_size']:>3} {np.median(r['tinyvllm_tokens_per_s']):>24.2f} {np.median(r['llamacpp_tokens_per_s']):>25.2f} "
          f"{r['median_ratio']:>12.3f}x {min(r['ratios']):>6.3f} {max(r['ratios']):>6.3f}")
  if args.json: args.json.write_text(json.dumps({"model": str(args.model), "precision": peer.precision, "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
