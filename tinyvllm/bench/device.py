"""The device's ceilings: measured memory bandwidth and matmul rate, and the published bandwidth of an Apple chip or
an NVIDIA GPU.

Bandwidth is what tinygrad itself achieves on a large read+write kernel (`y = x + 1`, bytes read plus written),
best of several runs at sizes well beyond the caches. On the CPU device tinygrad runs each kernel on one
thread, so that is one core's bandwidth; numpy's copy on every core is reported beside it for reference.
"""
from __future__ import annotations
import json, os, platform, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
import numpy as np

# Published unified-memory bandwidth of Apple silicon in GB/s (decimal), from Apple's newsroom announcements and
# tech-spec pages. Keys are `sysctl -n machdep.cpu.brand_string` minus "Apple "; where bins of one chip differ, the
# CPU core count (`hw.ncpu`) selects the value. `unsure` marks figures taken from press coverage of the announcement
# and not checked against Apple's own spec page.
APPLE_CHIPS: dict[str, dict] = {
  "M1":       {"gbps": 68.25, "source": "Apple M1 tech specs (LPDDR4X-4266, 128-bit)"},
  "M1 Pro":   {"gbps": 200, "source": "Apple newsroom, Oct 2021"},
  "M1 Max":   {"gbps": 400, "source": "Apple newsroom, Oct 2021"},
  "M1 Ultra": {"gbps": 800, "source": "Apple newsroom, Mar 2022"},
  "M2":       {"gbps": 100, "source": "Apple newsroom, Jun 2022"},
  "M2 Pro":   {"gbps": 200, "source": "Apple newsroom, Jan 2023"},
  "M2 Max":   {"gbps": 400, "source": "Apple newsroom, Jan 2023"},
  "M2 Ultra": {"gbps": 800, "source": "Apple newsroom, Jun 2023"},
  "M3":       {"gbps": 100, "source": "Apple MacBook Pro (M3) tech specs, Oct 2023"},
  "M3 Pro":   {"gbps": 150, "source": "Apple MacBook Pro (M3 Pro) tech specs, Oct 2023"},
  "M3 Max":   {"gbps": {14: 300, 16: 400}, "source": "Apple MacBook Pro tech specs, Oct 2023 (14-core CPU 300, 16-core 400)"},
  "M3 Ultra": {"gbps": 819, "source": "Apple newsroom, Mar 2025 (Mac Studio)"},
  "M4":       {"gbps": 120, "source": "Apple newsroom, May 2024"},
  "M4 Pro":   {"gbps": 273, "source": "Apple newsroom, Oct 2024"},
  "M4 Max":   {"gbps": {14: 410, 16: 546}, "source": "Apple newsroom and tech specs, Oct 2024 (14-core CPU 410, 16-core 546)"},
  "M5":       {"gbps": 153, "source": "Apple newsroom, Oct 2025"},
  "M5 Pro":   {"gbps": 307, "source": "press coverage of Apple's Mar 2026 announcement", "unsure": True},
  "M5 Max":   {"gbps": 614, "source": "press coverage of Apple's Mar 2026 announcement ('up to'; lower bins may be less)",
               "unsure": True},
}
# No M4 Ultra or M5 Ultra had been announced when this table was written.

# Published memory bandwidth of common NVIDIA GPUs in GB/s (decimal), from NVIDIA's data sheets and product pages.
# Matched against `nvidia-smi --query-gpu=name` by pattern, first match wins (so the specific forms come first).
NVIDIA_GPUS: list[tuple[str, float, str]] = [
  (r"B200", 8000, "NVIDIA DGX B200 data sheet (8 TB/s per GPU)"),
  (r"GH200.*144", 4900, "NVIDIA GH200 data sheet (144 GB HBM3e)"),
  (r"GH200", 4000, "NVIDIA GH200 data sheet (HBM3, 96 GB)"),
  (r"H200", 4800, "NVIDIA H200 data sheet"),
  (r"H100.*NVL", 3900, "NVIDIA H100 data sheet (H100 NVL)"),
  (r"H100.*PCIe", 2000, "NVIDIA H100 data sheet (H100 PCIe)"),
  (r"H100", 3350, "NVIDIA H100 data sheet (H100 SXM, 80 GB HBM3)"),
  (r"H800.*PCIe", 2000, "NVIDIA H800 PCIe product page"),
  (r"H800", 3350, "NVIDIA H800 SXM product page"),
  (r"A100.*80\s*GB.*PCIe|A100.*PCIe.*80", 1935, "NVIDIA A100 data sheet (80 GB PCIe)"),
  (r"A100.*80", 2039, "NVIDIA A100 data sheet (80 GB SXM)"),
  (r"A100", 1555, "NVIDIA A100 data sheet (40 GB)"),
  (r"L40S|L40\b", 864, "NVIDIA L40/L40S data sheet"),
  (r"\bL4\b", 300, "NVIDIA L4 data sheet"),
  (r"A10G?\b", 600, "NVIDIA A10 data sheet"),
  (r"\bT4\b", 320, "NVIDIA T4 data sheet"),
  (r"V100", 900, "NVIDIA V100 data sheet"),
  (r"RTX 5090", 1792, "NVIDIA GeForce RTX 5090 specifications"),
  (r"RTX 4090", 1008, "NVIDIA GeForce RTX 4090 specifications"),
  (r"RTX 4080", 717, "NVIDIA GeForce RTX 4080 specifications"),
  (r"RTX 3090 Ti", 1008, "NVIDIA GeForce RTX 3090 Ti specifications"),
  (r"RTX 3090", 936, "NVIDIA GeForce RTX 3090 specifications"),
  (r"RTX 6000 Ada", 960, "NVIDIA RTX 6000 Ada data sheet"),
  (r"RTX A6000", 768, "NVIDIA RTX A6000 data sheet"),
]

BANDWIDTH_SIZES_MIB = (64, 256, 1024)


@dataclass
class Ceilings:
  device: str
  chip: str | None = None                      # e.g. "Apple M2 Pro" or "NVIDIA H100 80GB HBM3"; None on other machines
  published_gbps: float | None = None
  published_source: str | None = None
  published_unsure: bool = False
  bandwidth_gbps: float = 0.0                  # tinygrad read+write kernel, best size and run
  bandwidth_by_size: dict[int, float] = field(default_factory=dict)
  numpy_copy_gbps: float | None = None         # numpy copy on every core (read + write), reference only
  threaded_bandwidth_gbps: float | None = None # CPU device: the same kernel in our C, split over the engine's threads
  threads: int = 1
  numpy_threads: int = 0
  matmul_gflops: float = 0.0                   # compute ceiling: the best of the two below
  matmul_dtype: str = "float32"
  tinygrad_matmul_gflops: float = 0.0
  engine_linear_gflops: float = 0.0            # the engine's own linear kernel on this device
  torch_copy_gbps: float | None = None         # an NVIDIA GPU: torch's device-to-device copy (read + write), same GPU
  torch_matmul_gflops: float | None = None     # and torch's matmul (cuBLAS) in matmul_dtype; both count in the ceilings

  def as_dict(self) -> dict: return dict(vars(self))


def apple_chip() -> tuple[str | None, int]:
  """(brand string, logical CPU count) on macOS, (None, 0) elsewhere."""
  if sys.platform != "darwin": return None, 0
  try:
    brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5).stdout.strip()
    ncpu = int(subprocess.run(["sysctl", "-n", "hw.ncpu"], capture_output=True, text=True, timeout=5).stdout.strip() or 0)
  except (OSError, ValueError, subprocess.SubprocessError):
    return None, 0
  return brand or None, ncpu


def nvidia_gpu() -> str | None:
  """The first NVIDIA GPU's name as nvidia-smi reports it (e.g. "NVIDIA H100 80GB HBM3"), or None."""
  try:
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError): return None
  return r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None


def published_nvidia_bandwidth(name: str | None) -> tuple[float | None, str | None]:
  """(GB/s, source) of an NVIDIA GPU by its nvidia-smi name; Nones for one not in NVIDIA_GPUS."""
  import re
  for pattern, gbps, source in NVIDIA_GPUS if name else ():
    if re.search(pattern, name): return float(gbps), source
  return None, None


def published_bandwidth(brand: str | None, ncpu: int = 0) -> tuple[float | None, str | None, bool]:
  """(GB/s, source, unsure) for an Apple brand string such as "Apple M3 Max"; Nones for an unknown chip."""
  if not brand: return None, None, False
  entry = APPLE_CHIPS.get(brand.removeprefix("Apple ").strip())
  if entry is None: return None, None, False
  gbps = entry["gbps"]
  if isinstance(gbps, dict):   # bins: pick by CPU core count, the highest bin when the count is unknown
    gbps = gbps.get(ncpu, max(gbps.values()))
  return float(gbps), entry["source"], bool(entry.get("unsure"))


def _best_time(fn, sync, reps: int, per_sync: int = 1) -> float:
  """The best of `reps` timings of `fn`, each over `per_sync` calls between two waits for the device, per call: a GPU
  takes calls asynchronously, and one call a wait would time the wait and the launch with it (on an H200, tinygrad's
  y = x + 1 over 64 MiB timed 0.2 ms where its bytes need 0.03)."""
  best = float("inf")
  for _ in range(reps):
    sync()
    t = time.perf_counter()
    for _ in range(per_sync): fn()
    sync()
    best = min(best, (time.perf_counter() - t) / per_sync)
  return best


def _calls_per_wait(device: str) -> int: return 1 if device.split(":")[0] == "CPU" else 20


def _add_one_bandwidth(add_one, sizes_mib, reps: int) -> dict[int, float]:
  """GB/s (read + written) of `add_one(x)` (y = x + 1) on float32 buffers of each size, best of `reps` replays."""
  from tinygrad import Device, Tensor, TinyJit
  dev = Device.DEFAULT
  out = {}
  for mib in sizes_mib:
    n = (mib << 20) // 4
    x = Tensor.ones(n, device=dev).contiguous().realize()
    jit = TinyJit(lambda x: add_one(x).realize())
    for _ in range(2): jit(x)     # run, then capture
    out[mib] = 2 * n * 4 / _best_time(lambda: jit(x), Device[dev].synchronize, reps, _calls_per_wait(dev)) / 1e9
    del x, jit
  return out


def tinygrad_bandwidth(sizes_mib=BANDWIDTH_SIZES_MIB, reps: int = 5) -> dict[int, float]:
  """GB/s of tinygrad's own `y = x + 1` kernel on buffers of each size."""
  return _add_one_bandwidth(lambda x: x + 1, sizes_mib, reps)


def threaded_bandwidth(sizes_mib=BANDWIDTH_SIZES_MIB, reps: int = 5, threads: int | None = None) -> tuple[float, int]:
  """CPU device: GB/s of `y = x + 1` as a C kernel split over the engine's thread pool (kernels/threads.py), the best
  size: tinygrad runs its own kernel on one core, while the engine's kernels use them all."""
  from tinygrad import Tensor, dtypes
  from tinyvllm.kernels import cpu
  from tinyvllm.kernels.threads import ThreadPool, default_threads

  def add_one(x: Tensor) -> Tensor:
    n, name = x.shape[0], f"add_one_{x.shape[0]}"
    src = cpu.row_parallel_kernel(name, ["float *restrict y", "const float *restrict x"], n,
                                  "for (long i = nb; i < ne; i++) y[i] = x[i] + 1.0f;", cpu.C_PARALLEL_DECLS, cpu.C_PARALLEL)
    return cpu.run_kernel((name, src), Tensor.invalids(n, dtype=dtypes.float32), x, pool.buffer)

  pool = ThreadPool(threads or default_threads())
  try: return max(_add_one_bandwidth(add_one, sizes_mib, reps).values()), pool.threads
  finally: pool.close()


def numpy_copy_bandwidth(mib: int = 1024, reps: int = 5, threads: int | None = None) -> tuple[float, int]:
  """GB/s (read + written) of numpy copies of `mib` MiB split across `threads` threads (numpy releases the GIL)."""
  threads = threads or os.cpu_count() or 1
  n = (mib << 20) // 4
  src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
  edges = np.linspace(0, n, threads + 1).astype(int)
  parts = [(dst[a:b], src[a:b]) for a, b in zip(edges[:-1], edges[1:])]
  with ThreadPoolExecutor(threads) as pool:
    run = lambda: list(pool.map(lambda p: np.copyto(*p), parts))
    run()
    t = _best_time(run, lambda: None, reps)
  return 2 * n * 4 / t / 1e9, threads


def matmul_rates(n: int = 1024, reps: int = 5, threads: int | None = None, dtype: str = "float32") -> tuple[float, float]:
  """GFLOP/s of an n x n x n matmul in tinygrad, and of the engine's linear kernel (y = x @ W^T) with the same sizes
  (on the CPU device that is our C kernel, elsewhere tinygrad's matmul), in `dtype`."""
  from tinygrad import Device, Tensor, TinyJit, dtypes
  from tinyvllm.kernels import make_kernels
  from tinyvllm.quant.formats import FLOAT, LinearWeights
  dev = Device.DEFAULT
  sync = Device[dev].synchronize
  dt = getattr(dtypes, dtype)
  a, b = Tensor.rand(n, n, device=dev).cast(dt).realize(), Tensor.rand(n, n, device=dev).cast(dt).realize()
  rates = []
  kernels = make_kernels("portable", dev, num_threads=threads)
  for fn in (lambda a, b: (a @ b).realize(), lambda a, b: kernels.linear(a, LinearWeights(FLOAT, b)).realize()):
    jit = TinyJit(fn)
    for _ in range(2): jit(a, b)
    rates.append(2 * n ** 3 / _best_time(lambda: jit(a, b), sync, reps, _calls_per_wait(dev)) / 1e9)
  return rates[0], rates[1]


def torch_cuda_ceilings(mib: int = 1024, n: int = 8192, reps: int = 5, dtype: str = "float16") -> tuple[float, float] | None:
  """On an NVIDIA GPU with torch: GB/s (read + written) of torch's device-to-device copy of `mib` MiB and GFLOP/s of
  its n x n x n matmul (cuBLAS), timed as tinygrad's ceilings are (`_best_time`: the best of `reps` timings of 20
  calls between two waits); None without torch or CUDA. The roofline's ceilings are the fastest bytes and FLOPs measured on the chip, by anyone: on the H200
  tinygrad's own y = x + 1 reached about 1700 GB/s where torch's copy moved about 4100.

  Measured in a process of its own: with torch's CUDA context and cuBLAS handle made in the bench's process before
  the engine took the GPU's free memory for its KV cache, the torch.compile peer later failed in cuBLAS
  (CUBLAS_STATUS_INTERNAL_ERROR, H200)."""
  code = ("import json, sys; from tinyvllm.bench.device import _torch_cuda_ceilings_here as f; "
          f"print(json.dumps(f({mib}, {n}, {reps}, {dtype!r})))")
  try:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None
  except (OSError, subprocess.TimeoutExpired, ValueError): return None
  return tuple(out) if out else None


def _torch_cuda_ceilings_here(mib: int, n: int, reps: int, dtype: str) -> tuple[float, float] | None:
  try:
    import torch
    if not torch.cuda.is_available(): return None
  except Exception: return None
  best = lambda fn: _best_time(fn, torch.cuda.synchronize, reps, _calls_per_wait("CUDA"))   # as tinygrad's are timed
  src = torch.rand((mib << 20) // 4, device="cuda")
  dst = torch.empty_like(src)
  gbps = 2 * src.numel() * 4 / best(lambda: dst.copy_(src)) / 1e9
  dt = getattr(torch, dtype)
  a, b = torch.randn(n, n, device="cuda", dtype=dt), torch.randn(n, n, device="cuda", dtype=dt)   # random: zeros run faster
  return gbps, 2 * n ** 3 / best(lambda: a @ b) / 1e9


def runs_nothing(device: str) -> bool:
  """tinygrad's NULL device (`DEV=NULL:CUDA:sm_90`: the H100's lowering) compiles and launches every kernel into nothing
  and copies back zeros (with NULL_ALLOW_COPYOUT=1): a run there times the host's work alone."""
  return device.split(":")[0] == "NULL"


def measure(sizes_mib=BANDWIDTH_SIZES_MIB, reps: int = 5, matmul_n: int | None = None, numpy_mib: int | None = None,
            threads: int | None = None) -> Ceilings:
  """The device's ceilings; `threads`: the engine's CPU threads (default every core). The matmul is float32 at n=1024
  on the CPU, float16 (the dtype models run in there) at n=4096 on a GPU, where n=1024 would measure launch time."""
  from tinygrad import Device
  brand, ncpu = apple_chip()
  gbps, source, unsure = published_bandwidth(brand, ncpu)
  if brand is None and Device.DEFAULT.split(":")[0] in ("CUDA", "NV"):
    brand = nvidia_gpu()
    gbps, source = published_nvidia_bandwidth(brand)
  c = Ceilings(device=Device.DEFAULT, chip=brand, published_gbps=gbps, published_source=source, published_unsure=unsure)
  if runs_nothing(c.device): return Ceilings(device=c.device)   # nothing to measure: no roofline
  c.bandwidth_by_size = tinygrad_bandwidth(sizes_mib, reps)
  c.bandwidth_gbps = max(c.bandwidth_by_size.values())
  if c.device.split(":")[0] == "CPU":   # the engine's kernels use every core: so must its ceiling
    c.threaded_bandwidth_gbps, c.threads = threaded_bandwidth(sizes_mib, reps, threads)
    c.bandwidth_gbps = max(c.bandwidth_gbps, c.threaded_bandwidth_gbps)
  c.numpy_copy_gbps, c.numpy_threads = numpy_copy_bandwidth(numpy_mib or max(sizes_mib), reps)
  cpu = c.device.split(":")[0] == "CPU"
  c.matmul_dtype = "float32" if cpu else "float16"
  c.tinygrad_matmul_gflops, c.engine_linear_gflops = matmul_rates(matmul_n or (1024 if cpu else 4096), reps, threads, c.matmul_dtype)
  c.matmul_gflops = max(c.tinygrad_matmul_gflops, c.engine_linear_gflops)
  if c.device.split(":")[0] in ("CUDA", "NV") and (ref := torch_cuda_ceilings(max(sizes_mib), reps=reps, dtype=c.matmul_dtype)):
    c.torch_copy_gbps, c.torch_matmul_gflops = ref
    c.bandwidth_gbps, c.matmul_gflops = max(c.bandwidth_gbps, ref[0]), max(c.matmul_gflops, ref[1])
  return c


def machine_description() -> str:
  brand, _ = apple_chip()
  host = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
  if brand is None and (gpu := nvidia_gpu()): return f"{gpu} ({host})"
  return brand or host
