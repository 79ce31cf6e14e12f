#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TV_AVX2 1
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
static inline float h2f(unsigned short h);
#ifdef TV_AVX2
static inline float hsum8(__m256 v);
#endif

typedef void (*tv_task)(void *ctx, int part, int nparts);
static inline void tv_parallel(const unsigned long long *pool, tv_task fn, void *ctx);
static inline void tv_share(int units, int part, int nparts, int *begin, int *end);
static inline void tv_share_rows(int rows, int part, int nparts, int *begin, int *end);

void packed_linear_64_64_14336_4_32_8ua(float *restrict y, const float *restrict x, const unsigned *restrict w, const unsigned char *restrict s, const unsigned short *restrict sd, const unsigned long long *restrict pool);
struct packed_linear_64_64_14336_4_32_8ua_ctx { float *y; const float *x; const unsigned *w; const unsigned char *s; const unsigned short *sd; };
static void packed_linear_64_64_14336_4_32_8ua_rows(void *ctx, int part, int nparts);
void packed_linear_64_64_14336_4_32_8ua(float *restrict y, const float *restrict x, const unsigned *restrict w, const unsigned char *restrict s, const unsigned short *restrict sd, const unsigned long long *restrict pool) {
  struct packed_linear_64_64_14336_4_32_8ua_ctx c = {y, x, w, s, sd};
  tv_parallel(pool, packed_linear_64_64_14336_4_32_8ua_rows, &c);
}
static void packed_linear_64_64_14336_4_32_8ua_rows(void *ctx, int part, int nparts) {
  struct packed_linear_64_64_14336_4_32_8ua_ctx *c = ctx;
  float *restrict y = c->y; const float *restrict x = c->x; const unsigned *restrict w = c->w; const unsigned char *restrict s = c->s; const unsigned short *restrict sd = c->sd;
  int nb, ne;
  tv_share_rows(64, part, nparts, &nb, &ne);
  #ifdef TV_AVX2
#ifdef TV_AVX512

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[9][14368] __attribute__((aligned(64)));
  float dxs[9][448], dxgs[9][448], xgs[9][448];
  __m256i xcs[9][448];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][448], sbc[4][448]; (void)sbc;
  float gs[9][4][452] __attribute__((aligned(32))), bsum[9][4];   /* per x row and weight row */
  __m512 sums[9][4];   /* each row's sums between slices */
  
    const __m512i nib512 = _mm512_set1_epi16(15), hmask512 = _mm512_set1_epi16(0);
    const __m512i gidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);   /* int32 lane -> its group among the 4 loaded */
    const __m512i hbase = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);   /* run c + 1: one more run's shift */
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
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 448; g++) {
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
        long n = n0 + r < 64 ? n0 + r : 64 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 1792);
        whr[r] = wr[r] + 7168;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 448; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 448 + g))), deint);
        long d_ = 2 * (n * 56 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 448; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 56 + g / 8)]) * (float)s[2 * (n * 448 + g)]; B[0] = -(h2f(sd[2 * (n * 56 + g / 8) + 1]) * (float)s[2 * (n * 448 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 448; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 448; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 448; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 448; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm512_setzero_ps();
      }
      for (int cs = 0; cs < 448; cs += 64) {
        const int ce = cs + 64 < 448 ? cs + 64 : 448;
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
        for (int r = 0; r < 4 && n0 + r < 64; r++) y[(long)m * 64 + n0 + r] = _mm512_reduce_add_ps(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#else

  const __m256i nib = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1), pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hmask = _mm256_set1_epi16(0);   /* a run's high bits, moved to bits 4.. of a 16-bit code */
  const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  (void)pair; (void)hmask; (void)deint; (void)nib;
  short xqs[9][14368] __attribute__((aligned(64)));
  float dxs[9][448], dxgs[9][448], xgs[9][448];
  __m256i xcs[9][448];
  short qw[4][2080] __attribute__((aligned(64)));   /* a slice's codes; per step: its even codes, then its odd */
  float sf[4][448], sbc[4][448]; (void)sbc;
  float gs[9][4][452] __attribute__((aligned(32))), bsum[9][4];   /* per x row and weight row */
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
      xc[c] = _mm256_mullo_epi32(run_lanes, _mm256_set1_epi32(-8));
    }
    for (int g = 0; g < 448; g++) {
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
        long n = n0 + r < 64 ? n0 + r : 64 - 1;   /* past the last row: recompute it, store nothing */
        wr[r] = (const unsigned char *)(w + n * 1792);
        whr[r] = wr[r] + 7168;
        int g = 0;   /* scales, and (affine) the bias terms' factors B + c S, as the GEMV computes them */
        for (; g + 8 <= 448; g += 8) {
          __m128i sm_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(s + 2 * (n * 448 + g))), deint);
        long d_ = 2 * (n * 56 + g / 8);
        __m256 Sv = _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm_)));
        __m256 Bv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(h2f(sd[d_ + 1])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm_, 8)))));
          _mm256_storeu_ps(&sf[r][g], Sv); _mm256_storeu_ps(&sbc[r][g], _mm256_fmadd_ps(Sv, _mm256_set1_ps(8.0f), Bv));
        }
        for (; g < 448; g++) {
          float S[1], B[1]; (void)B;
          S[0] = h2f(sd[2 * (n * 56 + g / 8)]) * (float)s[2 * (n * 448 + g)]; B[0] = -(h2f(sd[2 * (n * 56 + g / 8) + 1]) * (float)s[2 * (n * 448 + g) + 1]);
          sf[r][g] = S[0]; sbc[r][g] = __builtin_fmaf(S[0], 8.0f, B[0]);
        }
      }
      for (int m = c0; m < mend; m++) for (int r = 0; r < 4; r++) {   /* gs and bsum per x row, as the GEMV's */
        const float *dxg = dxgs[m - c0], *xg = xgs[m - c0]; (void)xg;
        float *gsr = gs[m - c0][r];
        int g = 0;
        for (; g + 8 <= 448; g += 8) _mm256_storeu_ps(gsr + g, _mm256_mul_ps(_mm256_loadu_ps(&sf[r][g]), _mm256_loadu_ps(dxg + g)));
        for (; g < 448; g++) gsr[g] = sf[r][g] * dxg[g];
        __m256 bacc = _mm256_setzero_ps();
        for (g = 0; g + 8 <= 448; g += 8) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(&sbc[r][g]), _mm256_loadu_ps(xg + g), bacc);
        float bs = hsum8(bacc);
        for (; g < 448; g++) bs = __builtin_fmaf(sbc[r][g], xg[g], bs);
        bsum[m - c0][r] = bs;
        sums[m - c0][r] = _mm256_setzero_ps();
      }
      for (int cs = 0; cs < 448; cs += 64) {
        const int ce = cs + 64 < 448 ? cs + 64 : 448;
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
        for (int r = 0; r < 4 && n0 + r < 64; r++) y[(long)m * 64 + n0 + r] = hsum8(sums[m - c0][r]) + bsum[m - c0][r];
    }
  }
#endif
#else

  float S[448], B[448]; (void)B;
  for (int n = nb; n < ne; n++) {
    for (int g = 0; g < 448; g++) { S[g] = h2f(sd[2 * (n * 56 + g / 8)]) * (float)s[2 * (n * 448 + g)]; B[g] = -(h2f(sd[2 * (n * 56 + g / 8) + 1]) * (float)s[2 * (n * 448 + g) + 1]); }
    for (int m = 0; m < 64; m++) {
      float t_ = 0;
      for (int k = 0; k < 14336; k++) {
        unsigned q = (w[(long)n * 1792 + k / 8] >> (4 * (k % 8))) & 15u;
        
        t_ += x[(long)m * 14336 + k] * (S[k / 32] * (float)q + B[k / 32]);
      }
      y[(long)m * 64 + n] = t_;
    }
  }
#endif
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

