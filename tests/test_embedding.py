"""The embedding lookup (`portable.rows`, what `Llama.embed` runs for a float table on one device): the table's rows of
the step's tokens, bit for bit as numpy indexes them, Gemma's sqrt(hidden) applied in the table's dtype as HF does, in
one kernel where tinygrad's own gather took two on a GPU for a decode step's few tokens (lowered for the H100)."""
from __future__ import annotations
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context
from tinyvllm.kernels import portable
from test_replay import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,factor", [(np.float16, None), (np.float32, None), (np.float16, 2048 ** 0.5)])
def test_rows_are_numpys(device, dtype, factor):
  """Random tables and ids (repeats, the first and last row), captured and replayed as a pass runs it; the factor
  rounded to the dtype first and the product rounded once (numpy's float16 product: float32, then rounded). An id
  outside the table reads a row of zeros, as tinygrad's gather does (the input processor refuses such prompts)."""
  rng = np.random.default_rng(7)
  V, N = 1000, 96
  table = (rng.standard_normal((V, N)) * 3).astype(dtype)
  with Context(DEV=device):
    weights = Tensor(table).realize()
    step = TinyJit(lambda ids: portable.rows(weights, ids, factor).realize())
    for T in (5, 5, 5):   # captured on the second call, replayed on the third
      ids = rng.integers(0, V, T).astype(np.int32)
      ids[:2] = 0, V - 1
      got = step(Tensor(ids).realize()).numpy()
      want = table[ids] if factor is None else table[ids] * dtype(factor)
      assert got.dtype == dtype and np.array_equal(got, want)
    out = portable.rows(weights, Tensor(np.array([3, V, -1], np.int32)), factor).numpy()
  assert np.array_equal(out[1:], np.zeros((2, N), dtype)) and np.array_equal(out[0], table[3] if factor is None else table[3] * dtype(factor))


@pytest.mark.parametrize("T", [1, 32])
def test_decode_embedding_is_one_kernel_on_the_h100(T):
  """Llama 3's 128,256 x 2048 float16 table, a decode step's 1 and 32 tokens, lowered for the H100: one kernel, a
  masked read per element with no modulo (tinygrad's gather was two kernels and a buffer of partial rows at these
  counts, and an id read as int32 into the table's 2-D view took modulos)."""
  from test_cuda_compile import NVRTC, captured_programs_of, on_null_cuda, plain_name
  if NVRTC is None: pytest.skip("nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
  from types import SimpleNamespace
  from tinygrad.uop.ops import Ops
  with on_null_cuda():
    table = Tensor.empty(128256, 2048, dtype=dtypes.float16).realize()
    step = TinyJit(lambda ids: portable.rows(table, ids).realize())
    for _ in range(2): step(Tensor.empty(T, dtype=dtypes.int32).realize())
    gather = TinyJit(lambda ids: table[ids].realize())   # tinygrad's: the reason for ours (one kernel would make it moot)
    for _ in range(2): gather(Tensor.empty(T, dtype=dtypes.int32).realize())
  assert len(captured_programs_of(SimpleNamespace(jit=gather))) == 2
  programs = captured_programs_of(SimpleNamespace(jit=step))
  assert [plain_name(p) for p in programs] == [f"embed_rows_{T}_2048"]
  source = next(u.arg for u in programs[0].src if u.op is Ops.SOURCE)
  assert "%" not in source and "long" not in source, source


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group,factor,N", [(32, None, 256), (64, 2048 ** 0.5, 576), (128, None, 256)])
def test_int4_rows_are_the_dequantized_tables(device, group, factor, N):
  """`portable.int4_table_rows`, an INT4 table's rows (what `Llama.embed` runs for `quantization="int4"` and MLX 4-bit
  tables): code x scale + bias from the stored codes in float64, rounded to float16 (exact: the product and sum of
  float16 scales and 4-bit codes are exact in float32 at these magnitudes, then rounded once), Gemma's factor in
  float16 after it; an id outside the table a row of zeros. Captured and replayed as a pass runs it. 576 in groups of
  64 is SmolLM2's table (9 groups, no count of which makes a block)."""
  from test_gemv import quantized
  from tinyvllm.quant.formats import INT4
  rng = np.random.default_rng(group)
  V = 300
  with Context(DEV=device):
    lw, W = quantized(rng, INT4, V, N, device, group)
    step = TinyJit(lambda ids: portable.int4_table_rows(lw.weight, lw.scales, lw.biases, ids, dtypes.float16, factor).realize())
    for T in (6, 6, 6):
      ids = rng.integers(0, V, T).astype(np.int32)
      ids[:2] = 0, V - 1
      got = step(Tensor(ids).realize()).numpy()
      want = W[ids].astype(np.float16)
      if factor is not None: want = want * np.float16(factor)
      assert got.dtype == np.float16 and np.array_equal(got, want)
    out = portable.int4_table_rows(lw.weight, lw.scales, lw.biases, Tensor(np.array([3, V, -1], np.int32)), dtypes.float16).numpy()
  assert np.array_equal(out[1:], np.zeros((2, N), np.float16)) and np.array_equal(out[0], W[3].astype(np.float16))


@pytest.mark.parametrize("T,N,threads", [(1, 2048, 128), (32, 2048, 128), (128, 576, 8)])
def test_int4_decode_embedding_is_one_kernel_on_the_h100(T, N, threads):
  """Llama 3's table in INT4 (groups of 64), lowered for the H100: one kernel of blocks of 128 threads, a word of 8
  codes a thread (tinygrad's gathers of words, scales and biases and the dequantization were three). SmolLM2's 576 is
  9 groups, of which no count divides: blocks of a group's 8 words (an opt of 1 failed in tinygrad: every request)."""
  from test_cuda_compile import NVRTC, h100_renderer, recording_kernels
  if NVRTC is None: pytest.skip("nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
  import dataclasses, os
  from tinygrad.codegen import to_program
  os.environ["NVRTC_PATH"] = NVRTC
  words, halves = Tensor.empty(49152, N // 8, dtype=dtypes.uint32, device="CPU"), Tensor.empty(49152, N // 64, dtype=dtypes.float16, device="CPU")
  with recording_kernels() as asts:
    portable.int4_table_rows(words, halves, halves, Tensor.empty(T, dtype=dtypes.int32, device="CPU"), dtypes.float16).realize()
  (ast,) = asts
  program = to_program(ast.replace(arg=dataclasses.replace(ast.arg, opts_to_apply=portable.int4_rows_opts("CUDA", T, N, 64))), h100_renderer())
  g, l = program.arg.launch_dims({})
  assert np.prod(l) == threads and np.prod(g) * np.prod(l) * 8 == T * N, (g, l)
