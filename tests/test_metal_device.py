"""The kernel cases of test_metal_kernels.py on tinygrad's METAL device, through the public functions.

On a Mac this is the real GPU: `DEV=METAL python -m pytest tests/test_metal_device.py -q`. Elsewhere (Linux CI) the
same tests run on tinygrad's METAL device through the MSL emulator (tinyvllm.kernels.emulator.metal_device): MetalBackend
builds the same PROGRAMs and libraries, tinygrad's runtime launches them. TINYVLLM_EMULATE_METAL=0 skips them instead.
Same tolerances as the emulator tests (see test_metal_kernels.py): they were chosen for Metal's arithmetic.
"""
import os, sys

import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes

from tinyvllm.kernels import metal as M

try:
  from test_metal_kernels import (DT_PAIRS, GQA, I8_PAIRS, INT4_SHAPES, attention_cases, decode_case, dt_id, int4_case,
                                  prefill_case, rope_case)
except ImportError:  # run as a package
  from tests.test_metal_kernels import (DT_PAIRS, GQA, I8_PAIRS, INT4_SHAPES, attention_cases, decode_case, dt_id, int4_case,
                                        prefill_case, rope_case)


def _metal_reason() -> str | None:
  if sys.platform != "darwin":
    if os.environ.get("TINYVLLM_EMULATE_METAL") == "0": return "no Metal here and TINYVLLM_EMULATE_METAL=0"
    from tinyvllm.kernels.emulator.metal_device import install
    install()   # before the first Device["METAL"]: nothing else in the suite opens it
  try:
    Device["METAL"]
    return None
  except Exception as e:  # a Mac without a usable GPU
    return f"Metal is not available here ({type(e).__name__}: {str(e)[:80]})"


REASON = _metal_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@attention_cases(DT_PAIRS)
def test_decode_metal(D, bs, heads, dts):
  decode_case("metal", D, bs, heads, dts)
  decode_case("metal", D, bs, heads, dts, partition_size=2 * bs, seed=1)


@attention_cases(DT_PAIRS)
def test_prefill_metal(D, bs, heads, dts):
  prefill_case("metal", D, bs, heads, dts)


@pytest.mark.parametrize("dts", DT_PAIRS, ids=lambda d: f"{d[0].name}-{d[1].name}")
@pytest.mark.parametrize("D", M.HEAD_DIMS)
def test_rope_metal(D, dts):
  rope_case("metal", D, (6, 2), dts)


@pytest.mark.parametrize("xdt", [dtypes.float32, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("g", M.GROUP_SIZES)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int4_matmul_metal(shape, g, xdt):
  m, n, k = shape
  if k % g: pytest.skip("K must be a multiple of the group size")
  int4_case("metal", m, n, k, g, xdt)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_packed_linear_metal(qtype):
  """A GGUF k-quant linear through the portable expression tinygrad compiles for the GPU (packed weights have no
  shader of ours): Q4_K's and Q5_K's 6-bit scales and mins unpacked inside the matmul, against float64 numpy on the
  exactly dequantized weights (quant/blocks.py; equal to gguf's dequantizer bit for bit, tests/test_blocks.py).
  Tolerance 1e-5: float32 sums of 512 products (~1e-7 each) in another order than numpy's; a wrong scale bit moves
  whole percents."""
  from test_blocks import random_ggml
  from tinyvllm.kernels import portable
  from tinyvllm.quant import blocks
  from tinyvllm.quant.formats import PACKED, LinearWeights
  rng = np.random.default_rng(9)
  parts, spec = blocks.from_ggml(random_ggml(qtype, 40, 768, rng), qtype, (40, 768))
  x = rng.standard_normal((3, 768)).astype(np.float32)
  lw = LinearWeights(PACKED, **{k: Tensor(v, device="METAL") for k, v in parts.items() if k != "qspec"}, spec=spec)
  y = portable.packed_linear(Tensor(x, device="METAL"), lw).numpy()
  ref = x.astype(np.float64) @ blocks.dequantize(parts, spec).T.astype(np.float64)
  assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


def test_long_context_metal():
  decode_case("metal", 128, 16, (8, 2), (dtypes.float16, dtypes.float16), lens=(1500, 3, 700, 1024), seed=2)


@pytest.mark.parametrize("dts", I8_PAIRS, ids=lambda d: f"{dt_id(d[0])}-{dt_id(d[1])}")
def test_int8_cache_metal(dts):
  """An int8 KV cache (codes + float16 scales in a PagedKVCache): the cache write, one-pass and partitioned decode and
  prefill, every head_dim, block sizes and GQA ratios in turn (the full matrix runs in test_metal_kernels.py)."""
  for i, D in enumerate(M.HEAD_DIMS):
    bs = M.BLOCK_SIZES[i % len(M.BLOCK_SIZES)]
    rope_case("metal", D, (6, 2), dts, seed=i)
    decode_case("metal", D, bs, GQA[i], dts, seed=i)
    decode_case("metal", D, bs, GQA[(i + 1) % len(GQA)], dts, partition_size=2 * bs, seed=i)
    prefill_case("metal", D, bs, GQA[(i + 2) % len(GQA)], dts, seed=i)


# **** tinygrad's own kernels on the METAL device (what the model's norms, float linears and sampling inputs use) ****

EMULATED = REASON is None and hasattr(Device["METAL"], "counters")


def bf16_round(x: np.ndarray) -> np.ndarray:
  """float32 -> nearest bfloat16 (ties to even), returned as float32."""
  u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
  return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=lambda d: d.name)
def test_tensor_core_matmul(dtype):
  # 64x64 @ 64x64: tinygrad's MetalRenderer (Apple7+) uses simdgroup_matrix tensor cores built with thread_elements()
  rng = np.random.default_rng(21)
  x, y = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
  out = (Tensor(x, device="METAL").cast(dtype) @ Tensor(y, device="METAL").cast(dtype)).cast(dtypes.float32).numpy()
  xr, yr = (x.astype(np.float16), y.astype(np.float16)) if dtype == dtypes.float16 else (bf16_round(x), bf16_round(y))
  ref = xr.astype(np.float64) @ yr.astype(np.float64)
  # float accumulation; the output is rounded to the input dtype: 2^-11 (half) or 2^-8 (bfloat) relative at worst
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert err < (1e-3 if dtype == dtypes.float16 else 8e-3), err
  if EMULATED: assert any("simdgroup_multiply_accumulate" in s for s in Device["METAL"].sources.values())


def test_bfloat_elementwise():
  rng = np.random.default_rng(22)
  x, y = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
  a, b = (Tensor(v, device="METAL").cast(dtypes.bfloat16) for v in (x, y))
  out = (a * b + a).cast(dtypes.float32).numpy()
  bx, by = bf16_round(x), bf16_round(y)
  if EMULATED:   # the emulator computes a bfloat expression in float and rounds once, when it is stored
    np.testing.assert_array_equal(out, bf16_round(bx * by + bx))
  else:          # Metal may round after each operation
    ref = bf16_round(bf16_round(bx * by) + bx)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 8e-3
