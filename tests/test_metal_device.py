"""The kernel cases of test_metal_kernels.py on tinygrad's METAL device, through the public functions.

On a Mac this is the real GPU: `DEV=METAL python -m pytest tests/test_metal_device.py -q`. Elsewhere (Linux CI) the
same tests run on tinygrad's METAL device through the MSL emulator (tinyvllm.kernels.emulator.metal_device): MetalBackend
builds the same PROGRAMs and libraries, tinygrad's runtime launches them. TINYVLLM_EMULATE_METAL=0 skips them instead.
Same tolerances as the emulator tests (see test_metal_kernels.py): they were chosen for Metal's arithmetic.
"""
import os, sys
import pytest
from tinygrad import Device, dtypes

from tinyvllm.kernels import metal as M

try:
  from test_metal_kernels import DT_PAIRS, INT4_SHAPES, attention_cases, decode_case, int4_case, prefill_case, rope_case
except ImportError:  # run as a package
  from tests.test_metal_kernels import DT_PAIRS, INT4_SHAPES, attention_cases, decode_case, int4_case, prefill_case, rope_case


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


def test_long_context_metal():
  decode_case("metal", 128, 16, (8, 2), (dtypes.float16, dtypes.float16), lens=(1500, 3, 700, 1024), seed=2)
