// Paged attention for decode: one query token per sequence against its paged K/V cache.
//
// Shared layouts (x = dtype of q and out, c = dtype of the caches, D = head_dim in {64, 80, 96, 128}):
//   q             [num_seqs, n_heads, D]                        x
//   k_cache       [num_blocks, block_size, n_kv_heads, D]       c   slot s = block * block_size + offset
//   v_cache       [num_blocks, block_size, n_kv_heads, D]       c
//   block_tables  [num_seqs, max_blocks]                        int32 (unused entries 0)
//   context_lens  [num_seqs]                                    int32 (0 = padding row -> zeros)
//   params        PagedParams
// Query head h uses KV head h / G, G = n_heads / n_kv_heads <= 8. With params.window > 0 (a sliding window) the query
// sees only the latest `window` keys of its context; with params.softcap > 0 its scores are soft-capped (Gemma 2).
// c = i8 (kv_cache_dtype="int8", tinyvllm/kernels/kv_cache.py): the caches hold int8 codes (char) and two more
// buffers follow them, one half scale per (slot, KV head), row (s, kvh) ~ k_scale[s * n_kv_heads + kvh] * codes:
//   k_scale       [num_blocks, block_size, n_kv_heads]          half
//   v_scale       [num_blocks, block_size, n_kv_heads]          half
// The kernels dequantize in registers, never through a float copy of the cache: a lane converts its codes of a row
// to float as it would convert half, every lane also reads the row's scale (one broadcast load), a score is
// simd_sum(q . codes) * k_scale (one multiply per row and head) and a V row enters the output with weight
// p * v_scale (one multiply per row and head). Rows are still one contiguous load across the SIMD-group (D bytes:
// 64..128 B), so a key costs 2 * (D + 2) bytes instead of 2 * D * sizeof(c): 0.52x of a half cache at D = 64,
// 0.51x at D = 128.
//
// Decode is a matrix-vector product per head: it is bound by reading K and V, so the design is about reading
// each K/V row once, in full cache lines, with enough SIMD-groups in flight to hide the latency.
//
// paged_attention_decode_<x>_<c>_<D>_g<GMAX>             (one pass; tables of up to PARTITION_THRESHOLD keys)
//   grid: (1, n_kv_heads, num_seqs) threadgroups of 256 threads (NSG = 8 SIMD-groups).
//   One threadgroup serves one (sequence, KV head) and all G query heads that share it (GQA), so each K/V row
//   is read from device memory exactly once. GMAX in {2, 4, 8} is the smallest >= G (the host picks it): it
//   sizes the per-lane register state (o, m, l per head), which is what limits occupancy, so an MHA model
//   does not pay registers for 8 heads.
//   Lanes split the head dimension (as MLX's sdpa_vector does): lane j holds elements [V j, V j + V) of q and
//   of the output accumulator, V = 2 for D = 64 and 4 otherwise (D / V = 32, 20, 24, 32 active lanes; the
//   idle lanes of D = 80/96 hold zeros). A K or V row is then one contiguous 128..512-byte load across the
//   SIMD-group (coalesced), and its dot products with the G query heads are G simd_sums.
//   SIMD-group sg walks the pairs of keys 2 sg + 16 i, 2 sg + 16 i + 1 (two rows in flight per SIMD-group,
//   one softmax rescale per pair) keeping its own online-softmax state per head in registers: running
//   maximum m, sum l (uniform across the SIMD-group) and its lanes' slice of the output o, all float. No
//   probabilities are staged and no barrier is needed inside the key loop.
//   At the end the 8 SIMD-groups' states are merged head by head through threadgroup memory (the same array
//   `qs` that held q during the loop; 2 barriers per head), weighting SIMD-group s by exp2(m_s - max_s m_s);
//   thread t < D / 4 merges float4 chunk t and stores it as one vector.
//   Keys map to slots with shifts: block_size is a power of two (8, 16 or 32; the host checks).
//   Scores are kept in base 2: q is pre-scaled by scale * log2(e) and exp2 is used throughout.
//   The "minus infinity" is -FLT_MAX (finite): exp2(-FLT_MAX - x) is 0 and exp2(-FLT_MAX - -FLT_MAX) is 1 with
//   l = 0, never NaN; a context of 0 keys gives l = 0 and output zeros.
//   Threadgroup memory, independent of G: qs = 8 * D floats (2 KB for D = 64 .. 4 KB for D = 128; q needs only
//   G * D <= 8 * D of it) + 64 B, so it never limits occupancy (even 8 threadgroups per core would use <= 33 KB).
//   Registers per lane: GMAX * (V + 2) floats of state + 4 V of K/V rows in flight + addressing: about 40
//   (GMAX 2) .. 80 (GMAX 8, V 4), the real occupancy limit; q is read from threadgroup memory per step
//   (conflict-free consecutive vectors) rather than held in G * V more registers.
//   Bytes per (sequence, KV head): ctx * 2 * D * sizeof(c) of K/V (int8: ctx * 2 * (D + 2), codes and scales)
//   + G * D * sizeof(x) of q + G * D * sizeof(x) written.
//   buffers: 0 q, 1 k_cache, 2 v_cache, 3 block_tables, 4 context_lens, 5 out [num_seqs, n_heads, D] x, 6 params
//   paged_attention_decode_<x>_i8_<D>_g<GMAX>: 0 q, 1 k_cache, 2 v_cache, 3 k_scale, 4 v_scale, 5 block_tables,
//   6 context_lens, 7 out, 8 params
//
// paged_attention_decode_partitioned_<x>_<c>_<D>_g<GMAX>   (wide tables, like vLLM's v2 / MLX's 2-pass)
//   grid: (num_partitions, n_kv_heads, num_seqs), num_partitions = ceil(max_blocks * block_size / P),
//   P = partition_size; partition i covers keys [i P, (i + 1) P) and works as the one-pass kernel on them.
//   The grid is fixed by the table width (TinyJit captures it), but the work follows the real context:
//   a threadgroup whose partition starts at or beyond context_lens[seq] returns after reading that one int
//   (so a 40-key sequence in a 4096-key table costs one working threadgroup per KV head, plus 7 early exits).
//   Writes, per (seq, head, partition), the normalised partial output and its softmax statistics:
//   buffers: 0-4 as above, 5 tmp_out [num_seqs, n_heads, num_partitions, D] float,
//            6 exp_sums [num_seqs, n_heads, num_partitions] float (sum of exp2(score - max)),
//            7 max_logits (same shape) float (base-2 maximum score), 8 params
//   (..._partitioned_<x>_i8_<D>_g<GMAX>: 0-6 as the int8 one-pass kernel, 7 tmp_out, 8 exp_sums, 9 max_logits,
//   10 params)
//   Bytes per (sequence, KV head, used partition): min(P, rest) * 2 * D * sizeof(c) of K/V (int8: * 2 * (D + 2))
//   + G * D * sizeof(x) of q, + G * (D + 2) * 4 written.
//
// paged_attention_reduce_<x>
//   grid: (n_heads, num_seqs) threadgroups of 32 threads (one float4 chunk of D each).
//   Combines the partitions a sequence used (ceil(context / P), never the empty ones): out = sum_i w_i *
//   tmp_out_i / sum_i w_i, w_i = exp_sums_i * exp2(max_logits_i - max). A sequence whose context fits in one
//   partition (the common short case) is a plain copy of partition 0 (no statistics read, no exp); a
//   context of 0 writes zeros without reading anything. (Partition 0 cannot write `out` itself: the
//   partitioned kernel's buffer list has no `out`; the copy costs G * D * 4 bytes read per KV head.)
//   buffers: 0 tmp_out, 1 exp_sums, 2 max_logits, 3 context_lens, 4 out, 5 params
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
  int window;           // sliding window: the latest `window` keys only (0: all keys)
  float softcap;        // scores become softcap * tanh(scores / softcap) (Gemma 2; 0: none)
};

// The first key a sequence's query sees: with a sliding window, the oldest of its latest `window` keys
METAL_FUNC int first_key(int ctx, constant PagedParams& p) { return p.window > 0 ? max(0, ctx - p.window) : 0; }

template <typename T> METAL_FUNC vec<T, 4> to_vec4(float4 v);
template <> METAL_FUNC float4 to_vec4<float>(float4 v) { return v; }
template <> METAL_FUNC half4 to_vec4<half>(float4 v) { return half4(v); }

METAL_FUNC float2 to_float(float2 v) { return v; }
METAL_FUNC float2 to_float(half2 v) { return float2(v); }
METAL_FUNC float4 to_float(float4 v) { return v; }
METAL_FUNC float4 to_float(half4 v) { return float4(v); }
METAL_FUNC float2 to_float(char2 v) { return float2(v); }   // int8 codes: exact in float
METAL_FUNC float4 to_float(char4 v) { return float4(v); }

// KV = float | half (a float cache; k_scale, v_scale unused) or char (int8 codes, a half scale per row)
template <typename T, typename KV, int D, int V, int GMAX, bool PARTITIONED>
METAL_FUNC void paged_decode_impl(
    device const T* q, device const KV* k_cache, device const KV* v_cache,
    device const half* k_scale, device const half* v_scale, device const int* block_tables, device const int* context_lens,
    device T* out, device float* tmp_out, device float* exp_sums, device float* max_logits,
    constant PagedParams& p, threadgroup float* qs, threadgroup float* red,
    uint3 tgid, uint tid, uint lane, uint sg) {
  constexpr int NSG = 8;                 // SIMD-groups per threadgroup
  constexpr int NT = 32 * NSG;           // threads
  constexpr int U = 2;                   // keys per SIMD-group step
  constexpr int NC = D / V;              // active lanes (V-element chunks of a row)
  typedef vec<float, V> fv;
  typedef vec<KV, V> kvv;
  constexpr bool QUANT = sizeof(KV) == 1;   // int8 codes: rows carry a scale
  const float NEG_BIG = -FLT_MAX;        // finite "minus infinity"

  const int seq = tgid.z, kvh = tgid.y, part = tgid.x;
  const int ctx = context_lens[seq], kfirst = first_key(ctx, p);
  const int pbeg = PARTITIONED ? part * p.partition_size : 0;
  // past the context, or wholly before the window: the reduce never reads this partition
  if (PARTITIONED && (pbeg >= ctx || pbeg + p.partition_size <= kfirst)) return;
  const int kbeg = max(pbeg, kfirst);
  const int kend = PARTITIONED ? min(ctx, pbeg + p.partition_size) : ctx;
  const int G = p.n_heads / p.n_kv_heads;
  const int bs = p.block_size, bshift = popcount(bs - 1);   // power of two (host checks): no integer division per key
  device const int* table = block_tables + (long)seq * p.max_blocks;
  const long row_stride = (long)p.n_kv_heads * D;
  const bool active = (int)lane < NC;
  const int col = kvh * D + V * (int)lane;   // this lane's first element within a cache row

  // The G query heads of this KV head (contiguous in q), in float, pre-scaled for base-2 scores: qs[g * D + d]
  const float qscale = p.scale * 1.4426950408889634f;
  const float cap2 = p.softcap * 1.4426950408889634f;   // the soft cap in the same base-2 units as the scores
  for (int i = tid; i < G * D; i += NT) qs[i] = float(q[((long)seq * p.n_heads + kvh * G) * D + i]) * qscale;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // This SIMD-group's online-softmax state per head (m, l uniform across lanes; o = this lane's slice)
  float m[GMAX], l[GMAX];
  fv o[GMAX];
  for (int g = 0; g < GMAX; g++) {
    m[g] = NEG_BIG;
    l[g] = 0.0f;
    o[g] = fv(0.0f);
  }

  for (int k0 = kbeg + U * (int)sg; k0 < kend; k0 += U * NSG) {
    // Issue all row loads of the step first (key k0 is always valid, k0 + u may be past the end)
    // Row scales (int8): every lane needs them, since the scores and weights are uniform across the SIMD-group.
    // For a float cache they stay 1 and the multiplies fold away.
    fv kr[U], vr[U];
    float ks[U], vs[U];
    for (int u = 0; u < U; u++) {
      kr[u] = fv(0.0f);
      vr[u] = fv(0.0f);
      ks[u] = 1.0f;
      vs[u] = 1.0f;
      const int k = k0 + u;
      if (k < kend) {
        const int slot = (table[k >> bshift] << bshift) + (k & (bs - 1));
        if (active) {
          const long at = (long)slot * row_stride + col;
          kr[u] = to_float(*(device const kvv*)(k_cache + at));
          vr[u] = to_float(*(device const kvv*)(v_cache + at));
        }
        if (QUANT) {
          ks[u] = float(k_scale[(long)slot * p.n_kv_heads + kvh]);
          vs[u] = float(v_scale[(long)slot * p.n_kv_heads + kvh]);
        }
      }
    }
    for (int g = 0; g < GMAX; g++) {
      if (g >= G) break;
      const fv qg = active ? *(threadgroup const fv*)(qs + g * D + V * lane) : fv(0.0f);
      float s[U];
      float mx = m[g];
      for (int u = 0; u < U; u++) {
        s[u] = k0 + u < kend ? simd_sum(dot(qg, kr[u])) * ks[u] : NEG_BIG;   // uniform condition: no divergence
        if (p.softcap > 0.0f && k0 + u < kend) s[u] = cap2 * precise::tanh(s[u] / cap2);
        mx = max(mx, s[u]);
      }
      const float corr = exp2(m[g] - mx);
      float lsum = l[g] * corr;
      fv acc = o[g] * corr;
      for (int u = 0; u < U; u++) {
        const float pu = exp2(s[u] - mx);
        lsum += pu;
        acc += (pu * vs[u]) * vr[u];
      }
      m[g] = mx;
      l[g] = lsum;
      o[g] = acc;
    }
  }

  // Merge the SIMD-groups head by head; qs is free once every SIMD-group has left the key loop
  threadgroup float* red_m = red;
  threadgroup float* red_l = red + NSG;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int g = 0; g < GMAX; g++) {
    if (g >= G) break;
    if (active) *(threadgroup fv*)(qs + sg * D + V * lane) = o[g];
    if (lane == 0) {
      red_m[sg] = m[g];
      red_l[sg] = l[g];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if ((int)tid < D / 4) {   // thread = float4 chunk of the head's output
      float mx = NEG_BIG;
      for (int s = 0; s < NSG; s++) mx = max(mx, red_m[s]);
      float sum = 0.0f;
      float4 acc = float4(0.0f);
      for (int s = 0; s < NSG; s++) {
        const float w = exp2(red_m[s] - mx);
        sum += red_l[s] * w;
        acc += *(threadgroup const float4*)(qs + s * D + 4 * tid) * w;
      }
      const float4 res = sum > 0.0f ? acc / sum : float4(0.0f);
      const long head = (long)seq * p.n_heads + kvh * G + g;
      if (PARTITIONED) {
        const long idx = head * p.num_partitions + part;
        *(device float4*)(tmp_out + idx * D + 4 * tid) = res;
        if (tid == 0) {
          exp_sums[idx] = sum;
          max_logits[idx] = mx;
        }
      } else {
        *(device vec<T, 4>*)(out + head * D + 4 * tid) = to_vec4<T>(res);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

template <typename T, typename KV, int D, int GMAX>
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
  threadgroup __attribute__((aligned(16))) float qs[8 * D];   // read as float4 (and float2): Metal needs 16-byte alignment
  threadgroup float red[2 * 8];
  paged_decode_impl<T, KV, D, D == 64 ? 2 : 4, GMAX, false>(q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens,
                                                            out, nullptr, nullptr, nullptr, p, qs, red, tgid, tid, lane, sg);
}

template <typename T, typename KV, int D, int GMAX>
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
  threadgroup __attribute__((aligned(16))) float qs[8 * D];   // read as float4 (and float2): Metal needs 16-byte alignment
  threadgroup float red[2 * 8];
  paged_decode_impl<T, KV, D, D == 64 ? 2 : 4, GMAX, true>(q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens,
                                                           nullptr, tmp_out, exp_sums, max_logits, p, qs, red, tgid, tid, lane, sg);
}

// The int8-cache kernels: the same, with the scale buffers after the caches
template <typename T, int D, int GMAX>
[[kernel]] void paged_attention_decode_i8(
    device const T* q [[buffer(0)]],
    device const char* k_cache [[buffer(1)]],
    device const char* v_cache [[buffer(2)]],
    device const half* k_scale [[buffer(3)]],
    device const half* v_scale [[buffer(4)]],
    device const int* block_tables [[buffer(5)]],
    device const int* context_lens [[buffer(6)]],
    device T* out [[buffer(7)]],
    constant PagedParams& p [[buffer(8)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup __attribute__((aligned(16))) float qs[8 * D];   // read as float4 (and float2): Metal needs 16-byte alignment
  threadgroup float red[2 * 8];
  paged_decode_impl<T, char, D, D == 64 ? 2 : 4, GMAX, false>(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                                              out, nullptr, nullptr, nullptr, p, qs, red, tgid, tid, lane, sg);
}

template <typename T, int D, int GMAX>
[[kernel]] void paged_attention_decode_partitioned_i8(
    device const T* q [[buffer(0)]],
    device const char* k_cache [[buffer(1)]],
    device const char* v_cache [[buffer(2)]],
    device const half* k_scale [[buffer(3)]],
    device const half* v_scale [[buffer(4)]],
    device const int* block_tables [[buffer(5)]],
    device const int* context_lens [[buffer(6)]],
    device float* tmp_out [[buffer(7)]],
    device float* exp_sums [[buffer(8)]],
    device float* max_logits [[buffer(9)]],
    constant PagedParams& p [[buffer(10)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup __attribute__((aligned(16))) float qs[8 * D];
  threadgroup float red[2 * 8];
  paged_decode_impl<T, char, D, D == 64 ? 2 : 4, GMAX, true>(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                                             nullptr, tmp_out, exp_sums, max_logits, p, qs, red, tgid, tid, lane, sg);
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
  const int ctx = context_lens[seq];
  // the partitions with keys the query sees: from its window's first key's to its last key's
  const int first = first_key(ctx, p) / p.partition_size, used = (ctx + p.partition_size - 1) / p.partition_size;
  const long row = (long)seq * p.n_heads + head;
  device const float* part0 = tmp_out + row * p.num_partitions * D + 4 * tid;
  float4 res = float4(0.0f);
  if (used - first == 1) {
    res = *(device const float4*)(part0 + first * D);   // already normalised
  } else if (used - first > 1) {
    float mx = -FLT_MAX;
    for (int i = first; i < used; i++) mx = max(mx, max_logits[row * p.num_partitions + i]);
    float sum = 0.0f;
    float4 acc = float4(0.0f);
    for (int i = first; i < used; i++) {
      const long idx = row * p.num_partitions + i;
      const float w = exp_sums[idx] * exp2(max_logits[idx] - mx);
      sum += w;
      acc += *(device const float4*)(part0 + i * D) * w;
    }
    res = sum > 0.0f ? acc / sum : float4(0.0f);
  }
  *(device vec<T, 4>*)(out + row * D + 4 * tid) = to_vec4<T>(res);
}

#define INSTANTIATE_DECODE_G(xn, X, cn, C, D, GM)                                                                  \
  template [[host_name("paged_attention_decode_" #xn "_" #cn "_" #D "_g" #GM)]] [[kernel]]                         \
  decltype(paged_attention_decode<X, C, D, GM>) paged_attention_decode<X, C, D, GM>;                              \
  template [[host_name("paged_attention_decode_partitioned_" #xn "_" #cn "_" #D "_g" #GM)]] [[kernel]]             \
  decltype(paged_attention_decode_partitioned<X, C, D, GM>) paged_attention_decode_partitioned<X, C, D, GM>;
// GMAX in {2, 4, 8}: a GMAX = 1 family would save one head of state (V + 2 registers) for MHA models, not worth
// 32 more instantiations (emulator compile time grows with each one)
#define INSTANTIATE_DECODE(xn, X, cn, C, D) \
  INSTANTIATE_DECODE_G(xn, X, cn, C, D, 2) INSTANTIATE_DECODE_G(xn, X, cn, C, D, 4) INSTANTIATE_DECODE_G(xn, X, cn, C, D, 8)
#define INSTANTIATE_DECODE_D(xn, X, cn, C) \
  INSTANTIATE_DECODE(xn, X, cn, C, 64) INSTANTIATE_DECODE(xn, X, cn, C, 80) \
  INSTANTIATE_DECODE(xn, X, cn, C, 96) INSTANTIATE_DECODE(xn, X, cn, C, 128)
INSTANTIATE_DECODE_D(f32, float, f32, float)
INSTANTIATE_DECODE_D(f32, float, f16, half)
INSTANTIATE_DECODE_D(f16, half, f32, float)
INSTANTIATE_DECODE_D(f16, half, f16, half)

#define INSTANTIATE_DECODE_I8_G(xn, X, D, GM)                                                                      \
  template [[host_name("paged_attention_decode_" #xn "_i8_" #D "_g" #GM)]] [[kernel]]                              \
  decltype(paged_attention_decode_i8<X, D, GM>) paged_attention_decode_i8<X, D, GM>;                               \
  template [[host_name("paged_attention_decode_partitioned_" #xn "_i8_" #D "_g" #GM)]] [[kernel]]                  \
  decltype(paged_attention_decode_partitioned_i8<X, D, GM>) paged_attention_decode_partitioned_i8<X, D, GM>;
#define INSTANTIATE_DECODE_I8(xn, X, D) \
  INSTANTIATE_DECODE_I8_G(xn, X, D, 2) INSTANTIATE_DECODE_I8_G(xn, X, D, 4) INSTANTIATE_DECODE_I8_G(xn, X, D, 8)
#define INSTANTIATE_DECODE_I8_D(xn, X) \
  INSTANTIATE_DECODE_I8(xn, X, 64) INSTANTIATE_DECODE_I8(xn, X, 80) INSTANTIATE_DECODE_I8(xn, X, 96) INSTANTIATE_DECODE_I8(xn, X, 128)
INSTANTIATE_DECODE_I8_D(f32, float)
INSTANTIATE_DECODE_I8_D(f16, half)

template [[host_name("paged_attention_reduce_f32")]] [[kernel]] decltype(paged_attention_reduce<float>) paged_attention_reduce<float>;
template [[host_name("paged_attention_reduce_f16")]] [[kernel]] decltype(paged_attention_reduce<half>) paged_attention_reduce<half>;
