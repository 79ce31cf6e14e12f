"""Host side of tinyvllm's Metal kernels: one launch description per kernel, run on real Metal or on the emulator.

A `Launch` names the .metal file, the kernel (its host name), the buffer order, the packed params struct and
the grid. ONE function per kernel computes it from shapes and dtypes (`rope_launch`, `decode_launches`,
`prefill_launch`, `int4_launch`); both backends consume the same description:

  * `MetalBackend`: `Tensor.custom_kernel` with a PROGRAM built from the MSL source and the library from
    `Device["METAL"].compiler`; the grid travels as `gidx*`/`lidx*` specials (threadgroups, threads).
  * `EmulatorBackend`: the same `.metal` file compiled by `tinyvllm.kernels.emulator`; a tiny C trampoline,
    compiled for tinygrad's CPU device, calls the emulator at an address baked into its source with the
    buffer addresses and a launch descriptor, so the kernel is an ordinary tinygrad kernel (TinyJit captures it).

Shape constants travel in a small int32 params buffer (created once per shape), never as runtime integer
scalars, so no bound Variables are needed under TinyJit; dynamic data (lengths, positions, tables) are buffers.

The paged KV cache travels as a `PagedKVCache` (tinyvllm.kernels.kv_cache): float32/float16 K and V, or int8 codes
with a float16 scale per (slot, KV head). An int8 cache selects the `_i8` instantiations, whose buffer lists carry
`k_scale` and `v_scale` right after the caches; the kernels dequantize as they read (see docs/kernels.md).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinygrad import Context, Device, Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.uop.ops import KernelInfo, Ops

from tinyvllm.kernels.kv_cache import PagedKVCache
from tinyvllm.kernels.portable import rms_norm

DTYPE_NAMES = {dtypes.float32: "f32", dtypes.float16: "f16", dtypes.int8: "i8"}   # int8: KV caches only
ACTIVATION_DTYPES = (dtypes.float32, dtypes.float16)
HEAD_DIMS = (64, 80, 96, 128)
BLOCK_SIZES = (8, 16, 32)
GROUP_SIZES = (32, 64, 128)
PARTITION_SIZE = 512          # keys per partition of the partitioned decode kernel
PARTITION_THRESHOLD = 1024    # partition when the block table can hold more keys than this
GEMV_MAX_M = 8


@dataclass(frozen=True)
class Launch:
  """One kernel launch: `grid` threadgroups of `threads` threads; buffers in [[buffer(n)]] order, then params."""
  source: str                    # file in tinyvllm.shaders
  kernel: str                    # host name of the instantiation
  buffers: tuple[str, ...]       # names of the tensor arguments, in order (the params buffer comes last)
  params: tuple[int, ...]        # the params struct as int32 words (floats bit-cast)
  grid: tuple[int, int, int]
  threads: tuple[int, int, int]


def _f32_bits(x: float) -> int: return int(np.array(x, np.float32).view(np.int32))


def _dt(d: DType) -> str:
  """Name of an activation dtype (q, x, outputs): float32 or float16."""
  if d not in ACTIVATION_DTYPES: raise ValueError(f"unsupported dtype {d}: kernels take float32 or float16")
  return DTYPE_NAMES[d]


def _cache_dt(d: DType) -> str:
  """Name of a KV-cache dtype: float32, float16, or int8 (codes with a float16 scale per slot and KV head)."""
  if d not in DTYPE_NAMES: raise ValueError(f"unsupported KV cache dtype {d}: the caches hold float32, float16 or int8")
  return DTYPE_NAMES[d]


def _cache_buffers(cache_dtype: DType) -> tuple[str, ...]:
  """The cache's buffers in a kernel's list: the scales follow the caches for an int8 cache."""
  return ("k_cache", "v_cache") + (("k_scale", "v_scale") if cache_dtype == dtypes.int8 else ())


def _check_head_dim(d: int):
  if d not in HEAD_DIMS: raise ValueError(f"head_dim {d} not supported (have {HEAD_DIMS})")


# ---------------------------------------------------------------------------------------------- launch descriptions

def rope_launch(num_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, x_dtype: DType, cache_dtype: DType) -> Launch:
  if head_dim % 8: raise ValueError(f"head_dim {head_dim} must be a multiple of 8")
  if cache_dtype == dtypes.int8 and head_dim > 256: raise ValueError(f"head_dim {head_dim}: an int8 cache needs D / 8 <= 32 lanes")
  # 64 threads: the int8 kernel quantizes one head vector per SIMD-group, so the count stays a multiple of 32
  return Launch("rope.metal", f"rope_cache_write_{_dt(x_dtype)}_{_cache_dt(cache_dtype)}",
                ("qkv", "positions", "cos_sin", "slot_mapping", "q_out") + _cache_buffers(cache_dtype),
                (num_tokens, n_heads, n_kv_heads, head_dim), (num_tokens, 1, 1), (64, 1, 1))


def _paged_params(num_seqs, n_heads, n_kv_heads, head_dim, block_size, max_blocks, partition_size, num_partitions, scale, window,
                  softcap):
  return (num_seqs, n_heads, n_kv_heads, head_dim, block_size, max_blocks, partition_size, num_partitions, _f32_bits(scale),
          window or 0, _f32_bits(softcap or 0.0))


def decode_launches(num_seqs: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                    q_dtype: DType, cache_dtype: DType, scale: float, partition_size: int | None = None,
                    window: int | None = None, softcap: float | None = None) -> list[Launch]:
  """One launch, or two (partitioned + reduce) when the table can hold more than PARTITION_THRESHOLD keys.

  The grid depends on shapes only (TinyJit captures it); the work follows context_lens at run time: partitions
  past a sequence's context exit at once, and the reduce copies a sequence that used a single partition.
  partition_size: None = choose from max_blocks * block_size; 0 = never partition; n = partitions of n keys.
  window: a sliding window (the latest `window` keys only; partitions wholly before it exit at once); softcap: scores
  soft-capped (Gemma 2).
  Kernels are instantiated for GMAX in (2, 4, 8) query heads per KV head: the smallest >= the GQA ratio.
  """
  _check_head_dim(head_dim)
  if n_heads % n_kv_heads or n_heads // n_kv_heads > 8: raise ValueError(f"GQA ratio {n_heads}/{n_kv_heads} unsupported (<= 8)")
  if block_size < 1 or block_size & (block_size - 1): raise ValueError(f"block_size {block_size} must be a power of two")
  max_keys = max_blocks * block_size
  if partition_size is None: partition_size = PARTITION_SIZE if max_keys > PARTITION_THRESHOLD else 0
  x, c = _dt(q_dtype), _cache_dt(cache_dtype)
  gmax = next(g for g in (2, 4, 8) if g >= n_heads // n_kv_heads)
  common = ("q",) + _cache_buffers(cache_dtype) + ("block_tables", "context_lens")
  if not partition_size:
    return [Launch("paged_attention.metal", f"paged_attention_decode_{x}_{c}_{head_dim}_g{gmax}", common + ("out",),
                   _paged_params(num_seqs, n_heads, n_kv_heads, head_dim, block_size, max_blocks, 0, 1, scale, window, softcap),
                   (1, n_kv_heads, num_seqs), (256, 1, 1))]
  nparts = math.ceil(max_keys / partition_size)
  params = _paged_params(num_seqs, n_heads, n_kv_heads, head_dim, block_size, max_blocks, partition_size, nparts, scale, window, softcap)
  return [Launch("paged_attention.metal", f"paged_attention_decode_partitioned_{x}_{c}_{head_dim}_g{gmax}",
                 common + ("tmp_out", "exp_sums", "max_logits"), params, (nparts, n_kv_heads, num_seqs), (256, 1, 1)),
          Launch("paged_attention.metal", f"paged_attention_reduce_{x}", ("tmp_out", "exp_sums", "max_logits", "context_lens", "out"),
                 params, (n_heads, num_seqs, 1), (32, 1, 1))]


def prefill_launch(num_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                   q_dtype: DType, cache_dtype: DType, scale: float, window: int | None = None, softcap: float | None = None) -> Launch:
  _check_head_dim(head_dim)
  g = n_heads // n_kv_heads
  if n_heads % n_kv_heads or g > 16: raise ValueError(f"GQA ratio {n_heads}/{n_kv_heads} unsupported (<= 16)")
  tq = max(1, 32 // g)  # tokens per threadgroup: tq * g <= 32 query rows, 8 per SIMD-group (simdgroup_matrix tiles)
  return Launch("paged_prefill.metal", f"paged_attention_prefill_{_dt(q_dtype)}_{_cache_dt(cache_dtype)}_{head_dim}",
                ("q",) + _cache_buffers(cache_dtype) + ("block_tables", "token_seq", "token_pos", "out"),
                (num_tokens, n_heads, n_kv_heads, block_size, max_blocks, tq, _f32_bits(scale), window or 0, _f32_bits(softcap or 0.0)),
                (math.ceil(num_tokens / tq), n_kv_heads, 1), (128, 1, 1))


GATES = {"silu": "glu", "gelu_pytorch_tanh": "geglu"}   # a gated GEMV's activation -> its kernel's name


def int4_launch(m: int, n: int, k: int, group_size: int, x_dtype: DType, norm_eps: float | None = None,
                residual: bool = False, gate: str | None = None, rope: tuple[int, int, int, DType] | None = None) -> Launch:
  """`norm_eps`: the GEMV of RMSNorm(x) * norm_weight with this epsilon (int4_gemv_rms); `residual`: the GEMV plus a
  residual [M, N] (int4_gemv_res); `gate` (a GATES activation, with `norm_eps`): the normed GEMV of a fused gate/up
  weight of 2 n rows, gated, n outputs (int4_gemv_glu, int4_gemv_geglu); `rope` (n_heads, n_kv_heads, head_dim, the
  cache's dtype; with `norm_eps`): the normed GEMV of a fused qkv weight of 2 n rows, rotated and written into q and
  a float cache, n rotation pairs (int4_gemv_rope). All M <= GEMV_MAX_M only; a residual not with the others."""
  if group_size not in GROUP_SIZES or k % group_size: raise ValueError(f"group_size {group_size} must be in {GROUP_SIZES} and divide K={k}")
  if norm_eps is not None and residual: raise ValueError("the GEMV norms x or adds a residual, not both")
  if gate is not None and (gate not in GATES or norm_eps is None or m > GEMV_MAX_M or rope is not None):
    raise ValueError(f"a gated GEMV takes {sorted(GATES)}, a norm and at most {GEMV_MAX_M} rows: got {gate!r}, {m} rows")
  if rope is not None and (norm_eps is None or m > GEMV_MAX_M or rope[2] % 8 or 2 * n != (rope[0] + 2 * rope[1]) * rope[2]
                           or rope[3] == dtypes.int8):
    raise ValueError(f"a GEMV with RoPE norms x, takes at most {GEMV_MAX_M} rows, a head_dim that 8 divides, the qkv rows of "
                     f"its heads and a float cache: got {m} rows, {2 * n} weight rows, heads {rope[:3]}, cache {rope[3]}")
  bufs = ("x", "w_packed", "scales", "biases", "y")
  heads = (0, 0, 0) if rope is None else rope[:3]   # Int4Params' n_heads, n_kv_heads, head_dim
  if m > GEMV_MAX_M:
    if norm_eps is not None or residual: raise ValueError(f"the normed and residual GEMVs take at most {GEMV_MAX_M} rows, got {m}")
    return Launch("int4_matmul.metal", f"int4_gemm_{_dt(x_dtype)}", bufs, (m, n, k, group_size, 32, 0, *heads),
                  (math.ceil(n / 32), math.ceil(m / 32), 1), (128, 1, 1))
  # a lane takes 16 codes of 4 rows per step; teams of `lanes` lanes share 4 rows: the width that leaves the fewest
  # lane-steps idle for K/16 chunks per row wins, ties to the widest (K=576: 8 lanes, 90% busy; 2048: 32, 100%)
  lanes = min((32, 16, 8), key=lambda t: t * math.ceil(k // 16 / t))
  outputs = 2 if gate or rope else 4   # a team's 4 weight rows: 4 outputs, or 2 (their gate and up rows; rotation pairs)
  grid = (math.ceil(n / (2 * (32 // lanes) * outputs)), 1, 1)   # per threadgroup: 2 SIMD-groups of 32/lanes teams
  params = (m, n, k, group_size, lanes, 0 if norm_eps is None else _f32_bits(norm_eps), *heads)
  normed = ("x", "norm_weight") + bufs[1:4]
  if rope is not None:
    return Launch("int4_matmul.metal", f"int4_gemv_rope_{_dt(x_dtype)}_{_cache_dt(rope[3])}",
                  normed + ("positions", "cos_sin", "slot_mapping", "q_out", "k_cache", "v_cache"), params, grid, (64, 1, 1))
  if gate is not None: return Launch("int4_matmul.metal", f"int4_gemv_{GATES[gate]}_{_dt(x_dtype)}", normed + ("y",), params, grid, (64, 1, 1))
  if residual: return Launch("int4_matmul.metal", f"int4_gemv_res_{_dt(x_dtype)}", bufs[:4] + ("residual", "y"), params, grid, (64, 1, 1))
  if norm_eps is None: return Launch("int4_matmul.metal", f"int4_gemv_{_dt(x_dtype)}", bufs, params, grid, (64, 1, 1))
  return Launch("int4_matmul.metal", f"int4_gemv_rms_{_dt(x_dtype)}", normed + ("y",), params, grid, (64, 1, 1))


# ---------------------------------------------------------------------------------------------- backends

def shader_source(name: str) -> str:
  """A shipped shader by file name, or any .metal file by absolute path (tests keep deliberately broken kernels)."""
  if os.path.isabs(name): return Path(name).read_text()
  return importlib.resources.files("tinyvllm.shaders").joinpath(name).read_text()


def _program(name: str, src: str, lib: bytes, args: list[UOp], specials: list[UOp]) -> UOp:
  sink = UOp.sink(*args, *specials, arg=KernelInfo(name=name))
  return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=(*sink.src, sink)), UOp(Ops.SOURCE, arg=src), UOp(Ops.BINARY, arg=lib)))


class _Backend:
  def __init__(self): self._params: dict[tuple, Tensor] = {}

  def params_tensor(self, launch: Launch, device: str) -> Tensor:
    """The launch's params buffer, created once per (params, device). Realized outside any TinyJit capture: inside one,
    its host->device copy would be recorded in the graph and replayed on every call, and on Metal each replayed copy
    waits for the GPU to finish (about 150 waits per token on a 30-layer model)."""
    key = (launch.params, device)
    if key not in self._params:
      with Context(CAPTURING=0): self._params[key] = Tensor(np.array(launch.params, np.int32), device=device).realize()
    return self._params[key]

  def run(self, launch: Launch, *tensors: Tensor) -> list[Tensor]:
    """Launch over `tensors` (in launch.buffers order); returns every tensor as it is after the kernel."""
    assert len(tensors) == len(launch.buffers), f"{launch.kernel}: expected {launch.buffers}"
    dev = tensors[0].device
    if not all(isinstance(t.device, str) and t.device.split(":")[0] == self.device for t in tensors):
      raise ValueError(f"{type(self).__name__} runs on {self.device} tensors, got {[t.device for t in tensors]}")
    p = self.params_tensor(launch, dev)
    fxn = self.program_fxn(launch, [t.nbytes() for t in tensors] + [p.nbytes()])
    return Tensor.custom_kernel(*tensors, p, fxn=fxn)[:-1]


class MetalBackend(_Backend):
  """Runs the .metal kernels on Apple GPUs (DEV=METAL); each source is compiled once per process."""
  device = "METAL"

  @functools.cache
  def library(self, source: str) -> tuple[str, bytes]:
    src = shader_source(source)
    return src, Device["METAL"].compiler.compile_cached(src)

  def program_fxn(self, launch: Launch, sizes: list[int]):
    src, lib = self.library(launch.source)
    specials = [UOp.special(g, f"gidx{i}") for i, g in enumerate(launch.grid)] + \
               [UOp.special(t, f"lidx{i}") for i, t in enumerate(launch.threads)]
    return lambda *args: _program(launch.kernel, src, lib, list(args), specials)


class EmulatorBackend(_Backend):
  """Runs the same .metal kernels on tinygrad's CPU device through the emulator.

  order: "forward" | "reverse" | "random" (threads of a threadgroup; exposes races); seed: for "random";
  guard: copy buffers into guarded pages so out-of-bounds accesses are reported; os_threads: OS threads
  running threadgroups. Kernel errors (divergent barrier, out-of-bounds access) cannot raise inside
  tinygrad's worker thread: they are printed, kept, and raised by `check()`, which every public function
  calls before launching anything.
  """

  device = "CPU"

  def __init__(self, order: str = "forward", seed: int = 0, guard: bool = True, os_threads: int = 1):
    super().__init__()
    from tinyvllm.kernels import emulator
    self.em, self.order, self.seed, self.guard, self.os_threads = emulator, order, seed, guard, os_threads
    self._descs: dict[tuple, tuple] = {}

  @functools.cache
  def library(self, source: str):
    return self.em.compile_source(shader_source(source), os.path.basename(source))

  def check(self):
    if (err := self.em.take_error()) is not None: raise self.em.EmulatorError(err)

  def program_fxn(self, launch: Launch, sizes: list[int]):
    from tinyvllm.kernels.emulator.harness import make_desc
    key = (launch, tuple(sizes))
    if key not in self._descs:
      lib = self.library(launch.source)
      desc = make_desc(lib.kernel_addr(launch.kernel), launch.grid, launch.threads, sizes, order=self.order, seed=self.seed,
                       os_threads=self.os_threads, guard=self.guard)
      entry = ctypes.cast(self.em.runtime().tv_launch_deferred, ctypes.c_void_p).value
      name = "tv_" + hashlib.sha256(repr(key).encode()).hexdigest()[:12]
      n = len(sizes)
      # freestanding C for tinygrad's CPU device: must be the first function; every argument is a 64-bit address
      src = (f"void {name}({', '.join(f'unsigned long long a{i}' for i in range(n))}) {{\n"
             f"  void* b[{n}] = {{{', '.join(f'(void*)a{i}' for i in range(n))}}};\n"
             f"  ((void (*)(const void*, void* const*)){entry:#x}ULL)((const void*){ctypes.addressof(desc):#x}ULL, b);\n}}\n")
      self._descs[key] = (desc, name, src, Device["CPU"].compiler.compile_cached(src))
    _, name, src, binary = self._descs[key]
    return lambda *args: _program(name, src, binary, list(args), [])


_default_backends: dict[str, _Backend] = {}


def get_backend(backend: str | _Backend) -> _Backend:
  """A per-process backend for "metal" or "emulator" (compiled programs cached there); a backend object passes through."""
  if isinstance(backend, _Backend): return backend
  if backend not in ("metal", "emulator"): raise ValueError(f"backend must be 'metal' or 'emulator', got {backend!r}")
  if backend not in _default_backends: _default_backends[backend] = MetalBackend() if backend == "metal" else EmulatorBackend()
  return _default_backends[backend]


def _prepare(backend) -> _Backend:
  b = get_backend(backend)
  if isinstance(b, EmulatorBackend): b.check()
  return b


def _int32(t: Tensor) -> Tensor: return (t if t.dtype == dtypes.int32 else t.cast(dtypes.int32)).contiguous()


def _check_cache(cache: PagedKVCache) -> DType:
  """The cache's storage dtype, after checking that its tensors agree: K and V of one shape and dtype; an int8 cache
  with float16 scales `[num_blocks, block_size, n_kv_heads]`, a float cache without scales."""
  if not isinstance(cache, PagedKVCache): raise TypeError(f"the KV cache must be a PagedKVCache, got {type(cache).__name__}")
  k, v = cache.k, cache.v
  if k.shape != v.shape or k.dtype != v.dtype or len(k.shape) != 4:
    raise ValueError(f"k and v caches must be [num_blocks, block_size, n_kv_heads, head_dim] of one dtype, got "
                     f"{k.shape} {k.dtype} and {v.shape} {v.dtype}")
  if (k.dtype == dtypes.int8) != cache.quantized or (cache.v_scale is None) != (cache.k_scale is None):
    raise ValueError(f"an int8 cache needs k_scale and v_scale, a {k.dtype} cache none")
  if cache.quantized:
    for name, sc in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
      if sc.dtype != dtypes.float16 or sc.shape != k.shape[:3]:
        raise ValueError(f"{name} must be float16 {k.shape[:3]}, got {sc.dtype} {sc.shape}")
  return k.dtype


# ---------------------------------------------------------------------------------------------- public functions

def paged_attention_decode(q: Tensor, cache: PagedKVCache, block_tables: Tensor, context_lens: Tensor, scale: float,
                           *, backend: str | _Backend, partition_size: int | None = None, window: int | None = None,
                           softcap: float | None = None, flat: bool = False) -> Tensor:
  """Decode attention: one query token per sequence against its paged K/V.

  Args:
    q: [num_seqs, n_heads, head_dim] float32/float16.
    cache: the layer's PagedKVCache: k, v [num_blocks, block_size, n_kv_heads, head_dim] float32/float16, or int8
      codes with k_scale, v_scale float16 [num_blocks, block_size, n_kv_heads] (dequantized inside the kernel).
    block_tables: int32 [num_seqs, max_blocks]; context_lens: int32 [num_seqs] (0 -> zeros).
    scale: softmax scale. partition_size, window, softcap: see `decode_launches`.
    flat: return the output as the kernel wrote it, [num_seqs, n_heads * head_dim] (what an o projection reads;
      reshaped back by the caller, tinygrad would copy it before another shader could read it).
  Returns: [num_seqs, n_heads, head_dim] in q's dtype (flat: [num_seqs, n_heads * head_dim]).
  """
  b = _prepare(backend)
  cache_dtype = _check_cache(cache)
  (B, H, D), (_, bs, KVH, _) = q.shape, cache.k.shape
  launches = decode_launches(B, H, KVH, D, bs, block_tables.shape[1], q.dtype, cache_dtype, scale, partition_size, window, softcap)
  q, bt, cl = q.contiguous(), _int32(block_tables), _int32(context_lens)
  ins = [q, *cache.tensors(), bt, cl]
  out = Tensor.empty(B, H * D, dtype=q.dtype, device=q.device)
  shaped = lambda o: o if flat else o.reshape(B, H, D)
  if len(launches) == 1: return shaped(b.run(launches[0], *ins, out)[len(ins)])
  nparts = launches[0].grid[0]
  tmp = Tensor.empty(B, H, nparts, D, dtype=dtypes.float32, device=q.device)
  sums, maxes = (Tensor.empty(B, H, nparts, dtype=dtypes.float32, device=q.device) for _ in range(2))
  tmp, sums, maxes = b.run(launches[0], *ins, tmp, sums, maxes)[len(ins):]
  return shaped(b.run(launches[1], tmp, sums, maxes, cl, out)[4])


def paged_attention_prefill(q: Tensor, cache: PagedKVCache, block_tables: Tensor, token_seq: Tensor, token_pos: Tensor,
                            scale: float, *, backend: str | _Backend, window: int | None = None, softcap: float | None = None,
                            flat: bool = False) -> Tensor:
  """Prefill attention for a chunk of tokens whose K/V are already in the cache.

  Args:
    q: [T, n_heads, head_dim]; cache: the layer's PagedKVCache (float or int8, as in `paged_attention_decode`);
    token_seq: int32 [T] (row of block_tables, -1 = padding -> zeros);
    token_pos: int32 [T] absolute positions: token t attends to keys 0..token_pos[t] of its sequence (with a `window`,
      those above token_pos[t] - window); softcap: scores soft-capped (Gemma 2); flat: as in `paged_attention_decode`.
  Returns: [T, n_heads, head_dim] in q's dtype (flat: [T, n_heads * head_dim]).
  """
  b = _prepare(backend)
  cache_dtype = _check_cache(cache)
  (T, H, D), (_, bs, KVH, _) = q.shape, cache.k.shape
  launch = prefill_launch(T, H, KVH, D, bs, block_tables.shape[1], q.dtype, cache_dtype, scale, window, softcap)
  ins = [q.contiguous(), *cache.tensors(), _int32(block_tables), _int32(token_seq), _int32(token_pos)]
  out = b.run(launch, *ins, Tensor.empty(T, H * D, dtype=q.dtype, device=q.device))[len(ins)]
  return out if flat else out.reshape(T, H, D)


def rope_and_cache_write(qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache,
                         slot_mapping: Tensor, *, backend: str | _Backend) -> tuple[Tensor, PagedKVCache]:
  """Rotary embedding on q and k, and k/v written into the cache at slot_mapping (-1 = skip), in one kernel that reads
  the fused q/k/v projection's output in place (slicing it into three inputs would cost three copy kernels).

  Args:
    qkv: [T, (n_heads + 2 n_kv_heads) D]: each token's query heads, then its key heads, then its value heads;
      positions: int32 [T]; cos_sin: float32 [max_positions, D]; cache: the layer's PagedKVCache of realized buffers,
      written in place (D is its head_dim). For an int8 cache each rotated k head and each v head is quantized (codes
      and one float16 scale per slot and KV head, tinyvllm/kernels/kv_cache.py).
  Returns: (q_rot [T, n_heads, D], the cache ordered after the write): keep reading the cache through the returned one.
  """
  b = _prepare(backend)
  cache_dtype = _check_cache(cache)
  T, D = qkv.shape[0], cache.head_dim
  if qkv.ndim != 2 or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * D:
    raise ValueError(f"qkv {qkv.shape} is not [T, (n_heads + 2 n_kv_heads) * head_dim] for {n_heads}, {n_kv_heads} heads of {D}")
  launch = rope_launch(T, n_heads, n_kv_heads, D, qkv.dtype, cache_dtype)
  q_out = Tensor.empty(T, n_heads, D, dtype=qkv.dtype, device=qkv.device)
  res = b.run(launch, qkv.contiguous(), _int32(positions), cos_sin.cast(dtypes.float32).contiguous(), _int32(slot_mapping), q_out,
              *cache.tensors())
  return res[4], cache.written(*res[5:])


def int4_qkv_rope(x: Tensor, w_packed: Tensor, scales: Tensor, biases: Tensor, group_size: int, norm: tuple[Tensor, float],
                  n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache, slot_mapping: Tensor, *,
                  backend: str | _Backend) -> tuple[Tensor, PagedKVCache]:
  """The qkv projection of RMSNorm(x) * norm[0] (W [(n_heads + 2 n_kv_heads) D, K] in 4-bit groups) with RoPE and the
  cache write done as the GEMV writes it (int4_gemv_rope): `int4_matmul` then `rope_and_cache_write` in one launch.
  x: [M, K], M <= GEMV_MAX_M; the cache float (an int8 cache's scales are the RoPE shader's to write). Returns
  (q rotated [M, n_heads, D] in x's dtype, the cache ordered after the write)."""
  b = _prepare(backend)
  cache_dtype = _check_cache(cache)
  (M, K), D = x.shape, cache.head_dim
  norm_weight, weights = _int4_weights(x, w_packed, scales, biases, norm)
  launch = int4_launch(M, w_packed.shape[0] // 2, K, group_size, x.dtype, norm[1], rope=(n_heads, n_kv_heads, D, cache_dtype))
  q_out = Tensor.empty(M, n_heads, D, dtype=x.dtype, device=x.device)
  res = b.run(launch, x.contiguous(), norm_weight, *weights, _int32(positions), cos_sin.cast(dtypes.float32).contiguous(), _int32(slot_mapping),
              q_out, *cache.tensors())
  return res[8], cache.written(*res[9:])


def _int4_weights(x: Tensor, w_packed: Tensor, scales: Tensor, biases: Tensor, norm: tuple[Tensor, float] | None) -> tuple[Tensor | None, list[Tensor]]:
  """The INT4 kernels' weight inputs, checked against x `[M, K]`: the norm's weight in x's dtype (None without a norm),
  and the packed codes, scales and biases (float16) in the kernels' order."""
  K = x.shape[1]
  if w_packed.shape[1] * 8 != K: raise ValueError(f"w_packed {w_packed.shape} does not match K={K}")
  if norm is not None and tuple(norm[0].shape) != (K,): raise ValueError(f"norm weight {norm[0].shape} does not match K={K}")
  return (None if norm is None else norm[0].cast(x.dtype).contiguous(),
          [w_packed.contiguous(), scales.cast(dtypes.float16).contiguous(), biases.cast(dtypes.float16).contiguous()])


def int4_matmul(x: Tensor, w_packed: Tensor, scales: Tensor, biases: Tensor, group_size: int, *, backend: str | _Backend,
                norm: tuple[Tensor, float] | None = None, residual: Tensor | None = None, out: Tensor | None = None,
                gate: str | None = None) -> Tensor:
  """y = x @ W^T with W [N, K] stored as 4-bit affine groups (see docs/kernels.md).

  Args:
    x: [M, K] float32/float16; w_packed: uint32 [N, K/8] (lowest k in the lowest nibble);
    scales, biases: float16 [N, K/group_size]; w = scale * q + bias.
    norm: (weight [K], eps): y = RMSNorm(x) * weight @ W^T, the norm computed inside the GEMV (M <= 8; a larger M is
      normed first by tinygrad, as portable.rms_norm does).
    residual: [M, N] in x's dtype: y = residual + x @ W^T, added as the GEMV writes y (M <= 8; a larger M adds it
      after the GEMM, in tinygrad). Not with norm.
    out: a realized [M, N] tensor in x's dtype for the kernel to write y into (no copy after it).
    gate: "silu" or "gelu_pytorch_tanh", with norm: W is the fused gate/up projection [2 I, K] and y = act(gate) * up
      [M, I], gated as the GEMV writes it (M <= 8).
  Returns: [M, N] in x's dtype. M <= 8 uses the GEMV kernel, larger M the tiled GEMM.
  """
  b = _prepare(backend)
  M, K = x.shape
  N = w_packed.shape[0]
  norm_weight, weights = _int4_weights(x, w_packed, scales, biases, norm)
  if gate is not None and (norm is None or N % 2 or M > GEMV_MAX_M or residual is not None):
    raise ValueError(f"a gated GEMV norms x, takes a fused gate/up weight of an even row count and at most {GEMV_MAX_M} rows, "
                     f"and no residual: got {N} rows of W, {M} of x")
  if gate is not None: N //= 2   # y's columns: the outputs, each of a gate row and an up row
  if out is not None and (tuple(out.shape) != (M, N) or out.dtype != x.dtype):
    raise ValueError(f"out {out.shape} {out.dtype} does not match y [{M}, {N}] {x.dtype}")
  if residual is not None:
    if norm is not None: raise ValueError("int4_matmul takes norm or residual, not both")
    if tuple(residual.shape) != (M, N): raise ValueError(f"residual {residual.shape} does not match y [{M}, {N}]")
    if M > GEMV_MAX_M:
      y = residual + int4_matmul(x, w_packed, scales, biases, group_size, backend=b)
      return y if out is None else out.assign(y)
  if norm is not None and M > GEMV_MAX_M: x, norm = rms_norm(x, norm[0], norm[1]), None
  launch = int4_launch(M, N, K, group_size, x.dtype, None if norm is None else norm[1], residual is not None, gate)
  if norm is not None: weights.insert(0, norm_weight)
  if residual is not None: weights.append(residual.cast(x.dtype).contiguous())
  y = Tensor.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
  return b.run(launch, x.contiguous(), *weights, y)[-1]
