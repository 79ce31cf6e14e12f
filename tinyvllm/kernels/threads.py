"""Every core for the C kernels on tinygrad's CPU device: a pool of worker threads (threadpool.c) they split work over.

tinygrad runs each kernel on one thread, so on its own the engine uses one core. Our kernels (the fused decoder
layer, the linears, the LM head) split their rows and attention heads into parts and call the pool through
`tv_parallel`, whose C is in `C_PARALLEL_DECLS` / `C_PARALLEL`. A kernel finds the pool in a small uint64 buffer passed like any other
argument: [address of tv_pool_run, pool handle], or [0, 0] for one thread (the kernel then runs its parts
inline). Addresses travel in data, not in the kernel's source, so tinygrad's on-disk cache of compiled kernels
keeps working across processes. Parts split rows on fixed boundaries and each row is computed the same way
whatever part it falls in, so results are bitwise the same for any number of threads.
"""
from __future__ import annotations
import ctypes, hashlib, os, platform, subprocess, sys, weakref
from pathlib import Path
import numpy as np
from tinygrad import Context, Tensor, dtypes

HERE = Path(__file__).resolve().parent

# C shared by every kernel that splits its work: the pool call, and a contiguous share of `units` (or of rows, in
# runs of 4) for one part.
# Declarations go before the kernel, definitions after it (tinygrad calls the start of a kernel's code).
C_PARALLEL_DECLS = r"""
typedef void (*tv_task)(void *ctx, int part, int nparts);
static inline void tv_parallel(const unsigned long long *pool, tv_task fn, void *ctx);
static inline void tv_share(int units, int part, int nparts, int *begin, int *end);
static inline void tv_share_rows(int rows, int part, int nparts, int *begin, int *end);
"""
C_PARALLEL = r"""
static inline void tv_parallel(const unsigned long long *pool, tv_task fn, void *ctx) {
  if (pool[0]) ((void (*)(unsigned long long, tv_task, void *))pool[0])(pool[1], fn, ctx);
  else fn(ctx, 0, 1);
}
static inline void tv_share(int units, int part, int nparts, int *begin, int *end) {
  *begin = (int)((long)units * part / nparts);
  *end = (int)((long)units * (part + 1) / nparts);
}
/* rows [begin, end) of `rows` for one part, in runs of 4: each 4-row tile is computed whole by one thread */
static inline void tv_share_rows(int rows, int part, int nparts, int *begin, int *end) {
  tv_share((rows + 3) / 4, part, nparts, begin, end);
  *begin *= 4;
  *end = *end * 4 < rows ? *end * 4 : rows;
}
"""


def _library() -> ctypes.CDLL:
  """threadpool.c built once per content (clang, as tinygrad's CPU device needs anyway) into the tinyvllm cache."""
  src = (HERE / "threadpool.c").read_text()
  root = Path(os.environ.get("TINYVLLM_CACHE") or Path.home() / ".cache" / "tinyvllm") / "threads"
  root.mkdir(parents=True, exist_ok=True)
  key = hashlib.sha256((src + platform.machine() + os.environ.get("CC", "clang")).encode()).hexdigest()[:16]
  out = root / f"libtvpool-{key}{'.dylib' if sys.platform == 'darwin' else '.so'}"
  if not out.exists():
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [os.environ.get("CC", "clang"), "-O2", "-shared", "-fPIC", "-pthread", str(HERE / "threadpool.c"), "-o", str(tmp)]
    try: r = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError: raise RuntimeError(f"building the CPU thread pool needs clang ({cmd[0]} not found)") from None
    if r.returncode != 0: raise RuntimeError(f"building the CPU thread pool failed:\n{r.stderr.strip()}")
    os.replace(tmp, out)
  lib = ctypes.CDLL(str(out))
  lib.tv_pool_create.argtypes, lib.tv_pool_create.restype = [ctypes.c_int], ctypes.c_void_p
  lib.tv_pool_size.argtypes, lib.tv_pool_size.restype = [ctypes.c_void_p], ctypes.c_int
  lib.tv_pool_destroy.argtypes, lib.tv_pool_destroy.restype = [ctypes.c_void_p], None
  lib.tv_pool_stats.argtypes, lib.tv_pool_stats.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_longlong)], None
  return lib


def default_threads() -> int:
  """Every core this process may use."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ThreadPool:
  """`threads` threads for one engine's kernels (the caller's included); one thread needs no library at all."""
  def __init__(self, threads: int, device: str = "CPU"):
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
      raise ValueError(f"num_threads must be a positive integer, got {threads!r}")
    self.lib, self.handle = (None, None) if threads == 1 else (lib := _library(), lib.tv_pool_create(threads) or None)
    self.threads = 1 if self.handle is None else self.lib.tv_pool_size(self.handle)
    # stop the workers when the pool is collected, in the process that made it (a forked child's copy has none)
    self._finalizer = weakref.finalize(self, _destroy, self.lib, self.handle, os.getpid()) if self.handle else None
    if self._finalizer: self._finalizer.atexit = False   # at exit the OS ends the threads; a join could wait on a kernel
    entry = ctypes.cast(self.lib.tv_pool_run, ctypes.c_void_p).value if self.handle else 0
    # the buffer every parallel kernel takes; realized now, outside any TinyJit capture, and kept for the pool's life
    with Context(CAPTURING=0):
      self.buffer = Tensor(np.array([entry, self.handle or 0], np.uint64), dtype=dtypes.uint64, device=device).realize()

  def stats(self) -> tuple[int, float]:
    """(parallel regions run, seconds the calling thread waited at their ends for the workers) since the pool was
    made: the pool's synchronization cost, read by the benchmark between steps. (0, 0.0) on one thread."""
    if not self.handle or not self._finalizer.alive: return 0, 0.0
    out = (ctypes.c_longlong * 2)()
    self.lib.tv_pool_stats(self.handle, out)
    return int(out[0]), out[1] / 1e9

  def close(self) -> None:
    """Stop the workers. Queued kernels finish first; kernels that run later with this pool's buffer run on one
    thread (same results)."""
    if self._finalizer is None or not self._finalizer.alive: return
    from tinygrad import Device
    buf = self.buffer.uop.buffer.ensure_allocated()
    Device[buf.device].synchronize()
    Device[buf.device].allocator._copyin(buf._buf, memoryview(np.zeros(2, np.uint64)).cast("B"))
    self._finalizer()


def _destroy(lib, handle, pid: int) -> None:
  if os.getpid() == pid: lib.tv_pool_destroy(handle)
