/* AVX-512 (F, BW, DQ, VL) kernels, compiled for that target whatever the build
 * flags; dispatch.c only selects them on a CPU that has it. */
#include "../convert.h"
#include "../internal.h"
#include "../testing.h"

#if SDPA_HAVE_X86_KERNELS

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#endif

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/*
 * exp: x = n ln2 + r with n = round(x / ln2), |r| <= ln2/2 (ln2 split in two
 * parts so that r is exact to a few ulp), e^r by its Taylor polynomial
 * (degree 7 for float, 13 for double: truncation error below 1e-8 and 1e-17
 * relative), then scalef(p, n) = p 2^n.  Below the cut (SDPA_EXP_CUT_F32/F64,
 * internal.h) the result is exactly 0, and nothing below the smallest normal
 * number is ever computed: the input is clamped to the cut first and the
 * lanes below it are zeroed by the scalef's mask, because an underflowing
 * result costs Intel cores a microcode assist per lane (with the caller's
 * default flags), and a masked key or one far below the row's max is such a
 * lane.  Above +200 (float) or +1500 (double) e^x is inf anyway; NaN stays.
 * Measured against libm: see tests/test_kernels.py.
 */
#define EXP_AVX512_PS(name, V, M, P)                                                              \
    static inline V name(V x) {                                                                    \
        const M keep = P##_cmp_ps_mask(x, P##_set1_ps(SDPA_EXP_CUT_F32), _CMP_NLT_UQ); /* NaN kept */ \
        x = P##_max_ps(P##_set1_ps(SDPA_EXP_CUT_F32), x); /* NaN stays (second operand) */           \
        x = P##_min_ps(P##_set1_ps(200.0f), x);                                                   \
        V n = P##_roundscale_ps(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                 \
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                   \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                     \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                    \
        V p = P##_set1_ps(1.0f / 5040.0f);                                                        \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 720.0f));                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 120.0f));                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 24.0f));                                        \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 6.0f));                                         \
        p = P##_fmadd_ps(p, r, P##_set1_ps(0.5f));                                                \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                \
        return P##_maskz_scalef_ps(keep, p, n);                                                   \
    }
/* the float kernels' exp on 512-bit vectors, and the same operations on
 * 256-bit ones (AVX-512 VL) for the quarter-width panels: the same bits a lane */
EXP_AVX512_PS(exp_avx512_ps, __m512, __mmask16, _mm512)
EXP_AVX512_PS(exp_avx512_ps256, __m256, __mmask8, _mm256)
#undef EXP_AVX512_PS

static inline __m512d exp_avx512_pd(__m512d x) {
    const __mmask8 keep = _mm512_cmp_pd_mask(x, _mm512_set1_pd(SDPA_EXP_CUT_F64), _CMP_NLT_UQ);
    x = _mm512_max_pd(_mm512_set1_pd(SDPA_EXP_CUT_F64), x);
    x = _mm512_min_pd(_mm512_set1_pd(1500.0), x);
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634074)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
    static const double inv_fact[14] = {
        1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
        1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,
        1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,         0.5,
        1.0,                1.0};
    __m512d p = _mm512_set1_pd(inv_fact[0]);
    for (int i = 1; i < 14; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inv_fact[i]));
    return _mm512_maskz_scalef_pd(keep, p, n);
}

#define MAX_NAN_PS(name, V, P)                                                       \
    static inline V name(V acc, V x) {                                               \
        V m = P##_max_ps(x, acc); /* keeps a NaN in acc */                            \
        return P##_mask_mov_ps(m, P##_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);            \
    }
MAX_NAN_PS(max_nan_ps, __m512, _mm512)
MAX_NAN_PS(max_nan_ps256, __m256, _mm256)
#undef MAX_NAN_PS
static inline __m512d max_nan_pd(__m512d acc, __m512d x) {
    __m512d m = _mm512_max_pd(x, acc);
    return _mm512_mask_mov_pd(m, _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q), x);
}
#define NEGINF_TO_ZERO_PS(name, V, P)                                                                  \
    static inline V name(V x) {                                                                         \
        return P##_mask_mov_ps(x, P##_cmp_ps_mask(x, P##_set1_ps(-INFINITY), _CMP_EQ_OQ), P##_setzero_ps()); \
    }
NEGINF_TO_ZERO_PS(neginf_to_zero_ps, __m512, _mm512)
NEGINF_TO_ZERO_PS(neginf_to_zero_ps256, __m256, _mm256)
#undef NEGINF_TO_ZERO_PS
static inline __m512d neginf_to_zero_pd(__m512d x) {
    return _mm512_mask_mov_pd(x, _mm512_cmp_pd_mask(x, _mm512_set1_pd(-INFINITY), _CMP_EQ_OQ),
                              _mm512_setzero_pd());
}

static void widen_avx512(sdpa_dtype dt, const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    if (dt == SDPA_BFLOAT16) {
        for (; i + 16 <= n; i += 16) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
    } else {
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    }
    if (i < n) sdpa_widen_portable(dt, src + i, dst + i, n - i);
}

/* 16 float8 e4m3fn values, each divided by 256 (exactly): the byte
 * sign-extended to 16 bits and shifted left by 7, with bit 14 cleared, is the
 * value as a float16 whose exponent bias is 8 more (subnormals alike).
 * S.1111.111 (NaN) gives NaN. */
static inline __m512 load_e4m3_ps(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbf80));
    const __mmask16 num = _mm_cmpneq_epi8_mask(_mm_or_si128(b, _mm_set1_epi8((char)0x80)), _mm_set1_epi8((char)0xff));
    return _mm512_mask_cvtph_ps(_mm512_set1_ps(NAN), num, h);
}

/* 16 float8 e5m2 values: the upper bytes of float16s */
static inline __m512 load_e5m2_ps(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}

/* 16 int4 values from 8 bytes (low nibble first, each the value plus 8) */
static inline __m512 load_i4_ps(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    const __m128i x = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
}

/* lane i of the result = the sum of the lanes of a[i]: 16 (8) horizontal sums
 * in 15 (7) adds, halving the vectors at each step */
static inline __m512 hsum_lanes_ps(const __m512 *a) {
    __m512 s2[8], s4[4], s8[2];
    for (int i = 0; i < 8; i++)  /* [a0+a2 b0+b2 a1+a3 b1+b3] per 128-bit group */
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* [a b c d] of each 128-bit group */
        __m512d x = _mm512_castps_pd(s2[2 * i]), y = _mm512_castps_pd(s2[2 * i + 1]);
        s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  /* groups 0+1 and 2+3 of four vectors each */
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s8[0], s8[1], 0x88), _mm512_shuffle_f32x4(s8[0], s8[1], 0xDD));
}
/* lanes 0-3 = the sums of a[0..4), each by hsum_lanes_ps's tree (the same
 * operations on the same operands: a score summed here has the bits it has
 * there).  Its first two levels are hsum_lanes_ps's written again: a shared
 * helper for them measured a bfloat16 decoding step 6% slower (the code
 * around hsum_lanes_ps compiled otherwise; 446 -> 470 us in cache). */
static inline __m512 hsum4_ps(const __m512 *a) {
    __m512 s2[2];
    for (int i = 0; i < 2; i++)
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    const __m512d x = _mm512_castps_pd(s2[0]), y = _mm512_castps_pd(s2[1]);
    const __m512 s4 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const __m512 s8 = _mm512_add_ps(_mm512_shuffle_f32x4(s4, s4, 0x88), _mm512_shuffle_f32x4(s4, s4, 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s8, s8, 0x88), _mm512_shuffle_f32x4(s8, s8, 0xDD));
}
static inline __m512d hsum_lanes_pd(const __m512d *a) {
    __m512d s2[4], s4[2];
    for (int i = 0; i < 4; i++)  /* [a0+a1 b0+b1] per 128-bit group */
        s2[i] = _mm512_add_pd(_mm512_unpacklo_pd(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_pd(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        s4[i] = _mm512_add_pd(_mm512_shuffle_f64x2(s2[2 * i], s2[2 * i + 1], 0x88),
                              _mm512_shuffle_f64x2(s2[2 * i], s2[2 * i + 1], 0xDD));
    return _mm512_add_pd(_mm512_shuffle_f64x2(s4[0], s4[1], 0x88), _mm512_shuffle_f64x2(s4[0], s4[1], 0xDD));
}

/* r[i] (row i of a 16 x 16 block) becomes column i */
static inline void transpose16_ps(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
            __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + 2 + h]);
            r[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    /* now 128-bit group g of r[4i + c] holds rows 4i..4i+3 of column 4g + c:
     * gather the groups of the four row blocks */
    for (int c = 0; c < 4; c++) {
        __m512 a0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), a1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        __m512 b0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44), b1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_f32x4(a0, b0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(a0, b0, 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(a1, b1, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(a1, b1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 16 bytes of a bool mask: 0 where nonzero (visible), -inf where zero */
static inline __m512 bool_to_neginf_ps(const uint8_t *p) {
    __mmask16 visible = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8(-1));
    return _mm512_maskz_mov_ps((__mmask16)~visible, _mm512_set1_ps(-INFINITY));
}

/* 16 floats rounded to bfloat16 as sdpa_f32_to_bf16 does (to nearest even, a
 * NaN made quiet), with integer operations: VCVTNEPS2BF16 would flush
 * subnormal results. */
static inline __m256i f32_to_bf16_avx512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline float hmax_nan_ps(__m512 v) {
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return NAN;
    return _mm512_reduce_max_ps(v);
}
static inline double hmax_nan_pd(__m512d v) {
    if (_mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q)) return NAN;
    return _mm512_reduce_max_pd(v);
}

#include "avx512_f32.h"
#include "simd_impl.h"
#include "simd_end.h"

#include "avx512_f64.h"
#include "simd_impl.h"
#include "simd_end.h"

/* the panel kernels at half the width (kernel_table's *_half) */
#include "avx512_f32.h"
#define SIMD_HALF_SUF avx512_f32h
#define SIMD_HALF_NV 1
#include "simd_half.h"

/* the float panel kernels at a quarter of the width, on 256-bit vectors
 * (kernel_table's f32_quarter) */
#include "ymm_f32.h"
#include "avx512_f32q.h"
#define SIMD_PANELS_ONLY
#include "simd_impl.h"
#undef SIMD_PANELS_ONLY
#include "simd_end.h"

/* the panel kernels at half the width (kernel_table's *_half) */
#include "avx512_f64.h"
#define SIMD_HALF_SUF avx512_f64h
#define SIMD_HALF_NV 1
#include "simd_half.h"


/* Row-mode copies (internal.h): one multiply per element, as the driver's loops. */
static void scale_copy_avx512(float *dst, const float *src, int64_t n, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(s, _mm512_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = scale * src[i];
}

/* dropout's bits (internal.h), the portable loop vectorized for AVX-512 */
#define PHILOX_NAME dropout_bits_avx512
#include "philox_impl.h"
#undef PHILOX_NAME

static void scale_copy_d_avx512(float *dst, const float *src, int64_t n, double inv) {
    const __m512d s = _mm512_set1_pd(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(src + i)), s)));
    for (; i < n; i++) dst[i] = (float)((double)src[i] * inv);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---- bfloat16 products: VDPBF16PS (AVX512-BF16), for the "avx512_bf16" set ---- */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
#endif

#define BF16_NV 2  /* panel of 32 query rows: two vectors of 16 lanes */
#define BF16_MR 8

/* c[r][:] (=|+=) sum_p dot2(a[r*a_rs + p*a_ks], b[p][:]) for r < mr: one 32-bit
 * pair of a broadcast against 16 pairs of b, two bfloat16 products a lane. */
static inline __attribute__((always_inline)) void gemm_bf16_block(const int mr, int64_t kpairs, const uint32_t *a,
                                                                  int64_t a_rs, int64_t a_ks, const uint32_t *b,
                                                                  int64_t ldb, float *c, int64_t ldc, int accumulate) {
    __m512 acc[BF16_MR][BF16_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < BF16_NV; v++)
            acc[r][v] = accumulate ? _mm512_load_ps(c + r * ldc + v * 16) : _mm512_setzero_ps();
    for (int64_t p = 0; p < kpairs; p++) {
        __m512bh bv[BF16_NV];
        for (int v = 0; v < BF16_NV; v++) bv[v] = (__m512bh)_mm512_load_si512((const void *)(b + p * ldb + v * 16));
        const uint32_t *ap = a + p * a_ks;
        for (int r = 0; r < mr; r++) {
            __m512bh av = (__m512bh)_mm512_set1_epi32((int)ap[r * a_rs]);
            for (int v = 0; v < BF16_NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < BF16_NV; v++) _mm512_store_ps(c + r * ldc + v * 16, acc[r][v]);
}

static void gemm_bf16_avx512(int m, int64_t kpairs, const uint32_t *a, int64_t a_rs, int64_t a_ks,
                             const uint32_t *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    int r = 0;
    for (; r + BF16_MR <= m; r += BF16_MR)
        gemm_bf16_block(BF16_MR, kpairs, a + r * a_rs, a_rs, a_ks, b, ldb, c + r * ldc, ldc, accumulate);
    const uint32_t *ar = a + r * a_rs;
    float *cr = c + r * ldc;
    switch (m - r) {
        case 1: gemm_bf16_block(1, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 2: gemm_bf16_block(2, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 3: gemm_bf16_block(3, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 4: gemm_bf16_block(4, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 5: gemm_bf16_block(5, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 6: gemm_bf16_block(6, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 7: gemm_bf16_block(7, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        default: break;
    }
}

/* The query panel as pairs (internal.h's pack_q_pairs): word p of rows[x],
 * rows of e2 32-bit pairs read unaligned, 16 x 16 blocks transposed in
 * registers (the permutes move bits, never arithmetic on them). */
static void pack_q_pairs_avx512(uint32_t *panel, const uint16_t *const *rows, int n, int64_t e2) {
    for (int64_t p0 = 0; p0 < e2; p0 += 16) {
        const int w = e2 - p0 < 16 ? (int)(e2 - p0) : 16;
        const __mmask16 m = (__mmask16)((1u << w) - 1);
        for (int rb = 0; rb < BF16_NV; rb++) {
            __m512 t[16];
            for (int i = 0; i < 16; i++) {
                const int x = rb * 16 + i;
                t[i] = x < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, rows[x] + 2 * p0))
                             : _mm512_setzero_ps();
            }
            transpose16_ps(t);
            for (int i = 0; i < w; i++) _mm512_store_ps((float *)(panel + (p0 + i) * 32 + rb * 16), t[i]);
        }
    }
}

/* Pair i of 16 from rows r0 and r1 (r1 NULL: zeros), features c0.. under m */
static inline __m512i value_pair_avx512(const uint16_t *r0, const uint16_t *r1, __mmask16 m) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0));
    const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r1)) : _mm512_setzero_si512();
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* V pairs pair by pair (internal.h's pack_v_pairs, layout 0): dst[p*ld + c] */
static void pack_v_pairs_avx512(uint32_t *dst, int64_t ld, const uint16_t *src, int64_t rs, int n, int64_t ev) {
    for (int p = 0; 2 * p < n; p++) {
        const uint16_t *r0 = src + (int64_t)(2 * p) * rs, *r1 = 2 * p + 1 < n ? r0 + rs : NULL;
        for (int64_t c0 = 0; c0 < ev; c0 += 16) {
            const int w = ev - c0 < 16 ? (int)(ev - c0) : 16;
            const __mmask16 m = (__mmask16)((1u << w) - 1);
            _mm512_mask_storeu_epi32(dst + (int64_t)p * ld + c0, m, value_pair_avx512(r0 + c0, r1 ? r1 + c0 : NULL, m));
        }
    }
}

/* V pairs feature by feature (layout 1): dst[c*ld + p]; blocks of 16 pairs x
 * 16 features built along the rows of V and transposed in registers. */
static void pack_v_pairs_by_feature_avx512(uint32_t *dst, int64_t ld, const uint16_t *src, int64_t rs, int n,
                                           int64_t ev) {
    const int np = (n + 1) / 2;
    for (int p0 = 0; p0 < np; p0 += 16) {
        const int h = np - p0 < 16 ? np - p0 : 16;
        for (int64_t c0 = 0; c0 < ev; c0 += 16) {
            const int w = ev - c0 < 16 ? (int)(ev - c0) : 16;
            const __mmask16 m = (__mmask16)((1u << w) - 1);
            __m512 t[16];
            for (int i = 0; i < 16; i++) {
                const int p = p0 + i;
                if (i >= h) {
                    t[i] = _mm512_setzero_ps();
                    continue;
                }
                const uint16_t *r0 = src + (int64_t)(2 * p) * rs + c0;
                t[i] = _mm512_castsi512_ps(value_pair_avx512(r0, 2 * p + 1 < n ? r0 + rs : NULL, m));
            }
            transpose16_ps(t);
            const __mmask16 hm = (__mmask16)((1u << h) - 1);
            for (int i = 0; i < w; i++) _mm512_mask_storeu_ps((float *)(dst + (c0 + i) * ld + p0), hm, t[i]);
        }
    }
}

static void pack_v_pairs_set_avx512(int by_feature, uint32_t *dst, int64_t ld, const uint16_t *src, int64_t rs,
                                    int n, int64_t ev) {
    if (by_feature) pack_v_pairs_by_feature_avx512(dst, ld, src, rs, n, ev);
    else pack_v_pairs_avx512(dst, ld, src, rs, n, ev);
}

/* 2^t for t <= 0 or NaN (the softmax's exponents, in base 2): t = n + f with
 * n = round(t) (by adding and taking away 1.5 * 2^23, exact for |t| < 2^22),
 * |f| <= 1/2, 2^f by a degree-4 polynomial fitted for the least largest
 * relative error on [-1/2, 1/2] (2.7e-6 evaluated in float: P is rounded to
 * bfloat16, 3.9e-3, and the sums keep float's), then scalef.  Exactly 0 below
 * -125.9 (e^x below SDPA_EXP_CUT_F32: 2^-125.9 is normal, and no subnormal is
 * computed: those lanes are the scalef's masked ones); NaN stays NaN, and so
 * does what |t| >= 2^22 would garble (t is masked to 0 below the cut, and t
 * above 0 is at most the headroom's few units). */
static inline __m512 exp2_nonpos_avx512(__m512 t) {
    const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.9f), _CMP_NLT_UQ);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.009570113383233547f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591786280274391f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240247443318367f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931217908859253f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999992847442627f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* The exponentials of a panel's scores against the maxima whose -m log2 e is
 * nm, summed into sum and written to pp as bfloat16 pairs.  `huge`: maxima of
 * PAIRS_FMA_MAX_M or more in magnitude, or a scale beyond 1e38: the exponent
 * is taken as (s * scale - m) log2 e, as the float softmax takes it (s - m
 * exact near the max), rather than from one FMA, s (scale log2 e) - m log2 e,
 * whose two rounded products err by about |m| 2^-24 in the exponent: 0.11 at
 * |m| = 2e6, so a weight off by 8% and a weight above 1 (beyond 1e38 they
 * overflow). */
#define PAIRS_FMA_MAX_M 1024.0f
#define EXPONENT_HUGE(x, v) _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps((x), vs), m[v]), _mm512_set1_ps(1.44269504088896341f))
static inline __attribute__((always_inline)) void exp_pairs_avx512(const float *s, int n, __m512 c, const __m512 *nm,
                                                                   __m512 *sum, uint32_t *pp, const int huge,
                                                                   __m512 vs, const __m512 *m) {
    /* word x of a pair row: bfloat16 x of the first row, then x of the second */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int p = 0; 2 * p < n; p++) {
        const float *r0 = s + (int64_t)(2 * p) * 32;
        const int two = 2 * p + 1 < n;
        for (int v = 0; v < BF16_NV; v++) {
            const __m512 s0 = _mm512_load_ps(r0 + v * 16);
            const __m512 x0 = exp2_nonpos_avx512(huge ? EXPONENT_HUGE(s0, v) : _mm512_fmadd_ps(s0, c, nm[v]));
            sum[v] = _mm512_add_ps(sum[v], x0);
            __m512 x1 = _mm512_setzero_ps();
            if (two) {
                const __m512 s1 = _mm512_load_ps(r0 + 32 + v * 16);
                x1 = exp2_nonpos_avx512(huge ? EXPONENT_HUGE(s1, v) : _mm512_fmadd_ps(s1, c, nm[v]));
                sum[v] = _mm512_add_ps(sum[v], x1);
            }
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  /* x0's in the low half */
            _mm512_store_si512((void *)(pp + (int64_t)p * 32 + v * 16), _mm512_permutexvar_epi16(interleave, both));
        }
    }
}

/* How large a tile's sum of terms (so each term) may grow against a panel's
 * running max before the max is moved: 2^16, far from float's range (a term
 * e^(s - m) reaches it only where s is at least ln(2^16 / 512) = 4.9 above m),
 * and most tiles need neither a pass for their max nor a rescale of the
 * accumulators. */
#define LAZY_MAX_HEADROOM 65536.0f

/* The online softmax step of a 32-row panel with the scores' scale folded in
 * and P written as bfloat16 pairs (internal.h's online_softmax_pairs).  Its
 * exponentials are taken in base 2 from one fused multiply-add per score,
 * (s * scale - m) log2 e = s (scale log2 e) - m log2 e, within 3e-6 of
 * online_softmax_update_avx512_f32's (P is then rounded to bfloat16 anyway, 3.9e-3).
 * row_max is the max the terms are taken against: the rows' running max, or
 * less by at most ln 2^16 (the lse, m + log l, and the weights,
 * e^(s - m) / l, are the same either way).  scale > 0: the largest scaled
 * score is the scaled largest score (rounding is monotonic). */
static void online_softmax_pairs_avx512(const float *s, int n, float scale, float *row_max, float *row_sum, float *acc,
                                 int64_t ev, uint32_t *pp) {
    const float log2e = 1.44269504088896341f;
    const __m512 vs = _mm512_set1_ps(scale), c = _mm512_set1_ps(scale * log2e);
    __m512 m_new[BF16_NV], m_sub[BF16_NV], alpha[BF16_NV], sum[BF16_NV], nm[BF16_NV];
    /* Every row of the panel has a finite running max: one pass, against it,
     * kept unless a row's terms grew past the headroom (then the pass is done
     * again against the tile's max, below). */
    __mmask16 finite = 0xFFFF;
    for (int v = 0; v < BF16_NV; v++) {
        const __m512 old = _mm512_load_ps(row_max + v * 16);
        finite &= _mm512_cmp_ps_mask(_mm512_abs_ps(old), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    }
    const int huge_scale = !(scale < 1e38f);
    __mmask16 huge = 0;
    for (int v = 0; v < BF16_NV; v++)
        huge |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_load_ps(row_max + v * 16)), _mm512_set1_ps(PAIRS_FMA_MAX_M),
                                   _CMP_NLT_UQ);
    if (finite == 0xFFFF && !huge && !huge_scale) {
        for (int v = 0; v < BF16_NV; v++) {
            nm[v] = _mm512_mul_ps(_mm512_load_ps(row_max + v * 16), _mm512_set1_ps(-log2e));
            sum[v] = _mm512_setzero_ps();
        }
        exp_pairs_avx512(s, n, c, nm, sum, pp, 0, vs, nm);
        /* kept when every row's sum of terms stays below the headroom (so does
         * each term; NaN or inf is not kept) */
        __mmask16 ok = 0xFFFF;
        for (int v = 0; v < BF16_NV; v++) ok &= _mm512_cmp_ps_mask(sum[v], _mm512_set1_ps(LAZY_MAX_HEADROOM), _CMP_LT_OQ);
        if (ok == 0xFFFF) {
            for (int v = 0; v < BF16_NV; v++)
                _mm512_store_ps(row_sum + v * 16, _mm512_add_ps(_mm512_load_ps(row_sum + v * 16), sum[v]));
            return;
        }
    }
    for (int v = 0; v < BF16_NV; v++) {
        /* VMAXPS drops a NaN score here (it returns its second operand): the
         * NaN still reaches its row through its exponential below */
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < n; j++) mx = _mm512_max_ps(_mm512_load_ps(s + j * 32 + v * 16), mx);
        const __m512 old = _mm512_load_ps(row_max + v * 16);
        m_new[v] = max_nan_ps(old, _mm512_mul_ps(mx, vs));
        m_sub[v] = neginf_to_zero_ps(m_new[v]);
        alpha[v] = exp_avx512_ps(_mm512_sub_ps(old, m_sub[v]));
        sum[v] = _mm512_setzero_ps();
        nm[v] = _mm512_mul_ps(m_sub[v], _mm512_set1_ps(-log2e));
    }
    __mmask16 huge_m = 0;
    for (int v = 0; v < BF16_NV; v++)
        huge_m |= _mm512_cmp_ps_mask(_mm512_abs_ps(m_sub[v]), _mm512_set1_ps(PAIRS_FMA_MAX_M), _CMP_NLT_UQ);
    if (huge_m || huge_scale)
        exp_pairs_avx512(s, n, c, nm, sum, pp, 1, vs, m_sub);
    else
        exp_pairs_avx512(s, n, c, nm, sum, pp, 0, vs, m_sub);
    float alphas[32] __attribute__((aligned(64)));
    for (int v = 0; v < BF16_NV; v++) {
        _mm512_store_ps(row_sum + v * 16, _mm512_fmadd_ps(_mm512_load_ps(row_sum + v * 16), alpha[v], sum[v]));
        _mm512_store_ps(row_max + v * 16, m_new[v]);
        _mm512_store_ps(alphas + v * 16, alpha[v]);
    }
    int changed = 0, small = 0;
    for (int x = 0; x < 32; x++) {
        changed |= alphas[x] != 1;
        small |= alphas[x] > 0 && alphas[x] < (float)SDPA_RESCALE_SMALL;
    }
    if (!changed) return;
    if (small) {  /* internal.h: no subnormal product; the small factors' rows apart */
        for (int64_t c = 0; c < ev; c++)
            for (int x = 0; x < 32; x++) acc[c * 32 + x] = sdpa_rescale_f32(acc[c * 32 + x], alphas[x]);
        return;
    }
    for (int64_t c = 0; c < ev; c++)
        for (int v = 0; v < BF16_NV; v++) {
            float *ac = acc + c * 32 + v * 16;
            _mm512_store_ps(ac, _mm512_mul_ps(_mm512_load_ps(ac), alpha[v]));
        }
}
#undef LAZY_MAX_HEADROOM
#undef EXPONENT_HUGE
#undef PAIRS_FMA_MAX_M

enum { bf16_panel_rows = BF16_NV * 16 };
#undef BF16_NV
#undef BF16_MR

/* The amx set's code over emulated tiles (the test-only set amx_emulated): it
 * runs where avx512_bf16 does, with FMA for its fused sums. */
#define AMX_EMULATE 1
#include "amx_impl.h"
#undef AMX_EMULATE

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---- bfloat16 products on AMX tiles: the "amx" set (its emulation is above) ---- */


#if SDPA_HAVE_AMX_KERNELS
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#endif
#define AMX_EMULATE 0
#include "amx_impl.h"
#undef AMX_EMULATE
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

/* ---- integer_qk's scores with AVX512-VNNI (any set with AVX-512, on a CPU with VNNI) ---- */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

/* VPDPBUSD multiplies unsigned bytes by signed ones: the keys go in as
 * unsigned, int8 as value + 128 (the byte ^ 0x80), int4 as their nibbles
 * (value + 8), and each lane's products of the offset times the query's four
 * bytes (qi_offsets) are taken off after.  An int4 chunk of 64 values (32
 * bytes) unpacks by 128-bit lanes into the 16-value blocks 0, 2, 1, 3 of the
 * chunk: the query's int4 chunks are permuted alike (QI_INT4_ORDER). */
#define QI_INT4_ORDER _MM_SHUFFLE(3, 1, 2, 0)

static inline __attribute__((always_inline)) __m512i qi_keys(const uint8_t *p, const int int4) {
    if (!int4) return _mm512_xor_si512(_mm512_loadu_si512((const void *)p), _mm512_set1_epi8((char)0x80));
    const __m256i b = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(lo, hi)), _mm256_unpackhi_epi8(lo, hi), 1);
}

/* The scale of each lane of chunk c (64 values) of key row ks (group stride
 * ksc), groups of g values: one for g >= 64; for g of 32 or 16, the lane's
 * group, lane l holding values 4l.. (int8) or those of 16-value block
 * order[l / 4] (int4). */
static inline __attribute__((always_inline)) __m512 qi_scales(const float *ks, int64_t ksc, int64_t c, int64_t g,
                                                              const int int4) {
    if (g >= 64) return _mm512_set1_ps(ks[(c * 64 / g) * ksc]);
    const float *first = ks + (c * 64 / g) * ksc;
    if (g == 32) {
        const __mmask16 second = int4 ? 0xF0F0 : 0xFF00;
        return _mm512_mask_blend_ps(second, _mm512_set1_ps(first[0]), _mm512_set1_ps(first[ksc]));
    }
    const __m128 four = _mm_setr_ps(first[0], first[ksc], first[2 * ksc], first[3 * ksc]);
    const __m512i idx = int4 ? _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3)
                             : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(four));
}

/* Up to 4 rows (mr) x 4 keys from key row kj, one group a row (g = e): the
 * integer sums whole, then (exact in float, below 2^24) the offsets taken off,
 * each key's scale and the row's applied as the portable kernel applies them.
 * qp: the rows' query bytes as the keys are read (e a row); qt: each row's
 * lane offsets summed over the chunks (16 a row). */
static inline __attribute__((always_inline)) void qi_single4(const int int4, int mr, int64_t chunks,
                                                             const int8_t *qp, const int32_t *qt, int64_t e,
                                                             const float *qscale, const uint8_t *kj, int64_t ldk,
                                                             const float *ks, int64_t ksr, float *s, int64_t lds) {
    const int64_t cb = int4 ? 32 : 64;
    const int8_t *qx[4];
    for (int x = 0; x < 4; x++) qx[x] = qp + (x < mr ? x : mr - 1) * e;  /* past mr: a copy, not stored */
    __m512i acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; c++) {
        __m512i K[4];
        for (int t = 0; t < 4; t++) K[t] = qi_keys(kj + t * ldk + c * cb, int4);
        for (int x = 0; x < 4; x++) {
            const __m512i qv = _mm512_load_si512((const void *)(qx[x] + c * 64));
            for (int t = 0; t < 4; t++) acc[x * 4 + t] = _mm512_dpbusd_epi32(acc[x * 4 + t], K[t], qv);
        }
    }
    __m512 f[16];
    for (int x = 0; x < 4; x++) {
        const __m512i off = _mm512_load_si512((const void *)(qt + (x < mr ? x : mr - 1) * 16));
        for (int t = 0; t < 4; t++) f[x * 4 + t] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[x * 4 + t], off));
    }
    float r[16] __attribute__((aligned(64)));
    _mm512_store_ps(r, hsum_lanes_ps(f));
    for (int x = 0; x < mr; x++)
        for (int t = 0; t < 4; t++) s[x * lds + t] = r[x * 4 + t] * ks[t * ksr] * qscale[x];
}

/* Up to 4 rows x nt keys (4 or 1), several groups a row: each chunk's lane
 * sums (exact), less their offsets, converted and scaled by their group's
 * scale, summed in float; then the row's scale.  qo: per row and chunk, each
 * lane's offset products. */
static inline __attribute__((always_inline)) void qi_groups(const int int4, const int nt, int mr, int64_t chunks,
                                                            int64_t g, const int8_t *qp, const int32_t *qo,
                                                            int64_t e, const float *qscale, const uint8_t *kj,
                                                            int64_t ldk, const float *ks, int64_t ksr, int64_t ksc,
                                                            float *s, int64_t lds) {
    const int64_t cb = int4 ? 32 : 64;
    const int8_t *qx[4];
    const int32_t *ox[4];
    for (int x = 0; x < 4; x++) {
        const int xr = x < mr ? x : mr - 1;  /* past mr: a copy, not stored */
        qx[x] = qp + xr * e;
        ox[x] = qo + xr * chunks * 16;
    }
    __m512 f[16];
    for (int i = 0; i < 16; i++) f[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512i K[4];
        __m512 S[4];
        for (int t = 0; t < nt; t++) {
            K[t] = qi_keys(kj + t * ldk + c * cb, int4);
            S[t] = qi_scales(ks + t * ksr, ksc, c, g, int4);
        }
        for (int x = 0; x < 4; x++) {
            const __m512i qv = _mm512_load_si512((const void *)(qx[x] + c * 64));
            const __m512i off = _mm512_load_si512((const void *)(ox[x] + c * 16));
            for (int t = 0; t < nt; t++) {
                const __m512i d = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), K[t], qv), off);
                f[x * 4 + t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), S[t], f[x * 4 + t]);
            }
        }
    }
    if (nt == 4) {
        float r[16] __attribute__((aligned(64)));
        _mm512_store_ps(r, hsum_lanes_ps(f));
        for (int x = 0; x < mr; x++)
            for (int t = 0; t < 4; t++) s[x * lds + t] = r[x * 4 + t] * qscale[x];
    } else {
        for (int x = 0; x < mr; x++) s[x * lds] = _mm512_reduce_add_ps(f[x * 4]) * qscale[x];
    }
}

static int dot_qi_avx512_vnni(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q, int64_t ldq,
                              const float *qscale, const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr,
                              int64_t ksc, float *s, int64_t lds, void *work) {
    const int int4 = dt == SDPA_INT4;
    if ((dt != SDPA_INT8 && !int4) || e % 64 || e > 65536 || g <= 0 || e % g ||
        (g >= 64 ? g % 64 != 0 : g != 32 && g != 16))
        return 0;
    const int64_t chunks = e / 64;
    /* the query rows as the keys are read, each lane's offset products per
     * chunk, and their sums over the chunks */
    int8_t *qp = (int8_t *)work;
    int32_t *qo = (int32_t *)(qp + (size_t)m * (size_t)e);
    int32_t *qt = qo + (size_t)m * (size_t)chunks * 16;
    const __m512i off = _mm512_set1_epi8(int4 ? 8 : (char)0x80);
    for (int x = 0; x < m; x++) {
        __m512i total = _mm512_setzero_si512();
        for (int64_t c = 0; c < chunks; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(q + x * ldq + c * 64));
            if (int4) v = _mm512_shuffle_i64x2(v, v, QI_INT4_ORDER);
            _mm512_store_si512((void *)(qp + x * e + c * 64), v);
            const __m512i o = _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, v);
            _mm512_store_si512((void *)(qo + (x * chunks + c) * 16), o);
            total = _mm512_add_epi32(total, o);
        }
        _mm512_store_si512((void *)(qt + x * 16), total);
    }
    const int single = g == e;
    for (int x0 = 0; x0 < m; x0 += 4) {
        const int mr = m - x0 < 4 ? m - x0 : 4;
        const int8_t *qx = qp + x0 * e;
        float *sx = s + x0 * lds;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            const uint8_t *kj = k + j * ldk;
            const float *kss = ks + j * ksr;
            if (single && int4) qi_single4(1, mr, chunks, qx, qt + x0 * 16, e, qscale + x0, kj, ldk, kss, ksr, sx + j, lds);
            else if (single) qi_single4(0, mr, chunks, qx, qt + x0 * 16, e, qscale + x0, kj, ldk, kss, ksr, sx + j, lds);
            else if (int4) qi_groups(1, 4, mr, chunks, g, qx, qo + x0 * chunks * 16, e, qscale + x0, kj, ldk, kss, ksr, ksc, sx + j, lds);
            else qi_groups(0, 4, mr, chunks, g, qx, qo + x0 * chunks * 16, e, qscale + x0, kj, ldk, kss, ksr, ksc, sx + j, lds);
        }
        for (; j < n; j++) {  /* the last keys, one at a time */
            if (!single) {
                qi_groups(int4, 1, mr, chunks, g, qx, qo + x0 * chunks * 16, e, qscale + x0, k + j * ldk, ldk,
                          ks + j * ksr, ksr, ksc, sx + j, lds);
                continue;
            }
            for (int x = 0; x < mr; x++) {  /* the whole integer sum, as in qi_single4 */
                __m512i acc = _mm512_setzero_si512();
                for (int64_t c = 0; c < chunks; c++)
                    acc = _mm512_dpbusd_epi32(acc, qi_keys(k + j * ldk + c * (int4 ? 32 : 64), int4),
                                              _mm512_load_si512((const void *)(qx + x * e + c * 64)));
                const __m512i d = _mm512_sub_epi32(acc, _mm512_load_si512((const void *)(qt + (x0 + x) * 16)));
                sx[x * lds + j] = (float)_mm512_reduce_add_epi32(d) * ks[j * ksr] * qscale[x0 + x];
            }
        }
    }
    return 1;
}
#undef QI_INT4_ORDER

/* integer_pv's values: 64 of a row as signed bytes in order, int4 nibbles
 * unpacked (value c at byte c / 2, low nibble first) less 8. */
static inline __attribute__((always_inline)) __m512i pv_values(const uint8_t *p, const int int4) {
    if (!int4) return _mm512_loadu_si512((const void *)p);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));  /* word i: byte i */
    const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(0x000F));
    const __m512i hi = _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F00));
    return _mm512_sub_epi8(_mm512_or_si512(lo, hi), _mm512_set1_epi8(8));
}

/* One 32-bit lane's four weights (keys 4t.. of group i) of row x, for each
 * 128-bit lane of a chunk of 64 values starting in group gi: lane l holds
 * values 16l.. of the chunk, in group gi (g >= 64), gi + l / 2 (32) or
 * gi + l (16).  lin: the row's weights as bytes, SDPA_PV_KEYS a group. */
static inline __attribute__((always_inline)) __m512i pv_weights(const uint8_t *lin, int64_t g, int64_t gi, int t) {
    const uint8_t *at = lin + gi * SDPA_PV_KEYS + 4 * t;
    int32_t d[4];
    memcpy(&d[0], at, 4);
    if (g >= 64) return _mm512_set1_epi32(d[0]);
    memcpy(&d[1], at + SDPA_PV_KEYS, 4);
    if (g == 32) return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(d[0]), _mm512_set1_epi32(d[1]));
    memcpy(&d[2], at + 2 * SDPA_PV_KEYS, 4);
    memcpy(&d[3], at + 3 * SDPA_PV_KEYS, 4);
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                    _mm512_castsi128_si512(_mm_setr_epi32(d[0], d[1], d[2], d[3])));
}

/* internal.h's pv_qi.  The weights are rounded to bytes 16 at a time; then up
 * to 4 rows x 64 values, 4 keys a step: the four keys' value rows are
 * interleaved byte by byte (unpack by 8 then 16 bits), so that each 32-bit
 * lane holds one value of the four keys, and VPDPBUSD adds the row's four
 * weights (unsigned) times them (signed) to the lane.  The interleave leaves
 * value 16l + 4i + d of 128-bit lane l in register i, lane l, dword d; the
 * sums are put back in order (a 4 x 4 transpose of 128-bit lanes), converted
 * and scaled into acc. */
static int pv_qi_avx512_vnni(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const float *p, int64_t ldp,
                             const float *vs, const uint8_t *const *rows, float *acc, int64_t ldacc, void *work) {
    const int int4 = dt == SDPA_INT4;
    if ((dt != SDPA_INT8 && !int4) || ev % 64 || g <= 0 || ev % g || (g >= 64 ? g % 64 != 0 : g != 32 && g != 16) ||
        n > SDPA_PV_KEYS || n < 1)
        return 0;
    const int64_t ng = ev / g;
    uint8_t *lin = (uint8_t *)work;  /* [m][ng][SDPA_PV_KEYS] */
    float *scale = (float *)(void *)(lin + ((size_t)m * (size_t)ng * SDPA_PV_KEYS + 63) / 64 * 64);  /* [m][ng] */
    const __m512 half = _mm512_set1_ps(0.5f), top = _mm512_set1_ps(255.0f);
    __mmask16 keep[SDPA_PV_KEYS / 16];
    for (int b = 0; b < SDPA_PV_KEYS / 16; b++) {
        const int left = n - 16 * b;
        keep[b] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    }
    for (int x = 0; x < m; x++)
        for (int64_t i = 0; i < ng; i++) {
            __m512 w[SDPA_PV_KEYS / 16], mx = _mm512_setzero_ps();
            __mmask16 nan = 0;
            for (int b = 0; b < SDPA_PV_KEYS / 16; b++) {  /* zeros past n */
                w[b] = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep[b], p + x * ldp + 16 * b),
                                     _mm512_maskz_loadu_ps(keep[b], vs + i * SDPA_PV_KEYS + 16 * b));
                mx = _mm512_max_ps(mx, w[b]);
                nan |= _mm512_cmp_ps_mask(w[b], w[b], _CMP_UNORD_Q);
            }
            const float top1 = _mm512_reduce_max_ps(mx);
            const float sc = nan ? NAN : top1 / 255.0f >= FLT_MIN ? top1 / 255.0f : 0.0f;
            scale[x * ng + i] = sc;
            const __m512 vi = _mm512_set1_ps(sc > 0 ? 1.0f / sc : 0.0f);
            uint8_t *lx = lin + (x * ng + i) * SDPA_PV_KEYS;
            for (int b = 0; b < SDPA_PV_KEYS / 16; b++) {
                const __m512 r = _mm512_min_ps(_mm512_add_ps(_mm512_mul_ps(w[b], vi), half), top);
                _mm_storeu_si128((__m128i *)(lx + 16 * b), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
            }
        }
    const int quads = (n + 3) / 4;
    for (int x0 = 0; x0 < m; x0 += 4) {
        const int mr = m - x0 < 4 ? m - x0 : 4;
        const uint8_t *lx[4];
        for (int x = 0; x < 4; x++) lx[x] = lin + (x0 + (x < mr ? x : mr - 1)) * ng * SDPA_PV_KEYS;  /* past mr: a copy */
        for (int64_t c0 = 0; c0 < ev; c0 += 64) {
            const int64_t gi = c0 / g, vo = int4 ? c0 / 2 : c0;
            __m512i A[16];
            for (int i = 0; i < 16; i++) A[i] = _mm512_setzero_si512();
            for (int t = 0; t < quads; t++) {
                const int j = 4 * t, rem = n - j;
                __m512i r[4];
                for (int k = 0; k < 4; k++) r[k] = k < rem ? pv_values(rows[j + k] + vo, int4) : _mm512_setzero_si512();
                const __m512i l01 = _mm512_unpacklo_epi8(r[0], r[1]), h01 = _mm512_unpackhi_epi8(r[0], r[1]);
                const __m512i l23 = _mm512_unpacklo_epi8(r[2], r[3]), h23 = _mm512_unpackhi_epi8(r[2], r[3]);
                const __m512i V[4] = {_mm512_unpacklo_epi16(l01, l23), _mm512_unpackhi_epi16(l01, l23),
                                      _mm512_unpacklo_epi16(h01, h23), _mm512_unpackhi_epi16(h01, h23)};
                for (int x = 0; x < 4; x++) {
                    const __m512i a = pv_weights(lx[x], g, gi, t);
                    for (int i = 0; i < 4; i++) A[x * 4 + i] = _mm512_dpbusd_epi32(A[x * 4 + i], a, V[i]);
                }
            }
            for (int x = 0; x < mr; x++) {
                const __m512i *R = A + x * 4;
                const __m512i t0 = _mm512_shuffle_i64x2(R[0], R[1], 0x44), t1 = _mm512_shuffle_i64x2(R[2], R[3], 0x44);
                const __m512i t2 = _mm512_shuffle_i64x2(R[0], R[1], 0xEE), t3 = _mm512_shuffle_i64x2(R[2], R[3], 0xEE);
                const __m512i N[4] = {_mm512_shuffle_i64x2(t0, t1, 0x88), _mm512_shuffle_i64x2(t0, t1, 0xDD),
                                      _mm512_shuffle_i64x2(t2, t3, 0x88), _mm512_shuffle_i64x2(t2, t3, 0xDD)};
                float *ax = acc + (x0 + x) * ldacc + c0;
                const float *sx = scale + (x0 + x) * ng;
                for (int l = 0; l < 4; l++) {
                    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(N[l]), _mm512_set1_ps(sx[(c0 + 16 * l) / g]));
                    _mm512_storeu_ps(ax + 16 * l, _mm512_add_ps(_mm512_loadu_ps(ax + 16 * l), f));
                }
            }
        }
    }
    return 1;
}

/* The roofline report's probes (internal.h): 12 independent chains, more
 * than two pipes' latency needs. */
static double peak_fma_avx512(int64_t iters) {
    __m512 a[12];
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int k = 0; k < 12; k++) a[k] = _mm512_set1_ps((float)k);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = _mm512_fmadd_ps(a[k], b, c);
    __m512 t = a[0];
    for (int k = 1; k < 12; k++) t = _mm512_add_ps(t, a[k]);
    volatile float sink = _mm512_reduce_add_ps(t);
    (void)sink;
    return (double)iters * 12 * 16 * 2;
}

static double peak_vnni_avx512(int64_t iters) {
    __m512i a[12];
    const __m512i u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(-2);
    for (int k = 0; k < 12; k++) a[k] = _mm512_set1_epi32(k);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = _mm512_dpbusd_epi32(a[k], u, v);
    __m512i t = a[0];
    for (int k = 1; k < 12; k++) t = _mm512_add_epi32(t, a[k]);  /* the sums wrap: read as bits */
    uint32_t lanes[16];
    _mm512_storeu_si512((void *)lanes, t);
    volatile uint32_t sink = lanes[0] ^ lanes[15];
    (void)sink;
    return (double)iters * 12 * 64 * 2;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

int (*const sdpa_dot_qi_vnni)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                              const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                              void *) = dot_qi_avx512_vnni;
const sdpa_pv_qi_fn sdpa_pv_qi_vnni = pv_qi_avx512_vnni;

const sdpa_peak_fn sdpa_peak_fma_avx512 = peak_fma_avx512;
const sdpa_peak_fn sdpa_peak_vnni_avx512 = peak_vnni_avx512;

/* The float32 kernels every AVX-512 set shares. */
#define AVX512_F32_KERNELS                                                                                     \
    .nr = panel_rows_avx512_f32, .widen = widen_avx512, .gemm = gemm_avx512_f32, .online_softmax_update = online_softmax_update_avx512_f32, \
    .exp = exp_avx512_f32, .softcap = softcap_avx512_f32, .dot = dot_avx512_f32, .pv_rows = pv_rows_avx512_f32, \
    .row_online_softmax_update = row_online_softmax_update_avx512_f32, .dot_half = dot_half_avx512_f32,                                    \
    .pv_rows_half = pv_rows_half_avx512_f32, .dot_q = dot_q_avx512_f32, .pv_rows_q = pv_rows_q_avx512_f32,  \
    .dot_q_grouped = dot_q_grouped_avx512_f32, .pv_rows_q_grouped = pv_rows_q_grouped_avx512_f32, .mask_add = mask_add_avx512_f32,     \
    .mask_bool = mask_bool_avx512_f32, .pack_q = pack_q_avx512_f32, .store_rows = store_rows_avx512_f32,         \
    .pack_q_half = pack_q_half_avx512_f32, .store_rows_half = store_rows_half_avx512_f32,                      \
    .scale_copy = scale_copy_avx512, .scale_copy_d = scale_copy_d_avx512, .bwd_probs = bwd_probs_avx512_f32,       \
    .bwd_dscores = bwd_dscores_avx512_f32
/* The bfloat16 pair kernels of the avx512_bf16 and amx sets. */
#define BF16_PAIR_KERNELS                                                                                     \
    .pack_q_pairs = pack_q_pairs_avx512, .pack_v_pairs = pack_v_pairs_set_avx512,                            \
    .online_softmax_pairs = online_softmax_pairs_avx512
#define AVX512_F64_KERNELS                                                                                     \
    .nr = panel_rows_avx512_f64, .gemm = gemm_avx512_f64, .online_softmax_update = online_softmax_update_avx512_f64, \
    .exp = exp_avx512_f64, .softcap = softcap_avx512_f64, .dot = dot_avx512_f64, .pv_rows = pv_rows_avx512_f64,  \
    .row_online_softmax_update = row_online_softmax_update_avx512_f64, .bwd_probs = bwd_probs_avx512_f64,          \
    .bwd_dscores = bwd_dscores_avx512_f64
#define AVX512_FEATURES (SDPA_FEATURE_AVX2 | SDPA_FEATURE_AVX512)
#define AVX512_HALF_KERNELS                                                                                    \
    .f32_half = {SDPA_HALF_KERNELS_F32(avx512_f32h)}, .f64_half = {SDPA_HALF_KERNELS(avx512_f64h)},             \
    .f32_quarter = {SDPA_HALF_KERNELS_F32(avx512_f32q)}

const kernel_table sdpa_kernels_avx512 = {
    .name = "avx512",
    .features = AVX512_FEATURES,
    .dropout_bits = dropout_bits_avx512,
    .f32 = {AVX512_F32_KERNELS},
    .f64 = {AVX512_F64_KERNELS},
    AVX512_HALF_KERNELS,
};

/* The avx512 set plus bfloat16 dot products for bfloat16 problems. */
const kernel_table sdpa_kernels_avx512_bf16 = {
    .name = "avx512_bf16",
    .features = AVX512_FEATURES | SDPA_FEATURE_AVX512_BF16,
    .dropout_bits = dropout_bits_avx512,
    .bf16_products = 1,
    .f32 = {AVX512_F32_KERNELS, .bf16 = {.gemm_bf16 = gemm_bf16_avx512, BF16_PAIR_KERNELS}},
    .f64 = {AVX512_F64_KERNELS},
    AVX512_HALF_KERNELS,
};

#if SDPA_HAVE_AMX_KERNELS
/* The avx512_bf16 set with its bfloat16 products on AMX tiles. */
const kernel_table sdpa_kernels_amx = {
    .name = "amx",
    .features = AVX512_FEATURES | SDPA_FEATURE_AVX512_BF16 | SDPA_FEATURE_AMX_BF16,
    .dropout_bits = dropout_bits_avx512,
    .bf16_products = 1,
    .f32 = {AVX512_F32_KERNELS,
            .bf16 = {.gemm_bf16 = gemm_bf16_amx, BF16_PAIR_KERNELS, .values_by_feature = 1, .pairs_block = 16,
                     .tiles_begin = tiles_begin_amx, .tiles_end = tiles_end_amx}},
    .f64 = {AVX512_F64_KERNELS},
    AVX512_HALF_KERNELS,
};
#endif

/* The amx set's code over emulated tiles (testing.h): runs wherever
 * avx512_bf16 does. */
const kernel_table sdpa_kernels_amx_emulated = {
    .name = "amx_emulated",
    .features = AVX512_FEATURES | SDPA_FEATURE_AVX512_BF16,
    .dropout_bits = dropout_bits_avx512,
    .bf16_products = 1,
    .f32 = {AVX512_F32_KERNELS,
            .bf16 = {.gemm_bf16 = gemm_bf16_amx_emulated, BF16_PAIR_KERNELS, .values_by_feature = 1,
                     .pairs_block = 16, .tiles_begin = tiles_begin_amx_emulated, .tiles_end = tiles_end_amx_emulated}},
    .f64 = {AVX512_F64_KERNELS},
    AVX512_HALF_KERNELS,
};

#undef AVX512_F32_KERNELS
#undef AVX512_F64_KERNELS
#undef BF16_PAIR_KERNELS
#undef AVX512_FEATURES
#undef AVX512_HALF_KERNELS

_Static_assert((int)bf16_panel_rows == (int)panel_rows_avx512_f32, "the bfloat16 panel is the float32 one");
_Static_assert((int)panel_rows_avx512_f32 == 32, "the AMX kernel's C and B tiles cover a panel of 32 rows");

#endif /* SDPA_HAVE_X86_KERNELS */
