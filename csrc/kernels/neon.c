/* AArch64 Advanced SIMD (NEON) kernels: the "neon" set, which every AArch64
 * CPU runs, and "neon_bf16", the same with BFDOT for the bfloat16 products
 * (FEAT_BF16), chosen by dispatch.c; integer_qk's scores with SDOT
 * (FEAT_DotProd) where the CPU has it.  Loads and stores are 128 bits; the
 * register blocks keep 4 or more independent FMA chains (the FMA latency of
 * the Arm server cores is 4 cycles, 2-4 pipes). */
#include <string.h>

#include "../convert.h"
#include "../internal.h"

#if SDPA_HAVE_NEON_KERNELS

#include <arm_neon.h>
#include <math.h>

/*
 * exp: as exp_avx2_ps (avx2.c): x = n ln2 + r with n = round(x / ln2), e^r by
 * its Taylor polynomial (degree 7 for float, 13 for double), times 2^n built in
 * the exponent field as 2^(n/2) 2^(n - n/2).  Exactly 0 below the cut
 * (SDPA_EXP_CUT_F32/F64, internal.h), never a subnormal on the way; +inf above
 * the largest finite result; NaN stays NaN.
 */
static inline float32x4_t exp_neon_ps(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(SDPA_EXP_CUT_F32), hi = vdupq_n_f32(88.72284f);
    const uint32x4_t under = vcltq_f32(x, lo), over = vcgtq_f32(x, hi);
    const float32x4_t xc = vminnmq_f32(hi, vmaxnmq_f32(lo, x));  /* a NaN lane becomes lo; put back below */
    const float32x4_t n = vrndnq_f32(vmulq_f32(xc, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(xc, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t ni = vcvtq_s32_f32(n);
    const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    const int32x4_t bias = vdupq_n_s32(127);
    const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, bias), 23));
    const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, bias), 23));
    float32x4_t res = vmulq_f32(vmulq_f32(p, s1), s2);
    res = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(res), under));
    res = vbslq_f32(over, vdupq_n_f32(INFINITY), res);
    return vbslq_f32(vceqq_f32(x, x), res, x);
}

static inline float64x2_t exp_neon_pd(float64x2_t x) {
    const float64x2_t lo = vdupq_n_f64(SDPA_EXP_CUT_F64), hi = vdupq_n_f64(709.782712893384);
    const uint64x2_t under = vcltq_f64(x, lo), over = vcgtq_f64(x, hi);
    const float64x2_t xc = vminnmq_f64(hi, vmaxnmq_f64(lo, x));
    const float64x2_t n = vrndnq_f64(vmulq_f64(xc, vdupq_n_f64(1.4426950408889634074)));
    float64x2_t r = vfmsq_f64(xc, n, vdupq_n_f64(6.93147180369123816490e-01));
    r = vfmsq_f64(r, n, vdupq_n_f64(1.90821492927058770002e-10));
    static const double inv_fact[14] = {
        1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
        1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,
        1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,         0.5,
        1.0,                1.0};
    float64x2_t p = vdupq_n_f64(inv_fact[0]);
    for (int i = 1; i < 14; i++) p = vfmaq_f64(vdupq_n_f64(inv_fact[i]), p, r);
    const int64x2_t ni = vcvtq_s64_f64(n);
    const int64x2_t n1 = vshrq_n_s64(ni, 1), n2 = vsubq_s64(ni, n1);
    const int64x2_t bias = vdupq_n_s64(1023);
    const float64x2_t s1 = vreinterpretq_f64_s64(vshlq_n_s64(vaddq_s64(n1, bias), 52));
    const float64x2_t s2 = vreinterpretq_f64_s64(vshlq_n_s64(vaddq_s64(n2, bias), 52));
    float64x2_t res = vmulq_f64(vmulq_f64(p, s1), s2);
    res = vreinterpretq_f64_u64(vbicq_u64(vreinterpretq_u64_f64(res), under));
    res = vbslq_f64(over, vdupq_n_f64(INFINITY), res);
    return vbslq_f64(vceqq_f64(x, x), res, x);
}

static inline float32x4_t neginf_to_zero_ps(float32x4_t x) {
    return vreinterpretq_f32_u32(
        vbicq_u32(vreinterpretq_u32_f32(x), vceqq_f32(x, vdupq_n_f32(-INFINITY))));
}
static inline float64x2_t neginf_to_zero_pd(float64x2_t x) {
    return vreinterpretq_f64_u64(
        vbicq_u64(vreinterpretq_u64_f64(x), vceqq_f64(x, vdupq_n_f64(-INFINITY))));
}

/* sums in one tree, ((v0 + v1) + (v2 + v3)): hsum_ps and each lane of hsum_lanes_ps alike */
static inline float hsum_ps(float32x4_t v) {
    const float32x4_t t = vpaddq_f32(v, v);
    return vgetq_lane_f32(vpaddq_f32(t, t), 0);
}
static inline double hsum_pd(float64x2_t v) { return vgetq_lane_f64(vpaddq_f64(v, v), 0); }

/* lane i of the result = the sum of the lanes of a[i] */
static inline float32x4_t hsum_lanes_ps(const float32x4_t *a) {
    return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}
static inline float64x2_t hsum_lanes_pd(const float64x2_t *a) { return vpaddq_f64(a[0], a[1]); }

static inline float hmax_nan_ps(float32x4_t v) {
    if (vminvq_u32(vceqq_f32(v, v)) == 0) return NAN;
    return vmaxvq_f32(v);
}
static inline double hmax_nan_pd(float64x2_t v) {
    const uint64x2_t ok = vceqq_f64(v, v);
    if (!(vgetq_lane_u64(ok, 0) & vgetq_lane_u64(ok, 1))) return NAN;
    return vmaxvq_f64(v);
}

/* r[i] (row i of a 4 x 4 block) becomes column i */
static inline void transpose4_ps(float32x4_t *r) {
    const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

/* exactly n bytes (n <= 8) into the low bytes of a vector: never reads past them */
static inline uint8x8_t load_bytes(const void *p, const int n) {
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    return vcreate_u8(w);
}

/* 4 bytes of a bool mask: 0 where nonzero (visible), -inf where zero */
static inline float32x4_t bool_to_neginf_ps(const uint8_t *p) {
    const uint32x4_t b = vmovl_u16(vget_low_u16(vmovl_u8(load_bytes(p, 4))));
    return vreinterpretq_f32_u32(vandq_u32(vceqzq_u32(b), vreinterpretq_u32_f32(vdupq_n_f32(-INFINITY))));
}

/* 4 bfloat16 / float16 values widened exactly */
static inline float32x4_t load_bf16_ps(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline float32x4_t load_f16_ps(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

/* 4 int8 values */
static inline float32x4_t load_i8_ps(const int8_t *p) {
    const int16x8_t h = vmovl_s8(vreinterpret_s8_u8(load_bytes(p, 4)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}

/* 4 float8 e5m2 values: the upper bytes of float16s */
static inline float32x4_t load_e5m2_ps(const uint8_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(vshll_n_u8(load_bytes(p, 4), 8))));
}

/* 8 float8 e4m3fn values (int16 lanes, the bytes sign-extended) each divided
 * by 256, as float16 bits: shifted left by 7 with bit 14 cleared, the value as
 * a float16 whose exponent bias is 8 more (as load_e4m3_ps of avx2.c);
 * S.1111.111, the only pattern that gives 1.875, becomes a float16 NaN */
static inline int16x8_t e4m3_half8(int16x8_t w) {
    const int16x8_t h = vandq_s16(vshlq_n_s16(w, 7), vdupq_n_s16((int16_t)0xbf80));
    return vbslq_s16(vceqq_s16(vandq_s16(h, vdupq_n_s16(0x7fff)), vdupq_n_s16(0x3f80)), vdupq_n_s16(0x7e00), h);
}

/* 4 float8 e4m3fn values, each divided by 256 */
static inline float32x4_t load_e4m3_ps(const uint8_t *p) {
    const int16x8_t h = e4m3_half8(vmovl_s8(vreinterpret_s8_u8(load_bytes(p, 4))));
    return vcvt_f32_f16(vget_low_f16(vreinterpretq_f16_s16(h)));
}

/* 4 int4 values from 2 bytes (low nibble first, each the value plus 8) */
static inline float32x4_t load_i4_ps(const uint8_t *p) {
    const uint8x8_t b = load_bytes(p, 2);
    const uint8x8_t z = vzip1_u8(vand_u8(b, vdup_n_u8(15)), vshr_n_u8(b, 4));
    const int8x8_t x = vsub_s8(vreinterpret_s8_u8(z), vdup_n_s8(8));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(x))));
}

/* The same values 16 at a time, into o[0..3], from one load: 16 bytes (int4: 8) */
static inline void widen_s8x16(int8x16_t b, float32x4_t *o) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
    o[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    o[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    o[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    o[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}
static inline void widen_f16x16(int16x8_t lo, int16x8_t hi, float32x4_t *o) {
    o[0] = vcvt_f32_f16(vget_low_f16(vreinterpretq_f16_s16(lo)));
    o[1] = vcvt_high_f32_f16(vreinterpretq_f16_s16(lo));
    o[2] = vcvt_f32_f16(vget_low_f16(vreinterpretq_f16_s16(hi)));
    o[3] = vcvt_high_f32_f16(vreinterpretq_f16_s16(hi));
}
static inline void load16_i8_ps(const int8_t *p, float32x4_t *o) { widen_s8x16(vld1q_s8(p), o); }
static inline void load16_e5m2_ps(const uint8_t *p, float32x4_t *o) {
    const uint8x16_t b = vld1q_u8(p);
    widen_f16x16(vreinterpretq_s16_u16(vshll_n_u8(vget_low_u8(b), 8)), vreinterpretq_s16_u16(vshll_high_n_u8(b, 8)), o);
}
static inline void load16_e4m3_ps(const uint8_t *p, float32x4_t *o) {
    const int8x16_t b = vld1q_s8((const int8_t *)p);
    widen_f16x16(e4m3_half8(vmovl_s8(vget_low_s8(b))), e4m3_half8(vmovl_high_s8(b)), o);
}
static inline void load16_i4_ps(const uint8_t *p, float32x4_t *o) {
    const uint8x8_t b = vld1_u8(p), lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
    const uint8x16_t z = vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi));
    widen_s8x16(vsubq_s8(vreinterpretq_s8_u8(z), vdupq_n_s8(8)), o);
}

/* 4 floats rounded to bfloat16 as sdpa_f32_to_bf16 does (to nearest even, a
 * NaN made quiet), with integer operations: BFCVTN flushes subnormals */
static inline uint16x4_t f32_to_bf16_neon(float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd));
    r = vbslq_u32(vceqq_f32(v, v), r, vorrq_u32(u, vdupq_n_u32(0x400000)));
    return vshrn_n_u32(r, 16);
}
static inline void store_bf16_ps(uint16_t *p, float32x4_t v) { vst1_u16(p, f32_to_bf16_neon(v)); }

/* 4 floats to float16: FCVTN, to nearest even unless the caller's FPCR rounds otherwise */
static inline void store_f16_ps(uint16_t *p, float32x4_t v) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }

static void widen_neon(sdpa_dtype dt, const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    if (dt == SDPA_BFLOAT16)
        for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, load_bf16_ps(src + i));
    else
        for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, load_f16_ps(src + i));
    if (i < n) sdpa_widen_portable(dt, src + i, dst + i, n - i);
}

#include "neon_f32.h"
#include "simd_impl.h"
#include "simd_end.h"

#include "neon_f64.h"
#include "simd_impl.h"
#include "simd_end.h"

/* the panel kernels at half the width (kernel_table's *_half) */
#include "neon_f32.h"
#define SIMD_HALF_SUF neon_f32h
#define SIMD_HALF_NV 2
#include "simd_half.h"

/* the panel kernels at half the width (kernel_table's *_half) */
#include "neon_f64.h"
#define SIMD_HALF_SUF neon_f64h
#define SIMD_HALF_NV 2
#include "simd_half.h"

/* Row-mode copies (internal.h): one multiply per element, as the driver's loops. */
static void scale_copy_neon(float *dst, const float *src, int64_t n, float scale) {
    const float32x4_t s = vdupq_n_f32(scale);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vmulq_f32(s, vld1q_f32(src + i)));
    for (; i < n; i++) dst[i] = scale * src[i];
}

static void scale_copy_d_neon(float *dst, const float *src, int64_t n, double inv) {
    const float64x2_t s = vdupq_n_f64(inv);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(src + i);
        const float32x2_t lo = vcvt_f32_f64(vmulq_f64(vcvt_f64_f32(vget_low_f32(x)), s));
        vst1q_f32(dst + i, vcvt_high_f32_f64(lo, vmulq_f64(vcvt_high_f64_f32(x), s)));
    }
    for (; i < n; i++) dst[i] = (float)((double)src[i] * inv);
}

#define NEON_F32_KERNELS                                                                                          \
    .nr = panel_rows_neon_f32, .widen = widen_neon, .gemm = gemm_neon_f32,                                        \
    .online_softmax_update = online_softmax_update_neon_f32, .exp = exp_neon_f32, .softcap = softcap_neon_f32,    \
    .dot = dot_neon_f32, .pv_rows = pv_rows_neon_f32, .row_online_softmax_update = row_online_softmax_update_neon_f32, \
    .dot_half = dot_half_neon_f32, .pv_rows_half = pv_rows_half_neon_f32, .dot_q = dot_q_neon_f32,              \
    .pv_rows_q = pv_rows_q_neon_f32, .dot_q_grouped = dot_q_grouped_neon_f32,                                     \
    .pv_rows_q_grouped = pv_rows_q_grouped_neon_f32, .mask_add = mask_add_neon_f32, .mask_bool = mask_bool_neon_f32, \
    .pack_q = pack_q_neon_f32, .store_rows = store_rows_neon_f32, .pack_q_half = pack_q_half_neon_f32,           \
    .store_rows_half = store_rows_half_neon_f32, .scale_copy = scale_copy_neon, .scale_copy_d = scale_copy_d_neon, \
    .bwd_probs = bwd_probs_neon_f32, .bwd_dscores = bwd_dscores_neon_f32
#define NEON_F64_KERNELS                                                                                          \
    .nr = panel_rows_neon_f64, .gemm = gemm_neon_f64, .online_softmax_update = online_softmax_update_neon_f64,    \
    .exp = exp_neon_f64, .softcap = softcap_neon_f64, .dot = dot_neon_f64, .pv_rows = pv_rows_neon_f64,          \
    .row_online_softmax_update = row_online_softmax_update_neon_f64, .bwd_probs = bwd_probs_neon_f64,             \
    .bwd_dscores = bwd_dscores_neon_f64
#define NEON_HALF_KERNELS .f32_half = {SDPA_HALF_KERNELS_F32(neon_f32h)}, .f64_half = {SDPA_HALF_KERNELS(neon_f64h)}

/* The roofline report's probe (internal.h). */
static double peak_fma_neon(int64_t iters) {
    float32x4_t a[12];
    const float32x4_t b = vdupq_n_f32(0.999999f), c = vdupq_n_f32(1e-7f);
    for (int k = 0; k < 12; k++) a[k] = vdupq_n_f32((float)k);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = vfmaq_f32(c, a[k], b);
    float32x4_t t = a[0];
    for (int k = 1; k < 12; k++) t = vaddq_f32(t, a[k]);
    volatile float sink = vaddvq_f32(t);
    (void)sink;
    return (double)iters * 12 * 4 * 2;
}
const sdpa_peak_fn sdpa_peak_fma_neon = peak_fma_neon;

const kernel_table sdpa_kernels_neon = {
    .name = "neon",
    .features = SDPA_FEATURE_NEON,
    .f32 = {NEON_F32_KERNELS},
    .f64 = {NEON_F64_KERNELS},
    NEON_HALF_KERNELS,
};

#if SDPA_HAVE_NEON_EXT_KERNELS
#include "neon_ext.h"

/* The neon set plus BFDOT for bfloat16 problems. */
const kernel_table sdpa_kernels_neon_bf16 = {
    .name = "neon_bf16",
    .features = SDPA_FEATURE_NEON | SDPA_FEATURE_NEON_BF16,
    .bf16_products = 1,
    .f32 = {NEON_F32_KERNELS,
            .bf16 = {.gemm_bf16 = gemm_bf16_neon, .pack_q_pairs = pack_q_pairs_neon,
                     .pack_v_pairs = pack_v_pairs_neon, .online_softmax_pairs = online_softmax_pairs_neon}},
    .f64 = {NEON_F64_KERNELS},
    NEON_HALF_KERNELS,
};

int (*const sdpa_dot_qi_neon)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                              const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                              void *) = dot_qi_neon_dotprod;
const sdpa_peak_fn sdpa_peak_sdot_neon = peak_sdot_neon;
#else
const sdpa_peak_fn sdpa_peak_sdot_neon = NULL;
int (*const sdpa_dot_qi_neon)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                              const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                              void *) = NULL;
#endif

#undef NEON_F32_KERNELS
#undef NEON_F64_KERNELS

_Static_assert((int)panel_rows_neon_f32 == 16, "the bfloat16 pair kernels are built for panels of 16 rows");

#endif /* SDPA_HAVE_NEON_KERNELS */
