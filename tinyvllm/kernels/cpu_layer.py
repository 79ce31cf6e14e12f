"""A whole Llama decoder layer as one C kernel for tinygrad's CPU device (the `cpu` kernel backend).

tinygrad spells a layer as about twenty small kernels (norms, gathers, softmax passes, residual adds); on the
CPU each costs tens of microseconds of dispatch, and every new shape costs a compile of each. One kernel per
layer leaves the weight stream as the cost: RMSNorm -> q/k/v projection -> RoPE + K/V cache write -> paged
attention -> output projection + residual -> RMSNorm -> gate/up projection -> SiLU * up -> down projection +
residual. Projections are float32 or 4-bit (docs/quantization.md), each with an optional bias.

Same conventions as kernels/cpu.py: the kernel is the first function of its source, helpers are `static`,
shapes are compile-time constants, and the C is freestanding. No libm: tinygrad's loader links external calls
with 32-bit relative offsets, which break (a crash far from the cause) once the kernel's code lands more than
2 GB from libm, so exp and sqrt are our own.
"""
from __future__ import annotations
import hashlib
from dataclasses import dataclass
from tinygrad import Tensor, dtypes
from tinyvllm.kernels.kv_cache import PagedKVCache, hadamard_block
from tinyvllm.quant.formats import FLOAT, INT4, INT8, LinearWeights, QuantSpec, projection_parts
from tinyvllm.kernels.threads import C_PARALLEL, C_PARALLEL_DECLS
from tinyvllm.kernels.cpu import (SQRT, _DPWSSD, _HALF, _HSUM8, _MM_F32, _VEC, _packed_params, _program, c_param_name, c_struct_fields,
                                  packed_body, pool_arg, q8_body, rms_norm_source)

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")   # in the kernel's argument order
TILE = 32   # keys scored at once in attention: one max and one rescale per tile instead of per key
SPLIT_KEYS = 64   # attention splits a token's keys into parts of at least this many (and at most NSPLIT parts, a
NSPLIT = 4        # power of two) so one decoding sequence's attention spreads over the threads too

_MATH = r"""
typedef int vi __attribute__((vector_size(32)));
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }   /* m ? a : b, lane by lane */
/* e^x on 8 lanes = 2^k e^r, k = round(x / ln 2) (half away from zero), |r| <= ln(2)/2: degree-6 Taylor polynomial,
   within 2.3e-7 relative; 0 below -87, where e^x underflows */
static inline vf exp8(vf x) {
  vi under = x < -87.0f;
  x = vsel(x > 88.0f, (vf){0} + 88.0f, x);
  x = vsel(under, (vf){0} - 87.0f, x);    /* keeps the int conversion in range; the lane becomes 0 below */
  vi k = __builtin_convertvector(x * 1.44269504f + vsel(x < 0.0f, (vf){0} - 0.5f, (vf){0} + 0.5f), vi);
  vf kf = __builtin_convertvector(k, vf);
  vf r = (x - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;   /* ln 2 in two parts */
  vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  vf e = p * (vf)((k + 127) << 23);
  return (vf)((vi)e & ~under);
}
/* the scalar e^x: one lane of exp8, so softmax's vector and scalar exps cannot drift apart */
static inline float exp_f32(float x) { return exp8((vf){0} + x)[0]; }
""" + SQRT


@dataclass(frozen=True)
class Part:
  """One stored matrix of a projection: `n` output rows of `k` inputs, float32, INT4 (`group` inputs per scale),
  INT8 (Q8_0 blocks) or packed (`quant`: quant/blocks.py), with an optional bias."""
  n: int
  k: int
  fmt: str = FLOAT
  group: int = 0
  quant: QuantSpec | None = None
  bias: bool = False

  def args(self, name: str) -> list[str]:
    """The C parameters of this part's tensors, in LinearWeights.tensors() order."""
    if self.fmt == FLOAT: w = [f"const float *restrict {name}_w"]
    elif self.fmt == INT4:
      w = [f"const unsigned *restrict {name}_w", f"const unsigned short *restrict {name}_s", f"const unsigned short *restrict {name}_b"]
    elif self.fmt == INT8: w = [f"const signed char *restrict {name}_w", f"const unsigned short *restrict {name}_s"]
    else: w = [a.replace("restrict ", f"restrict {name}_") for a in _packed_params(self.quant)]
    return w + ([f"const float *restrict {name}_bias"] if self.bias else [])


def _row_cost(p: Part) -> int:
  """What one row of a part costs a thread, in relative units: the bytes it reads (weights and scales), times 1.3 for
  a layout whose codes have high bits to join on (Q5_K, Q6_K, ...). A Q6_K row is 1.46x a Q4_K row's bytes (1.42x
  when Q4_K's scales took a byte each), but took 1.84x its time from cache then (512 x 2048 GEMVs, one thread: 25.0
  and 13.6 us) and about 1.8x on two threads from memory (a Q4_K_M 1B's q/k rows split evenly beside its Q6_K v
  rows: one thread 85 us a layer, the other 58); the factor gives 1.9x."""
  if p.fmt == FLOAT: return 4 * p.k
  if p.fmt == INT4: return p.k // 2 + 4 * (p.k // p.group)
  if p.fmt == INT8: return p.k + 2 * (p.k // 32)
  return round(p.k * p.quant.bytes_per_weight() * (1.3 if p.quant.bits > 4 else 1.0))


@dataclass(frozen=True)
class LinearSpec:
  """How one projection is stored: one part, or (q/k/v or gate/up stored in different formats) several, whose
  outputs sit side by side."""
  parts: tuple[Part, ...]

  @property
  def n(self) -> int: return sum(p.n for p in self.parts)
  @property
  def k(self) -> int: return self.parts[0].k

  def part_names(self, name: str) -> list[str]: return [name] if len(self.parts) == 1 else [f"{name}{i}" for i in range(len(self.parts))]

  def share_fn(self, name: str) -> str:
    """`static inline void name_share(int part, int nparts, int *nb, int *ne)`: the rows [nb, ne) of the projection that
    one pool part computes, in runs of 4, each row weighted by its part's `_row_cost`. Parts stored alike split evenly
    (tv_share_rows); split by count, a Q4_K_M checkpoint's q/k in Q4_K beside its v in Q6_K left the thread holding
    v's rows last to finish, 27 us a layer after the other (1B, two threads). Boundaries fall on runs of 4 of the whole
    projection because every part but the last starts one (`takes`)."""
    assert all(p.n % 4 == 0 for p in self.parts[:-1]), "parts must start on runs of 4"
    head = f"static inline void {name}_share(int part, int nparts, int *nb, int *ne) {{\n"
    if len({_row_cost(p) for p in self.parts}) == 1: return head + f"  tv_share_rows({self.n}, part, nparts, nb, ne);\n}}\n"
    starts, costs = [sum(p.n for p in self.parts[:i]) for i in range(len(self.parts))], [_row_cost(p) for p in self.parts]
    total = sum(p.n * c for p, c in zip(self.parts, costs))
    return head + f"""  static const long long start[] = {{{", ".join(map(str, starts))}}}, rows[] = {{{", ".join(str(p.n) for p in self.parts)}}},
                        cost[] = {{{", ".join(map(str, costs))}}};
  int at[2];
  for (int e = 0; e < 2; e++) {{   /* the first row whose cost before it reaches (part + e) / nparts of the total, to a run of 4 */
    long long target = {total}LL * (part + e) / nparts, before = 0;
    at[e] = {self.n};
    for (int i = 0; i < {len(self.parts)}; i++) {{
      if (target < before + rows[i] * cost[i]) {{ long long r = start[i] + ((target - before) / cost[i] + 3) / 4 * 4; at[e] = r < {self.n} ? (int)r : {self.n}; break; }}
      before += rows[i] * cost[i];
    }}
  }}
  *nb = at[0];
  *ne = at[1];
}}
"""

  def args(self, name: str) -> list[str]: return [a for p, pn in zip(self.parts, self.part_names(name)) for a in p.args(pn)]


def _part_fn(name: str, part: Part, M: int, ys: int) -> str:
  """`static void name_rows(y, x, weights..., nb, ne)`: y[M, nb:ne] = x @ W[nb:ne]^T (+ bias) for one part, y already
  at the part's first column, rows of `ys` floats."""
  N, K = part.n, part.k
  bias = f"for (int m = 0; m < {M}; m++) for (int n = nb; n < ne; n++) y[(long)m * {ys} + n] += {name}_bias[n];" if part.bias else ""
  head = f"static void {name}_rows(float *restrict y, const float *restrict x, {', '.join(part.args(name))}, int nb, int ne) {{"
  if part.fmt == FLOAT: return f"{head}\n  mm_f32(y, x, {name}_w, {M}, {ys}, {K}, nb, ne);\n  {bias}\n}}\n"
  if part.fmt == INT4:
    alias = f"const unsigned *restrict w = {name}_w; const unsigned short *restrict s = {name}_s, *restrict b = {name}_b;"
    body = packed_body(M, N, K, QuantSpec(4, part.group), ys)   # INT4's arrays are the 4-bit packed layout
  elif part.fmt == INT8:
    alias = f"const signed char *restrict w = {name}_w; const unsigned short *restrict s = {name}_s;"
    body = q8_body(M, N, K, ys)
  else:
    alias = " ".join(f"{a.rsplit(' ', 1)[0]} {c_param_name(a)} = {name}_{c_param_name(a)};" for a in _packed_params(part.quant))
    body = packed_body(M, N, K, part.quant, ys)
  return f"{head}\n  {alias}\n{body}\n  {bias}\n}}\n"


def _linear_fn(name: str, spec: LinearSpec, M: int) -> str:
  """`static void name(y, x, weights..., nb, ne)`: y[M, nb:ne] = x[M, K] @ W[nb:ne]^T (+ bias), nb a multiple of 4. A
  projection of several parts runs each part on the rows of [nb, ne) that fall in it (parts start at multiples of 4)."""
  names, parts = spec.part_names(name), spec.parts
  out, calls, start = [], [], 0
  for part, pn in zip(parts, names):
    out.append(_part_fn(pn, part, M, spec.n))
    args = ", ".join(c_param_name(a) for a in part.args(pn))
    calls.append(f"  {{ int b_ = nb > {start} ? nb : {start}, e_ = ne < {start + part.n} ? ne : {start + part.n};\n"
                 f"    if (b_ < e_) {pn}_rows(y + {start}, x, {args}, b_ - {start}, e_ - {start}); }}")
    start += part.n
  return "".join(out) + f"static void {name}(float *restrict y, const float *restrict x, {', '.join(spec.args(name))}, int nb, int ne) {{\n" + \
    "\n".join(calls) + "\n}\n"


@dataclass(frozen=True)
class LayerShape:
  tokens: int               # T (bucketed)
  hidden: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  intermediate: int
  block_size: int
  table_width: int          # block-table columns (full width)
  max_pos: int              # rows of the cos/sin table
  eps: float
  qkv: LinearSpec
  o: LinearSpec
  gate_up: LinearSpec
  down: LinearSpec
  k_storage: str = "float"  # float | int8 | int4: K codes with a float16 scale per (slot, KV head), kernels/kv_cache.py
  v_storage: str = "float"  # the same for V (k8v4: int8 keys, int4 values)
  k_rotated: bool = False   # int4: stored rotated by the Hadamard matrix R along head_dim
  v_rotated: bool = False
  qk_norm: bool = False     # RMSNorm each head of q and k before RoPE (Qwen3, Gemma 3: weights qn, kn)
  window: int = 0           # attend to the latest `window` keys only (sliding window); 0: all
  sandwich: bool = False    # Gemma 2/3: attention and MLP outputs RMS-normed (ln3, ln4) before their residual adds
  gelu: bool = False        # GeGLU (tanh GELU) instead of SwiGLU
  softcap: float = 0.0      # attention scores become softcap * tanh(scores / softcap) (Gemma 2); 0: none

  @property
  def kv_quantized(self) -> bool: return self.k_storage != "float"

  @property
  def scratch(self) -> int:
    """floats of working memory: normed x, qkv, rotated q, attention output, gate/up, activation, one product,
    and the attention splits' partial states (per split and query head: head_dim sums, a max and a total)"""
    T, qd = self.tokens, self.n_heads * self.head_dim
    return T * (self.hidden + self.qkv.n + 2 * qd + self.gate_up.n + self.intermediate + self.hidden +
                NSPLIT * self.n_heads * (self.head_dim + 2))


def _source(name: str, s: LayerShape, scale: float) -> str:
  T, E, H, KVH, D, I = s.tokens, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.intermediate
  G, DV, half, QKV = H // KVH, D // 8, D // 2, s.qkv.n
  vl = {"float": "vload", "int8": "vload_i8", "int4": "vload_i4"}
  ctype = {"float": "float", "int8": "signed char", "int4": "unsigned char"}
  kt, vt = ctype[s.k_storage], ctype[s.v_storage]
  # cache elements per head vector, per 8 values
  row = {st: (D // 2 if st == "int4" else D) for st in (s.k_storage, s.v_storage)}
  step = {st: (4 if st == "int4" else 8) for st in (s.k_storage, s.v_storage)}
  hb = hadamard_block(D)
  size = {"float": 4 * D, "int8": D, "int4": D // 2}
  kbytes, vbytes = size[s.k_storage], size[s.v_storage]
  NB8 = TILE // 8
  # a quantized row is converted to float once per tile (shared by the G query heads); a float row is read in place
  def rows(kind: str, st: str) -> str:
    ptr = f"{kind}c + (slot * {KVH} + g) * {row[st]}"
    if st == "float": return f"{kind}p[j] = {ptr};"
    return (f"{{ const {ctype[st]} *r = {ptr}; float *d = {kind}buf + j * {D}; "
            f"for (int i = 0; i < {DV}; i++) *(vf_u *)(d + i * 8) = {vl[st]}(r + i * {step[st]}); {kind}p[j] = d; }}")
  rotate_q = "" if not s.k_rotated else f"""    float qr[{H * D}];   /* scores against rotated keys: (Rq).(Rk) = q.k */
    for (int i = 0; i < {H * D}; i++) qr[i] = qt[i];
    for (int hd = 0; hd < {H}; hd++) rotate_vec(qr + hd * {D});
    qt = qr;"""
  params = ["float *restrict out", f"{kt} *restrict kc", f"{vt} *restrict vc",
            *(["unsigned short *restrict ks", "unsigned short *restrict vs"] if s.kv_quantized else []),
            "float *restrict scratch", "const float *restrict h",
            "const int *restrict pos", "const int *restrict slots", "const int *restrict tables", "const int *restrict token_seq",
            "const int *restrict token_pos", "const float *restrict cs", "const float *restrict ln1", "const float *restrict ln2",
            *(["const float *restrict qn", "const float *restrict kn"] if s.qk_norm else []),
            *(["const float *restrict ln3", "const float *restrict ln4"] if s.sandwich else []), *s.qkv.args("qkv"), *s.o.args("o"), *s.gate_up.args("gate_up"), *s.down.args("down"),
            "const unsigned long long *restrict pool"]
  # a projection over rows nb..ne-1, called from a pool part: its weights come from the layer's context struct
  call = lambda lin, spec, y, x: f"{lin}({y}, {x}, {', '.join('c->' + c_param_name(a) for a in spec.args(lin))}, nb, ne);"
  # the MLP's first region: with whole runs of 4 units, each part computes a span of units' gate and up rows and
  # then their products (no wait between the two); otherwise gate/up rows, then the products, as two regions
  gate_up_call = call("gate_up", s.gate_up, "c->gu", "c->xn")
  if I % 4 == 0:
    mlp_in = f"""/* units [ib, ie): their gate rows, their up rows, then their products: a part's products read only its own rows */
static void part_mlp_in(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx;
  int nb, ne, ib, ie;
  tv_share_rows({I}, part, nparts, &ib, &ie);
  if (ib >= ie) return;
  nb = ib; ne = ie; {gate_up_call}
  nb = {I} + ib; ne = {I} + ie; {gate_up_call}
  activate(c, ib, ie);
}}"""
    mlp_calls = "tv_parallel(pool, part_mlp_in, &c);"
  else:
    mlp_in = f"""static void part_gate_up(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx; int nb, ne; tv_share_rows({s.gate_up.n}, part, nparts, &nb, &ne); {gate_up_call}
}}
static void part_act(void *ctx, int part, int nparts) {{
  int ib, ie;
  tv_share({I}, part, nparts, &ib, &ie);
  activate(ctx, ib, ie);
}}"""
    mlp_calls = "tv_parallel(pool, part_gate_up, &c);\n  tv_parallel(pool, part_act, &c);"
  return f"""#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TV_AVX2 1
#elif defined(__SSE__)
#include <immintrin.h>
#endif
{_DPWSSD}
void {name}({", ".join(params)});
{C_PARALLEL_DECLS}
struct layer_ctx {{ {c_struct_fields(params)} float *xn, *qkv_out, *q, *att, *gu, *act, *prod, *part; }};
{_VEC}
typedef signed char vc8 __attribute__((vector_size(8), aligned(1)));
static inline vf vload_i8(const signed char *p) {{ return __builtin_convertvector(*(const vc8 *)p, vf); }}
typedef unsigned char vu4 __attribute__((vector_size(4), aligned(1)));
typedef unsigned char vu8 __attribute__((vector_size(8)));
/* 8 int4 codes from 4 bytes (element 2i in the low nibble of byte i), as floats in [-7, 7] */
static inline vf vload_i4(const unsigned char *p) {{
  vu4 b = *(const vu4 *)p, lo = b & 15, hi = b >> 4;
  return __builtin_convertvector((vu8)__builtin_shufflevector(lo, hi, 0, 4, 1, 5, 2, 6, 3, 7), vf) - 8.0f;
}}
/* x <- R x: the normalized fast Walsh-Hadamard transform in blocks of {hb} (R symmetric and its own inverse) */
static inline void rotate_vec(float *x) {{
  for (int b0 = 0; b0 < {D}; b0 += {hb})
    for (int len = 1; len < {hb}; len <<= 1)
      for (int i = b0; i < b0 + {hb}; i += 2 * len)
        for (int j = i; j < i + len; j++) {{ float a = x[j], c = x[j + len]; x[j] = a + c; x[j + len] = a - c; }}
  for (int i = 0; i < {D}; i++) x[i] *= {hb ** -0.5!r}f;
}}
{_MATH}
/* the 8 sums of d[0..7] as the lanes of one vector: a transpose-style pairwise tree instead of 8 horizontal sums */
static inline vf hsum8x(const vf *d) {{
#define TV_P1(a, b) (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define TV_P2(a, b) (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
#define TV_P3(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
  vf r0 = TV_P1(d[0], d[1]), r1 = TV_P1(d[2], d[3]), r2 = TV_P1(d[4], d[5]), r3 = TV_P1(d[6], d[7]);
  vf s0 = TV_P2(r0, r1), s1 = TV_P2(r2, r3);
  return TV_P3(s0, s1);
#undef TV_P1
#undef TV_P2
#undef TV_P3
}}
static inline float h2f(unsigned short h);
#ifdef TV_AVX2
static inline float hsum8(__m256 v);
#endif
{_MM_F32}
{_linear_fn("qkv", s.qkv, T)}
{_linear_fn("o", s.o, T)}
{_linear_fn("gate_up", s.gate_up, T)}
{_linear_fn("down", s.down, T)}
{s.qkv.share_fn("qkv")}{s.o.share_fn("o")}{s.down.share_fn("down")}

{rms_norm_source("rms_norm", T, E, s.eps)}
{rms_norm_source("head_norm", 1, D, s.eps) if s.qk_norm else ""}
static inline void rope(float *restrict dst, const float *restrict x, const float *restrict c, const float *restrict sn) {{
  for (int i = 0; i < {half}; i++) {{
    float x1 = x[i], x2 = x[i + {half}];
    dst[i] = x1 * c[i] - x2 * sn[i];
    dst[i + {half}] = x2 * c[i] + x1 * sn[i];
  }}
}}

/* tanh(y) = 1 - 2 / (e^2y + 1): exp8 saturates at e^88, where this is 1 */
static inline vf tanh8(vf y) {{ return 1.0f - 2.0f / (exp8(2.0f * y) + 1.0f); }}
/* the MLP's gate: {"GELU's tanh approximation (GeGLU)" if s.gelu else "SiLU (SwiGLU)"} */
static inline vf gate8(vf g) {{ return {"0.5f * g * (1.0f + tanh8(0.7978845608f * (g + 0.044715f * g * g * g)))" if s.gelu else "g / (1.0f + exp8(-g))"}; }}
{_F2H + _KV_QUANT if s.kv_quantized else ""}
{_kv_store("store_k", s.k_storage, s.k_rotated, D)}
{_kv_store("store_v", s.v_storage, s.v_rotated, D)}
/* rotate q and k (RMS-normed head by head first, with qk_norm), write k and v into their cache slots (slot -1: a
   padding token, nothing written) */
static void rope_write(float *restrict q, struct layer_ctx *c, const float *restrict qkv) {{
  for (int t = 0; t < {T}; t++) {{
    const float *row = qkv + (long)t * {QKV};
    int p = c->pos[t] < 0 ? 0 : c->pos[t] >= {s.max_pos} ? {s.max_pos - 1} : c->pos[t];
    const float *cs = c->cs + (long)p * {D}, *sn = cs + {half};
    float normed[{D}];
    for (int hd = 0; hd < {H}; hd++) {{
      const float *x = row + hd * {D};
      {"head_norm(normed, x, c->qn); x = normed;" if s.qk_norm else ""}
      rope(q + ((long)t * {H} + hd) * {D}, x, cs, sn);
    }}
    int slot = c->slots[t];
    if (slot < 0) continue;   /* a padding token; the source leaves out the cache size so one binary serves every size */
    for (int hd = 0; hd < {KVH}; hd++) {{
      long at = (long)slot * {KVH} + hd;
      float k[{D}];
      const float *x = row + ({H} + hd) * {D};
      {"head_norm(normed, x, c->kn); x = normed;" if s.qk_norm else ""}
      rope(k, x, cs, sn);
      store_k(c->kc, {"c->ks" if s.kv_quantized else "0"}, at, k);
      store_v(c->vc, {"c->vs" if s.kv_quantized else "0"}, at, row + ({H + KVH} + hd) * {D});
    }}
  }}
}}

/* start loading the K and V rows of keys j0 .. j0 + {TILE} - 1 (those below je), every KV head (one contiguous run
   per key), while the tile before them is scored */
static inline void prefetch_rows(struct layer_ctx *c, const int *table, int j0, int je) {{
  for (int j = j0; j < j0 + {TILE} && j < je; j++) {{
    long slot = (long)table[j / {s.block_size}] * {s.block_size} + j % {s.block_size};
    const char *kr = (const char *)(c->kc + slot * {KVH * row[s.k_storage]}), *vr = (const char *)(c->vc + slot * {KVH * row[s.v_storage]});
    for (int b = 0; b < {KVH * kbytes}; b += 64) __builtin_prefetch(kr + b, 0, 3);
    for (int b = 0; b < {KVH * vbytes}; b += 64) __builtin_prefetch(vr + b, 0, 3);
  }}
}}

/* online softmax of KV head g's {G} query heads (qg; state m, l, acc) over the keys j0 .. j0 + nt - 1 of one tile */
static inline void attend_tile(const float *restrict qg, struct layer_ctx *c, const int *restrict table, int g, int j0, int nt,
                               float *restrict m, float *restrict l, vf (*restrict acc)[{DV}], float *restrict kbuf, float *restrict vbuf) {{
  const {kt} *restrict kc = c->kc;
  const {vt} *restrict vc = c->vc;
  int nb8 = (nt + 7) / 8;
  const float *kp[{TILE}], *vp[{TILE}];   /* the tile's K and V rows as floats */
  float kscale[{TILE}] __attribute__((aligned(32))), vscale[{TILE}] __attribute__((aligned(32)));   /* per-row dequantization scales (1 for a float cache) */
  for (int j = 0; j < nb8 * 8; j++) {{   /* keys past nt (to a multiple of 8) repeat key j0: scored, then masked */
    int key = j0 + (j < nt ? j : 0);
    long slot = (long)table[key / {s.block_size}] * {s.block_size} + key % {s.block_size};
    {rows("k", s.k_storage)}
    {"kscale[j] = h2f(c->ks[slot * " + str(KVH) + " + g]);" if s.kv_quantized else "kscale[j] = 1.0f;"}
    if (j < nt) {{
      {rows("v", s.v_storage)}
      {"vscale[j] = h2f(c->vs[slot * " + str(KVH) + " + g]);" if s.kv_quantized else "vscale[j] = 1.0f;"}
    }} else vscale[j] = 0.0f;
  }}
  const vi lane = {{0, 1, 2, 3, 4, 5, 6, 7}};
  for (int hd = 0; hd < {G}; hd++) {{
    const float *qh = qg + hd * {D};
    vf sc[{NB8}], mx = (vf){{0}} + m[hd];
    for (int b = 0; b < nb8; b++) {{   /* 8 keys' scores at once */
      vf d[8];
      for (int e = 0; e < 8; e++) d[e] = (vf){{0}};
      for (int i = 0; i < {DV}; i++) {{
        vf qv = vload(qh + i * 8);
        for (int e = 0; e < 8; e++) d[e] += qv * vload(kp[b * 8 + e] + i * 8);
      }}
      vf sb = hsum8x(d) * (*(const vf *)(kscale + b * 8) * {scale!r}f);
      {f"sb = {s.softcap!r}f * tanh8(sb * {1 / s.softcap!r}f);   /* soft-capped */" if s.softcap else ""}
      sb = vsel(lane + b * 8 < nt, sb, (vf){{0}} - 1e30f);
      sc[b] = sb;
      mx = vsel(sb > mx, sb, mx);
    }}
    float mt = mx[0];
    for (int e = 1; e < 8; e++) if (mx[e] > mt) mt = mx[e];
    float corr = exp_f32(m[hd] - mt);
    l[hd] *= corr;
    vf a[{DV}];   /* in registers for the tile: acc may alias the rows as far as the compiler knows */
    for (int i = 0; i < {DV}; i++) a[i] = acc[hd][i] * corr;
    m[hd] = mt;
    float pv[{TILE}] __attribute__((aligned(32)));
    vf ls = (vf){{0}};
    for (int b = 0; b < nb8; b++) {{
      vf p = exp8(sc[b] - mt);
      ls += p;
      *(vf *)(pv + b * 8) = p * *(const vf *)(vscale + b * 8);
    }}
    l[hd] += hsum(ls);
    for (int j = 0; j < nt; j++) {{
      float w = pv[j];
      for (int i = 0; i < {DV}; i++) a[i] += w * vload(vp[j] + i * 8);
    }}
    for (int i = 0; i < {DV}; i++) acc[hd][i] = a[i];
  }}
}}

/* How many parts token t's keys are split into: a fixed function of the key count alone (never of the batch or the
   thread count), so a token's attention is the same arithmetic alone, in any batch and on any number of threads.
   A power of two (parts of at least {SPLIT_KEYS} keys, at most {NSPLIT}), so the parts divide evenly over 2 or 4 threads. */
static inline int key_splits(int n) {{ int k = 1; while (k < {NSPLIT} && n >= 2 * k * {SPLIT_KEYS}) k *= 2; return k; }}
/* token t's first key: 0, or with a sliding window the oldest of the latest {s.window} keys */
static inline int first_key(struct layer_ctx *c, int t) {{ return {s.window} && c->token_pos[t] + 1 > {s.window} ? c->token_pos[t] + 1 - {s.window} : 0; }}
static inline int token_units(struct layer_ctx *c, int t) {{ return c->token_seq[t] < 0 ? 0 : key_splits(c->token_pos[t] + 1 - first_key(c, t)); }}

/* Attention units ub..ue-1, where a unit is one key split of one token (tokens in order, splits in order): token t
   attends to keys first_key(t)..token_pos[t] of block-table row token_seq[t] (-1: padding), causal in a chunk and the
   whole cached prefix (or its window). A unit sweeps its keys a tile at a time and, per tile, every KV head: each key's K (and V) rows
   for all heads are one contiguous run, read once, in order. The {G} query heads of a KV head share each row.
   A unit leaves its unnormalized state (acc, max, sum per query head) in c->part for attention_merge. */
static void attention(const float *restrict q, struct layer_ctx *c, int ub, int ue) {{
  {f"float kbuf[{TILE * D}] __attribute__((aligned(32)));" if s.k_storage != "float" else "float *kbuf = 0;"}
  {f"float vbuf[{TILE * D}] __attribute__((aligned(32)));" if s.v_storage != "float" else "float *vbuf = 0;"}
  int t = 0, u0 = 0;   /* token t's units are u0 .. u0 + token_units(t) - 1 */
  for (int u = ub; u < ue; u++) {{
    while (u >= u0 + token_units(c, t)) u0 += token_units(c, t++);
    int lo = first_key(c, t), sp = u - u0, n = c->token_pos[t] + 1 - lo, ns = key_splits(n), tiles = (n + {TILE - 1}) / {TILE};
    int jb = lo + tiles * sp / ns * {TILE}, je = lo + tiles * (sp + 1) / ns * {TILE};
    if (je > lo + n) je = lo + n;
    const int *table = c->tables + (long)c->token_seq[t] * {s.table_width};
    const float *qt = q + (long)t * {H * D};
{rotate_q}
    float m[{H}], l[{H}];
    vf acc[{H}][{DV}];
    for (int hd = 0; hd < {H}; hd++) {{ m[hd] = -1e30f; l[hd] = 0; for (int i = 0; i < {DV}; i++) acc[hd][i] = (vf){{0}}; }}
    prefetch_rows(c, table, jb, je);
    for (int j0 = jb; j0 < je; j0 += {TILE}) {{
      int nt = je - j0 < {TILE} ? je - j0 : {TILE};
      prefetch_rows(c, table, j0 + {TILE}, je);
      for (int g = 0; g < {KVH}; g++) attend_tile(qt + g * {G * D}, c, table, g, j0, nt, m + g * {G}, l + g * {G}, acc + g * {G}, kbuf, vbuf);
    }}
    float *ps = c->part + ((long)t * {NSPLIT} + sp) * {H * (D + 2)};   /* [H][D] acc, [H] max, [H] sum */
    for (int hd = 0; hd < {H}; hd++) {{
      for (int i = 0; i < {DV}; i++) *(vf_u *)(ps + hd * {D} + i * 8) = acc[hd][i];
      ps[{H * D} + hd] = m[hd];
      ps[{H * D + H} + hd] = l[hd];
    }}
  }}
}}

/* tokens tb..te-1: combine each token's key splits in order (rescaled to the largest max), normalize, write */
static void attention_merge(float *restrict out, struct layer_ctx *c, int tb, int te) {{
  for (int t = tb; t < te; t++) {{
    float *o = out + (long)t * {H * D};
    int ns = token_units(c, t);
    if (!ns) {{ for (int i = 0; i < {H * D}; i++) o[i] = 0; continue; }}
    const float *p0 = c->part + (long)t * {NSPLIT * H * (D + 2)};
    for (int hd = 0; hd < {H}; hd++) {{
      float mx = p0[{H * D} + hd];
      for (int sp = 1; sp < ns; sp++) {{ float ms = p0[sp * {H * (D + 2)} + {H * D} + hd]; if (ms > mx) mx = ms; }}
      vf r[{DV}];
      float lsum = 0;
      for (int i = 0; i < {DV}; i++) r[i] = (vf){{0}};
      for (int sp = 0; sp < ns; sp++) {{
        const float *ps = p0 + sp * {H * (D + 2)};
        float w = ns == 1 ? 1.0f : exp_f32(ps[{H * D} + hd] - mx);
        lsum += ps[{H * D + H} + hd] * w;
        for (int i = 0; i < {DV}; i++) r[i] += vload(ps + hd * {D} + i * 8) * w;
      }}
      float inv = 1.0f / lsum;
      float *oh = o + hd * {D};
      for (int i = 0; i < {DV}; i++) {{ vf v = r[i] * inv; for (int e = 0; e < 8; e++) oh[i * 8 + e] = v[e]; }}
      {"rotate_vec(oh);   /* sum_j p_j v_j = R sum_j p_j (R v_j) */" if s.v_rotated else ""}
    }}
  }}
}}

/* the thread pool's parts (kernels/threads.py): rows of each projection in runs of 4 (weighted by their cost where
   its parts are stored differently), key splits of attention, and of the MLP's intermediate units (a gate row, its
   up row and their product); norms, RoPE and residual adds are short and stay on the calling thread */
#define SHARE_ROWS(lin) int nb, ne; lin##_share(part, nparts, &nb, &ne);
static void part_qkv(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx; SHARE_ROWS(qkv) {call("qkv", s.qkv, "c->qkv_out", "c->xn")}
}}
static void part_attention(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx;
  int units = 0, ub, ue;
  for (int t = 0; t < {T}; t++) units += token_units(c, t);
  tv_share(units, part, nparts, &ub, &ue);
  attention(c->q, c, ub, ue);
}}
static void part_merge(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx;
  int tb, te;
  tv_share({T}, part, nparts, &tb, &te);
  attention_merge(c->att, c, tb, te);
}}
static void part_o(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx; SHARE_ROWS(o) {call("o", s.o, "c->prod", "c->att")}
}}
/* {"GELU" if s.gelu else "SiLU"}(gate) * up of tokens' intermediate units [ib, ie), 8 at a time */
static void activate(struct layer_ctx *c, int ib, int ie) {{
  for (int t = 0; t < {T}; t++) {{
    const float *g = c->gu + (long)t * {2 * I}, *u = g + {I};
    float *a = c->act + (long)t * {I};
    int i = ib;
    for (; i + 8 <= ie; i += 8) *(vf_u *)(a + i) = gate8(vload(g + i)) * vload(u + i);
    for (; i < ie; i++) a[i] = gate8((vf){{0}} + g[i])[0] * u[i];
  }}
}}
{mlp_in}
static void part_down(void *ctx, int part, int nparts) {{
  struct layer_ctx *c = ctx; SHARE_ROWS(down) {call("down", s.down, "c->prod", "c->act")}
}}

void {name}({", ".join(params)}) {{
  float *xn = scratch, *qkv_out = xn + {T * E}, *q = qkv_out + {T * QKV}, *att = q + {T * H * D};
  float *gu = att + {T * H * D}, *act = gu + {T * s.gate_up.n}, *prod = act + {T * I}, *part = prod + {T * E};
  struct layer_ctx c = {{{", ".join(c_param_name(p) for p in params)}, xn, qkv_out, q, att, gu, act, prod, part}};
  rms_norm(xn, h, ln1);
  tv_parallel(pool, part_qkv, &c);
  rope_write(q, &c, qkv_out);
  tv_parallel(pool, part_attention, &c);
  {"attention_merge(att, &c, 0, " + str(T) + ");   /* a few tokens: less than waking the pool */" if T <= 8 else "tv_parallel(pool, part_merge, &c);"}
  tv_parallel(pool, part_o, &c);
  {"rms_norm(xn, prod, ln3);   /* the attention output normed (xn is free again) */" if s.sandwich else ""}
  for (long i = 0; i < {T * E}; i++) out[i] = h[i] + {"xn" if s.sandwich else "prod"}[i];
  rms_norm(xn, out, ln2);
  {mlp_calls}
  tv_parallel(pool, part_down, &c);
  {"rms_norm(xn, prod, ln4);" if s.sandwich else ""}
  for (long i = 0; i < {T * E}; i++) out[i] += {"xn" if s.sandwich else "prod"}[i];
}}
{C_PARALLEL}
{_HALF}
#ifdef TV_AVX2
{_HSUM8}
#endif
"""


def takes(linears: dict[str, LinearWeights]) -> bool:
  """Whether the fused layer reads these projections: every format (float32, INT4, INT8, packed), fused or in parts
  whose rows start at multiples of 4 (the row tiles' width)."""
  for n in LINEARS:
    parts = projection_parts(linears, n)
    if parts is None or any(p.weight.shape[0] % 4 for p in parts[:-1]): return False
  return True


def _spec(ws: list[LinearWeights]) -> LinearSpec:
  return LinearSpec(tuple(Part(w.weight.shape[0], w.in_features, w.format, w.group_size if w.format == INT4 else 0, w.spec, w.bias is not None)
                          for w in ws))


def decoder_layer(h: Tensor, linears: dict[str, LinearWeights], norms: tuple[Tensor, ...], cfg, positions: Tensor, slots: Tensor,
                  tables: Tensor, token_seq: Tensor,
                  token_pos: Tensor, cos_sin: Tensor, cache: PagedKVCache, out: Tensor | None = None,
                  pool: Tensor | None = None, window: int | None = None) -> Tensor:
  """One decoder layer: h `[T, hidden]` float32 -> `[T, hidden]`, written into `out` when given (a realized buffer,
  so the caller can alternate two); k/v written into the cache in place; `pool`: a ThreadPool's buffer
  (kernels/threads.py) to split the work over, or None for one thread. `linears`: the layer's projections under HF
  names relative to the layer, q/k/v and gate/up fused (see model/llama.py); `norms`: the RMSNorm weights of the
  layer's input and of the MLP's input, then the q and k head norms' (cfg.qk_norm), then the attention and MLP output
  norms' (cfg.sandwich_norms); `window`: the layer's sliding window, or None."""
  T, E = h.shape
  D, I = cfg.head_dim, cfg.intermediate_size
  shape = LayerShape(T, E, cfg.num_attention_heads, cfg.num_key_value_heads, D, I, cache.k.shape[1],
                     tables.shape[1], cos_sin.shape[0], float(cfg.rms_norm_eps),
                     *(_spec(projection_parts(linears, n)) for n in LINEARS),
                     *(("int4" if int4 else "int8" if cache.quantized else "float") for int4 in (cache.k_int4, cache.v_int4)),
                     cache.k_rotated, cache.v_rotated, cfg.qk_norm, window or 0, cfg.sandwich_norms, cfg.hidden_act != "silu",
                     cfg.attn_logit_softcapping or 0.0)
  # a name stable across processes (hash() of a str is salted per process): tinygrad's disk cache of compiled
  # kernels is keyed by source, so the same shape compiles once per machine, not once per process
  name = f"llama_layer_{hashlib.sha256(repr((shape, cfg.attention_scale)).encode()).hexdigest()[:16]}"
  src = _source(name, shape, cfg.attention_scale)
  if out is None: out = Tensor.invalids(T, E, dtype=dtypes.float32, device=h.device)
  scratch = Tensor.invalids(shape.scratch, dtype=dtypes.float32, device=h.device)
  args = [out, *cache.tensors(), scratch, h.contiguous(), positions, slots, tables.contiguous(), token_seq, token_pos.contiguous(),
          cos_sin, *norms, *(t for n in LINEARS for w in projection_parts(linears, n) for t in w.tensors()), pool_arg(pool, h.device)]
  return Tensor.custom_kernel(*args, fxn=lambda *p: _program(name, src, *p))[0]


def _kv_store(name: str, storage: str, rotated: bool, D: int) -> str:
  """`name(cache, scales, at, x)`: head vector x into row `at` of a K or V cache, quantized for an int8 or int4
  cache by `_KV_QUANT` (int4: rotated first, codes + 8 packed two per byte)."""
  if storage == "float":
    return f"""static inline void {name}(float *restrict cache, void *unused, long at, const float *restrict x) {{
  for (int i = 0; i < {D}; i++) cache[at * {D} + i] = x[i];
}}"""
  if storage == "int8":
    return f"""static inline void {name}(signed char *restrict cache, unsigned short *restrict scales, long at, const float *restrict x) {{
  float sc = kv_scale(x, {D}, 127.0f, scales + at);
  for (int i = 0; i < {D}; i++) cache[at * {D} + i] = (signed char)kv_code(x[i], sc, 127.0f);
}}"""
  return f"""static inline void {name}(unsigned char *restrict cache, unsigned short *restrict scales, long at, const float *restrict x_in) {{
  float x[{D}];
  for (int i = 0; i < {D}; i++) x[i] = x_in[i];
  {"rotate_vec(x);" if rotated else ""}
  float sc = kv_scale(x, {D}, 7.0f, scales + at);
  for (int i = 0; i < {D // 2}; i++)
    cache[at * {D // 2} + i] = (unsigned char)((kv_code(x[2 * i], sc, 7.0f) + 8) | (kv_code(x[2 * i + 1], sc, 7.0f) + 8) << 4);
}}"""


# kernels/kv_cache.py's rule, shared by the int8 and int4 stores
_KV_QUANT = r"""
/* s = half(max|x| / levels): stored in *bits, returned as float */
static inline float kv_scale(const float *restrict x, int n, float levels, unsigned short *bits) {
  float amax = 0;
  for (int i = 0; i < n; i++) { float a = x[i] < 0 ? -x[i] : x[i]; if (a > amax) amax = a; }
  *bits = f2h(amax / levels);
  return h2f(*bits);
}
/* rint(clamp(v / s, -levels, levels)), 0 when s == 0. Rounding adds and subtracts 1.5 * 2^23, exact in the default
   rounding mode for |v| <= 127 (no libm, and rintf is a call without SSE4.1). */
static inline int kv_code(float v, float sc, float levels) {
  v = sc > 0 ? v / sc : 0.0f;
  v = v > levels ? levels : v < -levels ? -levels : v;
  return (int)((v + 12582912.0f) - 12582912.0f);
}
"""


_F2H = r"""
/* float -> float16 bits, round to nearest even */
static inline unsigned short f2h(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  union { float f; unsigned u; } c = { f };
  unsigned sign = (c.u >> 16) & 0x8000, a = c.u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00;                      /* NaN */
  if (a >= 0x477FF000u) return sign | 0x7C00;                     /* rounds past 65504: inf */
  if (a < 0x38800000u) {                                          /* subnormal half: units of 2^-24 */
    union { unsigned u; float f; } m = { a };
    return sign | (unsigned short)(int)((m.f * 16777216.0f + 12582912.0f) - 12582912.0f);
  }
  a -= 0x38000000u;                                               /* rebias the exponent from 127 to 15 */
  return sign | (unsigned short)((a + 0x0FFFu + ((a >> 13) & 1)) >> 13);
#endif
}
"""
