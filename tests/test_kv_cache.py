"""Quantized KV caches (`kv_cache_dtype="int8"`, `"int4"` rotated and unrotated): their size, their writes and their
attention on the CPU-side backends, against the float64 numpy reference of each format (tests/kv_reference.py, its
rotation from scipy's Hadamard matrix). The Metal kernels' int8 variants are tested in tests/test_metal_kernels.py."""
from __future__ import annotations
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from conftest import our_prefill_logits
from kv_reference import dequantize_int4_ref, dequantize_int8_ref, quantize_int4_ref, quantize_int8_ref, unpack_int4_ref
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.kernels import portable
from tinyvllm.kernels.kv_cache import KVCacheFormat, PagedKVCache


def rel_err(out, ref) -> float: return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


def zeros(shape, dtype): return Tensor.zeros(*shape, dtype=dtype).contiguous().realize()


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_bytes_per_block_and_capacity(head_dim):
  """Counted by hand: K and V, per layer, per token, per KV head: head_dim codes + a 2-byte scale (int8)."""
  layers, bs, kvh = 30, 16, 3
  count = lambda per_vector: 2 * layers * bs * kvh * per_vector
  assert KVCacheFormat("int8").bytes_per_block(layers, bs, kvh, head_dim) == count(head_dim + 2)
  assert KVCacheFormat("int4", True).bytes_per_block(layers, bs, kvh, head_dim) == count(head_dim // 2 + 2)
  assert 2 * head_dim / (head_dim // 2 + 2) >= 3.5   # int4: 3.76x float16 at head_dim 64, 3.88x at 128
  # k8v4: int8 keys, int4 values
  assert KVCacheFormat("k8v4", True).bytes_per_block(layers, bs, kvh, head_dim) == count(head_dim + 2) // 2 + count(head_dim // 2 + 2) // 2
  assert KVCacheFormat("float16").bytes_per_block(layers, bs, kvh, head_dim) == count(2 * head_dim)
  assert KVCacheFormat("float32").bytes_per_block(layers, bs, kvh, head_dim) == count(4 * head_dim)
  ratio16, ratio32 = (2 * head_dim) / (head_dim + 2), (4 * head_dim) / (head_dim + 2)
  assert ratio16 >= 1.9 and ratio32 >= 3.8   # the capacity targets, for every head_dim the kernels take


def test_resolve_and_bad_values(tiny_model):
  assert KVCacheFormat.resolve("auto", "float16").storage == "float16"
  assert KVCacheFormat.resolve("int8", "float32").quantized
  assert KVCacheFormat.resolve("int4", "float32") == KVCacheFormat("int4", rotated=True)
  assert KVCacheFormat.resolve("int4-unrotated", "float32") == KVCacheFormat("int4", rotated=False)
  assert KVCacheFormat.resolve("k8v4", "float16") == KVCacheFormat("k8v4", rotated=True)
  for bad in ("fp8", "int2", "INT8", None):
    with pytest.raises(ConfigError, match="kv_cache_dtype"): LLM(str(tiny_model), kv_cache_dtype=bad)


def test_portable_write_matches_reference():
  """Fresh random K/V rows at scattered slots, two padding tokens (slot -1) that must write nothing."""
  rng = np.random.default_rng(0)
  T, KVH, D, NB, BS = 37, 2, 64, 12, 8
  k = (rng.standard_normal((T, KVH, D)) * rng.uniform(0.1, 5, (T, KVH, 1))).astype(np.float32)
  v = rng.standard_normal((T, KVH, D)).astype(np.float32)
  slots = rng.permutation(NB * BS)[:T].astype(np.int32)
  slots[[3, 20]] = -1
  cache = PagedKVCache.allocate(KVCacheFormat("int8"), NB, BS, KVH, D, zeros)
  cache = portable.write_cache(cache, Tensor(k), Tensor(v), Tensor(slots))
  kq, vq, ks, vs = (t.numpy().reshape(NB * BS, *t.shape[2:]) for t in cache.tensors())
  written = slots >= 0
  for codes, scales, x in ((kq, ks, k), (vq, vs, v)):
    ref_codes, ref_scales = quantize_int8_ref(x[written])
    # float32 amax / 127 and x / s against float64: a code may differ by one where x / s lies within float32
    # rounding of a half-integer, a scale by one float16 step where amax / 127 lies on a rounding boundary
    assert np.abs(codes[slots[written]].astype(int) - ref_codes).max() <= 1
    assert (codes[slots[written]] == ref_codes).mean() > 0.999
    np.testing.assert_allclose(scales[slots[written]].astype(np.float64), ref_scales.astype(np.float64), rtol=2 ** -10)
    untouched = np.setdiff1d(np.arange(NB * BS), slots[written])
    assert not codes[untouched].any() and not scales[untouched].any()


def attention_ref(q, k, v, tables, q_pos, scale, BS):
  """float64 attention of q [P, C, H, D] over dequantized K/V [NB*BS, KVH, D]."""
  P, C, H, D = q.shape
  KVH = k.shape[1]
  out = np.zeros(q.shape)
  for p in range(P):
    slots = (tables[p][:, None] * BS + np.arange(BS)).reshape(-1)
    for c in range(C):
      n = q_pos[p, c] + 1
      for h in range(H):
        kk, vv = k[slots[:n], h // (H // KVH)], v[slots[:n], h // (H // KVH)]
        s = kk @ q[p, c, h] * scale
        w = np.exp(s - s.max())
        out[p, c, h] = w @ vv / w.sum()
  return out


def test_portable_attention_reads_int8():
  """Random codes and scales (never zeros), causal chunks over scattered blocks: float32 arithmetic on exactly
  representable dequantized values, so 1e-5 relative covers the summation order; a wrong scale or index is O(1)."""
  rng = np.random.default_rng(1)
  NB, BS, KVH, D, H, P, C, MB = 64, 8, 2, 64, 4, 3, 5, 6
  codes = [rng.integers(-127, 128, (NB, BS, KVH, D)).astype(np.int8) for _ in range(2)]
  scales = [rng.uniform(0.001, 0.05, (NB, BS, KVH)).astype(np.float16) for _ in range(2)]
  cache = PagedKVCache(*(Tensor(a) for a in (*codes, *scales)))
  tables = np.stack([rng.permutation(NB)[:MB] for _ in range(P)]).astype(np.int32)
  q_pos = np.stack([np.arange(C) + rng.integers(0, MB * BS - C) for _ in range(P)]).astype(np.int32)
  q = rng.standard_normal((P, C, H, D)).astype(np.float32)
  out = portable.paged_attention(Tensor(q), cache, Tensor(tables), Tensor(q_pos), D ** -0.5).numpy()
  k, v = (dequantize_int8_ref(c, s).reshape(NB * BS, KVH, D) for c, s in zip(codes, scales))
  assert rel_err(out, attention_ref(q.astype(np.float64), k, v, tables, q_pos, D ** -0.5, BS)) < 1e-5


@pytest.mark.parametrize("backend", ["portable", "cpu"])
def test_model_cache_and_logits(tiny_model_factory, backend):
  """A 60-token prefill through the whole model. Layer 0's cached K/V are the float run's, quantized by the
  reference; logits move from the float cache's by the int8 noise only (measured ~1.5% on this random model,
  whose logits are small; a wrong dequantization moves them by O(100%)); the cpu layer's int8 logits equal the
  portable path's within float32 summation order."""
  path = tiny_model_factory("gqa")
  ids = np.random.default_rng(2).integers(4, 380, 60).tolist()
  ref_logits, ref_cache = our_prefill_logits(path, ids, backend, block_size=8, return_cache=True)
  logits, cache = our_prefill_logits(path, ids, backend, block_size=8, kv_cache_dtype="int8", return_cache=True)
  (k_ref, v_ref), (kq, vq, ks, vs) = ref_cache[0], cache[0]
  for codes, scales, x in ((kq, ks, k_ref), (vq, vs, v_ref)):
    ref_codes, ref_scales = quantize_int8_ref(x)
    assert np.abs(codes.astype(int) - ref_codes).max() <= 1 and (codes == ref_codes).mean() > 0.999
    np.testing.assert_allclose(scales.astype(np.float64), ref_scales.astype(np.float64), rtol=2 ** -10)
  assert 1e-4 < rel_err(logits, ref_logits) < 0.05
  if backend == "cpu":
    portable_logits = our_prefill_logits(path, ids, "portable", block_size=8, kv_cache_dtype="int8")
    assert rel_err(logits, portable_logits) < 1e-4


def test_generation_cpu_matches_portable(tiny_model_factory):
  """Greedy decode with an int8 cache: chunked prefill, batched decode, preemption-free; tokens equal across backends."""
  path = tiny_model_factory("gqa")
  rng = np.random.default_rng(3)
  prompts = [{"prompt_token_ids": rng.integers(4, 380, n).tolist()} for n in (5, 33, 70)]
  params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
  runs = {}
  for b in ("portable", "cpu"):
    llm = LLM(str(path), kernel_backend=b, kv_cache_dtype="int8", block_size=8, num_kv_blocks=48, max_num_batched_tokens=32)
    runs[b] = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
  for a, b in zip(runs["portable"], runs["cpu"]):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
      assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in lp_a) < 1e-3


def codes_and_scales(cache_rows: list[np.ndarray], int4: bool):
  """(K codes, V codes, K scales, V scales) of a cache's rows, int4 codes unpacked."""
  kq, vq, ks, vs = cache_rows
  return (unpack_int4_ref(kq), unpack_int4_ref(vq)) if int4 else (kq, vq), (ks, vs)


def check_codes(codes, scales, x, kv_cache_dtype):
  """Codes within one step of the reference (a tie, or float32 against float64 rounding of x / s or of the
  rotation's sums), almost all equal; scales within one float16 step."""
  ref_codes, ref_scales = quantize_int8_ref(x) if kv_cache_dtype == "int8" else quantize_int4_ref(x, kv_cache_dtype == "int4")
  assert np.abs(codes.astype(int) - ref_codes).max() <= 1 and (codes == ref_codes).mean() > 0.995
  np.testing.assert_allclose(scales.astype(np.float64), ref_scales.astype(np.float64), rtol=2 ** -10)


@pytest.mark.parametrize("kv_cache_dtype", ["int4", "int4-unrotated"])
def test_portable_int4_write_matches_reference(kv_cache_dtype):
  rng = np.random.default_rng(4)
  T, KVH, D, NB, BS = 29, 2, 96, 8, 8     # head_dim 96: the rotation is three Hadamard blocks of 32
  k = (rng.standard_normal((T, KVH, D)) * rng.uniform(0.1, 5, (T, KVH, 1))).astype(np.float32)
  k[:, :, 7] *= 20                        # an outlier channel, as real keys have: what the rotation is for
  v = rng.standard_normal((T, KVH, D)).astype(np.float32)
  slots = rng.permutation(NB * BS)[:T].astype(np.int32)
  slots[5] = -1
  fmt = KVCacheFormat.resolve(kv_cache_dtype, "float32")
  cache = PagedKVCache.allocate(fmt, NB, BS, KVH, D, zeros)
  cache = portable.write_cache(cache, Tensor(k), Tensor(v), Tensor(slots))
  rows = [t.numpy().reshape(NB * BS, *t.shape[2:]) for t in cache.tensors()]
  (kq, vq), (ks, vs) = codes_and_scales(rows, True)
  w = slots[slots >= 0]
  check_codes(kq[w], ks[w], k[slots >= 0], kv_cache_dtype)
  check_codes(vq[w], vs[w], v[slots >= 0], kv_cache_dtype)
  untouched = np.setdiff1d(np.arange(NB * BS), w)
  assert not rows[0][untouched].any() and not rows[2][untouched].any()
  # what the rotation buys on keys with an outlier channel: the round trip's error, measured on the reference
  err = lambda rot: rel_err(dequantize_int4_ref(*(np.asarray(a) for a in _packed_ref(k, rot)), rotated=rot), k)
  if kv_cache_dtype == "int4": assert err(True) < 0.5 * err(False)


def _packed_ref(x, rotated):
  codes, scale = quantize_int4_ref(x, rotated)
  c = (codes + 8).astype(np.uint8)
  return c[..., 0::2] | (c[..., 1::2] << 4), scale


@pytest.mark.parametrize("rotated", [True, False])
def test_portable_attention_reads_int4(rotated):
  """Random packed codes and scales: the cache holds rotated vectors y, meaning R y; float32 arithmetic on exact
  dequantized values plus the two rotations' float32 sums, so 1e-5 relative."""
  rng = np.random.default_rng(5)
  NB, BS, KVH, D, H, P, C, MB = 64, 8, 2, 64, 6, 2, 4, 5
  packed = [rng.integers(0, 256, (NB, BS, KVH, D // 2)).astype(np.uint8) for _ in range(2)]
  scales = [rng.uniform(0.01, 0.3, (NB, BS, KVH)).astype(np.float16) for _ in range(2)]
  cache = PagedKVCache(*(Tensor(a) for a in (*packed, *scales)), rotated=rotated)
  tables = np.stack([rng.permutation(NB)[:MB] for _ in range(P)]).astype(np.int32)
  q_pos = np.stack([np.arange(C) + rng.integers(0, MB * BS - C) for _ in range(P)]).astype(np.int32)
  q = rng.standard_normal((P, C, H, D)).astype(np.float32)
  out = portable.paged_attention(Tensor(q), cache, Tensor(tables), Tensor(q_pos), D ** -0.5).numpy()
  k, v = (dequantize_int4_ref(p, s, rotated).reshape(NB * BS, KVH, D) for p, s in zip(packed, scales))
  assert rel_err(out, attention_ref(q.astype(np.float64), k, v, tables, q_pos, D ** -0.5, BS)) < 1e-5


@pytest.mark.parametrize("kv_cache_dtype", ["int4", "int4-unrotated", "k8v4"])
def test_cpu_layer_int4_matches_portable_and_reference(tiny_model_factory, kv_cache_dtype):
  """The fused C layer's int4 cache (its own fast Walsh-Hadamard transform, nibble packing and unpacking in
  vectors) against the portable path (tested above against numpy): layer 0's codes against the reference of the
  float run's K/V, and logits equal within float32 summation order."""
  path = tiny_model_factory("gqa")
  ids = np.random.default_rng(6).integers(4, 380, 50).tolist()
  _, ref_cache = our_prefill_logits(path, ids, "cpu", block_size=8, return_cache=True)
  logits, cache = our_prefill_logits(path, ids, "cpu", block_size=8, kv_cache_dtype=kv_cache_dtype, return_cache=True)
  kq, vq, ks, vs = cache[0]
  k8 = kv_cache_dtype == "k8v4"   # int8 keys beside rotated int4 values
  check_codes(kq if k8 else unpack_int4_ref(kq), ks, ref_cache[0][0], "int8" if k8 else kv_cache_dtype)
  check_codes(unpack_int4_ref(vq), vs, ref_cache[0][1], "int4" if k8 else kv_cache_dtype)
  portable_logits = our_prefill_logits(path, ids, "portable", block_size=8, kv_cache_dtype=kv_cache_dtype)
  assert rel_err(logits, portable_logits) < 1e-4


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4-unrotated", "k8v4"])
def test_cpu_layer_attention_long_context(tiny_model_factory, kv_cache_dtype):
  """The fused C attention over 1100 cached tokens (34 tiles of 8-key groups, a ragged last one) against the portable
  path at every position. One layer, so both backends attend over the same cache bits (asserted) and differ by
  float32 summation order only (measured 6e-6). Rotated keys are left out here: the two backends' rotations sum in
  different orders, which can move a float16 scale by one step (seen at 1 of 1100 keys), and the positions reading
  that key then differ by ~1e-3; short contexts cover the rotated path above."""
  path = tiny_model_factory("long")
  ids = np.random.default_rng(8).integers(4, 380, 1100).tolist()
  logits, cache = our_prefill_logits(path, ids, "cpu", kv_cache_dtype=kv_cache_dtype, return_cache=True)
  ref, ref_cache = our_prefill_logits(path, ids, "portable", kv_cache_dtype=kv_cache_dtype, return_cache=True)
  assert all(np.array_equal(a, b) for a, b in zip(cache[0], ref_cache[0]))
  err = np.linalg.norm(logits - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
  assert err.max() < 1e-4


def test_metal_backends_refuse_int4(tiny_model_factory):
  with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
    LLM(str(tiny_model_factory("metal")), kernel_backend="emulator", kv_cache_dtype="int4", num_kv_blocks=16)


def test_portable_k8v4_write_and_attention():
  """int8 keys (unrotated) beside rotated int4 values: each tensor against its own reference, then attention over
  both (q is not rotated, the output is)."""
  rng = np.random.default_rng(7)
  T, KVH, D, NB, BS, H = 21, 2, 64, 8, 8, 4
  k, v = (rng.standard_normal((T, KVH, D)).astype(np.float32) for _ in range(2))
  slots = rng.permutation(NB * BS)[:T].astype(np.int32)
  cache = PagedKVCache.allocate(KVCacheFormat.resolve("k8v4", "float32"), NB, BS, KVH, D, zeros)
  assert cache.k.dtype == dtypes.int8 and cache.v.dtype == dtypes.uint8 and not cache.k_rotated and cache.v_rotated
  cache = portable.write_cache(cache, Tensor(k), Tensor(v), Tensor(slots))
  kq, vq, ks, vs = (t.numpy().reshape(NB * BS, *t.shape[2:]) for t in cache.tensors())
  check_codes(kq[slots], ks[slots], k, "int8")
  check_codes(unpack_int4_ref(vq[slots]), vs[slots], v, "int4")
  tables = rng.permutation(NB)[None, :3].astype(np.int32)
  q_pos = np.arange(5, 10, dtype=np.int32)[None]
  q = rng.standard_normal((1, 5, H, D)).astype(np.float32)
  out = portable.paged_attention(Tensor(q), cache, Tensor(tables), Tensor(q_pos), D ** -0.5).numpy()
  k_ref = dequantize_int8_ref(kq, ks)
  v_ref = dequantize_int4_ref(vq, vs, rotated=True)
  assert rel_err(out, attention_ref(q.astype(np.float64), k_ref, v_ref, tables, q_pos, D ** -0.5, BS)) < 1e-5
