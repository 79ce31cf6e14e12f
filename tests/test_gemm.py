"""kernels/gemm.py, a decode batch's projections on the tensor cores, against float64 numpy on tinygrad's METAL device
through our emulator (tinygrad's simdgroup_matrix tensor cores, 8 x 8 x 8) and the GPU named by TINYVLLM_TEST_DEVICE;
lowered for an H100 without one (nvrtc: mma.sync, 16 x 8 x 16), where its grid and loads are checked against the
tinygrad matmul it replaces.

Tolerances, relative (‖out−ref‖/‖ref‖) against float64 sums of the same rounded inputs: float32 output 1e-5 (the
products are exact, the sums float32); float16 output 2e-3 (rounded once, up to 2^-11 an element)."""
from __future__ import annotations
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinyvllm.kernels import gemm
from tinyvllm.quant.formats import FLOAT, INT4, LinearWeights
from test_replay import DEVICES

GPUS = [d for d in DEVICES if d != "CPU"]


def _random(rng, T, N, K, device, bias):
  x, w, b = rng.standard_normal((T, K)), rng.standard_normal((N, K)) / np.sqrt(K), rng.standard_normal(N)
  x, w, b = (a.astype(np.float16) for a in (x, w, b))
  weights = LinearWeights(FLOAT, Tensor(w, device=device).realize(), bias=Tensor(b, device=device).realize() if bias else None)
  ref = x.astype(np.float64) @ w.astype(np.float64).T + (b.astype(np.float64) if bias else 0)
  return Tensor(x, device=device).realize(), weights, ref


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("T, N, K, bias", [(16, 64, 512, False), (32, 96, 256, True), (64, 128, 1024, False), (128, 64, 256, True),
                                           (40, 72, 320, False), (48, 40, 192, True)])
def test_matches_numpy(device, T, N, K, bias):
  """Shapes whose grid splits the input (S > 1) and not, x's tiles all a warp's and not (128 rows), an odd number of
  them (40 rows on Apple's tiles of 8, 48 on NVIDIA's of 16: tinygrad's lowering failed with them on a grid axis),
  with a bias."""
  rng = np.random.default_rng(T + N + K)
  x, w, ref = _random(rng, T, N, K, device, bias)
  if T % gemm.tensor_core(device, dtypes.float16)[1].dims[1]: pytest.skip(f"{T} rows are not whole tiles on {device}")
  assert gemm.applies(x, w)
  for dtype, tol in ((dtypes.float32, 1e-5), (None, 2e-3)):
    out = gemm.matmul(x, w, dtype=dtype).numpy().astype(np.float64)
    assert out.dtype == np.float64 and np.linalg.norm(out - ref) / np.linalg.norm(ref) < tol


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("act", [None, "silu", "gelu_pytorch_tanh"])
def test_normed_and_gated(device, act):
  """RMSNorm(x) * g first (x's 1/RMS a kernel, the rest as x is read, rounded to float16 as HF rounds the normed row),
  and act(gate) * up of gate and up stacked: against float64 numpy of the unrounded normed row, 2e-3 (the normed row's
  and the output's float16 roundings)."""
  rng = np.random.default_rng(7)
  T, N, K, eps = 32, 128, 512, 1e-5
  x, w, _ = _random(rng, T, N, K, device, bias=True)
  g = (1 + 0.3 * rng.standard_normal(K)).astype(np.float16)
  xn = x.numpy().astype(np.float64)
  normed = xn / np.sqrt((xn ** 2).mean(1, keepdims=True) + eps) * g.astype(np.float64)
  y = normed @ w.weight.numpy().astype(np.float64).T + w.bias.numpy().astype(np.float64)
  if act is not None:
    gate, up = y[:, :N // 2], y[:, N // 2:]
    y = (gate / (1 + np.exp(-gate)) if act == "silu" else 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))) * up
  out = gemm.matmul(x, w, norm=(Tensor(g, device=device), eps), act=act).numpy().astype(np.float64)
  assert out.shape == y.shape and np.linalg.norm(out - y) / np.linalg.norm(y) < 2e-3


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("bias", [False, True])
def test_cache_write_adds_the_partial_sums(device, bias):
  """The qkv projection's partial sums (the input split in runs: S > 1) straight into kernels/paged.py's write, which
  adds them (and the bias), rounds the row to float16 as the projection would, rotates q and k and writes k and v into
  their slots: against float64 numpy of the normed projection, RoPE and the slots' rows, 2e-3 (the normed row's and
  the projection's float16 roundings). A padding token (slot -1) writes nothing; every other slot keeps its row."""
  from tinygrad.helpers import Context
  from test_metal_kernels import rope_ref, rope_table
  from tinyvllm.kernels import paged
  from tinyvllm.kernels.kv_cache import PagedKVCache
  rng = np.random.default_rng(11 + bias)
  T, H, KVH, D, K, eps, NB, BS = 32, 4, 2, 64, 2048, 1e-5, 8, 16
  with Context(DEV=device):
    x, w, _ = _random(rng, T, (H + 2 * KVH) * D, K, device, bias)
    tc = gemm.tensor_core(device, dtypes.float16)[1]
    assert gemm.splits(T, (H + 2 * KVH) * D, K, tc) > 1
    g = (1 + 0.3 * rng.standard_normal(K)).astype(np.float16)
    positions, table = rng.integers(0, 100, T).astype(np.int32), rope_table(128, D)
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[5] = -1
    before = [rng.standard_normal((NB, BS, KVH, D)).astype(np.float16) for _ in range(2)]
    cache = PagedKVCache(*(Tensor(a.copy(), device=device).realize() for a in before))
    partial = gemm.partial_products(x, w, norm=(Tensor(g, device=device), eps))
    q, cache = paged.write(partial, H, KVH, Tensor(positions, device=device), Tensor(table, device=device), cache,
                           Tensor(slots, device=device), w.bias, dtypes.float16)
    q, k, v = q.numpy().astype(np.float64), cache.k.numpy(), cache.v.numpy()
  xn = x.numpy().astype(np.float64)
  normed = xn / np.sqrt((xn ** 2).mean(1, keepdims=True) + eps) * g.astype(np.float64)
  qkv = normed @ w.weight.numpy().astype(np.float64).T + (w.bias.numpy().astype(np.float64) if bias else 0)
  heads = rope_ref(qkv.reshape(T, H + 2 * KVH, D), positions, table)
  rel = lambda out, ref: np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert q.shape == (T, H, D) and rel(q, heads[:, :H]) < 2e-3
  written = slots >= 0
  for got, old, ref in ((k, before[0], heads[:, H:H + KVH]), (v, before[1], qkv.reshape(T, H + 2 * KVH, D)[:, H + KVH:])):
    got, old = got.reshape(NB * BS, KVH, D).astype(np.float64), old.reshape(NB * BS, KVH, D)
    assert rel(got[slots[written]], ref[written]) < 2e-3
    untouched = np.setdiff1d(np.arange(NB * BS), slots[written])
    assert (got[untouched] == old[untouched]).all()


@pytest.mark.parametrize("device", [d for d in GPUS if d == "METAL"])
def test_metal_runs_it_on_simdgroup_matrices(device):
  """The kernel tinygrad lowers for Metal multiplies on simdgroup_matrix (the tensor-core opt applied, not dropped)."""
  from tinygrad import Device
  rng = np.random.default_rng(3)
  x, w, _ = _random(rng, 32, 64, 256, device, False)
  Device[device].sources.clear() if hasattr(Device[device], "sources") else None
  gemm.matmul(x, w).realize()
  sources = [s for s in getattr(Device[device], "sources", {}).values() if "gemm_tc" in s]
  if not sources: pytest.skip("the device keeps no sources (a real Mac)")
  assert all("simdgroup_multiply_accumulate" in s for s in sources)


def test_apple_gpus_split_the_input_less():
  """The grid's input split on Metal aims at gemm.SIMDGROUPS_WANTED SIMD groups, not an H100's 1536 warps: fewer runs,
  and fewer partial sums to write and read back (the 1B's down at 32 rows: 8 runs, 2 MB, where the H100's count gives
  32 runs, 8 MB); the CUDA splits are unchanged (the 1B at 32 rows on sm_90's tensor cores: 8, 8, 4, 32, 1)."""
  if "METAL" not in DEVICES: pytest.skip("needs a device with tensor cores: emulated METAL")
  _, apple = gemm.tensor_core("METAL", dtypes.float16)
  shapes = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]
  assert gemm.warps_wanted("METAL") == gemm.SIMDGROUPS_WANTED
  assert [gemm.splits(32, N, K, apple, gemm.warps_wanted("METAL")) for N, K in shapes] == [4, 8, 1, 8, 1]
  from test_cuda_compile import NVRTC, h100_renderer, on_null_cuda
  if NVRTC is None: pytest.skip("nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
  with on_null_cuda():   # the renderer loads nvrtc
    sm90 = next(tc for tc in h100_renderer().tensor_cores if tc.dtype_in == dtypes.float16 and tc.dtype_out == dtypes.float32)
  assert [gemm.splits(32, N, K, sm90) for N, K in shapes] == [8, 8, 4, 32, 1]
  with on_null_cuda(): assert gemm.warps_wanted("NULL") == gemm.WARPS_WANTED   # lowered for an H100
  # the kernel the engine builds takes Metal's split: its name carries S (gemm_tc_<S>_<T>_<N>_<K>)
  from tinygrad import Tensor
  x, w = Tensor.empty(32, 8192, dtype=dtypes.float16, device="METAL"), Tensor.empty(2048, 8192, dtype=dtypes.float16, device="METAL")
  partial = gemm.partial_products(x, LinearWeights(FLOAT, w))
  assert partial.shape == (8, 32, 2048)


def test_which_projections_take_it():
  """Float16 or bfloat16 weights of x's dtype, 9 to 256 rows in whole tiles, outputs and input in whole tiles; not
  INT4 (the GEMV), float32 (TF32 on NVIDIA), the CPU device, a batch the GEMV takes, or with tinygrad's tensor cores
  off (USE_TC=0: a Mac whose MSL has no simdgroup_matrix, kernels.prepare_device)."""
  from tinygrad.helpers import Context
  from tinygrad import Device
  if "METAL" not in DEVICES: pytest.skip("needs a device with tensor cores: emulated METAL")
  rows = lambda T, dtype=dtypes.float16, K=256: Tensor.empty(T, K, dtype=dtype, device="METAL")
  w = LinearWeights(FLOAT, Tensor.empty(64, 256, dtype=dtypes.float16, device="METAL"))
  assert gemm.applies(rows(16), w) and gemm.applies(rows(256), w) and not gemm.applies(rows(8), w) and not gemm.applies(rows(264), w)
  assert not gemm.applies(rows(12), w)   # not whole tiles of 8 rows
  assert gemm.applies(rows(40), w) and not gemm.applies(rows(72), w)   # 5 tiles, all a warp's; 9, past 8
  with Context(TC=0): assert not gemm.applies(rows(16), w)
  assert not gemm.applies(rows(16, dtypes.float32), LinearWeights(FLOAT, Tensor.empty(64, 256, device="METAL")))
  assert not gemm.applies(rows(16, dtypes.bfloat16), w)   # weight and x of different dtypes
  assert not gemm.applies(rows(16, K=264), LinearWeights(FLOAT, Tensor.empty(64, 264, dtype=dtypes.float16, device="METAL")))
  int4 = LinearWeights(INT4, Tensor.empty(64, 32, dtype=dtypes.uint32, device="METAL"), Tensor.empty(64, 4, device="METAL"))
  assert not gemm.applies(rows(16), int4)
  assert not gemm.applies(Tensor.empty(16, 256, dtype=dtypes.float16), LinearWeights(FLOAT, Tensor.empty(64, 256, dtype=dtypes.float16)))


def _lowered_for_h100(T, N, K):
  """The CUDA sources of tinygrad's matmul and of ours for x `[T, K]` @ W^T, W `[N, K]` float16, lowered for sm_90."""
  import os
  from test_cuda_compile import NVRTC, h100_renderer, on_null_cuda, recording_kernels
  if NVRTC is None: pytest.skip("nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
  from tinygrad.codegen import to_program
  from tinygrad.uop.ops import Ops
  sources = {}
  with on_null_cuda():
    for name, fn in (("tinygrad", lambda x, w: x @ w.T), ("ours", lambda x, w: gemm.matmul(x, LinearWeights(FLOAT, w), dtype=dtypes.float32))):
      x, w = Tensor.empty(T, K, dtype=dtypes.half), Tensor.empty(N, K, dtype=dtypes.half)
      with recording_kernels() as asts: fn(x, w).realize()
      programs = [to_program(a, h100_renderer()) for a in asts]
      sources[name] = [src for p in programs if "mma.sync" in (src := next(s.arg for s in p.src if s.op is Ops.SOURCE))]
  return sources


def _warps(src: str) -> int:
  import re
  sizes = [int(n) for n in re.findall(r"int [gl]idx\d+ = (?:blockIdx|threadIdx)\.\w; /\* (\d+) \*/", src)]
  return int(np.prod(sizes)) // 32


@pytest.mark.parametrize("N, K", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)])
def test_h100_grid_streams_the_weight(N, K):
  """The 1B's projections at a 32-sequence decode step (qkv, o, gate/up, down, the LM head): tinygrad's matmul (tensor
  cores, 4 output tiles a warp over the whole input, 1 KB of the weight a loop iteration) gives qkv, o and down 96,
  64 and 64 warps, under one an SM of an H100, and gate/up 512; ours splits the input while the grid holds 1536 warps
  or a run is 256 long (the LM head's 2004 unsplit): 4 times theirs or more, up to 1024 and beyond, each warp on
  mma.sync with 4 KB of the weight a loop iteration. A lane reads its inputs two consecutive at a time (half4 where
  tinygrad's layout gives half2), at most 8 lines a warp's load (`warp_accesses`): twice the bytes a pass of the L1."""
  from test_cuda_compile import warp_accesses, cache_lines
  sources = _lowered_for_h100(32, N, K)
  (ours,), (theirs,) = sources["ours"], sources["tinygrad"]   # one kernel each on the tensor cores
  assert "gemm_tc" in ours and "mma.sync.aligned.m16n8k16" in ours
  assert _warps(ours) >= min(4 * _warps(theirs), 1024)
  loads = lambda src: [(b, width, cache_lines(width, offsets)[0]) for b, kind, width, offsets in warp_accesses(src)
                       if kind == "load" and b in ("data1", "data2")]
  assert all(lines <= 8 and width == 8 for _, width, lines in loads(ours)), loads(ours)
  assert all(width == 4 for _, width, _ in loads(theirs))
  assert sum(width * 32 for b, width, _ in loads(ours) if b == "data2") >= 4096
