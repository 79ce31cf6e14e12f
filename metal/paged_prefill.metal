// Prefill attention over the paged KV cache, for a chunk of new tokens (their K/V already in the cache).
//
// paged_attention_prefill_<x>_<c>_<D>: x = dtype of q and out, c = dtype of the caches, D in {64, 80, 96, 128}.
//   Token t belongs to sequence token_seq[t] (a row of block_tables; -1 = padding -> zeros) and sits at
//   absolute position token_pos[t]; it attends to keys 0..token_pos[t] of its sequence, which is causal inside
//   the chunk and full attention to the cached prefix.
//   grid: (ceil(num_tokens / TQ), n_kv_heads) threadgroups of 128 threads (4 SIMD-groups), where
//   TQ = tokens_per_tile = max(1, 16 / G) and G = n_heads / n_kv_heads <= 16. A threadgroup owns the
//   R = TQ * G query rows (token, query head) of TQ consecutive tokens for one KV head: SIMD-group sg owns rows
//   sg, sg + 4, ... For each sequence present in the tile it walks the keys in tiles of TK (32 for a half
//   cache, 16 for float), staging K and V in threadgroup memory once for all R rows. Per row and tile: lanes
//   score keys (32 / TK lanes per key), simd_max / simd_sum update the online softmax in float, the tile's
//   probabilities go through a per-SIMD-group scratch in threadgroup memory (simdgroup_barrier), and each lane
//   accumulates the output elements d = lane + 32 i.
//   buffers:
//     0 q            [T, n_heads, D]                          x
//     1 k_cache      [num_blocks, block_size, n_kv_heads, D]  c
//     2 v_cache      [num_blocks, block_size, n_kv_heads, D]  c
//     3 block_tables [num_seqs, max_blocks]                   int32
//     4 token_seq    [T]                                      int32
//     5 token_pos    [T]                                      int32
//     6 out          [T, n_heads, D]                          x
//     7 params       PrefillParams
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
};

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
  constexpr int NSG = 4;                          // SIMD-groups
  constexpr int RMAX = 16;                        // most query rows per threadgroup
  constexpr int RPS = RMAX / NSG;                 // rows per SIMD-group
  constexpr int TK = sizeof(KV) == 2 ? 32 : 16;   // keys per tile
  constexpr int LPK = 32 / TK;                    // lanes per key when scoring
  constexpr int DP = D / LPK;                     // elements of a key each scoring lane covers
  constexpr int KS = D + 4;                       // padded row stride of the K/V tiles (fewer bank conflicts)
  constexpr int NE = (D + 31) / 32;               // output elements per lane
  const float NEG_BIG = -FLT_MAX;

  threadgroup float4 qs4[RMAX * D / 4];
  threadgroup vec<KV, 4> ks4[TK * KS / 4];
  threadgroup vec<KV, 4> vs4[TK * KS / 4];
  threadgroup float ps[NSG * TK];
  threadgroup const KV* vs = (threadgroup const KV*)vs4;

  const int G = p.n_heads / p.n_kv_heads, TQ = p.tokens_per_tile, R = TQ * G;
  const int t0 = tgid.x * TQ, kvh = tgid.y;
  const int ntok = min(TQ, p.num_tokens - t0);
  const long kv_row = (long)p.n_kv_heads * D;

  // Query rows, pre-scaled: row r = (token t0 + r / G, head kvh * G + r % G)
  for (int i = tid; i < R * D / 4; i += NSG * 32) {
    const int r = i / (D / 4), c = 4 * (i % (D / 4));
    float4 x = float4(0.0f);
    if (r / G < ntok)
      x = float4(*(device const vec<T, 4>*)(q + ((long)(t0 + r / G) * p.n_heads + kvh * G + r % G) * D + c)) * p.scale;
    qs4[i] = x;
  }

  float m[RPS], l[RPS], o[RPS][NE];
  for (int j = 0; j < RPS; j++) {
    m[j] = NEG_BIG;
    l[j] = 0.0f;
    for (int e = 0; e < NE; e++) o[j][e] = 0.0f;
  }
  const int kk = lane % TK, part = lane / TK;

  // For each sequence in the tile (first token of each distinct sequence)
  for (int i = 0; i < ntok; i++) {
    const int s = token_seq[t0 + i];
    bool seen = s < 0;
    for (int j = 0; j < i; j++) seen = seen || token_seq[t0 + j] == s;
    if (seen) continue;
    int kmax = 0;  // keys [0, kmax) are needed by some row of this sequence
    for (int j = i; j < ntok; j++)
      if (token_seq[t0 + j] == s) kmax = max(kmax, token_pos[t0 + j] + 1);
    device const int* table = block_tables + (long)s * p.max_blocks;

    // For each key tile: stage K and V, then every SIMD-group updates its rows
    for (int k0 = 0; k0 < kmax; k0 += TK) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int e = tid; e < TK * D / 4; e += NSG * 32) {
        const int j = e / (D / 4), c = 4 * (e % (D / 4)), k = k0 + j;
        vec<KV, 4> kx = vec<KV, 4>(KV(0)), vx = vec<KV, 4>(KV(0));
        if (k < kmax) {
          const long base = (long)(table[k / p.block_size] * p.block_size + k % p.block_size) * kv_row + kvh * D + c;
          kx = *(device const vec<KV, 4>*)(k_cache + base);
          vx = *(device const vec<KV, 4>*)(v_cache + base);
        }
        ks4[(j * KS + c) / 4] = kx;
        vs4[(j * KS + c) / 4] = vx;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      for (int j = 0; j < RPS; j++) {
        const int r = sg + NSG * j;
        if (r >= R || r / G >= ntok || token_seq[t0 + r / G] != s) continue;
        const int pos = token_pos[t0 + r / G];
        float sc = 0.0f;
        for (int c = part * DP; c < (part + 1) * DP; c += 4)
          sc += dot(qs4[(r * D + c) / 4], float4(ks4[(kk * KS + c) / 4]));
        if (LPK == 2) sc += simd_shuffle_xor(sc, 16);
        const bool valid = k0 + kk <= pos;
        const float m_new = max(m[j], simd_max(valid ? sc : NEG_BIG));
        const float corr = exp(m[j] - m_new);
        const float pk = valid ? exp(sc - m_new) : 0.0f;
        l[j] = l[j] * corr + simd_sum(part == 0 ? pk : 0.0f);
        for (int e = 0; e < NE; e++) o[j][e] *= corr;
        if (part == 0) ps[sg * TK + kk] = pk;  // this SIMD-group's probabilities, read back by every lane
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int kj = 0; kj < TK; kj++) {
          const float pj = ps[sg * TK + kj];
          for (int e = 0; e < NE; e++) {
            const int d = lane + 32 * e;
            if (d < D) o[j][e] += pj * float(vs[kj * KS + d]);
          }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // before the next row overwrites ps
        m[j] = m_new;
      }
    }
  }

  // Write the rows (padding tokens and empty rows give zeros)
  for (int j = 0; j < RPS; j++) {
    const int r = sg + NSG * j;
    if (r >= R || r / G >= ntok) continue;
    const long row = (long)(t0 + r / G) * p.n_heads + kvh * G + r % G;
    for (int e = 0; e < NE; e++) {
      const int d = lane + 32 * e;
      if (d < D) out[row * D + d] = T(l[j] > 0.0f ? o[j][e] / l[j] : 0.0f);
    }
  }
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
