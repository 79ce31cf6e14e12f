"""Attention over the paged KV cache in a few kernels that read it in place: the portable backend's path on GPUs.

Composed from tensor ops (kernels/portable.py), one decode layer's attention cost tinygrad 11 kernels: gather the
RoPE rows of the step's positions, rotate k and stack it with v, write the cache, copy the used blocks of K and of V
out of the cache (a gather by block table is a reduction to tinygrad, and a reduction read by a broadcasting matmul
is realized first), build the key positions (an arange of symbolic length is a cumulative sum: S^2 work), QK^T, max,
exp, sum, PV. On a GPU every kernel is a launch, in a CUDA graph or a Metal command buffer alike. The kernels here are
written in UOps (tinygrad custom kernels, which tinygrad optimizes and compiles for every device as its own):

  write   from the qkv projection's rows: q rotated (float32), k rotated and v into their slots
  QK^T    keys read through the block table, scaled, masked                  scores [P, KVH, G*C, S]
  max     each row's largest score, its blocks read in the order PV reads them          [P, KVH, G*C, 1]
  PV      exp(score - max) times values read through the block table, over their sum (one kernel, two sums)
                                                                              [T, H*D], as the o projection reads it

4 kernels a layer where the tensor ops took 11. Prefill adds one that turns the scores into exp(score - max) in place:
the PV kernel otherwise recomputes each exp once per element of its output row (D times); for a decode step of a few
sequences that is cheaper than a launch, for a long prefill it is not (`EXP_INLINE_ROWS`).

The scores' buffer is as wide as the extent can be: the whole block table, or on a GPU a prefill shape's bound
(engine/model_runner.py; tinygrad sizes a buffer of symbolic length at its maximum as well); the kernels loop to the
step's used extent, a symbolic count they read as a kernel parameter (AttentionGroup.kernel_blocks). Its value reaches
them because the max kernel's call carries the count's bound Variable (engine/replay.py `custom_kernel_binding`):
tinygrad looks a kernel's variables up among the bound ones of the pass, and a kernel in a pass that bound none fails
with "unbound Variable" (a tensor op over the scores' used slice bound it before, and made the max a reduction of
tinygrad's heuristic). RoPE, the scale, the mask and every sum are computed in float32. Float and int8 caches are read
(int8: a code times its head vector's scale); int8 writes (the scale is a row maximum: tensor ops), int4 caches
(packed, rotated) and soft-capped scores (Gemma 2) take the tensor-op path.

A packed prefill group (prefill chunks back to back, kernels.AttentionGroup) is one row of T query slots: the scores
are `[1, KVH, G*T, MS]`, and a slot finds the block table to read through its token's sequence (token_seq), where an
unpacked group's slot (p, c) reads row p. Every slot's loop runs to the step's extent; the keys past its own sequence's
context are masked like those after its position.
"""
from __future__ import annotations
import functools, math
from typing import TYPE_CHECKING
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.uop.ops import AxisType, KernelInfo, Ops
from tinyvllm.engine.replay import custom_kernel_binding
from tinyvllm.kernels import portable
from tinyvllm.kernels.kv_cache import PagedKVCache

if TYPE_CHECKING: from tinyvllm.kernels import AttentionGroup

# decode steps of at most this many query rows (sequences x query heads) recompute exp(score - max) in the PV kernel
# rather than launch a kernel that writes it once: D exps per score, microseconds for one 32-head sequence at 4096
# tokens on an H100, about a launch; 32 such sequences would pay 32 times that
EXP_INLINE_ROWS = 64
LOG2E = 1 / math.log(2)
# a batch-1 decode step's values kernel takes the context's blocks this many at a time over threads of their own,
# beside a block's 16 offsets (`_values_kernel`): 128 threads an output, each looping over 1/8 of the blocks
DECODE_SPLIT = 8
# and the softmax's max kernel this many (`_max_kernel`): 64 threads a row at batch 1, a 2,048-token row's 128 blocks
# 32 loads a thread; its final step has every thread of a row read all of their partial maxima from shared memory
MAX_SPLIT = 4
# runs of blocks a decode step's values and max kernels take in one thread's loop iteration, unrolled beside those over
# threads: the loop over the blocks is symbolic, which tinygrad cannot unroll, and each of its iterations is a table
# entry and a value read that hang on each other (an L2 round trip each). ptxas unrolled the values kernel's loop by 2
# (its sm_90 SASS: two such chains in flight); unrolled here, 4 are, and a 32-sequence step at 2,048 tokens loops 32
# times where it looped 128 (lowered for the H100)
DECODE_UNROLL = 4


# threadgroup memory a kernel may take: Apple GPUs' 32 KB (CUDA gives a block 48 KB)
SHARED_BYTES = 32768


def decode_split(num_seqs: int, block_size: int, group: int, head_dim: int) -> int:
  """The values kernel's runs of blocks for a decode step of `num_seqs` sequences: DECODE_SPLIT shared among them, so
  that a step's threads stay about as many (more sequences bring threads of their own). tinygrad's final sum over an
  output's threads has every thread read all of their partial sums from shared memory (16 of them for the group's 4
  heads x 4 elements): at 128 threads an output that is about 13,000 instructions a block, 50 us a layer for a
  32-sequence step, where 16 threads take 200. Halved while those sums would not fit SHARED_BYTES (a group of 13 or
  more heads at 128 threads an output: 33 KB and up)."""
  threads = math.gcd(16, block_size)   # an output's threads along a block's offsets
  sums = _heads_a_thread(group) * (math.gcd(4, head_dim) + 1)   # numerators (heads x elements) and denominators
  split = max(1, DECODE_SPLIT // num_seqs)
  while split > 1 and threads * split * sums * 4 > SHARED_BYTES: split //= 2
  return split


def _heads_a_thread(group: int) -> int:
  """The heads of a GQA group one thread takes (tinygrad upcasts at most 16): the most that divide the group."""
  return next(n for n in range(min(group, 16), 0, -1) if group % n == 0)


def applies(int4_cache: bool, softcap: float | None) -> bool:
  """Can these kernels run a layer's attention (of a step's only group, padded or packed): a float or int8 cache (no
  int4 keys or values), no soft cap? Asked of each layer's cache as it runs, and before any step of a model's layers
  and cache format (`Kernels.packs`: the tensor-op path they fall back to pads prefill chunks)."""
  return softcap is None and not int4_cache


def _kernel_name(kind: str, P: int, G: int, C: int, packed: bool) -> str:
  return f"paged_{kind}_packed_{G}_{C}" if packed else f"paged_{kind}_{P}_{G}_{C}"


def _table_row(p: UOp, token: UOp, token_seq: UOp | None) -> UOp:
  """The block table row of a query slot: its group row p, or in a packed group its token's sequence (padding
  slots, -1, read row 0 harmlessly: their output is never read)."""
  return p if token_seq is None else token_seq[token].cast(dtypes.weakint).maximum(0)


def rotated(read, d: UOp, D: int, cos_sin: UOp, pos: UOp) -> UOp:
  """Element d of a head vector after HF's rotate-half RoPE at position `pos`, as float32; `read(i)` gives the vector's
  element i. cos_sin: flat `[positions, D]`, the cos of the D/2 frequencies then their sin."""
  half = D // 2
  first = d < half
  i = first.where(d, d - half)
  cos, sin = cos_sin[pos * D + i].cast(dtypes.float32), cos_sin[pos * D + half + i].cast(dtypes.float32)
  x, partner = read(d).cast(dtypes.float32), read(first.where(d + half, d - half)).cast(dtypes.float32)
  return x * cos + first.where(-partner, partner) * sin


def _cache_block(entry: UOp, cache: UOp, block_size: int, KVH: int, D: int) -> UOp:
  """A block table entry as the index arithmetic of a read from the flat cache wants it: a weakint, as the ranges are
  (an int32 beside them is cast, and tinygrad folds no load whose index holds a cast into a vector load: each half
  was read alone), held to the cache's blocks (else the index's range is int32's times a block's size, which tinygrad
  does in 64 bits; the runner's entries are in range already). The flat cache, not its `[NB, BS, KVH, D]` view: an
  index into the view of an unbounded entry took two modulos a read."""
  blocks = cache.shape[0] // (block_size * KVH * D)
  return entry.cast(dtypes.weakint).maximum(0).minimum(blocks - 1)


def _read(cache: UOp, scale: UOp | None, slot: UOp, kvh: UOp, d: UOp, KVH: int, D: int) -> UOp:
  """Element d of KV head kvh at a cache slot, as float32 (an int8 code times its head vector's scale)."""
  x = cache[(slot * KVH + kvh) * D + d].cast(dtypes.float32)
  return x if scale is None else x * scale[slot * KVH + kvh].cast(dtypes.float32)


def _write_kernel(n_heads: int, D: int, opts: tuple, dtype, q_out: UOp, k: UOp, v: UOp, qkv: UOp, positions: UOp,
                  cos_sin: UOp, slots: UOp, *bias: UOp) -> UOp:
  """From the qkv projection's rows `[T, width]`: q rotated into q_out `[T, H * D]` (float32), and k rotated and v
  into the caches `[NB, BS, KVH, D]` at each token's slot (padding tokens, slot -1, write no K/V). One grid of (token,
  q head, element): k and v store where the head is one of theirs. The head and the element are ranges of their own,
  so that no index divides: tinygrad would split a divided range into others, and `opts` (a GPU's block of threads
  along the element, `portable.block_opts`) name the axes as written.

  qkv `[S, T, width]` instead: the projection's partial sums (float32, kernels/gemm.py `partial_products`), which this
  kernel adds with `bias` and rounds to `dtype` as the projection would have stored its rows: the sums' kernel goes."""
  (NB, BS, KVH, _), width = k.shape, qkv.shape[-1]
  summed = len(qkv.shape) == 3
  S, T = qkv.shape[:2] if summed else (1, qkv.shape[0])
  q_out, k, v, qkv, cos_sin = q_out.flatten(), k.flatten(), v.flatten(), qkv.flatten(), cos_sin.flatten()
  t, h, d = UOp.range(T, 0), UOp.range(n_heads, 1), UOp.range(D, 2)
  pos, slot = positions[t], slots[t]
  def element(column: UOp) -> UOp:   # the projection's output (t, column)
    if not summed: return qkv[t * width + column]
    total = functools.reduce(lambda a, b: a + b, (qkv[(s * T + t) * width + column] for s in range(S)))
    return (total + bias[0].flatten()[column].cast(dtypes.float32) if bias else total).cast(dtype)
  head = lambda first: lambda i: element(first + i)   # a head vector's element i, the head's first column `first`
  stores = [q_out[(t * n_heads + h) * D + d].store(rotated(head(h * D), d, D, cos_sin, pos))]
  kv_h = (h < KVH).where(h, KVH - 1) if KVH < n_heads else h   # loads stay inside the row where the stores are masked off
  inside = portable.slot_in_range(slot, KVH * D, kv_h * D + d, NB * BS)
  if KVH < n_heads: inside = inside & (h < KVH)
  at = (slot * (KVH * D) + kv_h * D + d).valid(inside)
  key = rotated(head((n_heads + kv_h) * D), d, D, cos_sin, pos)
  value = element((n_heads + KVH + kv_h) * D + d)
  stores += [k[at].store(key.cast(k.dtype)), v[at].store(value.cast(v.dtype))]
  name = f"kv_write_rope_{T}_{KVH * D}_{n_heads * D}" + (f"_sum{S}" if summed else "")
  return UOp.sink(UOp.group(*stores).end(t, h, d), arg=KernelInfo(name=name, opts_to_apply=opts))


def _scores_kernel(opts, block_size: int, scale: float, window: int | None, packed: bool, S: UOp, scores: UOp, q: UOp, tables: UOp,
                   q_pos: UOp, *rest: UOp) -> UOp:
  """scores `[P, KVH, G*C, MS]` (MS >= S): the scaled q.k of query slot (p, c), head kvh*G + g (q: rotated, `[T, H, D]`),
  with key position s < S of sequence p (`packed`: of the slot's token's sequence; P is 1); -inf where the key is not
  visible (after the query, or outside the window). rest: token_seq when `packed`, then k and its scales if any."""
  P, KVH, GC, MS = scores.shape
  (T, H, D), MB = q.shape, tables.shape[1]
  G = H // KVH
  C = GC // G
  token_seq, (k, *k_scale) = (rest[0].flatten(), rest[1:]) if packed else (None, rest)
  scores, q, tables, q_pos, k = (x.flatten() for x in (scores, q, tables, q_pos, k))
  p, kvh, gc, s = UOp.range(P, 0), UOp.range(KVH, 1), UOp.range(GC, 2), UOp.range(S, 3)
  d = UOp.range(D, 4, AxisType.REDUCE)
  g, c = gc // C, gc % C
  token = p * C + c
  row = _table_row(p, token, token_seq)
  slot = _cache_block(tables[row * MB + s // block_size], k, block_size, KVH, D) * block_size + s % block_size
  key = _read(k, k_scale[0].flatten() if k_scale else None, slot, kvh, d, KVH, D)
  dot = (q[(token * H + kvh * G + g) * D + d] * key).reduce(d, arg=Ops.ADD)
  last = q_pos[token]
  visible = s <= last if window is None else (s <= last) & (s > last - window)
  store = scores[((p * KVH + kvh) * GC + gc) * MS + s].store(visible.where(dot * scale, float("-inf")))
  return UOp.sink(store.end(p, kvh, gc, s), arg=KernelInfo(name=_kernel_name("scores", P, G, C, packed), opts_to_apply=opts))


def _max_kernel(opts, block_size: int, split: int, blocks: UOp, row_max: UOp, scores: UOp) -> UOp:
  """row_max[r] = the largest of scores row r's first `blocks` blocks of keys, read as `_values_kernel` reads them: a
  block's offsets, then its blocks `split` at a time, so that `max_opts` can give both threads. (As a tensor op over the
  symbolic extent, tinygrad's heuristic gave a row 16 threads, each looping over a 16th of the row alone: 128 loads in
  a row at 2,048 tokens, a warp's lanes a 16th of the row apart; lowered for the H100.)"""
  P, KVH, GC, MS = scores.shape
  scores, row_max = scores.flatten(), row_max.flatten()
  r = UOp.range(P * KVH * GC, 0)
  o, j = UOp.range(block_size, 1, AxisType.REDUCE), UOp.range(split, 2, AxisType.REDUCE)
  hi = UOp.range((blocks + split - 1) // split, 3, AxisType.REDUCE)
  inside = _inside(hi, j, blocks, split)
  at = r * MS + (hi * split + j) * block_size + o
  score = scores[_masked(at, inside)]
  if inside is not None: score = inside.where(score, float("-inf"))
  store = row_max[r].store(score.reduce(hi, j, o, arg=Ops.MAX))
  return UOp.sink(store.end(r), arg=KernelInfo(name=f"paged_max_{P * KVH * GC}", opts_to_apply=opts))


def _masked(idx: UOp, inside: UOp | None) -> UOp:
  """A read's index, masked by `inside` where there is one: past the blocks, a load of 0."""
  return idx.valid(inside) if inside is not None else idx


def _inside(hi: UOp, j: UOp, blocks, split: int) -> UOp | None:
  """Block hi * split + j < blocks, written with j alone where a run of `split` is part-filled (None: split 1): tinygrad
  merges two ranges that every index reads as hi * split + j into one (of symbolic length, which no opt splits), and
  this clause tells them apart."""
  return (hi < blocks // split) | (hi.eq(blocks // split) & (j < blocks % split)) if split > 1 else None


def max_opts(device: str, rows: int, block_size: int, threads: int, unroll: int) -> tuple:
  """`_max_kernel`'s opts on a GPU: a row's reduction over 16 threads along a block's offsets (a warp's loads of a
  row contiguous), then its runs of blocks over `threads` and `unroll`ed in each (`runs_opts`); without threads along
  the blocks, rows enough a block for a warp where their count allows (a 32-sequence step has 1,024 rows, a prefill
  chunk one a token and head). On the CPU device no opts (its loops as written)."""
  if portable.on_cpu(device): return ()
  offsets = math.gcd(16, block_size)
  rows_a_block = whole_warp(0, rows, offsets) if threads == 1 else ()
  return (Opt(OptOps.GROUP, 0, offsets),) + runs_opts(block_size, threads, unroll) + rows_a_block


def runs_opts(block_size: int, threads: int, unroll: int) -> tuple:
  """The opts over the runs of blocks (range j of `threads * unroll`, after GROUPTOP or GROUP took a block's 16
  offsets): `threads` of them over threads of their own (GROUP, from j's low end), the rest unrolled in a thread; and
  a block's offsets past 16 (a block of 32) unrolled too, else their range of 2 is a loop around the symbolic one.
  tinygrad numbers a GROUP's axis among the REDUCE ranges (those offsets first) and an UNROLL's among the GROUP_REDUCE
  ranges (the threads, in the order made) then the REDUCE ones; a range an opt takes whole is gone.

  Blocks not taken in runs (threads * unroll == 1, prefill): no opts. Then no mask tells the blocks apart
  (`_inside`), and where an index reads a block's offsets and the blocks as one number (the max kernel's scores),
  tinygrad merges them into one range, which the GROUP before splits: past 16 there are no offsets of their own to
  unroll (blocks of 32: KernelOptError, every prefill on a GPU failed)."""
  if threads * unroll == 1: return ()
  rest = block_size // math.gcd(16, block_size)   # a block's offsets past the 16 threads: a REDUCE range of its own
  opts = (Opt(OptOps.GROUP, int(rest > 1), threads),) if threads > 1 else ()
  if unroll > 1: opts += (Opt(OptOps.UNROLL, 1 + int(threads > 1) + int(rest > 1), unroll),)
  return opts + ((Opt(OptOps.UNROLL, 1 + int(threads > 1), rest),) if rest > 1 else ())


def whole_warp(axis: int, size: int, threads: int) -> tuple:
  """A LOCAL over output axis `axis` (of `size`) that makes blocks of `threads` a warp of 32: the most of it up to
  32 // threads that divides it (() where none does: a block stays part of a warp)."""
  amount = math.gcd(size, max(1, 32 // threads))
  return (Opt(OptOps.LOCAL, axis, amount),) if amount > 1 else ()


def _exp_kernel(opts, S: UOp, scores: UOp, row_max: UOp) -> UOp:
  """scores[..., s] = exp(scores[..., s] - max of its row), in place, for s < S. `opts`: `exp_opts`."""
  R, MS = math.prod(scores.shape[:-1]), scores.shape[-1]
  scores, row_max = scores.flatten(), row_max.flatten()
  r, s = UOp.range(R, 0), UOp.range(S, 1)
  at = r * MS + s
  store = scores[at].store(((scores[at] - row_max[r]) * LOG2E).exp2())
  return UOp.sink(store.end(r, s), arg=KernelInfo(name=f"paged_exp_{R}", opts_to_apply=opts))


def exp_opts(device: str, rows: int, block_size: int) -> tuple | None:
  """`_exp_kernel`'s opts on a GPU: 16 threads along a row's keys (S is a whole number of blocks), rows enough a block
  for a warp (2, or 4 with blocks of 8), 4 rows a thread (the rows' grid axis stays under CUDA's 65,535 for a
  4,096-token chunk of 32 heads). tinygrad's heuristic, which cannot split the symbolic S, put a warp's threads on 32
  rows 4 KB apart, so every load and store of a warp touched 32 cache lines (lowered for the H100). None on the CPU
  device: its heuristic."""
  if portable.on_cpu(device): return None
  keys = math.gcd(16, block_size)
  opts = (Opt(OptOps.LOCAL, int(rows > 1), keys),) + (local := whole_warp(0, rows, keys))
  return opts + ((Opt(OptOps.UPCAST, 0, 4),) if rows // (local[0].arg if local else 1) % 4 == 0 else ())


def _values_kernel(opts, n_heads: int, D: int, block_size: int, quantized: bool, split: int, packed: bool, blocks: UOp, out: UOp,
                   scores: UOp, tables: UOp, v: UOp, *rest: UOp) -> UOp:
  """out `[T, H*D]` (token p*C + c, head kvh*G + g) = sum over the first `blocks` blocks of softmax weight x value
  row, read through the block table (row p, or `packed`, the token's sequence's). rest: token_seq when `packed`, v's
  scales when `quantized`, then the row maxima if `scores` are still scores; without them, `scores` hold
  exp(score - max) already. (Every parameter is read: tinygrad 0.14's CPU threads
  give their core id the slot after the buffers read, which an unread buffer before the last shifts onto a buffer's.)

  The sum runs over the offsets in a block (block_size, fixed) and the blocks (symbolic): tinygrad splits only a
  reduction of fixed size over a GPU's threads (GROUPTOP). A decode step has few outputs, each summing the whole
  context: tinygrad's heuristic groups a reduction only for at most 2048 outputs (one sequence of 32 heads of 64, not
  of 128: 256 threads, each looping over every key alone), so decode passes ask for it (`rope_attention`).

  `split`: the blocks taken `split` at a time, block hi * split + j, so that a decode step's opts can give j threads of
  their own and unroll the rest in each (`kernel_opts`): the symbolic loop over the blocks then has 1/split of the
  context, each iteration `DECODE_UNROLL` table entries and value reads, each value hanging on its entry; at batch 1 a
  thread's loop is the whole kernel's latency."""
  P, KVH, GC, MS = scores.shape
  MB, G = tables.shape[1], n_heads // scores.shape[1]
  C = GC // G
  token_seq, rest = (rest[0].flatten(), rest[1:]) if packed else (None, rest)
  v_scale, row_max = (rest[0] if quantized else None), (rest[-1].flatten() if len(rest) > quantized else None)
  out, scores, tables, v = (x.flatten() for x in (out, scores, tables, v))
  p, kvh, gc, d = UOp.range(P, 0), UOp.range(KVH, 1), UOp.range(GC, 2), UOp.range(D, 3)
  # the fixed ones first (GROUPTOP's axis 0, GROUP's next); the blocks `split` at a time: hi * split + j < blocks
  o, j = UOp.range(block_size, 4, AxisType.REDUCE), UOp.range(split, 5, AxisType.REDUCE)
  hi = UOp.range((blocks + split - 1) // split, 6, AxisType.REDUCE)
  b = hi * split + j
  inside = _inside(hi, j, blocks, split)
  g, c = gc // C, gc % C
  row = (p * KVH + kvh) * GC + gc
  weight = scores[_masked(row * MS + b * block_size + o, inside)]
  if row_max is not None: weight = ((weight - row_max[row]) * LOG2E).exp2()
  if inside is not None: weight = inside.where(weight, 0.0)
  entry = tables[_masked(_table_row(p, p * C + c, token_seq) * MB + b, inside)]   # 0 past the blocks: block 0, read harmlessly
  slot = _cache_block(entry, v, block_size, KVH, D) * block_size + o
  acc = (weight * _read(v, v_scale.flatten() if quantized else None, slot, kvh, d, KVH, D)).reduce(hi, j, o, arg=Ops.ADD)
  # the softmax's denominator, summed over the same runs of blocks and split over the same threads (tinygrad emits it
  # as a second loop beside the numerator's, reading the table entries and scores again: the sm_90 SASS): its
  # weight is tied to the block's table entry (>= 0: the runner maps freed entries to block 0), without which
  # tinygrad merges (b, o) into one range of the context's length, which no opt can split, and every thread summed the
  # whole context alone (lowered for an H100: 2,048 exps a thread at a 2,048-token context, beside the 128 of its share)
  total = ((entry >= 0).where(weight, 0.0)).reduce(hi, j, o, arg=Ops.ADD)
  store = out[((p * C + c) * n_heads + kvh * G + g) * D + d].store((acc / total).cast(out.dtype))
  return UOp.sink(store.end(p, kvh, gc, d), arg=KernelInfo(name=_kernel_name("values", P, G, C, packed), opts_to_apply=opts))


def kernel_opts(device: str, query_len: int, block_size: int, num_seqs: int = 1, kv_heads: int = 1, group: int = 1,
                head_dim: int = 1) -> tuple[tuple | None, tuple | None, int]:
  """tinygrad's optimizations for the scores and values kernels on a device (None: its heuristic picks them), and the
  runs of blocks the values kernel takes at a time (`_values_kernel`'s `split`), which its opts name. On the CPU
  device none: its heuristic unrolls every small axis of the two reductions (a 120 KB C source that took clang 5 s for
  4 sequences), and there these kernels only serve the portable backend's tests. For decode on a GPU,
  `decode_scores_opts` and `decode_values_opts`, the runs `decode_split`'s over threads and DECODE_UNROLL in each."""
  if portable.on_cpu(device): return (), (), 1
  if query_len > 1: return None, None, 1
  split = decode_split(num_seqs, block_size, group, head_dim)
  return (decode_scores_opts(block_size, num_seqs, kv_heads, group, head_dim),
          decode_values_opts(block_size, num_seqs, kv_heads, group, head_dim, split, DECODE_UNROLL), split * DECODE_UNROLL)


def decode_scores_opts(block_size: int, num_seqs: int, kv_heads: int, group: int, head_dim: int) -> tuple:
  """A decode step's scores on a GPU: a thread a key, its q heads' dot products at once (the K row read once for the
  group's G heads) over 8 elements of head_dim a step, 16 keys a block, of KV heads enough for a warp where they
  divide. tinygrad's heuristic gave each score a block of 16 threads of its own, 4 products a thread and a
  shared-memory sum (lowered for an H100: 65,536 blocks a layer at a 2,048-token context). The axes are (sequence, KV
  head, head in the group, key), those of size 1 dropped."""
  axes = [name for name, size in (("p", num_seqs), ("kvh", kv_heads), ("g", group)) if size > 1] + ["s"]
  opts = [Opt(OptOps.LOCAL, axes.index("s"), math.gcd(16, block_size))]
  if (heads := _heads_a_thread(group)) > 1: opts.append(Opt(OptOps.UPCAST, axes.index("g"), heads))
  if (unroll := math.gcd(8, head_dim)) > 1: opts.append(Opt(OptOps.UNROLL, 0, unroll))
  # KV heads (or else sequences) enough a block for a warp: a block of 16 keys was half of one, and a GPU holds a
  # bounded count of blocks an SM
  keys = math.gcd(16, block_size)
  pairing = [(axes.index(name), size) for name, size in (("kvh", kv_heads), ("p", num_seqs))
             if size > 1 and math.gcd(size, 32 // keys) > 1]
  return tuple(opts) + (whole_warp(*pairing[0], keys) if pairing else ())


def decode_values_opts(block_size: int, num_seqs: int, kv_heads: int, group: int, head_dim: int, split: int,
                       unroll: int) -> tuple:
  """A decode step's values on a GPU: an output's sum over 16 threads along a block's offsets and `split` along the
  blocks, `unroll` more runs of blocks in each (`_values_kernel`, `runs_opts`); a thread's outputs the group's heads (a value read once for G weighted sums) and 4
  consecutive elements (one 8-byte read of a value row). One element a thread, each of a key's 64 elements was a
  2-byte load of its own, in a block of its own, re-reading the value's 32-byte sector 16 times from L2. The axes are
  (sequence, KV head, head in the group, element), those of size 1 dropped."""
  offsets = math.gcd(16, block_size)
  axes = [name for name, size in (("p", num_seqs), ("kvh", kv_heads), ("g", group), ("d", head_dim)) if size > 1]
  opts = [Opt(OptOps.GROUPTOP, 0, offsets), *runs_opts(block_size, split, unroll)]
  # the elements first: an axis an opt takes whole is gone, and those after it renumber
  if (elements := math.gcd(4, head_dim)) > 1: opts.append(Opt(OptOps.UPCAST, axes.index("d"), elements))
  if (heads := _heads_a_thread(group)) > 1: opts.append(Opt(OptOps.UPCAST, axes.index("g"), heads))
  # without threads along the blocks an output has 16: outputs enough a block for a warp (the element axis renumbered
  # where the heads' upcast took theirs whole)
  if split == 1 and "d" in axes: opts += whole_warp(axes.index("d") - int(1 < heads == group), head_dim // elements, offsets)
  return tuple(opts)


def rope_attention(qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache,
                   slot_mapping: Tensor, group: AttentionGroup, scale: float, window: int | None = None) -> tuple[Tensor, PagedKVCache]:
  """RoPE, the cache write and attention of one group (kernels.AttentionGroup) from the qkv projection's output
  `[T, (H + 2 KVH) D]`. Returns (attention output `[T, H*D]`, the cache ordered after the write)."""
  q, cache = write(qkv, n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping)
  return attention(q, cache, group, scale, window, qkv.dtype), cache


def write(qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache,
          slot_mapping: Tensor, bias: Tensor | None = None, dtype=None) -> tuple[Tensor, PagedKVCache]:
  """q rotated `[T, H, D]` (float32) from the qkv projection's output, and the cache after k rotated and v are written
  into their slots. qkv `[S, T, width]` float32: the projection's tensor-core partial sums (kernels/gemm.py), which
  the write adds with `bias` and rounds to `dtype` (float caches only)."""
  T, D = qkv.shape[-2], cache.head_dim
  assert bias is None or qkv.ndim == 3, "a bias is added to partial sums only (rows carry theirs)"
  assert qkv.ndim == 2 or dtype is not None, "partial sums are rounded to the projection's dtype: pass it"
  qkv, cos_sin = qkv.contiguous(), cos_sin.contiguous()
  if cache.quantized:   # int8: the scale of each head vector is a row maximum, which tensor ops compute first
    assert qkv.ndim == 2, "partial sums are written to float caches only"
    q, k, v = portable.split_qkv(qkv, n_heads, n_kv_heads, D)
    q, cache = portable.rope_and_write_cache(q.float(), k, v, positions, cos_sin, cache, slot_mapping)
    return q.contiguous(), cache
  q = Tensor.empty(T, n_heads, D, dtype=dtypes.float32, device=qkv.device)
  fxn = functools.partial(_write_kernel, n_heads, D, portable.block_opts(qkv.device, T, D, axes=3), dtype or qkv.dtype)
  q, k, v = Tensor.custom_kernel(q, cache.k, cache.v, qkv, positions, cos_sin, slot_mapping, *(() if bias is None else (bias,)),
                                 fxn=fxn)[:3]
  return q, cache.written(k, v)


def attention(q: Tensor, cache: PagedKVCache, group: AttentionGroup, scale: float, window: int | None, dtype) -> Tensor:
  """Attention of one group's rotated q `[T, H, D]` (float32) over the cache it was written into: the output `[T, H*D]`
  as `dtype` (the model's), as the o projection reads it."""
  (T, n_heads, D), BS, n_kv_heads = q.shape, cache.k.shape[1], cache.k.shape[2]
  # a packed group is one row of its T tokens (group.query_len), each reading its sequence's table (token_seq)
  P, C, G = 1 if group.packed else group.num_seqs, group.query_len, n_heads // n_kv_heads
  seq_of = (group.token_seq.contiguous(),) if group.packed else ()
  scores_opts, values_opts, split = kernel_opts(str(q.device), C, BS, P, n_kv_heads, G, D)
  blocks = group.kernel_blocks if group.kernel_blocks is not None else group.used_blocks
  # a fixed extent (no captured pass's Variable: not the engine's path) lets tinygrad split the keys into blocks and
  # offsets, which the scores' opts do not name: its heuristic then
  if not isinstance(blocks, UOp) and scores_opts: scores_opts = None
  S_kernel = blocks * BS
  k_scale = (cache.k_scale,) if cache.quantized else ()
  v_scale = (cache.v_scale,) if cache.quantized else ()
  tables, q_pos = group.block_tables.contiguous(), group.q_pos.contiguous()
  # as wide as the extent can be: the Variable's maximum (a prefill shape's bound, or the table's width)
  width = blocks.vmax if isinstance(blocks, UOp) else tables.shape[1]
  full = Tensor.empty(P, n_kv_heads, G * C, width * BS, dtype=dtypes.float32, device=q.device)
  full = Tensor.custom_kernel(full, q, tables, q_pos, *seq_of, cache.k.reshape(-1), *k_scale,
                              fxn=functools.partial(_scores_kernel, scores_opts, BS, scale, window, group.packed, S_kernel))[0]
  # a decode step's few rows on a GPU: their blocks over threads too, and unrolled in each
  on_gpu, rows = not portable.on_cpu(str(q.device)), P * n_kv_heads * G * C
  threads, unroll = (max(1, MAX_SPLIT // P), DECODE_UNROLL) if C == 1 and on_gpu else (1, 1)
  row_max = Tensor.empty(P, n_kv_heads, G * C, 1, dtype=dtypes.float32, device=q.device)
  # the kernel's call binds the extent's Variable for the pass: no kernel here reads it through a tensor op's shape
  row_max = custom_kernel_binding(row_max, full, count=group.used_blocks, fxn=functools.partial(
    _max_kernel, max_opts(str(q.device), rows, BS, threads, unroll), BS, threads * unroll, blocks))[0]
  exponentiated = C > 1 or P * n_heads > EXP_INLINE_ROWS
  if exponentiated:
    full = Tensor.custom_kernel(full, row_max, fxn=functools.partial(_exp_kernel, exp_opts(str(q.device), rows, BS), S_kernel))[0]
  out = Tensor.empty(T, n_heads * D, dtype=dtype, device=q.device)
  out = Tensor.custom_kernel(out, full, tables, cache.v.reshape(-1), *seq_of, *v_scale, *(() if exponentiated else (row_max,)),
                             fxn=functools.partial(_values_kernel, values_opts, n_heads, D, BS, cache.quantized, split, group.packed, blocks))[0]
  return out
