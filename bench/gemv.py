"""A decode step's projections on the device: our GEMV kernel (kernels/gemv.py, one kernel with the norm, the gating
or the residual inside) against the tinygrad ops it replaced (the norm's reduction, tinygrad's matmul, the gating),
on the projection shapes of Llama-3.2-1B and Llama-3.1-8B, with float16 weights, with INT4 weights (groups of 64,
quantized at load by `quantization="int4"`) and with GGUF's Q4_K and Q6_K (a Q4_K_M file's two types: random valid
blocks, repacked by quant/blocks.py). Run it where the GPU is (bench/gpu_session.sh).

    python bench/gemv.py [--models 1b,8b] [--formats float16,int4,q4_k,q6_k] [--rows 1,8] [--rounds 9] [--json out.json]
                         [--schedules 32x2,64x2,32x1x32]   # our kernel's threads a weight row x rows a thread
                                                           # (x x rows a thread), each timed

Each variant's kernels are timed by tinygrad's device timer (CUDA events on a GPU) one call at a time, the L2 cache
flushed before each call (a 1B layer's weights fit the H100's 50 MB L2; a decode step streams them from memory), and
summed per variant; the median of --rounds. Both variants are first checked to agree (relative error below 2e-3:
float16 outputs). Printed: microseconds each, kernels each, our speed over tinygrad's, and the weight bytes per second
ours reads (against the device's bandwidth: `python -m tinyvllm.bench` measures it). Where a batch that size of float16
rows runs on the tensor cores instead (kernels/gemm.py: 16 rows or more on NVIDIA), that kernel's time too, with the
norm, gating or residual around it (`--rows 32`).
"""
from __future__ import annotations
import argparse, json, sys
from pathlib import Path
import numpy as np
from tqdm import tqdm

# (name, N, K, fusion): the projections of a decode layer and the LM head, with what each fuses
MODELS = {
  "1b": [("qkv", 3072, 2048, "norm"), ("o", 2048, 2048, "residual"), ("gate_up", 16384, 2048, "glu"),
         ("down", 2048, 8192, "residual"), ("lm_head", 128256, 2048, "norm")],
  "8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "residual"), ("gate_up", 28672, 4096, "glu"),
         ("down", 4096, 14336, "residual")],
}
EPS = 1e-5


GROUP = 64


# a GGUF block's float16 fields (byte offsets) and the scale they get (over sqrt(K)): weights about 1/sqrt(K), like the
# float ones (Q4_K: d * a 6-bit scale * a 4-bit code; Q6_K: d * an int8 scale * a code less 32)
KQUANT_F16 = {"Q4_K": ((0, 2), 1 / 256), "Q6_K": ((208,), 1 / 1024)}


def weights(fmt: str, N: int, K: int, rng, device: str):
  """A random `[N, K]` weight as float16, as INT4 codes with a float16 scale and bias per 64 (quant/formats.py), or as
  random valid Q4_K or Q6_K blocks (quant/blocks.py's packed layout)."""
  from tinygrad import Tensor
  from tinyvllm.quant import blocks
  from tinyvllm.quant.formats import FLOAT, INT4, PACKED, LinearWeights
  if fmt.upper() in KQUANT_F16:
    qtype = fmt.upper()
    block, nbytes = blocks.GGML_TYPES[qtype]
    raw = rng.integers(0, 256, (N, K // block, nbytes), dtype=np.uint8)
    fields, size = KQUANT_F16[qtype]
    for at in fields: raw[..., at:at + 2] = np.full(raw.shape[:-1], size / np.sqrt(K), np.float16)[..., None].view(np.uint8)
    parts, spec = blocks.from_ggml(raw.reshape(N, -1), qtype, (N, K))
    return LinearWeights(PACKED, **{k: Tensor(v, device=device).realize() for k, v in parts.items() if k != "qspec"}, spec=spec)
  if fmt == "float16":
    return LinearWeights(FLOAT, Tensor((rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K)).astype(np.float16), device=device).realize())
  words = rng.integers(0, 2**32, (N, K // 8), dtype=np.uint32)
  scales = (rng.uniform(0.5, 1.5, (N, K // GROUP)) / 8 / np.sqrt(K)).astype(np.float16)
  return LinearWeights(INT4, *(Tensor(a, device=device).realize() for a in (words, scales)), biases=Tensor(-7.5 * scales, device=device).realize())


def tensor_core_variant(fusion: str, x, w, g, r):
  """The projection as a batch beyond the GEMV's rows runs it on float16 weights (kernels/gemm.py: the tensor cores,
  x's 1/RMS a kernel before, the partial sums with the gating or residual a kernel after), or None where that kernel
  does not apply."""
  from tinyvllm.kernels import gemm
  if not gemm.applies(x, w): return None
  if fusion == "norm": return lambda: gemm.matmul(x, w, norm=(g, EPS))
  if fusion == "glu": return lambda: gemm.matmul(x, w, norm=(g, EPS), act="silu")
  return lambda: r + gemm.matmul(x, w)


def variants(fusion: str, x, w, g, r):
  """(ours, tinygrad's): the same projection as our kernel and as the tensor ops it replaced."""
  from tinyvllm.kernels import gemv, portable
  from tinyvllm.quant.formats import INT4, PACKED
  def matmul(x):
    if w.format == INT4: return portable.int4_linear(x, w.weight, w.scales, w.biases, GROUP)
    if w.format == PACKED: return portable.packed_linear(x, w)
    return portable.linear(x, w.weight)
  if fusion == "norm": return lambda: gemv.gemv(x, w, norm=(g, EPS)), lambda: matmul(portable.rms_norm(x, g, EPS))
  if fusion == "glu":
    inter = w.weight.shape[0] // 2
    def composed():
      gate_up = matmul(portable.rms_norm(x, g, EPS))
      return portable.gated(gate_up[:, :inter], gate_up[:, inter:], "silu").contiguous()
    return lambda: gemv.gemv(x, w, norm=(g, EPS), act="silu"), composed
  return lambda: gemv.gemv(x, w, residual=r), lambda: r + matmul(x)


def device_seconds(fn, rounds: int) -> tuple[float, int]:
  """Median device time of the kernels `fn` schedules (summed), and how many there are."""
  from tinygrad.engine.realize import time_call
  from tinygrad.uop.ops import Ops
  linear, var_vals = fn().linear_with_vars()
  calls = [c for c in linear.src if c.op is Ops.CALL and c.src[0].op is Ops.SINK]
  timers = [time_call(c, var_vals, clear_l2=True) for c in calls]
  return float(np.median([sum(next(t) for t in timers) for _ in range(rounds)])), len(calls)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="1b,8b")
  ap.add_argument("--shapes", default=None, help="NxK:fusion,... instead of --models (fusion: norm, glu, residual)")
  ap.add_argument("--formats", default="float16,int4", help="weight formats: float16, int4 (groups of 64), q4_k, q6_k")
  ap.add_argument("--rows", default="1,8", help="rows of x (decode sequences)")
  ap.add_argument("--rounds", type=int, default=9)
  ap.add_argument("--schedules", default=None, help="our kernel's schedules to time, THREADSxROWS[xXROWS],... (threads "
                  "sharing a weight row, its rows a thread, x's rows a thread: gemv.THREADS_PER_ROW, ROWS_PER_THREAD, "
                  "X_ROWS_A_THREAD); default the module's")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  from tinygrad import Device, Tensor
  from tinyvllm.kernels import gemv
  dev = Device.DEFAULT
  default = f"{gemv.THREADS_PER_ROW}x{gemv.ROWS_PER_THREAD}x{gemv.X_ROWS_A_THREAD}"
  def schedule(text: str) -> tuple[int, int, int]:   # THREADS[xROWS[xXROWS]], the module's values for those left out
    given = [*map(int, text.split("x"))]
    return tuple(given + [gemv.ROWS_PER_THREAD, gemv.X_ROWS_A_THREAD][len(given) - 1:])
  schedules = [schedule(s) for s in (args.schedules or default).split(",")]
  if args.schedules: gemv.SPREAD_BELOW = 0   # each schedule as asked, never spread (kernel_opts) by itself
  if args.shapes:
    shapes = [("custom", *map(int, s.split(":")[0].split("x")), s.split(":")[1]) for s in args.shapes.split(",")]
    cases = [("-", *s) for s in shapes]
  else: cases = [(m, *s) for m in args.models.split(",") for s in MODELS[m]]
  cases = [(fmt, *case) for case in cases for fmt in args.formats.split(",")]
  rng, rows = np.random.default_rng(0), []
  # each row printed as it is measured: the GPU session's time limit may cut the run short
  print(f"{'model':5} {'projection':>10} {'weights':>7} {'N x K':>14} {'T':>2} {'us ours':>9} {'us tinygrad':>11} {'kernels':>8} "
        f"{'speedup':>8} {'GB/s ours':>9}   ({dev}, float16 x, device time, L2 flushed)", flush=True)
  for fmt, model, name, N, K, fusion in tqdm(cases, desc="projections", file=sys.stderr, disable=None):
    w = weights(fmt, N, K, rng, dev)
    g = Tensor((1 + 0.1 * rng.standard_normal(K)).astype(np.float16), device=dev).realize()
    for T in map(int, args.rows.split(",")):
      x = Tensor(rng.standard_normal((T, K)).astype(np.float16), device=dev).realize()
      r = Tensor(rng.standard_normal((T, N)).astype(np.float16), device=dev).realize()
      theirs_timed = None
      for threads, per_thread, x_rows in schedules:
        gemv.THREADS_PER_ROW, gemv.ROWS_PER_THREAD, gemv.X_ROWS_A_THREAD = threads, per_thread, x_rows
        ours, theirs = variants(fusion, x, w, g, r)
        try: a = ours().numpy().astype(np.float64)
        except Exception as e:   # a schedule past the device's limits (shared memory for many threads and rows)
          tqdm.write(f"{model:5} {name:>10} {fmt:>7} {N:>6} x {K:<6} {T:>2} {threads}x{per_thread}x{x_rows} does not compile: {str(e)[:120]}",
                     file=sys.stdout)
          continue
        b = theirs().numpy().astype(np.float64)
        err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        # float16 outputs: 2e-3; a k-quant's tinygrad side also rounds each dequantized weight to float16 (its d * scale * q
        # less dmin * min cancels, so a weight's rounding can be large against it), where ours sums it in float32
        assert err < (2e-3 if fmt in ("float16", "int4") else 1e-2), f"{model} {name} T={T}: our GEMV and tinygrad's ops disagree (relative error {err:.2e})"
        s_ours, k_ours = device_seconds(ours, args.rounds)
        s_theirs, k_theirs = theirs_timed = theirs_timed or device_seconds(theirs, args.rounds)
        tc, us_tc = tensor_core_variant(fusion, x, w, g, r), None
        if tc is not None and (threads, per_thread, x_rows) == schedules[0]:
          c = tc().numpy().astype(np.float64)
          assert float(np.linalg.norm(c - b) / np.linalg.norm(b)) < 2e-3, f"{model} {name} T={T}: the tensor-core kernel and tinygrad's ops disagree"
          us_tc = device_seconds(tc, args.rounds)[0] * 1e6
        rows.append({"model": model, "projection": name, "format": fmt, "N": N, "K": K, "rows": T, "fusion": fusion, "device": dev,
                     "schedule": f"{threads}x{per_thread}x{x_rows}", "us_ours": s_ours * 1e6, "us_tinygrad": s_theirs * 1e6,
                     "kernels_ours": k_ours, "kernels_tinygrad": k_theirs, "speedup": s_theirs / s_ours,
                     "weight_gbps_ours": sum(t.nbytes() for t in w.tensors()) / s_ours / 1e9, "rel_err": err,
                     "us_tensor_cores": us_tc})
        rec = rows[-1]
        tqdm.write(f"{rec['model']:5} {rec['projection']:>10} {rec['format']:>7} {rec['N']:>6} x {rec['K']:<6} {rec['rows']:>2} "
                   f"{rec['us_ours']:9.1f} {rec['us_tinygrad']:11.1f} {rec['kernels_ours']:>3} / {rec['kernels_tinygrad']:<2} "
                   f"{rec['speedup']:8.2f} {rec['weight_gbps_ours']:9.1f}" + (f"  {rec['schedule']}" if len(schedules) > 1 else "")
                   + (f"  tensor cores {us_tc:.1f} us" if us_tc is not None else ""),
                   file=sys.stdout)
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
