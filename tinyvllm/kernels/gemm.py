"""Decode-batch projections on a GPU's tensor cores: x `[T, K]` of more rows than the GEMV takes (kernels/gemv.py) times
a float weight `[N, K]` of x's dtype, as one tinygrad custom kernel of our opts that sums runs of the input axis apart
(RMS-normed as it reads x, when asked), then a tensor op that adds those partial sums (with the bias, and what the
caller does after: the residual, the SwiGLU, tinygrad fuses into it).

Why not tinygrad's matmul: its heuristic takes the tensor cores but gives a batch-32 decode step's projections too few
warps to stream their weights. Lowered for the H100, the 1B's gate/up at 32 rows ran as 512 warps (4 a block, 32
outputs each) over the whole 2048-long input, 1 KB of the weight a warp's loop iteration: about 4 KB of loads in
flight an SM, where the H100's ~4 TB/s at ~1 us of latency needs some 30 KB. An H200 took 155 us for its 67 MB (430
GB/s). And the GEMV at 32 rows runs every multiply on the CUDA cores (the 1B's layer is 1.95 G multiply-adds at 32
rows; its LM head took 1.7 ms there, where tinygrad's took 337 us).

Here (`kernel_opts`), after tinygrad's tensor-core opt:
  UPCAST  up to ROW_TILES of x's tiles (16 rows each on NVIDIA, 8 on Apple; an odd count up to 8): a warp reads a
          weight tile once for all T rows (32 rows: both tiles)
  UPCAST  output tiles a warp (`tiles`: 8 at 32 rows on NVIDIA), LOCAL WARPS_A_BLOCK warps a block (x's tiles
          shared through the L1)
  UNROLL  PAIRED consecutive inputs a lane reads together (`_partial_products_kernel`): 4 KB of the weight in a
          warp's loop iteration at 8 tiles
and the input split in S runs (`splits`, a grid axis) while the grid holds at most `warps_wanted` warps (an H100's
1536; 256 SIMD groups on Metal): the 1B's o and down projections have 32 warps of outputs at 32 rows, for 132 SMs.
The runs' partial sums `[S, T, N]` (float32: 8 MB for the 1B's down at 32 rows on the H100, which the L2 holds) are
added by a tensor op after, which also adds the bias and takes what the caller does next (the residual, the SwiGLU,
the cast) into the same kernel. Where tinygrad's matmul had fused those already (o's and down's residual), that is a
launch more; qkv's sums the cache write adds (kernels/paged.py).

Carries over to Metal: tinygrad lowers the same opts to simdgroup_matrix (8 x 8 x 8); only the tile sizes differ, and
they come from the renderer's tensor cores. Where a device has none for x's dtype (the CPU, INT4 weights), this
does not apply."""
from __future__ import annotations
import functools, math
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.helpers import USE_TC
from tinygrad.uop.ops import AxisType, KernelInfo, Ops
from tinyvllm.kernels import gemv, portable
from tinyvllm.quant.formats import FLOAT, LinearWeights

MIN_ROWS, MAX_ROWS = gemv.MAX_ROWS + 1, 256   # x rows this kernel takes: beyond the GEMV's, up to a large decode batch
ROW_TILES = 4        # x's tiles a warp covers: 64 rows on NVIDIA, 32 on Apple (an odd count up to 8: `tiles`); more rows
                     # re-read the weight
ACCUMULATORS = 128   # float sums a thread holds: x's tiles x output tiles x a tile's sums a thread (CUDA 4, Apple 2) x PAIRED
PAIRED = 2           # consecutive inputs a lane reads together for each of its tensor-core elements (`_partial_products_kernel`)
MAX_TILES = 8        # output tiles a warp, at most
WARPS_A_BLOCK = 4
WARPS_WANTED = 1536  # warps the grid should hold, splitting the input to get them: 12 an SM of an H100's 132 fit (168
                     # registers a thread, 65536 an SM); more run as a second, partial wave
SIMDGROUPS_WANTED = 256   # Apple GPUs' share (unmeasured): 8 to 76 cores and 100-800 GB/s; at ~0.5 us of latency
                          # 800 GB/s wants some 400 KB in flight, 200 SIMD groups reading 2 KB of the weight a loop
                          # iteration (8 output tiles of 8 x 16 inputs); every split adds partial sums to write and
                          # read back (8 MB for the 1B's down at 32 rows split for the H100), so no more than that
MIN_RUN = 256        # the shortest run of the input a split leaves a warp (its partial sums cost 8 bytes a row and output)


def tensor_core(device: str, dtype) -> tuple[int, object] | None:
  """(index, TensorCore) of the device renderer's first tensor core that multiplies `dtype` (float16 or bfloat16) into
  float32, or None: also where the device does not open, and where tinygrad's tensor cores are off (USE_TC=0, as
  kernels.prepare_device sets on a Mac whose MSL has no simdgroup_matrix). Not float32: NVIDIA's would round x and W to
  TF32. Looked up each time (a trace's projections, ~14 us each): the renderer of a device name can change with
  tinygrad's DEV context (NULL's), so a cache by name went stale."""
  if not isinstance(device, str) or portable.on_cpu(device) or dtype not in (dtypes.float16, dtypes.bfloat16): return None
  if USE_TC.value != 1: return None
  try: cores = Device[device].renderer.tensor_cores
  except Exception: return None
  return next(((i, tc) for i, tc in enumerate(cores) if tc.dtype_in == dtype and tc.dtype_out == dtypes.float32), None)


def applies(x: Tensor, w: LinearWeights) -> bool:
  """x of MIN_ROWS..MAX_ROWS rows, a whole number of the tensor core's tiles (not an odd number above 8 of them:
  `tiles`), times a float weight of x's dtype whose outputs and input fill whole tiles, on a device with tensor cores
  for that dtype."""
  if x.ndim != 2 or w.format != FLOAT or w.weight.dtype != x.dtype or not MIN_ROWS <= x.shape[0] <= MAX_ROWS: return False
  if (found := tensor_core(x.device, x.dtype)) is None: return False
  (N, K), (n, m, k) = w.weight.shape, found[1].dims
  T = x.shape[0]
  return T % m == 0 and N % n == 0 and K % (k * PAIRED) == 0 and (tiles(T, N, found[1])[0] > 1 or T == m)


def tiles(T: int, N: int, tc) -> tuple[int, int]:
  """(x's tiles, output tiles) a warp takes, of T rows and N outputs. A thread's sums are x's tiles x output tiles x
  its elements of a tile x PAIRED (kept apart until the loop ends), at most ACCUMULATORS: 8 output tiles at 32 rows on
  NVIDIA (168 registers, none spilled: ptxas -v), 4 at 64. More output tiles a warp amortize x's loads, which every
  tile of the weight needs: lowered for the H100 (`warp_accesses`), the 1B's gate/up at 32 rows costs the L1 about 18
  us at 4 tiles, 14 at 8. An odd count of x's tiles (a 48-token chunk: 3) is all a warp's: left to a grid axis alone,
  tinygrad's tensor-core lowering fails (do_stack_wmma)."""
  tiles_of_x = T // tc.dims[1]
  rows = _most(tiles_of_x, ROW_TILES)
  if rows == 1 and tiles_of_x <= 2 * ROW_TILES: rows = tiles_of_x
  sums = ACCUMULATORS // (rows * tc.elements_per_thread[2] * PAIRED)
  return rows, _most(N // tc.dims[0], min(MAX_TILES, 1 << (sums.bit_length() - 1)))


def _most(size: int, want: int) -> int:
  """For `want` a power of two (every caller's), the largest power of two up to it that divides `size`."""
  return math.gcd(size, want)


def splits(T: int, N: int, K: int, tc, wanted: int = WARPS_WANTED) -> int:
  """Runs the input is split into: doubled while the grid still holds at most `wanted` warps (`warps_wanted`), a run
  stays at least MIN_RUN long and a whole number of loop iterations. The 1B at 32 rows on an H100: qkv 8 (a run of
  256), o 8, gate/up 4, down 32 (its partial sums 8 MB, which the L2 holds), the LM head 1 (its 2004 warps enough)."""
  (n, m, k), (rows, outputs) = tc.dims, tiles(T, N, tc)
  warps = (T // m // rows) * (N // n // outputs)
  S = 1
  while warps * 2 * S <= wanted and K % (2 * S * k * PAIRED) == 0 and K // (2 * S) >= MIN_RUN: S *= 2
  return S


def warps_wanted(device: str) -> int:
  """The warps (SIMD groups) a projection's grid should hold on `device`: an Apple GPU's where tinygrad renders Metal
  for it (also a NULL device lowering for Metal), else an H100's."""
  from tinygrad.renderer.cstyle import MetalRenderer
  return SIMDGROUPS_WANTED if isinstance(Device[device].renderer, MetalRenderer) else WARPS_WANTED


def kernel_opts(tc_index: int, tc, S: int, T: int, N: int, K: int) -> tuple:
  """The opts of the module's docstring for a kernel of ranges (split, row, output; input steps, pair), tensor core
  `tc_index` (on the inner reduction, over the steps). tinygrad drops an axis of size 1 and one an opt takes whole:
  after the tensor-core opt, the axes left are the split (when S > 1), x's tiles (when more than one), the output
  tiles, then the reductions': the steps left to loop over (when more than one) and the pair, unrolled."""
  (n, m, k), (rows, outputs) = tc.dims, tiles(T, N, tc)
  opts, axis = [Opt(OptOps.TC, 0, (tc_index, 0, 1))], int(S > 1)
  if rows > 1: opts.append(Opt(OptOps.UPCAST, axis, rows))
  if T // m // rows > 1: axis += 1   # x's tiles not all taken: their axis stays before the outputs'
  if outputs > 1: opts.append(Opt(OptOps.UPCAST, axis, outputs))
  if (warps := _most(N // n // outputs, WARPS_A_BLOCK)) > 1: opts.append(Opt(OptOps.LOCAL, axis, warps))
  opts.append(Opt(OptOps.UNROLL, int(K // S // PAIRED // k > 1), PAIRED))
  return tuple(opts)


def _partial_products_kernel(opts: tuple, normed: bool, out: UOp, x: UOp, w: UOp, *norm: UOp) -> UOp:
  """out[s, t, n] = sum over run s of the input of x[t, k] * w[n, k], float32: the product of two float16 (or
  bfloat16) values, summed as the tensor cores do (the reduction multiplies two values of x's dtype, as tinygrad's
  tensor-core opt requires). `normed`: x's row RMS-normed first, `norm` = (its weight `[K]`, x's 1/RMS `[T, 1]`),
  x[t, k] * 1/RMS[t] * weight[k] in float32, rounded once to x's dtype as it is loaded (HF's Llama rounds the normed
  row, then its product with the weight; Gemma's rounds once, as here): no kernel writes the normed rows.

  The input is two ranges, k = step * PAIRED + pair, summed one inside the other: the tensor-core opt takes the inner
  sum over the steps (a tile's 16 inputs are 16 steps: on NVIDIA a lane holds inputs 2c, 2c+1, 2c+8, 2c+9 of them) and
  the pair, unrolled, sits below them, so a lane's inputs come PAIRED consecutive at a time: half4 loads where the
  tensor cores' own layout gave half2 (8 lines a warp's load either way, twice the bytes). One sum over both ranges
  would not do: tinygrad merges two ranges an index reads linearly, and a sum's order is free to it."""
  S, T, N = out.shape
  K = x.shape[1]
  run = K // S
  s, t, n = UOp.range(S, 0), UOp.range(T, 1), UOp.range(N, 2)
  step, pair = UOp.range(run // PAIRED, 3, AxisType.REDUCE), UOp.range(PAIRED, 4, AxisType.REDUCE)
  at = s * run + step * PAIRED + pair
  xk = x.flatten()[t * K + at]
  if normed:
    weight, inverse_rms = (u.flatten() for u in norm)
    xk = (xk.cast(dtypes.float32) * inverse_rms[t] * weight[at].cast(dtypes.float32)).cast(xk.dtype)
  y = (xk * w.flatten()[n * K + at]).cast(dtypes.float32).reduce(step, arg=Ops.ADD).reduce(pair, arg=Ops.ADD)
  store = out.flatten()[(s * T + t) * N + n].store(y)
  name = "_".join(["gemm_tc", *(["norm"] if normed else []), str(S), str(T), str(N), str(K)])
  return UOp.sink(store.end(s, t, n), arg=KernelInfo(name=name, opts_to_apply=opts))


def partial_products(x: Tensor, w: LinearWeights, norm: tuple | None = None) -> Tensor:
  """The kernel's partial sums `[S, T, N]` (float32) of x `[T, K]` @ W^T (`applies`), without W's bias: S runs of the
  input (`splits`) the caller adds. norm=(w, eps): x RMS-normed (times w) first: x's 1/RMS a small kernel
  (gemv.inverse_rms), the rest as x is read."""
  (T, K), N = x.shape, w.weight.shape[0]
  index, tc = tensor_core(x.device, x.dtype)
  S = splits(T, N, K, tc, warps_wanted(x.device))
  partial = Tensor.empty(S, T, N, dtype=dtypes.float32, device=x.device)
  inputs = [x.contiguous(), w.weight] + ([norm[0], gemv.inverse_rms(x, norm[1])] if norm is not None else [])
  fxn = functools.partial(_partial_products_kernel, kernel_opts(index, tc, S, T, N, K), norm is not None)
  return Tensor.custom_kernel(partial, *inputs, fxn=fxn)[0]


def matmul(x: Tensor, w: LinearWeights, dtype=None, norm: tuple | None = None, act: str | None = None) -> Tensor:
  """x `[T, K]` @ W^T (+ W's bias) on the tensor cores (`applies`), summed in float32 and rounded once to `dtype`
  (default x's; the LM head's logits: float32).
    norm=(w, eps)  x RMS-normed (times w) first (`partial_products`)
    act            W is gate and up stacked (`[2 I, K]`): returns act(gate) * up `[T, I]`, each half's partial sums
                   added apart, so that the gating is the same kernel as the sums (a slice of one sum was a kernel
                   more)"""
  (T, _), N = x.shape, w.weight.shape[0]
  partial = partial_products(x, w, norm)
  summed = partial.reshape(T, N) if partial.shape[0] == 1 else None   # one run: the partial sums are the product (no kernel)
  bias = w.bias.cast(dtypes.float32) if w.bias is not None else None
  def total(lo: int, hi: int) -> Tensor:   # outputs lo..hi-1, their runs added (and the bias)
    y = summed[:, lo:hi] if summed is not None else partial[:, :, lo:hi].sum(0)
    return y + bias[lo:hi] if bias is not None else y
  if act is None: return total(0, N).cast(dtype or x.dtype)
  return portable.gated(total(0, N // 2), total(N // 2, N), act).cast(dtype or x.dtype)
