// Fused rotary embedding + KV-cache write.
//
// rope_cache_write_<x>_<c>: x = dtype of q/k/v (f32 | f16), c = dtype of the caches (f32 | f16).
//   grid: one threadgroup per token t (num_tokens threadgroups); threads: any count (the host uses 64).
//   buffers:
//     0 qkv          [T, (n_heads + 2 n_kv_heads) D]  x  the fused projection's output, read: each token's row holds
//                    its query heads, then its key heads, then its value heads (read in place: no copies to split it)
//     1 positions    [T]                 int32  absolute position of each token
//     2 cos_sin      [max_pos, D]        float  row p = cos of the D/2 frequencies, then their sin
//     3 slot_mapping [T]                 int32  cache slot (block * block_size + offset); -1 = padding, no write
//     4 q_out        [T, n_heads, D]     x      rotated query, written
//     5 k_cache      [num_blocks, block_size, n_kv_heads, D]  c  rotated key written at the token's slot
//     6 v_cache      [num_blocks, block_size, n_kv_heads, D]  c  value written at the token's slot
//     7 params       RopeParams
//   Rotation (HF Llama rotate-half), per head vector x: out[i] = x[i]*cos[i] - x[i+D/2]*sin[i],
//   out[i+D/2] = x[i+D/2]*cos[i] + x[i]*sin[i], for i < D/2; maths in float. D must be a multiple of 8.
//
// rope_cache_write_<x>_i8: the same for an int8 cache (kv_cache_dtype="int8", tinyvllm/kernels/kv_cache.py).
//   grid: one threadgroup per token; threads: a multiple of 32 (the host uses 64: 2 SIMD-groups).
//   buffers: 0-4 as above, then
//     5 k_cache  [num_blocks, block_size, n_kv_heads, D]  char  int8 codes of the rotated key
//     6 v_cache  [num_blocks, block_size, n_kv_heads, D]  char  int8 codes of the value
//     7 k_scale  [num_blocks, block_size, n_kv_heads]     half  one scale per (slot, KV head)
//     8 v_scale  [num_blocks, block_size, n_kv_heads]     half
//     9 params   RopeParams
//   Each head vector x (rotated k, or v) is quantized as the format defines it: amax = max|x_i|,
//   s = half(amax / 127), code_i = clamp(rint(x_i / s), -127, 127), all codes 0 when s == 0 (x_i ~ s * code_i).
//   q is rotated by all threads as in the float kernel. Then SIMD-group sg takes the head vectors sg, sg + NSG, ...
//   (the n_kv_heads k heads, then the v heads); lane l < D/8 holds elements [4l, 4l + 4) and [D/2 + 4l, D/2 + 4l + 4)
//   of it in registers (exactly the pair a rotation needs, so k is rotated in place), the amax is one simd_max over
//   the SIMD-group (idle lanes contribute 0), and each lane writes its 8 codes as two char4 stores (4-byte aligned:
//   D is a multiple of 8), lane 0 the scale. No threadgroup memory, no barrier. Bytes written per head vector:
//   D + 2 (codes + scale) instead of D * sizeof(c).
#include <metal_stdlib>
using namespace metal;

struct RopeParams {
  int num_tokens;
  int n_heads;
  int n_kv_heads;
  int head_dim;
};

template <typename T> METAL_FUNC vec<T, 4> to_vec4(float4 v);
template <> METAL_FUNC float4 to_vec4<float>(float4 v) { return v; }
template <> METAL_FUNC half4 to_vec4<half>(float4 v) { return half4(v); }

template <typename T, typename C>
[[kernel]] void rope_cache_write(
    device const T* qkv [[buffer(0)]],
    device const int* positions [[buffer(1)]],
    device const float* cos_sin [[buffer(2)]],
    device const int* slot_mapping [[buffer(3)]],
    device T* q_out [[buffer(4)]],
    device C* k_cache [[buffer(5)]],
    device C* v_cache [[buffer(6)]],
    constant RopeParams& p [[buffer(7)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgsize [[threads_per_threadgroup]]) {   // uint3 like tgid: Metal wants the geometry built-ins of one width
  const int t = tgid.x, nthreads = tgsize.x;
  const int D = p.head_dim, half_d = D / 2, chunks = half_d / 4;
  const int hq = p.n_heads, hk = p.n_kv_heads;
  const int slot = slot_mapping[t];
  device const float* cs = cos_sin + (long)positions[t] * D;
  device const T* token_qkv = qkv + (long)t * (hq + 2 * hk) * D;   // q heads, then k heads, then v heads

  // Rotate q and k: one work item per (head, float4 chunk of the first half)
  for (int i = tid; i < (hq + hk) * chunks; i += nthreads) {
    const int h = i / chunks, c = 4 * (i % chunks);
    const bool is_q = h < hq;
    if (!is_q && slot < 0) continue;
    device const T* src = token_qkv + (long)h * D;   // q head h, or (h >= hq) k head h - hq
    const float4 co = *(device const float4*)(cs + c);
    const float4 si = *(device const float4*)(cs + half_d + c);
    const float4 x1 = float4(*(device const vec<T, 4>*)(src + c));
    const float4 x2 = float4(*(device const vec<T, 4>*)(src + half_d + c));
    const float4 r1 = x1 * co - x2 * si;
    const float4 r2 = x2 * co + x1 * si;
    if (is_q) {
      device T* dst = q_out + ((long)t * hq + h) * D;
      *(device vec<T, 4>*)(dst + c) = to_vec4<T>(r1);
      *(device vec<T, 4>*)(dst + half_d + c) = to_vec4<T>(r2);
    } else {
      device C* dst = k_cache + ((long)slot * hk + (h - hq)) * D;
      *(device vec<C, 4>*)(dst + c) = to_vec4<C>(r1);
      *(device vec<C, 4>*)(dst + half_d + c) = to_vec4<C>(r2);
    }
  }

  // Copy v into its slot
  if (slot < 0) return;
  for (int i = tid; i < hk * D / 4; i += nthreads) {
    const float4 x = float4(*(device const vec<T, 4>*)(token_qkv + (long)(hq + hk) * D + 4 * i));
    *(device vec<C, 4>*)(v_cache + (long)slot * hk * D + 4 * i) = to_vec4<C>(x);
  }
}

// The rotated pair of float4 chunks at c and D/2 + c of one head vector
template <typename T>
METAL_FUNC void rotate_chunk(device const T* src, device const float* cs, int c, int half_d, thread float4& r1, thread float4& r2) {
  const float4 co = *(device const float4*)(cs + c);
  const float4 si = *(device const float4*)(cs + half_d + c);
  const float4 x1 = float4(*(device const vec<T, 4>*)(src + c));
  const float4 x2 = float4(*(device const vec<T, 4>*)(src + half_d + c));
  r1 = x1 * co - x2 * si;
  r2 = x2 * co + x1 * si;
}

METAL_FUNC char4 quantize4(float4 x, float inv_scale) {
  return char4(clamp(rint(x * inv_scale), float4(-127.0f), float4(127.0f)));
}

template <typename T>
[[kernel]] void rope_cache_write_i8(
    device const T* qkv [[buffer(0)]],
    device const int* positions [[buffer(1)]],
    device const float* cos_sin [[buffer(2)]],
    device const int* slot_mapping [[buffer(3)]],
    device T* q_out [[buffer(4)]],
    device char* k_cache [[buffer(5)]],
    device char* v_cache [[buffer(6)]],
    device half* k_scale [[buffer(7)]],
    device half* v_scale [[buffer(8)]],
    constant RopeParams& p [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgsize [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const int t = tgid.x, nthreads = tgsize.x, nsg = nthreads / 32;
  const int D = p.head_dim, half_d = D / 2, chunks = half_d / 4;
  const int hq = p.n_heads, hk = p.n_kv_heads;
  const int slot = slot_mapping[t];
  device const float* cs = cos_sin + (long)positions[t] * D;
  device const T* token_qkv = qkv + (long)t * (hq + 2 * hk) * D;   // q heads, then k heads, then v heads

  // Rotate q: one work item per (head, float4 chunk of the first half)
  for (int i = tid; i < hq * chunks; i += nthreads) {
    const int h = i / chunks, c = 4 * (i % chunks);
    float4 r1, r2;
    rotate_chunk(token_qkv + (long)h * D, cs, c, half_d, r1, r2);
    device T* dst = q_out + ((long)t * hq + h) * D;
    *(device vec<T, 4>*)(dst + c) = to_vec4<T>(r1);
    *(device vec<T, 4>*)(dst + half_d + c) = to_vec4<T>(r2);
  }
  if (slot < 0) return;   // padding token: no cache write (the same for every thread of the threadgroup)

  // Quantize the rotated k heads, then the v heads: one head vector per SIMD-group step (uniform loop)
  const bool active = (int)lane < chunks;
  const int c = 4 * (int)lane;
  for (int j = (int)sg; j < 2 * hk; j += nsg) {
    const bool is_k = j < hk;
    const int h = is_k ? j : j - hk;
    float4 a = float4(0.0f), b = float4(0.0f);   // elements [c, c + 4) and [D/2 + c, D/2 + c + 4)
    if (active) {
      if (is_k) {
        rotate_chunk(token_qkv + (long)(hq + h) * D, cs, c, half_d, a, b);
      } else {
        device const T* src = token_qkv + (long)(hq + hk + h) * D;
        a = float4(*(device const vec<T, 4>*)(src + c));
        b = float4(*(device const vec<T, 4>*)(src + half_d + c));
      }
    }
    const float4 m4 = max(abs(a), abs(b));
    const float amax = simd_max(max(max(m4.x, m4.y), max(m4.z, m4.w)));
    const half s = half(amax / 127.0f);
    const float inv = float(s) > 0.0f ? 1.0f / float(s) : 0.0f;   // s == 0: every code 0
    const long row = (long)slot * hk + h;
    if (active) {
      device char* dst = (is_k ? k_cache : v_cache) + row * D;
      *(device char4*)(dst + c) = quantize4(a, inv);
      *(device char4*)(dst + half_d + c) = quantize4(b, inv);
    }
    if (lane == 0) (is_k ? k_scale : v_scale)[row] = s;
  }
}

#define INSTANTIATE_ROPE(xn, X, cn, C) \
  template [[host_name("rope_cache_write_" #xn "_" #cn)]] [[kernel]] decltype(rope_cache_write<X, C>) rope_cache_write<X, C>;
INSTANTIATE_ROPE(f32, float, f32, float)
INSTANTIATE_ROPE(f32, float, f16, half)
INSTANTIATE_ROPE(f16, half, f32, float)
INSTANTIATE_ROPE(f16, half, f16, half)

#define INSTANTIATE_ROPE_I8(xn, X) \
  template [[host_name("rope_cache_write_" #xn "_i8")]] [[kernel]] decltype(rope_cache_write_i8<X>) rope_cache_write_i8<X>;
INSTANTIATE_ROPE_I8(f32, float)
INSTANTIATE_ROPE_I8(f16, half)
