"""Portable kernels written in tinygrad tensor ops: run on any tinygrad device and are the reference path.

Shapes: T flat tokens, P sequences of an attention group with C query slots each, H query heads,
KVH key/value heads, D head_dim, MB blocks per block table, BS block_size.
"""
from __future__ import annotations
import functools, math
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.uop.ops import KernelInfo
from tinyvllm.kernels.kv_cache import INT4_MAX, INT8_MAX, PagedKVCache, hadamard_tensor
from tinyvllm.quant.blocks import high_blocks
from tinyvllm.quant.formats import CODEBOOK


def on_cpu(device: str | tuple[str, ...]) -> bool:
  """Is this tinygrad's CPU device (a tuple: the devices a sharded tensor lives on)?"""
  return (device[0] if isinstance(device, tuple) else device).split(":")[0] == "CPU"


def inverse_rms(x: Tensor, eps: float) -> Tensor:
  """1 / sqrt(mean(x^2) + eps) of each row `[..., E] -> [..., 1]`, in float32: what RMSNorm scales a row by."""
  return (x.float().square().mean(-1, keepdim=True) + eps).rsqrt()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
  xf = x.float()
  return (xf * inverse_rms(xf, eps)).cast(x.dtype) * weight


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
  """x `[T, in]` @ weight `[out, in]`^T."""
  y = x @ weight.T
  return y if bias is None else y + bias


def gated(gate: Tensor, up: Tensor, act: str) -> Tensor:
  """act(gate) * up: SwiGLU ("silu") or GeGLU ("gelu_pytorch_tanh": GELU's tanh approximation, tinygrad's .gelu())."""
  return (gate.silu() if act == "silu" else gate.gelu()) * up


def split_qkv(qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
  """The fused projection's output `[T, (H + 2 KVH) D]` -> q `[T, H, D]`, k and v `[T, KVH, D]`."""
  T, D = qkv.shape[0], head_dim
  return (qkv[:, :n_heads * D].reshape(T, n_heads, D), qkv[:, n_heads * D:(n_heads + n_kv_heads) * D].reshape(T, n_kv_heads, D),
          qkv[:, (n_heads + n_kv_heads) * D:].reshape(T, n_kv_heads, D))


def rope(x: Tensor, cos_sin: Tensor) -> Tensor:
  """x `[T, heads, D]`, cos_sin `[T, D]` (cos of D/2 frequencies, then sin): HF rotate-half RoPE."""
  half = x.shape[-1] // 2
  cos, sin = cos_sin[:, None, :half].cast(x.dtype), cos_sin[:, None, half:].cast(x.dtype)
  x1, x2 = x[..., :half], x[..., half:]
  return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


def block_opts(device: str | tuple[str, ...], T: int, size: int, axes: int = 2) -> tuple:
  """tinygrad's opts for an elementwise custom kernel whose `axes` ranges are (T tokens, ..., `size` elements), no
  index dividing one (tinygrad would split it): on a GPU a block of up to 128 threads along the elements (without
  opts tinygrad launches such a kernel one thread a block: a 4096-token cache write of a 1B model was 8 million
  one-thread blocks a layer); on the CPU device none."""
  n = next((n for n in (128, 64, 32, 16, 8, 4, 2) if size % n == 0), 1)
  if on_cpu(device) or n == 1: return ()
  return (Opt(OptOps.LOCAL, axes - 1 - int(T == 1), n),)   # tinygrad's axes drop a range of size 1


def slot_in_range(slot: UOp, row_size: int, e: UOp, n_slots: int) -> UOp:
  """The mask of a cache store at `slot * row_size + e` (e in [0, row_size), with a range of the store's index): is the
  slot one of the cache's n_slots (a padding token's -1 is not)? Written as bounds on that index, not on the slot:
  tinygrad, flattening a buffer's shape inside a kernel, drops a store mask's clauses that name no range of the index,
  and with one token (its range of size 1 gone) a check on the slot alone is such a clause: slot -1 then wrapped onto
  the cache's last row."""
  at = slot * row_size + e
  return (at >= 0) & (at < n_slots * row_size)


def _cache_write_kernel(n: int, device: str | tuple[str, ...], *bufs: UOp) -> UOp:
  """caches[i][slot] = its row of token t, for every t with a slot in range and each of the n caches, in one kernel
  (bufs: the caches, their row tensors, the slots). A cache's row is everything after its first two axes (block,
  offset): `[KVH, D]` of K or V, `[KVH]` of scales. The rows are one tensor `[T, ...]` per cache, or one `[T, n, ...]`
  holding every cache's row side by side (offsets follow from the shapes, so a sharded device's smaller rows work
  alike). Padding tokens carry slot -1 and write nothing.

  Every store shares one pair of ranges, a token and an element of the longest row (K's and V's; a scale cache's row
  is shorter and stores only where the element is inside it). Ranges of their own per cache would be loops one after
  another on the CPU, but on a GPU every range is a grid axis, so the grid was their product: T^2 (KVH D)^2 threads for
  K and V (T^4 more with int8 scales), 6.9e10 for a 512-token step of a 1B model, which ran for minutes on the H100."""
  caches, rows, slots = bufs[:n], bufs[n:-1], bufs[-1]
  T = rows[0].shape[0]
  sizes = [math.prod(cache.shape[2:]) for cache in caches]
  longest = max(sizes)
  t, e = UOp.range(T, 0), UOp.range(longest, 1)
  slot, stores = slots[t], []
  for i, (cache, row_size) in enumerate(zip(caches, sizes)):
    src = rows[i] if len(rows) == n else rows[0]
    width, first = math.prod(src.shape[1:]), 0 if len(rows) == n else i * row_size
    inside = (e < row_size) if row_size < longest else None
    ok = slot_in_range(slot, row_size, e, cache.shape[0] * cache.shape[1])
    # guard the index itself: 0.14 rejects gated stores on an INDEX built from a multi-dim subscript
    dst = cache.flatten()[(slot * row_size + e).valid(ok if inside is None else ok & inside)]
    at = t * width + first + e
    stores.append(dst.store(src.flatten()[at if inside is None else at.valid(inside)].cast(cache.dtype)))
  name = "_".join(f"{size}{c.dtype.name}" for c, size in zip(caches, sizes))
  # the opts from the sizes this kernel sees: a tensor-parallel shard's rows are a part of the whole cache's
  opts = block_opts(device, T, longest)
  return UOp.sink(UOp.group(*stores).end(t, e), arg=KernelInfo(name=f"kv_cache_write_{T}_{name}", opts_to_apply=opts))


def _rows_kernel(factor: float | None, opts: tuple, out: UOp, table: UOp, tokens: UOp) -> UOp:
  T, N = out.shape
  t, e = UOp.range(T, 0), UOp.range(N, 1)
  token = tokens[t].cast(dtypes.weakint)   # the ranges' type, as paged._cache_block reads a table entry (its docstring)
  row = table[(token * N + e).valid((token >= 0) & (token < table.shape[0] // N))]   # 0 for an id out of range
  if factor is not None: row = row * UOp.const(factor, out.dtype)   # in the table's dtype, as HF scales Gemma's
  return UOp.sink(out.flatten()[t * N + e].store(row).end(t, e), arg=KernelInfo(name=f"embed_rows_{T}_{N}", opts_to_apply=opts))


def _int4_rows_kernel(group: int, factor: float | None, opts: tuple, out: UOp, words: UOp, scales: UOp, biases: UOp,
                      tokens: UOp) -> UOp:
  T, N = out.shape
  W = group // 8   # words a group
  # the element's group, word and nibble as ranges of their own: no index divides one (tinygrad would split it)
  t, g, w, n = UOp.range(T, 0), UOp.range(N // group, 1), UOp.range(W, 2), UOp.range(8, 3)
  token = tokens[t].cast(dtypes.weakint)
  ok = (token >= 0) & (token < words.shape[0] // (N // 8))
  word = words[(token * (N // 8) + g * W + w).valid(ok)]   # 0 for an id out of range, its scale and bias too
  at = (token * (N // group) + g).valid(ok)
  code = ((word >> (n * 4).cast(dtypes.uint32)) & 0xF).cast(dtypes.float32)
  row = (code * scales[at].cast(dtypes.float32) + biases[at].cast(dtypes.float32)).cast(out.dtype)
  if factor is not None: row = row * UOp.const(factor, out.dtype)
  store = out.flatten()[t * N + (g * W + w) * 8 + n].store(row)
  return UOp.sink(store.end(t, g, w, n), arg=KernelInfo(name=f"embed_int4_rows_{T}_{N}", opts_to_apply=opts))


def int4_table_rows(words: Tensor, scales: Tensor, biases: Tensor, tokens: Tensor, dtype, factor: float | None = None) -> Tensor:
  """`rows` of a 4-bit table (quant/formats.py's INT4: words `[V, N/8]`, scales and biases `[V, N/G]`), dequantized as
  `int4_rows` does (in float32, then rounded to `dtype`; times `factor` in `dtype`), in one kernel: tinygrad's gathers
  of the three parts and the dequantization were three kernels of a decode step on CUDA (two on Metal)."""
  T, N, group = tokens.shape[0], words.shape[1] * 8, words.shape[1] * 8 // scales.shape[1]
  out = Tensor.empty(T, N, dtype=dtype, device=words.device)
  fxn = functools.partial(_int4_rows_kernel, group, factor, int4_rows_opts(words.device, T, N, group))
  return Tensor.custom_kernel(out, words.reshape(-1), scales.reshape(-1), biases.reshape(-1), tokens, fxn=fxn)[0]


def int4_rows_opts(device: str | tuple[str, ...], T: int, N: int, group: int) -> tuple:
  """`int4_table_rows`' opts on a GPU: a word's 8 codes a thread, a block of the words of up to 128 // words-a-group
  groups (at least a warp); none on the CPU device."""
  if on_cpu(device): return ()
  first, words = int(T > 1), group // 8   # tinygrad's axes drop a range of size 1 (one token)
  groups = math.gcd(N // group, 128 // words)   # 1 where none divides (SmolLM2's 576 in groups of 64: 9), no opt then
  return (Opt(OptOps.UPCAST, first + 2, 8), Opt(OptOps.LOCAL, first + 1, words)) + ((Opt(OptOps.LOCAL, first, groups),) if groups > 1 else ())


def rows(table: Tensor, tokens: Tensor, factor: float | None = None) -> Tensor:
  """table[tokens] `[T, N]` (times `factor`, rounded to the table's dtype first) in one kernel: an embedding lookup.
  tinygrad's own gather is a sum over the vocabulary of where(arange == token), which it folds into one masked read
  per output, but for a decode step's few tokens it first splits that sum over threads: on CUDA two kernels and a
  buffer of partial rows (1 MB at batch 1 for Llama 3's 128,256 x 2048, 8 MB at 32 rows; lowered for the H100)."""
  T, N = tokens.shape[0], table.shape[1]
  out = Tensor.empty(T, N, dtype=table.dtype, device=table.device)
  return Tensor.custom_kernel(out, table.reshape(-1), tokens, fxn=functools.partial(_rows_kernel, factor, block_opts(table.device, T, N)))[0]


ARGMAX_RUN = 256        # a long row's argmax: the max of each run of this many keys first (one thread group a run) ...
ARGMAX_RUNS_PAD = 16    # ... the run count padded to a multiple of this, so tinygrad groups the second max's threads too


def argmax(x: Tensor) -> Tensor:
  """int32 index of each row's largest value `[..., V] -> [...]`, as numpy's argmax picks it: the first of equal maxima
  (-0.0 equal to 0.0), and the first NaN of a row holding one (tinygrad's own argmax ignores NaN on some devices).

  The max of a 64-bit key per element: the value's float32 bits made to order as the floats do (negatives' bits
  inverted, positives' top bit set; every NaN the largest key, -0.0 taken as 0.0) above V - 1 - its index (the first
  of equal values the largest). A row of at most ARGMAX_RUN * ARGMAX_RUNS_PAD keys is one reduction, one kernel. A
  longer one (a vocabulary) is two: the max of each run of ARGMAX_RUN keys, then of the runs. Left to itself tinygrad
  split Llama 3's 128,256 logits on CUDA into 256 threads of 501 keys each, 157 us of a 1.4 ms H100/H200 step; run
  by run it is 512 groups of 16 threads. Padding keys are 0, below every real key (a value's part is never 0)."""
  V = x.shape[-1]
  bits = (x == 0).where(0.0, x.float()).bitcast(dtypes.uint32)
  ordered = x.isnan().where(0xFFFFFFFF, (bits >= 0x80000000).where(bits ^ 0xFFFFFFFF, bits | 0x80000000))
  key = (ordered.cast(dtypes.uint64) << 32) | Tensor.arange(V - 1, -1, -1, dtype=dtypes.uint64).to(x.device)
  if V > ARGMAX_RUN * ARGMAX_RUNS_PAD:
    block = ARGMAX_RUN * ARGMAX_RUNS_PAD
    key = key.pad(((0, 0),) * (key.ndim - 1) + ((0, -V % block),)).reshape(*key.shape[:-1], -1, ARGMAX_RUN).max(-1).contiguous()
  return V - 1 - (key.max(-1) & 0xFFFFFFFF).cast(dtypes.int32)


def _split_kernel(sizes: tuple[int, ...], per_pass: tuple[bool, ...], feed: int | None, opts: tuple, *bufs: UOp) -> UOp:
  """outs[i] = the i-th run of `sizes` elements of src (bufs: the outputs, with `feed` one more, then src, then with
  `per_pass` the pass counter, then with `feed` the token history), on one grid of the longest run's elements: a
  shorter output stores where the element is inside it. Without per_pass the runs are back to back. With it (a
  multi-step run's inputs, `split`), the runs not per pass come first, then one group of the per-pass runs for each
  pass, and the group read is the counter's. With `feed`, run `feed` (the tokens) is stored a second time, fed from
  the history (`_fed`), into the output after the runs'."""
  n, fed = len(sizes), int(feed is not None)
  outs, fed_out, src = bufs[:n], bufs[n] if fed else None, bufs[n + fed]
  longest = max(sizes)
  e, stores = UOp.range(longest, 0), []
  run_len = sum(size for size, every in zip(sizes, per_pass) if not every)
  step = (bufs[n + fed + 1][0] * sum(size for size, every in zip(sizes, per_pass) if every)) if any(per_pass) else None
  at = {False: 0, True: run_len}
  for i, (out, size, every) in enumerate(zip(outs, sizes, per_pass)):
    inside = (e < size) if size < longest else None
    index = at[every] + e + (step if every else 0)
    ok = (index < src.shape[0]) if every else None   # a counter past the passes uploaded reads zeros, never past src
    ok = ok if inside is None else inside if ok is None else ok & inside
    value = src[index if ok is None else index.valid(ok)]
    at_e = e if inside is None else e.valid(inside)
    stores.append(out[at_e].store(value))
    if i == feed: stores.append(fed_out[at_e].store(_fed(value, bufs[-1])))
    at[every] += size
  name = f"split_{n}_{sum(at.values())}" + (f"_pass_{run_len}" if any(per_pass) else "") + ("_fed" if fed else "")
  return UOp.sink(UOp.group(*stores).end(e), arg=KernelInfo(name=name, opts_to_apply=opts))


def split(src: Tensor, sizes: tuple[int, ...], per_pass: tuple[bool, ...] = (), counter: Tensor | None = None,
          feed: tuple[int, Tensor] | None = None) -> list[Tensor]:
  """A 1-D tensor's consecutive runs of `sizes` elements as separate buffers, copied by one kernel (slices each cost
  a copy kernel of their own wherever a kernel needs a real buffer).

  A multi-step run uploads its passes' inputs at once: the runs marked `per_pass` change from one pass to the next and
  come after the others, one group per pass; `counter` `[1]` (int32, on the device) says which pass reads its group
  (`store_tokens` advances it). `feed` (run i, the token history): run i is also returned a second time, last, with
  each negative entry t read from the history (`_fed`), in the same kernel: a launch a pass fewer than a kernel of its
  own."""
  outs = [Tensor.empty(n, dtype=src.dtype, device=src.device) for n in sizes]
  per_pass = tuple(per_pass) or (False,) * len(sizes)
  fed = [Tensor.empty(sizes[feed[0]], dtype=src.dtype, device=src.device)] if feed is not None else []
  extra = ([counter] if any(per_pass) else []) + ([feed[1]] if feed is not None else [])
  kernel = functools.partial(_split_kernel, tuple(sizes), per_pass, feed[0] if feed is not None else None, block_opts(src.device, 1, max(sizes)))
  return Tensor.custom_kernel(*outs, *fed, src, *extra, fxn=kernel)[:len(sizes) + len(fed)]


# Multi-step decoding (ModelRunner.execute_steps) keeps the tokens it samples on the device: pass i of a run reads the
# argmax tokens of pass i - 1 without a round trip to the host. Each decode shape has a history of its runs' tokens,
# rows of P int32 (pass i's row p at i * P + p). A token field's entry t >= 0 is a token id; t < 0 means "the
# token at history[-t - 1]", and that row's new token goes P entries further on (a row of the next pass; past the last
# row, the first: a pipelined decode's runs take the rows in a ring, ModelRunner.launch_decodes). An entry t at or past
# -1 - len(history) (a padding row's) reads as token 0 and stores nothing.

def _fed(t: UOp, history: UOp) -> UOp:
  """Token entry t as a pass reads it: t itself, or for t < 0 history[-t - 1] (0 where that is out of range)."""
  return (t < 0).where(history[(-t - 1).valid((t < 0) & (-t - 1 < history.shape[0]))], t)


def _store_tokens_kernel(history: UOp, counter: UOp, tokens: UOp, sampled: UOp) -> UOp:
  P = tokens.shape[0]
  p = UOp.range(P, 0)
  t = tokens[p]
  slot = (t < 0).where((-t - 1 + P) % history.shape[0], p)   # the row after the one read, in a ring (a pipelined run's)
  store = history[slot.valid((t >= 0) | (-t - 1 < history.shape[0]))].store(sampled[p])   # a token read from past the history: none
  advance = counter[p.valid(p < 1)].store(counter[0] + 1)   # one thread moves the run on to its next pass
  return UOp.sink(UOp.group(store, advance).end(p), arg=KernelInfo(name=f"store_tokens_{P}", opts_to_apply=()))


def store_tokens(history: Tensor, counter: Tensor, tokens: Tensor, sampled: Tensor) -> tuple[Tensor, Tensor]:
  """Write each row's sampled token `[P]` into history, in place: row p at history[-t - 1 + P] where its input token t
  came from the history, else at history[p] (a run's first pass); and add 1 to the pass counter `[1]` (`split`).
  Returns both ordered after the writes."""
  return tuple(Tensor.custom_kernel(history, counter, tokens, sampled.cast(history.dtype), fxn=_store_tokens_kernel)[:2])


def write_kv(caches: list[Tensor], rows: list[Tensor], slot_mapping: Tensor) -> list[Tensor]:
  """Scatter each token's rows into caches `[NB, BS, ...]` at slot_mapping `[T]`, in place, every cache in one kernel
  (K and V and their scales: one launch per layer, not two or four). `rows`: rows[i] `[T, ...]` for cache i, or a
  single `[T, len(caches), ...]` with every cache's row side by side.

  Returns the caches ordered after the write; read them through the returned tensors. Writing with
  `cache[...].assign(...)` instead rewrites the whole cache each step (cost grows with the cache)."""
  return Tensor.custom_kernel(*caches, *(r.contiguous() for r in rows), slot_mapping,
                              fxn=functools.partial(_cache_write_kernel, len(caches), slot_mapping.device))[:len(caches)]


def quantize(rows: Tensor, levels: int) -> tuple[Tensor, Tensor]:
  """Head vectors `[..., D]` -> (codes in [-levels, levels] as float, float16 scales `[...]`), kernels/kv_cache.py's rule."""
  x = rows.float()
  # contiguous: stored as float16 before use; tinygrad folds a float32 -> float16 -> float32 round trip away, and
  # codes made with the unrounded scale would be off by up to 2^-11 relative once dequantized with the stored one
  scale = (x.abs().max(-1) / levels).cast(dtypes.float16).contiguous()
  s = scale.float().unsqueeze(-1)
  return (s > 0).where((x / (s > 0).where(s, 1.0)).round().clip(-levels, levels), 0.0), scale


def pack_int4(codes: Tensor) -> Tensor:
  """Codes in [-7, 7] `[..., D]` -> uint8 `[..., D/2]`: code + 8, element 2i in the low nibble."""
  c = (codes + 8).cast(dtypes.uint8)
  return c[..., 0::2] + c[..., 1::2] * 16


def unpack_int4(packed: Tensor, dtype) -> Tensor:
  """uint8 `[..., D/2]` -> codes `[..., D]` in `dtype`."""
  pairs = Tensor.stack(packed & 15, packed >> 4, dim=-1)
  return (pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2).cast(dtype) - 8)


def rotate(x: Tensor, head_dim: int) -> Tensor:
  """x `[..., D]` @ R (R symmetric: also R x), the int4 cache's Hadamard rotation."""
  return (x.float() @ hadamard_tensor(head_dim, x.device)).cast(x.dtype)


def rope_and_write_cache(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache,
                         slot_mapping: Tensor) -> tuple[Tensor, PagedKVCache]:
  """q `[T, H, D]` and k, v `[T, KVH, D]`: q and k rotated at their positions (cos_sin: the table), k and v written into
  their slots. Returns (rotated q, the cache ordered after the write)."""
  cs = cos_sin[positions]
  return rope(q, cs), write_cache(cache, rope(k, cs), v, slot_mapping)


def write_cache(cache: PagedKVCache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> PagedKVCache:
  """Write K and V rows `[T, KVH, D]` into their slots, quantized (and rotated) when the cache is."""
  if not cache.quantized:   # rotated k and v side by side: one kernel makes the rows (not one copy each), one writes both
    return cache.written(*write_kv([cache.k, cache.v], [k.stack(v, dim=1)], slot_mapping))
  (kq, ks), (vq, vs) = (_quantized(x, int4, rotated, cache.head_dim)
                        for x, int4, rotated in ((k, cache.k_int4, cache.k_rotated), (v, cache.v_int4, cache.v_rotated)))
  return cache.written(*write_kv([cache.k, cache.v, cache.k_scale, cache.v_scale], [kq, vq, ks, vs], slot_mapping))


def _quantized(x: Tensor, int4: bool, rotated: bool, head_dim: int) -> tuple[Tensor, Tensor]:
  """(stored codes, scales) of head vectors x for an int8 or int4 (packed, optionally rotated) tensor."""
  if rotated: x = rotate(x, head_dim)
  codes, scale = quantize(x, INT4_MAX if int4 else INT8_MAX)
  return (pack_int4(codes) if int4 else codes.cast(dtypes.int8)), scale


def _gather(cache: Tensor, scale: Tensor | None, block_tables: Tensor, dtype) -> Tensor:
  """Whole blocks by table index `[P, MB, BS, KVH, D]`, dequantized inside the expression that reads them."""
  rows = cache[block_tables]
  rows = unpack_int4(rows, dtype) if rows.dtype == dtypes.uint8 else rows.cast(dtype)
  return rows if scale is None else rows * scale[block_tables].cast(dtype).unsqueeze(-1)


def paged_attention(q: Tensor, cache: PagedKVCache, block_tables: Tensor, q_pos: Tensor, scale: float,
                    window: int | None = None, softcap: float | None = None) -> Tensor:
  """Attention of q `[P, C, H, D]` to each sequence's paged K/V.

  block_tables `[P, MB]` int32, q_pos `[P, C]` int32: query slot (p, c) sees the key positions 0..q_pos[p, c]
  of sequence p, which is causal within a chunk and full attention to the cached prefix; with a `window`, only
  positions above q_pos[p, c] - window. `softcap`: scores become softcap * tanh(scores / softcap) (Gemma 2).
  Every query sees its own position (padding slots: position 0), so padding rows stay finite; their output is
  ignored by the caller.
  """
  P, C, H, D = q.shape
  _, BS, KVH, _ = cache.k.shape
  G, S = H // KVH, block_tables.shape[1] * BS
  if cache.k_rotated: q = rotate(q, D)   # scores against rotated keys: (Rq).(Rk) = q.k
  # (P, MB, BS, KVH, D) -> (P, KVH, S, D): gathering whole blocks by table index compiles to direct loads
  k = _gather(cache.k, cache.k_scale, block_tables, q.dtype).reshape(P, S, KVH, D).permute(0, 2, 1, 3)
  v = _gather(cache.v, cache.v_scale, block_tables, q.dtype).reshape(P, S, KVH, D).permute(0, 2, 1, 3)
  q = q.reshape(P, C, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(P, KVH, G * C, D)          # (P, KVH, G*C, D)
  scores = (q @ k.transpose(-1, -2)).float() * scale                                      # (P, KVH, G*C, S)
  if softcap is not None: scores = (scores / softcap).tanh() * softcap
  key_pos, last = Tensor.arange(S).reshape(1, 1, 1, S), q_pos.reshape(P, 1, 1, C, 1).expand(P, 1, G, C, 1).reshape(P, 1, G * C, 1)
  visible = key_pos <= last
  if window is not None: visible = visible & (key_pos > last - window)
  scores = visible.where(scores, float("-inf"))
  # spelled out rather than .softmax(): measured 2x faster on CPU, and the final contiguous() stops the
  # scheduler from fusing two layers' P@V into one slow kernel
  e = (scores - scores.max(-1, keepdim=True)).exp().contiguous()
  out = ((e.cast(v.dtype) @ v).float() / e.sum(-1, keepdim=True)).cast(q.dtype).contiguous()  # (P, KVH, G*C, D)
  if cache.v_rotated: out = rotate(out, D).contiguous()   # sum_j p_j v_j = R sum_j p_j (R v_j)
  return out.reshape(P, KVH, G, C, D).permute(0, 3, 1, 2, 4).reshape(P, C, H, D)


def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, biases: Tensor, group_size: int) -> Tensor:
  """x `[M, K]` @ W^T with W `[N, K]` in 4-bit affine groups (packed uint32 `[N, K/8]`, scales and biases
  `[N, K/group_size]`, w = scale * q + bias; layout in docs/kernels.md). The codes are unpacked and scaled
  inside the matmul expression, which tinygrad fuses into one kernel: no float copy of W is ever stored."""
  assert x.shape[1] == packed.shape[1] * 8 == scales.shape[1] * group_size, (x.shape, packed.shape, scales.shape, group_size)
  return x @ int4_rows(packed, scales, biases, x.dtype).T


def int4_rows(packed: Tensor, scales: Tensor, biases: Tensor, dtype=dtypes.float32) -> Tensor:
  """Dequantize rows: packed `[T, K/8]` uint32, scales/biases `[T, K/G]` -> `[T, K]` in `dtype` (gathered rows
  of a 4-bit embedding, or a whole weight inside a lazy matmul expression)."""
  T, words = packed.shape
  q = Tensor.stack(*[(packed >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(T, scales.shape[1], -1)   # (T, K/G, G)
  return (q.cast(dtype) * scales.cast(dtype).reshape(T, -1, 1) + biases.cast(dtype).reshape(T, -1, 1)).reshape(T, words * 8)


def q8_rows(codes: Tensor, scales: Tensor) -> Tensor:
  """Dequantize gathered 8-bit rows: codes `[T, K]` int8, scales `[T, K/32]` -> float32 `[T, K]`."""
  T, K = codes.shape
  return (codes.cast(dtypes.float32).reshape(T, K // 32, 32) * scales.float().reshape(T, -1, 1)).reshape(T, K)


def packed_rows(w, dtype=dtypes.float32) -> Tensor:
  """Dequantize rows of a packed linear (quant/blocks.py; `w` a LinearWeights, or its gathered rows) -> `[T, K]` in
  `dtype`. The codes' nibbles and high bits are unpacked and scaled in float32 (a two-level scale is the product of
  a float16 and an integer, exact there) inside whatever expression reads them: in a matmul, tinygrad fuses it all
  into one kernel (it reads at most three buffers: the layout's reason for three arrays) and no float W is stored."""
  spec, T = w.spec, w.weight.shape[0]
  K = w.scales.shape[1] * spec.scale_inputs
  nib = w.weight[:, :K // 8]
  q = Tensor.stack(*[(nib >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(T, K)
  if spec.bits > 4:   # blocks of 32 bytes: byte i holds run j's input i's high bits at bits h*j (quant/blocks.py)
    h, runs = spec.bits - 4, K // 32
    R, NB = high_blocks(K, spec.bits)
    shifts = Tensor.arange(4, dtype=dtypes.uint32) * 8                                     # in the kernel: no buffer
    byte = (w.weight[:, K // 8:].reshape(T, NB, 1, 8, 1) >> shifts) & 0xFF               # [T, NB, 1, 32 bytes]
    high = (byte.reshape(T, NB, 1, 32) >> (Tensor.arange(R, dtype=dtypes.uint32) * h).reshape(1, 1, R, 1)) & ((1 << h) - 1)
    q = q + high.reshape(T, NB * R, 32)[:, :runs].reshape(T, K) * 16
  # [T, super-blocks, groups, inputs]: a two-level scale broadcasts its float16 over a super-block's groups
  sg = spec.super_groups or 1
  shape = (T, K // spec.group // sg, sg, 1)
  if spec.codebook:   # the table's values as constants in the expression (a table tensor would be a fourth buffer)
    value = (q == 1).where(float(CODEBOOK[1]), float(CODEBOOK[0]))
    for i, v in enumerate(CODEBOOK[2:], 2): value = (q == i).where(float(v), value)
    q = value
  qg = q.float().reshape(T, shape[1], sg, spec.group)
  if not spec.super_groups:
    S = w.scales.float().reshape(shape)
    out = S * (qg - spec.offset) if spec.symmetric else S * qg + w.biases.float().reshape(shape)
  elif spec.symmetric: out = w.scales.float().reshape(shape) * w.scale_d.float().reshape(T, -1, 1, 1) * (qg - spec.offset)
  else:
    sc, mn = k_scales_mins(w.scales) if spec.k_scales else (w.scales[..., 0], w.scales[..., 1])
    d = w.scale_d.float().reshape(T, -1, 1, 2)
    out = (sc.float().reshape(shape[:3]) * d[..., 0]).unsqueeze(-1) * qg - (mn.float().reshape(shape[:3]) * d[..., 1]).unsqueeze(-1)
  return out.reshape(T, K).cast(dtype)


def k_scales_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
  """A k_scales layout's 12 bytes per super-block (`[..., 12]` uint8) -> its 8 scales and 8 mins (`[..., 8]` int32 each),
  as quant/blocks.k_scales_mins unpacks them: groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins),
  groups 4-7 with their low 4 bits in bytes 8-11 (scale low nibble, min high) and their top 2 from bytes 0-7's.
  One expression for both halves (h = 0, 1 for groups 0-3, 4-7) rather than two joined: inside a matmul every weight
  computes its group's scale, and a join computes both halves and picks one (1.7x the time of byte scales on the CPU
  device's generated code for a 4096x4096 Q4_K GEMV, where this form takes 1.15x)."""
  b = packed.cast(dtypes.int32).reshape(*packed.shape[:-1], 3, 4)   # bytes 0-3, 4-7, 8-11
  h = Tensor.arange(2, dtype=dtypes.int32).reshape(2, 1)   # computed in the kernel: no buffer
  def field(low: Tensor, top: Tensor, shift) -> Tensor:   # h = 0: low & 63; h = 1: (low >> shift) & 15 | top's 2 bits << 4
    return (((low >> shift) & (63 - 48 * h)) | (((top >> 6) << 4) * h)).flatten(-2)
  return field(b[..., 0::2, :], b[..., 0:1, :], 0), field(b[..., 1:3, :], b[..., 1:2, :], 4 * h)


def packed_linear(x: Tensor, w) -> Tensor:
  """x `[M, K]` @ W^T for a packed linear (quant/blocks.py), W dequantized inside the matmul expression."""
  return x @ packed_rows(w, x.dtype).T


def q8_linear(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
  """x `[M, K]` @ W^T with W 8-bit (int8 codes `[N, K]`, a float16 scale per 32), dequantized inside the matmul."""
  return x @ q8_rows(codes, scales).cast(x.dtype).T
