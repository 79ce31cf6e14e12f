"""Prefill chunks packed back to back against padded to the longest: the prefill query slots a stream of prompts costs
(padding included) for its prompt tokens, the pass shapes it captures, and its time, on the portable backend.

  python bench/prefill_packing.py [--prompts 120] [--workloads 10-200,100-600,10-1000] [--device CPU] [--json out.json]

Each workload: `--prompts` prompts of uniformly random lengths in its range, arriving 1 to 5 at a time every 4 engine
steps (a seeded schedule, the same for both runs), 16 tokens each generated, through the engine's scheduler and
runner at their defaults (a 512-token budget, 32 sequences). "Padded" is the engine with every prefill chunk padded
to the step's longest, as the portable backend's attention read them before it packed them (`Kernels.packs`). Slots
and shapes are counts (machine-independent); the times are this machine's, the portable kernels on the CPU device
(its default `cpu` backend packs either way), a tiny random-weight model written here.
"""
from __future__ import annotations
import argparse, json, sys, tempfile, time
from pathlib import Path
import numpy as np
from tqdm import tqdm


def run(model: Path, lengths: tuple[int, int], prompts: int, packed: bool, device: str) -> dict:
  from tinygrad.helpers import Context
  from tinyvllm import SamplingParams
  from tinyvllm.engine import model_runner
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.kernels import Kernels
  counts = {"slots": 0, "tokens": 0, "passes": 0, "seconds": 0.0}
  execute = model_runner.ModelRunner.execute
  def counted(self, decodes, prefills=(), verifies=(), **kwargs):   # the slots of the step's prefill pass
    if not prefills: return execute(self, decodes, prefills, verifies, **kwargs)
    shape = self._shape(1, prefills, False)
    counts["slots"] += shape.num_tokens
    counts["tokens"] += sum(len(w.tokens) for w in prefills)
    counts["passes"] += 1
    t = time.perf_counter()
    try: return execute(self, decodes, prefills, verifies, **kwargs)
    finally: counts["seconds"] += time.perf_counter() - t
  model_runner.ModelRunner.execute, packs = counted, Kernels.packs_prefill
  Kernels.packs_prefill = packed
  try:
    with Context(DEV=device):
      engine = LLMEngine.from_kwargs(str(model), kernel_backend="portable", max_model_len=1024, num_kv_blocks=8192)
      assert engine.runner.packs_prefill == packed
      rng, added, step = np.random.default_rng(0), 0, 0
      params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
      started = time.perf_counter()
      with tqdm(total=prompts, desc=f"{lengths[0]}-{lengths[1]} tokens, {'packed' if packed else 'padded'}", leave=False) as bar:
        while added < prompts or engine.has_unfinished_requests():
          if step % 4 == 0 and added < prompts:
            for _ in range(min(int(rng.integers(1, 6)), prompts - added)):
              ids = rng.integers(5, 4000, int(rng.integers(lengths[0], lengths[1] + 1))).tolist()
              engine.add_request(str(added), {"prompt_token_ids": ids}, params)
              added += 1
          if engine.has_unfinished_requests():
            bar.update(sum(o.finished for o in engine.step()))
          step += 1
      shapes = sorted({(s.num_seqs, s.query_len) for s in engine.runner.replays if s.query_len > 1})
      return {"workload": f"{lengths[0]}-{lengths[1]}", "packed": packed, **counts, "prefill_shapes": len(shapes),
              "wall_seconds": time.perf_counter() - started}
  finally:
    model_runner.ModelRunner.execute, Kernels.packs_prefill = execute, packs


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--prompts", type=int, default=120)
  ap.add_argument("--workloads", default="10-200,100-600,10-1000", help="comma-separated prompt length ranges")
  ap.add_argument("--device", default="CPU")
  ap.add_argument("--json", type=Path)
  args = ap.parse_args()
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from loading import write_checkpoint
  workloads = [tuple(map(int, w.split("-"))) for w in args.workloads.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    model = write_checkpoint(Path(tmp) / "tiny", "tiny")
    rows = [run(model, w, args.prompts, packed, args.device) for w in workloads for packed in (False, True)]
  print(f"{'prompt tokens':>14} {'':>7} {'slots / token':>14} {'passes':>7} {'shapes':>7} {'prefill s':>10} {'wall s':>8}")
  for r in rows:
    print(f"{r['workload']:>14} {'packed' if r['packed'] else 'padded':>7} {r['slots'] / r['tokens']:>14.2f} {r['passes']:>7} "
          f"{r['prefill_shapes']:>7} {r['seconds']:>10.2f} {r['wall_seconds']:>8.2f}")
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
