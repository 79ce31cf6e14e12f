"""Every .metal kernel, run by the emulator, against a float64 numpy reference on fresh random inputs.

Each case builds its inputs once and runs them through a `runner`: "direct" launches the emulator on numpy arrays
with the launch description from tinyvllm.kernels.metal (fast: the big shape matrix), "emulator" and "metal" go
through the public functions on tinygrad Tensors (tests/test_metal_device.py reuses these cases on a Mac).

Tolerances, relative error ||out - ref|| / ||ref||:
  * F32_TOL 1e-4: float32 storage, float accumulation in a different order than numpy's float64, and the GPU's
    exp (a few ulp); measured errors are ~1e-7, the margin covers Metal's fast paths and sums over long contexts.
  * F16_TOL 3e-3: half storage of q/K/V/x or of the output rounds each value to 2^-11 relative (~4.9e-4 worst,
    ~2e-4 RMS measured), then accumulated in float; 3e-3 leaves room for Metal's half conversions and fast math.

int8 KV cache (`kv_cache_dtype="int8"`, tinyvllm/kernels/kv_cache.py): the attention references run in float64 on the
cache dequantized by tests/kv_reference.py (codes * scale), so the quantization error itself is not in the comparison,
only the kernels' arithmetic: the same tolerance as the activation dtype. With float32 activations the decode kernel
converts codes exactly and multiplies scores and weights by the float16 scales in float (F32_TOL); the prefill kernel
stages scale * code in float tiles, exact (7 + 11 significant bits). With float16 activations the prefill tiles are
half, so scale * code rounds to 2^-11 relative like a half cache (F16_TOL). The cache write is checked code by code
(see `rope_case`).
"""
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.kernels import metal as M
from tinyvllm.kernels.emulator import EmulatorError, compile_source
from tinyvllm.kernels.kv_cache import PagedKVCache

try:
  from kv_reference import dequantize_int8_ref, quantize_int8_ref
except ImportError:  # run as a package
  from tests.kv_reference import dequantize_int8_ref, quantize_int8_ref

F32_TOL, F16_TOL = 1e-4, 3e-3
NP = {dtypes.float32: np.float32, dtypes.float16: np.float16, dtypes.int8: np.int8}
TG = {np.dtype(v): k for k, v in NP.items()}   # numpy dtype -> tinygrad dtype
DT_PAIRS = [(dtypes.float32, dtypes.float32), (dtypes.float16, dtypes.float16), (dtypes.float32, dtypes.float16),
            (dtypes.float16, dtypes.float32)]
I8_PAIRS = [(dtypes.float16, dtypes.int8), (dtypes.float32, dtypes.int8)]   # (activations, int8 cache)
GQA = [(4, 4), (6, 2), (8, 2), (8, 1)]  # (n_heads, n_kv_heads): ratios 1, 3, 4, 8


def dt_id(d) -> str: return "int8" if d == dtypes.int8 else d.name   # tinygrad names int8 "signed char"


def attention_cases(dt_pairs, every_block_size=True):
  """Parametrize a test over (D, bs, heads, dts): every head_dim, block size and GQA ratio, with these dtype pairs.
  every_block_size=False: block sizes take turns over the (D, GQA) pairs instead (the slot arithmetic does not depend
  on the cache dtype, and every block size still meets every head_dim and every GQA ratio)."""
  combos = [(D, bs, heads) for D in M.HEAD_DIMS for bs in M.BLOCK_SIZES for heads in GQA] if every_block_size else \
           [(D, M.BLOCK_SIZES[(i + j) % len(M.BLOCK_SIZES)], heads) for i, D in enumerate(M.HEAD_DIMS) for j, heads in enumerate(GQA)]
  cases = [pytest.param(D, bs, heads, dts, id=f"{D}-{bs}-gqa{heads[0] // heads[1]}-{dt_id(dts[0])}-{dt_id(dts[1])}")
           for D, bs, heads in combos for dts in dt_pairs]
  return pytest.mark.parametrize("D,bs,heads,dts", cases)

# **** references (float64) ****


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
  assert np.isfinite(out).all(), "non-finite output"
  return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def tol(*dts) -> float: return F16_TOL if dtypes.float16 in dts else F32_TOL


def cache_f64(cache) -> tuple[np.ndarray, np.ndarray]:
  """K and V of a numpy cache (k, v) or (k codes, v codes, k_scale, v_scale) in float64: what attention must read."""
  if len(cache) == 2: return cache[0].astype(np.float64), cache[1].astype(np.float64)
  k, v, ks, vs = cache
  return dequantize_int8_ref(k, ks), dequantize_int8_ref(v, vs)


def random_heads(rng, shape) -> np.ndarray:
  """Random head vectors [..., D] of varied magnitudes (a log-normal factor per vector), so scales differ row to row."""
  return rng.standard_normal(shape) * np.exp(rng.normal(0.0, 0.7, shape[:-1] + (1,)))


def attention_ref(qv, k_cache, v_cache, table_row, ctx, scale, window=None, softcap=None):
  """One token's heads qv [H, D] against keys 0..ctx-1 of a paged sequence (the last `window` of them only, scores
  soft-capped by `softcap`, when given)."""
  H, D = qv.shape
  bs, KVH = k_cache.shape[1], k_cache.shape[2]
  if ctx <= 0: return np.zeros((H, D))
  k = np.arange(max(0, ctx - window) if window else 0, ctx)
  slots = table_row[k // bs] * bs + k % bs
  K = k_cache.reshape(-1, KVH, D)[slots].astype(np.float64)
  V = v_cache.reshape(-1, KVH, D)[slots].astype(np.float64)
  out = np.zeros((H, D))
  for h in range(H):
    s = K[:, h // (H // KVH)] @ qv[h].astype(np.float64) * scale
    if softcap: s = softcap * np.tanh(s / softcap)
    p = np.exp(s - s.max())
    out[h] = (p / p.sum()) @ V[:, h // (H // KVH)]
  return out


def decode_ref(q, k_cache, v_cache, tables, lens, scale, **kw):
  return np.stack([attention_ref(q[b], k_cache, v_cache, tables[b], lens[b], scale, **kw) for b in range(len(q))])


def prefill_ref(q, k_cache, v_cache, tables, token_seq, token_pos, scale, **kw):
  return np.stack([attention_ref(q[t], k_cache, v_cache, tables[token_seq[t]], token_pos[t] + 1, scale, **kw) if token_seq[t] >= 0
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


def random_cache(rng, num_blocks, bs, KVH, D, cache_dt) -> tuple[np.ndarray, ...]:
  """A numpy cache full of random values: (k, v) float, or int8 (k codes, v codes, k_scale, v_scale) quantized from
  random head vectors by the reference."""
  if cache_dt != dtypes.int8:
    return tuple(rng.standard_normal((num_blocks, bs, KVH, D)).astype(NP[cache_dt]) for _ in range(2))
  (k, ks), (v, vs) = (quantize_int8_ref(random_heads(rng, (num_blocks, bs, KVH, D))) for _ in range(2))
  return k, v, ks, vs


def paged_inputs(rng, lens, bs, KVH, D, cache_dt, extra_blocks=2):
  """A random cache (see random_cache) and block tables built from a shuffled free list (non-contiguous, unused = 0)."""
  need = sum(-(-n // bs) for n in lens)
  num_blocks = need + extra_blocks + 3
  cache = random_cache(rng, num_blocks, bs, KVH, D, cache_dt)
  free = rng.permutation(num_blocks)
  tables = np.zeros((len(lens), max(-(-n // bs) for n in lens) + extra_blocks), np.int32)
  i = 0
  for s, n in enumerate(lens):
    tables[s, :-(-n // bs)] = free[i:i - (-n // bs)]
    i -= -n // bs
  return cache, tables


# **** runners: numpy in, numpy out ****

_libs = {}


def direct_run(launch, arrays, order="forward", seed=0):
  if launch.source not in _libs: _libs[launch.source] = compile_source(M.shader_source(launch.source), launch.source)
  _libs[launch.source].run(launch.kernel, list(arrays) + [np.array(launch.params, np.int32)], launch.grid, launch.threads,
                           order=order, seed=seed)


def tensor_cache(cache, dev) -> PagedKVCache:
  return PagedKVCache(*[Tensor(a, device=dev).realize() for a in cache])


def run_decode(runner, q, cache, tables, lens, scale, partition_size=None, order="forward", window=None, softcap=None):
  if runner == "direct":
    B, H, D = q.shape
    k_cache = cache[0]
    ls = M.decode_launches(B, H, k_cache.shape[2], D, k_cache.shape[1], tables.shape[1], TG[q.dtype], TG[k_cache.dtype], scale,
                           partition_size, window, softcap)
    out = np.zeros_like(q)
    if len(ls) == 1: direct_run(ls[0], [q, *cache, tables, lens, out], order)
    else:
      n = ls[0].grid[0]
      # NaN where a partition writes nothing (a GPU's buffers start as garbage): the reduce must read only written ones
      tmp, sums, maxes = np.full((B, H, n, D), np.nan, np.float32), np.full((B, H, n), np.nan, np.float32), np.full((B, H, n), np.nan, np.float32)
      direct_run(ls[0], [q, *cache, tables, lens, tmp, sums, maxes], order)
      direct_run(ls[1], [tmp, sums, maxes, lens, out], order)
    return out
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (q, tables, lens)]
  return M.paged_attention_decode(t[0], tensor_cache(cache, dev), t[1], t[2], scale, backend=runner,
                                  partition_size=partition_size, window=window, softcap=softcap).numpy()


def run_prefill(runner, q, cache, tables, token_seq, token_pos, scale, order="forward", window=None, softcap=None):
  if runner == "direct":
    T, H, D = q.shape
    k_cache = cache[0]
    launch = M.prefill_launch(T, H, k_cache.shape[2], D, k_cache.shape[1], tables.shape[1], TG[q.dtype], TG[k_cache.dtype], scale,
                              window, softcap)
    out = np.zeros_like(q)
    direct_run(launch, [q, *cache, tables, token_seq, token_pos, out], order)
    return out
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (q, tables, token_seq, token_pos)]
  return M.paged_attention_prefill(t[0], tensor_cache(cache, dev), *t[1:], scale, backend=runner, window=window, softcap=softcap).numpy()


def run_rope(runner, q, k, v, pos, cos_sin, cache, slots, order="forward"):
  """Returns (q_out, the cache after the write) as numpy arrays. The kernel reads q, k and v as one fused projection's
  rows (each token's q heads, then k, then v)."""
  (T, H, D), KVH = q.shape, k.shape[1]
  qkv = np.concatenate([a.reshape(T, -1) for a in (q, k, v)], axis=1)
  if runner == "direct":
    launch = M.rope_launch(T, H, KVH, D, TG[q.dtype], TG[cache[0].dtype])
    q_out, written = np.zeros_like(q), tuple(a.copy() for a in cache)
    direct_run(launch, [qkv, pos, cos_sin, slots, q_out, *written], order)
    return q_out, written
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (qkv, pos, cos_sin, slots)]
  q_out, written = M.rope_and_cache_write(t[0], H, KVH, t[1], t[2], tensor_cache(cache, dev), t[3], backend=runner)
  assert isinstance(written, PagedKVCache) and written.quantized == (len(cache) == 4)
  return q_out.numpy(), tuple(x.numpy() for x in written.tensors())


def run_int4(runner, x, packed, scales, biases, g, order="forward", norm=None, residual=None, gate=None):
  """norm: (weight, eps) for RMSNorm(x) * weight before the matmul (int4_gemv_rms for M <= 8); residual: [M, N] added
  to the product (int4_gemv_res for M <= 8); gate (with norm): W is gate and up stacked, act(gate) * up returned
  (int4_gemv_glu / geglu)."""
  if runner == "direct":
    n = packed.shape[0] // (2 if gate else 1)
    launch = M.int4_launch(x.shape[0], n, x.shape[1], g, dtypes.float16 if x.dtype == np.float16 else dtypes.float32,
                           None if norm is None else norm[1], residual is not None, gate)
    y = np.zeros((x.shape[0], n), x.dtype)
    direct_run(launch, [x, *([] if norm is None else [norm[0]]), packed, scales, biases, *([] if residual is None else [residual]), y], order)
    return y
  dev = "METAL" if runner == "metal" else "CPU"
  t = [Tensor(a, device=dev).realize() for a in (x, packed, scales, biases)]
  return M.int4_matmul(*t, g, backend=runner, norm=None if norm is None else (Tensor(norm[0], device=dev).realize(), norm[1]),
                       residual=None if residual is None else Tensor(residual, device=dev).realize(), gate=gate).numpy()


# **** cases: build inputs, run, compare ****


def decode_case(runner, D, bs, heads, dts, partition_size=None, lens=(1, 37, 0, 70, 16), seed=0, order="forward", **kw):
  """kw: window, softcap (sliding-window and soft-capped attention)."""
  (H, KVH), (qdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  cache, tables = paged_inputs(rng, lens, bs, KVH, D, cdt)
  q = rng.standard_normal((len(lens), H, D)).astype(NP[qdt])
  lens = np.array(lens, np.int32)
  out = run_decode(runner, q, cache, tables, lens, D ** -0.5, partition_size, order, **kw)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert not out[lens == 0].any(), "a padding row must give zeros"
  err = rel_err(out, decode_ref(q, *cache_f64(cache), tables, lens, D ** -0.5, **kw))
  assert err < tol(qdt, cdt), err
  return err


def prefill_case(runner, D, bs, heads, dts, seed=0, order="forward", chunk=None, **kw):
  """chunk: (lens, token_seq, token_pos); default: the last 6 tokens of seq 0, a padding token, all 9 of seq 1,
  the last 13 of seq 2. kw: window, softcap."""
  (H, KVH), (qdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  lens, token_seq, token_pos = chunk or ((45, 9, 70), [0] * 6 + [-1] + [1] * 9 + [2] * 13,
                                         list(range(39, 45)) + [0] + list(range(9)) + list(range(57, 70)))
  cache, tables = paged_inputs(rng, lens, bs, KVH, D, cdt)
  token_seq, token_pos = np.array(token_seq, np.int32), np.array(token_pos, np.int32)
  q = rng.standard_normal((len(token_seq), H, D)).astype(NP[qdt])
  out = run_prefill(runner, q, cache, tables, token_seq, token_pos, D ** -0.5, order, **kw)
  assert out.dtype == q.dtype and not out[token_seq < 0].any()
  err = rel_err(out, prefill_ref(q, *cache_f64(cache), tables, token_seq, token_pos, D ** -0.5, **kw))
  assert err < tol(qdt, cdt), err
  return err


def rope_case(runner, D, heads, dts, seed=0, order="forward"):
  (H, KVH), (xdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  T, num_blocks, bs = 9, 5, 8
  q = rng.standard_normal((T, H, D)).astype(NP[xdt])
  k, v = (random_heads(rng, (T, KVH, D)).astype(NP[xdt]) for _ in range(2))
  if cdt == dtypes.int8:   # a tiny (not zero) head vector: max|v| / 127 = 1.6e-8 rounds to float16 0: scale 0, codes 0
    v[3, 0] = (v[3, 0].astype(np.float64) / np.abs(v[3, 0]).max() * 2e-6).astype(v.dtype)
  pos = rng.integers(0, 200, T).astype(np.int32)
  cos_sin = rope_table(256, D)
  slots = rng.permutation(num_blocks * bs)[:T].astype(np.int32)
  slots[[2, 5]] = -1  # padding tokens: no cache write
  cache = random_cache(rng, num_blocks, bs, KVH, D, cdt)
  q_out, written = run_rope(runner, q, k, v, pos, cos_sin, cache, slots, order)
  ok = slots >= 0
  k_new, v_new = rope_ref(k, pos, cos_sin)[ok], v[ok].astype(np.float64)
  err_q = rel_err(q_out, rope_ref(q, pos, cos_sin))
  assert err_q < tol(xdt), err_q
  if cdt != dtypes.int8:
    k_ref, v_ref = (c.reshape(-1, KVH, D).astype(np.float64) for c in cache)
    k_ref[slots[ok]], v_ref[slots[ok]] = k_new, v_new
    errs = err_q, rel_err(written[0].reshape(k_ref.shape), k_ref), rel_err(written[1].reshape(v_ref.shape), v_ref)
    assert max(errs) < tol(xdt, cdt), errs
    return max(errs)
  # int8: the rows of unwritten slots are untouched, bit for bit
  untouched = np.setdiff1d(np.arange(num_blocks * bs), slots[ok])
  for before, after in zip(cache, written):
    assert np.array_equal(before.reshape(num_blocks * bs, KVH, -1)[untouched], after.reshape(num_blocks * bs, KVH, -1)[untouched])
  errs = [err_q]
  for x, codes, scale in ((k_new, written[0], written[2]), (v_new, written[1], written[3])):
    codes, scale = codes.reshape(-1, KVH, D)[slots[ok]], scale.reshape(-1, KVH)[slots[ok]]
    errs.append(check_int8_rows(x, codes, scale))
  return max(errs)


# Quantization error of the cache write for random_heads rows: each element is off by at most s / 2 (s = max|x| / 127,
# rounded to float16), uniform in [-s/2, s/2] (RMS s / sqrt(12)); over a Gaussian head vector of D <= 128 elements
# max|x| is ~2.5-3 standard deviations, so ||deq - x|| / ||x|| ~ 3 / (127 sqrt(12)) ~ 0.7 % (measured ~0.6 %).
INT8_ROW_TOL = 1.2e-2


def check_int8_rows(x, codes, scale) -> float:
  """A kernel's int8 head vectors (codes [..., D], float16 scales [...]) against the float64 reference quantization of
  the exact rows x: scales within one float16 ulp (the kernel divides max|x| by 127 in float, then rounds to half: a
  second rounding); codes equal except +-1 at rounding ties of x / s, or where the scale took the neighbouring ulp;
  every element of s * code within s / 2 of x (s == 0 only where max|x| / 127 underflows half). Returns the relative
  error ||s * code - x|| / ||x||, checked against INT8_ROW_TOL."""
  ref_codes, ref_scale = quantize_int8_ref(x)
  assert codes.dtype == np.int8 and scale.dtype == np.float16
  assert (np.abs(scale.astype(np.float64) - ref_scale) <= np.spacing(ref_scale).astype(np.float64)).all(), "scale off by > 1 ulp"
  diff = codes.astype(np.int32) - ref_codes
  assert np.abs(diff).max() <= 1, "a code is off by more than 1"
  s_ref = ref_scale.astype(np.float64)[..., None]
  ratio = np.abs(x) / np.where(s_ref > 0, s_ref, 1)
  at_tie = np.abs(ratio - np.floor(ratio) - 0.5) < 1e-3
  same_scale = np.broadcast_to((scale == ref_scale)[..., None], diff.shape)
  assert (at_tie | ~same_scale)[diff != 0].all(), "a code differs from the reference away from a rounding tie"
  s = scale.astype(np.float64)[..., None]
  deq = dequantize_int8_ref(codes, scale)
  zero = (scale == 0)[..., None]
  assert (np.abs(deq - x) <= 0.5 * s * (1 + 1e-3) + zero * 127 * 2.0 ** -25).all(), "an element is off by more than s / 2"
  assert not codes[scale == 0].any(), "a zero scale must come with zero codes"
  err = rel_err(deq, x)
  assert err < INT8_ROW_TOL, err
  return err


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


def normed_rows(rng, m, k, xdt):
  """x `[m, k]` with rows scaled far from unit RMS (0.05 .. 20), so a norm left out or applied twice is off by orders
  of magnitude; the norm's weight and epsilon; and RMSNorm(x) * weight in float64."""
  x = (rng.standard_normal((m, k)) * np.geomspace(0.05, 20, m)[:, None]).astype(NP[xdt])
  nw, eps = (1 + 0.5 * rng.standard_normal(k)).astype(NP[xdt]), 1e-5
  x64 = x.astype(np.float64)
  return x, nw, eps, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * nw.astype(np.float64)


def int4_rms_case(runner, m, n, k, g, xdt, seed=0, order="forward"):
  """RMSNorm(x) * weight @ W^T against float64 numpy (`normed_rows`)."""
  rng = np.random.default_rng(seed)
  packed, scales, biases, w = quantize_int4(rng, n, k, g)
  x, nw, eps, xn = normed_rows(rng, m, k, xdt)
  y = run_int4(runner, x, packed, scales, biases, g, order, norm=(nw, eps))
  assert y.dtype == x.dtype and y.shape == (m, n)
  err = rel_err(y, xn @ w.T)
  assert err < tol(xdt), err
  return err

def int4_gated_case(runner, m, n, k, g, xdt, act, seed=0):
  """act(gate) * up of RMSNorm(x) * weight against float64 numpy (`normed_rows`), W the gate rows then the up rows: a
  gate and an up of different rows, or of rows swapped, give another product."""
  rng = np.random.default_rng(seed)
  packed, scales, biases, w = quantize_int4(rng, 2 * n, k, g)
  x, nw, eps, xn = normed_rows(rng, m, k, xdt)
  gate_up = xn @ w.T
  gate, up = gate_up[:, :n], gate_up[:, n:]
  if act == "silu": ref = gate / (1 + np.exp(-gate)) * up
  else: ref = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
  y = run_int4(runner, x, packed, scales, biases, g, norm=(nw, eps), gate=act)
  assert y.dtype == x.dtype and y.shape == (m, n)
  err = rel_err(y, ref)
  assert err < tol(xdt), err
  return err


def int4_residual_case(runner, m, n, k, g, xdt, seed=0):
  """residual + x @ W^T against float64 numpy, the residual of the product's size: an add left out, or a product
  dropped, is off by about 1 (the tolerance is 1e-2 at most)."""
  rng = np.random.default_rng(seed)
  packed, scales, biases, w = quantize_int4(rng, n, k, g)
  x = rng.standard_normal((m, k)).astype(NP[xdt])
  prod = x.astype(np.float64) @ w.T
  res = (prod.std() * rng.standard_normal((m, n))).astype(NP[xdt])
  y = run_int4(runner, x, packed, scales, biases, g, residual=res)
  assert y.dtype == x.dtype and y.shape == (m, n)
  err = rel_err(y, res.astype(np.float64) + prod)
  assert err < tol(xdt), err
  return err

# **** tests ****


@attention_cases(DT_PAIRS[:3])
def test_decode(D, bs, heads, dts):
  decode_case("direct", D, bs, heads, dts)
  decode_case("direct", D, bs, heads, dts, partition_size=2 * bs, seed=1)  # partitioned + reduce, 1..5 partitions


@pytest.mark.parametrize("dts", [(dtypes.float32, dtypes.float32), (dtypes.float16, dtypes.float16), (dtypes.float16, dtypes.int8)],
                         ids=lambda d: f"{dt_id(d[0])}-{dt_id(d[1])}")
@pytest.mark.parametrize("window,softcap", [(20, None), (5, None), (None, 1.5), (24, 2.0)])
def test_attention_window_and_softcap(window, softcap, dts):
  """Sliding windows (Mistral, Gemma, Qwen) and soft-capped scores (Gemma 2) against numpy: decode one-pass and
  partitioned (partitions wholly before the window exit, the reduce merges only those after), and prefill (tiles
  start at the window of the tile's earliest token)."""
  D, bs, heads = 64, 8, (8, 2)
  decode_case("direct", D, bs, heads, dts, window=window, softcap=softcap, seed=2)
  decode_case("direct", D, bs, heads, dts, partition_size=2 * bs, window=window, softcap=softcap, seed=3)
  prefill_case("direct", D, bs, heads, dts, window=window, softcap=softcap, seed=4)


@attention_cases(DT_PAIRS[:3])
def test_prefill(D, bs, heads, dts):
  prefill_case("direct", D, bs, heads, dts)


@attention_cases(I8_PAIRS, every_block_size=False)
def test_decode_int8_cache(D, bs, heads, dts):
  decode_case("direct", D, bs, heads, dts)
  decode_case("direct", D, bs, heads, dts, partition_size=2 * bs, seed=1)


@attention_cases(I8_PAIRS, every_block_size=False)
def test_prefill_int8_cache(D, bs, heads, dts):
  prefill_case("direct", D, bs, heads, dts)


@pytest.mark.parametrize("dts", DT_PAIRS + I8_PAIRS, ids=lambda d: f"{dt_id(d[0])}-{dt_id(d[1])}")
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


@pytest.mark.parametrize("xdt", [dtypes.float32, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 72, 256), (3, 64, 512), (8, 40, 384), (9, 40, 256)], ids=lambda s: "x".join(map(str, s)))
def test_int4_matmul_of_rms_normed_x(shape, xdt):
  """int4_gemv_rms (the norm inside the GEMV, M <= 8) through the emulator, and M = 9 through tinygrad's norm + GEMM."""
  m, n, k = shape
  int4_rms_case("direct" if m <= M.GEMV_MAX_M else "emulator", m, n, k, 64, xdt)


@pytest.mark.parametrize("xdt", [dtypes.float32, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 72, 256), (3, 64, 512), (8, 40, 384), (9, 40, 256)], ids=lambda s: "x".join(map(str, s)))
def test_int4_matmul_plus_residual(shape, xdt):
  """int4_gemv_res (the residual added as the GEMV writes y, M <= 8) through the emulator's direct launch, and M = 9
  through the GEMM and tinygrad's add."""
  m, n, k = shape
  int4_residual_case("direct" if m <= M.GEMV_MAX_M else "emulator", m, n, k, 64, xdt)
  rng = np.random.default_rng(1)   # written into a given buffer (the layer's output), no copy after the kernel
  packed, scales, biases, w = quantize_int4(rng, n, k, 64)
  x, res = rng.standard_normal((m, k)).astype(NP[xdt]), rng.standard_normal((m, n)).astype(NP[xdt])
  out = Tensor.empty(m, n, dtype=xdt).realize()
  t = lambda a: Tensor(a).realize()
  M.int4_matmul(t(x), t(packed), t(scales), t(biases), 64, backend="emulator", residual=t(res), out=out).realize()
  assert rel_err(out.numpy(), res.astype(np.float64) + x.astype(np.float64) @ w.T) < tol(xdt)
  with pytest.raises(ValueError, match="residual"):
    rng = np.random.default_rng(0)
    packed, scales, biases, _ = quantize_int4(rng, n, k, 64)
    run_int4("emulator", rng.standard_normal((m, k)).astype(NP[xdt]), packed, scales, biases, 64, residual=np.zeros((m, n + 1), NP[xdt]))


@pytest.mark.parametrize("xdt", [dtypes.float32, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("shape,g", [((1, 72, 256), 64), ((3, 40, 576), 32), ((8, 20, 384), 128)], ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else str(s))
def test_int4_gated_gemv(shape, g, act, xdt):
  """int4_gemv_glu / geglu (the fused gate/up projection, normed and gated as it is written: M <= 8) through the
  emulator's direct launch, outputs not a multiple of a threadgroup's (72, 40, 20), K of 8 lanes a team (576)."""
  m, n, k = shape
  int4_gated_case("direct", m, n, k, g, xdt, act)


def test_int4_gated_gemv_through_tinygrad_and_its_refusals():
  """The same through `int4_matmul` (the emulator backend, as the engine calls it); refused without a norm, past 8
  rows, with an odd row count."""
  int4_gated_case("emulator", 2, 24, 128, 32, dtypes.float32, "silu", seed=4)
  rng = np.random.default_rng(5)
  packed, scales, biases, _ = quantize_int4(rng, 16, 128, 32)
  x = rng.standard_normal((9, 128)).astype(np.float32)
  for rows, norm, w in ((1, None, packed), (9, (np.ones(128, np.float32), 1e-5), packed), (1, (np.ones(128, np.float32), 1e-5), packed[:15])):
    with pytest.raises(ValueError, match="gated GEMV"):
      run_int4("emulator", x[:rows], w, scales[:len(w)], biases[:len(w)], 32, norm=norm, gate="silu")


def int4_qkv_rope_case(runner, m, heads, D, k, g, dts, seed=0):
  """The INT4 qkv projection of RMSNorm(x) * weight, rotated and written (int4_gemv_rope), against float64 numpy:
  q rotated; each token's rotated k and its v at its slot, padding tokens (slot -1) and every other slot untouched."""
  (H, KVH), (xdt, cdt) = heads, dts
  rng = np.random.default_rng(seed)
  packed, scales, biases, w = quantize_int4(rng, (H + 2 * KVH) * D, k, g)
  x, nw, eps, xn = normed_rows(rng, m, k, xdt)
  pos, cos_sin = rng.integers(0, 200, m).astype(np.int32), rope_table(256, D)
  num_blocks, bs = 4, 8
  slots = rng.permutation(num_blocks * bs)[:m].astype(np.int32)
  if m > 1: slots[1] = -1   # a padding token: writes nothing
  cache = random_cache(rng, num_blocks, bs, KVH, D, cdt)
  qkv = (xn @ w.T).reshape(m, H + 2 * KVH, D)
  rotated = rope_ref(qkv[:, :H + KVH], pos, cos_sin)
  k_ref, v_ref = (c.astype(np.float64).reshape(-1, KVH, D).copy() for c in cache)
  live = slots >= 0
  k_ref[slots[live]], v_ref[slots[live]] = rotated[live, H:], qkv[live, H + KVH:]
  if runner == "direct":
    launch = M.int4_launch(m, (H + 2 * KVH) * D // 2, k, g, xdt, eps, rope=(H, KVH, D, cdt))
    q = np.zeros((m, H, D), NP[xdt])
    kc, vc = (c.copy() for c in cache)
    direct_run(launch, [x, nw, packed, scales, biases, pos, cos_sin, slots, q, kc, vc])
  else:
    t = lambda a: Tensor(a).realize()
    q, written = M.int4_qkv_rope(t(x), t(packed), t(scales), t(biases), g, (t(nw), eps), H, KVH, t(pos), t(cos_sin),
                                 tensor_cache(cache, "CPU"), t(slots), backend=runner)
    q, (kc, vc) = q.numpy(), (a.numpy() for a in written.tensors())
  assert q.dtype == x.dtype and rel_err(q, rotated[:, :H]) < tol(xdt)
  kc, vc = kc.astype(np.float64).reshape(-1, KVH, D), vc.astype(np.float64).reshape(-1, KVH, D)
  untouched = np.setdiff1d(np.arange(num_blocks * bs), slots[live])
  assert (kc[untouched] == k_ref[untouched]).all() and (vc[untouched] == v_ref[untouched]).all()
  assert rel_err(kc[slots[live]], k_ref[slots[live]]) < tol(xdt, cdt) and rel_err(vc[slots[live]], v_ref[slots[live]]) < tol(xdt, cdt)


@pytest.mark.parametrize("dts", DT_PAIRS, ids=lambda d: f"{dt_id(d[0])}-{dt_id(d[1])}")
@pytest.mark.parametrize("m,heads,D,k,g", [(1, (4, 2), 64, 256, 64), (3, (6, 2), 128, 576, 32), (8, (8, 8), 80, 384, 128),
                                           (2, (8, 1), 96, 128, 32)], ids=["1x4-2x64", "3x6-2x128", "8x8-8x80", "2x8-1x96"])
def test_int4_qkv_gemv_with_rope_and_cache_write(m, heads, D, k, g, dts):
  """int4_gemv_rope through the emulator's direct launch: every head_dim the shaders take, GQA 1 to 8, K of 8, 16 and
  32 lanes a team, both dtypes of x and of the cache."""
  int4_qkv_rope_case("direct", m, heads, D, k, g, dts)


def test_int4_qkv_rope_through_tinygrad_and_its_refusals():
  """The same through `int4_qkv_rope` (the emulator backend, as the engine calls it); refused past 8 rows, for an int8
  cache, and for a weight of other rows than the heads'."""
  int4_qkv_rope_case("emulator", 2, (4, 2), 64, 128, 32, (dtypes.float32, dtypes.float32), seed=3)
  for m, rows, cdt in ((9, 512, dtypes.float32), (1, 512, dtypes.int8), (1, 448, dtypes.float32)):
    with pytest.raises(ValueError, match="RoPE"):
      M.int4_launch(m, rows // 2, 128, 32, dtypes.float32, 1e-5, rope=(4, 2, 64, cdt))


def test_int4_matmul_refuses_a_norm_weight_of_another_length():
  rng = np.random.default_rng(3)
  packed, scales, biases, _ = quantize_int4(rng, 8, 128, 64)
  t = lambda a: Tensor(a).realize()
  with pytest.raises(ValueError, match="norm weight"):
    M.int4_matmul(t(rng.standard_normal((1, 128)).astype(np.float32)), t(packed), t(scales), t(biases), 64, backend="emulator",
                  norm=(t(np.ones(64, np.float32)), 1e-5))


def test_decode_long_context_partitions_automatically():
  ls = M.decode_launches(2, 8, 2, 64, 16, 100, dtypes.float16, dtypes.float16, 0.125)
  assert [l.kernel for l in ls] == ["paged_attention_decode_partitioned_f16_f16_64_g4", "paged_attention_reduce_f16"]
  assert ls[0].grid == (4, 2, 2)  # 1600 keys / 512 per partition
  assert len(M.decode_launches(2, 8, 2, 64, 16, 64, dtypes.float16, dtypes.float16, 0.125)) == 1
  decode_case("direct", 128, 16, (8, 2), (dtypes.float16, dtypes.float16), lens=(1500, 3, 700, 1024), seed=2)


def test_random_batches():
  """Random batch compositions: lengths 0..150, random shapes and dtypes (int8 caches too), shuffled chunk tokens,
  partitions."""
  rng = np.random.default_rng(11)
  pairs = DT_PAIRS + I8_PAIRS
  for i in range(14):
    D, bs = int(rng.choice(M.HEAD_DIMS)), int(rng.choice(M.BLOCK_SIZES))
    heads, dts = GQA[rng.integers(len(GQA))], pairs[i % len(pairs)]
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
    # int8 caches: the cache write (amax across a SIMD-group), one-pass and partitioned decode, prefill
    rope_case("direct", 80, (6, 2), (dtypes.float16, dtypes.int8), seed=seed, order=order)
    rope_case("direct", 128, (4, 4), (dtypes.float32, dtypes.int8), seed=seed, order=order)
    decode_case("direct", 96, 16, (8, 2), (dtypes.float16, dtypes.int8), seed=seed, order=order)
    decode_case("direct", 64, 8, (6, 2), (dtypes.float32, dtypes.int8), partition_size=16, seed=seed, order=order)
    prefill_case("direct", 128, 8, (8, 2), (dtypes.float16, dtypes.int8), seed=seed, order=order)
    prefill_case("direct", 80, 16, (4, 4), (dtypes.float32, dtypes.int8), seed=seed, order=order)


def test_public_functions_on_emulator():
  """The same kernels through the public Tensor functions (custom_kernel + trampoline on the CPU device)."""
  decode_case("emulator", 64, 16, (8, 2), (dtypes.float32, dtypes.float32))
  decode_case("emulator", 128, 8, (6, 2), (dtypes.float16, dtypes.float16), partition_size=32)
  prefill_case("emulator", 80, 16, (6, 2), (dtypes.float32, dtypes.float32))
  rope_case("emulator", 64, (6, 2), (dtypes.float32, dtypes.float32))
  int4_case("emulator", 4, 64, 256, 64, dtypes.float32)
  int4_case("emulator", 20, 64, 256, 64, dtypes.float32)
  # int8 caches: the PagedKVCache with its scales through the same functions
  decode_case("emulator", 64, 16, (8, 2), (dtypes.float16, dtypes.int8))
  decode_case("emulator", 128, 8, (6, 2), (dtypes.float32, dtypes.int8), partition_size=32)
  prefill_case("emulator", 96, 16, (6, 2), (dtypes.float16, dtypes.int8))
  rope_case("emulator", 64, (6, 2), (dtypes.float16, dtypes.int8))


def test_public_functions_check_the_cache():
  """A PagedKVCache whose tensors disagree is refused before any launch, with the reason."""
  rng = np.random.default_rng(4)
  (k, v, ks, vs), tables = paged_inputs(rng, (9,), 8, 2, 64, dtypes.int8)
  t = lambda a: Tensor(a).realize()
  q, bt, lens = t(rng.standard_normal((1, 4, 64)).astype(np.float32)), t(tables), t(np.array([9], np.int32))
  with pytest.raises(ValueError, match="k_scale and v_scale"):
    M.paged_attention_decode(q, PagedKVCache(t(k), t(v)), bt, lens, 0.125, backend="emulator")
  with pytest.raises(ValueError, match="k_scale must be float16"):
    M.paged_attention_decode(q, PagedKVCache(t(k), t(v), t(ks.astype(np.float32)), t(vs)), bt, lens, 0.125, backend="emulator")
  with pytest.raises(ValueError, match="one dtype"):
    M.paged_attention_prefill(q, PagedKVCache(t(k), t(v.astype(np.float16))), bt, t(np.zeros(1, np.int32)), lens, 0.125,
                              backend="emulator")
  with pytest.raises(TypeError, match="PagedKVCache"):
    M.paged_attention_decode(q, (t(k), t(v)), bt, lens, 0.125, backend="emulator")


@pytest.mark.parametrize("cache_dt", [dtypes.float32, dtypes.int8], ids=dt_id)
def test_tinyjit_decode_step(cache_dt):
  """A jitted step (rope + cache write, decode, prefill, int4) replayed with changed inputs gives fresh results; the
  cache written by one replay (codes and scales, for int8) is what the next one reads."""
  rng = np.random.default_rng(7)
  D, H, KVH, bs, num_blocks, K, N, g = 64, 8, 2, 8, 24, 128, 40, 32
  cache = tensor_cache(random_cache(rng, num_blocks, bs, KVH, D, cache_dt), "CPU")
  k_ref, v_ref = (a.reshape(-1, KVH, D) for a in cache_f64([c.numpy() for c in cache.tensors()]))
  cos_sin = rope_table(128, D)
  cs = Tensor(cos_sin).realize()
  packed, scales, biases, w = quantize_int4(rng, N, K, g)
  wt = [Tensor(a).realize() for a in (packed, scales, biases)]
  tables = np.array([[3, 17, 5, 9, 0, 0], [11, 2, 20, 7, 14, 0]], np.int32)
  bt = Tensor(tables).realize()

  @TinyJit
  def step(q, k, v, pos, slots, lens, x):
    qkv = Tensor.cat(*(a.reshape(2, -1) for a in (q, k, v)), dim=1)
    q_rot, written = M.rope_and_cache_write(qkv, H, KVH, pos, cs, cache, slots, backend="emulator")
    o = M.paged_attention_decode(q_rot, written, bt, lens, D ** -0.5, backend="emulator")
    seq = Tensor([0, 1], dtype=dtypes.int32)
    p = M.paged_attention_prefill(q_rot, written, bt, seq, pos, D ** -0.5, backend="emulator")
    y = M.int4_matmul(x, *wt, g, backend="emulator")
    return o.realize(), p.realize(), y.realize()

  lens = np.array([13, 30], np.int32)
  for _ in range(5):  # call 0 eager, 1 captures, 2.. replay
    pos = lens - 1
    slots = np.array([tables[b, p // bs] * bs + p % bs for b, p in enumerate(pos)], np.int32)
    q, k, v = (rng.standard_normal((2, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    x = rng.standard_normal((2, K)).astype(np.float32)
    o, p, y = step(*[Tensor(a).realize() for a in (q, k, v, pos, slots, lens, x)])
    if cache_dt == dtypes.int8:   # the rows written in place, against the reference quantization of the new k and v
      now = [c.numpy() for c in cache.tensors()]
      for x_new, codes, sc in ((rope_ref(k, pos, cos_sin), now[0], now[2]), (v.astype(np.float64), now[1], now[3])):
        check_int8_rows(x_new, codes.reshape(-1, KVH, D)[slots], sc.reshape(-1, KVH)[slots])
      k_ref, v_ref = (a.reshape(-1, KVH, D) for a in cache_f64(now))
    else: k_ref[slots], v_ref[slots] = rope_ref(k, pos, cos_sin), v
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
  cache, tables = paged_inputs(rng, (20, 5), 16, 2, 64, dtypes.float32)
  q, lens = rng.standard_normal((2, 8, 64)).astype(np.float32), np.array([20, 5], np.int32)
  (launch,) = M.decode_launches(2, 8, 2, 64, 16, tables.shape[1], dtypes.float32, dtypes.float32, 0.125)
  args = [q, *cache, tables, lens, np.zeros_like(q), np.array(launch.params, np.int32)]
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
  assert launch.kernel.startswith("int4_gemv_") and launch.params[4] == lanes   # (M, N, K, group_size, team_lanes, eps)
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
  cache, tables = paged_inputs(rng, lens, bs, KVH, D, dtypes.float16, extra_blocks=128 - -(-max(lens) // bs))
  q = rng.standard_normal((len(lens), H, D)).astype(np.float16)
  lens = np.array(lens, np.int32)
  ls = M.decode_launches(len(lens), H, KVH, D, bs, tables.shape[1], dtypes.float16, dtypes.float16, D ** -0.5)
  nparts = 128 * bs // P
  assert [l.kernel for l in ls] == ["paged_attention_decode_partitioned_f16_f16_64_g4", "paged_attention_reduce_f16"]
  assert ls[0].grid == (nparts, KVH, len(lens)) and ls[0].threads == (256, 1, 1)
  assert ls[1].grid == (H, len(lens), 1)
  used = -(-lens // P)
  tmp, sums, maxes = (np.full(s, np.nan, np.float32) for s in ((len(lens), H, nparts, D), (len(lens), H, nparts), (len(lens), H, nparts)))
  direct_run(ls[0], [q, *cache, tables, lens, tmp, sums, maxes], order)
  for b, u in enumerate(used):
    assert np.isfinite(tmp[b, :, :u]).all() and np.isfinite(sums[b, :, :u]).all() and np.isfinite(maxes[b, :, :u]).all()
    assert np.isnan(tmp[b, :, u:]).all() and np.isnan(sums[b, :, u:]).all(), f"seq {b}: a partition past the context was written"
  sums[used == 1], maxes[used == 1] = np.nan, np.nan  # a single-partition sequence must not need its statistics
  out = np.zeros_like(q)
  direct_run(ls[1], [tmp, sums, maxes, lens, out], order)
  assert not out[lens == 0].any()
  err = rel_err(out, decode_ref(q, *cache_f64(cache), tables, lens, D ** -0.5))
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
  cache, tables = paged_inputs(rng, (500, 36), bs, KVH, D, dtypes.float16)
  q = rng.standard_normal((len(seq), H, D)).astype(np.float16)
  perm = rng.permutation(len(seq))
  shuffled = run_prefill("direct", q[perm], cache, tables, seq[perm], pos[perm], D ** -0.5)
  assert not shuffled[seq[perm] < 0].any()
  err = rel_err(shuffled, prefill_ref(q[perm], *cache_f64(cache), tables, seq[perm], pos[perm], D ** -0.5))
  assert err < F16_TOL, err
  ordered = run_prefill("direct", q, cache, tables, seq, pos, D ** -0.5)
  assert np.array_equal(shuffled, ordered[perm])


INT8_MSL = """#include <metal_stdlib>
using namespace metal;
// codes of x, 4 per thread (rint: ties to even, then a conversion toward zero), and the codes read back as float
kernel void quantize(device const float* x [[buffer(0)]], device char* codes [[buffer(1)]], device float* back [[buffer(2)]],
                     device const int* offset [[buffer(3)]], uint i [[thread_position_in_grid]]) {
  *(device char4*)(codes + 4 * i) = char4(clamp(rint(*(device const float4*)(x + 4 * i)), float4(-127.0f), float4(127.0f)));
  *(device float4*)(back + 4 * i) = float4(*(device const char4*)(codes + 4 * i + offset[0]));
}
"""


def test_emulator_int8_vectors():
  """What the int8 cache kernels need from the emulator, as MSL defines it: rint rounds ties to even, char4(float4)
  converts element-wise, char is signed (-1 reads back as -1.0 on every host), and a char4 access needs 4-byte
  alignment (an offset of 2 bytes is refused, as it would misread on a GPU)."""
  lib = compile_source(INT8_MSL, "int8_vectors.metal")
  x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.6, -300.0, 3.2, -3.7, 64.49, -1.0], np.float32)
  codes, back = np.zeros(12, np.int8), np.zeros(12, np.float32)
  lib.run("quantize", [x, codes, back, np.array([0], np.int32)], (3, 1, 1), (1, 1, 1))
  np.testing.assert_array_equal(codes, [0, 2, 2, 0, -2, -2, 127, -127, 3, -4, 64, -1])
  np.testing.assert_array_equal(back, codes.astype(np.float32))
  with pytest.raises(EmulatorError, match="misaligned"):
    lib.run("quantize", [x, np.zeros(16, np.int8), back, np.array([2], np.int32)], (3, 1, 1), (1, 1, 1))
