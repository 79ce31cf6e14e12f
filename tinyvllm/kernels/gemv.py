"""Decode-step projections on a GPU, each one tinygrad custom kernel: x `[T, K]` (a few rows) times a weight `[N, K]`
stored as floats, INT4 groups, INT8 or a packed layout (GGUF's k-quants and their kin: `_packed_reader`), with the
RMSNorm before it, the SwiGLU after it or the residual sum after it inside the same kernel.

Why not tinygrad's matmul: its GPU heuristic has a matrix-vector schedule (a reduction split over 8 threads an output,
4 outputs a thread) that it takes only when the reduction multiplies two plain loads. A float16 weight is cast to
float32 for the sum, a code is dequantized and a normed x is computed, so none of a decode step's projections got it:
lowered for the H100, the 1B model's float16 qkv projection at batch 1 ran on 32 blocks of 32 threads, each thread
looping over 3 weight rows alone (uncoalesced: a warp's loads 12 KB apart). Here the opts are ours (`kernel_opts`):

  UNROLL  16 bytes of a float row a thread (8 halves, 4 floats: one vector load); a quantized row's word of 8 codes
          and up to 3 more a warp's width along (`_quantized_opts`: x's loads stay coalesced)
  GROUP   32 threads a row, side by side: a warp reads 512 contiguous bytes of it each iteration
  LOCAL   4 rows a block (128 threads); UPCAST 2 rows a thread and every x row (the weight read once for all T)

The sums a projection needs run over the same input axis, so they share its loop: the dot product, x's sum of squares
for the norm (recomputed by every output's threads from x, which the cache holds: K multiply-adds beside the K the dot
costs, free in a kernel bound by the weight's bytes), and for gate/up the second dot. Launches a decode layer saves:
the norm's reduction before qkv and before gate/up (2), and the SwiGLU's kernel (1); the residual sums were fused by
tinygrad already; and with `qkv_rope_write` the qkv projection stores its heads where they go, q rotated, k rotated and
v in their cache slots (1: the write kernel). A quantized weight's kernel reads x's squares at a permutation of its
inputs (`_squares_read` says why); 6-bit layouts still take x's 1/RMS from a small kernel before (`norms_inside`).
Everything is summed in float32 and rounded once, at the store.

Only for a few rows (`MAX_ROWS`, `max_rows`): beyond them the multiplies are the cost, and the tensor cores are the
right unit (kernels/gemm.py for float16 and bfloat16 weights, which `Kernels.takes_gemv` prefers from 16 rows, a
whole tile; else tinygrad's matmul). Not on the CPU device, where our C kernels serve (kernels/cpu.py)."""
from __future__ import annotations
import functools, math
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.uop.ops import AxisType, KernelInfo, Ops
from tinyvllm.kernels import portable
from tinyvllm.kernels.kv_cache import PagedKVCache
from tinyvllm.quant.blocks import stored_parts
from tinyvllm.quant.formats import CODEBOOK, FLOAT, INT4, INT8, PACKED, LinearWeights, QuantSpec

# the stored parts of each format the kernel reads (a packed layout's: `parts_of`)
PARTS = {FLOAT: ("weight",), INT4: ("weight", "scales", "biases"), INT8: ("weight", "scales")}
MAX_ROWS = 8          # x rows (decode sequences) a kernel takes; more go to tinygrad's matmul ...
NARROW_MAX_ROWS, NARROW_OUTPUTS, NARROW_BYTES = 32, 8192, 40 << 20   # ... up to 32 for a small float or INT4 weight
THREADS_PER_ROW = 32  # a SIMD group (Apple) or warp (NVIDIA) shares a weight row
ROWS_PER_BLOCK = 4
ROWS_PER_THREAD = 2
# A float batch-1 GEMV with fewer threads than this spreads: a long row (K >= LONG_ROW) over twice the threads, else one
# row a thread. Timed on an H200 (bench/gemv.py --schedules, 1B, device time): o (2048 x 2048) 21.6 -> 13.5 us at one
# row a thread, down (2048 x 8192) 29.1 -> 19.2 us at 64 threads a row; qkv (3072 outputs) alike either way; gate/up,
# the LM head and every 32-row case slower spread, and the 8B's shapes have threads enough. A GEMV reads its weight
# once: what hides the memory's latency is how many threads have loads in flight.
SPREAD_BELOW, LONG_ROW = 65536, 8192
WORDS_IN_FLIGHT = 4   # a quantized row's words a thread loads in an iteration, a warp's width apart (`_quantized_opts`)
X_ROWS_A_THREAD = 8   # x rows a thread sums at once (the H200's 32-row steps: 8 a thread, 4 blocks of rows, was fastest
                      # of those timed; more a thread, untimed, would read a large weight once: bench/gemv.py --schedules)


def layout_of(w: LinearWeights) -> str | QuantSpec:
  """What the kernel needs to know of how W is stored: its format, or a packed linear's QuantSpec."""
  return w.spec if w.format == PACKED else w.format


def parts_of(layout: str | QuantSpec) -> tuple[str, ...]:
  """The stored parts the kernel reads, in the order it takes them."""
  return tuple(p for p in stored_parts(layout) if p != "qspec") if isinstance(layout, QuantSpec) else PARTS[layout]


def max_rows(w: LinearWeights, T: int) -> int:
  """The most x rows our kernel takes for `w` in a step of T. Timed on an H200 (bench/gemv.py, 1B shapes, 32 rows,
  device time): the float16 qkv, o and down projections 59 / 33 / 72 us against tinygrad's matmul's 105 / 76 / 411,
  INT4 qkv and o 162 / 99 against 207 / 187; but gate/up's 16,384 outputs 192 us against 155 (INT4 417 against 293).
  Beyond 8 rows a thread takes X_ROWS_A_THREAD and the blocks of the rest re-read the weight: so only a weight of
  few outputs that the L2 holds (NARROW_BYTES; the 1B's down is 32 MiB, the H200's L2 60 MB), and only whole blocks
  of x rows (a verify pass's 10 rows would be 2 a thread, 5 blocks)."""
  narrow = (w.format in (FLOAT, INT4) and w.weight.shape[0] <= NARROW_OUTPUTS and T % X_ROWS_A_THREAD == 0
            and sum(t.nbytes() for t in w.tensors()) <= NARROW_BYTES)
  return NARROW_MAX_ROWS if narrow else MAX_ROWS


def applies(x: Tensor, w: LinearWeights) -> bool:
  """At most `max_rows` rows of x on a GPU device, times a weight stored as floats, INT4 groups, INT8 or a packed
  layout whose index bits `packed_cuts` can name."""
  return (x.ndim == 2 and x.shape[0] <= max_rows(w, x.shape[0]) and not portable.on_cpu(x.device)
          and (w.format in PARTS or (w.format == PACKED and packed_cuts(w.spec, x.shape[1]) is not None))
          and (w.format != FLOAT or dtypes.is_float(w.weight.dtype)))


def packed_cuts(spec: QuantSpec, K: int) -> tuple[int, ...] | None:
  """The bit positions at which a packed layout's indices cut input k (quant/blocks.py), lowest first: the nibble in
  its word (3); with high bits, a byte in its word (2), the run of 32 (5) and the block of R runs; the group and the
  super-block of groups; Q4_K's 6-bit scale fields (groups 0-3 or 4-7 of a super-block: 7). Only cuts an index needs:
  tinygrad merges two adjacent ranges that no index tells apart. None when a size is not a power of two or K is not a
  whole number of runs, groups and super-blocks (those layouts keep tinygrad's matmul). K may end in a part-filled block
  of high bits (Q5_0 at K = 896, Qwen2.5-0.5B's): the ranges then name inputs past K, which `_projector` masks. Not a K
  below one block of high bits, a toy's size, where that mask is all there is past K: 5-bit codes at K = 64 failed in
  tinygrad with a KernelOptError (the mask had shrunk a range the opts name), and at K = 32 the plain GEMV of 5- to
  8-bit codes summed wrong."""
  units = [8, spec.group] + ([spec.group * spec.super_groups] if spec.super_groups else [])
  high_block = [32 * (8 // (spec.bits - 4))] if spec.bits > 4 else []
  if spec.bits > 4: units += [4, 32]
  if spec.k_scales: units += [32, 128]
  if any(u & (u - 1) for u in units + high_block) or K % 32 or any(K % u for u in units) or K < sum(high_block): return None
  return tuple(sorted({u.bit_length() - 1 for u in units + high_block}))


def ranges_of(layout: str | QuantSpec, K: int, group: int) -> tuple[int, ...]:
  """The input axis as the ranges the weight's layout splits it into (input k = their mixed-radix number), so that no
  index divides: tinygrad splits a range that an index divides into ranges of its own, under the opts. Floats: k;
  INT8: the group of 32, the code in it; INT4: the group, its uint32 word, the code (nibble) in the word; packed: k's
  bits between consecutive `packed_cuts`, the highest first."""
  if isinstance(layout, QuantSpec):
    cuts = packed_cuts(layout, K)
    return (-(-K >> cuts[-1]), *(1 << (hi - lo) for hi, lo in zip(cuts[::-1], (*cuts[-2::-1], 0))))
  return (K,) if layout == FLOAT else (K // 32, 32) if layout == INT8 else (K // group, group // 8, 8)


def kernel_opts(device: str | tuple[str, ...], layout: str | QuantSpec, T: int, N: int, K: int, group: int = 0, itemsize: int = 2,
                heads: int = 0) -> tuple:
  """tinygrad's optimizations for a GEMV of T rows, weights stored as `layout` (INT4's `group`, a float's `itemsize`): on
  a GPU the schedule in the module's docstring, shrunk where a size does not divide; on the CPU device none (its loops
  as written: only tests run it there). `heads`: the qkv projection with RoPE (`_qkv_rope_kernel`), whose outputs
  are N pairs of rows a head, after an axis of that many heads: a thread's two rows are its pair."""
  if portable.on_cpu(device): return ()
  spread = layout == FLOAT and T == 1 and not heads and N * THREADS_PER_ROW // ROWS_PER_THREAD < SPREAD_BELOW
  per_row = 2 * THREADS_PER_ROW if spread and K >= LONG_ROW else THREADS_PER_ROW
  if layout == FLOAT:   # one reduction axis: a vector of it a thread, then the threads over the rest
    vector = _vector(K, itemsize)
    opts, rest = ([Opt(OptOps.UNROLL, 0, vector)] if vector > 1 else []), K // vector
  else: return _quantized_opts(ranges_of(layout, K, group), T, N, heads)
  threads = next(g for g in (per_row, THREADS_PER_ROW, 16, 8, 4, 2, 1) if rest % g == 0)
  per_thread = 1 if spread and threads == THREADS_PER_ROW else ROWS_PER_THREAD
  return tuple(opts + ([Opt(OptOps.GROUP, 0, threads)] if threads > 1 else []) + _output_opts(T, N, threads, heads, per_thread))


def _vector(K: int, itemsize: int) -> int:
  """Elements of a row of K floats a thread loads at once: 16 bytes' worth, or the most of fewer that divides K."""
  return next(v for v in (16 // itemsize, 4, 2, 1) if K % v == 0)


def _quantized_opts(ranges: tuple[int, ...], T: int, N: int, heads: int) -> tuple:
  """A quantized layout's schedule over its input ranges (`ranges_of`, the highest first), from k's lowest bits up:
  UNROLL a word's 8 codes (INT4 and packed nibbles; 8 bytes of INT8) a thread, GROUP the next bits over up to 32
  threads, then UNROLL up to WORDS_IN_FLIGHT more (each a warp's width further along the row). So a warp's threads
  read neighbouring words and x's neighbouring 8 values: the loads of x and the norm's weight, which every code
  needs, are coalesced. A thread that read 4 words of one group (16 bytes) read 32 consecutive values of x too, and
  a warp's load of them touched 32 cache lines where 2 would do (lowered for the H100: 535 lines a warp's iteration
  of the INT4 LM head, 47 needed; `tests/test_cuda_compile.py`'s `warp_accesses`): the L1 throughput that capped
  the INT4 GEMVs below float16's speed on an H200 (docs/kernels.md).

  tinygrad takes an opt's amount from a range's low end, numbers a GROUP's axis among the REDUCE ranges and an
  UNROLL's among the GROUP_REDUCE ranges (threads, in the order made) then the REDUCE ones; a range an opt takes whole
  is gone. Walking from the lowest range up, no opt renumbers a range still to come."""
  sizes = [size for size in ranges if size > 1]   # tinygrad's axes drop ranges of size 1
  opts, axis, threads = [], len(sizes) - 1, 1
  for op, want in ((OptOps.UNROLL, 8), (OptOps.GROUP, THREADS_PER_ROW), (OptOps.UNROLL, WORDS_IN_FLIGHT)):
    while want > 1 and axis >= 0 and (amount := math.gcd(sizes[axis], want)) > 1:   # a range's bits are all below the next's
      threads_made = len([o for o in opts if o.op is OptOps.GROUP])
      opts.append(Opt(op, axis + (threads_made if op is OptOps.UNROLL else 0), amount))
      sizes[axis], want = sizes[axis] // amount, want // amount
      if op is OptOps.GROUP: threads *= amount
      if sizes[axis] == 1: axis -= 1
  return tuple(opts + _output_opts(T, N, threads, heads))


def _output_opts(T: int, N: int, threads: int, heads: int, per_thread: int | None = None) -> list:
  """The opts over a GEMV's outputs, once `threads` share a row: rows a block, rows a thread (at most `per_thread`),
  x's rows a thread."""
  # rows a block: 4, or more where fewer threads share a row (a quantized K of few groups: 576 in groups of 64 is 9, one
  # thread a row), so that a block still holds a warp or more
  local = next(n for n in (128, 64, 32, 16, 8, 4, 2, 1) if n <= max(ROWS_PER_BLOCK, THREADS_PER_ROW // threads) and N % n == 0)
  per_thread = next(n for n in (1 if heads else per_thread or ROWS_PER_THREAD, 1) if N % (local * n) == 0)
  # global axes: x's rows (absent when there is one: tinygrad drops axes of size 1), (the heads,) then the outputs
  outputs, opts = int(T > 1) + int(heads > 1), []
  if local > 1: opts.append(Opt(OptOps.LOCAL, outputs, local))
  if per_thread > 1: opts.append(Opt(OptOps.UPCAST, outputs, per_thread))
  # every x row a thread up to X_ROWS_A_THREAD (the weight read once); beyond, that many a thread and the rest a grid
  # axis of their own, whose blocks re-read the weight (from L2 where it fits: `max_rows`)
  if T > 1 and (rows := T if T <= X_ROWS_A_THREAD else math.gcd(T, X_ROWS_A_THREAD)) > 1: opts.append(Opt(OptOps.UPCAST, 0, rows))
  return opts


def _weight_reader(layout: str | QuantSpec, K: int, parts: list[UOp], ranges: tuple[UOp, ...], inside: UOp | None = None):
  """row -> its weight element at the reduction's input (`ranges`, `_projector`) in float32, from the stored parts
  (quant/formats.py): floats; INT8, a code times a scale per 32; INT4, 8 codes a uint32 (code i of a word in bits
  4i..4i+3) times a scale plus a bias per group; a packed layout, `_packed_reader` (`inside`: k < K, where its ranges
  run past K)."""
  if isinstance(layout, QuantSpec): return _packed_reader(layout, K, parts, ranges, inside)
  if layout == FLOAT:
    w, (k,) = parts[0].flatten(), ranges
    return lambda row: w[row * K + k].cast(dtypes.float32)
  if layout == INT8:
    (codes, scales), (g, j) = (p.flatten() for p in parts), ranges
    return lambda row: codes[row * K + g * 32 + j].cast(dtypes.float32) * scales[row * (K // 32) + g].cast(dtypes.float32)
  (packed, scales, biases), (g, word, nibble) = (p.flatten() for p in parts), ranges
  words = word.vmax + 1
  groups = K // (words * 8)
  def int4(row):
    code = (packed[row * (K // 8) + g * words + word] >> (nibble * 4).cast(dtypes.uint32)) & 0xF
    at = row * groups + g
    return exact_float(code) * scales[at].cast(dtypes.float32) + biases[at].cast(dtypes.float32)
  return int4


def exact_float(code: UOp) -> UOp:
  """A uint32 below 2^23 as float32, by its bits: 2^23 + code is the float whose mantissa is the code, and the
  subtraction is exact. An int-to-float conversion runs at a quarter of the FMAs' rate on NVIDIA GPUs (16 a clock an
  SM on sm_80/sm_90, against a bitwise or's 64 and an add's 128), and a GEMV of 4-bit codes converts every one."""
  return (code | 0x4B000000).bitcast(dtypes.float32) - 8388608.0


def _packed_reader(spec: QuantSpec, K: int, parts: list[UOp], ranges: tuple[UOp, ...], inside: UOp | None):
  """row -> its weight at input k of a packed layout (quant/blocks.py), k's bit fields taken from the ranges
  (`ranges_of`: one range a span between `packed_cuts`) so that no index divides. The code: its nibble (word k >> 3,
  bits 4 (k & 7)) plus, above 4 bits, its high bits (block k >> (5 + log2 R) of 8 words after the nibbles, word
  (k >> 2) & 7, bits 8 (k & 3) + h ((k >> 5) & (R - 1))) times 16; a codebook's value for it. Its scale and bias:
  float16 per group; or a two-level scale, an integer per group times a float16 per super-block (Q4_K and Q5_K: 6-bit
  scales and mins unpacked as ggml's get_scale_min_k4 does). All in float32, where a two-level product is exact. Past K
  (a part-filled last block of high bits) the codes read are still the row's (its high bits), the scales' loads are
  masked by `inside` (0), as `_projector` masks x's."""
  cuts = packed_cuts(spec, K)
  span = dict(zip(cuts[::-1] + (0,), ranges))   # the lowest bit of each range's span -> the range
  def field(lo: int, hi: int = 64) -> UOp:   # k's bits lo..hi-1 (both cut positions) as a number
    return functools.reduce(UOp.__add__, [span[b] * (1 << (b - lo)) for b in span if lo <= b < hi])
  packed, (scales, *rest) = parts[0].flatten(), [_loader(p.flatten(), inside) for p in parts[1:]]
  words, groups, u32 = parts[0].shape[1], K // spec.group, dtypes.uint32
  code = lambda row: (packed[row * words + field(3)] >> (field(0, 3) * 4).cast(u32)) & 0xF
  if spec.bits > 4:
    h = spec.bits - 4
    log_r = (8 // h).bit_length() - 1
    nibble_code = code
    def code(row):
      high = packed[row * words + K // 8 + field(5 + log_r) * 8 + field(2, 5)] >> (field(0, 2) * 8 + field(5, 5 + log_r) * h).cast(u32)
      return nibble_code(row) + (high & ((1 << h) - 1)) * 16
  def value(row) -> UOp:   # the code as the float it stands for, less the symmetric layouts' centre
    q = code(row)
    if spec.codebook:
      first = q.eq(1).where(float(CODEBOOK[1]), float(CODEBOOK[0]))
      return functools.reduce(lambda acc, i: q.eq(i).where(float(CODEBOOK[i]), acc), range(2, 16), first)
    f = exact_float(q) if q.dtype == dtypes.uint32 else q.cast(dtypes.float32)
    return f - spec.offset if spec.offset else f
  f32 = lambda u: u.cast(dtypes.float32)
  g = field(spec.group.bit_length() - 1)
  if not spec.super_groups:
    if spec.symmetric: return lambda row: f32(scales(row * groups + g)) * value(row)
    return lambda row: f32(scales(row * groups + g)) * value(row) + f32(rest[0](row * groups + g))
  supers = groups // spec.super_groups
  sb = field((spec.group * spec.super_groups).bit_length() - 1)
  d = rest[0]
  if spec.symmetric: return lambda row: f32(scales(row * groups + g)) * f32(d(row * supers + sb)) * value(row)
  if spec.k_scales:   # 12 bytes a super-block; group 4 half + j: half 0 in bytes j (scale) and 4 + j (min), 6 bits;
    half, j = field(7, 8), field(5, 7)   # half 1: low 4 bits in byte 8 + j (scale low nibble, min high), top 2 bits in the
    def scale_min(row):                  # top of bytes j and 4 + j
      byte = lambda i: scales((row * supers + sb) * 12 + i).cast(dtypes.int32)
      mask, top = 63 - 48 * half, lambda i: ((byte(i) >> 6) << 4) * half
      return (byte(j + 8 * half) & mask) | top(j), ((byte(j + 4 + 4 * half) >> (4 * half)) & mask) | top(j + 4)
  else: scale_min = lambda row: (scales((row * groups + g) * 2), scales((row * groups + g) * 2 + 1))
  def affine(row):
    sc, mn = scale_min(row)
    at = (row * supers + sb) * 2
    return f32(sc) * f32(d(at)) * value(row) - f32(mn) * f32(d(at + 1))
  return affine


def _loader(buf: UOp, inside: UOp | None):
  """index -> buf's element there, or 0 where `inside` is false (a load masked, never made)."""
  return (lambda idx: buf[idx.valid(inside)]) if inside is not None else (lambda idx: buf[idx])


def _projector(layout: str | QuantSpec, eps: float | None, has_bias: bool, x: UOp, t: UOp, rest: list[UOp], first_range: int):
  """row -> the projection of x's row t by weight row `row` in float32 (its norm and bias applied), from the kernel's
  inputs in `rest`, which it takes from the front: the weight's stored parts, then the norm's weight when `eps`, then
  x's rows' 1/RMS `[T, 1]` where the kernel does not sum x's squares itself (`norms_inside`), then the bias when
  `has_bias`. The reduction's ranges are numbered from `first_range` (after the kernel's output ranges)."""
  K = x.shape[1]
  parts = [rest.pop(0) for _ in parts_of(layout)]
  norm_w = rest.pop(0).flatten() if eps is not None else None
  row_scale = rest.pop(0).flatten() if eps is not None and not norms_inside(layout) else None
  bias = rest.pop(0).flatten() if has_bias else None
  x = x.flatten()
  sizes = ranges_of(layout, K, K // parts[1].shape[1] if layout == INT4 else 0)
  ranges = tuple(UOp.range(size, first_range + i, AxisType.REDUCE) for i, size in enumerate(sizes))
  k = _input_at(ranges)
  inside = k < K if math.prod(sizes) > K else None   # a packed layout's part-filled last block of high bits
  weight_at = _weight_reader(layout, K, parts, ranges, inside)
  xk = _loader(x, inside)(t * K + k).cast(dtypes.float32)
  xin = xk * _loader(norm_w, inside)(k).cast(dtypes.float32) if norm_w is not None else xk
  if row_scale is not None: scale = row_scale[t]
  elif eps is not None:
    xs = xk if len(ranges) == 1 else _squares_read(x, t, K, ranges, inside)
    scale = ((xs * xs).reduce(*ranges, arg=Ops.ADD) * (1 / K) + eps).rsqrt()
  else: scale = None

  def project(row: UOp) -> UOp:
    y = (weight_at(row) * xin).reduce(*ranges, arg=Ops.ADD)
    if scale is not None: y = y * scale
    return y + bias[row].cast(dtypes.float32) if bias is not None else y
  return project


def _input_at(ranges: tuple[UOp, ...]) -> UOp:
  """The input k that `ranges` name: their mixed-radix number, the first the highest."""
  return functools.reduce(lambda acc, r: acc * (r.vmax + 1) + r, ranges[1:], ranges[0])


def _squares_read(x: UOp, t: UOp, K: int, ranges: tuple[UOp, ...], inside: UOp | None) -> UOp:
  """x's row t read for its sum of squares where the input axis is several ranges (a quantized layout's): at a
  permutation of the inputs, each range after the first rotated by half its size, which sums the same squares.

  Read at k itself, the sum names x alone, whose index needs no division once tinygrad merges the ranges, so it
  merges them: a second loop over the whole row, which the opts (written for the weight's ranges) leave to one
  thread an output, or the kernel before it that quantized GEMVs had (`inverse_rms`: 33 launches of an INT4 decode
  step of the 1B model). Rotated, every merge would add a division, so none is made: the squares keep the dot's
  ranges and with them its threads, a loop of the same count beside the dot's (lowered for the H100, one load of 16
  bytes of x a word of codes, coalesced as the dot's). Only its parts past K are masked (`inside`)."""
  rotated = [ranges[0]] + [(r + (r.vmax + 1) // 2) % (r.vmax + 1) if r.vmax > 0 else r for r in ranges[1:]]
  at = _input_at(tuple(rotated))
  return _loader(x, at < K if inside is not None else None)(t * K + at).cast(dtypes.float32)


def norms_inside(layout: str | QuantSpec) -> bool:
  """Whether the GEMV sums x's squares for its norm itself: every layout but a packed one of 6-bit codes (Q6_K, MLX's
  6-bit), whose two loops tinygrad 0.14 fails to order with the squares inside (an AssertionError in its linearizer,
  tests/test_gemv.py); those take x's 1/RMS from `inverse_rms`, a kernel before the GEMV. The others were lowered for
  the H100 at the widths of the models we know (K from 576 to 18,944) and 1 to 32 rows (8 for packed layouts)."""
  return not (isinstance(layout, QuantSpec) and layout.bits == 6)


def _tags(layout: str | QuantSpec, eps: float | None) -> list[str]:
  return ([] if layout == FLOAT else [PACKED if isinstance(layout, QuantSpec) else layout]) + (["norm"] if eps is not None else [])


def _gemv_kernel(opts: tuple, layout: str | QuantSpec, eps: float | None, act: str | None, inter: int, has_bias: bool, other: str | None,
                 out: UOp, x: UOp, *rest: UOp) -> UOp:
  """out[t, n] = the projection of x's row t by weight row n, in float32 (rest: the inputs `_projector` reads, then
  the `other` `[T, N]` tensor). With `act`, out[t, n] = act(gate) * up: of weight rows n and inter + n (the fused
  gate/up projection, `[2 inter, K]`), or with `other` "gate", of the gate projection's output and this one (gate and
  up stored apart). `other` "res": the residual, added."""
  T, N = out.shape
  rest = list(rest)
  t, n = UOp.range(T, 0), UOp.range(N, 1)
  project = _projector(layout, eps, has_bias, x, t, rest, 2)
  other_at = rest.pop(0).flatten()[t * N + n].cast(dtypes.float32) if other is not None else None
  out = out.flatten()
  y = project(n)
  if act is not None:
    gate, up = (other_at, y) if other == "gate" else (y, project(n + inter))
    y = (gate.silu() if act == "silu" else gate.gelu()) * up
  if other == "res": y = y + other_at
  store = out[t * N + n].store(y.cast(out.dtype))
  tags = _tags(layout, eps) + (["glu"] if act else []) + ([other] if other else [])
  name = "_".join(["gemv", *tags, str(T), str(N), str(x.shape[1])])
  return UOp.sink(store.end(t, n), arg=KernelInfo(name=name, opts_to_apply=opts))


def _qkv_rope_kernel(opts: tuple, layout: str | QuantSpec, eps: float | None, has_bias: bool, dims: tuple[int, int, int],
                     heads: tuple[int, int], *bufs: UOp) -> UOp:
  """The qkv projection of x `[T, K]` (weight rows: H q heads, KVH k heads, KVH v heads of D = `dims`; or `heads` =
  (first, count) of them, a part stored apart) with RoPE and the cache write done at the store: q rotated into q_out
  `[T, H, D]`, k rotated and v into the caches `[NB, BS, KVH, D]` at each token's slot (slot -1, a padding token, writes
  no K/V: `portable.slot_in_range`). bufs: the outputs the heads reach (q_out, k_cache, v_cache: a part stored apart
  writes one), x, the inputs `_projector` reads, then the positions `[T]`, the cos/sin table `[positions, D]`
  (kernels/paged.py's `rotated`) and the slots.

  HF's rotate-half RoPE mixes element i of a head with element i + D/2, so a thread computes that pair of weight rows
  (ranges: token, head, i < D/2) and stores both; v heads are stored as they are."""
  (H, KVH, D), (first, count) = dims, heads
  owns = [first < H, first < H + KVH and first + count > H, first + count > H + KVH]   # q, k, v
  bufs = list(bufs)
  q_out, k_cache, v_cache = (bufs.pop(0) if own else None for own in owns)
  x, rest = bufs[0], bufs[1:]
  cache = k_cache if k_cache is not None else v_cache   # its slots bound the K/V stores (a q part writes none)
  T, half, rows_per_slot = x.shape[0], D // 2, KVH * D
  t, local_h, i = UOp.range(T, 0), UOp.range(count, 1), UOp.range(half, 2)
  project = _projector(layout, eps, has_bias, x, t, rest, 3)
  positions, cos_sin, slots = (u.flatten() for u in rest)
  first_row, second_row = project(local_h * D + i), project(local_h * D + half + i)
  pos, slot, h = positions[t], slots[t], local_h + first   # h: the head among all H + 2 KVH (a part's: a constant apart)
  cos, sin = cos_sin[pos * D + i].cast(dtypes.float32), cos_sin[pos * D + half + i].cast(dtypes.float32)
  rotated = (first_row * cos - second_row * sin, second_row * cos + first_row * sin)
  is_q, is_v = h < H, h >= H + KVH
  is_k = (h >= H) & (h < H + KVH)
  kv_h = is_k.where(h - H, is_v.where(h - H - KVH, 0))   # in range for every head: the stores it does not own are masked
  stores = []
  for offset, rot, raw in ((0, rotated[0], first_row), (half, rotated[1], second_row)):
    if q_out is not None:
      stores.append(q_out.flatten()[((t * H + is_q.where(h, 0)) * D + i + offset).valid(is_q)].store(rot.cast(q_out.dtype)))
    if cache is None: continue
    element = kv_h * D + i + offset
    slot_ok = portable.slot_in_range(slot, rows_per_slot, element, math.prod(cache.shape[:2]))
    kv_at = slot * rows_per_slot + element
    if k_cache is not None: stores.append(k_cache.flatten()[kv_at.valid(is_k & slot_ok)].store(rot.cast(k_cache.dtype)))
    if v_cache is not None: stores.append(v_cache.flatten()[kv_at.valid(is_v & slot_ok)].store(raw.cast(v_cache.dtype)))
  which = "" if all(owns) else "q" if owns[0] else "k" if owns[1] else "v"   # a part's heads
  name = "_".join(["gemv", *_tags(layout, eps), "rope" + which, str(T), str(H), str(KVH), str(D), str(x.shape[1])])
  return UOp.sink(UOp.group(*stores).end(t, local_h, i), arg=KernelInfo(name=name, opts_to_apply=opts))


def _inverse_rms_kernel(eps: float, opts: tuple, out: UOp, x: UOp) -> UOp:
  """out `[T, 1]` = 1 / sqrt(mean(x[t]^2) + eps), float32, x `[T, K]`."""
  T, K = x.shape
  x, out = x.flatten(), out.flatten()
  t, k = UOp.range(T, 0), UOp.range(K, 1, AxisType.REDUCE)
  xk = x[t * K + k].cast(dtypes.float32)
  store = out[t].store(((xk * xk).reduce(k, arg=Ops.ADD) * (1 / K) + eps).rsqrt())
  return UOp.sink(store.end(t), arg=KernelInfo(name=f"inverse_rms_{T}_{K}", opts_to_apply=opts))


def inverse_rms(x: Tensor, eps: float) -> Tensor:
  """portable.inverse_rms `[T, K] -> [T, 1]` (float32) of x, for a GEMV of a 6-bit layout (`norms_inside`) and the
  tensor cores' GEMM (kernels/gemm.py), as a kernel whose threads share each row: 16 bytes of it a thread and up to 256
  threads a row. tinygrad's heuristic gave the 1B's 2048-wide row one block of 16 threads, each looping over 128 values
  alone (sm_90)."""
  out = Tensor.empty(x.shape[0], 1, dtype=dtypes.float32, device=x.device)
  opts = inverse_rms_opts(x.device, x.shape[1], x.dtype.itemsize)
  return Tensor.custom_kernel(out, x.contiguous(), fxn=functools.partial(_inverse_rms_kernel, eps, opts))[0]


def inverse_rms_opts(device: str | tuple[str, ...], K: int, itemsize: int) -> tuple:
  """`inverse_rms`'s opts on a GPU: a vector of 16 bytes a thread, up to 256 threads a row; none on the CPU device."""
  if portable.on_cpu(device): return ()
  vector = _vector(K, itemsize)
  threads = next(g for g in (256, 128, 64, 32, 16, 8, 4, 2, 1) if (K // vector) % g == 0)
  return tuple(([Opt(OptOps.UNROLL, 0, vector)] if vector > 1 else []) + ([Opt(OptOps.GROUP, 0, threads)] if threads > 1 else []))


def shared_norm(x: Tensor, norm: tuple[Tensor, float], *weights: LinearWeights) -> tuple:
  """`norm` for several GEMVs of the same x (q, k and v, or gate and up, stored apart): with x's 1/RMS computed once
  when any of them takes it from a kernel before (`norms_inside`). Each would launch its own `inverse_rms` (a tensor
  op's was one, tinygrad merging equal computations; a custom kernel's output is a buffer of its own)."""
  return (*norm, inverse_rms(x, norm[1])) if not all(norms_inside(layout_of(w)) for w in weights) else norm


def _projection_inputs(x: Tensor, w: LinearWeights, norm: tuple | None) -> list[Tensor]:
  """x and what `_projector` reads of a projection of x by w (normed first when `norm`: (weight, eps), or with x's
  1/RMS after them, `shared_norm`), in its order."""
  inputs = [x.contiguous(), *(getattr(w, name) for name in parts_of(layout_of(w)))] + ([norm[0]] if norm is not None else [])
  if norm is not None and not norms_inside(layout_of(w)): inputs.append(norm[2] if len(norm) > 2 else inverse_rms(x, norm[1]))
  return inputs + ([w.bias] if w.bias is not None else [])


def gemv(x: Tensor, w: LinearWeights, *, norm: tuple | None = None, act: str | None = None,
         residual: Tensor | None = None, gate: Tensor | None = None, out: Tensor | None = None, dtype=None) -> Tensor:
  """x `[T, K]` @ W^T (+ W's bias), W `[N, K]` stored as floats, INT4 groups, INT8 or packed (`applies`), in one kernel:
    norm=(w, eps)   x RMS-normed (times w) first (or `shared_norm`'s, x's 1/RMS after them)
    act             W is gate and up stacked (`[2 I, K]`): returns act(gate) * up, `[T, I]` (SwiGLU "silu", GeGLU
                    "gelu_pytorch_tanh"); with `gate`, W is the up projection alone
    gate            `[T, N]`, the gate projection's output (gate and up stored apart): returns act(gate) * x @ W^T
    residual        `[T, N]` added to the product
    out             a realized `[T, N]` buffer to write (the layer's output)
    dtype           the output's, when not x's (the LM head's float32 logits: no cast kernel after it)"""
  T, K = x.shape
  assert w.in_features == K, (x.shape, w.in_features)
  assert act is None or residual is None, "a gated projection's output is not the residual stream's"
  assert gate is None or act is not None, "a gate needs its activation"
  inter = w.weight.shape[0] // 2 if act is not None and gate is None else 0
  N = inter or w.weight.shape[0]
  y = Tensor.empty(T, N, dtype=dtype or x.dtype, device=x.device) if out is None else out
  opts = kernel_opts(x.device, layout_of(w), T, N, K, w.group_size, w.weight.dtype.itemsize)
  other = "res" if residual is not None else "gate" if gate is not None else None
  inputs = _projection_inputs(x, w, norm) + ([(residual if residual is not None else gate).contiguous()] if other else [])
  fxn = functools.partial(_gemv_kernel, opts, layout_of(w), norm[1] if norm is not None else None, act, inter, w.bias is not None, other)
  return Tensor.custom_kernel(y, *inputs, fxn=fxn)[0]


def qkv_rope_write(x: Tensor, w: LinearWeights | list[LinearWeights], norm: tuple[Tensor, float], n_heads: int, n_kv_heads: int,
                   positions: Tensor, cos_sin: Tensor, cache: PagedKVCache, slot_mapping: Tensor,
                   q_dtype=dtypes.float32) -> tuple[Tensor, PagedKVCache]:
  """The qkv projection of RMSNorm(x) (W `[(H + 2 KVH) D, K]`, any format `applies` takes), RoPE (HF's rotate-half,
  from the `[positions, D]` cos/sin table) and the write of k and v into their slots of a float cache, in one kernel:
  the decode step's projection stores its heads where they go. `w` a list: q, k and v stored apart (in different
  formats), a kernel each. Returns (q rotated `[T, H, D]` as `q_dtype`: float32 for kernels/paged.py, the model's for
  the attention shaders; the cache ordered after the write)."""
  T, K = x.shape
  D, parts = cache.head_dim, w if isinstance(w, list) else [w]
  heads = [n_heads + 2 * n_kv_heads] if len(parts) == 1 else [n_heads, n_kv_heads, n_kv_heads]
  assert not cache.quantized and len(parts) == len(heads), (len(parts), cache.quantized)
  outputs = [Tensor.empty(T, n_heads, D, dtype=q_dtype, device=x.device), cache.k, cache.v]
  tail = [positions.contiguous(), cos_sin.contiguous(), slot_mapping.contiguous()]
  norm = shared_norm(x, norm, *parts) if len(parts) > 1 else norm
  first = 0
  for i, (part, count) in enumerate(zip(parts, heads)):
    assert part.in_features == K and part.weight.shape[0] == count * D, (x.shape, part.weight.shape)
    opts = kernel_opts(x.device, layout_of(part), T, D // 2, K, part.group_size, part.weight.dtype.itemsize, heads=count)
    fxn = functools.partial(_qkv_rope_kernel, opts, layout_of(part), norm[1], part.bias is not None, (n_heads, n_kv_heads, D), (first, count))
    written = range(3) if len(parts) == 1 else [i]   # the outputs this kernel stores into
    after = Tensor.custom_kernel(*(outputs[j] for j in written), *_projection_inputs(x, part, norm), *tail, fxn=fxn)
    for j, out in zip(written, after): outputs[j] = out
    first += count
  q, k, v = outputs
  return q, cache.written(k, v)
