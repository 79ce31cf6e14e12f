"""The CPU's packed-linear kernels timed directly, for each GGUF block type and shape, every build this CPU runs.

  python bench/packed_gemv.py [--types Q4_K,Q6_K] [--shapes 2048x2048,16384x2048,2048x8192] [--rows 1,8]
                              [--threads 2] [--rounds 7] [--json out.json]

Each kernel source (kernels/cpu.py `packed_linear_kernel`) is compiled by clang for this CPU (`-march=native`) and,
where the CPU has AVX-512 VBMI, once more without it (`-mno-avx512vbmi`: the k-quants' generic AVX-512 path, what a
CPU without VBMI runs), then called through ctypes on random valid blocks (tests/test_blocks.py), the builds taking
turns round by round, so their ratio compares measurements taken a second apart on this shared machine. With one row
(a decode GEMV) the weights are copied until they exceed 64 MiB and the calls cycle through the copies: read from
memory, as a model's layers are. Reported: weight GB/s (bytes of the packed arrays over the time), GMAC/s, and each
build over the first.
"""
from __future__ import annotations
import argparse, ctypes, hashlib, json, os, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def cpu_flags() -> set[str]:
  try: return set(Path("/proc/cpuinfo").read_text().split())
  except OSError: return set()


def build(src: str, flags: list[str], cache: Path) -> ctypes.CDLL:
  key = hashlib.sha256((src + " ".join(flags)).encode()).hexdigest()[:16]
  so = cache / f"k_{key}.so"
  if not so.exists():
    subprocess.run(["clang", "-O2", *flags, "-fPIC", "-shared", "-ffreestanding", "-nostdlib", "-x", "c", "-", "-o", str(so)],
                   input=src.encode(), check=True)
  return ctypes.CDLL(str(so))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--types", default="Q4_K,Q6_K")
  ap.add_argument("--shapes", default="2048x2048,16384x2048,2048x8192", help="NxK (output rows x inputs), comma-separated")
  ap.add_argument("--rows", default="1,8", help="rows of x (1: a decode GEMV; more: the GEMM)")
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  from test_blocks import random_ggml
  from tinyvllm.kernels import cpu
  from tinyvllm.kernels.threads import ThreadPool
  from tinyvllm.quant import blocks
  builds = {"native": ["-march=native"]}
  if "avx512vbmi" in cpu_flags(): builds["no VBMI"] = ["-march=native", "-mno-avx512vbmi"]
  pool = ThreadPool(args.threads)
  pbuf = pool.buffer.numpy().astype(np.uint64)
  rng = np.random.default_rng(0)
  cache = Path(tempfile.mkdtemp(prefix="tinyvllm-packed-gemv-"))
  cases = [(t, *map(int, s.split("x")), int(m)) for t in args.types.split(",") for s in args.shapes.split(",") for m in args.rows.split(",")]
  rows = []
  for qtype, N, K, M in tqdm(cases, desc="kernels", file=sys.stderr):
    parts, spec = blocks.from_ggml(random_ggml(qtype, N, K, rng), qtype, (N, K))
    arrays = [np.ascontiguousarray(parts[p]) for p in ("weight", "scales", "scale_d", "biases") if parts.get(p) is not None]
    nbytes = sum(a.nbytes for a in arrays)
    copies = [arrays] + [[a.copy() for a in arrays] for _ in range(-(-(64 << 20) // nbytes) - 1 if M == 1 else 0)]
    name, src = cpu.packed_linear_kernel(M, N, K, spec)
    fns = {}
    for b, flags in builds.items():
      fn = getattr(build(src, flags, cache), name)
      fn.argtypes = [ctypes.c_void_p] * (3 + len(arrays))
      fns[b] = fn
    x = rng.standard_normal((M, K)).astype(np.float32)
    y = np.zeros((M, N), np.float32)
    calls = [[y.ctypes.data, x.ctypes.data, *[a.ctypes.data for a in c], pbuf.ctypes.data] for c in copies]
    reps = max(1, int(0.2 / max(1e-6, nbytes / 30e9 + M * N * K / 100e9)) // len(calls))
    times = {b: [] for b in builds}
    for _ in range(args.rounds):
      for b, fn in fns.items():
        for c in calls: fn(*c)
        t = time.perf_counter()
        for _ in range(reps):
          for c in calls: fn(*c)
        times[b].append((time.perf_counter() - t) / (reps * len(calls)))
    first = np.array(times["native"])
    for b, ts in times.items():
      ts = np.array(ts)
      rows.append({"type": qtype, "N": N, "K": K, "M": M, "build": b, "threads": args.threads, "ms": float(np.median(ts) * 1e3),
                   "weight_gbps": float(nbytes / np.median(ts) / 1e9), "gmacs": float(M * N * K / np.median(ts) / 1e9),
                   "vs_native": float(np.median(first / ts)), "from_memory": M == 1})
  print(f"{'type':6} {'N x K':>12} {'M':>3} {'build':>8} {'ms':>8} {'GB/s':>7} {'GMAC/s':>7} {'speed vs native':>15}")
  for r in rows:
    print(f"{r['type']:6} {r['N']:>5} x {r['K']:<5} {r['M']:>3} {r['build']:>8} {r['ms']:8.3f} {r['weight_gbps']:7.1f} {r['gmacs']:7.1f} {r['vs_native']:15.3f}")
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
