"""INT4 linear micro-benchmark on the CPU device, SmolLM2-135M's matrix shapes, decode batch sizes.

  python bench/int4_decode.py [--group-size 64] [--m 1,8] [--reps 30] [--json out.json]

For each shape [N, K] and batch M it times, best of --reps:
  fp32 C    cpu.linear_f32 (float32 weight)
  int4 C    cpu.int4_linear (packed uint32 + fp16 scales/biases)
  int4 tg   portable.int4_linear (tinygrad ops, one fused kernel)
"jit" is one TinyJit replay of a single call (what a decode step pays, dispatch included: ~0.1 ms here);
"kernel" runs the same C source compiled with the same clang flags, called directly (no tinygrad dispatch),
each call on another copy of the weights so they come from memory, not cache (the "jit" column reuses one
copy, so small fp32 weights sit in L2 there).
GB/s counts the weight bytes read: float32 W for fp32, packed codes + scales + biases for int4.
"""
from __future__ import annotations
import argparse, ctypes, json, os, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np

os.environ.setdefault("DEV", "CPU")
from tinygrad import Tensor, TinyJit, Device  # noqa: E402
from tinyvllm.kernels import cpu, portable  # noqa: E402
from tinyvllm.quant import int4  # noqa: E402

COLD_BYTES = 96 << 20   # more than this machine's L2 + L3 (2 + 32 MiB)
SHAPES = [("q/o_proj", 576, 576), ("qkv fused", 960, 576), ("gate_up fused", 3072, 576), ("down_proj", 576, 1536),
          ("lm_head (tied embedding)", 49152, 576)]


def time_jit(fn, args, reps: int) -> float:
  jit = TinyJit(lambda *a: fn(*a).realize())
  best = float("inf")
  for _ in range(reps + 2):  # first calls run and capture
    Device["CPU"].synchronize()
    t = time.perf_counter()
    jit(*args)
    Device["CPU"].synchronize()
    best = min(best, time.perf_counter() - t)
  return best


def time_kernel(src: str, name: str, arrays: list[np.ndarray], reps: int, tmp: Path, cold: tuple[int, ...] = ()) -> float:
  """Best time of a direct call. The arrays at indices `cold` are copied until the copies exceed the last-level
  cache, and each call reads the next copy, so weights come from memory as in a real decode step."""
  so = tmp / f"{name}_{len(list(tmp.iterdir()))}.so"   # a fresh path: dlopen returns a cached handle for a reused one
  subprocess.run(["clang", "-O2", "-march=native", "-ffreestanding", "-fno-math-errno", "-nostdlib", "-shared", "-fPIC",
                  "-x", "c", "-", "-o", str(so)], input=src.encode(), check=True)
  fn = getattr(ctypes.CDLL(str(so)), name)
  n_copies = max(1, -(-COLD_BYTES // max(1, sum(arrays[i].nbytes for i in cold)))) if cold else 1
  sets = [[a.copy() if i in cold else a for i, a in enumerate(arrays)] for _ in range(n_copies)]
  ptrs = [[a.ctypes.data_as(ctypes.c_void_p) for a in arrs] for arrs in sets]
  best = float("inf")
  for rep in range(max(reps, 2 * n_copies)):
    t = time.perf_counter()
    fn(*ptrs[rep % n_copies])
    best = min(best, time.perf_counter() - t)
  return best


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--group-size", type=int, default=64, choices=int4.GROUP_SIZES)
  ap.add_argument("--m", default="1,8")
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--no-portable", action="store_true", help="skip tinygrad's fused int4 kernel (slow on the LM head)")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  G, rng, rows = args.group_size, np.random.default_rng(0), []
  one_thread = np.zeros(2, np.uint64)   # the kernels' thread-pool buffer for a direct, single-threaded call
  with tempfile.TemporaryDirectory() as d:
    tmp = Path(d)
    for label, N, K in SHAPES:
      w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
      p, s, b = int4.quantize(w, G)
      tw, tp, ts, tb = [Tensor(a).realize() for a in (w, p, s, b)]
      q_bytes, f_bytes = p.nbytes + s.nbytes + b.nbytes, w.nbytes
      for M in map(int, args.m.split(",")):
        x = rng.standard_normal((M, K)).astype(np.float32)
        tx, y = Tensor(x).realize(), np.zeros((M, N), np.float32)
        r = {"shape": label, "N": N, "K": K, "M": M, "group_size": G, "int4_bytes": q_bytes, "fp32_bytes": f_bytes}
        r["fp32_jit_s"] = time_jit(lambda x: cpu.linear_f32(x, tw), [tx], args.reps)
        r["int4_jit_s"] = time_jit(lambda x: cpu.int4_linear(x, tp, ts, tb, G), [tx], args.reps)
        r["fp32_kernel_s"] = time_kernel(cpu._linear_f32_source("f", M, N, K, False), "f", [y, x, w, one_thread], args.reps, tmp, cold=(2,))
        name, src = cpu.int4_linear_kernel(M, N, K, G)
        r["int4_kernel_s"] = time_kernel(src, name, [y, x, p, s.view(np.uint16), b.view(np.uint16), one_thread], args.reps, tmp,
                                       cold=(2, 3, 4))
        if not args.no_portable:
          r["portable_jit_s"] = time_jit(lambda x: portable.int4_linear(x, tp, ts, tb, G), [tx], max(3, args.reps // 5))
        rows.append(r)
        print(f"{label:26s} M={M}: fp32 {r['fp32_kernel_s'] * 1e3:.3f} ms, int4 {r['int4_kernel_s'] * 1e3:.3f} ms (kernel)", file=sys.stderr, flush=True)
  gbs = lambda n, t: n / t / 1e9
  print(f"\nINT4 linear on the CPU device, group size {G}; ms and GB/s of weight bytes read, best of {args.reps}\n")
  print("| shape | N x K | M | fp32 C kernel | int4 C kernel | int4/fp32 time | fp32 C jit | int4 C jit | int4 tinygrad jit |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    port = f"{r['portable_jit_s'] * 1e3:.3f} ms, {gbs(r['int4_bytes'], r['portable_jit_s']):.2f} GB/s" if "portable_jit_s" in r else "-"
    print(f"| {r['shape']} | {r['N']}x{r['K']} | {r['M']} "
          f"| {r['fp32_kernel_s'] * 1e3:.3f} ms, {gbs(r['fp32_bytes'], r['fp32_kernel_s']):.1f} GB/s "
          f"| {r['int4_kernel_s'] * 1e3:.3f} ms, {gbs(r['int4_bytes'], r['int4_kernel_s']):.1f} GB/s "
          f"| {r['int4_kernel_s'] / r['fp32_kernel_s']:.2f} "
          f"| {r['fp32_jit_s'] * 1e3:.3f} ms | {r['int4_jit_s'] * 1e3:.3f} ms, {gbs(r['int4_bytes'], r['int4_jit_s']):.1f} GB/s | {port} |")
  if args.json: args.json.write_text(json.dumps({"group_size": G, "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
