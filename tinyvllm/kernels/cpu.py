"""Hand-written C kernels for tinygrad's CPU device, run through `Tensor.custom_kernel` (so TinyJit captures them).

tinygrad's generated CPU matmuls reach 1-5 GB/s on decode shapes; these reach several times that. The CPU
device calls a program at the start of its code with every buffer address as an argument, so each kernel is
the first function of its source, helpers are `static inline`, and shapes are compile-time constants (no
runtime scalars, which TinyJit would need as bound Variables). The source is freestanding C: no libc.
"""
from __future__ import annotations
import functools
from tinygrad import Tensor, Device, UOp, dtypes
from tinygrad.uop.ops import Ops, KernelInfo

# clang vector extensions compile to AVX2/AVX-512 on x86 and NEON on arm64 alike
_VEC = r"""
typedef float vf __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));   /* unaligned loads */
#define VW 8
static inline vf vload(const float *p) { return *(const vf_u *)p; }
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VW; i++) s += v[i]; return s; }
"""


def _linear_f32_source(name: str, M: int, N: int, K: int, bias: bool) -> str:
  """y[M,N] = x[M,K] @ w[N,K]^T (+ b[N]). Tiles of 4 weight rows stay in L1 while every x row pair passes
  over them, so each weight byte comes from memory once per call: decode is bound by the weight stream."""
  return f"""
void {name}(float *restrict y, const float *restrict x, const float *restrict w{", const float *restrict b" if bias else ""});
static inline void tile(float *restrict y, const float *restrict x, const float *restrict w{", const float *restrict b" if bias else ""}, int n0, int nr, int m0, int mr);
void {name}(float *restrict y, const float *restrict x, const float *restrict w{", const float *restrict b" if bias else ""}) {{
  for (int n0 = 0; n0 < {N}; n0 += 4) {{
    int nr = {N} - n0 < 4 ? {N} - n0 : 4;
    for (int m0 = 0; m0 < {M}; m0 += 2) tile(y, x, w{", b" if bias else ""}, n0, nr, m0, {M} - m0 < 2 ? {M} - m0 : 2);
  }}
}}
{_VEC}
static inline void tile(float *restrict y, const float *restrict x, const float *restrict w{", const float *restrict b" if bias else ""}, int n0, int nr, int m0, int mr) {{
  vf acc[2][4] = {{{{0}}}};
  const float *x0 = x + (long)m0 * {K}, *x1 = x + (long)(m0 + (mr > 1)) * {K};
  const float *w0 = w + (long)n0 * {K}, *w1 = w + (long)(n0 + (nr > 1)) * {K};
  const float *w2 = w + (long)(n0 + (nr > 2) * 2) * {K}, *w3 = w + (long)(n0 + (nr > 3) * 3) * {K};
  int k = 0;
  for (; k + VW <= {K}; k += VW) {{
    vf a0 = vload(x0 + k), a1 = vload(x1 + k);
    vf b0 = vload(w0 + k), b1 = vload(w1 + k), b2 = vload(w2 + k), b3 = vload(w3 + k);
    acc[0][0] += a0 * b0; acc[0][1] += a0 * b1; acc[0][2] += a0 * b2; acc[0][3] += a0 * b3;
    acc[1][0] += a1 * b0; acc[1][1] += a1 * b1; acc[1][2] += a1 * b2; acc[1][3] += a1 * b3;
  }}
  const float *xs[2] = {{x0, x1}}, *ws[4] = {{w0, w1, w2, w3}};
  for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {{
    float s = hsum(acc[i][j]);
    for (int kk = k; kk < {K}; kk++) s += xs[i][kk] * ws[j][kk];
    y[(long)(m0 + i) * {N} + n0 + j] = s{" + b[n0 + j]" if bias else ""};
  }}
}}
"""


@functools.cache
def _compiled(src: str) -> bytes:
  return Device["CPU"].compiler.compile(src)


def _program(name: str, src: str, *params: UOp) -> UOp:
  sink = UOp.sink(*params, arg=KernelInfo(name=name))
  return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=(*sink.src, sink)), UOp(Ops.SOURCE, arg=src),
                               UOp(Ops.BINARY, arg=_compiled(src))))


def linear_f32(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
  """x `[M, K]` float32 @ weight `[N, K]`^T (+ bias `[N]`) on the CPU device."""
  (M, K), N = x.shape, weight.shape[0]
  name = f"linear_f32_{M}_{N}_{K}{'_b' if bias is not None else ''}"
  src = _linear_f32_source(name, M, N, K, bias is not None)
  out = Tensor.invalids(M, N, dtype=dtypes.float32, device=x.device)
  args = [out, x.contiguous(), weight] + ([bias] if bias is not None else [])
  return Tensor.custom_kernel(*args, fxn=lambda *p: _program(name, src, *p))[0]
