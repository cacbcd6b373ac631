/* AVX2 + FMA (+ F16C) kernels, compiled for that target whatever the build flags;
 * dispatch.c only selects them on a CPU that has it. */
#include "../convert.h"
#include "../internal.h"

#if SDPA_HAVE_X86_KERNELS

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>
#include <math.h>

/*
 * exp: x = n ln2 + r with n = round(x / ln2), |r| <= ln2/2 (ln2 split in two
 * parts so that r is exact to a few ulp), e^r by its Taylor polynomial (degree
 * 7 for float, 13 for double), then times 2^n, built in the exponent field as
 * 2^(n/2) 2^(n - n/2) so that results near overflow are right too.  Below the
 * cut (SDPA_EXP_CUT_F32/F64, internal.h) the result is exactly 0 and no
 * subnormal is computed on the way (the input is clamped to the cut, the lane
 * zeroed after): see avx512.c.  Above the largest finite result it is +inf,
 * and NaN stays NaN.
 */
static inline __m256 exp_avx2_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(SDPA_EXP_CUT_F32), hi = _mm256_set1_ps(88.72284f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 res = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    res = _mm256_andnot_ps(under, res);
    res = _mm256_blendv_ps(res, _mm256_set1_ps(INFINITY), over);
    return _mm256_blendv_ps(res, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

static inline __m256d exp_avx2_pd(__m256d x) {
    const __m256d lo = _mm256_set1_pd(SDPA_EXP_CUT_F64), hi = _mm256_set1_pd(709.782712893384);
    __m256d under = _mm256_cmp_pd(x, lo, _CMP_LT_OQ);
    __m256d over = _mm256_cmp_pd(x, hi, _CMP_GT_OQ);
    __m256d xc = _mm256_min_pd(hi, _mm256_max_pd(lo, x));
    __m256d n = _mm256_round_pd(_mm256_mul_pd(xc, _mm256_set1_pd(1.4426950408889634074)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93147180369123816490e-01), xc);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.90821492927058770002e-10), r);
    static const double inv_fact[14] = {
        1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
        1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,
        1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,         0.5,
        1.0,                1.0};
    __m256d p = _mm256_set1_pd(inv_fact[0]);
    for (int i = 1; i < 14; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(inv_fact[i]));
    __m128i ni = _mm256_cvtpd_epi32(n);
    __m128i n1 = _mm_srai_epi32(ni, 1), n2 = _mm_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi64x(1023);
    __m256d s1 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(n1), bias), 52));
    __m256d s2 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(n2), bias), 52));
    __m256d res = _mm256_mul_pd(_mm256_mul_pd(p, s1), s2);
    res = _mm256_andnot_pd(under, res);
    res = _mm256_blendv_pd(res, _mm256_set1_pd(INFINITY), over);
    return _mm256_blendv_pd(res, x, _mm256_cmp_pd(x, x, _CMP_UNORD_Q));
}

static inline __m256 max_nan_ps(__m256 acc, __m256 x) {
    __m256 m = _mm256_max_ps(x, acc);  /* keeps a NaN in acc */
    return _mm256_blendv_ps(m, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
static inline __m256d max_nan_pd(__m256d acc, __m256d x) {
    __m256d m = _mm256_max_pd(x, acc);
    return _mm256_blendv_pd(m, x, _mm256_cmp_pd(x, x, _CMP_UNORD_Q));
}
static inline __m256 neginf_to_zero_ps(__m256 x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), x);
}
static inline __m256d neginf_to_zero_pd(__m256d x) {
    return _mm256_andnot_pd(_mm256_cmp_pd(x, _mm256_set1_pd(-INFINITY), _CMP_EQ_OQ), x);
}

static inline float hsum_ps(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
static inline double hsum_pd(__m256d v) {
    __m128d a = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    a = _mm_add_sd(a, _mm_unpackhi_pd(a, a));
    return _mm_cvtsd_f64(a);
}
static void widen_avx2(sdpa_dtype dt, const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    if (dt == SDPA_BFLOAT16) {
        for (; i + 8 <= n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    } else {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    }
    if (i < n) sdpa_widen_portable(dt, src + i, dst + i, n - i);
}

/* 8 float8 e4m3fn values, each divided by 256 (exactly): the byte
 * sign-extended to 16 bits and shifted left by 7, with bit 14 cleared, is the
 * value as a float16 whose exponent bias is 8 more (subnormals alike).
 * S.1111.111 (NaN), the only pattern that gives 1.875, becomes a float16 NaN
 * before the conversion. */
static inline __m256 load_e4m3_ps(const uint8_t *p) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xbf80));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
    return _mm256_cvtph_ps(_mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan));
}

/* 8 float8 e5m2 values: the upper bytes of float16s */
static inline __m256 load_e5m2_ps(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}

/* 8 int4 values from 4 bytes (low nibble first, each the value plus 8) */
static inline __m256 load_i4_ps(const uint8_t *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    const __m128i b = _mm_cvtsi32_si128(word);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    const __m128i x = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
}

/* lane i of the result = the sum of the lanes of a[i] (8 or 4 vectors) */
static inline __m256 hsum_lanes_ps(const __m256 *a) {
    __m256 s2[4], s4[2];
    for (int i = 0; i < 4; i++)  /* [a0+a2 b0+b2 a1+a3 b1+b3] per 128-bit half */
        s2[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                              _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {  /* [a b c d] of each half */
        __m256d x = _mm256_castps_pd(s2[2 * i]), y = _mm256_castps_pd(s2[2 * i + 1]);
        s4[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                              _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(s4[0], s4[1], 0x20), _mm256_permute2f128_ps(s4[0], s4[1], 0x31));
}
static inline __m256d hsum_lanes_pd(const __m256d *a) {
    __m256d s2[2];
    for (int i = 0; i < 2; i++)  /* [a0+a1 b0+b1] per 128-bit half */
        s2[i] = _mm256_add_pd(_mm256_unpacklo_pd(a[2 * i], a[2 * i + 1]),
                              _mm256_unpackhi_pd(a[2 * i], a[2 * i + 1]));
    return _mm256_add_pd(_mm256_permute2f128_pd(s2[0], s2[1], 0x20), _mm256_permute2f128_pd(s2[0], s2[1], 0x31));
}

#include "ymm_f32.h"

static inline __m256 neginf_where_ps(__m256 t, __m256 s) {
    return _mm256_blendv_ps(s, t, _mm256_cmp_ps(t, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}

static inline float hmax_nan_ps(__m256 v) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) return NAN;
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
static inline double hmax_nan_pd(__m256d v) {
    if (_mm256_movemask_pd(_mm256_cmp_pd(v, v, _CMP_UNORD_Q))) return NAN;
    __m128d a = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    a = _mm_max_sd(a, _mm_unpackhi_pd(a, a));
    return _mm_cvtsd_f64(a);
}

#include "avx2_f32.h"
#include "simd_impl.h"
#include "simd_end.h"

#include "avx2_f64.h"
#include "simd_impl.h"
#include "simd_end.h"

/* the panel kernels at half the width (kernel_table's *_half) */
#include "avx2_f32.h"
#define SIMD_HALF_SUF avx2_f32h
#define SIMD_HALF_NV 1
#include "simd_half.h"

/* the panel kernels at half the width (kernel_table's *_half) */
#include "avx2_f64.h"
#define SIMD_HALF_SUF avx2_f64h
#define SIMD_HALF_NV 1
#include "simd_half.h"


/* Row-mode copies (internal.h): one multiply per element, as the driver's loops. */
static void scale_copy_avx2(float *dst, const float *src, int64_t n, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(s, _mm256_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = scale * src[i];
}

static void scale_copy_d_avx2(float *dst, const float *src, int64_t n, double inv) {
    const __m256d s = _mm256_set1_pd(inv);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        _mm_storeu_ps(dst + i, _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(src + i)), s)));
    for (; i < n; i++) dst[i] = (float)((double)src[i] * inv);
}

/* integer_pv's products, the portable loops compiled for AVX2 (the same sums) */
#define PV_QI_NAME pv_qi_avx2
#define PV_QI_STATIC static
#include "pv_qi_impl.h"
#undef PV_QI_NAME
#undef PV_QI_STATIC

/* The roofline report's probe (internal.h). */
static double peak_fma_avx2(int64_t iters) {
    __m256 a[12];
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int k = 0; k < 12; k++) a[k] = _mm256_set1_ps((float)k);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = _mm256_fmadd_ps(a[k], b, c);
    __m256 t = a[0];
    for (int k = 1; k < 12; k++) t = _mm256_add_ps(t, a[k]);
    float r[8];
    _mm256_storeu_ps(r, t);
    volatile float sink = r[0];
    (void)sink;
    return (double)iters * 12 * 8 * 2;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---- integer_qk's scores with AVX-VNNI (the avx2 set, on a CPU with AVX-VNNI) ---- */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

/* As dot_qi_avx512_vnni (avx512.c), 32 values a chunk: the keys as unsigned
 * bytes (int8 + 128; int4 nibbles, value + 8, unpacked into their natural
 * order), the offsets' products taken off per lane. */
static inline __attribute__((always_inline)) __m256i qi_keys_avx(const uint8_t *p, const int int4) {
    if (!int4) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

/* the scale of each lane of chunk c (32 values) of a key: one for g >= 32,
 * lanes 0-3 and 4-7 their own for g = 16 */
static inline __attribute__((always_inline)) __m256 qi_scales_avx(const float *ks, int64_t ksc, int64_t c,
                                                                  int64_t g) {
    if (g >= 32) return _mm256_set1_ps(ks[(c * 32 / g) * ksc]);
    const float *first = ks + (c * 2) * ksc;
    return _mm256_blend_ps(_mm256_set1_ps(first[0]), _mm256_set1_ps(first[ksc]), 0xF0);
}

/* Up to 4 rows x nt keys (4 or 1).  single (one group a row): the integer sums
 * whole, then converted once (exact) and scaled as the portable kernel
 * scales them; else each chunk's lane sums converted and scaled by their
 * group's scale.  qo: per row and chunk, the lanes' offset products; qt: per
 * row, their sums over the chunks. */
static inline __attribute__((always_inline)) void qi_block_avx(const int int4, const int nt, const int single,
                                                               int mr, int64_t chunks, int64_t g,
                                                               const int8_t *qp, const int32_t *qo,
                                                               const int32_t *qt, int64_t e, const float *qscale,
                                                               const uint8_t *kj, int64_t ldk, const float *ks,
                                                               int64_t ksr, int64_t ksc, float *s, int64_t lds) {
    const int64_t cb = int4 ? 16 : 32;
    const int8_t *qx[4];
    const int32_t *ox[4];
    for (int x = 0; x < 4; x++) {
        const int xr = x < mr ? x : mr - 1;  /* past mr: a copy, not stored */
        qx[x] = qp + xr * e;
        ox[x] = single ? qt + xr * 8 : qo + xr * chunks * 8;
    }
    __m256i acc[16];
    __m256 f[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_si256(), f[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m256i K[4];
        __m256 S[4];
        for (int t = 0; t < nt; t++) {
            K[t] = qi_keys_avx(kj + t * ldk + c * cb, int4);
            S[t] = single ? _mm256_setzero_ps() : qi_scales_avx(ks + t * ksr, ksc, c, g);
        }
        for (int x = 0; x < 4; x++) {
            const __m256i qv = _mm256_load_si256((const __m256i *)(qx[x] + c * 32));
            if (single) {
                for (int t = 0; t < nt; t++) acc[x * 4 + t] = _mm256_dpbusd_avx_epi32(acc[x * 4 + t], K[t], qv);
                continue;
            }
            const __m256i off = _mm256_load_si256((const __m256i *)(ox[x] + c * 8));
            for (int t = 0; t < nt; t++) {
                const __m256i d = _mm256_sub_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), K[t], qv), off);
                f[x * 4 + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), S[t], f[x * 4 + t]);
            }
        }
    }
    if (single)
        for (int x = 0; x < 4; x++) {
            const __m256i off = _mm256_load_si256((const __m256i *)ox[x]);
            for (int t = 0; t < nt; t++) f[x * 4 + t] = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[x * 4 + t], off));
        }
    float r[16] __attribute__((aligned(32)));
    if (nt == 4) {
        _mm256_store_ps(r, hsum_lanes_ps(f));
        _mm256_store_ps(r + 8, hsum_lanes_ps(f + 8));
    } else {
        for (int x = 0; x < 4; x++) r[x * 4] = hsum_ps(f[x * 4]);
    }
    for (int x = 0; x < mr; x++)
        for (int t = 0; t < nt; t++)
            s[x * lds + t] = single ? r[x * 4 + t] * ks[t * ksr] * qscale[x] : r[x * 4 + t] * qscale[x];
}

static int dot_qi_avx_vnni(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q, int64_t ldq,
                           const float *qscale, const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr,
                           int64_t ksc, float *s, int64_t lds, void *work) {
    const int int4 = dt == SDPA_INT4;
    if ((dt != SDPA_INT8 && !int4) || e % 32 || e > 65536 || g <= 0 || e % g || (g >= 32 ? g % 32 != 0 : g != 16))
        return 0;
    const int64_t chunks = e / 32;
    int8_t *qp = (int8_t *)work;
    int32_t *qo = (int32_t *)(qp + (size_t)m * (size_t)e);
    int32_t *qt = qo + (size_t)m * (size_t)chunks * 8;
    const __m256i off = _mm256_set1_epi8(int4 ? 8 : (char)0x80);
    for (int x = 0; x < m; x++) {
        __m256i total = _mm256_setzero_si256();
        for (int64_t c = 0; c < chunks; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + x * ldq + c * 32));
            _mm256_store_si256((__m256i *)(qp + x * e + c * 32), v);
            const __m256i o = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), off, v);
            _mm256_store_si256((__m256i *)(qo + (x * chunks + c) * 8), o);
            total = _mm256_add_epi32(total, o);
        }
        _mm256_store_si256((__m256i *)(qt + x * 8), total);
    }
    const int single = g == e;
    for (int x0 = 0; x0 < m; x0 += 4) {
        const int mr = m - x0 < 4 ? m - x0 : 4;
        const int8_t *qx = qp + x0 * e;
        const int32_t *ox = qo + x0 * chunks * 8, *tx = qt + x0 * 8;
        float *sx = s + x0 * lds;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            const uint8_t *kj = k + j * ldk;
            const float *kss = ks + j * ksr;
            if (single && int4) qi_block_avx(1, 4, 1, mr, chunks, g, qx, ox, tx, e, qscale + x0, kj, ldk, kss, ksr, ksc, sx + j, lds);
            else if (single) qi_block_avx(0, 4, 1, mr, chunks, g, qx, ox, tx, e, qscale + x0, kj, ldk, kss, ksr, ksc, sx + j, lds);
            else if (int4) qi_block_avx(1, 4, 0, mr, chunks, g, qx, ox, tx, e, qscale + x0, kj, ldk, kss, ksr, ksc, sx + j, lds);
            else qi_block_avx(0, 4, 0, mr, chunks, g, qx, ox, tx, e, qscale + x0, kj, ldk, kss, ksr, ksc, sx + j, lds);
        }
        for (; j < n; j++)
            qi_block_avx(int4, 1, single, mr, chunks, g, qx, ox, tx, e, qscale + x0, k + j * ldk, ldk, ks + j * ksr,
                         ksr, ksc, sx + j, lds);
    }
    return 1;
}

/* The roofline report's probe (internal.h). */
static double peak_vnni_avx2(int64_t iters) {
    __m256i a[12];
    const __m256i u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(-2);
    for (int k = 0; k < 12; k++) a[k] = _mm256_set1_epi32(k);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = _mm256_dpbusd_avx_epi32(a[k], u, v);
    __m256i t = a[0];
    for (int k = 1; k < 12; k++) t = _mm256_add_epi32(t, a[k]);
    volatile int sink = _mm256_extract_epi32(t, 0);
    (void)sink;
    return (double)iters * 12 * 32 * 2;
}

/* dropout's bits (internal.h), the portable loop vectorized for AVX2 */
#define PHILOX_NAME dropout_bits_avx2
#include "philox_impl.h"
#undef PHILOX_NAME

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

int (*const sdpa_dot_qi_avx_vnni)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                                  const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                                  void *) = dot_qi_avx_vnni;

const sdpa_peak_fn sdpa_peak_fma_avx2 = peak_fma_avx2;
const sdpa_pv_qi_fn sdpa_pv_qi_avx2 = pv_qi_avx2;
const sdpa_peak_fn sdpa_peak_vnni_avx2 = peak_vnni_avx2;

const kernel_table sdpa_kernels_avx2 = {
    .name = "avx2",
    .features = SDPA_FEATURE_AVX2,
    .dropout_bits = dropout_bits_avx2,
    .f32 = {.nr = panel_rows_avx2_f32, .widen = widen_avx2,
            .gemm = gemm_avx2_f32, .online_softmax_update = online_softmax_update_avx2_f32, .exp = exp_avx2_f32, .softcap = softcap_avx2_f32,
            .dot = dot_avx2_f32, .pv_rows = pv_rows_avx2_f32, .row_online_softmax_update = row_online_softmax_update_avx2_f32,
            .dot_half = dot_half_avx2_f32, .pv_rows_half = pv_rows_half_avx2_f32,
            .dot_q = dot_q_avx2_f32, .pv_rows_q = pv_rows_q_avx2_f32,
            .dot_q_grouped = dot_q_grouped_avx2_f32, .pv_rows_q_grouped = pv_rows_q_grouped_avx2_f32,
            .mask_add = mask_add_avx2_f32, .mask_bool = mask_bool_avx2_f32,
            .pack_q = pack_q_avx2_f32, .store_rows = store_rows_avx2_f32,
            .pack_q_half = pack_q_half_avx2_f32, .store_rows_half = store_rows_half_avx2_f32,
            .scale_copy = scale_copy_avx2, .scale_copy_d = scale_copy_d_avx2,
            .bwd_probs = bwd_probs_avx2_f32, .bwd_dscores = bwd_dscores_avx2_f32},
    .f64 = {.nr = panel_rows_avx2_f64,
            .gemm = gemm_avx2_f64, .online_softmax_update = online_softmax_update_avx2_f64, .exp = exp_avx2_f64, .softcap = softcap_avx2_f64,
            .dot = dot_avx2_f64, .pv_rows = pv_rows_avx2_f64, .row_online_softmax_update = row_online_softmax_update_avx2_f64,
            .bwd_probs = bwd_probs_avx2_f64, .bwd_dscores = bwd_dscores_avx2_f64},
    .f32_half = {SDPA_HALF_KERNELS_F32(avx2_f32h)},
    .f64_half = {SDPA_HALF_KERNELS(avx2_f64h)},
};

#endif /* SDPA_HAVE_X86_KERNELS */
