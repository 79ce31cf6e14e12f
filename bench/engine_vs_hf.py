"""SmolLM2-135M on this machine: tinyvllm vs HF transformers (torch, fp32) in one run.

Measures steady-state decode tok/s at batch 1, total decode tok/s at batch 8 and prefill tok/s, for both
engines with the same weights (the default Q4_1 GGUF, dequantized to float32). Prints a table, writes JSON.

  python bench/engine_vs_hf.py [--json bench/results/engine_vs_hf.json] [--steps 64] [--prefill-len 512]
"""
from __future__ import annotations
import argparse, json, os, platform, sys, time
from pathlib import Path
import numpy as np
from tqdm import tqdm


def tinyvllm_run(args) -> dict:
  from tinyvllm import LLM, SamplingParams
  llm = LLM(args.model, dtype="float32", num_kv_blocks=1024, max_num_batched_tokens=args.prefill_len)
  engine = llm.llm_engine
  rng = np.random.default_rng(0)
  results = {}
  for batch in (1, 8):
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for _ in range(2):   # the first round captures this batch shape; the second is measured
      for _ in range(batch): engine.add_request(rng.integers(100, 20000, 32).tolist(), params)
      while any(s.is_prefilling or s.status.name == "WAITING" for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
      engine.step(); engine.step()
      t = time.perf_counter()
      for _ in tqdm(range(args.steps), desc=f"tinyvllm decode b={batch}", file=sys.stderr, leave=False): engine.step()
      dt = time.perf_counter() - t
      while engine.has_unfinished_requests(): engine.step()
    results[f"decode_b{batch}_tok_s"] = batch * args.steps / dt
  prompt = rng.integers(100, 20000, args.prefill_len).tolist()
  one = SamplingParams(temperature=0, max_tokens=1)
  for _ in range(2):
    llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)   # capture the prefill shape
  t = time.perf_counter()
  llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)
  results["prefill_tok_s"] = args.prefill_len / (time.perf_counter() - t)
  return results


def hf_run(args) -> dict:
  import torch
  from transformers import AutoModelForCausalLM
  from tinyvllm.model.weights import resolve_model
  path = resolve_model(args.model)
  if path.suffix == ".gguf": model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
  else: model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  model.eval()
  rng = np.random.default_rng(0)
  results = {}
  with torch.no_grad():
    for batch in (1, 8):
      ids = torch.tensor(rng.integers(100, 20000, (batch, 32)))
      model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)      # warm up
      t = time.perf_counter(); model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
      prefill = time.perf_counter() - t
      t = time.perf_counter()
      model.generate(ids, max_new_tokens=args.steps + 1, min_new_tokens=args.steps + 1, do_sample=False, pad_token_id=0)
      results[f"decode_b{batch}_tok_s"] = batch * args.steps / (time.perf_counter() - t - prefill)
    ids = torch.tensor(rng.integers(100, 20000, (1, args.prefill_len)))
    model(ids)
    t = time.perf_counter(); model(ids)
    results["prefill_tok_s"] = args.prefill_len / (time.perf_counter() - t)
  return results


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF")
  p.add_argument("--steps", type=int, default=64, help="decode steps measured per batch size")
  p.add_argument("--prefill-len", type=int, default=512)
  p.add_argument("--json", default="bench/results/engine_vs_hf.json")
  p.add_argument("--no-hf", action="store_true")
  args = p.parse_args()
  ours = tinyvllm_run(args)
  try: hf = {} if args.no_hf else hf_run(args)
  except ImportError as e: hf = {}; print(f"transformers/torch unavailable, skipping the peer: {e}", file=sys.stderr)
  print(f"\n{'metric':<22}{'tinyvllm':>12}{'transformers':>14}{'ratio':>8}")
  for key in ours:
    ratio = f"{ours[key] / hf[key]:.2f}x" if key in hf else "-"
    print(f"{key:<22}{ours[key]:>12.1f}{hf.get(key, float('nan')):>14.1f}{ratio:>8}")
  out = {"machine": platform.machine(), "cpus": os.cpu_count(), "device": os.environ.get("DEV", "default"),
         "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf (fp32)", "tinyvllm": ours, "transformers": hf}
  Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  Path(args.json).write_text(json.dumps(out, indent=2))
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
