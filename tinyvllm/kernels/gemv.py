"""Decode-step projections on a GPU, each one tinygrad custom kernel: x `[T, K]` (a few rows) times a weight `[N, K]`
stored as floats, INT4 groups or INT8, with the RMSNorm before it, the SwiGLU after it or the residual sum after it
inside the same kernel.

Why not tinygrad's matmul: its GPU heuristic has a matrix-vector schedule (a reduction split over 8 threads an output,
4 outputs a thread) that it takes only when the reduction multiplies two plain loads. A float16 weight is cast to
float32 for the sum, a code is dequantized and a normed x is computed, so none of a decode step's projections got it:
lowered for the H100, the 1B model's float16 qkv projection at batch 1 ran on 32 blocks of 32 threads, each thread
looping over 3 weight rows alone (uncoalesced: a warp's loads 12 KB apart). Here the opts are ours (`kernel_opts`):

  UNROLL  16 bytes of a weight row a thread (8 halves, 4 floats, 16 INT8 codes, 32 INT4 codes: one vector load)
  GROUP   32 threads a row, side by side: a warp reads 512 contiguous bytes of it each iteration
  LOCAL   4 rows a block (128 threads); UPCAST 2 rows a thread and every x row (the weight read once for all T)

The sums a projection needs run over the same input axis, so they share its loop: the dot product, x's sum of squares
for the norm (recomputed by every output's threads from x, which the cache holds: K multiply-adds beside the K the dot
costs, free in a kernel bound by the weight's bytes), and for gate/up the second dot. Launches a decode layer saves:
the norm's reduction before qkv and before gate/up (2), and the SwiGLU's kernel (1); the residual sums were fused by
tinygrad already; and with `qkv_rope_write` the qkv projection stores its heads where they go, q rotated, k rotated and
v in their cache slots (1: the write kernel). A quantized weight's norm keeps a small kernel of its own (`_projector`
says why). Everything is summed in float32 and rounded once, at the store.

Only for a few rows (`MAX_ROWS`): beyond them the weight is no longer the cost, and tinygrad's matmul (tensor cores)
is the right kernel. Not on the CPU device, where our C kernels serve (kernels/cpu.py)."""
from __future__ import annotations
import functools, math
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.uop.ops import AxisType, KernelInfo, Ops
from tinyvllm.kernels import portable
from tinyvllm.kernels.kv_cache import PagedKVCache
from tinyvllm.quant.formats import FLOAT, INT4, INT8, LinearWeights

# the stored parts of each format the kernel reads
PARTS = {FLOAT: ("weight",), INT4: ("weight", "scales", "biases"), INT8: ("weight", "scales")}
MAX_ROWS = 8          # x rows (decode sequences) a kernel takes; more go to tinygrad's matmul
THREADS_PER_ROW = 32  # a SIMD group (Apple) or warp (NVIDIA) shares a weight row
ROWS_PER_BLOCK = 4
ROWS_PER_THREAD = 2


def applies(x: Tensor, w: LinearWeights) -> bool:
  """At most MAX_ROWS rows of x on a GPU device, times a weight stored as floats, INT4 groups or INT8."""
  return (x.shape[0] <= MAX_ROWS and not portable.on_cpu(x.device) and x.ndim == 2 and w.format in PARTS
          and (w.format != FLOAT or dtypes.is_float(w.weight.dtype)))


def ranges_of(fmt: str, K: int, group: int) -> tuple[int, ...]:
  """The input axis as the ranges the weight's layout splits it into (input k = their mixed-radix number), so that no
  index divides: tinygrad splits a range that an index divides into ranges of its own, under the opts. Floats: k;
  INT8: the group of 32, the code in it; INT4: the group, its uint32 word, the code (nibble) in the word."""
  return (K,) if fmt == FLOAT else (K // 32, 32) if fmt == INT8 else (K // group, group // 8, 8)


def kernel_opts(device: str | tuple[str, ...], fmt: str, T: int, N: int, K: int, group: int = 0, itemsize: int = 2,
                paired: bool = False) -> tuple:
  """tinygrad's optimizations for a GEMV of T rows, weights stored as `fmt` (INT4's `group`, a float's `itemsize`): on
  a GPU the schedule in the module's docstring, shrunk where a size does not divide; on the CPU device none (its loops
  as written: only tests run it there). `paired`: the qkv projection with RoPE (`_qkv_rope_kernel`), whose outputs
  are N pairs of rows a head, after an axis of heads: a thread's two rows are its pair."""
  if portable.on_cpu(device): return ()
  if fmt == FLOAT:   # one reduction axis: a vector of it a thread, then the threads over the rest
    vector = next(v for v in (16 // itemsize, 4, 2, 1) if K % v == 0)
    opts, rest = ([Opt(OptOps.UNROLL, 0, vector)] if vector > 1 else []), K // vector
  else:   # INT8: 16 codes of a group of 32 a thread; INT4: a word's 8 codes and up to 4 words of its group (16 bytes)
    sizes = [size for size in (ranges_of(fmt, K, group)) if size > 1]   # tinygrad's axes drop ranges of size 1
    if fmt == INT8: opts = [Opt(OptOps.UNROLL, len(sizes) - 1, 16)]
    else:
      words = math.gcd(4, group // 8)
      opts = [Opt(OptOps.UNROLL, len(sizes) - 1, 8)] + ([Opt(OptOps.UNROLL, len(sizes) - 2, words)] if words > 1 else [])
    rest = K // (32 if fmt == INT8 else group)   # the groups, over the threads
  threads = next(g for g in (THREADS_PER_ROW, 16, 8, 4, 2, 1) if rest % g == 0)
  # rows a block: 4, or more where fewer threads share a row (a quantized K of few groups: 576 in groups of 64 is 9, one
  # thread a row), so that a block still holds a warp or more
  local = next(n for n in (128, 64, 32, 16, 8, 4, 2, 1) if n <= max(ROWS_PER_BLOCK, THREADS_PER_ROW // threads) and N % n == 0)
  per_thread = next(n for n in (1 if paired else ROWS_PER_THREAD, 1) if N % (local * n) == 0)
  # global axes: x's rows (absent when there is one: tinygrad drops axes of size 1), (the heads,) then the outputs
  outputs = int(T > 1) + int(paired)
  if threads > 1: opts.append(Opt(OptOps.GROUP, 0, threads))
  if local > 1: opts.append(Opt(OptOps.LOCAL, outputs, local))
  if per_thread > 1: opts.append(Opt(OptOps.UPCAST, outputs, per_thread))
  # every x row a thread up to MAX_ROWS (the weight read once); beyond (bench/gemv.py's larger rows), 8 a thread and
  # the rest a grid axis of their own, whose blocks re-read the weight from L2
  if T > 1 and (rows := T if T <= MAX_ROWS else math.gcd(T, MAX_ROWS)) > 1: opts.append(Opt(OptOps.UPCAST, 0, rows))
  return tuple(opts)


def _weight_reader(fmt: str, K: int, parts: list[UOp], ranges: tuple[UOp, ...]):
  """row -> its weight element at the reduction's input (`ranges`, `_projector`) in float32, from the stored parts
  (quant/formats.py): floats; INT8, a code times a scale per 32; INT4, 8 codes a uint32 (code i of a word in bits
  4i..4i+3) times a scale plus a bias per group."""
  if fmt == FLOAT:
    w, (k,) = parts[0].flatten(), ranges
    return lambda row: w[row * K + k].cast(dtypes.float32)
  if fmt == INT8:
    (codes, scales), (g, j) = (p.flatten() for p in parts), ranges
    return lambda row: codes[row * K + g * 32 + j].cast(dtypes.float32) * scales[row * (K // 32) + g].cast(dtypes.float32)
  (packed, scales, biases), (g, word, nibble) = (p.flatten() for p in parts), ranges
  words = word.vmax + 1
  groups = K // (words * 8)
  def int4(row):
    code = (packed[row * (K // 8) + g * words + word] >> (nibble * 4).cast(dtypes.uint32)) & 0xF
    at = row * groups + g
    return code.cast(dtypes.float32) * scales[at].cast(dtypes.float32) + biases[at].cast(dtypes.float32)
  return int4


def _projector(fmt: str, eps: float | None, has_bias: bool, x: UOp, t: UOp, rest: list[UOp], first_range: int):
  """row -> the projection of x's row t by weight row `row` in float32 (its norm and bias applied), from the kernel's
  inputs in `rest`, which it takes from the front: the weight's stored parts, then the norm's weight when `eps`, then
  x's rows' 1/RMS `[T, 1]` for a quantized weight, then the bias when `has_bias`. The reduction's ranges are numbered
  from `first_range` (after the kernel's output ranges).

  A float weight's kernel sums x's squares itself. A quantized weight's input axis is several ranges (`ranges_of`),
  and a sum over x alone would have them merged back into one by tinygrad (its index needs no division then): a
  second loop over the input, which the opts, written for the weight's ranges, would leave to one thread an output."""
  K = x.shape[1]
  parts = [rest.pop(0) for _ in range(len(PARTS[fmt]))]
  norm_w = rest.pop(0).flatten() if eps is not None else None
  row_scale = rest.pop(0).flatten() if eps is not None and fmt != FLOAT else None
  bias = rest.pop(0).flatten() if has_bias else None
  x = x.flatten()
  sizes = ranges_of(fmt, K, K // parts[1].shape[1] if fmt == INT4 else 0)
  ranges = tuple(UOp.range(size, first_range + i, AxisType.REDUCE) for i, size in enumerate(sizes))
  weight_at = _weight_reader(fmt, K, parts, ranges)
  k = functools.reduce(lambda acc, r: acc * (r.vmax + 1) + r, ranges[1:], ranges[0])   # the input these ranges name
  xk = x[t * K + k].cast(dtypes.float32)
  xin = xk * norm_w[k].cast(dtypes.float32) if norm_w is not None else xk
  if row_scale is not None: scale = row_scale[t]
  else: scale = ((xk * xk).reduce(*ranges, arg=Ops.ADD) * (1 / K) + eps).rsqrt() if eps is not None else None

  def project(row: UOp) -> UOp:
    y = (weight_at(row) * xin).reduce(*ranges, arg=Ops.ADD)
    if scale is not None: y = y * scale
    return y + bias[row].cast(dtypes.float32) if bias is not None else y
  return project


def _tags(fmt: str, eps: float | None) -> list[str]:
  return ([] if fmt == FLOAT else [fmt]) + (["norm"] if eps is not None else [])


def _gemv_kernel(opts: tuple, fmt: str, eps: float | None, act: str | None, inter: int, has_bias: bool, has_residual: bool,
                 out: UOp, x: UOp, *rest: UOp) -> UOp:
  """out[t, n] = the projection of x's row t by weight row n, in float32 (rest: the inputs `_projector` reads, then
  the residual `[T, N]` when `has_residual`). With `act`, out[t, n] = act(gate) * up of weight rows n and inter + n
  (the fused gate/up projection, `[2 inter, K]`)."""
  T, N = out.shape
  rest = list(rest)
  t, n = UOp.range(T, 0), UOp.range(N, 1)
  project = _projector(fmt, eps, has_bias, x, t, rest, 2)
  residual = rest.pop(0).flatten() if has_residual else None
  out = out.flatten()
  y = project(n)
  if act is not None: y = (y.silu() if act == "silu" else y.gelu()) * project(n + inter)
  if residual is not None: y = y + residual[t * N + n].cast(dtypes.float32)
  store = out[t * N + n].store(y.cast(out.dtype))
  tags = _tags(fmt, eps) + (["glu"] if act else []) + (["res"] if has_residual else [])
  name = "_".join(["gemv", *tags, str(T), str(N), str(x.shape[1])])
  return UOp.sink(store.end(t, n), arg=KernelInfo(name=name, opts_to_apply=opts))


def _qkv_rope_kernel(opts: tuple, fmt: str, eps: float | None, has_bias: bool, q_out: UOp, k_cache: UOp, v_cache: UOp, x: UOp,
                     *rest: UOp) -> UOp:
  """The qkv projection of x `[T, K]` (weight rows: H q heads, KVH k heads, KVH v heads of D) with RoPE and the cache
  write done at the store: q rotated into q_out `[T, H, D]`, k rotated and v into the caches `[NB, BS, KVH, D]` at
  each token's slot (slot -1, a padding token, writes no K/V: `portable.slot_in_range`). rest: the inputs `_projector`
  reads, then the positions `[T]`, the cos/sin table `[positions, D]` (kernels/paged.py's `rotated`) and the slots.

  HF's rotate-half RoPE mixes element i of a head with element i + D/2, so a thread computes that pair of weight rows
  (ranges: token, head, i < D/2) and stores both; v heads are stored as they are."""
  (T, H, D), (NB, BS, KVH, _) = q_out.shape, k_cache.shape
  half, rows_per_slot = D // 2, KVH * D
  rest = list(rest)
  t, h, i = UOp.range(T, 0), UOp.range(H + 2 * KVH, 1), UOp.range(half, 2)
  project = _projector(fmt, eps, has_bias, x, t, rest, 3)
  positions, cos_sin, slots = (u.flatten() for u in rest)
  q_out, k_cache, v_cache = q_out.flatten(), k_cache.flatten(), v_cache.flatten()
  first, second = project(h * D + i), project(h * D + half + i)
  pos, slot = positions[t], slots[t]
  cos, sin = cos_sin[pos * D + i].cast(dtypes.float32), cos_sin[pos * D + half + i].cast(dtypes.float32)
  rotated = (first * cos - second * sin, second * cos + first * sin)
  is_q, is_v = h < H, h >= H + KVH
  is_k = (h >= H) & (h < H + KVH)
  kv_h = is_k.where(h - H, is_v.where(h - H - KVH, 0))   # in range for every head: the stores it does not own are masked
  stores = []
  for offset, rot, raw in ((0, rotated[0], first), (half, rotated[1], second)):
    element = kv_h * D + i + offset
    slot_ok = portable.slot_in_range(slot, rows_per_slot, element, NB * BS)
    kv_at = slot * rows_per_slot + element
    stores += [q_out[((t * H + is_q.where(h, 0)) * D + i + offset).valid(is_q)].store(rot.cast(q_out.dtype)),
               k_cache[kv_at.valid(is_k & slot_ok)].store(rot.cast(k_cache.dtype)),
               v_cache[kv_at.valid(is_v & slot_ok)].store(raw.cast(v_cache.dtype))]
  name = "_".join(["gemv", *_tags(fmt, eps), "rope", str(T), str(H), str(KVH), str(D), str(x.shape[1])])
  return UOp.sink(UOp.group(*stores).end(t, h, i), arg=KernelInfo(name=name, opts_to_apply=opts))


def _projection_inputs(x: Tensor, w: LinearWeights, norm: tuple[Tensor, float] | None) -> list[Tensor]:
  """x and what `_projector` reads of a projection of x by w (normed first when `norm`), in its order."""
  inputs = [x.contiguous(), *(getattr(w, name) for name in PARTS[w.format])] + ([norm[0]] if norm is not None else [])
  if norm is not None and w.format != FLOAT: inputs.append(portable.inverse_rms(x, norm[1]).contiguous())
  return inputs + ([w.bias] if w.bias is not None else [])


def gemv(x: Tensor, w: LinearWeights, *, norm: tuple[Tensor, float] | None = None, act: str | None = None,
         residual: Tensor | None = None, out: Tensor | None = None, dtype=None) -> Tensor:
  """x `[T, K]` @ W^T (+ W's bias), W `[N, K]` stored as floats, INT4 groups or INT8 (`applies`), in one kernel:
    norm=(w, eps)   x RMS-normed (times w) first
    act             W is gate and up stacked (`[2 I, K]`): returns act(gate) * up, `[T, I]` (SwiGLU "silu", GeGLU
                    "gelu_pytorch_tanh")
    residual        `[T, N]` added to the product
    out             a realized `[T, N]` buffer to write (the layer's output)
    dtype           the output's, when not x's (the LM head's float32 logits: no cast kernel after it)"""
  T, K = x.shape
  assert w.in_features == K, (x.shape, w.in_features)
  assert act is None or residual is None, "a gated projection's output is not the residual stream's"
  N = w.weight.shape[0] // 2 if act is not None else w.weight.shape[0]
  y = Tensor.empty(T, N, dtype=dtype or x.dtype, device=x.device) if out is None else out
  opts = kernel_opts(x.device, w.format, T, N, K, w.group_size, w.weight.dtype.itemsize)
  inputs = _projection_inputs(x, w, norm) + ([residual.contiguous()] if residual is not None else [])
  fxn = functools.partial(_gemv_kernel, opts, w.format, norm[1] if norm is not None else None, act, N if act is not None else 0,
                          w.bias is not None, residual is not None)
  return Tensor.custom_kernel(y, *inputs, fxn=fxn)[0]


def qkv_rope_write(x: Tensor, w: LinearWeights, norm: tuple[Tensor, float], n_heads: int, n_kv_heads: int, positions: Tensor,
                   cos_sin: Tensor, cache: PagedKVCache, slot_mapping: Tensor, q_dtype=dtypes.float32) -> tuple[Tensor, PagedKVCache]:
  """The qkv projection of RMSNorm(x) (W `[(H + 2 KVH) D, K]`, any format `applies` takes), RoPE (HF's rotate-half,
  from the `[positions, D]` cos/sin table) and the write of k and v into their slots of a float cache, in one kernel:
  the decode step's projection stores its heads where they go. Returns (q rotated `[T, H, D]` as `q_dtype`: float32
  for kernels/paged.py, the model's for the attention shaders; the cache ordered after the write)."""
  T, K = x.shape
  D = cache.head_dim
  assert w.in_features == K and w.weight.shape[0] == (n_heads + 2 * n_kv_heads) * D and not cache.quantized, (x.shape, w.weight.shape)
  q = Tensor.empty(T, n_heads, D, dtype=q_dtype, device=x.device)
  opts = kernel_opts(x.device, w.format, T, D // 2, K, w.group_size, w.weight.dtype.itemsize, paired=True)
  fxn = functools.partial(_qkv_rope_kernel, opts, w.format, norm[1], w.bias is not None)
  q, k, v = Tensor.custom_kernel(q, cache.k, cache.v, *_projection_inputs(x, w, norm), positions.contiguous(), cos_sin.contiguous(),
                                 slot_mapping.contiguous(), fxn=fxn)[:3]
  return q, cache.written(k, v)
