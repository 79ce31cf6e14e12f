"""The host's per-step cost as outputs grow long: what a step of output processing and of the penalties costs at the
start of a long generation and at its end. A cost that grows with the text makes a long generation quadratic.

  python bench/long_outputs.py [--sequences 32] [--tokens 32000] [--windows 8] [--vocab 128256] [--json out.json]

Output processing: `OutputProcessor.process` handed one new token for each of `--sequences` requests a step, as the
engine core hands them, for `--tokens` steps, in each output kind (and DELTA with a stop string that never
completes); a word-level tokenizer of about 4 characters a token. Penalties: `sampler.apply_penalties` with
repetition, presence and frequency penalties over a vocabulary of `--vocab`, one sequence, for prompt and output
lengths up to 32,000 tokens. Both run on the CPU alone (no model, no device): us a step, median of the window.
"""
from __future__ import annotations
import argparse, json, statistics, sys, tempfile, time
from pathlib import Path
import numpy as np
from tqdm import tqdm


def output_processing(sequences: int, tokens: int, windows: int, tokenizer_dir: Path) -> list[dict]:
  from tinyvllm import RequestOutputKind, SamplingParams
  from tinyvllm.engine.output_processor import OutputProcessor
  from tinyvllm.engine.request import CoreOutput, EngineRequest
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.outputs import RequestMetrics
  tokenizer = load_tokenizer(tokenizer_dir)
  ids = np.random.default_rng(0).integers(2, tokenizer.vocab_size, (tokens, sequences)).tolist()
  rows = []
  cases = [(kind.name, kind, None) for kind in RequestOutputKind] + [("DELTA, a stop string", RequestOutputKind.DELTA, "</answer>")]
  for name, kind, stop in cases:
    processor = OutputProcessor(tokenizer)
    for r in range(sequences):
      params = SamplingParams(max_tokens=tokens + 1, output_kind=kind, stop=[stop] if stop else None)
      processor.add_request(EngineRequest(str(r), None, [5], params, RequestMetrics(arrival_time=0.0)))
    times = []
    for step in tqdm(ids, desc=f"output processing, {name}", leave=False):
      t = time.perf_counter()
      processor.process([CoreOutput(str(r), 0, [token]) for r, token in enumerate(step)])
      times.append(time.perf_counter() - t)
    per = len(times) // windows
    rows.append({"case": name, "sequences": sequences,
                 "us_per_step": [statistics.median(times[w * per:(w + 1) * per]) * 1e6 for w in range(windows)],
                 "tokens_per_window": per})
  return rows


def penalties(vocab: int) -> list[dict]:
  from tinyvllm import SamplingParams, sampler
  rng = np.random.default_rng(0)
  logits = rng.standard_normal(vocab).astype(np.float32)
  params = SamplingParams(repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.2)
  rows = []
  for prompt, output in tqdm([(1000, 1000), (1000, 8000), (8000, 24000)], desc="penalties", leave=False):
    every = rng.integers(0, min(vocab, 32000), prompt + output).tolist()   # a text's ids: a part of the vocabulary
    ids = every[:-50]
    counts = sampler.TokenCounts(vocab, prompt).update(ids)
    times = []
    for token in every[-50:]:   # 50 steps, a token each, as the engine core calls them
      ids.append(token)
      t = time.perf_counter()
      sampler.apply_penalties(logits, counts.update(ids), params)
      times.append(time.perf_counter() - t)
    verify = []   # a speculative verify's step: 4 drafted tokens, each of its 5 positions penalized with those before it
    for token in every[-50:]:
      drafts = rng.integers(0, min(vocab, 32000), 4).tolist()
      t = time.perf_counter()
      for k in range(5): sampler.apply_penalties(logits, counts.update(ids), params, drafts[:k])
      verify.append(time.perf_counter() - t)
    rows.append({"prompt_tokens": prompt, "output_tokens": output, "vocab": vocab, "us_per_step": statistics.median(times) * 1e6,
                 "us_per_verify_step": statistics.median(verify) * 1e6})
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sequences", type=int, default=32)
  ap.add_argument("--tokens", type=int, default=32000)
  ap.add_argument("--windows", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=128256)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from real_size import write_word_tokenizer
  penalized = penalties(args.vocab)   # first: after output processing's millions of objects it read 1.5-2x slower
  with tempfile.TemporaryDirectory() as d:
    write_word_tokenizer(Path(d), 384)   # "<t0>" .. "<t383>": about 4 characters a token
    outputs = output_processing(args.sequences, args.tokens, args.windows, Path(d))
  per = outputs[0]["tokens_per_window"]
  print(f"output processing, {args.sequences} sequences, us a step (median) in each window of {per} tokens:")
  print(f"{'kind':22}" + "".join(f"{f'{(w + 1) * per // 1000}k':>8}" for w in range(args.windows)) + f"{'last/first':>12}")
  for r in outputs:
    us = r["us_per_step"]
    print(f"{r['case']:22}" + "".join(f"{u:8.0f}" for u in us) + f"{us[-1] / us[0]:12.2f}")
  print(f"\npenalties (repetition, presence, frequency), vocabulary {args.vocab}, one sequence:")
  print(f"{'prompt + output':>18} {'us a step':>10} {'us a verify step of 4 drafts':>30}")
  for r in penalized: print(f"{r['prompt_tokens']:>8} + {r['output_tokens']:<7} {r['us_per_step']:10.0f} {r['us_per_verify_step']:30.0f}")
  if args.json: args.json.write_text(json.dumps({"output_processing": outputs, "penalties": penalized}, indent=1))


if __name__ == "__main__":
  main()
