// y[M, N] = x[M, K] @ W^T for a 4-bit affine-quantised weight W [N, K].
//
// Weight layout (shared with tinyvllm.quant): groups of G in {32, 64, 128} consecutive k of a row share a scale and
// a bias; w[n, k] = scales[n, k / G] * q[n, k] + biases[n, k / G], q in 0..15.
//   w_packed  [N, K / 8]  uint32   8 codes per word, the lowest k in the lowest 4 bits (MLX's order)
//   scales    [N, K / G]  half
//   biases    [N, K / G]  half
// Since 32 divides G, an aligned run of 8, 16 or 32 codes (a word, uint2 or uint4) always shares one scale and bias,
// so its contribution is scale * sum(x * q) + bias * sum(x), accumulated in float. K must be a multiple of G.
//
// int4_gemv_<x> (decode, M <= 8; x = dtype of x and y)
//   A lane takes a chunk of 16 codes (one uint2: 8 bytes, inside one group since 32 divides G) of each of R = 4
//   weight rows and applies that load to all M rows of x, so every weight byte is read once per call. The 32 lanes
//   of a SIMD-group form 32 / L teams of L = p.team_lanes lanes (32, 16 or 8; the host picks the width that leaves
//   the fewest lanes idle for K, e.g. K = 576 = 36 chunks: L = 8, 90 % busy instead of 56 %); team t owns rows
//   n0 .. n0 + 3 and its lanes read chunks tl, tl + L, ... of them: 8 L contiguous bytes per row and step.
//   grid: ceil(N / (8 * 32 / L)) threadgroups of 64 threads (2 SIMD-groups of 32 / L teams of 4 rows each).
//   Unpacking as in MLX's qmv / llama.cpp's q4_0: x is loaded once per chunk and pre-scaled by 1, 1/16, 1/256,
//   1/4096 by nibble position in a uint16, so each code is only masked in place (`u & 0x00f0` = 16 q) and
//   converted; the bias term uses the unscaled sum of x. Float accumulation; the team's lanes are combined with
//   simd_sum (L = 32) or a simd_shuffle_xor butterfly inside the team.
//   buffers: 0 x [M, K] x, 1 w_packed, 2 scales, 3 biases, 4 y [M, N] x, 5 params
//
// int4_gemv_rms_<x> (decode, M <= 8): the same GEMV of RMSNorm(x) * norm_weight, the norm computed in the kernel (as
//   tinyvllm's portable rms_norm does: x * rsqrt(mean(x^2) + eps) in float, rounded to x's dtype, times the weight in
//   x's dtype), so the layer launches no norm kernels before its projection. Every SIMD-group sums the squares of
//   each x row itself (K floats, one simd_sum: less than the weights it reads), then normalizes each chunk of x as
//   it loads it. eps travels in params.
//   buffers: 0 x [M, K] x (not normed), 1 norm_weight [K] x, 2 w_packed, 3 scales, 4 biases, 5 y [M, N] x, 6 params
//
// int4_gemv_res_<x> (decode, M <= 8): y = residual + x @ W^T, the residual stream's sum done as y is written (the
//   product rounded to x's dtype first, then added in float and rounded again: what a separate add of the two
//   rounded tensors gives), so the layer launches no add after its attention output projection.
//   buffers: 0 x [M, K] x, 1 w_packed, 2 scales, 3 biases, 4 residual [M, N] x, 5 y [M, N] x, 6 params
//
// int4_gemv_glu_<x>, int4_gemv_geglu_<x> (decode, M <= 8): the normed GEMV of the fused gate/up weight ([2 N, K]:
//   gate rows, then up rows) gated as it is written: y[m, n] = act(gate[m, n]) * up[m, n], act SiLU (glu) or GELU's
//   tanh approximation (geglu, Gemma's gelu_pytorch_tanh), both sums in float and y rounded once. A team's 4 weight
//   rows are 2 gate rows and the 2 up rows of the same outputs, so each team writes 2 outputs and the layer launches
//   no gating kernel after its projection. p.N counts the outputs.
//   buffers: as int4_gemv_rms
//
// int4_gemv_rope_<x>_<c> (decode, M <= 8): the normed GEMV of the fused qkv weight ([(H + 2 KVH) D, K]: H query
//   heads, KVH key heads, KVH value heads) with RoPE and the cache write done as it is written, as rope_cache_write
//   does after a GEMV (rope.metal; HF's rotate-half: element i of a head turns with element i + D/2). A team's 4 rows
//   are the rotation pairs (i, i + D/2) of 2 consecutive elements i of a head, so each team writes 2 pairs: q rotated
//   into q_out, k rotated and v into the caches at the token's slot (-1: none), all in float and rounded once. p.N
//   counts the pairs, (H + 2 KVH) D / 2.
//   buffers: 0-4 as int4_gemv_rms (x, norm_weight, w_packed, scales, biases), 5 positions [M] int32, 6 cos_sin
//   [max_pos, D] float (cos of the D/2 frequencies, then their sin), 7 slot_mapping [M] int32, 8 q_out [M, H, D] x,
//   9 k_cache, 10 v_cache [num_blocks, block_size, KVH, D] c, 11 params (n_heads, n_kv_heads, head_dim set)
//
// int4_gemm_<x> (prefill, M > 8)
//   grid: (ceil(N / 32), ceil(M / 32)) threadgroups of 128 threads (4 SIMD-groups), one 32x32 tile of y each.
//   Per step of 32 k: x tile and dequantised W tile staged in threadgroup memory as float; each SIMD-group
//   multiplies a 16x16 sub-tile with 8x8 simdgroup matrices (simdgroup_multiply_accumulate), float accumulation.
//   buffers: same as int4_gemv.
#include <metal_stdlib>
using namespace metal;

struct Int4Params {
  int M;
  int N;
  int K;
  int group_size;
  int team_lanes;  // int4_gemv: lanes per row team (32, 16 or 8); unused by int4_gemm
  float eps;       // int4_gemv_rms: the norm's epsilon; unused by the others
  int n_heads;     // int4_gemv_rope: the heads of q, k (and v), and their size; 0 for the others
  int n_kv_heads;
  int head_dim;
};

// sum_j x[j] * q_j over the 16 codes of one uint2 (four uint16s, the lowest k in the lowest nibble), with xs[i] =
// x[4i .. 4i + 3] pre-scaled by (1, 1/16, 1/256, 1/4096): each nibble is masked where it lies and never shifted.
METAL_FUNC float qdot16(uint2 wq, thread const float4* xs) {
  const ushort4 u = as_type<ushort4>(wq);
  float d = 0.0f;
  for (int i = 0; i < 4; i++) d += dot(xs[i], float4(ushort4(u[i]) & ushort4(0x000f, 0x00f0, 0x0f00, 0xf000)));
  return d;
}

template <typename T> METAL_FUNC vec<T, 4> to_vec4(float4 v);
template <> METAL_FUNC float4 to_vec4<float>(float4 v) { return v; }
template <> METAL_FUNC half4 to_vec4<half>(float4 v) { return half4(v); }

enum Gate { GATE_NONE, GATE_SILU, GATE_GELU_TANH };

METAL_FUNC float activate(float g, Gate act) {
  if (act == GATE_SILU) return g / (1.0f + exp(-g));
  return 0.5f * g * (1.0f + tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// The rotation's inputs and outputs (int4_gemv_rope); null pointers for the other GEMVs
template <typename T, typename C> struct RopeIO {
  device const int* positions;
  device const float* cos_sin;
  device const int* slots;
  device T* q_out;
  device C* k_cache;
  device C* v_cache;
};

// The GEMV; with NORM, of RMSNorm(x) * nw (int4_gemv_rms); with RES, plus res (int4_gemv_res); with ACT, gated
// (int4_gemv_glu: rows r < R / 2 of a team the gate's, the others the up's, of the same outputs); with ROPE, rotated
// and written where q, k and v go (int4_gemv_rope: rows r < R / 2 the first of a rotation pair, the others the second)
template <typename T, bool NORM, bool RES, Gate ACT = GATE_NONE, bool ROPE = false, typename C = T>
METAL_FUNC void gemv(device const T* x, device const T* nw, device const uint* w, device const half* scales,
                     device const half* biases, device const T* res, device T* y, constant Int4Params& p, uint3 tgid,
                     uint lane, uint sg, RopeIO<T, C> io = {}) {
  constexpr int NSG = 2, R = 4, MMAX = 8, OUTS = ACT == GATE_NONE && !ROPE ? R : R / 2;   // outputs a team writes
  const int L = p.team_lanes, teams = 32 / L, team = lane / L, tl = lane % L;
  const int n0 = ((tgid.x * NSG + sg) * teams + team) * OUTS;
  const int half_d = p.head_dim / 2;   // ROPE: output j is the pair of rows (j / half_d) D + j % half_d and half_d on
  const int kw = p.K / 8, kg = p.K / p.group_size;
  const int gshift = p.group_size == 32 ? 1 : (p.group_size == 64 ? 2 : 3);  // chunk index -> group index
  const int nc = n0 < p.N ? p.K / 16 : 0;  // chunks per row; a team past N has none
  const float4 pre = float4(1.0f, 1.0f / 16.0f, 1.0f / 256.0f, 1.0f / 4096.0f);
  float acc[MMAX][R];
  for (int m = 0; m < MMAX; m++)
    for (int r = 0; r < R; r++) acc[m][r] = 0.0f;
  float inv_rms[MMAX];   // NORM: 1 / RMS of each x row, the same in every lane (every lane of the SIMD-group sums)
  for (int m = 0; m < MMAX; m++) {
    inv_rms[m] = 1.0f;
    if (!NORM || m >= p.M) continue;
    float ss = 0.0f;
    for (int k = 4 * (int)lane; k < p.K; k += 128) {
      const float4 xv = float4(*(device const vec<T, 4>*)(x + (long)m * p.K + k));
      ss += dot(xv, xv);
    }
    inv_rms[m] = rsqrt(simd_sum(ss) / float(p.K) + p.eps);
  }

  for (int v = tl; v < nc; v += L) {
    const int g = v >> gshift;
    uint2 wq[R];
    float sc[R], bi[R];
    for (int r = 0; r < R; r++) {
      const bool ok = n0 + r % OUTS < p.N;
      const int j = n0 + r % OUTS;   // the weight row:
      const int n = ROPE ? (j / half_d) * p.head_dim + j % half_d + (r < OUTS ? 0 : half_d)
                         : ACT == GATE_NONE ? n0 + r : (r < OUTS ? j : p.N + j);
      wq[r] = ok ? *(device const uint2*)(w + (long)n * kw + 2 * v) : uint2(0u);
      sc[r] = ok ? float(scales[(long)n * kg + g]) : 0.0f;
      bi[r] = ok ? float(biases[(long)n * kg + g]) : 0.0f;
    }
    for (int m = 0; m < MMAX; m++) {
      if (m >= p.M) break;
      device const vec<T, 4>* xr = (device const vec<T, 4>*)(x + (long)m * p.K + 16 * v);
      float4 xs[4];
      float sx = 0.0f;
      for (int i = 0; i < 4; i++) {
        float4 xv = float4(xr[i]);
        if (NORM) xv = float4(to_vec4<T>(xv * inv_rms[m]) * ((device const vec<T, 4>*)(nw + 16 * v))[i]);   // in T, as rms_norm
        sx += (xv.x + xv.y) + (xv.z + xv.w);
        xs[i] = xv * pre;
      }
      for (int r = 0; r < R; r++) acc[m][r] += sc[r] * qdot16(wq[r], xs) + bi[r] * sx;
    }
  }

  for (int m = 0; m < MMAX; m++) {
    if (m >= p.M) break;
    float sums[R];
    for (int r = 0; r < R; r++) {
      float s = acc[m][r];
      if (L == 32) {
        s = simd_sum(s);
      } else {
        for (ushort off = L / 2; off > 0; off /= 2) s += simd_shuffle_xor(s, off);
      }
      sums[r] = s;
    }
    for (int r = 0; r < OUTS; r++) {
      if (tl != 0 || n0 + r >= p.N) continue;
      if (ROPE) {
        const int j = n0 + r, h = j / half_d, i = j % half_d, D = p.head_dim, H = p.n_heads, KVH = p.n_kv_heads;
        const float first = sums[r], second = sums[r + OUTS];
        device const float* cs = io.cos_sin + (long)io.positions[m] * D;
        const float c = cs[i], s = cs[half_d + i];
        const float rot0 = first * c - second * s, rot1 = second * c + first * s;
        if (h < H) {
          device T* q = io.q_out + ((long)m * H + h) * D;
          q[i] = T(rot0);
          q[half_d + i] = T(rot1);
        } else if (io.slots[m] >= 0) {
          const bool is_k = h < H + KVH;
          device C* row = (is_k ? io.k_cache : io.v_cache) + ((long)io.slots[m] * KVH + h - H - (is_k ? 0 : KVH)) * D;
          row[i] = C(is_k ? rot0 : first);
          row[half_d + i] = C(is_k ? rot1 : second);
        }
        continue;
      }
      const long at = (long)m * p.N + n0 + r;
      if (ACT != GATE_NONE) y[at] = T(activate(sums[r], ACT) * sums[r + OUTS]);
      else y[at] = RES ? T(float(T(sums[r])) + float(res[at])) : T(sums[r]);
    }
  }
}

template <typename T>
[[kernel]] void int4_gemv(
    device const T* x [[buffer(0)]],
    device const uint* w [[buffer(1)]],
    device const half* scales [[buffer(2)]],
    device const half* biases [[buffer(3)]],
    device T* y [[buffer(4)]],
    constant Int4Params& p [[buffer(5)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  gemv<T, false, false>(x, x, w, scales, biases, y, y, p, tgid, lane, sg);
}

template <typename T>
[[kernel]] void int4_gemv_rms(
    device const T* x [[buffer(0)]],
    device const T* norm_weight [[buffer(1)]],
    device const uint* w [[buffer(2)]],
    device const half* scales [[buffer(3)]],
    device const half* biases [[buffer(4)]],
    device T* y [[buffer(5)]],
    constant Int4Params& p [[buffer(6)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  gemv<T, true, false>(x, norm_weight, w, scales, biases, y, y, p, tgid, lane, sg);
}

template <typename T, Gate ACT>
[[kernel]] void int4_gemv_gated(
    device const T* x [[buffer(0)]],
    device const T* norm_weight [[buffer(1)]],
    device const uint* w [[buffer(2)]],
    device const half* scales [[buffer(3)]],
    device const half* biases [[buffer(4)]],
    device T* y [[buffer(5)]],
    constant Int4Params& p [[buffer(6)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  gemv<T, true, false, ACT>(x, norm_weight, w, scales, biases, y, y, p, tgid, lane, sg);
}

template <typename T, typename C>
[[kernel]] void int4_gemv_rope(
    device const T* x [[buffer(0)]],
    device const T* norm_weight [[buffer(1)]],
    device const uint* w [[buffer(2)]],
    device const half* scales [[buffer(3)]],
    device const half* biases [[buffer(4)]],
    device const int* positions [[buffer(5)]],
    device const float* cos_sin [[buffer(6)]],
    device const int* slot_mapping [[buffer(7)]],
    device T* q_out [[buffer(8)]],
    device C* k_cache [[buffer(9)]],
    device C* v_cache [[buffer(10)]],
    constant Int4Params& p [[buffer(11)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const RopeIO<T, C> io = {positions, cos_sin, slot_mapping, q_out, k_cache, v_cache};
  gemv<T, true, false, GATE_NONE, true, C>(x, norm_weight, w, scales, biases, q_out, q_out, p, tgid, lane, sg, io);
}

template <typename T>
[[kernel]] void int4_gemv_res(
    device const T* x [[buffer(0)]],
    device const uint* w [[buffer(1)]],
    device const half* scales [[buffer(2)]],
    device const half* biases [[buffer(3)]],
    device const T* residual [[buffer(4)]],
    device T* y [[buffer(5)]],
    constant Int4Params& p [[buffer(6)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  gemv<T, false, true>(x, x, w, scales, biases, residual, y, p, tgid, lane, sg);
}

template <typename T>
[[kernel]] void int4_gemm(
    device const T* x [[buffer(0)]],
    device const uint* w [[buffer(1)]],
    device const half* scales [[buffer(2)]],
    device const half* biases [[buffer(3)]],
    device T* y [[buffer(4)]],
    constant Int4Params& p [[buffer(5)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int BM = 32, BN = 32, BK = 32, LD = BK + 4, LDC = BN + 4;
  threadgroup float xs[BM * LD];
  threadgroup float ws[BN * LD];
  threadgroup float cs[BM * LDC];

  const int m0 = tgid.y * BM, n0 = tgid.x * BN;
  const int sm = (sg / 2) * 16, sn = (sg % 2) * 16;  // this SIMD-group's 16x16 sub-tile
  const int kw = p.K / 8, kg = p.K / p.group_size;
  simdgroup_float8x8 acc[2][2];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int k0 = 0; k0 < p.K; k0 += BK) {
    // Stage x [BM, BK] and W [BN, BK] (dequantised: one word of 8 codes per thread)
    for (int i = tid; i < BM * BK; i += 128) {
      const int r = i / BK, c = i % BK, m = m0 + r;
      xs[r * LD + c] = m < p.M ? float(x[(long)m * p.K + k0 + c]) : 0.0f;
    }
    {
      const int r = tid / (BK / 8), c = 8 * (tid % (BK / 8)), n = n0 + r;
      const uint word = n < p.N ? w[(long)n * kw + (k0 + c) / 8] : 0u;
      const float s = n < p.N ? float(scales[(long)n * kg + (k0 + c) / p.group_size]) : 0.0f;
      const float b = n < p.N ? float(biases[(long)n * kg + (k0 + c) / p.group_size]) : 0.0f;
      for (int e = 0; e < 8; e++) ws[r * LD + c + e] = s * float((word >> (4 * e)) & 15u) + b;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int kk = 0; kk < BK; kk += 8) {
      simdgroup_float8x8 a[2], bt[2];
      for (int i = 0; i < 2; i++) simdgroup_load(a[i], xs + (sm + 8 * i) * LD + kk, LD);
      for (int j = 0; j < 2; j++) simdgroup_load(bt[j], ws + (sn + 8 * j) * LD + kk, LD, ulong2(0, 0), true);
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) simdgroup_multiply_accumulate(acc[i][j], a[i], bt[j], acc[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) simdgroup_store(acc[i][j], cs + (sm + 8 * i) * LDC + sn + 8 * j, LDC);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < BM * BN; i += 128) {
    const int r = i / BN, c = i % BN, m = m0 + r, n = n0 + c;
    if (m < p.M && n < p.N) y[(long)m * p.N + n] = T(cs[r * LDC + c]);
  }
}

template [[host_name("int4_gemv_f32")]] [[kernel]] decltype(int4_gemv<float>) int4_gemv<float>;
template [[host_name("int4_gemv_f16")]] [[kernel]] decltype(int4_gemv<half>) int4_gemv<half>;
template [[host_name("int4_gemv_rms_f32")]] [[kernel]] decltype(int4_gemv_rms<float>) int4_gemv_rms<float>;
template [[host_name("int4_gemv_rms_f16")]] [[kernel]] decltype(int4_gemv_rms<half>) int4_gemv_rms<half>;
template [[host_name("int4_gemv_glu_f32")]] [[kernel]] decltype(int4_gemv_gated<float, GATE_SILU>) int4_gemv_gated<float, GATE_SILU>;
template [[host_name("int4_gemv_glu_f16")]] [[kernel]] decltype(int4_gemv_gated<half, GATE_SILU>) int4_gemv_gated<half, GATE_SILU>;
template [[host_name("int4_gemv_geglu_f32")]] [[kernel]] decltype(int4_gemv_gated<float, GATE_GELU_TANH>) int4_gemv_gated<float, GATE_GELU_TANH>;
template [[host_name("int4_gemv_geglu_f16")]] [[kernel]] decltype(int4_gemv_gated<half, GATE_GELU_TANH>) int4_gemv_gated<half, GATE_GELU_TANH>;
template [[host_name("int4_gemv_rope_f32_f32")]] [[kernel]] decltype(int4_gemv_rope<float, float>) int4_gemv_rope<float, float>;
template [[host_name("int4_gemv_rope_f32_f16")]] [[kernel]] decltype(int4_gemv_rope<float, half>) int4_gemv_rope<float, half>;
template [[host_name("int4_gemv_rope_f16_f32")]] [[kernel]] decltype(int4_gemv_rope<half, float>) int4_gemv_rope<half, float>;
template [[host_name("int4_gemv_rope_f16_f16")]] [[kernel]] decltype(int4_gemv_rope<half, half>) int4_gemv_rope<half, half>;
template [[host_name("int4_gemv_res_f32")]] [[kernel]] decltype(int4_gemv_res<float>) int4_gemv_res<float>;
template [[host_name("int4_gemv_res_f16")]] [[kernel]] decltype(int4_gemv_res<half>) int4_gemv_res<half>;
template [[host_name("int4_gemm_f32")]] [[kernel]] decltype(int4_gemm<float>) int4_gemm<float>;
template [[host_name("int4_gemm_f16")]] [[kernel]] decltype(int4_gemm<half>) int4_gemm<half>;
