"""kernels/gemv.py, the decode-step projections on a GPU, against float64 numpy on every device kind the suite reaches:
the CPU device (the kernel's loops as written), tinygrad's METAL device through our emulator and the GPU named by
TINYVLLM_TEST_DEVICE (both with the GPU schedule: the group's threads, shared-memory sums, vector loads). Its schedule
is also lowered for an H100 without one (nvrtc), beside tinygrad's own matmul, whose miss is the reason for the kernel.

Tolerances, relative (‖out−ref‖/‖ref‖) against float64 sums of the same rounded inputs: float32 1e-5 (summation
order only); float16 2e-3 (the output is rounded to float16 once, up to 2^-11 relative an element)."""
from __future__ import annotations
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinyvllm.kernels import gemv
from tinyvllm.quant import blocks
from tinyvllm.quant.formats import FLOAT, INT4, INT8, PACKED, LinearWeights
from test_blocks import random_ggml
from test_replay import DEVICES

TOL = {"float32": 1e-5, "float16": 2e-3}
EPS = 1e-5


def silu(z):
  with np.errstate(over="ignore"): return z / (1 + np.exp(-z))   # exp(-z) overflows to inf for z < -709: silu -> -0
def gelu_tanh(z): return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))


def rel(out: Tensor, ref: np.ndarray) -> float:
  return float(np.linalg.norm(out.numpy().astype(np.float64) - ref) / np.linalg.norm(ref))


def inputs(rng, T: int, K: int, N: int, dtype: str, device: str):
  """Random x `[T, K]`, W `[N, K]` (floats), norm weight, bias, residual: as device tensors of `dtype` and as float64
  arrays of the same rounded values."""
  arrays = [rng.standard_normal((T, K)), rng.standard_normal((N, K)) / np.sqrt(K), 1 + 0.5 * rng.standard_normal(K),
            rng.standard_normal(N), rng.standard_normal((T, N // 2))]
  rounded = [a.astype(dtype).astype(np.float64) for a in arrays]
  return [Tensor(a.astype(dtype), device=device).realize() for a in arrays], rounded


def quantized(rng, fmt: str, N: int, K: int, device: str, group: int = 32) -> tuple[LinearWeights, np.ndarray]:
  """A random weight stored as `fmt` (quant/formats.py) on the device, and the float64 matrix it holds, from its codes:
  INT4, codes 0..15 packed 8 a uint32 (code i in bits 4i..4i+3) times a float16 scale plus a bias per `group`; INT8,
  codes -127..127 times a float16 scale per 32; a GGUF type's name (Q4_K, ...), random valid blocks repacked
  (quant/blocks.py), the matrix the `gguf` package's dequantizer reads from them."""
  if fmt in blocks.GGML_TYPES:
    import gguf
    raw = random_ggml(fmt, N, K, rng)
    parts, spec = blocks.from_ggml(raw, fmt, (N, K))
    W = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(N, K).astype(np.float64)
    return LinearWeights(PACKED, **{k: Tensor(v, device=device).realize() for k, v in parts.items() if k != "qspec"}, spec=spec), W
  if fmt == INT4:
    codes = rng.integers(0, 16, (N, K)).astype(np.uint32)
    scales, biases = (rng.standard_normal((N, K // group)) * 0.05).astype(np.float16), (rng.standard_normal((N, K // group)) * 0.1).astype(np.float16)
    words = sum(codes.reshape(N, K // 8, 8)[..., i] << np.uint32(4 * i) for i in range(8)).astype(np.uint32)
    W = codes * np.repeat(scales.astype(np.float64), group, 1) + np.repeat(biases.astype(np.float64), group, 1)
    return LinearWeights(INT4, *(Tensor(a, device=device).realize() for a in (words, scales)), biases=Tensor(biases, device=device).realize()), W
  codes, scales = rng.integers(-127, 128, (N, K)).astype(np.int8), (rng.uniform(0.5, 1.5, (N, K // 32)) / 127 / np.sqrt(K)).astype(np.float16)
  W = codes * np.repeat(scales.astype(np.float64), 32, 1)
  return LinearWeights(INT8, Tensor(codes, device=device).realize(), Tensor(scales, device=device).realize()), W


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("T,K,N", [(1, 256, 64), (3, 128, 96), (8, 576, 32), (2, 40, 6), (24, 64, 16), (1, 8192, 8)])
def test_every_fusion_matches_numpy(device, dtype, T, K, N):
  """Plain (+ bias), normed (+ bias), normed and gated (SwiGLU and GeGLU), and with the residual added into a given
  buffer. K = 576 (SmolLM2's hidden size) takes a group of 8 threads; 40 and 6 divide no full vector or group; 24
  rows are 8 a thread in 3 blocks of rows; one row of few outputs spreads (`SPREAD_BELOW`): one row a thread, and
  K = 8192 (a long row) 64 threads a row."""
  rng = np.random.default_rng(T * 1000 + K + N)
  (x, w, g, b, r), (X, W, G, B, R) = inputs(rng, T, K, N, dtype, device)
  half = N // 2
  normed = X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G
  tol = TOL[dtype]
  assert rel(gemv.gemv(x, LinearWeights(FLOAT, w)), X @ W.T) < tol
  assert rel(gemv.gemv(x, LinearWeights(FLOAT, w, bias=b)), X @ W.T + B) < tol
  assert rel(gemv.gemv(x, LinearWeights(FLOAT, w, bias=b), norm=(g, EPS)), normed @ W.T + B) < tol
  gate_up = normed @ W.T
  assert rel(gemv.gemv(x, LinearWeights(FLOAT, w), norm=(g, EPS), act="silu"), silu(gate_up[:, :half]) * gate_up[:, half:]) < tol
  gate_up = normed @ W.T + B
  assert rel(gemv.gemv(x, LinearWeights(FLOAT, w, bias=b), norm=(g, EPS), act="gelu_pytorch_tanh"),
             gelu_tanh(gate_up[:, :half]) * gate_up[:, half:]) < tol
  w_half = LinearWeights(FLOAT, w[:half].contiguous().realize())
  out = Tensor.empty(T, half, dtype=x.dtype, device=device).realize()
  y = gemv.gemv(x, w_half, residual=r, out=out).realize()
  assert rel(y, X @ W[:half].T + R) < tol
  assert rel(out, X @ W[:half].T + R) < tol, "the residual sum goes into the given buffer"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,group", [(INT4, 32), (INT4, 64), (INT4, 128), (INT8, 32)])
@pytest.mark.parametrize("T,K,N", [(1, 1024, 16), (5, 128, 12), (32, 256, 16)])
def test_quantized_weights_match_numpy(device, fmt, group, T, K, N):
  """Codes read and scaled inside the kernel, against numpy's dequantized matrix: plain, normed and gated, and with
  the residual. K = 1024 takes the GPU's whole schedule (32 threads a row on consecutive words of 8 codes, 4 words a
  thread in flight); a group of 128 spreads a group over 16 threads."""
  rng = np.random.default_rng(K + N + T + group)
  (x, _, g, _, r), (X, _, G, _, R) = inputs(rng, T, K, N, "float16", device)
  lw, W = quantized(rng, fmt, N, K, device, group)
  normed = X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G
  tol = TOL["float16"]
  assert rel(gemv.gemv(x, lw), X @ W.T) < tol
  gate_up = normed @ W.T
  assert rel(gemv.gemv(x, lw, norm=(g, EPS), act="silu"), silu(gate_up[:, :N // 2]) * gate_up[:, N // 2:]) < tol
  r_full = Tensor(np.concatenate([R, R], 1).astype(np.float16), device=device)
  assert rel(gemv.gemv(x, lw, residual=r_full), X @ W.T + np.concatenate([R, R], 1)) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,group,K", [(INT8, 32, 32), (INT4, 32, 32), (INT4, 64, 576)])
def test_quantized_weights_of_few_groups(device, fmt, group, K):
  """An input of one group (no threads to share a row's groups), and SmolLM2's 576 in groups of 64 (9: one thread a
  row, so a block takes more rows), normed and gated, against numpy."""
  rng = np.random.default_rng(K + group)
  (x, _, g, _, _), (X, _, G, _, _) = inputs(rng, 2, K, 16, "float16", device)
  lw, W = quantized(rng, fmt, 16, K, device, group)
  normed = X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G
  gate_up = normed @ W.T
  assert rel(gemv.gemv(x, lw, norm=(g, EPS), act="silu"), silu(gate_up[:, :8]) * gate_up[:, 8:]) < TOL["float16"]


PACKED_CASES = [(q, 512) for q in blocks.GGML_TYPES] + [("Q4_K", 2048), ("Q6_K", 4352), ("Q5_0", 416), ("Q5_1", 416),
                                                         ("affine6g64", 512), ("affine8g32", 256), ("affine8g32", 160)]
# on the emulated METAL device (the GPU schedule; a few seconds a kernel to compile there), one case of each way of
# reading a code and its scale: 6-bit fields and 32 threads (Q4_K), 2 high bits and signed two-level scales (Q6_K), 1
# high bit and float16 scale and bias (Q5_1), a codebook (IQ4_NL), 4 high bits in groups of 32 (MLX 8-bit), a last
# block of high bits part-filled (Q5_0 at K = 416: 13 runs of 32, blocks of 8)
ON_METAL = {("Q4_K", 2048), ("Q6_K", 512), ("Q5_1", 512), ("IQ4_NL", 512), ("affine8g32", 256), ("Q5_0", 416)}


def packed(rng, name: str, N: int, K: int, device: str) -> tuple[LinearWeights, np.ndarray]:
  """A packed weight (quant/blocks.py) and its float64 matrix: a GGUF type's (`quantized`), or MLX's affine b-bit with
  groups of G ("affine6g64"), laid out from random codes, scales and biases (its matrix computed from those)."""
  if name in blocks.GGML_TYPES: return quantized(rng, name, N, K, device)
  bits, G = map(int, name[len("affine"):].split("g"))
  codes = rng.integers(0, 1 << bits, (N, K), dtype=np.uint8)
  s, b = (rng.uniform(0.001, 0.02, (N, K // G)) * rng.choice([-1, 1], (N, K // G))).astype(np.float16), rng.uniform(-0.3, 0.3, (N, K // G)).astype(np.float16)
  spec = blocks.QuantSpec(bits, G)
  parts = blocks.layout(codes, spec, s, None, b)
  W = codes * np.repeat(s.astype(np.float64), G, 1) + np.repeat(b.astype(np.float64), G, 1)
  return LinearWeights(PACKED, **{k: Tensor(v, device=device).realize() for k, v in parts.items() if k != "qspec"}, spec=spec), W


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,K", PACKED_CASES, ids=[f"{q}-K{K}" for q, K in PACKED_CASES])
def test_packed_weights_match_gguf(device, name, K):
  """Every packed layout (GGUF's k-quants, Q5_0/Q5_1, IQ4_XS/IQ4_NL; MLX's 6- and 8-bit) read inside the kernel,
  normed and gated (both halves of the rows: two reads of the weight a thread), against the `gguf` package's
  dequantizer (MLX's: numpy from the codes). K = 2048 gives Q4_K's row its 32 threads over 3 ranges of k's bits
  (`gemv._packed_opts`); 4352 is 17 super-blocks (a top range that is no power of two); 416 and 160 end in a
  part-filled block of high bits (the ranges run past K, masked). Tolerance: float32 outputs, 1e-5 (summation order
  only)."""
  if device != "CPU" and (name, K) not in ON_METAL: pytest.skip("read the same way as a case that runs here")
  rng = np.random.default_rng(K + len(name))
  N = 16
  (x, _, g, _, _), (X, _, G, _, _) = inputs(rng, 2, K, N, "float32", device)
  lw, W = packed(rng, name, N, K, device)
  normed = X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G
  gate_up = normed @ W.T
  assert rel(gemv.gemv(x, lw, norm=(g, EPS), act="silu"), silu(gate_up[:, :N // 2]) * gate_up[:, N // 2:]) < TOL["float32"]


@pytest.mark.parametrize("device", DEVICES)
def test_gate_and_up_stored_apart(device):
  """Gate (Q4_K) and up (Q6_K) in different formats, as a Q4_K_M file may store them: the up GEMV gates its product by
  the gate GEMV's output (`gate=`), against numpy; x's 1/RMS computed once for both (`shared_norm`): 3 kernels."""
  from tinygrad.helpers import GlobalCounters
  rng = np.random.default_rng(9)
  (x, _, g, _, _), (X, _, G, _, _) = inputs(rng, 3, 256, 32, "float32", device)
  (gate, Wg), (up, Wu) = quantized(rng, "Q4_K", 32, 256, device), quantized(rng, "Q6_K", 32, 256, device)
  normed = X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G
  norm = gemv.shared_norm(x, (g, EPS), gate, up)
  y = gemv.gemv(x, up, norm=norm, act="silu", gate=gemv.gemv(x, gate, norm=norm))
  GlobalCounters.reset()
  y.realize()
  assert GlobalCounters.kernel_count == 3
  assert rel(y, silu(normed @ Wg.T) * (normed @ Wu.T)) < TOL["float32"]


def test_packed_layouts_it_takes():
  """A packed layout whose index bits the kernel can name as ranges: every unit (nibble word, run of 32, block of high
  bits, group, super-block) a power of two, and K a whole number of runs, groups and super-blocks. A part-filled last
  block of high bits is taken (Q5_0 at Qwen2.5-0.5B's K = 896: 28 runs, blocks of 8, the top range 4 blocks); a group
  of 96 is not."""
  x = lambda K: type("Rows", (), {"shape": (1, K), "device": "CUDA", "ndim": 2})
  for q, spec in blocks.GGML_SPECS.items():
    assert gemv.packed_cuts(spec, 768) is not None and gemv.packed_cuts(spec, 512) is not None, q
  assert gemv.packed_cuts(blocks.GGML_SPECS["Q4_K"], 2048) == (3, 5, 7, 8)   # nibble, run, half of the 8 scales, super-block
  assert gemv.ranges_of(blocks.GGML_SPECS["Q4_K"], 2048, 0) == (8, 2, 4, 4, 8)
  assert gemv.ranges_of(blocks.GGML_SPECS["Q5_0"], 896, 0) == (4, 8, 4, 2, 4)   # blocks (the last part-filled), run, word, bytes
  q5_0 = LinearWeights(PACKED, Tensor.empty(4, 896 // 8 + 32, dtype=dtypes.uint32), Tensor.empty(4, 28), spec=blocks.GGML_SPECS["Q5_0"])
  assert gemv.applies(x(896), q5_0)
  assert gemv.packed_cuts(blocks.QuantSpec(6, 96), 384) is None and gemv.packed_cuts(blocks.GGML_SPECS["Q4_K"], 384) is None


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
@pytest.mark.parametrize("name,K,normed", [("Q5_0", 64, True), ("affine5g32", 64, True), ("affine8g32", 32, False), ("affine6g32", 32, False)])
def test_a_row_shorter_than_a_block_of_high_bits_keeps_the_matmul(device, name, K, normed):
  """Codes with high bits in a row shorter than one block of them (a toy's size): 5-bit codes at K = 64 failed in
  tinygrad (KernelOptError: the mask past K had shrunk a range the GEMV's opts name), and at K = 32 the plain GEMV of
  6- and 8-bit codes summed wrong (relative error 0.09 to 1.9, found by review). Such a row keeps tinygrad's matmul,
  which a GPU's decode projection then runs: against the `gguf` package's dequantizer (MLX's: numpy from the codes),
  float32, 1e-5. Rows of a whole block or more take the GEMV (`test_packed_weights_match_gguf`)."""
  from tinyvllm.kernels import Kernels
  rng = np.random.default_rng(K)
  (x, _, g, _, _), (X, _, G, _, _) = inputs(rng, 1, K, 16, "float32", device)
  lw, W = packed(rng, name, 16, K, device)
  assert not gemv.applies(x, lw) and gemv.packed_cuts(lw.spec, 256) is not None
  if normed:
    X = X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G
    y = Kernels(device).norm_linear(x, g, EPS, lw)
  else: y = Kernels(device).linear(x, lw)
  assert rel(y, X @ W.T) < TOL["float32"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,K,N", [(1, 256, 96), (8, 64, 40)])
def test_float32_logits_from_half_rows(device, T, K, N):
  """The LM head's GEMV (`Kernels.norm_logits`) stores float32 from float16 x and weights: the float32 sum unrounded,
  so within float32's tolerance of the float64 reference, where a float16 output would be 2^-11 off."""
  rng = np.random.default_rng(T + K + N)
  (x, w, g, _, _), (X, W, G, _, _) = inputs(rng, T, K, N, "float16", device)
  y = gemv.gemv(x, LinearWeights(FLOAT, w), norm=(g, EPS), dtype=dtypes.float32)
  assert y.dtype == dtypes.float32 and rel(y, (X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G) @ W.T) < TOL["float32"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,dtype,T,H,KVH,D,K,pad", [
    (FLOAT, "float16", 1, 4, 2, 64, 256, None),   # batch-1 decode, GQA 2
    (FLOAT, "float32", 3, 6, 2, 32, 96, 1),       # 3 rows, one a padding token
    (FLOAT, "float32", 2, 2, 1, 32, 64, 0),       # the first row a padding token
    (FLOAT, "float32", 1, 2, 1, 32, 64, 0),       # one row, a padding token: tinygrad dropped its mask once (writes none)
    (FLOAT, "float16", 8, 2, 2, 80, 64, 5),       # MAX_ROWS rows, no GQA, a head_dim that is not a power of two
    (INT4, "float16", 2, 4, 1, 64, 128, None),
    (FLOAT, "float16", 32, 4, 2, 64, 128, 7),     # NARROW_MAX_ROWS rows: 8 a thread, 4 blocks of rows
    (INT4, "float16", 16, 4, 2, 64, 256, None),
    (INT8, "float16", 1, 4, 2, 64, 128, None),
    ("Q4_K", "float32", 2, 4, 2, 64, 512, None),       # a packed qkv, stored fused
    ("Q4_K+Q4_K+Q6_K", "float16", 1, 4, 2, 64, 256, None),   # q, k and v stored apart (Q4_K_M's): a kernel each
    ("Q5_0+Q8_0+Q5_K", "float32", 3, 2, 1, 32, 256, 1)])
def test_qkv_projection_with_rope_and_cache_write(device, fmt, dtype, T, H, KVH, D, K, pad):
  """`qkv_rope_write` against numpy: RMSNorm, the projection (+ bias), HF's rotate-half RoPE at each token's position
  (tests/test_metal_kernels.py's reference) and the cache write: q rotated, k rotated and v in their slots, every other
  slot untouched (a padding token, slot -1, writes nothing)."""
  from test_metal_kernels import rope_ref, rope_table
  from tinyvllm.kernels.kv_cache import PagedKVCache
  rng = np.random.default_rng(T * 100 + H + D + K)
  N, NB, BS = (H + 2 * KVH) * D, 12, 16
  (x, w, g, b, _), (X, W, G, B, _) = inputs(rng, T, K, N, dtype, device)
  if fmt == FLOAT: lw = LinearWeights(FLOAT, w, bias=b)
  elif "+" in fmt:   # parts apart: q, k, v
    made = [quantized(rng, f if f != "Q8_0" else INT8, rows * D, K, device) for f, rows in zip(fmt.split("+"), (H, KVH, KVH))]
    lw, W, B = [m[0] for m in made], np.concatenate([m[1] for m in made]), np.zeros(N)
  else: (lw, W), B = quantized(rng, fmt, N, K, device), np.zeros(N)
  positions = rng.integers(0, 200, T).astype(np.int32)
  slots = rng.permutation(NB * BS)[:T].astype(np.int32)
  if pad is not None: slots[pad] = -1
  table = rope_table(256, D, theta=500.0)
  np_dtype = np.float32 if dtype == "float32" else np.float16
  cache_np = [rng.standard_normal((NB, BS, KVH, D)).astype(np_dtype) for _ in range(2)]
  cache = PagedKVCache(*(Tensor(a.copy(), device=device).realize() for a in cache_np))
  q, written = gemv.qkv_rope_write(x, lw, (g, EPS), H, KVH, Tensor(positions, device=device), Tensor(table, device=device), cache,
                                   Tensor(slots, device=device))
  q, k, v = q.numpy(), written.k.numpy(), written.v.numpy()
  heads = ((X / np.sqrt((X * X).mean(-1, keepdims=True) + EPS) * G) @ W.T + B).reshape(T, H + 2 * KVH, D)
  rotated = rope_ref(heads, positions, table)
  tol = TOL[dtype]
  assert q.dtype == np.float32 and rel(Tensor(q), rotated[:, :H]) < tol
  for got, before, ref in ((k, cache_np[0], rotated[:, H:H + KVH]), (v, cache_np[1], heads[:, H + KVH:])):
    got, want = got.reshape(NB * BS, KVH, D), before.reshape(NB * BS, KVH, D).astype(np.float64).copy()
    kept = slots >= 0
    want[slots[kept]] = ref[kept]
    others = np.setdiff1d(np.arange(NB * BS), slots[kept])
    assert (got[others] == want[others]).all(), "only the tokens' slots are written"
    if kept.any(): assert rel(Tensor(got[slots[kept]].astype(np.float64)), want[slots[kept]]) < tol


def test_which_projections_take_it():
  """A GPU's float, INT4, INT8 and packed (k-quant) projections of at most MAX_ROWS rows, float and INT4 ones of at
  most NARROW_OUTPUTS outputs and NARROW_BYTES up to NARROW_MAX_ROWS in whole blocks of X_ROWS_A_THREAD; not the CPU device (our C kernels), not more rows (tinygrad's
  matmul and its tensor cores), not a sharded layer, and not INT4 on the metal backend (its shaders' own GEMV)."""
  from tinyvllm.kernels import Kernels, ShaderKernels
  w = LinearWeights(FLOAT, Tensor.empty(64, 32))
  rows = lambda T, device="CUDA", K=32: type("Rows", (), {"shape": (T, K), "device": device, "ndim": 2, "dtype": dtypes.float32})   # x, without a GPU
  def kernels(cpu: bool, shards: int = 1, base=Kernels) -> Kernels:   # the fields takes_gemv reads, without a device
    k = object.__new__(type("Backend", (base,), {"shards": shards}))
    k.cpu = cpu
    return k
  gpu = kernels(False)
  assert gpu.takes_gemv(rows(1), w) and gpu.takes_gemv(rows(gemv.NARROW_MAX_ROWS), w)
  assert not gpu.takes_gemv(rows(gemv.NARROW_MAX_ROWS + gemv.X_ROWS_A_THREAD), w)
  wide = LinearWeights(FLOAT, Tensor.empty(gemv.NARROW_OUTPUTS + 2, 32))   # gate/up's many outputs: tinygrad's past 8 rows
  assert gpu.takes_gemv(rows(gemv.MAX_ROWS), wide) and not gpu.takes_gemv(rows(16), wide)
  big = LinearWeights(FLOAT, Tensor.empty(4096, 14336, dtype=dtypes.float16))   # the 8B's down: 117 MB, past the L2
  assert gpu.takes_gemv(rows(gemv.MAX_ROWS, K=14336), big) and not gpu.takes_gemv(rows(16, K=14336), big)
  assert gpu.takes_gemv(rows(16), w) and not gpu.takes_gemv(rows(10), w)   # whole blocks of x rows only (10: 2 a thread)
  int8 = LinearWeights(INT8, Tensor.empty(64, 32, dtype=dtypes.int8), Tensor.empty(64, 1))
  int4 = LinearWeights(INT4, Tensor.empty(64, 4, dtype=dtypes.uint32), Tensor.empty(64, 1), biases=Tensor.empty(64, 1))
  q4k = LinearWeights(PACKED, Tensor.empty(64, 32, dtype=dtypes.uint32), Tensor.empty(64, 1, 12, dtype=dtypes.uint8),
                      Tensor.empty(64, 1, 2, dtype=dtypes.float16), spec=blocks.GGML_SPECS["Q4_K"])
  assert gpu.takes_gemv(rows(1), int8) and gpu.takes_gemv(rows(1), int4) and gpu.takes_gemv(rows(1, K=256), q4k)
  assert gpu.takes_gemv(rows(gemv.NARROW_MAX_ROWS), int4) and not gpu.takes_gemv(rows(gemv.MAX_ROWS + 1), int8)
  assert not gpu.takes_gemv(rows(gemv.MAX_ROWS + 1, K=256), q4k)
  assert not gpu.takes_gemv(rows(1, "CPU"), w)
  assert not kernels(False, shards=2).takes_gemv(rows(1), w)
  assert not kernels(True).takes_gemv(rows(1), w)
  shaders = kernels(False, base=ShaderKernels)
  assert shaders.takes_gemv(rows(1), w) and not shaders.takes_gemv(rows(1), int4)


def test_gpu_schedule():
  """The opts for the 1B model's shapes: 16 bytes of a row a thread, 32 threads a row, 4 rows a block, 2 a thread; at
  batch 1 a GEMV of few threads spreads (one row a thread, a long row over 64 threads: the H200's faster schedules in
  bench/gemv.py); none on the CPU device. Sizes that do not divide take the largest that do."""
  from tinygrad.codegen.opt import Opt, OptOps
  assert gemv.kernel_opts("CPU", FLOAT, 1, 3072, 2048) == ()
  assert gemv.kernel_opts("CUDA", FLOAT, 1, 16384, 2048) == (Opt(OptOps.UNROLL, 0, 8), Opt(OptOps.GROUP, 0, 32), Opt(OptOps.LOCAL, 0, 4),
                                                         Opt(OptOps.UPCAST, 0, 2))
  assert gemv.kernel_opts("CUDA", FLOAT, 1, 2048, 2048) == (Opt(OptOps.UNROLL, 0, 8), Opt(OptOps.GROUP, 0, 32), Opt(OptOps.LOCAL, 0, 4))
  assert gemv.kernel_opts("CUDA", FLOAT, 1, 2048, 8192) == (Opt(OptOps.UNROLL, 0, 8), Opt(OptOps.GROUP, 0, 64), Opt(OptOps.LOCAL, 0, 4),
                                                        Opt(OptOps.UPCAST, 0, 2))
  assert gemv.kernel_opts("CUDA", FLOAT, 32, 2048, 8192)[1] == Opt(OptOps.GROUP, 0, 32)
  assert gemv.kernel_opts("METAL", FLOAT, 4, 3072, 2048, itemsize=4) == (Opt(OptOps.UNROLL, 0, 4), Opt(OptOps.GROUP, 0, 32), Opt(OptOps.LOCAL, 1, 4),
                                                         Opt(OptOps.UPCAST, 1, 2), Opt(OptOps.UPCAST, 0, 4))
  assert gemv.kernel_opts("CUDA", FLOAT, 1, 6, 40) == (Opt(OptOps.UNROLL, 0, 8), Opt(OptOps.LOCAL, 0, 2))   # 40 = 5 vectors of 8


def _lowered_for_h100(fn, fmt=FLOAT, group: int = 0):
  """(name, global size, local size) of every kernel `fn` schedules on the CPU device, lowered and compiled for sm_90 as
  on a GPU: our GEMV with its GPU schedule, tinygrad's kernels with its heuristic."""
  return [(program.arg.name, *program.arg.launch_dims({})) for program in _programs_for_h100(fn, fmt, group)]


def _programs_for_h100(fn, fmt=FLOAT, group: int = 0) -> list:
  """The programs of `_lowered_for_h100`."""
  import dataclasses, os
  from test_cuda_compile import NVRTC, h100_renderer, recording_kernels
  if NVRTC is None: pytest.skip("nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
  os.environ["NVRTC_PATH"] = NVRTC
  from tinygrad.codegen import to_program
  from tinygrad.uop.ops import Ops
  with recording_kernels() as asts: fn().realize()
  renderer, out = h100_renderer(), []
  for ast in asts:
    if ast.arg.name.startswith("gemv"):
      T, N, K = map(int, ast.arg.name.split("_")[-3:])
      ast = ast.replace(arg=dataclasses.replace(ast.arg, opts_to_apply=gemv.kernel_opts("CUDA", fmt, T, N, K, group)))
    if ast.arg.name.startswith("inverse_rms"):   # x float16, as a GPU's
      ast = ast.replace(arg=dataclasses.replace(ast.arg, opts_to_apply=gemv.inverse_rms_opts("CUDA", int(ast.arg.name.split("_")[-1]), 2)))
    program = to_program(ast, renderer)
    assert program.src[-1].op is Ops.BINARY and len(program.src[-1].arg) > 0, program.arg.name   # nvrtc compiled it
    out.append(program)
  return out


@pytest.mark.parametrize("T", [1, 8])
def test_h100_launch_against_tinygrads_matmul(T):
  """A float16 qkv projection of the 1B model (3072 x 2048), normed: tinygrad's matmul gives its kernel fewer threads
  than outputs (each looping over whole rows alone; its matrix-vector schedule needs plain loads on both sides), and
  the norm's reduction a kernel of its own. Ours: one kernel, 32 threads a row, 16 a row's output with two rows a
  thread (32 at batch 1, where it spreads to one row a thread). If tinygrad starts grouping the half matvec itself, the first assert fails: this module may then go."""
  from tinyvllm.kernels import portable
  x = Tensor.randn(T, 2048, dtype=dtypes.half).realize()
  w, g = Tensor.randn(3072, 2048, dtype=dtypes.half).realize(), Tensor.randn(2048, dtype=dtypes.half).realize()
  threads = lambda gs, ls: int(np.prod(gs) * np.prod(ls))
  theirs = _lowered_for_h100(lambda: portable.linear(portable.rms_norm(x, g, EPS), w))
  assert len(theirs) == 2 and threads(*theirs[1][1:]) < 3072 * T, theirs
  ours = _lowered_for_h100(lambda: gemv.gemv(x, LinearWeights(FLOAT, w), norm=(g, EPS)))
  (name, gs, ls), = ours
  assert name == f"gemv_norm_{T}_3072_2048" and threads(gs, ls) == 3072 * (32 if T == 1 else 16) and np.prod(ls) == 128, ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,K", [(1, 2048), (3, 576), (2, 40)])
def test_inverse_rms_matches_numpy(device, T, K):
  """A quantized GEMV's 1/RMS of each row of x (float16, as a GPU's), in float32: within 1e-6 of float64 numpy."""
  from tinygrad.helpers import Context
  x = np.random.default_rng(T + K).standard_normal((T, K)).astype(np.float16)
  with Context(DEV=device): got = gemv.inverse_rms(Tensor(x), EPS).numpy()
  want = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
  assert got.shape == (T, 1) and np.abs(got - want).max() / np.abs(want).max() < 1e-6


def test_h100_launch_of_the_inverse_rms():
  """The 1B's 2048-wide row: one block of 256 threads (16 bytes each) where tinygrad's heuristic gave 16 threads."""
  from tinyvllm.kernels import portable
  x = Tensor.randn(1, 2048, dtype=dtypes.half).realize()
  (name, gs, ls), = _lowered_for_h100(lambda: gemv.inverse_rms(x, EPS))
  assert name == "inverse_rms_1_2048" and int(np.prod(gs) * np.prod(ls)) == 256
  (name, gs, ls), = _lowered_for_h100(lambda: portable.inverse_rms(x, EPS).contiguous())
  assert int(np.prod(gs) * np.prod(ls)) < 256, "tinygrad now groups this reduction itself: the kernel may go"


def test_h100_launch_of_32_rows():
  """A 32-sequence decode step's narrow projections (the 1B's o and down, float16, `max_rows`) compile for sm_90 as one
  kernel each: 8 x rows a thread, 4 blocks of rows, 16 threads a weight row's output (32 threads, 2 rows a thread)."""
  threads = lambda gs, ls: int(np.prod(gs) * np.prod(ls))
  for N, K in ((2048, 2048), (2048, 8192)):
    x, r = Tensor.randn(32, K, dtype=dtypes.half).realize(), Tensor.randn(32, N, dtype=dtypes.half).realize()
    w = LinearWeights(FLOAT, Tensor.empty(N, K, dtype=dtypes.half))
    assert gemv.max_rows(w, 32) == 32
    (name, gs, ls), = _lowered_for_h100(lambda: gemv.gemv(x, w, residual=r))
    assert name == f"gemv_res_32_{N}_{K}" and threads(gs, ls) == 4 * N * 16 and np.prod(ls) == 128


def test_h100_launch_of_8b_shapes():
  """Llama-3.1-8B's projections at batch 1 (gate/up gated, down with the residual; 14336 = 56 x 256) compile with the
  full schedule."""
  x, xi = Tensor.randn(1, 4096, dtype=dtypes.half).realize(), Tensor.randn(1, 14336, dtype=dtypes.half).realize()
  gu, down = Tensor.empty(2 * 14336, 4096, dtype=dtypes.half), Tensor.empty(4096, 14336, dtype=dtypes.half)
  g = Tensor.randn(4096, dtype=dtypes.half).realize()
  (name, gs, ls), = _lowered_for_h100(lambda: gemv.gemv(x, LinearWeights(FLOAT, gu), norm=(g, EPS), act="silu"))
  assert name == "gemv_norm_glu_1_14336_4096" and gs[0] * 8 == 14336 and np.prod(ls) == 128
  (name, gs, ls), = _lowered_for_h100(lambda: gemv.gemv(xi, LinearWeights(FLOAT, down), residual=x))
  assert name == "gemv_res_1_4096_14336" and gs[0] * 8 == 4096 and np.prod(ls) == 128


def test_h100_launch_of_int4_weights():
  """An INT4 qkv projection of the 1B model (groups of 64), normed: tinygrad's matmul over the unpacked codes gives
  fewer threads than outputs; ours: 32 threads a row on consecutive words (8 codes each), 4 words in flight a thread,
  x's squares summed in the same kernel (`gemv._squares_read`), no kernel of x's 1/RMS before it."""
  from tinyvllm.kernels import portable
  rng = np.random.default_rng(3)
  lw, _ = quantized(rng, INT4, 3072, 2048, "CPU", 64)
  x, g = Tensor.randn(1, 2048, dtype=dtypes.half).realize(), Tensor.randn(2048, dtype=dtypes.half).realize()
  threads = lambda gs, ls: int(np.prod(gs) * np.prod(ls))
  theirs = _lowered_for_h100(lambda: portable.int4_linear(portable.rms_norm(x, g, EPS), lw.weight, lw.scales, lw.biases, 64))
  assert threads(*theirs[-1][1:]) < 3072, theirs
  ours = _lowered_for_h100(lambda: gemv.gemv(x, lw, norm=(g, EPS)), INT4, 64)
  assert len(ours) == 1 and ours[0][0] == "gemv_int4_norm_1_3072_2048", ours
  assert threads(*ours[0][1:]) == 3072 * 16 and np.prod(ours[0][2]) == 128, ours


def _loop_counts(source: str) -> list[int]:
  """The trip counts of a lowered CUDA kernel's outermost loops before its first barrier (its reductions' loops over
  the input, before the threads' partial sums meet)."""
  import re
  return [int(n) for n in re.findall(r"\n  for \(int \w+ = 0; \w+ < (\d+);", source.split("__syncthreads")[0])]


# the 4-bit groups, INT8, and one of each way of reading a packed layout's codes and scales (as ON_METAL); 8 rows for two
NORMED_LAYOUTS = [(INT4, 32, 1), (INT4, 64, 8), (INT4, 128, 1), (INT8, 32, 1), ("Q4_K", 0, 8), ("Q5_1", 0, 1), ("IQ4_NL", 0, 1),
                  ("affine8g32", 0, 1), ("Q6_K", 0, 1)]


@pytest.mark.parametrize("fmt,group,T", NORMED_LAYOUTS, ids=[f"{f}-{g}-T{T}" if g else f"{f}-T{T}" for f, g, T in NORMED_LAYOUTS])
def test_h100_quantized_norm_shares_the_dots_loop(fmt, group, T):
  """A normed quantized GEMV lowered for the H100 (gate/up of K = 4096, gated) sums x's squares in its own kernel, in
  a loop as long as the dot's: the squares read at the weight's ranges, rotated (`gemv._squares_read`). Read at k,
  tinygrad merged the ranges and the squares were a loop over the whole row by one thread a row, or a kernel before
  (`inverse_rms`: 33 launches of an INT4 decode step of the 1B model). A 6-bit layout (Q6_K) keeps that kernel
  (`gemv.norms_inside`)."""
  from tinygrad.uop.ops import Ops
  rng = np.random.default_rng(9)
  K, N = 4096, 256
  lw, _ = quantized(rng, fmt, N, K, "CPU", group) if fmt in (INT4, INT8) else packed(rng, fmt, N, K, "CPU")
  x, g = Tensor.randn(T, K, dtype=dtypes.half).realize(), Tensor.randn(K, dtype=dtypes.half).realize()
  programs = _programs_for_h100(lambda: gemv.gemv(x, lw, norm=(g, EPS), act="silu"), gemv.layout_of(lw), group)
  names = [p.arg.name for p in programs]
  inside = fmt != "Q6_K"
  assert gemv.norms_inside(gemv.layout_of(lw)) == inside
  assert len(programs) == (1 if inside else 2) and names[-1].startswith("gemv_"), names
  loops = _loop_counts(next(u.arg for u in programs[-1].src if u.op is Ops.SOURCE))
  assert loops and len(set(loops)) == 1 and (len(loops) == 2) == inside, (names, loops)


@pytest.mark.parametrize("fmt", ["Q6_K", "affine6g64"])
def test_6_bit_layouts_still_need_their_norms_kernel(fmt, monkeypatch):
  """tinygrad 0.14 cannot order the loops of a 6-bit layout's GEMV with x's squares inside (an AssertionError in its
  linearizer, "this can happen! it causes infinite loop", or a KeyError after it), so those keep `inverse_rms`
  (`gemv.norms_inside`). If this starts passing after a tinygrad upgrade, drop the exception."""
  rng = np.random.default_rng(10)
  lw, _ = packed(rng, fmt, 256, 4096, "CPU")
  x, g = Tensor.randn(1, 4096, dtype=dtypes.half).realize(), Tensor.randn(4096, dtype=dtypes.half).realize()
  monkeypatch.setattr(gemv, "norms_inside", lambda layout: True)
  with pytest.raises((AssertionError, KeyError)):
    _programs_for_h100(lambda: gemv.gemv(x, lw, norm=(g, EPS), act="silu"), gemv.layout_of(lw))


@pytest.mark.parametrize("fmt,group", [(FLOAT, 0), (INT4, 32), (INT4, 64), (INT4, 128), (INT8, 32), ("Q4_K", 0), ("Q6_K", 0)])
@pytest.mark.parametrize("T", [1, 8])
def test_h100_loads_are_coalesced(fmt, group, T):
  """Every load and store of a warp, in the GEMV lowered for the H100 (1B shapes: the gated gate/up at K = 2048, the
  down projection with the residual at K = 8192), touches at most twice the 128-byte lines its bytes fill. A warp's
  access to lines more than that passes through the L1 once a line: a quantized row read 4 words (32 codes) a thread
  had each lane load 32 consecutive values of x and of the norm's weight, so a warp's load of them touched 32 lines
  where 2 would do (the INT4 LM head on an H200: 300 us against float16's 141, for a quarter of the bytes)."""
  from test_cuda_compile import loose_accesses
  from tinygrad.uop.ops import Ops
  rng = np.random.default_rng(6)
  checked = 0
  for N, K, call in ((512, 2048, "glu"), (256, 8192, "res")):
    if fmt == FLOAT: lw = LinearWeights(FLOAT, Tensor.empty(N, K, dtype=dtypes.half))
    else: lw, _ = quantized(rng, fmt, N, K, "CPU", group or 32)
    x = Tensor.randn(T, K, dtype=dtypes.half).realize()
    if call == "glu": fn = lambda: gemv.gemv(x, lw, norm=(Tensor.randn(K, dtype=dtypes.half).realize(), EPS), act="silu")
    else: fn = lambda: gemv.gemv(x, lw, residual=Tensor.randn(T, N, dtype=dtypes.half).realize())
    program = _programs_for_h100(fn, gemv.layout_of(lw), group)[-1]
    assert program.arg.name.startswith("gemv"), program.arg.name
    count, loose = loose_accesses(next(u.arg for u in program.src if u.op is Ops.SOURCE))
    assert not loose, (program.arg.name, loose)
    checked += count
  assert checked > 10


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_h100_launch_of_kquant_weights(qtype):
  """A Q4_K_M file's two k-quants as the 1B model's qkv projection (3072 x 2048), normed: 32 threads a row over the
  ranges of k's bits, on consecutive words of nibbles (8 codes each), 4 rows a block, x's squares summed inside (Q4_K)
  or in a kernel of x's 1/RMS before (Q6_K: `gemv.norms_inside`); tinygrad's matmul over the same codes unpacked in its
  expression gives fewer threads than outputs."""
  from tinyvllm.kernels import portable
  rng = np.random.default_rng(4)
  lw, _ = quantized(rng, qtype, 3072, 2048, "CPU")
  x, g = Tensor.randn(1, 2048, dtype=dtypes.half).realize(), Tensor.randn(2048, dtype=dtypes.half).realize()
  threads = lambda gs, ls: int(np.prod(gs) * np.prod(ls))
  theirs = _lowered_for_h100(lambda: portable.packed_linear(portable.rms_norm(x, g, EPS), lw))
  assert threads(*theirs[-1][1:]) < 3072, theirs
  ours = _lowered_for_h100(lambda: gemv.gemv(x, lw, norm=(g, EPS)), lw.spec)
  assert len(ours) == (2 if qtype == "Q6_K" else 1) and ours[-1][0] == "gemv_packed_norm_1_3072_2048", ours
  assert threads(*ours[-1][1:]) == 3072 * 16 and np.prod(ours[-1][2]) == 128, ours
