// Fused rotary embedding + KV-cache write.
//
// rope_cache_write_<x>_<c>: x = dtype of q/k/v (f32 | f16), c = dtype of the caches (f32 | f16).
//   grid: one threadgroup per token t (num_tokens threadgroups); threads: any count (the host uses 64).
//   buffers:
//     0 q            [T, n_heads, D]     x      query, read
//     1 k            [T, n_kv_heads, D]  x      key, read
//     2 v            [T, n_kv_heads, D]  x      value, read
//     3 positions    [T]                 int32  absolute position of each token
//     4 cos_sin      [max_pos, D]        float  row p = cos of the D/2 frequencies, then their sin
//     5 slot_mapping [T]                 int32  cache slot (block * block_size + offset); -1 = padding, no write
//     6 q_out        [T, n_heads, D]     x      rotated query, written
//     7 k_cache      [num_blocks, block_size, n_kv_heads, D]  c  rotated key written at the token's slot
//     8 v_cache      [num_blocks, block_size, n_kv_heads, D]  c  value written at the token's slot
//     9 params       RopeParams
//   Rotation (HF Llama rotate-half), per head vector x: out[i] = x[i]*cos[i] - x[i+D/2]*sin[i],
//   out[i+D/2] = x[i+D/2]*cos[i] + x[i]*sin[i], for i < D/2; maths in float. D must be a multiple of 8.
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
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const int* positions [[buffer(3)]],
    device const float* cos_sin [[buffer(4)]],
    device const int* slot_mapping [[buffer(5)]],
    device T* q_out [[buffer(6)]],
    device C* k_cache [[buffer(7)]],
    device C* v_cache [[buffer(8)]],
    constant RopeParams& p [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgsize [[threads_per_threadgroup]]) {   // uint3 like tgid: Metal wants the geometry built-ins of one width
  const int t = tgid.x, nthreads = tgsize.x;
  const int D = p.head_dim, half_d = D / 2, chunks = half_d / 4;
  const int hq = p.n_heads, hk = p.n_kv_heads;
  const int slot = slot_mapping[t];
  device const float* cs = cos_sin + (long)positions[t] * D;

  // Rotate q and k: one work item per (head, float4 chunk of the first half)
  for (int i = tid; i < (hq + hk) * chunks; i += nthreads) {
    const int h = i / chunks, c = 4 * (i % chunks);
    const bool is_q = h < hq;
    if (!is_q && slot < 0) continue;
    device const T* src = is_q ? q + ((long)t * hq + h) * D : k + ((long)t * hk + (h - hq)) * D;
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
    const float4 x = float4(*(device const vec<T, 4>*)(v + (long)t * hk * D + 4 * i));
    *(device vec<C, 4>*)(v_cache + (long)slot * hk * D + 4 * i) = to_vec4<C>(x);
  }
}

#define INSTANTIATE_ROPE(xn, X, cn, C) \
  template [[host_name("rope_cache_write_" #xn "_" #cn)]] [[kernel]] decltype(rope_cache_write<X, C>) rope_cache_write<X, C>;
INSTANTIATE_ROPE(f32, float, f32, float)
INSTANTIATE_ROPE(f32, float, f16, half)
INSTANTIATE_ROPE(f16, half, f32, float)
INSTANTIATE_ROPE(f16, half, f16, half)
