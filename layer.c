#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TV_AVX2 1
#elif defined(__SSE__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TV_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define TV_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define TV_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TV_AVX512 1
#if defined(__AVX512VNNI__)
#define TV_DPWSSD512(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define TV_DPWSSD512(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#endif
void layer(float *restrict out, float *restrict kc, float *restrict vc, float *restrict scratch, const float *restrict h, const int *restrict pos, const int *restrict slots, const int *restrict tables, const int *restrict token_seq, const int *restrict token_pos, const float *restrict cs, const float *restrict ln1, const float *restrict ln2, const unsigned *restrict qkv0_w, const unsigned char *restrict qkv0_s, const unsigned short *restrict qkv0_sd, const unsigned *restrict qkv1_w, const unsigned char *restrict qkv1_s, const unsigned short *restrict qkv1_sd, const unsigned *restrict qkv2_w, const signed char *restrict qkv2_s, const unsigned short *restrict qkv2_sd, const unsigned *restrict o_w, const unsigned char *restrict o_s, const unsigned short *restrict o_sd, const unsigned *restrict gate_up_w, const unsigned char *restrict gate_up_s, const unsigned short *restrict gate_up_sd, const unsigned *restrict down_w, const signed char *restrict down_s, const unsigned short *restrict down_sd, const unsigned long long *restrict pool);

typedef void (*tv_task)(void *ctx, int part, int nparts);
static inline void tv_parallel(const unsigned long long *pool, tv_task fn, void *ctx);
static inline void tv_share(int units, int part, int nparts, int *begin, int *end);
static inline void tv_share_rows(int rows, int part, int nparts, int *begin, int *end);

struct layer_ctx { float *out; float *kc; float *vc; float *scratch; const float *h; const int *pos; const int *slots; const int *tables; const int *token_seq; const int *token_pos; const float *cs; const float *ln1; const float *ln2; const unsigned *qkv0_w; const unsigned char *qkv0_s; const unsigned short *qkv0_sd; const unsigned *qkv1_w; const unsigned char *qkv1_s; const unsigned short *qkv1_sd; const unsigned *qkv2_w; const signed char *qkv2_s; const unsigned short *qkv2_sd; const unsigned *o_w; const unsigned char *o_s; const unsigned short *o_sd; const unsigned *gate_up_w; const unsigned char *gate_up_s; const unsigned short *gate_up_sd; const unsigned *down_w; const signed char *down_s; const unsigned short *down_sd; const unsigned long long *pool; float *xn, *qkv_out, *q, *att, *gu, *act, *prod, *part; };

typedef float vf __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));   /* unaligned loads */
#define VW 8
static inline vf vload(const float *p) { return *(const vf_u *)p; }
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VW; i++) s += v[i]; return s; }

typedef signed char vc8 __attribute__((vector_size(8), aligned(1)));
static inline vf vload_i8(const signed char *p) { return __builtin_convertvector(*(const vc8 *)p, vf); }
typedef unsigned char vu4 __attribute__((vector_size(4), aligned(1)));
typedef unsigned char vu8 __attribute__((vector_size(8)));
/* 8 int4 codes from 4 bytes (element 2i in the low nibble of byte i), as floats in [-7, 7] */
static inline vf vload_i4(const unsigned char *p) {
  vu4 b = *(const vu4 *)p, lo = b & 15, hi = b >> 4;
  return __builtin_convertvector((vu8)__builtin_shufflevector(lo, hi, 0, 4, 1, 5, 2, 6, 3, 7), vf) - 8.0f;
}
/* x <- R x: the normalized fast Walsh-Hadamard transform in blocks of 128 (R symmetric and its own inverse) */
static inline void rotate_vec(float *x) {
  for (int b0 = 0; b0 < 128; b0 += 128)
    for (int len = 1; len < 128; len <<= 1)
      for (int i = b0; i < b0 + 128; i += 2 * len)
        for (int j = i; j < i + len; j++) { float a = x[j], c = x[j + len]; x[j] = a + c; x[j + len] = a - c; }
  for (int i = 0; i < 128; i++) x[i] *= 0.08838834764831845f;
}

typedef int vi __attribute__((vector_size(32)));
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }   /* m ? a : b, lane by lane */
/* e^x on 8 lanes = 2^k e^r, k = round(x / ln 2) (half away from zero), |r| <= ln(2)/2: degree-6 Taylor polynomial,
   within 2.3e-7 relative; 0 below -87, where e^x underflows */
static inline vf exp8(vf x) {
  vi under = x < -87.0f;
  x = vsel(x > 88.0f, (vf){0} + 88.0f, x);
  x = vsel(under, (vf){0} - 87.0f, x);    /* keeps the int conversion in range; the lane becomes 0 below */
  vi k = __builtin_convertvector(x * 1.44269504f + vsel(x < 0.0f, (vf){0} - 0.5f, (vf){0} + 0.5f), vi);
  vf kf = __builtin_convertvector(k, vf);
  vf r = (x - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;   /* ln 2 in two parts */
  vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  vf e = p * (vf)((k + 127) << 23);
  return (vf)((vi)e & ~under);
}
/* the scalar e^x: one lane of exp8, so softmax's vector and scalar exps cannot drift apart */
static inline float exp_f32(float x) { return exp8((vf){0} + x)[0]; }

static inline float sqrt_f32(float x) {
#if defined(__SSE__)
  return _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x)));
#elif defined(__aarch64__)
  float r; __asm__("fsqrt %s0, %s1" : "=w"(r) : "w"(x)); return r;
#else
  float r = x > 1 ? x : 1; for (int i = 0; i < 40; i++) r = 0.5f * (r + x / r); return r;
#endif
}

/* the 8 sums of d[0..7] as the lanes of one vector: a transpose-style pairwise tree instead of 8 horizontal sums */
static inline vf hsum8x(const vf *d) {
#define TV_P1(a, b) (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define TV_P2(a, b) (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
#define TV_P3(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
  vf r0 = TV_P1(d[0], d[1]), r1 = TV_P1(d[2], d[3]), r2 = TV_P1(d[4], d[5]), r3 = TV_P1(d[6], d[7]);
  vf s0 = TV_P2(r0, r1), s1 = TV_P2(r2, r3);
  return TV_P3(s0, s1);
#undef TV_P1
#undef TV_P2
#undef TV_P3
}
static inline float h2f(unsigned short h);
#ifdef TV_AVX2
static inline float hsum8(__m256 v);
#endif

static void mm_f32(float *restrict y, const float *restrict x, const float *restrict w, int M, int N, int K, int nb, int ne) {
  for (int n0 = nb; n0 < ne; n0 += 4) {
    int nr = ne - n0 < 4 ? ne - n0 : 4;
    for (int m0 = 0; m0 < M; m0 += 2) {
      int mr = M - m0 < 2 ? M - m0 : 2;
      vf acc[2][4] = {{0}};
      const float *x0 = x + (long)m0 * K, *x1 = x + (long)(m0 + (mr > 1)) * K;
      const float *ws[4];
      for (int j = 0; j < 4; j++) ws[j] = w + (long)(n0 + (j < nr ? j : 0)) * K;
      int k = 0;
      for (; k + VW <= K; k += VW) {
        vf a0 = vload(x0 + k), a1 = vload(x1 + k);
        vf b0 = vload(ws[0] + k), b1 = vload(ws[1] + k), b2 = vload(ws[2] + k), b3 = vload(ws[3] + k);
        acc[0][0] += a0 * b0; acc[0][1] += a0 * b1; acc[0][2] += a0 * b2; acc[0][3] += a0 * b3;
        acc[1][0] += a1 * b0; acc[1][1] += a1 * b1; acc[1][2] += a1 * b2; acc[1][3] += a1 * b3;
      }
      const float *xs[2] = {x0, x1};
      for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {
        float s = hsum(acc[i][j]);
        for (int kk = k; kk < K; kk++) s += xs[i][kk] * ws[j][kk];
        y[(long)(m0 + i) * N + n0 + j] = s;
      }
    }
  }
}

static void qkv0_rows(float *restrict y, const float *restrict x, const unsigned *restrict qkv0_w, const unsigned char *restrict qkv0_s, const unsigned short *restrict qkv0_sd, int nb, int ne) {
  const unsigned *restrict w = qkv0_w; const unsigned char *restrict s = qkv0_s; const unsigned short *restrict sd = qkv0_sd;
#ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m512 sums[32][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(0);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);   /* run c + 1: one more run's shift */
    (void)gidx; (void)hbase; (void)hmask512;
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 4096 ? n0 + r : 4096 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {   /* the slice's codes */
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m512 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 2) {
            __m512i xe0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 32)), 1);
      __m512i xo0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 48)), 1);
      __m512i x00 = _mm512_loadu_si512((const void *)&xc0[c]);   /* xc[c], xc[c + 1] */
            __m512i xe1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 32)), 1);
      __m512i xo1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 48)), 1);
      __m512i x01 = _mm512_loadu_si512((const void *)&xc1[c]);   /* xc[c], xc[c + 1] */
            
            for (int r = 0; r < 4; r++) {
              __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i0][r][c * 32 / 32]))), tot[0][r]); }
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i1][r][c * 32 / 32]))), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 4096; r++) y[(long)m * 6144 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m256 sums[32][4];   /* each row's sums between slices */
  
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 4096 ? n0 + r : 4096 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 1) {   /* the slice's codes */
          __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32], qe);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32 + 16], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m256 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 1) {
            __m256i xe0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32)), xo0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16));
      __m256i x00 = xc0[c];   /* -c * sum x */
            __m256i xe1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32)), xo1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16));
      __m256i x01 = xc1[c];   /* -c * sum x */
            
            for (int r = 0; r < 4; r++) {
              __m256i qe = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32]), qo = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32 + 16]);
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i0][r][c * 32 / 32]), tot[0][r]); }
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i1][r][c * 32 / 32]), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 4096; r++) y[(long)m * 6144 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[128], B[128]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 128; g++) { S[g] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[g] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]); }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 4096; k++) {
        unsigned q = (w[(long)n * 512 + k / 8] >> (4 * (k % 8))) & 15u;
        
        t_ += x[(long)m * 4096 + k] * (S[k / 32] * (float)q + B[k / 32]);
      }
      y[(long)m * 6144 + n] = t_;
    }
  }
#endif
  
}
static void qkv1_rows(float *restrict y, const float *restrict x, const unsigned *restrict qkv1_w, const unsigned char *restrict qkv1_s, const unsigned short *restrict qkv1_sd, int nb, int ne) {
  const unsigned *restrict w = qkv1_w; const unsigned char *restrict s = qkv1_s; const unsigned short *restrict sd = qkv1_sd;
#ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m512 sums[32][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(0);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);   /* run c + 1: one more run's shift */
    (void)gidx; (void)hbase; (void)hmask512;
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 1024 ? n0 + r : 1024 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {   /* the slice's codes */
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m512 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 2) {
            __m512i xe0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 32)), 1);
      __m512i xo0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 48)), 1);
      __m512i x00 = _mm512_loadu_si512((const void *)&xc0[c]);   /* xc[c], xc[c + 1] */
            __m512i xe1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 32)), 1);
      __m512i xo1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 48)), 1);
      __m512i x01 = _mm512_loadu_si512((const void *)&xc1[c]);   /* xc[c], xc[c + 1] */
            
            for (int r = 0; r < 4; r++) {
              __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i0][r][c * 32 / 32]))), tot[0][r]); }
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i1][r][c * 32 / 32]))), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 1024; r++) y[(long)m * 6144 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m256 sums[32][4];   /* each row's sums between slices */
  
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 1024 ? n0 + r : 1024 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 1) {   /* the slice's codes */
          __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32], qe);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32 + 16], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m256 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 1) {
            __m256i xe0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32)), xo0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16));
      __m256i x00 = xc0[c];   /* -c * sum x */
            __m256i xe1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32)), xo1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16));
      __m256i x01 = xc1[c];   /* -c * sum x */
            
            for (int r = 0; r < 4; r++) {
              __m256i qe = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32]), qo = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32 + 16]);
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i0][r][c * 32 / 32]), tot[0][r]); }
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i1][r][c * 32 / 32]), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 1024; r++) y[(long)m * 6144 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[128], B[128]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 128; g++) { S[g] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[g] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]); }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 4096; k++) {
        unsigned q = (w[(long)n * 512 + k / 8] >> (4 * (k % 8))) & 15u;
        
        t_ += x[(long)m * 4096 + k] * (S[k / 32] * (float)q + B[k / 32]);
      }
      y[(long)m * 6144 + n] = t_;
    }
  }
#endif
  
}
static void qkv2_rows(float *restrict y, const float *restrict x, const unsigned *restrict qkv2_w, const signed char *restrict qkv2_s, const unsigned short *restrict qkv2_sd, int nb, int ne) {
  const unsigned *restrict w = qkv2_w; const signed char *restrict s = qkv2_s; const unsigned short *restrict sd = qkv2_sd;
#ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(48);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][256], xgs[32][256];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][256], sbc[4][256]; (void)sbc;
  float gs[32][4][260] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m512 sums[32][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(48);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 131074, 131074, 131074, 131074, 131074, 131074, 131074, 131074);   /* run c + 1: one more run's shift */
    (void)gidx; (void)hbase; (void)hmask512;
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-32));
    }
    for (int g = 0; g < 256; g++) {
      float t = 0;
      for (int u = g * 1; u < (g + 1) * 1; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 16 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 1024 ? n0 + r : 1024 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 768);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 256; g += 8) {
          __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[n * 16 + g / 16])), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + n * 256 + g)))));
          _mm256_storeu_ps(&sf[r][g], Sv);
        }
        for (; g < 256; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[n * 16 + g / 16]) * (float)s[n * 256 + g];
          sf[r][g] = S[0];
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 256; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 256; g++) gsr[g] = sf[r][g] * dxg[g];
        bsum[m - c0][r] = 0;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {   /* the slice's codes */
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);
          { const __m512i hsv = _mm512_add_epi16(hbase, _mm512_set1_epi16(2 * (c % 4)));
            __m512i hb = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(whr[r] + (c / 4) * 32))), hsv);
            qe = _mm512_ternarylogic_epi32(qe, _mm512_slli_epi16(hb, 4), hmask512, 0xF8);   /* qe | (hb << 4 & hmask) */
            qo = _mm512_ternarylogic_epi32(qo, _mm512_srli_epi16(hb, 4), hmask512, 0xF8); }
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m512 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 2) {
            __m512i xe0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 32)), 1);
      __m512i xo0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 48)), 1);
      __m512i x00 = _mm512_loadu_si512((const void *)&xc0[c]);   /* xc[c], xc[c + 1] */
            __m512i xe1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 32)), 1);
      __m512i xo1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 48)), 1);
      __m512i x01 = _mm512_loadu_si512((const void *)&xc1[c]);   /* xc[c], xc[c + 1] */
            
            for (int r = 0; r < 4; r++) {
              __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i0][r][c * 32 / 16]))), tot[0][r]); }
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i1][r][c * 32 / 16]))), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 1024; r++) y[(long)m * 6144 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(48);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][256], xgs[32][256];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][256], sbc[4][256]; (void)sbc;
  float gs[32][4][260] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m256 sums[32][4];   /* each row's sums between slices */
  
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-32));
    }
    for (int g = 0; g < 256; g++) {
      float t = 0;
      for (int u = g * 1; u < (g + 1) * 1; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 16 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 1024 ? n0 + r : 1024 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 768);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 256; g += 8) {
          __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[n * 16 + g / 16])), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + n * 256 + g)))));
          _mm256_storeu_ps(&sf[r][g], Sv);
        }
        for (; g < 256; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[n * 16 + g / 16]) * (float)s[n * 256 + g];
          sf[r][g] = S[0];
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 256; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 256; g++) gsr[g] = sf[r][g] * dxg[g];
        bsum[m - c0][r] = 0;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 1) {   /* the slice's codes */
          __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);
          { __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(whr[r] + (c / 4) * 32)), _mm_cvtsi32_si128(2 * (c % 4)));
            qe = _mm256_add_epi16(qe, _mm256_and_si256(_mm256_slli_epi16(hb, 4), hmask));
            qo = _mm256_add_epi16(qo, _mm256_and_si256(_mm256_srli_epi16(hb, 4), hmask)); }
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32], qe);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32 + 16], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m256 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 1) {
            __m256i xe0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32)), xo0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16));
      __m256i x00 = xc0[c];   /* -c * sum x */
            __m256i xe1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32)), xo1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16));
      __m256i x01 = xc1[c];   /* -c * sum x */
            
            for (int r = 0; r < 4; r++) {
              __m256i qe = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32]), qo = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32 + 16]);
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&gs[i0][r][2 * c]))), pair), tot[0][r]); }
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&gs[i1][r][2 * c]))), pair), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 1024; r++) y[(long)m * 6144 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[256], B[256]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 256; g++) { S[g] = h2f(sd[n * 16 + g / 16]) * (float)s[n * 256 + g]; }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 4096; k++) {
        unsigned q = (w[(long)n * 768 + k / 8] >> (4 * (k % 8))) & 15u;
        { int run = k / 32;
          const unsigned char *hb = (const unsigned char *)(w + (long)n * 768 + 512);
          q |= ((hb[(run / 4) * 32 + k % 32] >> (2 * (run % 4))) & 3u) << 4; }
        t_ += x[(long)m * 4096 + k] * (S[k / 16] * ((float)q - 32.0f));
      }
      y[(long)m * 6144 + n] = t_;
    }
  }
#endif
  
}
static void qkv(float *restrict y, const float *restrict x, const unsigned *restrict qkv0_w, const unsigned char *restrict qkv0_s, const unsigned short *restrict qkv0_sd, const unsigned *restrict qkv1_w, const unsigned char *restrict qkv1_s, const unsigned short *restrict qkv1_sd, const unsigned *restrict qkv2_w, const signed char *restrict qkv2_s, const unsigned short *restrict qkv2_sd, int nb, int ne) {
  { int b_ = nb > 0 ? nb : 0, e_ = ne < 4096 ? ne : 4096;
    if (b_ < e_) qkv0_rows(y + 0, x, qkv0_w, qkv0_s, qkv0_sd, b_ - 0, e_ - 0); }
  { int b_ = nb > 4096 ? nb : 4096, e_ = ne < 5120 ? ne : 5120;
    if (b_ < e_) qkv1_rows(y + 4096, x, qkv1_w, qkv1_s, qkv1_sd, b_ - 4096, e_ - 4096); }
  { int b_ = nb > 5120 ? nb : 5120, e_ = ne < 6144 ? ne : 6144;
    if (b_ < e_) qkv2_rows(y + 5120, x, qkv2_w, qkv2_s, qkv2_sd, b_ - 5120, e_ - 5120); }
}

static void o_rows(float *restrict y, const float *restrict x, const unsigned *restrict o_w, const unsigned char *restrict o_s, const unsigned short *restrict o_sd, int nb, int ne) {
  const unsigned *restrict w = o_w; const unsigned char *restrict s = o_s; const unsigned short *restrict sd = o_sd;
#ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m512 sums[32][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(0);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);   /* run c + 1: one more run's shift */
    (void)gidx; (void)hbase; (void)hmask512;
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 4096 ? n0 + r : 4096 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {   /* the slice's codes */
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m512 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 2) {
            __m512i xe0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 32)), 1);
      __m512i xo0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 48)), 1);
      __m512i x00 = _mm512_loadu_si512((const void *)&xc0[c]);   /* xc[c], xc[c + 1] */
            __m512i xe1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 32)), 1);
      __m512i xo1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 48)), 1);
      __m512i x01 = _mm512_loadu_si512((const void *)&xc1[c]);   /* xc[c], xc[c + 1] */
            
            for (int r = 0; r < 4; r++) {
              __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i0][r][c * 32 / 32]))), tot[0][r]); }
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i1][r][c * 32 / 32]))), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 4096; r++) y[(long)m * 4096 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m256 sums[32][4];   /* each row's sums between slices */
  
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 4096 ? n0 + r : 4096 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 1) {   /* the slice's codes */
          __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32], qe);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32 + 16], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m256 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 1) {
            __m256i xe0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32)), xo0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16));
      __m256i x00 = xc0[c];   /* -c * sum x */
            __m256i xe1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32)), xo1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16));
      __m256i x01 = xc1[c];   /* -c * sum x */
            
            for (int r = 0; r < 4; r++) {
              __m256i qe = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32]), qo = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32 + 16]);
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i0][r][c * 32 / 32]), tot[0][r]); }
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i1][r][c * 32 / 32]), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 4096; r++) y[(long)m * 4096 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[128], B[128]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 128; g++) { S[g] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[g] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]); }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 4096; k++) {
        unsigned q = (w[(long)n * 512 + k / 8] >> (4 * (k % 8))) & 15u;
        
        t_ += x[(long)m * 4096 + k] * (S[k / 32] * (float)q + B[k / 32]);
      }
      y[(long)m * 4096 + n] = t_;
    }
  }
#endif
  
}
static void o(float *restrict y, const float *restrict x, const unsigned *restrict o_w, const unsigned char *restrict o_s, const unsigned short *restrict o_sd, int nb, int ne) {
  { int b_ = nb > 0 ? nb : 0, e_ = ne < 4096 ? ne : 4096;
    if (b_ < e_) o_rows(y + 0, x, o_w, o_s, o_sd, b_ - 0, e_ - 0); }
}

static void gate_up_rows(float *restrict y, const float *restrict x, const unsigned *restrict gate_up_w, const unsigned char *restrict gate_up_s, const unsigned short *restrict gate_up_sd, int nb, int ne) {
  const unsigned *restrict w = gate_up_w; const unsigned char *restrict s = gate_up_s; const unsigned short *restrict sd = gate_up_sd;
#ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m512 sums[32][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(0);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);   /* run c + 1: one more run's shift */
    (void)gidx; (void)hbase; (void)hmask512;
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 28672 ? n0 + r : 28672 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {   /* the slice's codes */
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m512 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 2) {
            __m512i xe0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 32)), 1);
      __m512i xo0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 48)), 1);
      __m512i x00 = _mm512_loadu_si512((const void *)&xc0[c]);   /* xc[c], xc[c + 1] */
            __m512i xe1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 32)), 1);
      __m512i xo1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 48)), 1);
      __m512i x01 = _mm512_loadu_si512((const void *)&xc1[c]);   /* xc[c], xc[c + 1] */
            
            for (int r = 0; r < 4; r++) {
              __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i0][r][c * 32 / 32]))), tot[0][r]); }
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i1][r][c * 32 / 32]))), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 28672; r++) y[(long)m * 28672 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[32][4128] __attribute__((aligned(64)));
  float dxs[32][128], dxgs[32][128], xgs[32][128];
  __m256i xcs[32][128];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][128], sbc[4][128]; (void)sbc;
  float gs[32][4][132] __attribute__((aligned(32))), bsum[32][4];   /* per x row and weight row */
  __m256 sums[32][4];   /* each row's sums between slices */
  
  for (int c0 = 0; c0 < 64; c0 += 32) {
    int mend = c0 + 32 < 64 ? c0 + 32 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[256];
    for (int u = 0; u < 128; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 4096) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 128; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 4096) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 128; g++) {
      float t = 0;
      for (int u = g * 2; u < (g + 1) * 2; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 32 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 28672 ? n0 + r : 28672 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 512);
        whr[r] = wr[r] + 2048;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 128; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 128 + g))), deint);
        long d_ = 2 * (n * 16 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 128; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[0] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 128; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 128; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 128; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 128; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 128; cs += 64) {
        const int ce = cs + 64 < 128 ? cs + 64 : 128;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 1) {   /* the slice's codes */
          __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32], qe);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32 + 16], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m256 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 1) {
            __m256i xe0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32)), xo0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16));
      __m256i x00 = xc0[c];   /* -c * sum x */
            __m256i xe1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32)), xo1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16));
      __m256i x01 = xc1[c];   /* -c * sum x */
            
            for (int r = 0; r < 4; r++) {
              __m256i qe = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32]), qo = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32 + 16]);
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i0][r][c * 32 / 32]), tot[0][r]); }
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&gs[i1][r][c * 32 / 32]), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 28672; r++) y[(long)m * 28672 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[128], B[128]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 128; g++) { S[g] = h2f(sd[2 * (n * 16 + g / 8)]) * (float)s[2 * (n * 128 + g)]; B[g] = -(h2f(sd[2 * (n * 16 + g / 8) + 1]) * (float)s[2 * (n * 128 + g) + 1]); }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 4096; k++) {
        unsigned q = (w[(long)n * 512 + k / 8] >> (4 * (k % 8))) & 15u;
        
        t_ += x[(long)m * 4096 + k] * (S[k / 32] * (float)q + B[k / 32]);
      }
      y[(long)m * 28672 + n] = t_;
    }
  }
#endif
  
}
static void gate_up(float *restrict y, const float *restrict x, const unsigned *restrict gate_up_w, const unsigned char *restrict gate_up_s, const unsigned short *restrict gate_up_sd, int nb, int ne) {
  { int b_ = nb > 0 ? nb : 0, e_ = ne < 28672 ? ne : 28672;
    if (b_ < e_) gate_up_rows(y + 0, x, gate_up_w, gate_up_s, gate_up_sd, b_ - 0, e_ - 0); }
}

static void down_rows(float *restrict y, const float *restrict x, const unsigned *restrict down_w, const signed char *restrict down_s, const unsigned short *restrict down_sd, int nb, int ne) {
  const unsigned *restrict w = down_w; const signed char *restrict s = down_s; const unsigned short *restrict sd = down_sd;
#ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(48);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[9][14368] __attribute__((aligned(64)));
  float dxs[9][448], dxgs[9][896], xgs[9][896];
  __m256i xcs[9][448];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][896], sbc[4][896]; (void)sbc;
  float gs[9][4][900] __attribute__((aligned(32))), bsum[9][4];   /* per x row and weight row */
  __m512 sums[9][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(48);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 131074, 131074, 131074, 131074, 131074, 131074, 131074, 131074);   /* run c + 1: one more run's shift */
    (void)gidx; (void)hbase; (void)hmask512;
  for (int c0 = 0; c0 < 64; c0 += 9) {
    int mend = c0 + 9 < 64 ? c0 + 9 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[896];
    for (int u = 0; u < 448; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 14336) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 448; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 14336) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-32));
    }
    for (int g = 0; g < 896; g++) {
      float t = 0;
      for (int u = g * 1; u < (g + 1) * 1; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 16 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 4096 ? n0 + r : 4096 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 2688);
        whr[r] = wr[r] + 7168;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 896; g += 8) {
          __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[n * 56 + g / 16])), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + n * 896 + g)))));
          _mm256_storeu_ps(&sf[r][g], Sv);
        }
        for (; g < 896; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[n * 56 + g / 16]) * (float)s[n * 896 + g];
          sf[r][g] = S[0];
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 896; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 896; g++) gsr[g] = sf[r][g] * dxg[g];
        bsum[m - c0][r] = 0;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 448; cs += 64) {
        const int ce = cs + 64 < 448 ? cs + 64 : 448;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 2) {   /* the slice's codes */
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + c * 16)));
        __m512i qe = _mm512_and_si512(v, nib512), qo = _mm512_srli_epi16(v, 4);
          { const __m512i hsv = _mm512_add_epi16(hbase, _mm512_set1_epi16(2 * (c % 4)));
            __m512i hb = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(whr[r] + (c / 4) * 32))), hsv);
            qe = _mm512_ternarylogic_epi32(qe, _mm512_slli_epi16(hb, 4), hmask512, 0xF8);   /* qe | (hb << 4 & hmask) */
            qo = _mm512_ternarylogic_epi32(qo, _mm512_srli_epi16(hb, 4), hmask512, 0xF8); }
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32], qe);
          _mm512_store_si512((void *)&qw[r][(c - cs) * 32 + 32], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m512 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 2) {
            __m512i xe0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 32)), 1);
      __m512i xo0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 48)), 1);
      __m512i x00 = _mm512_loadu_si512((const void *)&xc0[c]);   /* xc[c], xc[c + 1] */
            __m512i xe1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 32)), 1);
      __m512i xo1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16))), _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 48)), 1);
      __m512i x01 = _mm512_loadu_si512((const void *)&xc1[c]);   /* xc[c], xc[c + 1] */
            
            for (int r = 0; r < 4; r++) {
              __m512i qe = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32]), qo = _mm512_load_si512((const void *)&qw[r][(c - cs) * 32 + 32]);
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i0][r][c * 32 / 16]))), tot[0][r]); }
              { __m512i a = TV_DPWSSD512(TV_DPWSSD512(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_loadu_ps(&gs[i1][r][c * 32 / 16]))), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 4096; r++) y[(long)m * 4096 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(48);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[9][14368] __attribute__((aligned(64)));
  float dxs[9][448], dxgs[9][896], xgs[9][896];
  __m256i xcs[9][448];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][896], sbc[4][896]; (void)sbc;
  float gs[9][4][900] __attribute__((aligned(32))), bsum[9][4];   /* per x row and weight row */
  __m256 sums[9][4];   /* each row's sums between slices */
  
  for (int c0 = 0; c0 < 64; c0 += 9) {
    int mend = c0 + 9 < 64 ? c0 + 9 : 64;
    for (int m = c0; m < mend; m++) {   /* as the GEMV's x */
      short *xq = xqs[m - c0]; float *dx = dxs[m - c0], *dxg = dxgs[m - c0], *xg = xgs[m - c0]; __m256i *xc = xcs[m - c0];
      {
    float x16[896];
    for (int u = 0; u < 448; u++) {   /* x's scale per unit of 32 inputs */
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps((x + (long)m * 14336) + u * 32 + 8 * j), absmask));
      __m128 mh = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mh = _mm_max_ps(mh, _mm_movehl_ps(mh, mh));
      dx[u] = _mm_cvtss_f32(_mm_max_ss(mh, _mm_shuffle_ps(mh, mh, 1))) * (1.0f / 32767.0f);
    }
    for (int c = 0; c < 448; c++) {   /* x in 16 bits, in each run's even/odd order; float sums per 16 inputs */
      const float *xr = (x + (long)m * 14336) + c * 32;
      float d = dx[c * 32 / 32];
      __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
      x16[2 * c] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8)));
      x16[2 * c + 1] = hsum8(_mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24)));
      int qi[32] __attribute__((aligned(32)));
      for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * j), inv)));
      for (int t = 0; t < 16; t++) { xq[c * 32 + t] = (short)qi[2 * t]; xq[c * 32 + 16 + t] = (short)qi[2 * t + 1]; }
      __m256i run_lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32)), ones),
                                           _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(xq + c * 32 + 16)), ones));
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-32));
    }
    for (int g = 0; g < 896; g++) {
      float t = 0;
      for (int u = g * 1; u < (g + 1) * 1; u++) t += x16[u];
      xg[g] = t;
      dxg[g] = dx[g * 16 / 32];
    }
  }
    }
    for (int n0 = nb; n0 < ne; n0 += 4) {
      const unsigned char *wr[4], *whr[4]; (void)whr;
      for (int r = 0; r < 4; r++) {   /* the tile's scales, once per chunk */
        long n = n0 + r < 4096 ? n0 + r : 4096 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 2688);
        whr[r] = wr[r] + 7168;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 896; g += 8) {
          __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[n * 56 + g / 16])), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + n * 896 + g)))));
          _mm256_storeu_ps(&sf[r][g], Sv);
        }
        for (; g < 896; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[n * 56 + g / 16]) * (float)s[n * 896 + g];
          sf[r][g] = S[0];
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 896; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 896; g++) gsr[g] = sf[r][g] * dxg[g];
        bsum[m - c0][r] = 0;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 448; cs += 64) {
        const int ce = cs + 64 < 448 ? cs + 64 : 448;
        for (int r = 0; r < 4; r++) for (int c = cs; c < ce; c += 1) {   /* the slice's codes */
          __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + c * 16)));
        __m256i qe = _mm256_and_si256(v, nib), qo = _mm256_srli_epi16(v, 4);
          { __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(whr[r] + (c / 4) * 32)), _mm_cvtsi32_si128(2 * (c % 4)));
            qe = _mm256_add_epi16(qe, _mm256_and_si256(_mm256_slli_epi16(hb, 4), hmask));
            qo = _mm256_add_epi16(qo, _mm256_and_si256(_mm256_srli_epi16(hb, 4), hmask)); }
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32], qe);
          _mm256_store_si256((__m256i *)&qw[r][(c - cs) * 32 + 16], qo);
        }
        for (int m = c0; m < mend; m += 2) {   /* 2 rows at a time share each load of the codes */
          const int i0 = (m + 0 < mend ? m + 0 : mend - 1) - c0; const int i1 = (m + 1 < mend ? m + 1 : mend - 1) - c0;   /* past the last row: computed again, stored once */
          const short *xq0 = xqs[i0]; const __m256i *xc0 = xcs[i0]; const short *xq1 = xqs[i1]; const __m256i *xc1 = xcs[i1];
          __m256 tot[2][4] = {{sums[i0][0], sums[i0][1], sums[i0][2], sums[i0][3]}, {sums[i1][0], sums[i1][1], sums[i1][2], sums[i1][3]}};
          for (int c = cs; c < ce; c += 1) {
            __m256i xe0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32)), xo0 = _mm256_load_si256((const __m256i *)(xq0 + c * 32 + 16));
      __m256i x00 = xc0[c];   /* -c * sum x */
            __m256i xe1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32)), xo1 = _mm256_load_si256((const __m256i *)(xq1 + c * 32 + 16));
      __m256i x01 = xc1[c];   /* -c * sum x */
            
            for (int r = 0; r < 4; r++) {
              __m256i qe = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32]), qo = _mm256_load_si256((const __m256i *)&qw[r][(c - cs) * 32 + 16]);
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x00, qe, xe0), qo, xo0);
          tot[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&gs[i0][r][2 * c]))), pair), tot[0][r]); }
              { __m256i a = TV_DPWSSD(TV_DPWSSD(x01, qe, xe1), qo, xo1);
          tot[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&gs[i1][r][2 * c]))), pair), tot[1][r]); }
              
            }
          }
          for (int r = 0; r < 4; r++) { sums[i1][r] = tot[1][r]; sums[i0][r] = tot[0][r]; }
        }
      }
      for (int m = c0; m < mend; m++)
        for (int r = 0; r < 4 && n0 + r < 4096; r++) y[(long)m * 4096 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[896], B[896]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 896; g++) { S[g] = h2f(sd[n * 56 + g / 16]) * (float)s[n * 896 + g]; }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 14336; k++) {
        unsigned q = (w[(long)n * 2688 + k / 8] >> (4 * (k % 8))) & 15u;
        { int run = k / 32;
          const unsigned char *hb = (const unsigned char *)(w + (long)n * 2688 + 1792);
          q |= ((hb[(run / 4) * 32 + k % 32] >> (2 * (run % 4))) & 3u) << 4; }
        t_ += x[(long)m * 14336 + k] * (S[k / 16] * ((float)q - 32.0f));
      }
      y[(long)m * 4096 + n] = t_;
    }
  }
#endif
  
}
static void down(float *restrict y, const float *restrict x, const unsigned *restrict down_w, const signed char *restrict down_s, const unsigned short *restrict down_sd, int nb, int ne) {
  { int b_ = nb > 0 ? nb : 0, e_ = ne < 4096 ? ne : 4096;
    if (b_ < e_) down_rows(y + 0, x, down_w, down_s, down_sd, b_ - 0, e_ - 0); }
}


static void rms_norm(float *restrict y, const float *restrict x, const float *restrict w) {
  for (int t = 0; t < 64; t++) {
    const float *xr = x + (long)t * 4096;
    vf acc = (vf){0};
    int i = 0;
    for (; i + 8 <= 4096; i += 8) { vf v = vload(xr + i); acc += v * v; }
    float ss = hsum(acc);
    for (; i < 4096; i++) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrt_f32(ss / 4096 + 1e-05f);
    for (int j = 0; j < 4096; j++) y[(long)t * 4096 + j] = xr[j] * inv * w[j];
  }
}


static inline void rope(float *restrict dst, const float *restrict x, const float *restrict c, const float *restrict sn) {
  for (int i = 0; i < 64; i++) {
    float x1 = x[i], x2 = x[i + 64];
    dst[i] = x1 * c[i] - x2 * sn[i];
    dst[i + 64] = x2 * c[i] + x1 * sn[i];
  }
}

/* tanh(y) = 1 - 2 / (e^2y + 1): exp8 saturates at e^88, where this is 1 */
static inline vf tanh8(vf y) { return 1.0f - 2.0f / (exp8(2.0f * y) + 1.0f); }
/* the MLP's gate: SiLU (SwiGLU) */
static inline vf gate8(vf g) { return g / (1.0f + exp8(-g)); }

static inline void store_k(float *restrict cache, void *unused, long at, const float *restrict x) {
  for (int i = 0; i < 128; i++) cache[at * 128 + i] = x[i];
}
static inline void store_v(float *restrict cache, void *unused, long at, const float *restrict x) {
  for (int i = 0; i < 128; i++) cache[at * 128 + i] = x[i];
}
/* rotate q and k (RMS-normed head by head first, with qk_norm), write k and v into their cache slots (slot -1: a
   padding token, nothing written) */
static void rope_write(float *restrict q, struct layer_ctx *c, const float *restrict qkv) {
  for (int t = 0; t < 64; t++) {
    const float *row = qkv + (long)t * 6144;
    int p = c->pos[t] < 0 ? 0 : c->pos[t] >= 4096 ? 4095 : c->pos[t];
    const float *cs = c->cs + (long)p * 128, *sn = cs + 64;
    float normed[128];
    for (int hd = 0; hd < 32; hd++) {
      const float *x = row + hd * 128;
      
      rope(q + ((long)t * 32 + hd) * 128, x, cs, sn);
    }
    int slot = c->slots[t];
    if (slot < 0) continue;   /* a padding token; the source leaves out the cache size so one binary serves every size */
    for (int hd = 0; hd < 8; hd++) {
      long at = (long)slot * 8 + hd;
      float k[128];
      const float *x = row + (32 + hd) * 128;
      
      rope(k, x, cs, sn);
      store_k(c->kc, 0, at, k);
      store_v(c->vc, 0, at, row + (40 + hd) * 128);
    }
  }
}

/* start loading the K and V rows of keys j0 .. j0 + 32 - 1 (those below je), every KV head (one contiguous run
   per key), while the tile before them is scored */
static inline void prefetch_rows(struct layer_ctx *c, const int *table, int j0, int je) {
  for (int j = j0; j < j0 + 32 && j < je; j++) {
    long slot = (long)table[j / 16] * 16 + j % 16;
    const char *kr = (const char *)(c->kc + slot * 1024), *vr = (const char *)(c->vc + slot * 1024);
    for (int b = 0; b < 4096; b += 64) __builtin_prefetch(kr + b, 0, 3);
    for (int b = 0; b < 4096; b += 64) __builtin_prefetch(vr + b, 0, 3);
  }
}

/* online softmax of KV head g's 4 query heads (qg; state m, l, acc) over the keys j0 .. j0 + nt - 1 of one tile */
static inline void attend_tile(const float *restrict qg, struct layer_ctx *c, const int *restrict table, int g, int j0, int nt,
                               float *restrict m, float *restrict l, vf (*restrict acc)[16], float *restrict kbuf, float *restrict vbuf) {
  const float *restrict kc = c->kc;
  const float *restrict vc = c->vc;
  int nb8 = (nt + 7) / 8;
  const float *kp[32], *vp[32];   /* the tile's K and V rows as floats */
  float kscale[32] __attribute__((aligned(32))), vscale[32] __attribute__((aligned(32)));   /* per-row dequantization scales (1 for a float cache) */
  for (int j = 0; j < nb8 * 8; j++) {   /* keys past nt (to a multiple of 8) repeat key j0: scored, then masked */
    int key = j0 + (j < nt ? j : 0);
    long slot = (long)table[key / 16] * 16 + key % 16;
    kp[j] = kc + (slot * 8 + g) * 128;
    kscale[j] = 1.0f;
    if (j < nt) {
      vp[j] = vc + (slot * 8 + g) * 128;
      vscale[j] = 1.0f;
    } else vscale[j] = 0.0f;
  }
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int hd = 0; hd < 4; hd++) {
    const float *qh = qg + hd * 128;
    vf sc[4], mx = (vf){0} + m[hd];
    for (int b = 0; b < nb8; b++) {   /* 8 keys' scores at once */
      vf d[8];
      for (int e = 0; e < 8; e++) d[e] = (vf){0};
      for (int i = 0; i < 16; i++) {
        vf qv = vload(qh + i * 8);
        for (int e = 0; e < 8; e++) d[e] += qv * vload(kp[b * 8 + e] + i * 8);
      }
      vf sb = hsum8x(d) * (*(const vf *)(kscale + b * 8) * 0.1f);
      
      sb = vsel(lane + b * 8 < nt, sb, (vf){0} - 1e30f);
      sc[b] = sb;
      mx = vsel(sb > mx, sb, mx);
    }
    float mt = mx[0];
    for (int e = 1; e < 8; e++) if (mx[e] > mt) mt = mx[e];
    float corr = exp_f32(m[hd] - mt);
    l[hd] *= corr;
    vf a[16];   /* in registers for the tile: acc may alias the rows as far as the compiler knows */
    for (int i = 0; i < 16; i++) a[i] = acc[hd][i] * corr;
    m[hd] = mt;
    float pv[32] __attribute__((aligned(32)));
    vf ls = (vf){0};
    for (int b = 0; b < nb8; b++) {
      vf p = exp8(sc[b] - mt);
      ls += p;
      *(vf *)(pv + b * 8) = p * *(const vf *)(vscale + b * 8);
    }
    l[hd] += hsum(ls);
    for (int j = 0; j < nt; j++) {
      float w = pv[j];
      for (int i = 0; i < 16; i++) a[i] += w * vload(vp[j] + i * 8);
    }
    for (int i = 0; i < 16; i++) acc[hd][i] = a[i];
  }
}

/* How many parts token t's keys are split into: a fixed function of the key count alone (never of the batch or the
   thread count), so a token's attention is the same arithmetic alone, in any batch and on any number of threads.
   A power of two (parts of at least 64 keys, at most 4), so the parts divide evenly over 2 or 4 threads. */
static inline int key_splits(int n) { int k = 1; while (k < 4 && n >= 2 * k * 64) k *= 2; return k; }
/* token t's first key: 0, or with a sliding window the oldest of the latest 0 keys */
static inline int first_key(struct layer_ctx *c, int t) { return 0 && c->token_pos[t] + 1 > 0 ? c->token_pos[t] + 1 - 0 : 0; }
static inline int token_units(struct layer_ctx *c, int t) { return c->token_seq[t] < 0 ? 0 : key_splits(c->token_pos[t] + 1 - first_key(c, t)); }

/* Attention units ub..ue-1, where a unit is one key split of one token (tokens in order, splits in order): token t
   attends to keys first_key(t)..token_pos[t] of block-table row token_seq[t] (-1: padding), causal in a chunk and the
   whole cached prefix (or its window). A unit sweeps its keys a tile at a time and, per tile, every KV head: each key's K (and V) rows
   for all heads are one contiguous run, read once, in order. The 4 query heads of a KV head share each row.
   A unit leaves its unnormalized state (acc, max, sum per query head) in c->part for attention_merge. */
static void attention(const float *restrict q, struct layer_ctx *c, int ub, int ue) {
  float *kbuf = 0;
  float *vbuf = 0;
  int t = 0, u0 = 0;   /* token t's units are u0 .. u0 + token_units(t) - 1 */
  for (int u = ub; u < ue; u++) {
    while (u >= u0 + token_units(c, t)) u0 += token_units(c, t++);
    int lo = first_key(c, t), sp = u - u0, n = c->token_pos[t] + 1 - lo, ns = key_splits(n), tiles = (n + 31) / 32;
    int jb = lo + tiles * sp / ns * 32, je = lo + tiles * (sp + 1) / ns * 32;
    if (je > lo + n) je = lo + n;
    const int *table = c->tables + (long)c->token_seq[t] * 64;
    const float *qt = q + (long)t * 4096;

    float m[32], l[32];
    vf acc[32][16];
    for (int hd = 0; hd < 32; hd++) { m[hd] = -1e30f; l[hd] = 0; for (int i = 0; i < 16; i++) acc[hd][i] = (vf){0}; }
    prefetch_rows(c, table, jb, je);
    for (int j0 = jb; j0 < je; j0 += 32) {
      int nt = je - j0 < 32 ? je - j0 : 32;
      prefetch_rows(c, table, j0 + 32, je);
      for (int g = 0; g < 8; g++) attend_tile(qt + g * 512, c, table, g, j0, nt, m + g * 4, l + g * 4, acc + g * 4, kbuf, vbuf);
    }
    float *ps = c->part + ((long)t * 4 + sp) * 4160;   /* [H][D] acc, [H] max, [H] sum */
    for (int hd = 0; hd < 32; hd++) {
      for (int i = 0; i < 16; i++) *(vf_u *)(ps + hd * 128 + i * 8) = acc[hd][i];
      ps[4096 + hd] = m[hd];
      ps[4128 + hd] = l[hd];
    }
  }
}

/* tokens tb..te-1: combine each token's key splits in order (rescaled to the largest max), normalize, write */
static void attention_merge(float *restrict out, struct layer_ctx *c, int tb, int te) {
  for (int t = tb; t < te; t++) {
    float *o = out + (long)t * 4096;
    int ns = token_units(c, t);
    if (!ns) { for (int i = 0; i < 4096; i++) o[i] = 0; continue; }
    const float *p0 = c->part + (long)t * 16640;
    for (int hd = 0; hd < 32; hd++) {
      float mx = p0[4096 + hd];
      for (int sp = 1; sp < ns; sp++) { float ms = p0[sp * 4160 + 4096 + hd]; if (ms > mx) mx = ms; }
      vf r[16];
      float lsum = 0;
      for (int i = 0; i < 16; i++) r[i] = (vf){0};
      for (int sp = 0; sp < ns; sp++) {
        const float *ps = p0 + sp * 4160;
        float w = ns == 1 ? 1.0f : exp_f32(ps[4096 + hd] - mx);
        lsum += ps[4128 + hd] * w;
        for (int i = 0; i < 16; i++) r[i] += vload(ps + hd * 128 + i * 8) * w;
      }
      float inv = 1.0f / lsum;
      float *oh = o + hd * 128;
      for (int i = 0; i < 16; i++) { vf v = r[i] * inv; for (int e = 0; e < 8; e++) oh[i * 8 + e] = v[e]; }
      
    }
  }
}

/* the thread pool's parts (kernels/threads.py): rows of each projection in runs of 4, (token, KV head) pairs of
   attention, elements of SiLU * up; norms, RoPE and residual adds are short and stay on the calling thread */
#define SHARE_ROWS(n) int nb, ne; tv_share_rows(n, part, nparts, &nb, &ne);
static void part_qkv(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx; SHARE_ROWS(6144) qkv(c->qkv_out, c->xn, c->qkv0_w, c->qkv0_s, c->qkv0_sd, c->qkv1_w, c->qkv1_s, c->qkv1_sd, c->qkv2_w, c->qkv2_s, c->qkv2_sd, nb, ne);
}
static void part_attention(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx;
  int units = 0, ub, ue;
  for (int t = 0; t < 64; t++) units += token_units(c, t);
  tv_share(units, part, nparts, &ub, &ue);
  attention(c->q, c, ub, ue);
}
static void part_merge(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx;
  int tb, te;
  tv_share(64, part, nparts, &tb, &te);
  attention_merge(c->att, c, tb, te);
}
static void part_o(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx; SHARE_ROWS(4096) o(c->prod, c->att, c->o_w, c->o_s, c->o_sd, nb, ne);
}
static void part_gate_up(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx; SHARE_ROWS(28672) gate_up(c->gu, c->xn, c->gate_up_w, c->gate_up_s, c->gate_up_sd, nb, ne);
}
static void part_act(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx;
  int b, e;
  tv_share(917504, part, nparts, &b, &e);
  for (int j = b; j < e;) {   /* SiLU(gate) * up, 8 at a time inside a token's row */
    int t = j / 14336, i = j % 14336;
    const float *g = c->gu + (long)t * 28672 + i, *u = g + 14336;
    if (i + 8 <= 14336 && j + 8 <= e) {
      *(vf_u *)(c->act + j) = gate8(vload(g)) * vload(u);
      j += 8;
    } else { c->act[j] = gate8((vf){0} + g[0])[0] * u[0]; j++; }
  }
}
static void part_down(void *ctx, int part, int nparts) {
  struct layer_ctx *c = ctx; SHARE_ROWS(4096) down(c->prod, c->act, c->down_w, c->down_s, c->down_sd, nb, ne);
}

void layer(float *restrict out, float *restrict kc, float *restrict vc, float *restrict scratch, const float *restrict h, const int *restrict pos, const int *restrict slots, const int *restrict tables, const int *restrict token_seq, const int *restrict token_pos, const float *restrict cs, const float *restrict ln1, const float *restrict ln2, const unsigned *restrict qkv0_w, const unsigned char *restrict qkv0_s, const unsigned short *restrict qkv0_sd, const unsigned *restrict qkv1_w, const unsigned char *restrict qkv1_s, const unsigned short *restrict qkv1_sd, const unsigned *restrict qkv2_w, const signed char *restrict qkv2_s, const unsigned short *restrict qkv2_sd, const unsigned *restrict o_w, const unsigned char *restrict o_s, const unsigned short *restrict o_sd, const unsigned *restrict gate_up_w, const unsigned char *restrict gate_up_s, const unsigned short *restrict gate_up_sd, const unsigned *restrict down_w, const signed char *restrict down_s, const unsigned short *restrict down_sd, const unsigned long long *restrict pool) {
  float *xn = scratch, *qkv_out = xn + 262144, *q = qkv_out + 393216, *att = q + 262144;
  float *gu = att + 262144, *act = gu + 1835008, *prod = act + 917504, *part = prod + 262144;
  struct layer_ctx c = {out, kc, vc, scratch, h, pos, slots, tables, token_seq, token_pos, cs, ln1, ln2, qkv0_w, qkv0_s, qkv0_sd, qkv1_w, qkv1_s, qkv1_sd, qkv2_w, qkv2_s, qkv2_sd, o_w, o_s, o_sd, gate_up_w, gate_up_s, gate_up_sd, down_w, down_s, down_sd, pool, xn, qkv_out, q, att, gu, act, prod, part};
  rms_norm(xn, h, ln1);
  tv_parallel(pool, part_qkv, &c);
  rope_write(q, &c, qkv_out);
  tv_parallel(pool, part_attention, &c);
  tv_parallel(pool, part_merge, &c);
  tv_parallel(pool, part_o, &c);
  
  for (long i = 0; i < 262144; i++) out[i] = h[i] + prod[i];
  rms_norm(xn, out, ln2);
  tv_parallel(pool, part_gate_up, &c);
  tv_parallel(pool, part_act, &c);
  tv_parallel(pool, part_down, &c);
  
  for (long i = 0; i < 262144; i++) out[i] += prod[i];
}

static inline void tv_parallel(const unsigned long long *pool, tv_task fn, void *ctx) {
  if (pool[0]) ((void (*)(unsigned long long, tv_task, void *))pool[0])(pool[1], fn, ctx);
  else fn(ctx, 0, 1);
}
static inline void tv_share(int units, int part, int nparts, int *begin, int *end) {
  *begin = (int)((long)units * part / nparts);
  *end = (int)((long)units * (part + 1) / nparts);
}
/* rows [begin, end) of `rows` for one part, in runs of 4: each 4-row tile is computed whole by one thread */
static inline void tv_share_rows(int rows, int part, int nparts, int *begin, int *end) {
  tv_share((rows + 3) / 4, part, nparts, begin, end);
  *begin *= 4;
  *end = *end * 4 < rows ? *end * 4 : rows;
}


static inline float h2f(unsigned short h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  unsigned sign = (unsigned)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (!man) bits = sign;
  else { unsigned e = 113; while (!(man & 0x400)) { man <<= 1; e--; } bits = sign | (e << 23) | ((man & 0x3FF) << 13); }
  union { unsigned u; float f; } c = {bits};
  return c.f;
#endif
}

#ifdef TV_AVX2

static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

#endif
