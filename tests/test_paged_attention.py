"""kernels/paged.py: RoPE, the cache write and attention read through the block table in kernels written in UOps,
against float64 numpy on fresh random inputs (the references of tests/test_metal_kernels.py: RoPE from the table,
attention over a paged sequence, the int8 cache dequantized by tests/kv_reference.py). Tolerances as there: F32_TOL
for float32 activations and caches (float32 arithmetic in another order than numpy's float64), F16_TOL where q, K or V
are half (each value rounded to 2^-11 relative).

Each case runs inside TinyJit with the used extent as a bound variable, as the model runner captures it, and replays
at a second extent: the kernels read the extent as a kernel parameter, by name, and a replay must see the new value."""
from __future__ import annotations
import math
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context
from test_metal_kernels import F16_TOL, F32_TOL, attention_ref, random_heads, rel_err, rope_ref, rope_table
from kv_reference import dequantize_int8_ref, quantize_int8_ref
from test_replay import DEVICES
from tinyvllm.engine.replay import CountVariable
from tinyvllm.kernels import AttentionGroup, paged, portable
from tinyvllm.kernels.kv_cache import PagedKVCache

NP = {dtypes.float32: np.float32, dtypes.float16: np.float16}


def run_case(rng, P, C, H, KVH, D, BS, dtype, cache_dtype, window=None, NB=48, MB=8, packed: tuple[int, ...] | None = None):
  """Write P sequences' C new tokens each and attend, three times in a captured function (capture, two replays at
  other extents); checks the float cache's writes, returns [(output, reference)] per call, padding tokens left out.
  `packed`: instead P = len(packed) sequences' chunks of these lengths back to back in one row of C slots (the rest
  padding), each token finding its sequence through token_seq (kernels.AttentionGroup); their tables are disjoint."""
  lengths = list(packed) if packed else [C] * P
  if packed: P = len(lengths)
  T, G = C if packed else P * C, H // KVH
  # each slot's sequence and its index in that sequence's chunk (-1: padding)
  seq = np.full(T, -1) if packed else np.repeat(np.arange(P), C)
  if packed: seq[:sum(lengths)] = np.repeat(np.arange(P), lengths)
  index = np.concatenate([np.arange(n) for n in lengths] + [np.full(T - sum(lengths), -1)]) if packed else np.tile(np.arange(C), P)
  table_np = rope_table(MB * BS + 4, D, theta=500.0)
  if cache_dtype == "int8":
    k_codes, k_scale = quantize_int8_ref(random_heads(rng, (NB, BS, KVH, D)))
    v_codes, v_scale = quantize_int8_ref(random_heads(rng, (NB, BS, KVH, D)))
    cache_np = [k_codes, v_codes, k_scale, v_scale]
  else:
    cache_np = [random_heads(rng, (NB, BS, KVH, D)).astype(NP[cache_dtype]) for _ in range(2)]
  cache = PagedKVCache(*(Tensor(a.copy()).realize() for a in cache_np))
  tables_np = (rng.permutation(NB)[:P * MB].reshape(P, MB) if packed else np.stack([rng.permutation(NB)[:MB] for _ in range(P)])).astype(np.int32)
  extent = CountVariable.make("kv_blocks", MB)
  args = [Tensor(a).realize() for a in (table_np, tables_np)]

  token_seq = Tensor(seq.astype(np.int32)).realize()
  def attend(qkv, positions, slots, q_pos, bound):
    group = AttentionGroup(P, C, args[1], CountVariable.count(bound), q_pos, q_pos[:, -1] + 1, token_seq, packed=bool(packed),
                           kernel_blocks=extent.kernel_count())
    out, written = paged.rope_attention(qkv, H, KVH, positions, args[0], cache, slots, group, D ** -0.5, window)
    return out.realize(), written.k.realize()
  step = TinyJit(attend)

  results = []
  for used in (MB - 2, 3, MB):   # the capture's extent, then two replays
    # each sequence's last position; packed, the first in the extent's last block, the others anywhere before it
    last = rng.integers([max(n, (used - 1) * BS if i == 0 or not packed else n) for i, n in enumerate(lengths)], used * BS)
    flat = np.where(seq >= 0, last[seq] - np.array(lengths)[seq] + 1 + index, 0)             # [T]: padding at 0
    pos = flat.reshape(1 if packed else P, C).astype(np.int32)
    slots = np.array([tables_np[p, x // BS] * BS + x % BS if p >= 0 else -1 for p, x in zip(seq, flat)], np.int32)
    if P > 1 and not packed: slots[C - 1] = -1                      # a padding token: writes nothing
    qkv = random_heads(rng, (T, H + 2 * KVH, D)).astype(NP[dtype])
    out, k = step(Tensor(qkv.reshape(T, -1)).realize(), Tensor(pos.reshape(-1)).realize(), Tensor(slots).realize(),
                  Tensor(pos).realize(), extent.bind(used))
    rotated = rope_ref(qkv.astype(np.float64), pos.reshape(-1), table_np)                  # [T, H + 2 KVH, D]
    written = [s for s in range(T) if slots[s] >= 0]
    if cache_dtype == "int8":   # written by tensor ops: compare what the cache means
      k_ref, v_ref = (dequantize_int8_ref(c, s).reshape(NB * BS, KVH, D) for c, s in zip(cache_np[:2], cache_np[2:]))
      k_ref[slots[written]] = dequantize_int8_ref(*quantize_int8_ref(rotated[written, H:H + KVH]))
      v_ref[slots[written]] = dequantize_int8_ref(*quantize_int8_ref(qkv[written, H + KVH:].astype(np.float64)))
    else:
      k_ref, v_ref = (c.astype(np.float64).reshape(NB * BS, KVH, D).copy() for c in cache_np)
      k_ref[slots[written]], v_ref[slots[written]] = rotated[written, H:H + KVH], qkv[written, H + KVH:]
      cache_np = [k_ref.astype(NP[cache_dtype]).reshape(NB, BS, KVH, D), v_ref.astype(NP[cache_dtype]).reshape(NB, BS, KVH, D)]
    real = np.flatnonzero(seq >= 0)
    ref = np.stack([attention_ref(rotated[t, :H], k_ref.reshape(NB, BS, KVH, D), v_ref.reshape(NB, BS, KVH, D), tables_np[seq[t]],
                                  flat[t] + 1, D ** -0.5, window=window) for t in real])
    results.append((out.numpy().reshape(T, H, D)[real], ref))
    if cache_dtype != "int8":   # the rows written, and nothing else: padding tokens and other slots untouched
      k = k.numpy().reshape(NB * BS, KVH, D).astype(np.float64)
      untouched = np.setdiff1d(np.arange(NB * BS), slots[written])
      assert (k[untouched] == k_ref[untouched]).all()
      assert rel_err(k[slots[written]], k_ref[slots[written]]) < (F16_TOL if cache_dtype == dtypes.float16 else F32_TOL)
    cache_np = [t.numpy() for t in cache.tensors()]   # what the next call reads
  return results


@pytest.mark.parametrize("P,C,H,KVH,D,BS", [
    (1, 1, 4, 2, 64, 16),     # batch-1 decode: exp recomputed in the PV kernel
    (20, 1, 4, 1, 32, 8),     # 80 query rows: exp written once by a kernel of its own
    (2, 7, 6, 2, 128, 16),    # prefill chunks, GQA 3
    (3, 4, 8, 8, 80, 8),      # no GQA, a head_dim that is not a power of two
    (3, 1, 8, 8, 80, 8),      # decode without GQA: the scores' axes without the group's
    (2, 5, 4, 2, 64, 32),     # blocks of 32 tokens: prefill (its max kernel's offsets and blocks one range to tinygrad)
    (1, 1, 4, 2, 64, 32)])    # and decode (offsets past a block's 16 threads unrolled)
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("device", DEVICES)
def test_write_and_attention_match_numpy(P, C, H, KVH, D, BS, dtype, device):
  """On the CPU device the kernels run as written; on a GPU kind (the emulated METAL device here) with the
  optimizations a GPU gives them (`paged.kernel_opts`: tinygrad's heuristic, a split sum for decode values)."""
  rng = np.random.default_rng(P * 1000 + C * 100 + D)
  with Context(DEV=device):
    for out, ref in run_case(rng, P, C, H, KVH, D, BS, dtype, dtype):
      assert rel_err(out, ref) < (F16_TOL if dtype == dtypes.float16 else F32_TOL)


@pytest.mark.parametrize("lengths,C,H,KVH,D", [
    ((5, 1, 9), 16, 6, 2, 64),       # three chunks, one of a single token, and a padding slot
    ((7, 7), 14, 4, 4, 128),          # no padding, no GQA
    ((3, 12, 1, 4), 24, 8, 2, 80)])   # four chunks, 4 padding slots, a head_dim that is not a power of two
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_chunks_match_numpy(lengths, C, H, KVH, D, dtype, device):
  """Prefill chunks back to back (a packed group, as the runner sends a prefill step): each token reads its own
  sequence's table and sees its own context, whatever lies beside it in the row."""
  rng = np.random.default_rng(sum(lengths) * 10 + D)
  with Context(DEV=device):
    for out, ref in run_case(rng, 0, C, H, KVH, D, 8, dtype, dtype, packed=lengths):
      assert rel_err(out, ref) < (F16_TOL if dtype == dtypes.float16 else F32_TOL)


def test_packed_chunks_with_a_window_and_an_int8_cache():
  rng = np.random.default_rng(17)
  for out, ref in run_case(rng, 0, 20, 4, 2, 64, 8, dtypes.float32, dtypes.float32, window=13, packed=(6, 11)):
    assert rel_err(out, ref) < F32_TOL
  for out, ref in run_case(rng, 0, 16, 4, 2, 64, 16, dtypes.float32, "int8", packed=(2, 9, 3)):
    assert rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("P,MB,H,KVH", [(1, 21, 8, 2), (3, 12, 8, 2), (1, 12, 32, 2), (2, 5, 32, 1)])
def test_decode_over_blocks_not_a_multiple_of_the_split(device, P, MB, H, KVH):
  """A decode step's values kernel takes the blocks `paged.decode_split` at a time over threads of their own on a GPU
  (8 for one sequence, 2 for 3): extents of MB - 2, 3 and MB blocks (capture, then replays) end in part-filled runs,
  whose missing blocks must add nothing (their table entries and scores lie past the extent). Groups of 16 heads (a
  GLM-4-like 32 over 2) take 4 runs, their partial sums otherwise past Apple's 32 KB of threadgroup memory, and of 32
  (one KV head) a thread 16 of them, tinygrad's most."""
  rng = np.random.default_rng(MB + P + H)
  with Context(DEV=device):
    for out, ref in run_case(rng, P, 1, H, KVH, 64, 16, dtypes.float16, dtypes.float16, NB=64, MB=MB):
      assert rel_err(out, ref) < F16_TOL


def test_sliding_window():
  rng = np.random.default_rng(7)
  for out, ref in run_case(rng, 2, 3, 4, 2, 64, 8, dtypes.float32, dtypes.float32, window=13):
    assert rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("P,C", [(1, 1), (20, 1), (2, 5)])
def test_int8_cache_is_read_through_its_scales(P, C):
  rng = np.random.default_rng(11 + P + C)
  for out, ref in run_case(rng, P, C, 4, 2, 64, 16, dtypes.float32, "int8"):
    assert rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot", [-1, 37])
def test_a_lone_token_writes_its_slot_or_nothing(device, slot):
  """One token: its K and V into its slot, or with slot -1 (padding) nowhere, through both cache writes: this module's
  with RoPE and portable.write_kv's of given rows. With one token tinygrad dropped the store masks' check of the slot
  once (portable.slot_in_range), and slot -1 overwrote the cache's last row."""
  rng = np.random.default_rng(5)
  H, KVH, D, NB, BS = 4, 2, 32, 6, 8
  qkv, pos, table = random_heads(rng, (1, H + 2 * KVH, D)).astype(np.float32), np.array([9], np.int32), rope_table(64, D)
  rotated = rope_ref(qkv.astype(np.float64), pos, table)
  rows = [rotated[0, H:H + KVH].astype(np.float32), qkv[0, H + KVH:]]
  with Context(DEV=device):
    for write in ("rope", "rows"):
      before = [random_heads(rng, (NB, BS, KVH, D)).astype(np.float32) for _ in range(2)]
      cache = PagedKVCache(*(Tensor(a.copy()).realize() for a in before))
      slots = Tensor(np.array([slot], np.int32))
      if write == "rope":
        q, cache = paged.write(Tensor(qkv.reshape(1, -1)), H, KVH, Tensor(pos), Tensor(table), cache, slots)
        assert rel_err(q.numpy(), rotated[:, :H]) < F32_TOL
        got = [cache.k.numpy(), cache.v.numpy()]
      else: got = [t.numpy() for t in portable.write_kv([cache.k, cache.v], [Tensor(r[None]) for r in rows], slots)]
      for g, b, row in zip(got, before, rows):
        g, b = g.reshape(NB * BS, KVH, D), b.reshape(NB * BS, KVH, D)
        others = np.arange(NB * BS) != slot
        assert (g[others] == b[others]).all(), f"{write}: a row other than slot {slot} changed"
        if slot >= 0: assert rel_err(g[slot], row.astype(np.float64)) < F32_TOL


def _attention_lowered_for_h100(P, C, H, KVH, D, BS, NB, MB) -> dict:
  """name -> program of the attention of P sequences' C query tokens over an extent of up to MB blocks, captured on
  tinygrad's NULL device lowering for an H100 (nvrtc), the extent's variable bound to MB and MB - 1."""
  from test_cuda_compile import NVRTC, captured_programs_of, on_null_cuda
  if NVRTC is None: pytest.skip("nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
  with on_null_cuda():
    cache = PagedKVCache(*(Tensor.empty(NB, BS, KVH, D, dtype=dtypes.float16).realize() for _ in range(2)))
    tables, q = Tensor.empty(P, MB, dtype=dtypes.int32).realize(), Tensor.empty(P * C, H, D).realize()
    q_pos, extent = Tensor.empty(P, C, dtype=dtypes.int32).realize(), CountVariable.make("kv_blocks", MB)
    def attend(q, q_pos, bound):
      group = AttentionGroup(P, C, tables, CountVariable.count(bound), q_pos, q_pos[:, -1] + 1, kernel_blocks=extent.kernel_count())
      return paged.attention(q, cache, group, D ** -0.5, None, dtypes.float16).realize()
    step = TinyJit(attend)
    for used in (MB, MB - 1): step(q, q_pos, extent.bind(used))   # captured on the second call
  from types import SimpleNamespace
  return {p.arg.name: p for p in captured_programs_of(SimpleNamespace(jit=step))}


def test_decode_attention_lowered_for_the_h100():
  """The 1B model's decode attention lowered for an H100 (tinygrad's NULL device, nvrtc), at a 2,048-token extent: the
  scores kernel runs a thread a key and KV head, its group's 4 heads a thread, a warp a block (tinygrad's heuristic
  gave each score a block of 16 threads); the values kernel loops over the blocks only, the softmax's denominator split over the same
  threads as its numerator (merged into one range of the context's length, every thread summed all 2,048 weights)."""
  import re
  from tinygrad.uop.ops import Ops
  P, H, KVH, D, BS, NB, MB = 1, 32, 8, 64, 16, 256, 128
  programs = _attention_lowered_for_h100(P, 1, H, KVH, D, BS, NB, MB)
  at_full = {v.expr: v.vmax for p in programs.values() for v in p.arg.vars}
  g, l = programs["paged_scores_1_4_1"].arg.launch_dims(at_full)
  assert math.prod(g) * math.prod(l) == MB * BS * KVH and math.prod(l) == 32, (g, l)   # 16 keys of 2 KV heads a block
  source = next(u.arg for u in programs["paged_values_1_4_1"].src if u.op is Ops.SOURCE)
  bounds = re.findall(r"for \(int \w+ = 0; \w+ < ([^;]+);", source)
  assert len(bounds) >= 2 and not any("<<4" in b or "16" in b for b in bounds if not b.strip().isdigit()), bounds
  # a read of the cache through a table entry is one add and shift off it: the entry held to the cache's blocks and
  # the flat cache read (an unbounded entry into the [NB, BS, KVH, D] view took two modulos a read and 64-bit
  # arithmetic), in vectors of 4 halves where a thread reads consecutive elements (scores: 8 of a key's head a step)
  scores = next(u.arg for u in programs["paged_scores_1_4_1"].src if u.op is Ops.SOURCE)
  for name, text in (("scores", scores), ("values", source)):
    assert "%" not in text and "long" not in text, (name, text)
  assert re.search(r"half4 \w+ = \(\*\(\(half4\*\)\(\(data\d+_%d" % (NB * BS * KVH * D), scores), scores
  # the values: an output's sum over 16 offsets x 8 runs of blocks (128 threads), the group's 4 heads and 4 elements a
  # thread (a value read once, 8 bytes, for 16 sums): KVH x D/4 blocks
  g, l = programs["paged_values_1_4_1"].arg.launch_dims(at_full)
  assert math.prod(l) == 16 * paged.DECODE_SPLIT == 16 * paged.decode_split(1, BS, H // KVH, D) and math.prod(g) == KVH * D // 4, (g, l)
  assert re.search(r"half4 \w+ = \(\*\(\(half4\*\)\(\(data\d+_%d" % (NB * BS * KVH * D), source), source
  # the softmax's max alike: a row's 16 offsets x 4 runs of blocks (a tensor op, tinygrad gave a row 16 threads, each
  # looping over a 16th of it alone), a warp's lanes reading 32 consecutive scores
  g, l = programs[f"paged_max_{H}"].arg.launch_dims(at_full)
  assert math.prod(l) == 16 * paged.MAX_SPLIT and math.prod(g) == H, (g, l)
  maximum = next(u.arg for u in programs[f"paged_max_{H}"].src if u.op is Ops.SOURCE)
  assert "%" not in maximum, maximum
  from test_cuda_compile import loose_accesses
  count, loose = loose_accesses(maximum)
  assert count >= 1 and not loose, loose


@pytest.mark.parametrize("P, BS", [(1, 16), (32, 16), (1, 8), (32, 32)])
def test_decode_loops_over_blocks_unrolled_on_the_h100(P, BS):
  """The values and max kernels of a decode step (1B shapes, 2,048 tokens of blocks of 16; of 8 and 32 too, lowered
  for the H100) take `paged.DECODE_UNROLL` runs of blocks in each iteration of their symbolic loop, beside the runs
  over threads (8 and 4 at batch 1, none at 32): the loop's count is the extent's blocks over all runs, and each
  iteration reads that many table entries, independent of each other (one entry an iteration, then its value: a chain
  of two L2 round trips). A block of 32 has its offsets past the 16 threads unrolled too (their range of 2 was a loop
  around the symbolic one)."""
  import re
  from tinygrad.uop.ops import Ops
  H, KVH, D = 32, 8, 64
  MB = 2048 // BS
  programs = _attention_lowered_for_h100(P, 1, H, KVH, D, BS, max(MB * P, 256), MB)
  source = lambda name: next(u.arg for u in programs[name].src if u.op is Ops.SOURCE)
  table = f"data\\d+_{P * MB}"   # the block table's parameter, named by its size
  for name, runs in ((f"paged_values_{P}_4_1", paged.decode_split(P, BS, H // KVH, D)), (f"paged_max_{P * H}", max(1, paged.MAX_SPLIT // P))):
    runs *= paged.DECODE_UNROLL
    text = source(name)
    count = re.search(r"\(\(data\d+_>>(\d+)\)\+1\)", text)   # the extent's blocks (less one) over the runs, plus one
    assert count and 1 << int(count.group(1)) == runs, (name, text)
    loops = re.findall(r"for \(int \w+ = 0; \w+ < ([^;]+);", text)
    assert not loops[0].strip().isdigit(), (name, loops)   # the symbolic loop outermost
    if name.startswith("paged_values"):   # the numerator's loop (the denominator's, a second loop, reads them alike)
      body = text.split("for (int Ridx")[1]
      assert len(re.findall(r"\*\(%s\+" % table, body)) == paged.DECODE_UNROLL, (name, body)
  # and every kernel's blocks are whole warps (blocks of 16 threads left half of each warp idle, and a GPU holds a bounded
  # count of blocks an SM)
  at_full = {v.expr: v.vmax for p in programs.values() for v in p.arg.vars}
  blocks = {name: p.arg.launch_dims(at_full)[1] for name, p in programs.items()}
  assert all(math.prod(l) % 32 == 0 for l in blocks.values()), blocks


def test_the_split_fits_threadgroup_memory():
  """`decode_split` for the values kernel's partial sums (an output's threads x the heads and 4 elements a thread, and
  the heads' denominators, float32): 8 runs of blocks for one sequence of the 1B's groups of 4, halved for a group of
  16 (8 would take 40 KB where Apple gives 32), shared among sequences, none from 5 on."""
  assert [paged.decode_split(P, 16, 4, 64) for P in (1, 2, 3, 4, 5, 32)] == [8, 4, 2, 2, 1, 1]
  for G in (13, 16, 32):
    split = paged.decode_split(1, 16, G, 64)
    assert 16 * split * min(G, 16) * 5 * 4 <= paged.SHARED_BYTES < 16 * 2 * split * min(G, 16) * 5 * 4, (G, split)
  assert paged.decode_split(1, 8, 16, 64) == 8   # 8 offsets a block: half the threads


def test_prefill_exps_are_coalesced_on_the_h100():
  """A 128-token prefill of 32 heads writes exp(score - max) in place (`paged_exp`): with `paged.exp_opts` a warp's 16
  threads run along a row's keys, so each load and store of a warp touches at most twice the cache lines its bytes
  fill. tinygrad's heuristic (S is symbolic) put a warp on 32 rows 4 KB apart: 32 lines an access."""
  from tinygrad.uop.ops import Ops
  from test_cuda_compile import loose_accesses
  programs = _attention_lowered_for_h100(1, 128, 32, 8, 64, 16, 64, 16)
  (name, program), = [(n, p) for n, p in programs.items() if n.startswith("paged_exp")]
  count, loose = loose_accesses(next(u.arg for u in program.src if u.op is Ops.SOURCE))
  assert count >= 3 and not loose, (name, loose)
