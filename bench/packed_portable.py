"""The packed layouts' portable kernel, the one every GPU runs for a GGUF k-quant linear, timed on the device: Q4_K and
Q5_K with their 6-bit scales as the file stores them (`k_scales`, what tinyvllm loads) against the same weights with a
byte per scale and min (the layout before), and Q6_K for scale.

  python bench/packed_portable.py [--shapes 4096x4096,14336x4096] [--rows 1,32] [--rounds 9] [--json out.json]

The 6-bit layout reads 2.8 % fewer bytes and computes each weight's group scale from them with a few more integer
operations, inside the matmul kernel: on the CPU device's generated code (compute-bound) it took 1.15x the byte
layout's time; on a GPU the answer is this script's. Both layouts are checked to give the same outputs (the same
weights exactly), then each runs as one TinyJit'd kernel, the two taking turns round by round; reported: the median
time per call (after the device synchronizes), weight GB/s, and the 6-bit layout's speed over the byte layout's.
"""
from __future__ import annotations
import argparse, dataclasses, json, sys, time
from pathlib import Path
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def byte_scales(parts: dict, spec):
  """The same weights with Q4_K's/Q5_K's scales and mins a byte each ([N, K/32, 2] uint8), and its spec."""
  from tinyvllm.quant import blocks
  sc, mn = blocks.k_scales_mins(parts["scales"])
  return dict(parts, scales=np.stack([sc, mn], axis=-1).reshape(len(sc), -1, 2)), dataclasses.replace(spec, k_scales=False)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
  ap.add_argument("--shapes", default="4096x4096,14336x4096", help="NxK (output rows x inputs), comma-separated")
  ap.add_argument("--rows", default="1,32", help="rows of x")
  ap.add_argument("--rounds", type=int, default=9)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  from tinygrad import Device, Tensor, TinyJit
  from test_blocks import random_ggml
  from tinyvllm.kernels import portable
  from tinyvllm.quant import blocks
  from tinyvllm.quant.formats import PACKED, LinearWeights
  dev = Device.DEFAULT
  rng = np.random.default_rng(0)
  cases = [(t, *map(int, s.split("x")), int(m)) for t in args.types.split(",") for s in args.shapes.split(",") for m in args.rows.split(",")]
  rows = []
  for qtype, N, K, M in tqdm(cases, desc="kernels", file=sys.stderr, disable=None):
    parts, spec = blocks.from_ggml(random_ggml(qtype, N, K, rng), qtype, (N, K))
    layouts = {"file's scales": (parts, spec)}
    if spec.k_scales: layouts["byte scales"] = byte_scales(parts, spec)
    x = Tensor(rng.standard_normal((M, K)).astype(np.float32), device=dev).realize()
    runs, outputs = {}, {}
    for name, (p, sp) in layouts.items():
      lw = LinearWeights(PACKED, **{k: Tensor(v, device=dev).realize() for k, v in p.items() if k != "qspec"}, spec=sp)
      run = TinyJit(lambda x, lw=lw: portable.packed_linear(x, lw).realize())
      for _ in range(3): out = run(x)   # captured on the second call
      outputs[name], runs[name] = out.numpy(), (run, sum(t.nbytes() for t in lw.tensors()))
    if len(outputs) == 2:
      a, b = outputs.values()
      assert np.array_equal(a, b) or np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), f"{qtype}: the two layouts disagree"
    times = {name: [] for name in runs}
    for r in range(args.rounds):
      for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
        run, _ = runs[name]
        Device[dev].synchronize()
        t = time.perf_counter()
        for _ in range(5): run(x)
        Device[dev].synchronize()
        times[name].append((time.perf_counter() - t) / 5)
    first = np.array(times["file's scales"])
    for name, ts in times.items():
      ts = np.array(ts)
      rows.append({"type": qtype, "N": N, "K": K, "M": M, "layout": name, "device": dev, "ms": float(np.median(ts) * 1e3),
                   "weight_gbps": float(runs[name][1] / np.median(ts) / 1e9), "speed_vs_file_scales": float(np.median(first / ts))})
  print(f"{'type':5} {'N x K':>12} {'M':>3} {'layout':>14} {'ms':>8} {'GB/s':>7} {'speed vs file scales':>21}   ({dev})")
  for r in rows:
    print(f"{r['type']:5} {r['N']:>5} x {r['K']:<5} {r['M']:>3} {r['layout']:>14} {r['ms']:8.3f} {r['weight_gbps']:7.1f} {r['speed_vs_file_scales']:21.3f}")
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
