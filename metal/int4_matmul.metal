// y[M, N] = x[M, K] @ W^T for a 4-bit affine-quantised weight W [N, K].
//
// Weight layout (shared with tinyvllm.quant): groups of G in {32, 64, 128} consecutive k of a row share a scale and
// a bias; w[n, k] = scales[n, k / G] * q[n, k] + biases[n, k / G], q in 0..15.
//   w_packed  [N, K / 8]  uint32   8 codes per word, the lowest k in the lowest 4 bits (MLX's order)
//   scales    [N, K / G]  half
//   biases    [N, K / G]  half
// Since 32 divides G, the 32 codes of one uint4 (four words) always share one scale and bias, so a group's
// contribution is scale * sum(x * q) + bias * sum(x), accumulated in float. K must be a multiple of G.
//
// int4_gemv_<x> (decode, M <= 8; x = dtype of x and y)
//   grid: ceil(N / 8) threadgroups of 64 threads (2 SIMD-groups); SIMD-group sg owns output columns
//   n0 .. n0 + 3, n0 = (tgid * 2 + sg) * 4. Lane l reads uint4 l, l + 32, ... of each of its 4 weight rows
//   (512 contiguous bytes per SIMD-group step) and applies each weight load to all M rows of x, so every weight
//   byte is read once per call; simd_sum combines the lanes.
//   buffers: 0 x [M, K] x, 1 w_packed, 2 scales, 3 biases, 4 y [M, N] x, 5 params
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
};

// sum_j x[j] * q_j over the 8 codes of one word
METAL_FUNC float dot_codes(uint w, float4 xa, float4 xb) {
  return xa.x * float(w & 15u) + xa.y * float((w >> 4) & 15u) + xa.z * float((w >> 8) & 15u) +
         xa.w * float((w >> 12) & 15u) + xb.x * float((w >> 16) & 15u) + xb.y * float((w >> 20) & 15u) +
         xb.z * float((w >> 24) & 15u) + xb.w * float((w >> 28) & 15u);
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
  constexpr int NSG = 2, R = 4, MMAX = 8;
  const int n0 = (tgid.x * NSG + sg) * R;
  const int kw = p.K / 8, kg = p.K / p.group_size;
  float acc[MMAX][R];
  for (int m = 0; m < MMAX; m++)
    for (int r = 0; r < R; r++) acc[m][r] = 0.0f;

  for (int v = lane; v < p.K / 32; v += 32) {
    const int k = 32 * v, g = k / p.group_size;
    uint4 wq[R];
    float sc[R], bi[R];
    for (int r = 0; r < R; r++) {
      const int n = n0 + r;
      const bool ok = n < p.N;
      wq[r] = ok ? *(device const uint4*)(w + (long)n * kw + 4 * v) : uint4(0u);
      sc[r] = ok ? float(scales[(long)n * kg + g]) : 0.0f;
      bi[r] = ok ? float(biases[(long)n * kg + g]) : 0.0f;
    }
    for (int m = 0; m < MMAX; m++) {
      if (m >= p.M) break;
      device const T* xr = x + (long)m * p.K + k;
      float sx = 0.0f, dq[R] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int j = 0; j < 4; j++) {
        const float4 xa = float4(*(device const vec<T, 4>*)(xr + 8 * j));
        const float4 xb = float4(*(device const vec<T, 4>*)(xr + 8 * j + 4));
        sx += xa.x + xa.y + xa.z + xa.w + xb.x + xb.y + xb.z + xb.w;
        for (int r = 0; r < R; r++) dq[r] += dot_codes(wq[r][j], xa, xb);
      }
      for (int r = 0; r < R; r++) acc[m][r] += sc[r] * dq[r] + bi[r] * sx;
    }
  }

  for (int m = 0; m < MMAX; m++) {
    if (m >= p.M) break;
    for (int r = 0; r < R; r++) {
      const float s = simd_sum(acc[m][r]);
      if (lane == 0 && n0 + r < p.N) y[(long)m * p.N + n0 + r] = T(s);
    }
  }
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
template [[host_name("int4_gemm_f32")]] [[kernel]] decltype(int4_gemm<float>) int4_gemm<float>;
template [[host_name("int4_gemm_f16")]] [[kernel]] decltype(int4_gemm<half>) int4_gemm<half>;
