"""Hand-written C kernels for tinygrad's CPU device, run through `Tensor.custom_kernel` (so TinyJit captures them).

tinygrad's generated CPU matmuls reach 1-5 GB/s on decode shapes; these reach several times that. The CPU
device calls a program at the start of its code with every buffer address as an argument, so each kernel is
the first function of its source, helpers are `static inline`, and shapes are compile-time constants (no
runtime scalars, which TinyJit would need as bound Variables). The source is freestanding C: no libc.
"""
from __future__ import annotations
import functools
import numpy as np
from tinygrad import Context, Tensor, Device, UOp, dtypes
from tinygrad.uop.ops import Ops, KernelInfo
from tinyvllm.kernels.threads import C_PARALLEL, C_PARALLEL_DECLS
from tinyvllm.quant.blocks import QuantSpec, high_blocks
from tinyvllm.quant.formats import CODEBOOK
from tinyvllm.quant.int4 import GROUP_SIZES

# clang vector extensions compile to AVX2/AVX-512 on x86 and NEON on arm64 alike
_VEC = r"""
typedef float vf __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));   /* unaligned loads */
#define VW 8
static inline vf vload(const float *p) { return *(const vf_u *)p; }
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VW; i++) s += v[i]; return s; }
"""


# float32 y[M, nb:ne] = x[M,K] @ w[nb:ne,K]^T (rows nb..ne-1 of the output; nb a multiple of 4). Tiles of 4 weight
# rows stay in L1 while every pair of x rows passes over them, so each weight byte comes from memory once per call:
# decode is bound by the weight stream. Shared by linear_f32 and the fused decoder layer (cpu_layer.py); needs _VEC.
_MM_F32 = r"""
static void mm_f32(float *restrict y, const float *restrict x, const float *restrict w, int M, int N, int K, int nb, int ne) {
  for (int n0 = nb; n0 < ne; n0 += 4) {
    int nr = ne - n0 < 4 ? ne - n0 : 4;
    for (int m0 = 0; m0 < M; m0 += 2) {
      int mr = M - m0 < 2 ? M - m0 : 2;
      vf acc[2][4] = {{0}};
      const float *x0 = x + (long)m0 * K, *x1 = x + (long)(m0 + (mr > 1)) * K;
      const float *ws[4];
      for (int j = 0; j < 4; j++) ws[j] = w + (long)(n0 + (j < nr ? j : 0)) * K;
      int k = 0;
      for (; k + VW <= K; k += VW) {
        vf a0 = vload(x0 + k), a1 = vload(x1 + k);
        vf b0 = vload(ws[0] + k), b1 = vload(ws[1] + k), b2 = vload(ws[2] + k), b3 = vload(ws[3] + k);
        acc[0][0] += a0 * b0; acc[0][1] += a0 * b1; acc[0][2] += a0 * b2; acc[0][3] += a0 * b3;
        acc[1][0] += a1 * b0; acc[1][1] += a1 * b1; acc[1][2] += a1 * b2; acc[1][3] += a1 * b3;
      }
      const float *xs[2] = {x0, x1};
      for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {
        float s = hsum(acc[i][j]);
        for (int kk = k; kk < K; kk++) s += xs[i][kk] * ws[j][kk];
        y[(long)(m0 + i) * N + n0 + j] = s;
      }
    }
  }
}
"""


def c_param_name(param: str) -> str:
  """The name in a C parameter declaration such as "const float *restrict x"."""
  return param.split()[-1].lstrip("*")


def c_struct_fields(params: list[str]) -> str:
  """Struct fields holding these parameters (a pool part's context: the parts get one pointer)."""
  return " ".join(p.replace("restrict ", "") + ";" for p in params)


def row_parallel_kernel(name: str, params: list[str], N: int, body: str, head: str = "", tail: str = "") -> str:
  """The source of kernel `name(params..., pool)` that computes output rows [nb, ne) in `body`, the rows split over the
  thread pool (kernels/threads.py) in runs of 4 (so each 4-row tile is computed whole, by one thread, the same way
  for any thread count). `head` goes before the kernel (types, declarations: no function bodies, since tinygrad
  calls the start of the code), `tail` after it (helper definitions)."""
  return f"""{head}
void {name}({", ".join(params)}, const unsigned long long *restrict pool);
struct {name}_ctx {{ {c_struct_fields(params)} }};
static void {name}_rows(void *ctx, int part, int nparts);
void {name}({", ".join(params)}, const unsigned long long *restrict pool) {{
  struct {name}_ctx c = {{{", ".join(c_param_name(p) for p in params)}}};
  tv_parallel(pool, {name}_rows, &c);
}}
static void {name}_rows(void *ctx, int part, int nparts) {{
  struct {name}_ctx *c = ctx;
  {" ".join(f"{p} = c->{c_param_name(p)};" for p in params)}
  int nb, ne;
  tv_share_rows({N}, part, nparts, &nb, &ne);
  {body}
}}
{tail}
"""


def _linear_f32_source(name: str, M: int, N: int, K: int, bias: bool) -> str:
  """y[M,N] = x[M,K] @ w[N,K]^T (+ b[N]) through mm_f32, with the sizes as constants."""
  params = ["float *restrict y", "const float *restrict x", "const float *restrict w"] + (["const float *restrict b"] if bias else [])
  add_bias = f"for (int m = 0; m < {M}; m++) for (int n = nb; n < ne; n++) y[(long)m * {N} + n] += b[n];" if bias else ""
  head = C_PARALLEL_DECLS + "static void mm_f32(float *restrict y, const float *restrict x, const float *restrict w, int M, int N, int K, int nb, int ne);"
  return row_parallel_kernel(name, params, N, f"mm_f32(y, x, w, {M}, {N}, {K}, nb, ne);\n  {add_bias}", head=head,
                             tail=_VEC + _MM_F32 + C_PARALLEL)


@functools.cache
def _compiled(src: str) -> bytes:
  """Through tinygrad's on-disk cache: clang takes ~0.7 s for the layer kernel, once per machine, not per process."""
  return Device["CPU"].compiler.compile_cached(src)


def _program(name: str, src: str, *params: UOp) -> UOp:
  sink = UOp.sink(*params, arg=KernelInfo(name=name))
  return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=(*sink.src, sink)), UOp(Ops.SOURCE, arg=src),
                               UOp(Ops.BINARY, arg=_compiled(src))))


@functools.cache
def _serial(device: str) -> Tensor:
  """The pool buffer of a kernel run on one thread (kernels/threads.py), one per device, realized outside any capture."""
  with Context(CAPTURING=0): return Tensor(np.zeros(2, np.uint64), dtype=dtypes.uint64, device=device).realize()


def pool_arg(pool: Tensor | None, device: str) -> Tensor:
  """The thread-pool buffer a parallel kernel takes: a ThreadPool's, or for None the one-thread buffer."""
  return _serial(device) if pool is None else pool


def run_kernel(kernel: tuple[str, str], *args: Tensor) -> Tensor:
  """A (name, C source) kernel run as a tinygrad custom kernel over `args`; returns the first, its output."""
  name, src = kernel
  return Tensor.custom_kernel(*args, fxn=lambda *p: _program(name, src, *p))[0]


def linear_f32_kernel(M: int, N: int, K: int, bias: bool) -> tuple[str, str]:
  """(name, source) of the float32 linear `y[M, N] = x[M, K] @ w[N, K]^T (+ b)`: args y, x, w, (b,) pool."""
  name = f"linear_f32_{M}_{N}_{K}{'_b' if bias else ''}"
  return name, _linear_f32_source(name, M, N, K, bias)


def linear_f32(x: Tensor, weight: Tensor, bias: Tensor | None = None, pool: Tensor | None = None) -> Tensor:
  """x `[M, K]` float32 @ weight `[N, K]`^T (+ bias `[N]`) on the CPU device; `pool`: a ThreadPool's buffer
  (kernels/threads.py), or None for one thread."""
  (M, K), N = x.shape, weight.shape[0]
  out = Tensor.invalids(M, N, dtype=dtypes.float32, device=x.device)
  args = [out, x.contiguous(), weight] + ([bias] if bias is not None else []) + [pool_arg(pool, x.device)]
  return run_kernel(linear_f32_kernel(M, N, K, bias is not None), *args)




# **** RMSNorm ****

def rms_norm_source(name: str, T: int, E: int, eps: float) -> str:
  """`static void name(y, x, w)`: y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for each of T rows of E, one row at a
  time: a row's result never depends on how many rows share the call (batch invariance; tinygrad's generated
  reduction picks its order by shape). Shared by `rms_norm` and the fused layer; needs _VEC and sqrt_f32."""
  return f"""static void {name}(float *restrict y, const float *restrict x, const float *restrict w) {{
  for (int t = 0; t < {T}; t++) {{
    const float *xr = x + (long)t * {E};
    vf acc = (vf){{0}};
    int i = 0;
    for (; i + 8 <= {E}; i += 8) {{ vf v = vload(xr + i); acc += v * v; }}
    float ss = hsum(acc);
    for (; i < {E}; i++) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrt_f32(ss / {E} + {eps!r}f);
    for (int j = 0; j < {E}; j++) y[(long)t * {E} + j] = xr[j] * inv * w[j];
  }}
}}
"""


SQRT = r"""
static inline float sqrt_f32(float x) {
#if defined(__SSE__)
  return _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x)));
#elif defined(__aarch64__)
  float r; __asm__("fsqrt %s0, %s1" : "=w"(r) : "w"(x)); return r;
#else
  float r = x > 1 ? x : 1; for (int i = 0; i < 40; i++) r = 0.5f * (r + x / r); return r;
#endif
}
"""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
  """RMSNorm of float32 x `[T, E]` on the CPU device, row by row (batch-invariant)."""
  T, E = x.shape
  name = f"rms_norm_{T}_{E}_{abs(hash(eps)):x}"
  src = f"""#if defined(__SSE__)
#include <immintrin.h>
#endif
void {name}(float *restrict y, const float *restrict x, const float *restrict w);
{_VEC}{SQRT}{rms_norm_source("norm", T, E, eps)}
void {name}(float *restrict y, const float *restrict x, const float *restrict w) {{ norm(y, x, w); }}
"""
  out = Tensor.invalids(T, E, dtype=dtypes.float32, device=x.device)
  return Tensor.custom_kernel(out, x.contiguous(), weight.cast(dtypes.float32).contiguous(), fxn=lambda *p: _program(name, src, *p))[0]


def argmax(x: Tensor) -> Tensor:
  """int32 index of each row's largest value, float32 `[R, V] -> [R]` on the CPU device, as numpy's argmax picks it:
  the first of equal maxima, the first NaN of a row holding one (told by its bits: the compiler may assume no NaN).
  One pass over a row on one thread: tinygrad's two generated reductions took ~0.5 ms for 49,152 logits, and a greedy
  decode pass on the device (multi-step runs) pays one per pass."""
  R, V = x.shape
  name = f"argmax_{R}_{V}"
  src = f"""typedef unsigned int u32;
void {name}(int *restrict out, const float *restrict x) {{
  for (int r = 0; r < {R}; r++) {{
    const float *row = x + (long)r * {V};
    const u32 *bits = (const u32 *)row;
    int best = 0;
    float top = row[0];
    for (int i = 0; i < {V}; i++) {{
      if ((bits[i] & 0x7fffffffu) > 0x7f800000u) {{ best = i; break; }}
      if (row[i] > top) {{ top = row[i]; best = i; }}
    }}
    out[r] = best;
  }}
}}
"""
  out = Tensor.invalids(R, dtype=dtypes.int32, device=x.device)
  return Tensor.custom_kernel(out, x.contiguous(), fxn=lambda *p: _program(name, src, *p))[0]


# **** what the quantized linears share ****

_HALF = r"""
static inline float h2f(unsigned short h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  unsigned sign = (unsigned)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (!man) bits = sign;
  else { unsigned e = 113; while (!(man & 0x400)) { man <<= 1; e--; } bits = sign | (e << 23) | ((man & 0x3FF) << 13); }
  union { unsigned u; float f; } c = {bits};
  return c.f;
#endif
}
"""

_HSUM8 = r"""
static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
"""

# The quantized linears' integer dot product (_PackedInt below). Each row of x is quantized to 16 bits per unit of
# max(G, 32) inputs (scale = the unit's largest |x| / 32767, round to nearest), so a group's dot product with the codes
# is a sum of integer products, exact in int32: two vpmaddwd per 32 codes instead of converting every code to float
# (a third of the instructions: the float GEMV was compute-bound on two cores). The codes enter centred on
# c = 2^(bits-1) (w = S (q - c) + (B + c S)), so the rounding of x is weighted by |q - c| rather than by q: the only
# rounding added is x's, at most half a step per input, max|x| / 65534 of its unit (llama.cpp's dot products round x
# to 8 bits, 256x coarser). The group sums of x that multiply the biases stay float. Within each 32-input run the
# codes go even inputs first, then odd: the order a 16-byte load of packed nibbles unpacks in.
def _x16_run(src: str, at: str) -> str:
  """C statements rounding the 32 floats at `src` times `inv` to 16-bit codes xq[at .. at + 32), in the chunk order
  (even inputs, then odd), and setting `run_lanes` to their sums per int32 lane of the dot product (vpmaddwd with
  ones)."""
  return f"""int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps({src} + 8 * j), inv)));
      for (int t = 0; t < 16; t++) {{ xq[{at} + t] = (short)qi[2 * t]; xq[{at} + 16 + t] = (short)qi[2 * t + 1]; }}
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + {at})), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + {at} + 16)), ones));"""


# what the 4-bit and 8-bit linear kernels share around their bodies: AVX2 when the CPU has it (TV_AVX2), fp16
# conversion, a horizontal sum, the thread pool; declarations before the kernel, definitions after it
# acc + the pairwise int16 products of a and b (AVX2's vpmaddwd then vpaddd): one instruction on CPUs with VNNI
_DPWSSD = """#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TV_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define TV_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define TV_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TV_AVX512 1
#if defined(__AVX512VNNI__)
#define TV_DPWSSD512(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define TV_DPWSSD512(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#endif"""
_AVX2_DECLS = f"""#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TV_AVX2 1
#endif
{_DPWSSD}
static inline float h2f(unsigned short h);
#ifdef TV_AVX2
static inline float hsum8(__m256 v);
#endif
{C_PARALLEL_DECLS}"""
_AVX2_DEFS = f"{_HALF}\n#ifdef TV_AVX2\n{_HSUM8}\n#endif\n{C_PARALLEL}"


# **** 8-bit linear (GGUF Q8_0 blocks: int8 codes, one float16 scale per 32) ****

_Q8_PARAMS = ["float *restrict y", "const float *restrict x", "const signed char *restrict w", "const unsigned short *restrict s"]


def q8_body(M: int, N: int, K: int, ys: int | None = None) -> str:
  """y[M,N] = x[M,K] @ W^T, W = s * q per block of 32 along K (int8 codes w, float16 scales s). Each weight row is
  converted to float once per call, block by block, and used for all M rows of x: memory-bound for the few rows an LM
  head sees. Output rows have stride `ys` (default N). AVX2 and plain C branches."""
  NB, ys = K // 32, ys or N
  return f"""  for (int n = nb; n < ne; n++) {{
    const signed char *wr = w + (long)n * {K};
    const unsigned short *sr = s + (long)n * {NB};
    float acc[{M}];
    for (int m = 0; m < {M}; m++) acc[m] = 0;
#ifdef TV_AVX2
    /* per row of x and block: the block's 32 products summed in float (a chain of 4), then one FMA with the block's
       scale into the row's vector sum: the blocks' chains are independent, so they overlap */
    float sf[{NB}];
    for (int b = 0; b < {NB}; b++) sf[b] = h2f(sr[b]);
    __m256 av[{M}];
    for (int m = 0; m < {M}; m++) av[m] = _mm256_setzero_ps();
    for (int b = 0; b < {NB}; b++) {{
      __m256 wv[4];
      for (int j = 0; j < 4; j++) wv[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + b * 32 + j * 8))));
      __m256 sc = _mm256_broadcast_ss(&sf[b]);
      for (int m = 0; m < {M}; m++) {{
        const float *xr = x + (long)m * {K} + b * 32;
        __m256 p = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xr));
        for (int j = 1; j < 4; j++) p = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xr + j * 8), p);
        av[m] = _mm256_fmadd_ps(sc, p, av[m]);
      }}
    }}
    for (int m = 0; m < {M}; m++) acc[m] = hsum8(av[m]);
#else
    for (int b = 0; b < {NB}; b++) {{
      float sc = h2f(sr[b]);
      for (int m = 0; m < {M}; m++) {{
        float d = 0;
        for (int k = 0; k < 32; k++) d += (float)wr[b * 32 + k] * x[(long)m * {K} + b * 32 + k];
        acc[m] += sc * d;
      }}
    }}
#endif
    for (int m = 0; m < {M}; m++) y[(long)m * {ys} + n] = acc[m];
  }}"""


def _q8_linear_source(name: str, M: int, N: int, K: int) -> str:
  return row_parallel_kernel(name, _Q8_PARAMS, N, q8_body(M, N, K), _AVX2_DECLS, _AVX2_DEFS)


def q8_linear(x: Tensor, codes: Tensor, scales: Tensor, pool: Tensor | None = None) -> Tensor:
  """x `[M, K]` float32 @ W^T, W `[N, K]` as int8 codes with float16 scales `[N, K/32]` (w = scale * code)."""
  (M, K), N = x.shape, codes.shape[0]
  if K % 32 or tuple(scales.shape) != (N, K // 32): raise ValueError(f"8-bit weight {codes.shape} / scales {scales.shape} do not match x {x.shape}")
  name = f"q8_linear_{M}_{N}_{K}"
  src = _q8_linear_source(name, M, N, K)
  out = Tensor.invalids(M, N, dtype=dtypes.float32, device=x.device)
  return Tensor.custom_kernel(out, x.cast(dtypes.float32).contiguous(), codes, scales, pool_arg(pool, x.device), fxn=lambda *p: _program(name, src, *p))[0]


# **** packed linear (quant/blocks.py: GGUF k-quants, Q5_0/Q5_1, MLX 5/6/8-bit) ****

def _packed_params(spec) -> list[str]:
  """The kernel's weight arguments for a packed layout, in formats.WEIGHT_PARTS order (quant/blocks.py)."""
  scale_t = "unsigned short" if not spec.super_groups else ("signed char" if spec.signed_scales else "unsigned char")
  p = ["const unsigned *restrict w", f"const {scale_t} *restrict s"]
  if spec.super_groups: p.append("const unsigned short *restrict sd")
  elif not spec.symmetric: p.append("const unsigned short *restrict b")
  return p


def _row_words(K: int, spec) -> tuple[int, int, int]:
  """(uint32 words per weight row, runs per high-bits block R, mask of a run's h = bits - 4 high bits) of a packed
  layout: K/8 nibble words, then 32-byte blocks of high bits (quant/blocks.py)."""
  if spec.bits <= 4: return K // 8, 1, 0
  R, NB = high_blocks(K, spec.bits)
  return K // 8 + NB * 8, R, (1 << (spec.bits - 4)) - 1


def _packed_scale(spec, K: int, S: str = "S[g]", B: str = "B[g]") -> str:
  """C statements setting float `S` and (affine) `B` to group g's scale and bias in weight row `n`, exactly as
  quant/blocks.py dequantizes them (a two-level scale: float16 times an integer, exact in float; an affine k-quant
  pairs each group's scale with its min, and each super-block's d with its dmin)."""
  NG, sg = K // spec.group, spec.super_groups
  if not sg: return f"{S} = h2f(s[n * {NG} + g]);" + ("" if spec.symmetric else f" {B} = h2f(b[n * {NG} + g]);")
  if spec.symmetric: return f"{S} = h2f(sd[n * {NG // sg} + g / {sg}]) * (float)s[n * {NG} + g];"
  if spec.k_scales:   # group j of its super-block: 6-bit fields (quant/blocks.py k_scales_mins)
    q, j = f"(s + 12 * (n * {NG // sg} + g / 8))", "(g % 8)"
    scale = f"({j} < 4 ? {q}[{j}] & 63 : ({q}[{j} + 4] & 15) | ({q}[{j} - 4] >> 6) << 4)"
    mn = f"({j} < 4 ? {q}[{j} + 4] & 63 : ({q}[{j} + 4] >> 4) | ({q}[{j}] >> 6) << 4)"
  else: scale, mn = f"s[2 * (n * {NG} + g)]", f"s[2 * (n * {NG} + g) + 1]"
  return (f"{S} = h2f(sd[2 * (n * {NG // sg} + g / {sg})]) * (float){scale};"
          f" {B} = -(h2f(sd[2 * (n * {NG // sg} + g / {sg}) + 1]) * (float){mn});")


def _packed_scales(spec, K: int) -> str:
  """C statements filling S[g] and (affine) B[g] for every group of weight row `n` (_packed_scale)."""
  return f"for (int g = 0; g < {K // spec.group}; g++) {{ {_packed_scale(spec, K)} }}"


def _packed_scales8(spec, K: int) -> str:
  """C statements setting __m256 Sv (and, affine, Bv) to the scales and biases of groups g..g+7 of weight row `n`, as
  _packed_scales computes them one by one (a super-block spans 8 or 16 groups, so the 8 share its float16)."""
  NG, sg = K // spec.group, spec.super_groups
  if not sg:
    out = f"__m256 Sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + n * {NG} + g)));"
    return out + ("" if spec.symmetric else f" __m256 Bv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + n * {NG} + g)));")
  if spec.symmetric:
    cvt = "_mm256_cvtepi8_epi32" if spec.signed_scales else "_mm256_cvtepu8_epi32"
    return (f"__m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[n * {NG // sg} + g / {sg}])), "
            f"_mm256_cvtepi32_ps({cvt}(_mm_loadl_epi64((const __m128i *)(s + n * {NG} + g)))));")
  if spec.k_scales:   # a super-block's 12 bytes of 6-bit fields (quant/blocks.py k_scales_mins) -> 8 scales, then 8 mins
    sm = f"""const unsigned char *q_ = s + 12 * (n * {NG // sg} + g / 8);
        int w8_; __builtin_memcpy(&w8_, q_ + 8, 4);
        __m128i v_ = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)q_), w8_, 2);   /* 12 bytes, no more */
        __m128i a_ = _mm_shuffle_epi8(v_, kfield), t_ = _mm_and_si128(_mm_srli_epi16(_mm_shuffle_epi8(v_, ktop), 2), _mm_set1_epi8(0x30));
        __m128i sm_ = _mm_blendv_epi8(_mm_and_si128(a_, _mm_set1_epi8(63)), _mm_or_si128(_mm_and_si128(_mm_blendv_epi8(a_, _mm_srli_epi16(a_, 4), khigh), _mm_set1_epi8(15)), t_), kupper);"""
  else: sm = f"__m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * {NG} + g))), deint);"
  return f"""{sm}
        long d_ = 2 * (n * {NG // sg} + g / {sg});
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));"""


class _PackedInt:
  """C fragments of the packed layouts' integer products (the GEMV and the GEMM built on it): x rounded to 16 bits
  per unit of max(G, 32) inputs (per group; a run of 32 for 16-wide groups) and each run of 32
  codes multiplying it in exact int32 (vpmaddwd), centred on c = 2^(bits-1): sum S (q - c) x per group, then for
  affine layouts + sum (B + c S) x. A run's codes unpack from 16 bytes of nibbles (even inputs in the low nibbles,
  odd in the high) plus, for b > 4 bits, the run's h = b - 4 high bits: one shift of its 32-byte block leaves byte i
  holding input i's in its low bits, so read as 16-bit lanes, lane t holds input 2t's in its low byte and 2t + 1's
  in its high byte: shifted left and right by 4 and masked they add (high << 4) to the even and odd codes, no
  shuffles. With 16-wide groups a run holds two: its int32 lanes 0-3 come from the first 16 inputs, 4-7 from the
  last 16, and the scale vector carries each group's scale in its lanes. Per weight row, the groups' scale times
  x's (gs) and the bias term are computed 8 groups at a time.

  `wide` (AVX-512, an even number of runs): two runs per step in 512-bit registers, the same integer products with
  half the instructions (the AVX2 loop is compute-bound on this machine's cores, at about the bandwidth one core
  draws). A step's 32 bytes of nibbles widen to 32 words, run c's then run c + 1's, so int32 lanes 0-7 hold run
  c's sums (lane j: inputs 4j .. 4j + 3, as in the AVX2 loop) and 8-15 run c + 1's; the two runs' high bits come
  from one block, broadcast to both halves and shifted by each run's own amount."""
  def __init__(self, N: int, K: int, spec, wide: bool):
    self.N, self.K, self.spec, self.wide = N, K, spec, wide
    self.NC, self.NG, self.G, self.HB = K // 32, K // spec.group, spec.group, spec.bits - 4
    self.RW, self.R, self.high_mask = _row_words(K, spec)
    self.XU = max(self.G, 32)        # inputs per x scale
    self.NX = K // self.XU
    self.c = 0 if spec.codebook else 1 << (spec.bits - 1)   # the centre codes are taken from (a codebook's values are signed)

  def consts(self) -> str:
    table = ", ".join(map(str, CODEBOOK * 2))
    return f"""
  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i book = _mm256_setr_epi8({table});   /* a codebook layout's values, in each 128-bit lane */
  (void)book;
  const __m256i hmask = _mm256_set1_epi16({self.high_mask << 4});   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;{self._kscale_consts()}"""

  def _kscale_consts(self) -> str:
    if not self.spec.k_scales: return ""
    return """
  /* k_scales: output byte i (scales 0-7, then mins 0-7) takes its low bits from byte kfield[i] of the 12 (the low 6 of
     groups 0-3; a nibble of bytes 8-11 for groups 4-7, the high one for mins) and, for groups 4-7 (kupper), its top
     2 bits from the top of byte ktop[i] */
  const __m128i kfield = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
  const __m128i ktop = _mm_setr_epi8(-128, -128, -128, -128, 0, 1, 2, 3, -128, -128, -128, -128, 4, 5, 6, 7);
  const __m128i kupper = _mm_setr_epi8(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1);
  const __m128i khigh = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);"""

  def x_prep(self, x: str) -> str:
    """C statements turning float row `x` into xq (16-bit codes in each run's even/odd order), dx (x's scale per
    unit), xc (-c times each run's lane sums), xg (float sums of x per group) and dxg (x's scale per group)."""
    K, NC, NX, NG, G, XU = self.K, self.NC, self.NX, self.NG, self.G, self.XU
    return f"""{{
    float x16[{K // 16}];
    for (int u = 0; u < {NX}; u++) {{   /* x's scale per unit of {XU} inputs; NaN if one is NaN or infinite */
      __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();   /* bad: the sum of x * 0 (max_ps drops NaNs) */
      for (int j = 0; j < {XU // 8}; j++) {{
        __m256 v = _mm256_loadu_ps({x} + u * {XU} + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, absmask));
        bad = _mm256_fmadd_ps(v, _mm256_setzero_ps(), bad);
      }}
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f) + hsum8(bad);
    }}
    for (int c = 0; c < {NC}; c++) {{   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = {x} + c * 32;
      float d = dx[c * 32 / {XU}];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      {_x16_run("xr", "c * 32")}
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-{self.c}));
    }}
    for (int g = 0; g < {NG}; g++) {{
      float t = 0;
      for (int u = g * {G // 16}; u < (g + 1) * {G // 16}; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * {G} / {XU}];
    }}
  }}"""

  def row_scales(self, gs: str, bsum: str, dxg: str, xg: str, scales8: str, scale1: str) -> str:
    """C statements setting gs[g] (group scale times x's scale) and bsum (the bias term) for one weight row `n` and
    one x row: `scales8` sets __m256 Sv (and Bv) for groups g..g+7, `scale1` float S[0] (and B[0]) for group g."""
    c, NG = self.c, self.NG
    bias8 = "" if self.spec.symmetric else f"bacc = _mm256_fmadd_ps(_mm256_fmadd_ps(Sv, _mm256_set1_ps({c}.0f), Bv), _mm256_loadu_ps({xg} + g), bacc);"
    bias1 = "" if self.spec.symmetric else f"bs = __builtin_fmaf(__builtin_fmaf(S[0], {c}.0f, B[0]), {xg}[g], bs);"
    return f"""{{
        __m256 bacc = _mm256_setzero_ps();
        int g = 0;
        for (; g + 8 <= {NG}; g += 8) {{
          {scales8}
          _mm256_storeu_ps(&{gs}[g], _mm256_mul_ps(Sv, _mm256_loadu_ps({dxg} + g)));
          {bias8}
        }}
        float bs = hsum8(bacc);
        for (; g < {NG}; g++) {{   /* the last groups of a row whose group count is not a multiple of 8 */
          float S[1], B[1]; (void)B;
          {scale1}
          {gs}[g] = S[0] * {dxg}[g];
          {bias1}
        }}
        {bsum} = bs;
      }}"""

  def lanes(self, gs: str) -> str:
    """The float vector of group scales times x's scales for run c's int32 lanes (two runs' in wide mode)."""
    G = self.G
    if self.wide:
      return (f"_mm512_set1_ps({gs}[c * 32 / {G}])" if G >= 64 else
              f"_mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&{gs}[c * 32 / {G}])))")
    return (f"_mm256_broadcast_ss(&{gs}[c * 32 / {G}])" if G >= 32 else
            f"_mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&{gs}[2 * c]))), pair)")

  def wide_consts(self) -> str:
    HB = self.HB
    gidx = ", ".join(str(((j // 8) * 32 + 4 * (j % 8)) // self.G) for j in range(16))
    return f"""
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16({self.high_mask << 4});
    const __m512i gidx = _mm512_setr_epi32({gidx});   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32({", ".join(["0"] * 8 + [str(HB * 0x10001)] * 8)});   /* run c + 1: one more run's shift */
    const __m512i book512 = _mm512_broadcast_i32x4(_mm256_castsi256_si128(book));
    (void)gidx; (void)hbase; (void)hmask512; (void)book512;"""

  def codes(self, wr: str, whr: str) -> str:
    """C statements setting qe and qo to the even and odd codes of run c (wide: runs c and c + 1) of the weight row
    whose nibbles start at `wr` and high bits at `whr`."""
    R, HB = self.R, self.HB
    if self.wide:
      high = f"""
          {{ const __m512i hsv = _mm512_add_epi16(hbase, _mm512_set1_epi16({HB} * (c % {R})));
            __m512i hb = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)({whr} + (c / {R}) * 32))), hsv);
            qe = _mm512_ternarylogic_epi32(qe, _mm512_slli_epi16(hb, 4), hmask512, 0xF8);   /* qe | (hb << 4 & hmask) */
            qo = _mm512_ternarylogic_epi32(qo, _mm512_srli_epi16(hb, 4), hmask512, 0xF8); }}""" if HB else ""
      book = ("\n        qe = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_shuffle_epi8(book512, qe), 8), 8);   /* code -> value */"
              "\n        qo = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_shuffle_epi8(book512, qo), 8), 8);") if self.spec.codebook else ""
      return f"""__m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)({wr} + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);{high}{book}"""
    high = f"""
          {{ __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)({whr} + (c / {R}) * 32)), _mm_cvtsi32_si128({HB} * (c % {R})));
            qe = _mm256_add_epi16(qe, _mm256_and_si256(_mm256_slli_epi16(hb, 4), hmask));
            qo = _mm256_add_epi16(qo, _mm256_and_si256(_mm256_srli_epi16(hb, 4), hmask)); }}""" if HB else ""
    # a codebook's code picks a byte of `book` (the lane's high byte, 0, picks value 0: shifted out), sign-extended
    book = ("\n        qe = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(book, qe), 8), 8);"
            "\n        qo = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(book, qo), 8), 8);") if self.spec.codebook else ""
    return f"""__m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)({wr} + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);{high}{book}"""

  def x_run(self, xq: str, xc: str, i: str = "") -> str:
    """C declarations of x's codes xe{i}, xo{i} and its lane correction x0{i} for run c (wide: runs c, c + 1)."""
    if self.wide:
      return (f"__m512i xe{i} = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)({xq} + c * 32))), _mm256_load_si256((const __m256i *)({xq} + c * 32 + 32)), 1);\n"
              f"      __m512i xo{i} = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)({xq} + c * 32 + 16))), _mm256_load_si256((const __m256i *)({xq} + c * 32 + 48)), 1);\n"
              f"      __m512i x0{i} = _mm512_loadu_si512((const void *)&{xc}[c]);   /* xc[c], xc[c + 1] */")
    return (f"__m256i xe{i} = _mm256_load_si256((const __m256i *)({xq} + c * 32)), xo{i} = _mm256_load_si256((const __m256i *)({xq} + c * 32 + 16));\n"
            f"      __m256i x0{i} = {xc}[c];   /* -c * sum x */")

  def accumulate(self, tot: str, xi: str, gs: str) -> str:
    """tot += run c's (wide: runs c and c + 1's) products of qe, qo with x row `xi`'s codes, times its scales."""
    if self.wide:
      return (f"{{ __m512i a = TV_DPWSSD512(TV_DPWSSD512(x0{xi}, qe, xe{xi}), qo, xo{xi});\n"
              f"          {tot} = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), {self.lanes(gs)}, {tot}); }}")
    return (f"{{ __m256i a = TV_DPWSSD(TV_DPWSSD(x0{xi}, qe, xe{xi}), qo, xo{xi});\n"
            f"          {tot} = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), {self.lanes(gs)}, {tot}); }}")

  @property
  def vec(self) -> str: return "__m512" if self.wide else "__m256"

  @property
  def zero(self) -> str: return "_mm512_setzero_ps()" if self.wide else "_mm256_setzero_ps()"

  @property
  def hsum(self) -> str: return "_mm512_reduce_add_ps" if self.wide else "hsum8"

  @property
  def step(self) -> int: return 2 if self.wide else 1

  def x_arrays(self) -> str:
    """Declarations of the GEMV's prepared x arrays (x_prep fills them)."""
    K, NX, NG, NC = self.K, self.NX, self.NG, self.NC
    return f"short xq[{K}] __attribute__((aligned(32)));\n  float dx[{NX}], dxg[{NG}], xg[{NG}];\n  __m256i xc[{NC}];"


def _prefetches(RW: int, R: int, HB: int) -> str:
  """C statements a GEMV runs per weight row r and step c: prefetch the same place (run c's nibbles, its block of high
  bits) of a row some tiles on. Rows of RW words, 4-row tiles, R runs per block of HB-bit high bits (HB = 0: none).
  The distance is whole tiles, at least 8 KiB.
  One tile ahead is too close for short rows (a K = 2048 Q4_K tile is 4 KiB, read in about the memory's latency):
  8-16 KiB ahead ran 2048-wide Q4_K and Q6_K GEMVs from memory 9-19 % faster on two threads; a 2048-wide 512-row
  matrix (a k or v projection) loses a little beyond 8 KiB (its threads' last prefetches fall past their rows).
  The prefetches are non-temporal (_MM_HINT_NTA): a weight is read once a step, and streaming a model's weights
  through the caches evicts what is read again (activations, the KV cache, scales): alone a GEMV runs as fast
  either way, and a 1B model's decode step 1.05-1.06x as fast with them (two engines alternated in one process);
  an 8B's no differently."""
  tile = 4 * RW * 4
  PF = -(-8192 // tile) * tile
  return (f"_mm_prefetch((const char *)(wr[r] + {PF}) + c * 16, _MM_HINT_NTA);" +
          (f" if (c % {R} == 0) _mm_prefetch((const char *)(whr[r] + {PF}) + (c / {R}) * 32, _MM_HINT_NTA);" if HB else ""))


def _packed_gemv_body(N: int, K: int, spec, wide: bool = False) -> str:
  """M == 1 (_PackedInt): four weight rows at a time, each row's codes unpacked as the loop reaches them."""
  P = _PackedInt(N, K, spec, wide)
  RW, HB, R, NG = P.RW, P.HB, P.R, P.NG
  prefetch = _prefetches(RW, R, HB)
  return f"""{P.consts()}
  {P.x_arrays()}
  {P.x_prep("x")}
  for (int n0 = nb; n0 < ne; n0 += 4) {{
    float gs[4][{NG + 4}] __attribute__((aligned(32))), bsum[4];   /* group scale times x's scale (+4: wide's loads) */
    const unsigned char *wr[4], *whr[4]; (void)whr;
    for (int r = 0; r < 4; r++) {{
      long n = n0 + r < {N} ? n0 + r : {N} - 1;   /* past the last row: recompute it, store nothing */
      wr[r] = (const unsigned char *)(w + n * {RW});
      whr[r] = wr[r] + {K // 2};
      {P.row_scales("gs[r]", "bsum[r]", "dxg", "xg", _packed_scales8(spec, K), _packed_scale(spec, K, "S[0]", "B[0]"))}
    }}
    {P.wide_consts() if wide else ""}
    {P.vec} tot[4] = {{{", ".join([P.zero] * 4)}}};
    for (int c = 0; c < {P.NC}; c += {P.step}) {{
      {P.x_run("xq", "xc")}
      for (int r = 0; r < 4; r++) {{
        {prefetch}
        {P.codes("wr[r]", "whr[r]")}
        {P.accumulate("tot[r]", "", "gs[r]")}
      }}
    }}
    for (int r = 0; r < 4 && n0 + r < {N}; r++) y[n0 + r] = {P.hsum}(tot[r]) + bsum[r];
  }}"""


# Bytes of prepared x rows a GEMM keeps per chunk, on the stack of the thread running it: the pool's workers have
# 8 MiB, but part 0 runs on the calling thread, a Python thread whose stack may be glibc's 2 MiB, so a GEMM's frame
# stays under about 1 MiB (tests/test_packed_kernels.py checks the frames). Every chunk reads the weights again, so a
# chunk should hold many rows: the k-quant GEMM's x takes 2 bytes an input (3 in _PackedInt's), and 768 KiB of it
# ran 128 rows of 14336 inputs 1.3-1.4x as fast as 384 KiB (Q4_K, Q6_K), 16 rows 1.4-1.5x (one chunk, not two).
X_CHUNK = 3 << 17
KQUANT_X_CHUNK = 3 << 18


def _packed_gemm_body(M: int, N: int, K: int, spec, wide: bool, ys: int) -> str:
  """M > 1 with exactly the GEMV's arithmetic on every row (_PackedInt), so a row's result does not depend on how
  many rows share the call (batch invariance, bitwise), and the integer products of 16-bit codes do twice the work of
  float FMAs per instruction (1.7-3x the dequantize-to-float GEMM this replaced, measured at M = 2..128). x rows go in
  chunks (at most ~384 KiB of them, prepared as the GEMV prepares its one). A tile of 4 weight rows has its scales
  converted once per chunk and its codes unpacked to 16-bit lanes (in the order the GEMV's registers hold them) one
  slice of 64 runs at a time, so the slice stays in L1 while the chunk's rows pass over it two at a time, sharing
  each load of codes; a row's sums carry over from slice to slice in the GEMV's order."""
  P = _PackedInt(N, K, spec, wide)
  RW, NG, NC, step = P.RW, P.NG, P.NC, P.step
  XR = max(2, min(64, M, X_CHUNK // (3 * K)))   # x rows per chunk
  KS = min(NC, 64)   # runs per slice
  XB = 2             # x rows per register block (3 and 4 measured slower: registers run out)
  vw = 32 * step     # 16-bit codes per register
  bias_term = "bsum[m - c0][r] = 0;" if spec.symmetric else f"""__m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= {NG}; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < {NG}; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;"""
  load = "_mm512_load_si512((const void *)" if wide else "_mm256_load_si256((const __m256i *)"
  store = "_mm512_store_si512((void *)" if wide else "_mm256_store_si256((__m256i *)"
  return f"""{P.consts()}
  short xqs[{XR}][{K + 32}] __attribute__((aligned(64)));
  float dxs[{XR}][{P.NX}], dxgs[{XR}][{NG}], xgs[{XR}][{NG}];
  __m256i xcs[{XR}][{NC}];
  short qw[4][{KS * 32 + 32}] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][{NG}], sbc[4][{NG}]; (void)sbc;
  float gs[{XR}][4][{NG + 4}] __attribute__((aligned(32))), bsum[{XR}][4];   /* per x row and weight row */
  {P.vec} sums[{XR}][4];   /* each row's sums between slices */
  {P.wide_consts() if wide else ""}
  for (int c0 = 0; c0 < {M}; c0 += {XR}) {{
    int mend = c0 + {XR} < {M} ? c0 + {XR} : {M};
    for (int m = c0; m < mend; m++) {{   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {P.x_prep(f"(x + (long)m * {K})")}
    }}
    for (int n0 = nb; n0 < ne; n0 += 4) {{
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {{   /* the tile's scales, once per chunk */
        long n = n0 + r < {N} ? n0 + r : {N} - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * {RW});
        whr[r] = wr[r] + {K // 2};
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= {NG}; g += 8) {{
          {_packed_scales8(spec, K)}
          _mm256_storeu_ps(&sf[r][g], Sv);{"" if spec.symmetric else f" _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps({P.c}.0f), Bv));"}
        }}
        for (; g < {NG}; g++) {{
          float S[1], B[1]; (void)B;
          {_packed_scale(spec, K, "S[0]", "B[0]")}
          sf[r][g] = S[0];{"" if spec.symmetric else f" sbc[r][g] = __builtin_fmaf(S[0], {P.c}.0f, B[0]);"}
        }}
      }}
      /* gs and bsum per x row: row_scales' arithmetic on the tile's stored scales and B + c S (row_scales itself, fed
         the stored scales, measured 4-7 % slower on Q6_K at M = 64) */
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {{
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= {NG}; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < {NG}; g++) gsr[g] = sf[r][g] * dxg[g];
        {bias_term}
        sums[m - c0][r] = {P.zero};
      }}
      for (int cs = 0; cs < {NC}; cs += {KS}) {{
        const int ce = cs + {KS} < {NC} ? cs + {KS} : {NC};
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += {step}) {{   /* the slice's codes */
          {P.codes("wr[r]", "whr[r]")}
          {store}&qw[r][(c - cs) * 32], qe);
          {store}&qw[r][(c - cs) * 32 + {vw // 2}], qo);
        }}
        for (int m = c0; m < mend; m += {XB}) {{   /* {XB} rows at a time share each load of the codes */
          {" ".join(f"const int i{k} = (m + {k} < mend ? m + {k} : mend - 1) - c0;" for k in range(XB))}   /* past the last row: computed again, stored once */
          {" ".join(f"const short *xq{k} = xqs[i{k}]; const __m256i *xc{k} = xcs[i{k}];" for k in range(XB))}
          {P.vec} tot[{XB}][4] = {{{", ".join(f"{{sums[i{k}][0], sums[i{k}][1], sums[i{k}][2], sums[i{k}][3]}}" for k in range(XB))}}};
          for (int c = cs; c < ce; c += {step}) {{
            {"".join(P.x_run(f"xq{k}", f"xc{k}", str(k)) + chr(10) + "            " for k in range(XB))}
            for (int r = 0; r < 4; r++) {{
              {"__m512i" if wide else "__m256i"} qe = {load}&qw[r][(c - cs) * 32]), qo = {load}&qw[r][(c - cs) * 32 + {vw // 2}]);
              {"".join(P.accumulate(f"tot[{k}][r]", str(k), f"gs[i{k}][r]") + chr(10) + "              " for k in range(XB))}
            }}
          }}
          for (int r = 0; r < 4; r++) {{ {" ".join(f"sums[i{k}][r] = tot[{k}][r];" for k in range(XB - 1, -1, -1))} }}
        }}
      }}
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < {N}; r++) y[(long)m * {ys} + n0 + r] = {P.hsum}(sums[m - c0][r]) + bsum[m - c0][r];
    }}
  }}"""


# **** k-quant layouts on AVX-512 VBMI: the integer scales go into the integer products ****

def _kquant_centre(spec) -> int:
  """The code _KQuantInt takes codes from: a symmetric layout's offset; an affine one's 0 when a super-block's
  products sum in int32 uncentred (16 per int32 lane, each at most (2^b - 1) * 255 * 32767), else 2^(b-1)."""
  if spec.symmetric: return spec.offset
  return 0 if 16 * ((1 << spec.bits) - 1) * 255 * 32767 < 2 ** 31 else 1 << (spec.bits - 1)


def _kquant_int(K: int, spec) -> bool:
  """Whether _KQuantInt computes this layout: a GGUF k-quant's two-level scales (Q4_K and Q5_K: affine, groups of 32;
  Q6_K and Q3_K: symmetric, groups of 16; not IQ4_XS, whose codebook values times its scales could overflow int32
  within a super-block) over whole super-blocks of 256 inputs."""
  return (bool(spec.super_groups) and not spec.codebook and spec.group == (16 if spec.symmetric else 32)
          and spec.group * spec.super_groups == 256 and K % 256 == 0)


SCALE_AHEAD = 16   # rows: four 4-row tiles


class _KQuantInt:
  """C fragments of the k-quant layouts' products on CPUs with AVX-512 VBMI (Zen 4 and 5, Ice Lake and later). A
  k-quant's group scale is a small integer under a float16 d per super-block of 256 inputs, so it can join the
  integer products: each code (taken from a centre c) times its group's integer scale is a 16-bit number (vpmullw),
  its products with x's 16-bit codes sum in int32 over the whole super-block (exact: at most 16 products per int32
  lane, bounded in _kquant_centre; Q6_K's 32 * 128 * 32767 * 16 just fits), and floats enter once per super-block
  (d times x's scale) instead of once per run of 32 (_PackedInt's convert, scale permute and FMA per run): 1.3x
  _PackedInt's speed on a Q4_K GEMV from cache. x is rounded to 16 bits per super-block (one scale per 256 inputs).

  A step takes two runs (64 inputs). Its 32 bytes of nibbles are spread by one vpermb so that 16-bit word 4m + k holds
  byte m + 8 (k & 1) of run c + (k >> 1) (a byte holds inputs 2i and 2i + 1 in its two nibbles): word k of every
  64-bit lane then comes from one half run of 16 inputs, so the step's four half-run scales are one broadcast
  quadword, and x's codes are stored in the same word order (even inputs in xe, odd in xo). A run's high bits (Q5_K,
  Q6_K) come from word m + 8 (k & 1) of its 32-byte block (vpermw), shifted by the run's place in the block.

  Per weight row, `weight_prep` converts the scales once (the integer scale of every half run, d per super-block,
  and for affine layouts the float factor f = B + c S of each group); per weight row and x row, `x_terms` gives d
  times x's scale per super-block and the bias term sum_g f_g xg_g (x's float sums per group), 16 groups per vector
  FMA. The GEMV and GEMM run the same operations in the same order on every row (batch invariance)."""
  def __init__(self, N: int, K: int, spec):
    self.N, self.K, self.spec = N, K, spec
    self.NC, self.NG, self.NSB, self.HB = K // 32, K // spec.group, K // 256, spec.bits - 4
    self.RW, self.R, self.high_mask = _row_words(K, spec)
    self.c = _kquant_centre(spec)
    span, smax = max(self.c, (1 << spec.bits) - 1 - self.c), 128 if spec.signed_scales else 255
    assert span * smax <= 32767 and 16 * span * smax * 32767 < 2 ** 31, f"{spec}: products overflow"
    self.NP = 2 * self.NSB if not spec.symmetric else self.NSB   # float16s of d (and dmin) per row
    self.NV = -(-self.NP // 16)                                   # vectors of them
    self.GW = -(-self.NG // 16) * 16 + 16     # floats per row of f and xg: whole vectors, then one of zeros
    self.SW = -(-(K // 16) // 32) * 32 + 32   # int16s per row of s16: whole 64-byte lines

  @staticmethod
  def _set(fn: str, values) -> str:
    """_mm512_set_* of `values` given in memory order (lane 0 first)."""
    return f"{fn}({', '.join(str(v) for v in reversed(list(values)))})"

  def consts(self) -> str:
    words = range(32)
    run, byte = [(j & 3) >> 1 for j in words], [(j >> 2) + 8 * (j & 1) for j in words]   # word j's run (0, 1) and byte
    return f"""
  const __m512i nib = _mm512_set1_epi16(15), hmask = _mm512_set1_epi16({self.high_mask << 4}), centre = _mm512_set1_epi16({self.c});
  const __m512i spread = {self._set("_mm512_set_epi8", [16 * run[i // 2] + byte[i // 2] for i in range(64)])};   /* nibble byte -> word (low byte) */
  const __m512i hword = {self._set("_mm512_set_epi16", byte)};   /* a word's high bits: this word of the block */
  const __m512i hrun = {self._set("_mm512_set_epi16", [self.HB * r for r in run])};   /* the shift of run c + 1's field */
  const __m512i xeven = {self._set("_mm512_set_epi16", [32 * r + 2 * b for r, b in zip(run, byte)])};   /* x input of word j */
  const __m512i xodd = _mm512_add_epi16(xeven, _mm512_set1_epi16(1));
  const __m512i sdup = {self._set("_mm512_set_epi8", [2 * (i // 4) for i in range(64)])};   /* (scale, min) pair g's scale -> words 2g, 2g + 1 */
  const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), midx = _mm512_add_epi32(didx, _mm512_set1_epi32(1));
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  {self._kscale_consts()}
  (void)hmask; (void)centre; (void)hword; (void)hrun; (void)sdup; (void)didx; (void)midx; (void)evens;"""

  def _kscale_consts(self) -> str:
    """k_scales: byte 2j (2j + 1) of a super-block's 16 takes group j's scale (min) from byte kfield of its 12 (the low
    6 bits for j < 4; a nibble of bytes 8-11 for j >= 4, the high one for a min: kmins) and, for j >= 4 (kupper), its
    top 2 bits from the top of byte ktop. Two super-blocks a 256-bit vector."""
    if not self.spec.k_scales: return ""
    field, top, upper, mins = [], [], 0, 0
    for o in range(32):
      base, j, is_min = 12 * (o // 16), (o % 16) // 2, o % 2
      field.append(base + (j + 4 if is_min or j >= 4 else j))
      top.append(base + (j if is_min else j - 4) if j >= 4 else 0)
      if j >= 4: upper |= 1 << o
      if j >= 4 and is_min: mins |= 1 << o
    return (f"const __m256i kfield = {self._set('_mm256_set_epi8', field)}, ktop = {self._set('_mm256_set_epi8', top)};\n"
            f"  const __mmask32 kupper = {upper:#x}u, kmins = {mins:#x}u;")

  def x_arrays(self, rows: str = "") -> str:
    """Declarations of the prepared x (per x row when `rows` is a C dimension such as "[8]")."""
    return f"short xq{rows}[{self.K}] __attribute__((aligned(64)));\n  float dx{rows}[{self.NSB}], xg{rows}[{self.GW}];"

  def x_prep(self, x: str, xq: str = "xq", dx: str = "dx", xg: str = "xg") -> str:
    """C statements filling xq (x's 16-bit codes in the steps' word order), dx (x's scale per super-block) and xg
    (float sums per group, 0 past the last) from float row `x`."""
    NG, G = self.NG, self.spec.group
    pair = f" + _mm512_loadu_ps({x} + 32 * g + 16)" if G == 32 else ""
    return f"""{{
    for (int u = 0; u < {self.NSB}; u++) {{   /* x's scale per super-block; NaN if one is NaN or infinite */
      __m512 amax = _mm512_setzero_ps(), bad = _mm512_setzero_ps();   /* bad: the sum of x * 0 (max_ps drops NaNs) */
      for (int j = 0; j < 16; j++) {{
        __m512 v = _mm512_loadu_ps({x} + u * 256 + 16 * j);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        bad = _mm512_fmadd_ps(v, _mm512_setzero_ps(), bad);
      }}
      {dx}[u] = _mm512_reduce_max_ps(amax) * (1.0f / 32767.0f) + _mm512_reduce_add_ps(bad);
    }}
    for (int c = 0; c < {self.NC}; c += 2) {{   /* a step's 64 inputs to 16 bits, in its word order */
      float d = {dx}[c / 8];
      __m512 inv = _mm512_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      __m256i h[4];
      for (int j = 0; j < 4; j++) h[j] = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps({x} + c * 32 + 16 * j), inv)));
      __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1), hi = _mm512_inserti64x4(_mm512_castsi256_si512(h[2]), h[3], 1);
      _mm512_store_si512((void *)({xq} + c * 32), _mm512_permutex2var_epi16(lo, xeven, hi));
      _mm512_store_si512((void *)({xq} + c * 32 + 32), _mm512_permutex2var_epi16(lo, xodd, hi));
    }}
    for (int g = 0; g < {NG}; g++) {xg}[g] = _mm512_reduce_add_ps(_mm512_loadu_ps({x} + {G} * g){pair});
    for (int g = {NG}; g < {self.GW}; g++) {xg}[g] = 0;
  }}"""

  def weight_prep(self, s16: str, f: str, d: str) -> str:
    """C statements converting weight row `n`'s scales: s16 (int16 [K/16]: each half run's integer scale), d (float
    [NSB]: each super-block's d) and, affine, f (float [NG + 16]: each group's B + c S, 0 past the last)."""
    spec, NG, NSB, NP, NV, c = self.spec, self.NG, self.NSB, self.NP, self.NV, self.c
    mask = lambda left: f"({left} >= 16 ? 0xFFFF : (__mmask16)((1u << ({left})) - 1))"
    # the scales of the row SCALE_AHEAD rows on, each line of them: read with masked loads, a tile's scales otherwise
    # came from memory while its codes streamed in (the 6-bit k_scales GEMV from memory took up to 1.31x as long)
    later, row_bytes = f"(n + {SCALE_AHEAD} < {self.N} ? n + {SCALE_AHEAD} : n)", 12 * NSB if spec.k_scales else NG if spec.symmetric else 2 * NG
    lines = lambda n: [*range(0, n - 1, 64), n - 1]   # a row need not start on a line: its last byte's line too
    prefetch = " ".join([*(f"_mm_prefetch((const char *)s + {later} * {row_bytes} + {o}, _MM_HINT_T0);" for o in lines(row_bytes)),
                         *(f"_mm_prefetch((const char *)sd + {later} * {2 * NP} + {o}, _MM_HINT_T0);" for o in lines(2 * NP))])
    load_d = f"""{prefetch}
        __m512 dm[{NV + 1}];   /* the row's float16 d (dmin) as floats, in registers (0 past the last) */
        for (int i = 0; i < {NV}; i++) dm[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16({mask(f"{NP} - 16 * i")}, sd + (long)n * {NP} + 16 * i));
        dm[{NV}] = _mm512_setzero_ps();"""
    if spec.symmetric:   # one int8 scale per group of 16 (a half run)
      return f"""{{
        for (int g = 0; g < {NG}; g += 32)   /* (an odd number of super-blocks ends in 16) */
          _mm512_store_si512((void *)({s16} + g), _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8({NG} - g >= 32 ? 0xFFFFFFFFu : 0xFFFFu, s + (long)n * {NG} + g)));
        {load_d}
        for (int u = 0; u < {NSB}; u += 16) _mm512_storeu_ps({d} + u, dm[u / 16]);
      }}"""
    # affine, groups of 32: (scale, min) byte pairs, (d, dmin) float16 pairs; two super-blocks (16 groups) a step
    bias = ("_mm512_mul_ps(dmin, mf)" if not c else
            f"_mm512_fmsub_ps(_mm512_mul_ps(dg, _mm512_cvtepi32_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(255)))), _mm512_set1_ps({c}.0f), _mm512_mul_ps(dmin, mf))")
    if spec.k_scales:   # two super-blocks' 24 bytes of 6-bit fields -> their 16 (scale, min) byte pairs (kfield, ktop: consts)
      pairs = f"""__m256i v_ = _mm256_maskz_loadu_epi8({NG} - g >= 16 ? 0xFFFFFFu : 0xFFFu, sr + 12 * (g / 8));   /* an odd last super-block: 12 bytes */
          __m256i a_ = _mm256_permutexvar_epi8(kfield, v_), t_ = _mm256_and_si256(_mm256_srli_epi16(_mm256_maskz_permutexvar_epi8(kupper, ktop, v_), 2), _mm256_set1_epi8(0x30));
          __m256i sm = _mm256_mask_blend_epi8(kupper, _mm256_and_si256(a_, _mm256_set1_epi8(63)),
                                              _mm256_or_si256(_mm256_and_si256(_mm256_mask_blend_epi8(kmins, a_, _mm256_srli_epi16(a_, 4)), _mm256_set1_epi8(15)), t_));"""
      row = f"(const unsigned char *)s + 12 * (long)n * {NSB}"
    else:
      pairs = f"__m256i sm = _mm256_maskz_loadu_epi8({NG} - g >= 16 ? 0xFFFFFFFFu : 0xFFFFu, sr + 2 * g);   /* an odd last super-block: 8 groups */"
      row = f"(const unsigned char *)s + 2 * (long)n * {NG}"
    return f"""{{
        const unsigned char *sr = {row};
        {load_d}
        for (int g = 0; g < {NG}; g += 16) {{
          {pairs}
          _mm512_store_si512((void *)({s16} + 2 * g), _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, sdup, _mm512_castsi256_si512(sm)));
          __m512i pairs = _mm512_cvtepu16_epi32(sm), at = _mm512_set1_epi32((g / 4) % 16);   /* super-block g / 8's d: float g / 4 */
          {"__m512 dg = _mm512_permutex2var_ps(dm[g / 64], _mm512_add_epi32(didx, at), dm[g / 64 + 1]);" if c else ""}
          __m512 dmin = _mm512_permutex2var_ps(dm[g / 64], _mm512_add_epi32(midx, at), dm[g / 64 + 1]);
          __m512 mf = _mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 8));
          _mm512_storeu_ps({f} + g, {bias});   /* {"dmin m = -B" if not c else "c S + B"} */
        }}
        for (int u = 0; u < {NSB}; u += 16) _mm512_storeu_ps({d} + u, _mm512_permutex2var_ps(dm[u / 8], evens, dm[u / 8 + 1]));
        for (int g = {NG}; g < {self.GW}; g++) {f}[g] = 0;
      }}"""

  def x_terms(self, f: str, d: str, dd: str, bsum: str, dx: str = "dx", xg: str = "xg") -> str:
    """C statements setting dd (float [NSB]: d times x's scale per super-block) and bsum (the bias term) for one
    weight row (its `f`, `d` from weight_prep) and one x row (its `dx`, `xg`)."""
    NSB, NG = self.NSB, self.NG
    dd_loop = f"for (int u = 0; u < {NSB}; u++) {dd}[u] = {d}[u] * {dx}[u];"
    if self.spec.symmetric: return f"{dd_loop} {bsum} = 0;"
    acc = "_mm512_fnmadd_ps" if not self.c else "_mm512_fmadd_ps"
    return f"""{dd_loop}
      {{ __m512 bacc = _mm512_setzero_ps();
        for (int g = 0; g < {NG}; g += 16) bacc = {acc}(_mm512_loadu_ps({f} + g), _mm512_loadu_ps({xg} + g), bacc);
        {bsum} = _mm512_reduce_add_ps(bacc); }}"""

  def codes(self, wr: str, whr: str, s16: str) -> str:
    """C statements setting qe and qo to the step's even and odd codes (runs c and c + 1 of the row whose nibbles
    start at `wr`, high bits at `whr`), taken from the centre and times their half runs' integer scales (the row's
    `s16` table: the step's four are one quadword)."""
    HB, R = self.HB, self.R
    high = f"""
        {{ __m512i hb = _mm512_permutexvar_epi16(hword, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)({whr} + (c / {R}) * 32))));
          hb = _mm512_srlv_epi16(hb, _mm512_add_epi16(hrun, _mm512_set1_epi16({HB} * (c % {R}))));
          qe = _mm512_ternarylogic_epi32(qe, _mm512_slli_epi16(hb, 4), hmask, 0xF8);   /* qe | (hb << 4 & hmask) */
          qo = _mm512_ternarylogic_epi32(qo, _mm512_srli_epi16(hb, 4), hmask, 0xF8); }}""" if HB else ""
    centre = "\n        qe = _mm512_sub_epi16(qe, centre); qo = _mm512_sub_epi16(qo, centre);" if self.c else ""
    return f"""__m512i v = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, spread, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)({wr} + c * 16))));
        __m512i qe = _mm512_and_si512(v, nib), qo = _mm512_srli_epi16(v, 4);{high}{centre}
        const __m512i sv = _mm512_set1_epi64(*(const long long *)&{s16}[2 * c]);
        qe = _mm512_mullo_epi16(qe, sv); qo = _mm512_mullo_epi16(qo, sv);"""

  def tile_arrays(self) -> str:
    """Per 4-row tile: the rows' converted scales."""
    return (f"short s16[4][{self.SW}] __attribute__((aligned(64)));\n"
            f"  float fw[4][{self.GW}], dw[4][{-(-self.NSB // 16) * 16}]; (void)fw;")

  def tile_prep(self, N: int) -> str:
    """C statements pointing wr/whr at the tile's rows and converting their scales (weight_prep)."""
    return f"""for (int r = 0; r < 4; r++) {{
      long n = n0 + r < {N} ? n0 + r : {N} - 1;   /* past the last row: recompute it, store nothing */
      wr[r] = (const unsigned char *)(w + n * {self.RW});
      whr[r] = wr[r] + {self.K // 2};
      {self.weight_prep("s16[r]", "fw[r]", "dw[r]")}
    }}"""


def _kquant_gemv_body(N: int, K: int, spec) -> str:
  """M == 1 (_KQuantInt): four weight rows at a time; per super-block an int32 sum per row (two chains: vpdpwssd's
  latency), then one FMA of it times d and x's scale."""
  P = _KQuantInt(N, K, spec)
  prefetch = _prefetches(P.RW, P.R, P.HB)
  zeros = ", ".join(["_mm512_setzero_si512()"] * 4)
  return f"""{P.consts()}
  {P.x_arrays()}
  {P.x_prep("x")}
  {P.tile_arrays()}
  float dd[4][{P.NSB}], bsum[4];
  for (int n0 = nb; n0 < ne; n0 += 4) {{
    const unsigned char *wr[4], *whr[4]; (void)whr;
    {P.tile_prep(N)}
    for (int r = 0; r < 4; r++) {{ {P.x_terms("fw[r]", "dw[r]", "dd[r]", "bsum[r]")} }}
    __m512 tot[4] = {{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}};
    for (int u = 0; u < {P.NSB}; u++) {{
      __m512i ae[4] = {{{zeros}}}, ao[4] = {{{zeros}}};
      for (int c = 8 * u; c < 8 * u + 8; c += 2) {{
        __m512i xe = _mm512_load_si512((const void *)(xq + c * 32)), xo = _mm512_load_si512((const void *)(xq + c * 32 + 32));
        for (int r = 0; r < 4; r++) {{
          {prefetch}
          {P.codes("wr[r]", "whr[r]", "s16[r]")}
          ae[r] = TV_DPWSSD512(ae[r], qe, xe); ao[r] = TV_DPWSSD512(ao[r], qo, xo);
        }}
      }}
      for (int r = 0; r < 4; r++) tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ae[r], ao[r])), _mm512_set1_ps(dd[r][u]), tot[r]);
    }}
    for (int r = 0; r < 4 && n0 + r < {N}; r++) y[n0 + r] = _mm512_reduce_add_ps(tot[r]) + bsum[r];
  }}"""


def _kquant_gemm_body(M: int, N: int, K: int, spec, ys: int) -> str:
  """M > 1 with the GEMV's arithmetic on every row (_KQuantInt; bitwise batch invariance). x rows go in chunks, each
  prepared as the GEMV prepares its one; a tile of 4 weight rows has its scales converted once per chunk and its
  codes (times their integer scales) unpacked one slice of 64 runs at a time, kept in L1 while the chunk's rows pass
  over it two at a time. A row's float sums carry over from slice to slice in the GEMV's order (slices end at
  super-blocks)."""
  P = _KQuantInt(N, K, spec)
  NC, NSB = P.NC, P.NSB
  XR = max(2, min(64, M, KQUANT_X_CHUNK // (2 * K)))   # x rows per chunk
  KS = min(NC, 64)   # runs per slice (8 super-blocks)
  return f"""{P.consts()}
  {P.x_arrays(f"[{XR}]")}
  {P.tile_arrays()}
  short qw[4][{KS * 32}] __attribute__((aligned(64)));   /* a slice's scaled codes; per step its even codes, then its odd */
  float dd[{XR}][4][{NSB}], bsum[{XR}][4];
  __m512 sums[{XR}][4];   /* each row's float sums between slices */
  for (int c0 = 0; c0 < {M}; c0 += {XR}) {{
    int mend = c0 + {XR} < {M} ? c0 + {XR} : {M};
    for (int m = c0; m < mend; m++) {P.x_prep(f"(x + (long)m * {K})", "xq[m - c0]", "dx[m - c0]", "xg[m - c0]")}
    for (int n0 = nb; n0 < ne; n0 += 4) {{
      const unsigned char *wr[4], *whr[4]; (void)whr;
      {P.tile_prep(N)}
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {{
        {P.x_terms("fw[r]", "dw[r]", "dd[m - c0][r]", "bsum[m - c0][r]", "dx[m - c0]", "xg[m - c0]")}
        sums[m - c0][r] = _mm512_setzero_ps();
      }}
      for (int cs = 0; cs < {NC}; cs += {KS}) {{
        const int ce = cs + {KS} < {NC} ? cs + {KS} : {NC};
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {{   /* the slice's codes */
          {P.codes("wr[r]", "whr[r]", "s16[r]")}
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }}
        for (int m = c0; m < mend; m += 2) {{   /* two rows at a time share each load of the codes */
          const int i0 = m - c0, i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          __m512 t0[4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}}, t1[4] = {{sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int u = cs / 8; u < ce / 8; u++) {{
            __m512i a0[4], a1[4];
            for (int r = 0; r < 4; r++) a0[r] = a1[r] = _mm512_setzero_si512();
            for (int c = 8 * u; c < 8 * u + 8; c += 2) {{
              const __m512i xe0 = _mm512_load_si512((const void *)(xq[i0] + c * 32)), xo0 = _mm512_load_si512((const void *)(xq[i0] + c * 32 + 32));
              const __m512i xe1 = _mm512_load_si512((const void *)(xq[i1] + c * 32)), xo1 = _mm512_load_si512((const void *)(xq[i1] + c * 32 + 32));
              for (int r = 0; r < 4; r++) {{
                const __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
                a0[r] = TV_DPWSSD512(TV_DPWSSD512(a0[r], qe, xe0), qo, xo0);
                a1[r] = TV_DPWSSD512(TV_DPWSSD512(a1[r], qe, xe1), qo, xo1);
              }}
            }}
            for (int r = 0; r < 4; r++) {{
              t0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_set1_ps(dd[i0][r][u]), t0[r]);
              t1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), _mm512_set1_ps(dd[i1][r][u]), t1[r]);
            }}
          }}
          for (int r = 0; r < 4; r++) {{ sums[i1][r] = t1[r]; sums[i0][r] = t0[r]; }}
        }}
      }}
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < {N}; r++) y[(long)m * {ys} + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }}
  }}"""


def _packed_fallback_body(M: int, N: int, K: int, spec, ys: int | None = None) -> str:
  """Plain C (CPUs without AVX2): each weight dequantized as quant/blocks.py does, one dot product per output."""
  ys = ys or N
  HB, G = spec.bits - 4, spec.group
  RW, R, high_mask = _row_words(K, spec)
  high = f"""{{ int run = k / 32;
          const unsigned char *hb = (const unsigned char *)(w + (long)n * {RW} + {K // 8});
          q |= ((hb[(run / {R}) * 32 + k % 32] >> ({HB} * (run % {R}))) & {high_mask}u) << 4; }}""" if HB else ""
  value = f"S[k / {G}] * (float)book[q]" if spec.codebook else \
    f"S[k / {G}] * ((float)q - {spec.offset}.0f)" if spec.symmetric else f"S[k / {G}] * (float)q + B[k / {G}]"
  return f"""
  const signed char book[16] = {{{", ".join(map(str, CODEBOOK))}}}; (void)book;
  float S[{K // G}], B[{K // G}]; (void)B;
  for (int n = nb; n < ne; n++) {{
    {_packed_scales(spec, K)}
    for (int m = 0; m < {M}; m++) {{
      float t_ = 0;
      for (int k = 0; k < {K}; k++) {{
        unsigned q = (w[(long)n * {RW} + k / 8] >> (4 * (k % 8))) & 15u;
        {high}
        t_ += x[(long)m * {K} + k] * ({value});
      }}
      y[(long)m * {ys} + n] = t_;
    }}
  }}"""


def packed_body(M: int, N: int, K: int, spec, ys: int | None = None) -> str:
  """The packed linear's body for M rows, AVX2 and plain C branches; output rows of stride `ys` (default N). Each
  branch computes a row the same way for any M, so results are bitwise batch invariant."""
  body = (lambda wide: _packed_gemv_body(N, K, spec, wide)) if M == 1 else (lambda wide: _packed_gemm_body(M, N, K, spec, wide, ys or N))
  avx2 = f"#ifdef TV_AVX512\n{body(True)}\n#else\n{body(False)}\n#endif" if (K // 32) % 2 == 0 else body(False)
  if _kquant_int(K, spec):
    kquant = _kquant_gemv_body(N, K, spec) if M == 1 else _kquant_gemm_body(M, N, K, spec, ys or N)
    avx2 = f"#if defined(TV_AVX512) && defined(__AVX512VBMI__) && defined(__AVX512VL__)\n{kquant}\n#else\n{avx2}\n#endif"
  return f"#ifdef TV_AVX2\n{avx2}\n#else\n{_packed_fallback_body(M, N, K, spec, ys)}\n#endif"


def packed_linear_kernel(M: int, N: int, K: int, spec) -> tuple[str, str]:
  """(name, source) of the packed linear for these sizes and layout: args y, x, the layout's arrays, pool."""
  if K % 32 or K % spec.group: raise ValueError(f"packed linear of K={K} inputs: the kernels take whole runs of 32 and groups of {spec.group}")
  tag = f"{spec.bits}_{spec.group}_{spec.super_groups}{'s' if spec.signed_scales else 'u'}{'y' if spec.symmetric else 'a'}{'c' if spec.codebook else ''}{'k' if spec.k_scales else ''}"
  name = f"packed_linear_{M}_{N}_{K}_{tag}"
  src = row_parallel_kernel(name, ["float *restrict y", "const float *restrict x"] + _packed_params(spec), N,
                            packed_body(M, N, K, spec), _AVX2_DECLS, _AVX2_DEFS)
  return name, src


def packed_linear(x: Tensor, w, pool: Tensor | None = None) -> Tensor:
  """x `[M, K]` float32 @ W^T on the CPU device, W a packed linear (quant/blocks.py; `w` a LinearWeights)."""
  (M, K), N = x.shape, w.weight.shape[0]
  if K % 32 or w.in_features != K: raise ValueError(f"packed weight {w.weight.shape} does not match x {x.shape}")
  out = Tensor.invalids(M, N, dtype=dtypes.float32, device=x.device)
  parts = [t.contiguous() for t in (w.weight, w.scales, w.scale_d, w.biases) if t is not None]
  return run_kernel(packed_linear_kernel(M, N, K, w.spec), out, x.cast(dtypes.float32).contiguous(), *parts, pool_arg(pool, x.device))


# **** INT4 linear (quant/int4.py: MLX 4-bit, GGUF Q4_0/Q4_1, quantization="int4") ****

def int4_linear_kernel(M: int, N: int, K: int, G: int) -> tuple[str, str]:
  """(name, source) of the 4-bit linear: INT4's arrays (packed uint32 `[N, K/8]`, float16 scales and biases
  `[N, K/G]`, w = scale * q + bias) are the packed layout of 4-bit affine codes in groups of G, so the packed
  kernels run them as they are (args y, x, packed, scales, biases, pool)."""
  return packed_linear_kernel(M, N, K, QuantSpec(4, G))


def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, biases: Tensor, group_size: int, pool: Tensor | None = None) -> Tensor:
  """x `[M, K]` float32 @ W^T on the CPU device, W `[N, K]` stored as packed uint32 `[N, K/8]` with float16 scales
  and biases `[N, K/group_size]` (w = scale * q + bias). Returns float32 `[M, N]`, each row computed as alone (the
  packed kernels' GEMV and GEMM). One kernel per call, compiled per (M, N, K, group_size): under TinyJit keep M in a
  few buckets."""
  (M, K), N = x.shape, packed.shape[0]
  if packed.shape[1] * 8 != K: raise ValueError(f"packed weight {packed.shape} does not match x {x.shape} (K/8 words per row)")
  if group_size not in GROUP_SIZES or K % group_size or tuple(scales.shape) != (N, K // group_size) or tuple(biases.shape) != (N, K // group_size):
    raise ValueError(f"scales {scales.shape} / biases {biases.shape} do not match W [{N}, {K}] with group_size {group_size} "
                     f"(one of {GROUP_SIZES})")
  out = Tensor.invalids(M, N, dtype=dtypes.float32, device=x.device)
  packed = packed if packed.dtype == dtypes.uint32 else packed.bitcast(dtypes.uint32)
  args = [out, x.cast(dtypes.float32).contiguous(), packed.contiguous(), scales.cast(dtypes.float16).contiguous(),
          biases.cast(dtypes.float16).contiguous(), pool_arg(pool, x.device)]
  return run_kernel(int4_linear_kernel(M, N, K, group_size), *args)
