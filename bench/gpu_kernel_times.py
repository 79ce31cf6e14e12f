"""Where a decode step's device time goes, kernel by kernel: run it where the GPU is (bench/gpu_session.sh does).

    python bench/gpu_kernel_times.py MODEL [--batch-size 1] [--prompt-len 128] [--json out.json]

The engine captures its decode pass without graphs (tinygrad's JIT=2: each kernel a call of its own), then every
kernel of one decode step runs alone, the host waiting for it, and tinygrad's device timing (CUDA events on a GPU)
is summed per kernel name. Printed largest first, with the step's total: what the graph's step time is made of,
without the launch gaps a graph removes (bench's ms/step against this total is that overhead).
"""
from __future__ import annotations
import os
os.environ.setdefault("JIT", "2")   # before tinygrad is imported: no graphs, every kernel its own call
import argparse, collections, json, re


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("model")
  ap.add_argument("--batch-size", type=int, default=1)
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--kernel-backend", default="auto")
  ap.add_argument("--dtype", default="auto")
  ap.add_argument("--async-scheduling", choices=("off", "on"), default="off", help="the decode pass as a pipelined engine captures it")
  ap.add_argument("--json")
  args = ap.parse_args()
  from tinygrad.engine.realize import run_linear
  from tinygrad.helpers import GlobalCounters
  from tinygrad.uop.ops import Ops, UOp
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  B = args.batch_size
  # every prompt in one prefill step (a step's token budget the batch's prompts), so the batch decodes together at once
  engine = LLMEngine.from_kwargs(args.model, capture_mode="pass", max_num_seqs=max(B, 8), max_model_len=args.prompt_len + 64,
                                 max_num_batched_tokens=max(B * args.prompt_len, 2048),
                                 kernel_backend=args.kernel_backend, dtype=args.dtype,
                                 async_scheduling=args.async_scheduling == "on")
  vocab = engine.model_config.vocab_size
  for i in range(B):
    ids = [(7 * i + 13 * j) % vocab for j in range(args.prompt_len)]
    engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
  runner = engine.runner
  # the prefill, then decode steps until the batch's decode pass (its rows: B rounded up to a bucket) is bound
  widest = lambda: max((s.num_seqs for s, _ in runner.bound_passes if s.query_len == 1), default=0)
  for _ in range(16):
    engine.step()
    if widest() >= B: break
  if widest() < B: raise SystemExit(f"no decode pass of {B} sequences was bound (the widest: {widest()} rows)")
  engine.step()
  # the widest decode pass (a narrower one would be a sequence's decoding before the others had prefilled)
  shape, bound = max(((s, b) for (s, _), b in runner.bound_passes.items() if s.query_len == 1), key=lambda sb: sb[0].num_seqs)
  captured, inputs = bound[0][0].captured, tuple(bound[0][0].inputs)
  seqs = [s for seqs in engine.core.requests.values() for s in seqs]
  blocks = max(-(-s.num_tokens // runner.block_size) for s in seqs)
  var_vals = runner.extent_variable(shape).var_vals(blocks)
  per_name: dict[str, list[float]] = collections.defaultdict(list)
  for call in captured.linear.src:
    before = GlobalCounters.time_sum_s
    run_linear(UOp(Ops.LINEAR, src=(call,)), var_vals, input_uops=inputs, jit=True, wait=True)
    ast = call.src[0]
    name = re.sub(r"\x1b\[[0-9;]*m", "", ast.arg.name if ast.op is Ops.PROGRAM else str(ast.op))
    per_name[name].append(GlobalCounters.time_sum_s - before)
  total = sum(sum(v) for v in per_name.values())
  rows = sorted(((sum(v), len(v), n) for n, v in per_name.items()), reverse=True)
  print(f"decode step, batch {B} ({shape.num_seqs} rows), {blocks} KV blocks, {len(captured.linear.src)} kernels on "
        f"{runner.devices[0]}: {total * 1e3:.3f} ms of device time")
  print(f"{'us/step':>9} {'share':>6} {'count':>5}  kernel")
  for seconds, count, name in rows[:args.top]:
    print(f"{seconds * 1e6:9.1f} {seconds / total:6.1%} {count:5d}  {name}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"batch_size": B, "rows": shape.num_seqs, "kv_blocks": blocks, "kernels": len(captured.linear.src), "device_ms": total * 1e3,
                 "by_kernel": [{"name": n, "count": c, "us": s * 1e6} for s, c, n in rows]}, f, indent=1)


if __name__ == "__main__":
  main()
