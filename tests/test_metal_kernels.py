"""Every .metal kernel, run by the emulator, against a float64 numpy reference on fresh random inputs.

Each case builds its inputs once and runs them through a `runner`: "direct" launches the emulator on numpy arrays
with the launch description from tinyvllm.kernels.metal (fast: the big shape matrix), "emulator" and "metal" go
through the public functions on tinygrad Tensors (tests/test_metal_device.py reuses these cases on a Mac).

Tolerances, relative error ||out - ref|| / ||ref||:
  * F32_TOL 1e-4: float32 storage, float accumulation in a different order than numpy's float64, and the GPU's
    exp (a few ulp); measured errors are ~1e-7, the margin covers Metal's fast paths and sums over long contexts.
  * F16_TOL 3e-3: half storage of q/K/V/x or of the output rounds each value to 2^-11 relative (~4.9e-4 worst,
    ~2e-4 RMS measured), then accumulated in float; 3e-3 leaves room for Metal's half conversions and fast math.
"""
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.kernels import metal as M
from tinyvllm.kernels.emulator import EmulatorError, compile_source

F32_TOL, F16_TOL = 1e-4, 3e-3
NP = {dtypes.float32: np.float32, dtypes.float16: np.float16}
DT_PAIRS = [(dtypes.float32, dtypes.float32), (dtypes.float16, dtypes.float16), (dtypes.float32, dtypes.float16),
            (dtypes.float16, dtypes.float32)]
GQA = [(4, 4), (6, 2), (8, 2), (8, 1)]  # (n_heads, n_kv_heads): ratios 1, 3, 4, 8


def attention_cases(dt_pairs):
  """Parametrize a test over (D, bs, heads, dts): every head_dim, block size and GQA ratio, with these dtype pairs."""
  cases = [pytest.param(D, bs, heads, dts, id=f"{D}-{bs}-gqa{heads[0] // heads[1]}-{dts[0].name}-{dts[1].name}")
           for D in M.HEAD_DIMS for bs in M.BLOCK_SIZES for heads in GQA for dts in dt_pairs]
  return pytest.mark.parametrize("D,bs,heads,dts", cases)

# **** references (float64) ****


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
  assert np.isfinite(out).all(), "non-finite output"
  return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def tol(*dts) -> float: return F16_TOL if dtypes.float16 in dts else F32_TOL


def attention_ref(qv, k_cache, v_cache, table_row, ctx, scale):
  """One token's heads qv [H, D] against keys 0..ctx-1 of a paged sequence."""
  H, D = qv.shape
  bs, KVH = k_cache.shape[1], k_cache.shape[2]
  if ctx <= 0: return np.zeros((H, D))
  k = np.arange(ctx)
  slots = table_row[k // bs] * bs + k % bs
  K = k_cache.reshape(-1, KVH, D)[slots].astype(np.float64)
  V = v_cache.reshape(-1, KVH, D)[slots].astype(np.float64)
  out = np.zeros((H, D))
  for h in range(H):
    s = K[:, h // (H // KVH)] @ qv[h].astype(np.float64) * scale
    p = np.exp(s - s.max())
    out[h] = (p / p.sum()) @ V[:, h // (H // KVH)]
  return out


def decode_ref(q, k_cache, v_cache, tables, lens, scale):
  return np.stack([attention_ref(q[b], k_cache, v_cache, tables[b], lens[b], scale) for b in range(len(q))])


def prefill_ref(q, k_cache, v_cache, tables, token_seq, token_pos, scale):
  return np.stack([attention_ref(q[t], k_cache, v_cache, tables[token_seq[t]], token_pos[t] + 1, scale) if token_seq[t] >= 0
                   else np.zeros(q.shape[1:]) for t in range(len(q))])


def rope_table(max_pos: int, d: int, theta: float = 10000.0) -> np.ndarray:
  ang = np.arange(max_pos)[:, None] / theta ** (np.arange(0, d, 2) / d)[None]
  return np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32)


def rope_ref(x, positions, cos_sin):
  h = x.shape[-1] // 2
  c, s = cos_sin[positions][:, None, :h].astype(np.float64), cos_sin[positions][:, None, h:].astype(np.float64)
  x1, x2 = x[..., :h].astype(np.float64), x[..., h:].astype(np.float64)
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def quantize_int4(rng, n, k, g):
  """Random 4-bit codes in the shared layout; returns (packed, scales, biases, dequantised float64 W)."""
  q = rng.integers(0, 16, (n, k)).astype(np.uint32)
  scales = (rng.random((n, k // g)) * 0.1 + 0.01).astype(np.float16)
  biases = (rng.standard_normal((n, k // g)) * 0.1).astype(np.float16)
  packed = np.zeros((n, k // 8), np.uint32)
  for j in range(8): packed |= q[:, j::8] << (4 * j)  # lowest k in the lowest nibble
  w = q.reshape(n, k // g, g) * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]
  return packed, scales, biases, w.reshape(n, k)


# **** inputs ****


def paged_inputs(rng, lens, bs, KVH, D, cache_dt, extra_blocks=2):
  """Caches full of random values and block tables built from a shuffled free list (non-contiguous, unused = 0)."""
  need = sum(-(-n // bs) for n in lens)
  num_blocks = need + extra_blocks + 3
  k_cache = rng.standard_normal((num_blocks, bs, KVH, D)).astype(NP[cache_dt])
  v_cache = rng.standard_normal((num_blocks, bs, KVH, D)).astype(NP[cache_dt])
  free = rng.permutation(num_blocks)
  tables = np.zeros((len(lens), max(-(-n // bs) for n in lens) + extra_blocks), np.int32)
  i = 0
  for s, n in enumerate(lens):
    tables[s, :-(-n // bs)] = free[i:i - (-n // bs)]
    i -= -n // bs
  return k_cache, v_cache, tables


# **** runners: numpy in, numpy out ****

_libs = {}


def direct_run(launch, arrays, order="forward", seed=0):
  if launch.source not in _libs: _libs[launch.source] = compile_source(M.shader_source(launch.source), launch.source)
  _libs[launch.source].run(launch.kernel, list(arrays) + [np.array(launch.params, np.int32)], launch.grid, launch.threads,
                           order=order, seed=seed)


def run_decode(runner, q, k_cache, v_cache, tables, lens, scale, partition_size=None, order="forward"):
  if runner == "direct":
    B, H, D = q.shape
    ls = M.decode_launches(B, H, k_cache.shape[2], D, k_cache.shape[1], tables.shape[1], dtypes.float16 if q.dtype == np.float16
                           else dtypes.float32, dtypes.float16 if k_cache.dtype == np.float16 else dtypes.float32, scale, partition_size)
    out = np.zeros_like(q)
    if len(ls) == 1: direct_run(ls[0], [q, k_cache, v_cache, tables, lens, out], order)
    else:
      n = ls[0].grid[0]
      tmp, sums, maxes = np.zeros((B, H, n, D), np.float32), np.zeros((B, H, n), np.float32), np.zeros((B, H, n), np.float32)
      direct_run(ls[0], [q, k_cache, v_cache, tables, lens, tmp, sums, maxes], order)
      direct_run(ls[1], [tmp, sums, maxes, lens, out], order)
    return out
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (q, k_cache, v_cache, tables, lens)]
  return M.paged_attention_decode(*t, scale, backend=runner, partition_size=partition_size).numpy()


def run_prefill(runner, q, k_cache, v_cache, tables, token_seq, token_pos, scale, order="forward"):
  if runner == "direct":
    T, H, D = q.shape
    launch = M.prefill_launch(T, H, k_cache.shape[2], D, k_cache.shape[1], tables.shape[1], dtypes.float16 if q.dtype == np.float16
                              else dtypes.float32, dtypes.float16 if k_cache.dtype == np.float16 else dtypes.float32, scale)
    out = np.zeros_like(q)
    direct_run(launch, [q, k_cache, v_cache, tables, token_seq, token_pos, out], order)
    return out
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (q, k_cache, v_cache, tables, token_seq, token_pos)]
  return M.paged_attention_prefill(*t, scale, backend=runner).numpy()


def run_rope(runner, q, k, v, pos, cos_sin, k_cache, v_cache, slots, order="forward"):
  if runner == "direct":
    T, H, D = q.shape
    launch = M.rope_launch(T, H, k.shape[1], D, dtypes.float16 if q.dtype == np.float16 else dtypes.float32,
                           dtypes.float16 if k_cache.dtype == np.float16 else dtypes.float32)
    q_out, kc, vc = np.zeros_like(q), k_cache.copy(), v_cache.copy()
    direct_run(launch, [q, k, v, pos, cos_sin, slots, q_out, kc, vc], order)
    return q_out, kc, vc
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (q, k, v, pos, cos_sin, k_cache, v_cache, slots)]
  return tuple(x.numpy() for x in M.rope_and_cache_write(*t, backend=runner))


def run_int4(runner, x, packed, scales, biases, g, order="forward"):
  if runner == "direct":
    launch = M.int4_launch(x.shape[0], packed.shape[0], x.shape[1], g, dtypes.float16 if x.dtype == np.float16 else dtypes.float32)
    y = np.zeros((x.shape[0], packed.shape[0]), x.dtype)
    direct_run(launch, [x, packed, scales, biases, y], order)
    return y
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (x, packed, scales, biases)]
  return M.int4_matmul(*t, g, backend=runner).numpy()


# **** cases: build inputs, run, compare ****


def decode_case(runner, D, bs, heads, dts, partition_size=None, lens=(1, 37, 0, 70, 16), seed=0, order="forward"):
  (H, KVH), (qdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  k_cache, v_cache, tables = paged_inputs(rng, lens, bs, KVH, D, cdt)
  q = rng.standard_normal((len(lens), H, D)).astype(NP[qdt])
  lens = np.array(lens, np.int32)
  out = run_decode(runner, q, k_cache, v_cache, tables, lens, D ** -0.5, partition_size, order)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert not out[lens == 0].any(), "a padding row must give zeros"
  err = rel_err(out, decode_ref(q, k_cache, v_cache, tables, lens, D ** -0.5))
  assert err < tol(qdt, cdt), err
  return err


def prefill_case(runner, D, bs, heads, dts, seed=0, order="forward", chunk=None):
  """chunk: (lens, token_seq, token_pos); default: the last 6 tokens of seq 0, a padding token, all 9 of seq 1,
  the last 13 of seq 2."""
  (H, KVH), (qdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  lens, token_seq, token_pos = chunk or ((45, 9, 70), [0] * 6 + [-1] + [1] * 9 + [2] * 13,
                                         list(range(39, 45)) + [0] + list(range(9)) + list(range(57, 70)))
  k_cache, v_cache, tables = paged_inputs(rng, lens, bs, KVH, D, cdt)
  token_seq, token_pos = np.array(token_seq, np.int32), np.array(token_pos, np.int32)
  q = rng.standard_normal((len(token_seq), H, D)).astype(NP[qdt])
  out = run_prefill(runner, q, k_cache, v_cache, tables, token_seq, token_pos, D ** -0.5, order)
  assert out.dtype == q.dtype and not out[token_seq < 0].any()
  err = rel_err(out, prefill_ref(q, k_cache, v_cache, tables, token_seq, token_pos, D ** -0.5))
  assert err < tol(qdt, cdt), err
  return err


def rope_case(runner, D, heads, dts, seed=0, order="forward"):
  (H, KVH), (xdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  T, num_blocks, bs = 9, 5, 8
  q, k, v = (rng.standard_normal((T, h, D)).astype(NP[xdt]) for h in (H, KVH, KVH))
  pos = rng.integers(0, 200, T).astype(np.int32)
  cos_sin = rope_table(256, D)
  slots = rng.permutation(num_blocks * bs)[:T].astype(np.int32)
  slots[[2, 5]] = -1  # padding tokens: no cache write
  k_cache, v_cache = (rng.standard_normal((num_blocks, bs, KVH, D)).astype(NP[cdt]) for _ in range(2))
  q_out, kc, vc = run_rope(runner, q, k, v, pos, cos_sin, k_cache, v_cache, slots, order)
  k_ref, v_ref = k_cache.reshape(-1, KVH, D).astype(np.float64), v_cache.reshape(-1, KVH, D).astype(np.float64)
  ok = slots >= 0
  k_ref[slots[ok]], v_ref[slots[ok]] = rope_ref(k, pos, cos_sin)[ok], v[ok]
  errs = rel_err(q_out, rope_ref(q, pos, cos_sin)), rel_err(kc.reshape(k_ref.shape), k_ref), rel_err(vc.reshape(v_ref.shape), v_ref)
  assert max(errs) < tol(xdt, cdt), errs
  return max(errs)


def int4_case(runner, m, n, k, g, xdt, seed=0, order="forward"):
  rng = np.random.default_rng(seed)
  packed, scales, biases, w = quantize_int4(rng, n, k, g)
  x = rng.standard_normal((m, k)).astype(NP[xdt])
  y = run_int4(runner, x, packed, scales, biases, g, order)
  assert y.dtype == x.dtype and y.shape == (m, n)
  err = rel_err(y, x.astype(np.float64) @ w.T)
  assert err < tol(xdt), err
  return err


INT4_SHAPES = [(1, 72, 256), (3, 64, 512), (8, 40, 384), (9, 40, 256), (40, 72, 256), (65, 33, 128)]

# **** tests ****


@attention_cases(DT_PAIRS[:3])
def test_decode(D, bs, heads, dts):
  decode_case("direct", D, bs, heads, dts)
  decode_case("direct", D, bs, heads, dts, partition_size=2 * bs, seed=1)  # partitioned + reduce, 1..5 partitions


@attention_cases(DT_PAIRS[:3])
def test_prefill(D, bs, heads, dts):
  prefill_case("direct", D, bs, heads, dts)


@pytest.mark.parametrize("dts", DT_PAIRS, ids=lambda d: f"{d[0].name}-{d[1].name}")
@pytest.mark.parametrize("D", M.HEAD_DIMS)
def test_rope_and_cache_write(D, dts):
  rope_case("direct", D, (6, 2), dts)


@pytest.mark.parametrize("xdt", [dtypes.float32, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("g", M.GROUP_SIZES)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int4_matmul(shape, g, xdt):
  m, n, k = shape
  if k % g: pytest.skip("K must be a multiple of the group size")
  int4_case("direct", m, n, k, g, xdt)


def test_decode_long_context_partitions_automatically():
  ls = M.decode_launches(2, 8, 2, 64, 16, 100, dtypes.float16, dtypes.float16, 0.125)
  assert [l.kernel for l in ls] == ["paged_attention_decode_partitioned_f16_f16_64_g4", "paged_attention_reduce_f16"]
  assert ls[0].grid == (4, 2, 2)  # 1600 keys / 512 per partition
  assert len(M.decode_launches(2, 8, 2, 64, 16, 64, dtypes.float16, dtypes.float16, 0.125)) == 1
  decode_case("direct", 128, 16, (8, 2), (dtypes.float16, dtypes.float16), lens=(1500, 3, 700, 1024), seed=2)


def test_random_batches():
  """Random batch compositions: lengths 0..150, random shapes and dtypes, shuffled chunk tokens, partitions."""
  rng = np.random.default_rng(11)
  for i in range(12):
    D, bs = int(rng.choice(M.HEAD_DIMS)), int(rng.choice(M.BLOCK_SIZES))
    heads, dts = GQA[rng.integers(len(GQA))], DT_PAIRS[rng.integers(len(DT_PAIRS))]
    lens = tuple(int(n) for n in rng.integers(0, 150, rng.integers(1, 6)))
    decode_case("direct", D, bs, heads, dts, partition_size=int(rng.choice([0, bs, 4 * bs])), lens=lens, seed=i)
    lens = tuple(max(1, n) for n in lens)
    token_seq, token_pos = [], []
    for s_, n in enumerate(lens):
      new = int(rng.integers(1, n + 1))
      token_seq += [s_] * new
      token_pos += list(range(n - new, n))
    token_seq += [-1] * int(rng.integers(0, 3))
    token_pos += [0] * (len(token_seq) - len(token_pos))
    perm = rng.permutation(len(token_seq))
    chunk = (lens, [token_seq[j] for j in perm], [token_pos[j] for j in perm])
    prefill_case("direct", D, bs, heads, dts, seed=i, chunk=chunk)


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_lane_orders(order):
  for seed in range(2):
    decode_case("direct", 80, 16, (6, 2), (dtypes.float16, dtypes.float16), seed=seed, order=order)
    decode_case("direct", 64, 8, (8, 1), (dtypes.float32, dtypes.float32), partition_size=16, seed=seed, order=order)
    prefill_case("direct", 96, 8, (8, 2), (dtypes.float16, dtypes.float32), seed=seed, order=order)
    rope_case("direct", 64, (4, 2), (dtypes.float32, dtypes.float16), seed=seed, order=order)
    int4_case("direct", 5, 72, 256, 64, dtypes.float32, seed=seed, order=order)
    int4_case("direct", 40, 72, 256, 32, dtypes.float16, seed=seed, order=order)


def test_public_functions_on_emulator():
  """The same kernels through the public Tensor functions (custom_kernel + trampoline on the CPU device)."""
  decode_case("emulator", 64, 16, (8, 2), (dtypes.float32, dtypes.float32))
  decode_case("emulator", 128, 8, (6, 2), (dtypes.float16, dtypes.float16), partition_size=32)
  prefill_case("emulator", 80, 16, (6, 2), (dtypes.float32, dtypes.float32))
  rope_case("emulator", 64, (6, 2), (dtypes.float32, dtypes.float32))
  int4_case("emulator", 4, 64, 256, 64, dtypes.float32)
  int4_case("emulator", 20, 64, 256, 64, dtypes.float32)


def test_tinyjit_decode_step():
  """A jitted step (rope + cache write, decode, prefill, int4) replayed with changed inputs gives fresh results."""
  rng = np.random.default_rng(7)
  D, H, KVH, bs, num_blocks, K, N, g = 64, 8, 2, 8, 24, 128, 40, 32
  k_cache = Tensor(rng.standard_normal((num_blocks, bs, KVH, D)).astype(np.float32)).realize()
  v_cache = Tensor(rng.standard_normal((num_blocks, bs, KVH, D)).astype(np.float32)).realize()
  k_ref, v_ref = k_cache.numpy().reshape(-1, KVH, D).astype(np.float64), v_cache.numpy().reshape(-1, KVH, D).astype(np.float64)
  cos_sin = rope_table(128, D)
  cs = Tensor(cos_sin).realize()
  packed, scales, biases, w = quantize_int4(rng, N, K, g)
  wt = [Tensor(a).realize() for a in (packed, scales, biases)]
  tables = np.array([[3, 17, 5, 9, 0, 0], [11, 2, 20, 7, 14, 0]], np.int32)
  bt = Tensor(tables).realize()

  @TinyJit
  def step(q, k, v, pos, slots, lens, x):
    q_rot, kc, vc = M.rope_and_cache_write(q, k, v, pos, cs, k_cache, v_cache, slots, backend="emulator")
    o = M.paged_attention_decode(q_rot, kc, vc, bt, lens, D ** -0.5, backend="emulator")
    seq = Tensor([0, 1], dtype=dtypes.int32)
    p = M.paged_attention_prefill(q_rot, kc, vc, bt, seq, pos, D ** -0.5, backend="emulator")
    y = M.int4_matmul(x, *wt, g, backend="emulator")
    return o.realize(), p.realize(), y.realize()

  lens = np.array([13, 30], np.int32)
  for _ in range(5):  # call 0 eager, 1 captures, 2.. replay
    pos = lens - 1
    slots = np.array([tables[b, p // bs] * bs + p % bs for b, p in enumerate(pos)], np.int32)
    q, k, v = (rng.standard_normal((2, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    x = rng.standard_normal((2, K)).astype(np.float32)
    o, p, y = step(*[Tensor(a).realize() for a in (q, k, v, pos, slots, lens, x)])
    k_ref[slots], v_ref[slots] = rope_ref(k, pos, cos_sin), v
    ref = decode_ref(rope_ref(q, pos, cos_sin), k_ref.reshape(num_blocks, bs, KVH, D), v_ref.reshape(num_blocks, bs, KVH, D),
                     tables, lens, D ** -0.5)
    assert rel_err(o.numpy(), ref) < F32_TOL
    assert rel_err(p.numpy(), ref) < F32_TOL  # prefill of the same tokens = decode
    assert rel_err(y.numpy(), x.astype(np.float64) @ w.T) < F32_TOL
    lens = lens + 1
  M.get_backend("emulator").check()


def test_shipped_kernels_need_their_metal_fixes():
  """The two defects the emulator now catches, put back into the shipped sources, are refused: rope.metal's scalar
  threads_per_threadgroup beside a uint3 threadgroup position (Apple's compiler rejects the mix), and the threadgroup
  array `qs` of paged_attention.metal read as float4 without being declared 16-byte aligned."""
  rope = M.shader_source("rope.metal")
  old_rope = rope.replace("uint3 tgsize [[threads_per_threadgroup]]", "uint nthreads [[threads_per_threadgroup]]")
  assert old_rope != rope
  with pytest.raises(EmulatorError, match="agree in vector width"): compile_source(old_rope, "rope_old.metal")

  attn = M.shader_source("paged_attention.metal")
  old_attn = attn.replace("threadgroup __attribute__((aligned(16))) float qs", "threadgroup float qs")
  assert old_attn != attn
  lib = compile_source(old_attn, "paged_attention_old.metal")
  rng = np.random.default_rng(3)
  k_cache, v_cache, tables = paged_inputs(rng, (20, 5), 16, 2, 64, dtypes.float32)
  q, lens = rng.standard_normal((2, 8, 64)).astype(np.float32), np.array([20, 5], np.int32)
  (launch,) = M.decode_launches(2, 8, 2, 64, 16, tables.shape[1], dtypes.float32, dtypes.float32, 0.125)
  args = [q, k_cache, v_cache, tables, lens, np.zeros_like(q), np.array(launch.params, np.int32)]
  with pytest.raises(EmulatorError, match="misaligned"): lib.run(launch.kernel, args, launch.grid, launch.threads)


# (K, N, lanes per row team): K/16 chunks per row not a multiple of 32 (SmolLM2's 576, 896, 960, 4864) or a multiple
# (1536); N never a multiple of the 256 / lanes rows per threadgroup, so the last threadgroup has idle teams
INT4_GEMV_LAYOUTS = [(576, 45, 8), (1536, 20, 32), (960, 37, 32), (896, 70, 8), (4864, 17, 16)]


@pytest.mark.parametrize("xdt", [dtypes.float32, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("g", M.GROUP_SIZES)
@pytest.mark.parametrize("k,n,lanes", INT4_GEMV_LAYOUTS, ids=lambda c: str(c))
def test_int4_gemv_lane_layouts(k, n, lanes, g, xdt):
  """The GEMV's team width is chosen for K and every M of 1..8 matches the reference, including the N tail."""
  if k % g: pytest.skip("K must be a multiple of the group size")
  launch = M.int4_launch(1, n, k, g, xdt)
  assert launch.kernel.startswith("int4_gemv_") and launch.params[-1] == lanes
  assert launch.grid[0] == -(-n // (256 // lanes)) and launch.grid[0] * (256 // lanes) > n
  for m in range(1, M.GEMV_MAX_M + 1): int4_case("direct", m, n, k, g, xdt, seed=m)


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_int4_gemv_lane_layouts_lane_orders(order):
  for seed, (k, n, g) in enumerate([(576, 45, 64), (1536, 20, 128), (4864, 17, 32)]):
    int4_case("direct", 1 + seed * 3, n, k, g, dtypes.float16, seed=seed, order=order)


@pytest.mark.parametrize("order", ["forward", "random"])
def test_decode_short_context_in_wide_table(order):
  """A table wider than PARTITION_THRESHOLD always gets the partitioned grid (its shape is fixed for TinyJit), but the
  work follows context_lens: partitions past a context write nothing (early exit), and the reduce reads no statistics
  of a sequence that used one partition (a copy) nor any of the empty partitions (all left NaN here)."""
  D, bs, H, KVH, P = 64, 16, 8, 2, M.PARTITION_SIZE
  lens = (5, 0, P + 88, P)  # one partition, padding, two partitions, exactly one
  rng = np.random.default_rng(5)
  k_cache, v_cache, tables = paged_inputs(rng, lens, bs, KVH, D, dtypes.float16, extra_blocks=128 - -(-max(lens) // bs))
  q = rng.standard_normal((len(lens), H, D)).astype(np.float16)
  lens = np.array(lens, np.int32)
  ls = M.decode_launches(len(lens), H, KVH, D, bs, tables.shape[1], dtypes.float16, dtypes.float16, D ** -0.5)
  nparts = 128 * bs // P
  assert [l.kernel for l in ls] == ["paged_attention_decode_partitioned_f16_f16_64_g4", "paged_attention_reduce_f16"]
  assert ls[0].grid == (nparts, KVH, len(lens)) and ls[0].threads == (256, 1, 1)
  assert ls[1].grid == (H, len(lens), 1)
  used = -(-lens // P)
  tmp, sums, maxes = (np.full(s, np.nan, np.float32) for s in ((len(lens), H, nparts, D), (len(lens), H, nparts), (len(lens), H, nparts)))
  direct_run(ls[0], [q, k_cache, v_cache, tables, lens, tmp, sums, maxes], order)
  for b, u in enumerate(used):
    assert np.isfinite(tmp[b, :, :u]).all() and np.isfinite(sums[b, :, :u]).all() and np.isfinite(maxes[b, :, :u]).all()
    assert np.isnan(tmp[b, :, u:]).all() and np.isnan(sums[b, :, u:]).all(), f"seq {b}: a partition past the context was written"
  sums[used == 1], maxes[used == 1] = np.nan, np.nan  # a single-partition sequence must not need its statistics
  out = np.zeros_like(q)
  direct_run(ls[1], [tmp, sums, maxes, lens, out], order)
  assert not out[lens == 0].any()
  err = rel_err(out, decode_ref(q, k_cache, v_cache, tables, lens, D ** -0.5))
  assert err < F16_TOL, err
  # the one-pass kernel on a narrow table agrees
  decode_case("direct", D, bs, (H, KVH), (dtypes.float16, dtypes.float16), lens=(5, 0, 300, 17), seed=5, order=order)


def test_decode_gqa_ratio_instantiations():
  """The host picks the smallest GMAX in (2, 4, 8) >= G; ratios between instantiations (2, 5, 7) and MHA compute right."""
  def kernel(h, kvh): return M.decode_launches(1, h, kvh, 128, 16, 8, dtypes.float32, dtypes.float32, 0.1)[0].kernel
  assert [kernel(h, kvh)[-2:] for h, kvh in [(4, 4), (4, 2), (6, 2), (8, 2), (10, 2), (14, 2), (8, 1)]] == \
         ["g2", "g2", "g4", "g4", "g8", "g8", "g8"]
  for i, (heads, D) in enumerate([((4, 2), 80), ((10, 2), 96), ((7, 1), 64), ((2, 2), 128)]):
    decode_case("direct", D, 8, heads, (dtypes.float32, dtypes.float32), seed=i)
    decode_case("direct", D, 8, heads, (dtypes.float16, dtypes.float16), partition_size=16, seed=i, order="random")


def test_prefill_long_chunk_shuffled():
  """A long chunk on the simdgroup-matrix prefill kernel: 100 tokens of one sequence at positions 400..499 (many key
  tiles, a causal diagonal inside the chunk), 6 tokens of a second sequence and 3 padding tokens, shuffled so that
  every tile mixes sequences and positions. Each row's result does not depend on its tile's other rows: the same
  chunk in order gives bitwise the same rows."""
  D, bs, H, KVH = 64, 16, 4, 1
  seq = np.array([0] * 100 + [1] * 6 + [-1] * 3, np.int32)
  pos = np.array(list(range(400, 500)) + list(range(30, 36)) + [0] * 3, np.int32)
  rng = np.random.default_rng(21)
  k_cache, v_cache, tables = paged_inputs(rng, (500, 36), bs, KVH, D, dtypes.float16)
  q = rng.standard_normal((len(seq), H, D)).astype(np.float16)
  perm = rng.permutation(len(seq))
  shuffled = run_prefill("direct", q[perm], k_cache, v_cache, tables, seq[perm], pos[perm], D ** -0.5)
  assert not shuffled[seq[perm] < 0].any()
  err = rel_err(shuffled, prefill_ref(q[perm], k_cache, v_cache, tables, seq[perm], pos[perm], D ** -0.5))
  assert err < F16_TOL, err
  ordered = run_prefill("direct", q, k_cache, v_cache, tables, seq, pos, D ** -0.5)
  assert np.array_equal(shuffled, ordered[perm])
