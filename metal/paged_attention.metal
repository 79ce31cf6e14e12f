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
//   read from memory once. The context is walked in chunks of 128 keys (flash-decoding inside the group):
//     1. thread t scores key k0 + t against the G query heads (its K row read with vector loads, q from
//        threadgroup memory), no cross-lane traffic;
//     2. simd_max + threadgroup memory give the chunk maximum; the running maximum, sum and output are
//        rescaled in float and the probabilities stored in threadgroup memory;
//     3. SIMD-group sg accumulates V rows sg, sg + 4, ... (lane = float4 chunk of the row) for all G heads.
//   At the end the four SIMD-groups' partial outputs are summed through threadgroup memory.
//   The masked tail of the last block is never read: keys stop at the context length.
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
    constant PagedParams& p, threadgroup float* qs, threadgroup float* probs, threadgroup float* red,
    threadgroup float4* red_o, uint3 tgid, uint tid, uint lane, uint sg) {
  constexpr int NSG = 4;                 // SIMD-groups per threadgroup
  constexpr int NT = 32 * NSG;           // threads = keys per chunk
  constexpr int GMAX = 8;                // most query heads per KV head
  constexpr int C = D / 4;               // float4 chunks per row (<= 32)
  const float NEG_BIG = -FLT_MAX;        // finite "minus infinity": exp(NEG_BIG - x) is 0, never NaN

  const int seq = tgid.z, kvh = tgid.y, part = tgid.x;
  const int G = p.n_heads / p.n_kv_heads;
  const int ctx = context_lens[seq];
  const int kbeg = PARTITIONED ? part * p.partition_size : 0;
  const int kend = PARTITIONED ? min(ctx, kbeg + p.partition_size) : ctx;
  device const int* table = block_tables + (long)seq * p.max_blocks;
  const long row_stride = (long)p.n_kv_heads * D;

  // The G query heads of this KV head (contiguous in q), pre-scaled: qs[g * D + d]
  for (int i = tid; i < G * D; i += NT) qs[i] = float(q[((long)seq * p.n_heads + kvh * G) * D + i]) * p.scale;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Online softmax state; m is the same in every thread, l and o cover this SIMD-group's keys
  float m[GMAX], l[GMAX];
  float4 o[GMAX];
  for (int g = 0; g < GMAX; g++) {
    m[g] = NEG_BIG;
    l[g] = 0.0f;
    o[g] = float4(0.0f);
  }

  // For each chunk of NT keys
  for (int k0 = kbeg, parity = 0; k0 < kend; k0 += NT, parity ^= 1) {
    const int nk = min(NT, kend - k0);

    // Scores: thread tid takes key k0 + tid and reads its whole K row with vector loads
    float s[GMAX];
    for (int g = 0; g < GMAX; g++) s[g] = NEG_BIG;
    if ((int)tid < nk) {
      const int k = k0 + tid;
      device const KV* kr = k_cache + (long)(table[k / p.block_size] * p.block_size + k % p.block_size) * row_stride + kvh * D;
      for (int g = 0; g < GMAX; g++) s[g] = 0.0f;
      for (int c = 0; c < C; c++) {
        const float4 kv = float4(*(device const vec<KV, 4>*)(kr + 4 * c));
        for (int g = 0; g < GMAX; g++) {
          if (g >= G) break;
          s[g] += dot(*(threadgroup const float4*)(qs + g * D + 4 * c), kv);
        }
      }
    }

    // Chunk maximum per head (red is double-buffered by chunk parity, so one barrier per use suffices)
    for (int g = 0; g < GMAX; g++) {
      if (g >= G) break;
      const float mx = simd_max(s[g]);
      if (lane == 0) red[(parity * NSG + sg) * GMAX + g] = mx;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // New running maximum, rescale the state, publish this chunk's probabilities
    for (int g = 0; g < GMAX; g++) {
      if (g >= G) break;
      float mc = m[g];
      for (int i = 0; i < NSG; i++) mc = max(mc, red[(parity * NSG + i) * GMAX + g]);
      const float corr = exp(m[g] - mc);
      l[g] *= corr;
      o[g] *= corr;
      m[g] = mc;
      if ((int)tid < nk) probs[g * NT + tid] = exp(s[g] - mc);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Weighted V: SIMD-group sg takes keys sg, sg + NSG, ...; lane = float4 chunk of the row
    for (int j = sg; j < nk; j += NSG) {
      const int k = k0 + j;
      float4 vv = float4(0.0f);
      if ((int)lane < C)
        vv = float4(*(device const vec<KV, 4>*)(v_cache + (long)(table[k / p.block_size] * p.block_size + k % p.block_size) * row_stride
                                                 + kvh * D + 4 * lane));
      for (int g = 0; g < GMAX; g++) {
        if (g >= G) break;
        const float pj = probs[g * NT + j];
        l[g] += pj;
        o[g] += pj * vv;
      }
    }
  }

  // Sum the SIMD-groups' partial outputs (same running maximum, so no rescaling)
  threadgroup float* red_l = red + 2 * NSG * GMAX;
  for (int g = 0; g < GMAX; g++) {
    if (g >= G) break;
    if ((int)lane < C) red_o[(sg * GMAX + g) * C + lane] = o[g];
    if (lane == 0) red_l[sg * GMAX + g] = l[g];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < G * C; i += NT) {
    const int g = i / C, c = i % C;
    float sum = 0.0f;
    float4 acc = float4(0.0f);
    for (int s = 0; s < NSG; s++) {
      sum += red_l[s * GMAX + g];
      acc += red_o[(s * GMAX + g) * C + c];
    }
    const float4 res = sum > 0.0f ? acc / sum : float4(0.0f);
    const long head = (long)seq * p.n_heads + kvh * G + g;
    if (PARTITIONED) {
      const long idx = head * p.num_partitions + part;
      *(device float4*)(tmp_out + idx * D + 4 * c) = res;
      if (c == 0) {
        exp_sums[idx] = sum;
        max_logits[idx] = m[g];
      }
    } else {
      *(device vec<T, 4>*)(out + head * D + 4 * c) = to_vec4<T>(res);
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
  threadgroup __attribute__((aligned(16))) float qs[8 * D];   // read as float4: Metal needs 16-byte alignment
  threadgroup float probs[8 * 128];
  threadgroup float red[3 * 4 * 8];
  threadgroup float4 red_o[4 * 8 * D / 4];
  paged_decode_impl<T, KV, D, false>(q, k_cache, v_cache, block_tables, context_lens, out, nullptr, nullptr, nullptr,
                                     p, qs, probs, red, red_o, tgid, tid, lane, sg);
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
  threadgroup __attribute__((aligned(16))) float qs[8 * D];   // read as float4: Metal needs 16-byte alignment
  threadgroup float probs[8 * 128];
  threadgroup float red[3 * 4 * 8];
  threadgroup float4 red_o[4 * 8 * D / 4];
  paged_decode_impl<T, KV, D, true>(q, k_cache, v_cache, block_tables, context_lens, nullptr, tmp_out, exp_sums,
                                    max_logits, p, qs, probs, red, red_o, tgid, tid, lane, sg);
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
