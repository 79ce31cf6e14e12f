// Prefill attention over the paged KV cache, for a chunk of new tokens (their K/V already in the cache):
// flash attention with 8x8 simdgroup matrices (QK^T and PV on the matrix units, online softmax in float).
//
// paged_attention_prefill_<x>_<c>_<D>: x = dtype of q and out, c = dtype of the caches, D in {64, 80, 96, 128}.
//   Token t belongs to sequence token_seq[t] (a row of block_tables; -1 = padding -> zeros) and sits at
//   absolute position token_pos[t]; it attends to keys 0..token_pos[t] of its sequence, which is causal inside
//   the chunk and full attention to the cached prefix (with params.window > 0, only keys above token_pos[t] - window;
//   with params.softcap > 0, scores soft-capped as in Gemma 2). Tokens may come in any order and mix sequences.
//   grid: (ceil(num_tokens / TQ), n_kv_heads) threadgroups of 128 threads (4 SIMD-groups), where
//   TQ = tokens_per_tile = max(1, 32 / G) and G = n_heads / n_kv_heads <= 16.
//   buffers:
//     0 q            [T, n_heads, D]                          x
//     1 k_cache      [num_blocks, block_size, n_kv_heads, D]  c
//     2 v_cache      [num_blocks, block_size, n_kv_heads, D]  c
//     3 block_tables [num_seqs, max_blocks]                   int32
//     4 token_seq    [T]                                      int32
//     5 token_pos    [T]                                      int32
//     6 out          [T, n_heads, D]                          x
//     7 params       PrefillParams
//
// paged_attention_prefill_<x>_i8_<D>: the same over an int8 cache (kv_cache_dtype="int8", tinyvllm/kernels/kv_cache.py).
//   buffers: 0 q, 1 k_cache [.., D] char (int8 codes), 2 v_cache char, 3 k_scale [num_blocks, block_size, n_kv_heads]
//   half, 4 v_scale half (row (s, kvh) ~ scale[s * n_kv_heads + kvh] * codes), 5 block_tables, 6 token_seq,
//   7 token_pos, 8 out, 9 params.
//   The cache is dequantized where the tiles are staged (step 1 below): a thread loads 4 codes of a row (one char4,
//   coalesced along D as before) and that row's scale, and stores scale * codes into threadgroup memory in the tile
//   dtype, which for an int8 cache is the activation dtype x (half x half -> float MMAs for f16 activations; for
//   f32 activations float tiles, where scale * code is exact: 11 + 7 significant bits). Everything after the staging
//   is the float-cache kernel unchanged. Device bytes per key tile: 2 * BK * (D + 2) instead of 2 * BK * D * sizeof(c).
//   With half tiles, scale * code is rounded to half (2^-11 relative, several times below the int8 step amax / 254).
//
// Design (flash attention as in MLX's steel attention / llama.cpp's flash_attn_ext, over a paged cache).
//   A threadgroup owns BQ = 32 query rows r = (token t0 + r / G, query head kvh * G + r % G) of TQ consecutive
//   tokens and one KV head (rows r >= R = TQ * G are idle; the G query heads of a KV head share every K/V tile).
//   SIMD-group sg owns rows 8 sg .. 8 sg + 7: its Q (D / 8 fragments, tile dtype) and its output O (D / 8 float
//   fragments, 8 x D) stay in simdgroup matrices for the whole kernel. Lane i of every SIMD-group holds token
//   t0 + i (TQ <= 32), so finding the tile's sequences and their key ranges is a few SIMD operations.
//   Tokens may come in any order and mix sequences: for each distinct sequence s of the tile (at its first
//   token), the threadgroup walks keys 0 .. kmax(s) - 1 (kmax = 1 + the largest position of s in the tile) in
//   tiles of BK keys:
//     1. all 128 threads gather the tile's K and V rows through s's block table into threadgroup memory
//        (vec4 loads coalesced along D, as in the decode kernel; keys >= kmax are zero-filled, so 0 * V is 0);
//     2. a SIMD-group whose rows see any of these keys (a row of sequence s with position >= k0) computes
//        S (8 x BK) = Q K^T, (D / 8) MMAs per 8 keys (K fragments loaded transposed), in float; 8-key blocks
//        past its rows' last position are skipped (the causal diagonal);
//     3. online softmax on the S fragments in registers. A lane holds 2 elements of each 8x8 fragment, all in
//        one row (Apple's layout, as MLX: row (l / 16) * 4 + (l / 2) % 4, columns ((l / 8) % 2) * 4 + (l % 2) * 2
//        and the next), the same row in S, P and O: a row's max and sum are the lane's elements reduced with
//        simd_shuffle_xor 1 and 8, and O is rescaled in place through thread_elements(). Key k counts for a row
//        iff the row's token is in sequence s and k <= its position (sequence + causal mask, per row, so any
//        order is right); masked probabilities are set to 0 explicitly (never exp of a sentinel) and the
//        running max starts at -FLT_MAX (finite): a row that sees no key of a tile, or of a whole sequence,
//        keeps l = 0 and O = 0, no NaN, and padding rows write zeros;
//     4. P goes into simdgroup matrices of the tile dtype (for a half tile P is rounded to half, 2^-11
//        relative, as in llama.cpp; l sums the float values) and O += P V, (D / 8) MMAs per 8 keys.
//   Rows of other sequences in the tile cost masked work only; chunked prefill packs each sequence's tokens
//   contiguously, so a tile nearly always holds one sequence (two at a boundary). At the end each lane writes
//   its own O elements / l straight to out. MMA inputs are in the tile dtype (the cache dtype; the activation dtype
//   for an int8 cache): half x half -> float or float x float, accumulation and softmax in float, exp2 with
//   scale * log2(e) folded into the scores.
// Sizes (e = sizeof of the tile dtype). BK = 32 keys when the K and V tiles fit in 16 KB, else 16 (float tiles;
//   half with D = 128, as MLX's bk = 16 for D = 128). Tile rows are padded to D + 4 elements (strided fragment loads
//   spread over banks; rows stay 8/16-byte aligned for the vec4 stores). Threadgroup memory = 2 * BK * (D + 4) * e: half
//   8.5 / 10.5 / 12.5 / 8.25 KB for D = 64 / 80 / 96 / 128, float 8.5 / 10.5 / 12.5 / 16.5 KB; Q is staged
//   once through the same buffer (32 rows <= 2 * BK). Per key tile and threadgroup: 4 * 32 * BK * D FLOPs on
//   the matrix units (QK^T + PV; 262144 for half D = 128, BK = 16) for 2 * BK * D * sizeof(c) bytes of K/V
//   from device memory (8 KB), i.e. 64 / sizeof(c) FLOP/byte (32 for half; about 62 for int8, D + 2 bytes a row):
//   each K/V element is read once per 32 query rows; each SIMD-group then reads the whole tile from threadgroup
//   memory.
#include <metal_stdlib>
using namespace metal;

struct PrefillParams {
  int num_tokens;
  int n_heads;
  int n_kv_heads;
  int block_size;
  int max_blocks;
  int tokens_per_tile;  // TQ
  float scale;
  int window;           // sliding window: keys above token_pos - window only (0: all)
  float softcap;        // scores soft-capped (0: none)
};

// Tile geometry for tiles of dtype KT: rows padded to KS elements, BK keys per tile, 2 BK rows (K then V)
template <typename KT, int D> struct PrefillTiles {
  static constexpr int KS = D + 4;
  static constexpr int BK = 2 * 32 * KS * (int)sizeof(KT) <= 16384 ? 32 : 16;
  static constexpr int SIZE = 2 * BK * KS;
};

template <typename KT> METAL_FUNC vec<KT, 4> to_vec4(float4 v);
template <> METAL_FUNC float4 to_vec4<float>(float4 v) { return v; }
template <> METAL_FUNC half4 to_vec4<half>(float4 v) { return half4(v); }

// 4 consecutive elements of a cache row as tile elements: a float cache as stored; int8 codes times the row's scale
// (scale_idx = slot * n_kv_heads + kv_head), converted once to the tile dtype
template <typename KT>
METAL_FUNC vec<KT, 4> load_row4(device const KT* row, device const half*, long) { return *(device const vec<KT, 4>*)row; }
template <typename KT>
METAL_FUNC vec<KT, 4> load_row4(device const char* row, device const half* scale, long scale_idx) {
  return to_vec4<KT>(float4(*(device const char4*)row) * float(scale[scale_idx]));
}

// KV: the cache's storage (float, half, char = int8 codes with k_scale/v_scale); KT: the tile and MMA dtype
template <typename T, typename KV, typename KT, int D>
METAL_FUNC void paged_prefill_impl(
    device const T* q, device const KV* k_cache, device const KV* v_cache, device const half* k_scale,
    device const half* v_scale, device const int* block_tables, device const int* token_seq, device const int* token_pos,
    device T* out, constant PrefillParams& p, threadgroup KT* kvs, uint3 tgid, uint tid, uint lane, uint sg) {
  constexpr int NT = 128;                                         // threads
  constexpr int BQ = 32;                                          // query rows per threadgroup, 8 per SIMD-group
  constexpr int KS = PrefillTiles<KT, D>::KS;                     // padded row stride of the tiles (elements)
  constexpr int BK = PrefillTiles<KT, D>::BK;                     // keys per tile
  constexpr int ND = D / 8, NKB = BK / 8;                         // fragments along D and along the keys
  constexpr int D4 = D / 4;
  const float NEG_BIG = -FLT_MAX;                                 // finite "minus infinity"

  // K tile rows [0, BK), V tile rows [BK, 2 BK); before the key loop, the 32 Q rows
  threadgroup const KT* ks = kvs;
  threadgroup const KT* vs = kvs + BK * KS;

  const int G = p.n_heads / p.n_kv_heads, TQ = p.tokens_per_tile, R = TQ * G;
  const int t0 = tgid.x * TQ, kvh = tgid.y;
  const int ntok = min(TQ, p.num_tokens - t0);
  const long kv_row = (long)p.n_kv_heads * D;
  const float qk_scale = p.scale * 1.4426950408889634f;          // scores in log2 units: exp2
  const float cap2 = p.softcap * 1.4426950408889634f;            // the soft cap in the same units

  // This lane's row of every fragment (Apple's simdgroup_matrix layout) and the two columns it holds
  const int frow = (int)((lane / 16) * 4 + (lane / 2) % 4), fcol = (int)(((lane / 8) % 2) * 4 + (lane % 2) * 2);
  // Lane i of every SIMD-group holds token t0 + i of the tile (TQ <= 32): sequence scans are SIMD operations
  const int lane_seq = (int)lane < ntok ? token_seq[t0 + lane] : -1;
  const int lane_pos = (int)lane < ntok ? token_pos[t0 + lane] : -1;
  const int my_r = (int)sg * 8 + frow;
  const bool my_real = my_r < R && my_r / G < ntok;
  const int tok_seq = simd_shuffle(lane_seq, (ushort)(my_r / G)), tok_pos = simd_shuffle(lane_pos, (ushort)(my_r / G));
  const int my_seq = my_real ? tok_seq : -2;                     // -2: no token (never matches a sequence)
  const int my_pos = my_real ? tok_pos : -1;

  // Stage Q (rows past R or past the chunk are zeros) in the tile dtype, then load this SIMD-group's fragments
  for (int i = tid; i < BQ * D4; i += NT) {
    const int r = i / D4, c = 4 * (i % D4);
    float4 x = float4(0.0f);
    if (r < R && r / G < ntok)
      x = float4(*(device const vec<T, 4>*)(q + ((long)(t0 + r / G) * p.n_heads + kvh * G + r % G) * D + c));
    for (int j = 0; j < 4; j++) kvs[r * KS + c + j] = KT(x[j]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<KT, 8, 8> qf[ND];
  for (int d = 0; d < ND; d++) simdgroup_load(qf[d], ks + sg * 8 * KS + d * 8, KS);

  simdgroup_float8x8 of[ND];
  for (int d = 0; d < ND; d++) of[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  float m = NEG_BIG, l = 0.0f;  // this lane's row: running max (log2 units) and sum

  // For each sequence in the tile, at its first token (the same in every SIMD-group: threadgroup-uniform)
  for (int i = 0; i < ntok; i++) {
    const int s = simd_shuffle(lane_seq, (ushort)i);
    if (s < 0 || simd_any((int)lane < i && lane_seq == s)) continue;  // padding, or sequence already done
    // keys [0, kmax) are needed by some row of sequence s, [0, sg_kmax) by this SIMD-group's rows
    // (float reductions: exact for positions < 2^24)
    const int kmax = (int)simd_max(lane_seq == s ? float(lane_pos + 1) : 0.0f);
    const int sg_kmax = (int)simd_max(my_seq == s ? float(my_pos + 1) : 0.0f);
    // with a sliding window, no row of s sees keys below its earliest token's window: start at that key's tile
    const int kmin = p.window > 0 ? (int)simd_min(lane_seq == s ? float(max(0, lane_pos + 1 - p.window)) : FLT_MAX) : 0;
    device const int* table = block_tables + (long)s * p.max_blocks;

    for (int k0 = kmin / BK * BK; k0 < kmax; k0 += BK) {
      // 1. Gather the K and V tiles (the barrier before: every SIMD-group is done with the previous tile / Q)
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int e = tid; e < BK * D4; e += NT) {
        const int j = e / D4, c = 4 * (e % D4), k = k0 + j;
        vec<KT, 4> kx = vec<KT, 4>(KT(0)), vx = vec<KT, 4>(KT(0));
        if (k < kmax) {
          const long slot = table[k / p.block_size] * p.block_size + k % p.block_size;
          const long base = slot * kv_row + kvh * D + c, srow = slot * p.n_kv_heads + kvh;
          kx = load_row4<KT>(k_cache + base, k_scale, srow);
          vx = load_row4<KT>(v_cache + base, v_scale, srow);
        }
        *(threadgroup vec<KT, 4>*)(kvs + j * KS + c) = kx;
        *(threadgroup vec<KT, 4>*)(kvs + (BK + j) * KS + c) = vx;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (k0 >= sg_kmax) continue;  // no row of this SIMD-group sees these keys (uniform per SIMD-group)
      const int nkb = min(NKB, (sg_kmax - k0 + 7) / 8);  // 8-key blocks some row of the SIMD-group sees (causal)

      // 2. S = Q K^T, 8 rows x BK keys (blocks past nkb stay 0 and are masked below)
      simdgroup_float8x8 sf[NKB];
      for (int kb = 0; kb < NKB; kb++) {
        sf[kb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        if (kb < nkb)
          for (int d = 0; d < ND; d++) {
            simdgroup_matrix<KT, 8, 8> kt;
            simdgroup_load(kt, ks + kb * 8 * KS + d * 8, KS, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(sf[kb], qf[d], kt, sf[kb]);
          }
      }

      // 3. Online softmax of this lane's row (its 2 * NKB elements, then across the row's 4 lanes)
      float sc[NKB][2];
      float tmax = NEG_BIG;
      for (int kb = 0; kb < NKB; kb++)
        for (int e = 0; e < 2; e++) {
          const int key = k0 + kb * 8 + fcol + e;
          const bool valid = my_seq == s && key <= my_pos && (p.window == 0 || key > my_pos - p.window);
          const float sv = float(sf[kb].thread_elements()[e]) * qk_scale;
          sc[kb][e] = !valid ? NEG_BIG : p.softcap > 0.0f ? cap2 * precise::tanh(sv / cap2) : sv;
          tmax = max(tmax, sc[kb][e]);
        }
      tmax = max(tmax, simd_shuffle_xor(tmax, 1));
      tmax = max(tmax, simd_shuffle_xor(tmax, 8));
      const float m_new = max(m, tmax);
      const float corr = exp2(m - m_new);
      float tsum = 0.0f;
      simdgroup_matrix<KT, 8, 8> pf[NKB];
      for (int kb = 0; kb < NKB; kb++)
        for (int e = 0; e < 2; e++) {
          const int key = k0 + kb * 8 + fcol + e;
          const bool valid = my_seq == s && key <= my_pos && (p.window == 0 || key > my_pos - p.window);
          const float pe = valid ? exp2(sc[kb][e] - m_new) : 0.0f;
          tsum += pe;
          pf[kb].thread_elements()[e] = KT(pe);
        }
      tsum += simd_shuffle_xor(tsum, 1);
      tsum += simd_shuffle_xor(tsum, 8);
      l = l * corr + tsum;
      m = m_new;
      for (int d = 0; d < ND; d++) {
        of[d].thread_elements()[0] *= corr;
        of[d].thread_elements()[1] *= corr;
      }

      // 4. O += P V
      for (int d = 0; d < ND; d++)
        for (int kb = 0; kb < NKB; kb++)
          if (kb < nkb) {
            simdgroup_matrix<KT, 8, 8> vf;
            simdgroup_load(vf, vs + kb * 8 * KS + d * 8, KS);
            simdgroup_multiply_accumulate(of[d], pf[kb], vf, of[d]);
          }
    }
  }

  // Write this lane's elements of its row (padding tokens and rows that saw no key give zeros)
  if (my_r < R && my_r / G < ntok) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    device T* o = out + ((long)(t0 + my_r / G) * p.n_heads + kvh * G + my_r % G) * D + fcol;
    for (int d = 0; d < ND; d++) {
      o[d * 8] = T(float(of[d].thread_elements()[0]) * inv);
      o[d * 8 + 1] = T(float(of[d].thread_elements()[1]) * inv);
    }
  }
}

template <typename T, typename KV, int D>
[[kernel]] void paged_attention_prefill(
    device const T* q [[buffer(0)]],
    device const KV* k_cache [[buffer(1)]],
    device const KV* v_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* token_seq [[buffer(4)]],
    device const int* token_pos [[buffer(5)]],
    device T* out [[buffer(6)]],
    constant PrefillParams& p [[buffer(7)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup __attribute__((aligned(16))) KV kvs[PrefillTiles<KV, D>::SIZE];
  paged_prefill_impl<T, KV, KV, D>(q, k_cache, v_cache, nullptr, nullptr, block_tables, token_seq, token_pos, out, p, kvs,
                                   tgid, tid, lane, sg);
}

template <typename T, int D>
[[kernel]] void paged_attention_prefill_i8(
    device const T* q [[buffer(0)]],
    device const char* k_cache [[buffer(1)]],
    device const char* v_cache [[buffer(2)]],
    device const half* k_scale [[buffer(3)]],
    device const half* v_scale [[buffer(4)]],
    device const int* block_tables [[buffer(5)]],
    device const int* token_seq [[buffer(6)]],
    device const int* token_pos [[buffer(7)]],
    device T* out [[buffer(8)]],
    constant PrefillParams& p [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup __attribute__((aligned(16))) T kvs[PrefillTiles<T, D>::SIZE];   // tiles in the activation dtype
  paged_prefill_impl<T, char, T, D>(q, k_cache, v_cache, k_scale, v_scale, block_tables, token_seq, token_pos, out, p, kvs,
                                    tgid, tid, lane, sg);
}

#define INSTANTIATE_PREFILL(xn, X, cn, C, D)                                          \
  template [[host_name("paged_attention_prefill_" #xn "_" #cn "_" #D)]] [[kernel]]    \
  decltype(paged_attention_prefill<X, C, D>) paged_attention_prefill<X, C, D>;
#define INSTANTIATE_PREFILL_D(xn, X, cn, C) \
  INSTANTIATE_PREFILL(xn, X, cn, C, 64) INSTANTIATE_PREFILL(xn, X, cn, C, 80) \
  INSTANTIATE_PREFILL(xn, X, cn, C, 96) INSTANTIATE_PREFILL(xn, X, cn, C, 128)
INSTANTIATE_PREFILL_D(f32, float, f32, float)
INSTANTIATE_PREFILL_D(f32, float, f16, half)
INSTANTIATE_PREFILL_D(f16, half, f32, float)
INSTANTIATE_PREFILL_D(f16, half, f16, half)

#define INSTANTIATE_PREFILL_I8(xn, X, D)                                         \
  template [[host_name("paged_attention_prefill_" #xn "_i8_" #D)]] [[kernel]]   \
  decltype(paged_attention_prefill_i8<X, D>) paged_attention_prefill_i8<X, D>;
#define INSTANTIATE_PREFILL_I8_D(xn, X) \
  INSTANTIATE_PREFILL_I8(xn, X, 64) INSTANTIATE_PREFILL_I8(xn, X, 80) INSTANTIATE_PREFILL_I8(xn, X, 96) INSTANTIATE_PREFILL_I8(xn, X, 128)
INSTANTIATE_PREFILL_I8_D(f32, float)
INSTANTIATE_PREFILL_I8_D(f16, half)
