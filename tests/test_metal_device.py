"""The kernel cases of test_metal_kernels.py on a real Apple GPU (DEV=METAL), through the public functions.

Skipped where Metal is absent (Linux CI). On a Mac: `DEV=METAL python -m pytest tests/test_metal_device.py -q`.
Same tolerances as the emulator tests (see test_metal_kernels.py): they were chosen for Metal's arithmetic.
"""
import pytest
from tinygrad import Device, dtypes

from tinyvllm.kernels import metal as M

try:
  from test_metal_kernels import DT_PAIRS, INT4_SHAPES, attention_cases, decode_case, int4_case, prefill_case, rope_case
except ImportError:  # run as a package
  from tests.test_metal_kernels import DT_PAIRS, INT4_SHAPES, attention_cases, decode_case, int4_case, prefill_case, rope_case


def _metal_reason() -> str | None:
  try:
    Device["METAL"]
    return None
  except Exception as e:  # no Metal framework / no GPU
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
