"""The packed linear's kernels (GGUF k-quants, Q5_0/Q5_1, MLX 5/6/8-bit: quant/blocks.py) against float64 numpy on the
exactly dequantized weights: the CPU C kernel (AVX2 GEMV and GEMM, and its plain-C branch), the portable kernel.

Bound: float32 summation, 4 K 2^-24 (|x| . (|S| q + |B|)) per output; the AVX2 kernels (GEMV and GEMM alike) round x
to 16 bits per max(G, 32) inputs, adding half a 16-bit step of each input times |S (q - c)| (c = 2^(bits-1), the
centre the codes are taken from). On CPUs with AVX-512 VBMI the k-quants (Q4_K, Q5_K, Q6_K, Q3_K) take another path
(kernels/cpu.py _KQuantInt): x rounded per super-block of 256 inputs and codes taken from that path's centre
(_kquant_centre: 0 for Q4_K). Every branch computes a row the same way for any number of rows: the GEMM's rows
equal the GEMV's bit for bit (batch invariance).
Rows of 416 and 160 inputs end in a partly filled block of high bits (13 and 5 runs of 32), and 13 groups exercise the
GEMV's 8-groups-at-a-time scales and its one-at-a-time tail together."""
from __future__ import annotations
import ctypes, shutil, subprocess, tempfile
from pathlib import Path
import numpy as np
import pytest
from tinygrad import GlobalCounters, Tensor
from test_blocks import random_ggml
from tinyvllm.quant import blocks
from tinyvllm.quant.formats import CODEBOOK, PACKED, LinearWeights


def cases():
  rng = np.random.default_rng(5)
  out = [(q, *blocks.from_ggml(random_ggml(q, 37, 512, rng), q, (37, 512))) for q in blocks.GGML_TYPES]
  out += [(f"{q}-K416", *blocks.from_ggml(random_ggml(q, 37, 416, rng), q, (37, 416))) for q in ("Q5_0", "Q5_1")]
  # k-quant rows of an odd number of super-blocks (3: the VBMI path's half-filled last steps) and of more than 16 (its
  # d, dmin and per-super-block loops past one vector)
  out += [(f"{q}-K{K}", *blocks.from_ggml(random_ggml(q, 37, K, rng), q, (37, K)))
          for q, K in (("Q4_K", 768), ("Q5_K", 768), ("Q6_K", 768), ("Q3_K", 768), ("Q4_K", 4352), ("Q6_K", 4352))]
  for bits, G, K in ((5, 32, 416), (6, 64, 512), (6, 32, 416), (8, 128, 512), (8, 32, 160)):
    codes = rng.integers(0, 1 << bits, (37, K), dtype=np.uint8)
    s = (rng.uniform(0.001, 0.02, (37, K // G)) * rng.choice([-1, 1], (37, K // G))).astype(np.float16)
    b = rng.uniform(-0.3, 0.3, (37, K // G)).astype(np.float16)
    spec = blocks.QuantSpec(bits, G)
    out.append((f"affine{bits}g{G}-K{K}", blocks.layout(codes, spec, s, None, b), spec))
  return out


CASES = cases()
IDS = [c[0] for c in CASES]


def cpu_has(*features: str) -> bool:
  """Whether this machine's CPU (what tinygrad's clang compiles for, and what runs the kernels compiled here for
  others) has every one of `features`, as /proc/cpuinfo names them."""
  try: flags = Path("/proc/cpuinfo").read_text().split()
  except OSError: return False
  return all(f in flags for f in features)


AVX512 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")   # what -march=x86-64-v4 may use


def vbmi_native() -> bool:
  """Whether this CPU has the k-quant path's AVX-512 VBMI."""
  return cpu_has(*AVX512, "avx512vbmi")


def bound(x: np.ndarray, parts: dict, spec, x16: bool, vbmi: bool | None = None) -> np.ndarray:
  """`vbmi`: whether the kernel was compiled with AVX-512 VBMI (None: this machine's CPU)."""
  from tinyvllm.kernels import cpu
  N, K = parts["scales"].shape[0], parts["scales"].shape[1] * spec.scale_inputs
  kquant = (vbmi_native() if vbmi is None else vbmi) and cpu._kquant_int(K, spec)
  q = blocks.unpack_codes(parts["weight"], spec.bits, K).astype(np.float64)
  centre = cpu._kquant_centre(spec) if kquant else 1 << (spec.bits - 1)
  centred = np.array(CODEBOOK, np.float64)[q.astype(int)] if spec.codebook else q - centre   # what x multiplies
  if spec.codebook: q = np.abs(centred)
  S, B = blocks.group_scales(parts, spec)
  S = np.abs(S.astype(np.float64)).repeat(spec.group, axis=1)
  B = np.abs(B.astype(np.float64)).repeat(spec.group, axis=1) if B is not None else S * spec.offset
  x = np.abs(np.asarray(x, np.float64))
  out = 4 * K * 2.0 ** -24 * (x @ (S * q + B).T) + 1e-30
  if x16:
    unit = 256 if kquant else max(spec.group, 32)   # inputs sharing one scale of x
    half_step = x.reshape(len(x), K // unit, unit).max(-1).repeat(unit, axis=1) / 65534 * 1.001
    out += half_step @ (S * np.abs(centred)).T
  return out


def check(y: np.ndarray, x: np.ndarray, parts: dict, spec, x16: bool, vbmi: bool | None = None) -> None:
  ref = x.astype(np.float64) @ blocks.dequantize(parts, spec).T.astype(np.float64)
  assert y.shape == ref.shape
  worst = np.max(np.abs(y - ref) / bound(x, parts, spec, x16, vbmi))
  assert worst <= 1, f"error {worst:.2f}x the bound"


def inputs(parts: dict, spec) -> int: return parts["scales"].shape[1] * spec.scale_inputs


def tensors(parts: dict, spec) -> LinearWeights:
  return LinearWeights(PACKED, **{k: Tensor(v) for k, v in parts.items() if k != "qspec"}, spec=spec)


@pytest.mark.parametrize("name,parts,spec", CASES, ids=IDS)
@pytest.mark.parametrize("M", [1, 3, 70])
def test_cpu_kernel(name, parts, spec, M):
  from tinyvllm.kernels import cpu
  x = np.random.default_rng(M).standard_normal((M, inputs(parts, spec))).astype(np.float32)
  check(cpu.packed_linear(Tensor(x), tensors(parts, spec)).numpy(), x, parts, spec, x16=True)


@pytest.mark.parametrize("name,parts,spec", CASES, ids=IDS)
@pytest.mark.parametrize("M", [2, 5, 70])
def test_cpu_rows_as_alone(name, parts, spec, M):
  """Batch invariance: each row of the GEMM equals the GEMV of that row alone, bit for bit (x's rounding, the integer
  products, the float sums in the same order)."""
  from tinyvllm.kernels import cpu
  x = np.random.default_rng(M + 10).standard_normal((M, inputs(parts, spec))).astype(np.float32)
  x *= np.exp(np.random.default_rng(1).standard_normal(x.shape[1])).astype(np.float32)   # inputs of different sizes
  lw = tensors(parts, spec)
  together = cpu.packed_linear(Tensor(x), lw).numpy()
  alone = np.concatenate([cpu.packed_linear(Tensor(x[m:m + 1]), lw).numpy() for m in range(M)])
  assert np.array_equal(together, alone), f"rows differ from the GEMV's by up to {np.abs(together - alone).max():.3g}"


@pytest.mark.parametrize("name,parts,spec", CASES, ids=IDS)
def test_portable_kernel_is_one_kernel(name, parts, spec):
  from tinyvllm.kernels import portable
  x = np.random.default_rng(2).standard_normal((2, inputs(parts, spec))).astype(np.float32)
  lw, tx = tensors(parts, spec), Tensor(x).realize()
  for t in lw.tensors(): t.realize()
  GlobalCounters.reset()
  y = portable.packed_linear(tx, lw).realize()
  assert GlobalCounters.kernel_count == 1, "the unpacking must fuse into the matmul (no float W materialised)"
  check(y.numpy(), x, parts, spec, x16=False)


COMPILED = ("Q4_K", "Q6_K", "Q5_1", "Q5_0-K416", "IQ4_XS", "affine6g32-K416", "affine8g32-K160", "Q5_K-K768", "Q3_K-K768")
VBMI = ("-march=x86-64-v4", "-mavx512vbmi")


@pytest.mark.parametrize("name,parts,spec", [CASES[IDS.index(n)] for n in COMPILED], ids=COMPILED)
@pytest.mark.parametrize("flags,M", [(("-mno-avx2", "-mno-f16c"), 3), (("-march=x86-64-v3",), 1), (("-march=x86-64-v3",), 3),
                                     (("-march=x86-64-v4",), 1), (("-march=x86-64-v4",), 3), (VBMI, 1), (VBMI, 3)],
                         ids=["plain-C", "AVX2-noVNNI-GEMV", "AVX2-noVNNI-GEMM", "AVX512-noVNNI-GEMV", "AVX512-noVNNI-GEMM",
                              "AVX512-VBMI-noVNNI-GEMV", "AVX512-VBMI-noVNNI-GEMM"])
def test_compiled_for_other_cpus(name, parts, spec, flags, M):
  """The kernel as other CPUs compile it: the non-AVX2 branch (what arm64 compiles) with AVX2 off, the AVX2 one
  without VNNI (vpmaddwd + vpaddd where this machine uses vpdpwssd), the AVX-512 one without VNNI (rows of an even
  number of runs; odd ones take the AVX2 loop), and with VBMI too (the k-quants' integer-scale path). With several
  rows, each also equals that CPU's GEMV of the row alone."""
  from tinyvllm.kernels import cpu
  if shutil.which("clang") is None: pytest.skip("clang not found")
  # a kernel this CPU cannot run kills the whole test process (SIGILL), so those are skipped, naming what is missing
  if "-march=x86-64-v4" in flags and not cpu_has(*AVX512): pytest.skip("this CPU has no AVX-512 to run it")
  if flags == VBMI and not vbmi_native(): pytest.skip("this CPU has no AVX-512 VBMI to run it")
  N, K = 37, inputs(parts, spec)
  x = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
  arrays = [np.ascontiguousarray(parts[p]) for p in ("weight", "scales", "scale_d", "biases") if p in parts]

  def run(x: np.ndarray, d: str) -> np.ndarray:
    src, so = Path(d) / f"k{len(x)}.c", Path(d) / f"k{len(x)}.so"
    name, code = cpu.packed_linear_kernel(len(x), N, K, spec)
    src.write_text(code.replace(name, "k"))
    subprocess.run(["clang", "-O2", *flags, "-ffreestanding", "-nostdlib", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    y = np.zeros((len(x), N), np.float32)
    ctypes.CDLL(str(so)).k(*[a.ctypes.data_as(ctypes.c_void_p) for a in (y, np.ascontiguousarray(x), *arrays, np.zeros(2, np.uint64))])
    return y

  with tempfile.TemporaryDirectory() as d:
    y = run(x, d)
    check(y, x, parts, spec, x16="-mno-avx2" not in flags, vbmi=flags == VBMI)
    if M > 1: assert np.array_equal(y, np.concatenate([run(x[m:m + 1], d) for m in range(M)]))


@pytest.mark.parametrize("flags", [("-march=x86-64-v3",), ("-march=x86-64-v4",), VBMI], ids=["AVX2", "AVX512", "AVX512-VBMI"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_gemm_frame_fits_a_python_threads_stack(flags, qtype):
  """A GEMM keeps its chunk of prepared x rows on the stack, and part 0 of a pooled kernel runs on the calling thread:
  a Python thread (tinygrad's CPU worker, the engine's), whose stack can be glibc's 2 MiB. Every frame of a prefill-
  sized GEMM over the widest inputs an 8B has (14336) stays under 1 MiB (clang's -fstack-usage; compiled, not run)."""
  from tinyvllm.kernels import cpu
  if shutil.which("clang") is None: pytest.skip("clang not found")
  K = 14336
  parts, spec = blocks.from_ggml(random_ggml(qtype, 4, K, np.random.default_rng(0)), qtype, (4, K))
  with tempfile.TemporaryDirectory() as d:
    src = Path(d) / "k.c"
    src.write_text(cpu.packed_linear_kernel(128, 64, K, spec)[1])
    subprocess.run(["clang", "-O2", *flags, "-fstack-usage", "-ffreestanding", "-c", str(src), "-o", str(Path(d) / "k.o")], check=True)
    frames = {line.split("\t")[0].split(":")[-1]: int(line.split("\t")[1]) for line in (Path(d) / "k.su").read_text().splitlines()}
  assert max(frames.values()) < 1 << 20, frames


@pytest.mark.parametrize("name,parts,spec", [CASES[IDS.index(n)] for n in ("Q4_K", "Q6_K", "Q3_K", "Q5_0-K416", "IQ4_XS")],
                         ids=["Q4_K", "Q6_K", "Q3_K", "Q5_0-K416", "IQ4_XS"])
@pytest.mark.parametrize("M", [1, 3])
def test_a_nan_in_x_reaches_every_output(name, parts, spec, M):
  """A NaN input makes every output of its row NaN, wherever it sits: x's 16-bit rounding must not lose it (max_ps
  keeps its second operand when one is NaN, so a NaN once vanished unless it was its unit's last input)."""
  from tinyvllm.kernels import cpu
  x = np.random.default_rng(3).standard_normal((M, inputs(parts, spec))).astype(np.float32)
  x[0, 5] = np.nan
  y = cpu.packed_linear(Tensor(x), tensors(parts, spec)).numpy()
  assert np.isnan(y[0]).all()
  if M > 1: assert np.isfinite(y[1:]).all()
