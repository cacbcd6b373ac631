/* The kernels of neon.c that need an extension the base AArch64 set does not
 * have, each compiled for its extension alone whatever the build flags
 * (dispatch.c selects them only on a CPU that has it): BFDOT (FEAT_BF16) for
 * the "neon_bf16" set's bfloat16 products, SDOT (FEAT_DotProd) for
 * integer_qk's scores.  Included by neon.c, after its helpers. */

/* ---- bfloat16 products (FEAT_BF16: the neon_bf16 set alone) ---- */

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+bf16")
#endif

/* ---- bfloat16 products (internal.h's kernels_bf16), panels of 16 rows ---- */

#define BF16_NV 4 /* 16 query rows: four vectors of four lanes */
#define BF16_MR 6

/* c[r][:] (=|+=) sum_p dot2(a[r*a_rs + p*a_ks], b[p][:]) for r < mr: one
 * 32-bit pair of a broadcast against 4 x 4 pairs of b (BFDOT: two bfloat16
 * products a lane, added to the float lane). */
static inline __attribute__((always_inline)) void gemm_bf16_block_neon(const int mr, int64_t kpairs,
                                                                       const uint32_t *a, int64_t a_rs, int64_t a_ks,
                                                                       const uint32_t *b, int64_t ldb, float *c,
                                                                       int64_t ldc, int accumulate) {
    float32x4_t acc[BF16_MR][BF16_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < BF16_NV; v++) acc[r][v] = accumulate ? vld1q_f32(c + r * ldc + v * 4) : vdupq_n_f32(0.0f);
    for (int64_t p = 0; p < kpairs; p++) {
        bfloat16x8_t bv[BF16_NV];
        for (int v = 0; v < BF16_NV; v++) bv[v] = vreinterpretq_bf16_u32(vld1q_u32(b + p * ldb + v * 4));
        const uint32_t *ap = a + p * a_ks;
        for (int r = 0; r < mr; r++) {
            const bfloat16x8_t av = vreinterpretq_bf16_u32(vld1q_dup_u32(ap + r * a_rs));
            for (int v = 0; v < BF16_NV; v++) acc[r][v] = vbfdotq_f32(acc[r][v], av, bv[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < BF16_NV; v++) vst1q_f32(c + r * ldc + v * 4, acc[r][v]);
}

static void gemm_bf16_neon(int m, int64_t kpairs, const uint32_t *a, int64_t a_rs, int64_t a_ks, const uint32_t *b,
                           int64_t ldb, float *c, int64_t ldc, int accumulate) {
    int r = 0;
    for (; r + BF16_MR <= m; r += BF16_MR)
        gemm_bf16_block_neon(BF16_MR, kpairs, a + r * a_rs, a_rs, a_ks, b, ldb, c + r * ldc, ldc, accumulate);
    const uint32_t *ar = a + r * a_rs;
    float *cr = c + r * ldc;
    switch (m - r) {
        case 1: gemm_bf16_block_neon(1, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 2: gemm_bf16_block_neon(2, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 3: gemm_bf16_block_neon(3, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 4: gemm_bf16_block_neon(4, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        case 5: gemm_bf16_block_neon(5, kpairs, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); break;
        default: break;
    }
}

/* 4 x 4 32-bit words transposed (the bits moved, never computed on) */
static inline void transpose4_u32(uint32x4_t *r) {
    float32x4_t f[4];
    for (int i = 0; i < 4; i++) f[i] = vreinterpretq_f32_u32(r[i]);
    transpose4_ps(f);
    for (int i = 0; i < 4; i++) r[i] = vreinterpretq_u32_f32(f[i]);
}

/* The query panel as pairs: panel[p*16 + x] = word p of rows[x] (rows of 2*e2
 * bfloat16), 0 for the rows in [n, 16); 4 x 4 blocks transposed in registers. */
static void pack_q_pairs_neon(uint32_t *panel, const uint16_t *const *rows, int n, int64_t e2) {
    int64_t p0 = 0;
    for (; p0 + 4 <= e2; p0 += 4)
        for (int rb = 0; rb < BF16_NV; rb++) {
            uint32x4_t t[4];
            for (int i = 0; i < 4; i++) {
                const int x = rb * 4 + i;
                t[i] = x < n ? vreinterpretq_u32_u16(vld1q_u16(rows[x] + 2 * p0)) : vdupq_n_u32(0);
            }
            transpose4_u32(t);
            for (int i = 0; i < 4; i++) vst1q_u32(panel + (p0 + i) * 16 + rb * 4, t[i]);
        }
    for (; p0 < e2; p0++)
        for (int x = 0; x < 16; x++) {
            uint32_t w = 0;
            if (x < n) memcpy(&w, rows[x] + 2 * p0, sizeof w);
            panel[p0 * 16 + x] = w;
        }
}

/* V as pairs along the keys (the row past an odd n zero): by_feature 1:
 * dst[c*ld + p], 0: dst[p*ld + c] (this set's layout: the pairs of two rows
 * interleaved, 8 features at a time) */
static void pack_v_pairs_neon(int by_feature, uint32_t *dst, int64_t ld, const uint16_t *src, int64_t rs, int n,
                              int64_t ev) {
    for (int p = 0; 2 * p < n; p++) {
        const uint16_t *r0 = src + (int64_t)(2 * p) * rs, *r1 = 2 * p + 1 < n ? r0 + rs : NULL;
        int64_t c = 0;
        if (!by_feature)
            for (; c + 8 <= ev; c += 8) {
                const uint16x8_t a = vld1q_u16(r0 + c), b = r1 ? vld1q_u16(r1 + c) : vdupq_n_u16(0);
                vst1q_u16((uint16_t *)(dst + (int64_t)p * ld + c), vzip1q_u16(a, b));
                vst1q_u16((uint16_t *)(dst + (int64_t)p * ld + c + 4), vzip2q_u16(a, b));
            }
        for (; c < ev; c++) {
            const uint32_t w = (uint32_t)r0[c] | (uint32_t)(r1 ? r1[c] : 0) << 16;
            dst[by_feature ? c * ld + p : (int64_t)p * ld + c] = w;
        }
    }
}

/* The online softmax step of a 16-row panel on s * scale, P written as
 * bfloat16 pairs (internal.h's online_softmax_pairs): the float update of
 * simd_impl.h (the same maxima, exponentials and sums, in the same order) on
 * the scaled scores, each P rounded to nearest even as it is paired. */
static void online_softmax_pairs_neon(const float *s, int n, float scale, float *row_max, float *row_sum, float *acc,
                                      int64_t ev, uint32_t *pp) {
    const float32x4_t vs = vdupq_n_f32(scale);
    float32x4_t m_new[BF16_NV], m_sub[BF16_NV], alpha[BF16_NV], sum[BF16_NV];
    for (int v = 0; v < BF16_NV; v++) {
        const float32x4_t old = vld1q_f32(row_max + v * 4);
        float32x4_t mx = old;
        for (int j = 0; j < n; j++) mx = vmaxq_f32(mx, vmulq_f32(vld1q_f32(s + j * 16 + v * 4), vs));
        m_new[v] = mx;
        m_sub[v] = neginf_to_zero_ps(mx);
        alpha[v] = exp_neon_ps(vsubq_f32(old, m_sub[v]));
        sum[v] = vdupq_n_f32(0.0f);
    }
    for (int p = 0; 2 * p < n; p++) {
        const float *s0 = s + (int64_t)(2 * p) * 16;
        const int two = 2 * p + 1 < n;
        for (int v = 0; v < BF16_NV; v++) {
            const float32x4_t x0 = exp_neon_ps(vsubq_f32(vmulq_f32(vld1q_f32(s0 + v * 4), vs), m_sub[v]));
            sum[v] = vaddq_f32(sum[v], x0);
            float32x4_t x1 = vdupq_n_f32(0.0f);
            if (two) {
                x1 = exp_neon_ps(vsubq_f32(vmulq_f32(vld1q_f32(s0 + 16 + v * 4), vs), m_sub[v]));
                sum[v] = vaddq_f32(sum[v], x1);
            }
            const uint16x4_t b0 = f32_to_bf16_neon(x0), b1 = f32_to_bf16_neon(x1);
            uint16_t *dst = (uint16_t *)(pp + (int64_t)p * 16 + v * 4);
            vst1q_u16(dst, vcombine_u16(vzip1_u16(b0, b1), vzip2_u16(b0, b1)));
        }
    }
    float alphas[16];
    for (int v = 0; v < BF16_NV; v++) {
        vst1q_f32(row_sum + v * 4, vfmaq_f32(sum[v], vld1q_f32(row_sum + v * 4), alpha[v]));
        vst1q_f32(row_max + v * 4, m_new[v]);
        vst1q_f32(alphas + v * 4, alpha[v]);
    }
    int changed = 0, small = 0;
    for (int x = 0; x < 16; x++) {
        changed |= alphas[x] != 1;
        small |= alphas[x] > 0 && alphas[x] < (float)SDPA_RESCALE_SMALL;
    }
    if (!changed) return;
    if (small) {  /* internal.h: no subnormal product; the small factors' rows apart */
        for (int64_t c = 0; c < ev; c++)
            for (int x = 0; x < 16; x++) acc[c * 16 + x] = sdpa_rescale_f32(acc[c * 16 + x], alphas[x]);
        return;
    }
    for (int64_t c = 0; c < ev; c++)
        for (int v = 0; v < BF16_NV; v++) vst1q_f32(acc + c * 16 + v * 4, vmulq_f32(vld1q_f32(acc + c * 16 + v * 4), alpha[v]));
}

#undef BF16_NV
#undef BF16_MR

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---- integer_qk's scores with SDOT (signed x signed: no offsets) ---- */

/* FEAT_DotProd alone: this kernel runs on CPUs without BF16 too */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

/* 16 key values from feature c (a multiple of 16) of a row, as int8: int8
 * rows as they are, int4 nibbles (value + 8) unpacked into their order */
/* The roofline report's probe (internal.h): SDOT, 16 products an instruction. */
static double peak_sdot_neon(int64_t iters) {
    int32x4_t a[12];
    const int8x16_t u = vdupq_n_s8(3), v = vdupq_n_s8(-2);
    for (int k = 0; k < 12; k++) a[k] = vdupq_n_s32(k);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = vdotq_s32(a[k], u, v);
    int32x4_t t = a[0];
    for (int k = 1; k < 12; k++) t = vaddq_s32(t, a[k]);
    volatile int sink = vaddvq_s32(t);
    (void)sink;
    return (double)iters * 12 * 16 * 2;
}

static inline __attribute__((always_inline)) int8x16_t qi_keys_neon(const uint8_t *row, int64_t c, const int int4) {
    if (!int4) return vld1q_s8((const int8_t *)row + c);
    const uint8x8_t b = vld1_u8(row + c / 2);
    const uint8x8_t lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
    const uint8x16_t z = vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi));
    return vsubq_s8(vreinterpretq_s8_u8(z), vdupq_n_s8(8));
}

/* 4 rows (those past mr copies, not stored) x nt keys: each group's sum exact
 * in int32 lanes, reduced exactly, then converted, scaled and added in group
 * order: the portable kernel's arithmetic, so its results bit for bit */
static inline __attribute__((always_inline)) void qi_block_neon(const int int4, const int nt, int mr, int64_t e,
                                                                int64_t g, const int8_t *q, int64_t ldq,
                                                                const float *qscale, const uint8_t *kj, int64_t ldk,
                                                                const float *ks, int64_t ksr, int64_t ksc, float *s,
                                                                int64_t lds) {
    const int8_t *qx[4];
    for (int x = 0; x < 4; x++) qx[x] = q + (x < mr ? x : mr - 1) * ldq;
    float sum[4][4] = {{0}};
    for (int64_t c0 = 0; c0 < e; c0 += g) {
        int32x4_t acc[4][4];
        for (int x = 0; x < 4; x++)
            for (int t = 0; t < nt; t++) acc[x][t] = vdupq_n_s32(0);
        for (int64_t c = c0; c < c0 + g; c += 16) {
            int8x16_t kv[4];
            for (int t = 0; t < nt; t++) kv[t] = qi_keys_neon(kj + t * ldk, c, int4);
            for (int x = 0; x < 4; x++) {
                const int8x16_t qv = vld1q_s8(qx[x] + c);
                for (int t = 0; t < nt; t++) acc[x][t] = vdotq_s32(acc[x][t], qv, kv[t]);
            }
        }
        for (int x = 0; x < mr; x++)
            for (int t = 0; t < nt; t++) {
                const float term = (float)vaddvq_s32(acc[x][t]) * ks[t * ksr + (c0 / g) * ksc];
                sum[x][t] = c0 == 0 ? term : sum[x][t] + term;
            }
    }
    for (int x = 0; x < mr; x++)
        for (int t = 0; t < nt; t++) s[x * lds + t] = sum[x][t] * qscale[x];
}

/* internal.h's dot_qi for int8 and int4 keys, groups of a multiple of 16
 * features (0, nothing done, for others: the portable kernel runs) */
static int dot_qi_neon_dotprod(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q, int64_t ldq,
                               const float *qscale, const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr,
                               int64_t ksc, float *s, int64_t lds, void *work) {
    (void)work;
    const int int4 = dt == SDPA_INT4;
    if ((dt != SDPA_INT8 && !int4) || g <= 0 || g % 16 || e % g || g > 65536) return 0; /* int32 sums: exact */
    for (int x0 = 0; x0 < m; x0 += 4) {
        const int mr = m - x0 < 4 ? m - x0 : 4;
        const int8_t *qx = q + x0 * ldq;
        float *sx = s + x0 * lds;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            if (int4) qi_block_neon(1, 4, mr, e, g, qx, ldq, qscale + x0, k + j * ldk, ldk, ks + j * ksr, ksr, ksc, sx + j, lds);
            else qi_block_neon(0, 4, mr, e, g, qx, ldq, qscale + x0, k + j * ldk, ldk, ks + j * ksr, ksr, ksc, sx + j, lds);
        }
        for (; j < n; j++)
            qi_block_neon(int4, 1, mr, e, g, qx, ldq, qscale + x0, k + j * ldk, ldk, ks + j * ksr, ksr, ksc, sx + j, lds);
    }
    return 1;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
