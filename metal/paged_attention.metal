// Paged attention for decode: one query token per sequence against its paged K/V cache.
//
// Shared layouts (x = dtype of q and out, c = dtype of the caches, D = head_dim in {64, 80, 96, 128}):
//   q             [num_seqs, n_heads, D]                        x
//   k_cache       [num_blocks, block_size, n_kv_heads, D]       c   slot s = block * block_size + offset
//   v_cache       [num_blocks, block_size, n_kv_heads, D]       c
//   block_tables  [num_seqs, max_blocks]                        int32 (unused entries 0)
//   context_lens  [num_seqs]                                    int32 (0 = padding row -> zeros)
//   params        PagedParams
// Query head h uses KV head h / G, G = n_heads / n_kv_heads <= 8.
//
// paged_attention_decode_<x>_<c>_<D>
//   grid: (1, n_kv_heads, num_seqs) threadgroups of 128 threads (4 SIMD-groups).
//   One threadgroup serves one (sequence, KV head) and all G query heads that share it, so each K/V row is
//   read once. Lanes own float4 chunks of a K/V row (LK = 16 lanes per key for D = 64, else 32), so a
//   SIMD-group scores 32 / LK keys per step; SIMD-groups take interleaved keys. Every lane keeps an online
//   softmax (max, sum, weighted V chunk) per query head in float; the states are merged across the keys of
//   a SIMD-group with simd_shuffle_xor, then across SIMD-groups through threadgroup memory.
//   buffers: 0 q, 1 k_cache, 2 v_cache, 3 block_tables, 4 context_lens, 5 out [num_seqs, n_heads, D] x, 6 params
//
// paged_attention_decode_partitioned_<x>_<c>_<D>   (long contexts, like vLLM's v2)
//   grid: (num_partitions, n_kv_heads, num_seqs); partition i covers keys [i*P, (i+1)*P), P = partition_size.
//   Writes, per (seq, head, partition), the normalised partial output and its softmax statistics:
//   buffers: 0-4 as above, 5 tmp_out [num_seqs, n_heads, num_partitions, D] float,
//            6 exp_sums [num_seqs, n_heads, num_partitions] float, 7 max_logits (same shape) float, 8 params
//
// paged_attention_reduce_<x>
//   grid: (n_heads, num_seqs) threadgroups of 32 threads (one float4 chunk of D each).
//   Combines the partitions a sequence used: out = sum_i w_i * tmp_out_i / sum_i w_i, w_i = exp_sums_i *
//   exp(max_logits_i - max). buffers: 0 tmp_out, 1 exp_sums, 2 max_logits, 3 context_lens, 4 out, 5 params
#include <metal_stdlib>
using namespace metal;

struct PagedParams {
  int num_seqs;
  int n_heads;
  int n_kv_heads;
  int head_dim;
  int block_size;
  int max_blocks;
  int partition_size;   // keys per partition (partitioned kernels)
  int num_partitions;
  float scale;          // softmax scale, usually 1/sqrt(D)
};

template <typename T> METAL_FUNC vec<T, 4> to_vec4(float4 v);
template <> METAL_FUNC float4 to_vec4<float>(float4 v) { return v; }
template <> METAL_FUNC half4 to_vec4<half>(float4 v) { return half4(v); }

template <typename T, typename KV, int D, bool PARTITIONED>
METAL_FUNC void paged_decode_impl(
    device const T* q, device const KV* k_cache, device const KV* v_cache,
    device const int* block_tables, device const int* context_lens,
    device T* out, device float* tmp_out, device float* exp_sums, device float* max_logits,
    constant PagedParams& p, threadgroup float4* red_o, threadgroup float* red_ml,
    uint3 tgid, uint tid, uint lane, uint sg) {
  constexpr int NSG = 4;                 // SIMD-groups per threadgroup
  constexpr int GMAX = 8;                // most query heads per KV head
  constexpr int C = D / 4;               // float4 chunks per row
  constexpr int LK = D == 64 ? 16 : 32;  // lanes per key
  constexpr int KPS = 32 / LK;           // keys per SIMD-group step
  constexpr int NKG = NSG * KPS;         // keys per threadgroup step
  const float NEG_BIG = -FLT_MAX;        // finite "minus infinity": exp(NEG_BIG - NEG_BIG) stays 1, never NaN

  const int seq = tgid.z, kvh = tgid.y, part = tgid.x;
  const int G = p.n_heads / p.n_kv_heads;
  const int ctx = context_lens[seq];
  const int kbeg = PARTITIONED ? part * p.partition_size : 0;
  const int kend = PARTITIONED ? min(ctx, kbeg + p.partition_size) : ctx;
  const int c = lane % LK;
  const bool has_chunk = c < C;

  // Query heads of this KV head, pre-scaled
  float4 qv[GMAX], o[GMAX];
  float m[GMAX], l[GMAX];
  for (int g = 0; g < GMAX; g++) {
    o[g] = float4(0.0f);
    qv[g] = float4(0.0f);
    m[g] = NEG_BIG;
    l[g] = 0.0f;
    if (g < G && has_chunk)
      qv[g] = float4(*(device const vec<T, 4>*)(q + ((long)seq * p.n_heads + kvh * G + g) * D + 4 * c)) * p.scale;
  }

  // For each key: this SIMD-group's keys are k0 + lane / LK; the loop bound is uniform per SIMD-group
  device const int* table = block_tables + (long)seq * p.max_blocks;
  const long row_stride = (long)p.n_kv_heads * D;
  for (int k0 = kbeg + (int)sg * KPS; k0 < kend; k0 += NKG) {
    const int k = k0 + lane / LK;
    const bool valid = k < kend;
    float4 kk = float4(0.0f), vv = float4(0.0f);
    if (valid && has_chunk) {
      const int slot = table[k / p.block_size] * p.block_size + k % p.block_size;
      const long base = slot * row_stride + kvh * D + 4 * c;
      kk = float4(*(device const vec<KV, 4>*)(k_cache + base));
      vv = float4(*(device const vec<KV, 4>*)(v_cache + base));
    }
    for (int g = 0; g < GMAX; g++) {
      if (g >= G) break;
      float s = dot(qv[g], kk);
      for (int off = LK / 2; off > 0; off /= 2) s += simd_shuffle_xor(s, off);
      const float m_new = valid ? max(m[g], s) : m[g];
      const float corr = exp(m[g] - m_new);
      const float pk = valid ? exp(s - m_new) : 0.0f;
      l[g] = l[g] * corr + pk;
      o[g] = o[g] * corr + pk * vv;
      m[g] = m_new;
    }
  }

  // Merge the key streams of one SIMD-group (D = 64: lanes l and l + 16)
  if (KPS == 2) {
    for (int g = 0; g < GMAX; g++) {
      if (g >= G) break;
      const float mo = simd_shuffle_xor(m[g], LK), lo = simd_shuffle_xor(l[g], LK);
      const float4 oo = simd_shuffle_xor(o[g], LK);
      const float mn = max(m[g], mo), a = exp(m[g] - mn), b = exp(mo - mn);
      l[g] = l[g] * a + lo * b;
      o[g] = o[g] * a + oo * b;
      m[g] = mn;
    }
  }

  // Merge across SIMD-groups: red_o [NSG][GMAX][C], red_ml [2][NSG][GMAX]
  for (int g = 0; g < GMAX; g++) {
    if (g >= G) break;
    if (lane < LK && has_chunk) red_o[(sg * GMAX + g) * C + c] = o[g];
    if (lane == 0) {
      red_ml[sg * GMAX + g] = m[g];
      red_ml[NSG * GMAX + sg * GMAX + g] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < G * C; i += NSG * 32) {
    const int g = i / C, cc = i % C;
    float mx = NEG_BIG;
    for (int s = 0; s < NSG; s++) mx = max(mx, red_ml[s * GMAX + g]);
    float sum = 0.0f;
    float4 acc = float4(0.0f);
    for (int s = 0; s < NSG; s++) {
      const float w = exp(red_ml[s * GMAX + g] - mx);
      sum += red_ml[NSG * GMAX + s * GMAX + g] * w;
      acc += red_o[(s * GMAX + g) * C + cc] * w;
    }
    const float4 res = sum > 0.0f ? acc / sum : float4(0.0f);
    const long head = (long)seq * p.n_heads + kvh * G + g;
    if (PARTITIONED) {
      const long idx = head * p.num_partitions + part;
      *(device float4*)(tmp_out + idx * D + 4 * cc) = res;
      if (cc == 0) {
        exp_sums[idx] = sum;
        max_logits[idx] = mx;
      }
    } else {
      *(device vec<T, 4>*)(out + head * D + 4 * cc) = to_vec4<T>(res);
    }
  }
}

template <typename T, typename KV, int D>
[[kernel]] void paged_attention_decode(
    device const T* q [[buffer(0)]],
    device const KV* k_cache [[buffer(1)]],
    device const KV* v_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* context_lens [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant PagedParams& p [[buffer(6)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 red_o[4 * 8 * D / 4];
  threadgroup float red_ml[2 * 4 * 8];
  paged_decode_impl<T, KV, D, false>(q, k_cache, v_cache, block_tables, context_lens, out, nullptr, nullptr, nullptr,
                                     p, red_o, red_ml, tgid, tid, lane, sg);
}

template <typename T, typename KV, int D>
[[kernel]] void paged_attention_decode_partitioned(
    device const T* q [[buffer(0)]],
    device const KV* k_cache [[buffer(1)]],
    device const KV* v_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* context_lens [[buffer(4)]],
    device float* tmp_out [[buffer(5)]],
    device float* exp_sums [[buffer(6)]],
    device float* max_logits [[buffer(7)]],
    constant PagedParams& p [[buffer(8)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 red_o[4 * 8 * D / 4];
  threadgroup float red_ml[2 * 4 * 8];
  paged_decode_impl<T, KV, D, true>(q, k_cache, v_cache, block_tables, context_lens, nullptr, tmp_out, exp_sums,
                                    max_logits, p, red_o, red_ml, tgid, tid, lane, sg);
}

template <typename T>
[[kernel]] void paged_attention_reduce(
    device const float* tmp_out [[buffer(0)]],
    device const float* exp_sums [[buffer(1)]],
    device const float* max_logits [[buffer(2)]],
    device const int* context_lens [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant PagedParams& p [[buffer(5)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  const int head = tgid.x, seq = tgid.y, D = p.head_dim;
  if ((int)tid >= D / 4) return;
  const int used = (context_lens[seq] + p.partition_size - 1) / p.partition_size;  // partitions with keys
  const long row = (long)seq * p.n_heads + head;
  float mx = -FLT_MAX;
  for (int i = 0; i < used; i++) mx = max(mx, max_logits[row * p.num_partitions + i]);
  float sum = 0.0f;
  float4 acc = float4(0.0f);
  for (int i = 0; i < used; i++) {
    const long idx = row * p.num_partitions + i;
    const float w = exp_sums[idx] * exp(max_logits[idx] - mx);
    sum += w;
    acc += *(device const float4*)(tmp_out + idx * D + 4 * tid) * w;
  }
  *(device vec<T, 4>*)(out + row * D + 4 * tid) = to_vec4<T>(sum > 0.0f ? acc / sum : float4(0.0f));
}

#define INSTANTIATE_DECODE(xn, X, cn, C, D)                                                                       \
  template [[host_name("paged_attention_decode_" #xn "_" #cn "_" #D)]] [[kernel]]                                  \
  decltype(paged_attention_decode<X, C, D>) paged_attention_decode<X, C, D>;                                      \
  template [[host_name("paged_attention_decode_partitioned_" #xn "_" #cn "_" #D)]] [[kernel]]                      \
  decltype(paged_attention_decode_partitioned<X, C, D>) paged_attention_decode_partitioned<X, C, D>;
#define INSTANTIATE_DECODE_D(xn, X, cn, C) \
  INSTANTIATE_DECODE(xn, X, cn, C, 64) INSTANTIATE_DECODE(xn, X, cn, C, 80) \
  INSTANTIATE_DECODE(xn, X, cn, C, 96) INSTANTIATE_DECODE(xn, X, cn, C, 128)
INSTANTIATE_DECODE_D(f32, float, f32, float)
INSTANTIATE_DECODE_D(f32, float, f16, half)
INSTANTIATE_DECODE_D(f16, half, f32, float)
INSTANTIATE_DECODE_D(f16, half, f16, half)

template [[host_name("paged_attention_reduce_f32")]] [[kernel]] decltype(paged_attention_reduce<float>) paged_attention_reduce<float>;
template [[host_name("paged_attention_reduce_f16")]] [[kernel]] decltype(paged_attention_reduce<half>) paged_attention_reduce<half>;
