"""Attention-side C kernels for the CPU device: RoPE + KV-cache write in one kernel, and paged attention in one.

tinygrad spells these as about a dozen small kernels per layer (gathers, masks, softmax passes); each kernel
costs tens of microseconds of dispatch and a compile per shape. These two do the same work, reading only the
keys each query can see. Same conventions as kernels/cpu.py: the kernel is the first function, shapes are
compile-time constants, freestanding C.
"""
from __future__ import annotations
from tinygrad import Tensor, dtypes
from tinyvllm.kernels.cpu import _VEC, _program


def _rope_source(name: str, T: int, H: int, KVH: int, D: int, n_slots: int, max_pos: int) -> str:
  W, half = (H + 2 * KVH) * D, D // 2
  return f"""
void {name}(float *restrict qo, float *restrict kc, float *restrict vc, const float *restrict qkv,
            const int *restrict pos, const float *restrict cs, const int *restrict slots);
static inline void rope(float *restrict dst, const float *restrict x, const float *restrict c, const float *restrict s);
void {name}(float *restrict qo, float *restrict kc, float *restrict vc, const float *restrict qkv,
            const int *restrict pos, const float *restrict cs, const int *restrict slots) {{
  for (int t = 0; t < {T}; t++) {{
    const float *row = qkv + (long)t * {W};
    int p = pos[t] < 0 ? 0 : pos[t] >= {max_pos} ? {max_pos - 1} : pos[t];
    const float *c = cs + (long)p * {D}, *s = c + {half};
    for (int h = 0; h < {H}; h++) rope(qo + ((long)t * {H} + h) * {D}, row + h * {D}, c, s);
    int slot = slots[t];
    if (slot < 0 || slot >= {n_slots}) continue;          /* padding token: no cache write */
    for (int h = 0; h < {KVH}; h++) {{
      rope(kc + ((long)slot * {KVH} + h) * {D}, row + ({H} + h) * {D}, c, s);
      const float *v = row + ({H + KVH} + h) * {D};
      float *dst = vc + ((long)slot * {KVH} + h) * {D};
      for (int i = 0; i < {D}; i++) dst[i] = v[i];
    }}
  }}
}}
static inline void rope(float *restrict dst, const float *restrict x, const float *restrict c, const float *restrict s) {{
  for (int i = 0; i < {half}; i++) {{
    float x1 = x[i], x2 = x[i + {half}];
    dst[i] = x1 * c[i] - x2 * s[i];
    dst[i + {half}] = x2 * c[i] + x1 * s[i];
  }}
}}
"""


def rope_and_cache_write(qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor,
                         k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor, Tensor]:
  """qkv `[T, (H + 2 KVH) D]` float32 (q, k, v side by side, as the fused projection writes them) -> rotated q
  `[T, H, D]`; rotated k and v written into the caches at slot_mapping (-1: skipped). Returns (q, k_cache, v_cache)."""
  T, D = qkv.shape[0], k_cache.shape[-1]
  n_slots = k_cache.shape[0] * k_cache.shape[1]
  name = f"rope_cache_write_{T}_{n_heads}_{n_kv_heads}_{D}_{n_slots}"
  src = _rope_source(name, T, n_heads, n_kv_heads, D, n_slots, cos_sin.shape[0])
  q = Tensor.invalids(T, n_heads, D, dtype=dtypes.float32, device=qkv.device)
  q, k_cache, v_cache, *_ = Tensor.custom_kernel(q, k_cache, v_cache, qkv.contiguous(), positions, cos_sin, slot_mapping,
                                                 fxn=lambda *p: _program(name, src, *p))
  return q, k_cache, v_cache


TILE = 32   # keys scored at once: one max and one rescale per tile instead of per key

# Our own exp. Calling libm's expf is not safe here: tinygrad's loader links calls with 32-bit relative
# offsets, which break (a crash far from the cause) once the kernel's code lands more than 2 GB from libm.
# e^x = 2^k e^r with k = round(x / ln 2), |r| <= ln(2)/2; the degree-6 Taylor polynomial is within 2e-7 relative.
_EXP = r"""
static inline float exp_f32(float x) {
  if (x < -87.0f) return 0.0f;                 /* the softmax only asks for x <= 0; below this e^x underflows */
  if (x > 88.0f) x = 88.0f;
  int k = (int)(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f));
  float r = (x - (float)k * 0.693145751953125f) - (float)k * 1.428606765330187e-06f;   /* ln 2 in two parts */
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  union { int i; float f; } scale = { .i = (k + 127) << 23 };
  return p * scale.f;
}
"""


def _attention_source(name: str, T: int, H: int, KVH: int, D: int, BS: int, MB: int, scale: float) -> str:
  G, DV = H // KVH, D // 8
  return f"""
void {name}(float *restrict out, const float *restrict q, const float *restrict kc, const float *restrict vc,
            const int *restrict tables, const int *restrict token_seq, const int *restrict token_pos);
{_VEC}
{_EXP}
void {name}(float *restrict out, const float *restrict q, const float *restrict kc, const float *restrict vc,
            const int *restrict tables, const int *restrict token_seq, const int *restrict token_pos) {{
  for (int t = 0; t < {T}; t++) {{
    float *o = out + (long)t * {H * D};
    int seq = token_seq[t];
    if (seq < 0) {{ for (int i = 0; i < {H * D}; i++) o[i] = 0; continue; }}   /* padding slot */
    const int *table = tables + (long)seq * {MB};
    int n = token_pos[t] + 1;                       /* keys 0..pos: causal in a chunk, the whole cached prefix */
    for (int g = 0; g < {KVH}; g++) {{                /* the {G} query heads of a KV head share each K/V row read */
      const float *qg = q + ((long)t * {H} + g * {G}) * {D};
      float m[{G}], l[{G}], s[{G}][{TILE}];
      vf acc[{G}][{DV}];
      for (int h = 0; h < {G}; h++) {{ m[h] = -1e30f; l[h] = 0; for (int i = 0; i < {DV}; i++) acc[h][i] = (vf){{0}}; }}
      for (int j0 = 0; j0 < n; j0 += {TILE}) {{
        int nt = n - j0 < {TILE} ? n - j0 : {TILE};
        const float *krow[{TILE}], *vrow[{TILE}];
        for (int j = 0; j < nt; j++) {{
          int key = j0 + j;
          long slot = (long)table[key / {BS}] * {BS} + key % {BS};
          krow[j] = kc + (slot * {KVH} + g) * {D};
          vrow[j] = vc + (slot * {KVH} + g) * {D};
        }}
        for (int h = 0; h < {G}; h++) {{
          float mt = m[h];
          for (int j = 0; j < nt; j++) {{
            vf d = (vf){{0}};
            for (int i = 0; i < {DV}; i++) d += vload(qg + h * {D} + i * 8) * vload(krow[j] + i * 8);
            s[h][j] = hsum(d) * {scale!r}f;
            if (s[h][j] > mt) mt = s[h][j];
          }}
          float corr = exp_f32(m[h] - mt);             /* online softmax: rescale what came before this tile */
          l[h] *= corr;
          for (int i = 0; i < {DV}; i++) acc[h][i] *= corr;
          m[h] = mt;
          for (int j = 0; j < nt; j++) {{
            float p = exp_f32(s[h][j] - mt);
            l[h] += p;
            for (int i = 0; i < {DV}; i++) acc[h][i] += p * vload(vrow[j] + i * 8);
          }}
        }}
      }}
      for (int h = 0; h < {G}; h++) {{
        float inv = 1.0f / l[h];
        float *oh = o + (g * {G} + h) * {D};
        for (int i = 0; i < {DV}; i++) {{ vf r = acc[h][i] * inv; for (int e = 0; e < 8; e++) oh[i * 8 + e] = r[e]; }}
      }}
    }}
  }}
}}
"""


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, token_seq: Tensor, token_pos: Tensor,
                    scale: float) -> Tensor:
  """q `[T, H, D]` float32; token t attends to keys 0..token_pos[t] of block-table row token_seq[t] (-1: padding,
  zeros out). block_tables `[P, MB]` int32 at full width. Returns `[T, H, D]`."""
  T, H, D = q.shape
  _, BS, KVH, _ = k_cache.shape
  if D % 8: raise ValueError(f"the CPU attention kernel needs head_dim divisible by 8, got {D}")
  MB = block_tables.shape[1]
  name = f"paged_attention_{T}_{H}_{KVH}_{D}_{BS}_{MB}"
  src = _attention_source(name, T, H, KVH, D, BS, MB, float(scale))
  out = Tensor.invalids(T, H, D, dtype=dtypes.float32, device=q.device)
  return Tensor.custom_kernel(out, q.contiguous(), k_cache, v_cache, block_tables.contiguous(), token_seq.contiguous(),
                              token_pos.contiguous(), fxn=lambda *p: _program(name, src, *p))[0]
