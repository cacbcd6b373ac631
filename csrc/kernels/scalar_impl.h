/* Portable kernels for one element type (contracts in internal.h).  Included by
 * scalar.c with T (the element type), SUF (the name suffix), EXP (libm's exp with the cut of internal.h). */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

static void FN(gemm)(int m, int64_t kdim, const T *a, int64_t a_rs, int64_t a_ks, const T *b,
                     int64_t ldb, T *c, int64_t ldc, int accumulate) {
    for (int r = 0; r < m; r++) {
        T acc[SCALAR_NR];
        T *cr = c + (int64_t)r * ldc;
        for (int x = 0; x < SCALAR_NR; x++) acc[x] = accumulate ? cr[x] : 0;
        const T *ar = a + (int64_t)r * a_rs;
        for (int64_t kk = 0; kk < kdim; kk++) {
            T av = ar[kk * a_ks];
            const T *bk = b + kk * ldb;
            for (int x = 0; x < SCALAR_NR; x++) acc[x] += av * bk[x];
        }
        for (int x = 0; x < SCALAR_NR; x++) cr[x] = acc[x];
    }
}

static void FN(online_softmax_update)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
    T m_new[SCALAR_NR], m_sub[SCALAR_NR], alpha[SCALAR_NR], sum[SCALAR_NR];
    for (int x = 0; x < SCALAR_NR; x++) {
        T mx = row_max[x];
        for (int j = 0; j < n; j++) {
            T v = s[j * SCALAR_NR + x];
            if (v > mx || v != v) mx = v;
            if (mx != mx) break;
        }
        m_new[x] = mx;
        m_sub[x] = mx == -(T)INFINITY ? 0 : mx;  /* nothing visible: exp(-inf) = 0 */
        alpha[x] = EXP(row_max[x] - m_sub[x]);
        sum[x] = 0;
    }
    for (int j = 0; j < n; j++) {
        T *sj = s + j * SCALAR_NR;
        for (int x = 0; x < SCALAR_NR; x++) {
            T p = EXP(sj[x] - m_sub[x]);
            sj[x] = p;
            sum[x] += p;
        }
    }
    for (int x = 0; x < SCALAR_NR; x++) {
        row_sum[x] = row_sum[x] * alpha[x] + sum[x];
        row_max[x] = m_new[x];
    }
    int changed = 0;  /* rescale only when some row's max grew */
    for (int x = 0; x < SCALAR_NR; x++) changed |= alpha[x] != 1;
    if (!changed) return;
    for (int x = 0; x < SCALAR_NR; x++)  /* internal.h: no subnormal product */
        if (alpha[x] != 1)
            for (int64_t c = 0; c < ev; c++) acc[c * SCALAR_NR + x] = RESCALE(acc[c * SCALAR_NR + x], alpha[x]);
}

/* x[i] = cap * tanh(x[i] / cap), as 1 - 2 / (e^(2y) + 1) (see simd_impl.h). */
static void FN(softcap)(T *x, int64_t n, T cap) {
    for (int64_t i = 0; i < n; i++) x[i] = cap * (1 - 2 / (EXP(x[i] * ((T)2 / cap)) + 1));
}

static void FN(exp)(T *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = EXP(x[i]);
}

static void FN(bwd_probs)(T *s, int n, int nr, const T *lse) {
    for (int j = 0; j < n; j++)
        for (int x = 0; x < nr; x++) s[(int64_t)j * nr + x] = EXP(s[(int64_t)j * nr + x] - lse[x]);
}

static void FN(bwd_dscores)(T *d, const T *p, int n, int nr, const T *dd) {
    for (int j = 0; j < n; j++)
        for (int x = 0; x < nr; x++) {
            T *dj = d + (int64_t)j * nr + x;
            *dj = p[(int64_t)j * nr + x] * (*dj - dd[x]);
        }
}

static void FN(dot)(int m, int n, int64_t e, const T *q, int64_t ldq, const T *k, int64_t ldk, T *s,
                    int64_t lds) {
    for (int x = 0; x < m; x++)
        for (int j = 0; j < n; j++) {
            const T *qx = q + x * ldq, *kj = k + j * ldk;
            T acc = 0;
            for (int64_t c = 0; c < e; c++) acc += qx[c] * kj[c];
            s[x * lds + j] = acc;
        }
}

static void FN(pv_rows)(int m, int n, int64_t ev, const T *p, int64_t ldp, const T *v, int64_t ldv,
                        T *acc, int64_t ldacc) {
    for (int x = 0; x < m; x++) {
        T *ax = acc + x * ldacc;
        for (int j = 0; j < n; j++) {
            const T w = p[x * ldp + j], *vj = v + j * ldv;
            for (int64_t c = 0; c < ev; c++) ax[c] += w * vj[c];
        }
    }
}

static void FN(row_online_softmax_update)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
    T mx = *row_max;
    for (int j = 0; j < n; j++) {
        if (s[j] > mx || s[j] != s[j]) mx = s[j];
        if (mx != mx) break;
    }
    const T m_sub = mx == -(T)INFINITY ? 0 : mx;
    const T alpha = EXP(*row_max - m_sub);
    T sum = 0;
    for (int j = 0; j < n; j++) {
        T p = EXP(s[j] - m_sub);
        s[j] = p;
        sum += p;
    }
    *row_sum = *row_sum * alpha + sum;
    *row_max = mx;
    if (alpha == 1) return;  /* the max did not grow */
    for (int64_t c = 0; c < ev; c++) acc[c] = RESCALE(acc[c], alpha);
}


/* ---- the rest of the contracts: the same sums, in the same order, as dot,
 * pv_rows and the driver's element loops over widened or converted values ---- */

static inline T FN(half_value)(sdpa_dtype dt, uint16_t h) {
    return (T)(dt == SDPA_BFLOAT16 ? sdpa_bf16_to_f32(h) : sdpa_f16_to_f32(h));
}

static void FN(widen)(sdpa_dtype dt, const uint16_t *src, T *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = FN(half_value)(dt, src[i]);
}

static void FN(dot_half)(sdpa_dtype dt, int m, int n, int64_t e, const T *q, int64_t ldq, const uint16_t *k,
                         int64_t ldk, T *s, int64_t lds) {
    for (int x = 0; x < m; x++)
        for (int j = 0; j < n; j++) {
            const T *qx = q + x * ldq;
            const uint16_t *kj = k + j * ldk;
            T acc = 0;
            for (int64_t c = 0; c < e; c++) acc += qx[c] * FN(half_value)(dt, kj[c]);
            s[x * lds + j] = acc;
        }
}

static void FN(pv_rows_half)(sdpa_dtype dt, int m, int n, int64_t ev, const T *p, int64_t ldp, const uint16_t *v,
                             int64_t ldv, T *acc, int64_t ldacc) {
    for (int x = 0; x < m; x++) {
        T *ax = acc + x * ldacc;
        for (int j = 0; j < n; j++) {
            const T w = p[x * ldp + j];
            const uint16_t *vj = v + j * ldv;
            for (int64_t c = 0; c < ev; c++) ax[c] += w * FN(half_value)(dt, vj[c]);
        }
    }
}

static void FN(dot_q)(sdpa_dtype dt, int m, int n, int64_t e, const T *q, int64_t ldq, const uint8_t *k, int64_t ldk,
                      T *s, int64_t lds) {
    for (int x = 0; x < m; x++)
        for (int j = 0; j < n; j++) {
            const T *qx = q + x * ldq;
            const uint8_t *kj = k + j * ldk;
            T acc = 0;
            for (int64_t c = 0; c < e; c++) acc += qx[c] * (T)sdpa_quantized_value(dt, kj, c);
            s[x * lds + j] = acc;
        }
}

static void FN(pv_rows_q)(sdpa_dtype dt, int m, int n, int64_t ev, const T *p, int64_t ldp, const uint8_t *v,
                          int64_t ldv, T *acc, int64_t ldacc) {
    for (int x = 0; x < m; x++) {
        T *ax = acc + x * ldacc;
        for (int j = 0; j < n; j++) {
            const T w = p[x * ldp + j];
            const uint8_t *vj = v + j * ldv;
            for (int64_t c = 0; c < ev; c++) ax[c] += w * (T)sdpa_quantized_value(dt, vj, c);
        }
    }
}

/* Each group's unscaled dot, scaled and summed group by group: the values of
 * the driver's loop over dot_q, for any g that divides e. */
static int FN(dot_q_grouped)(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const T *q, int64_t ldq,
                             const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr, int64_t ksc, T *s,
                             int64_t lds) {
    if (g <= 0 || e % g) return 0;
    for (int x = 0; x < m; x++)
        for (int j = 0; j < n; j++) {
            const T *qx = q + x * ldq;
            const uint8_t *kj = k + j * ldk;
            T sum = 0;
            for (int64_t c0 = 0; c0 < e; c0 += g) {
                T acc = 0;
                for (int64_t c = c0; c < c0 + g; c++) acc += qx[c] * (T)sdpa_quantized_value(dt, kj, c);
                const T scaled = acc * (T)ks[j * ksr + (c0 / g) * ksc];
                sum = c0 == 0 ? scaled : sum + scaled;
            }
            s[x * lds + j] = sum;
        }
    return 1;
}

/* The weights scaled by each group's value scales, then that group's pv_rows_q:
 * the values of the driver's loop, for any g that divides ev. */
static int FN(pv_rows_q_grouped)(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const T *p, int64_t ldp,
                                 const uint8_t *v, int64_t ldv, const float *vs, int64_t vsr, int64_t vsc, T *acc,
                                 int64_t ldacc) {
    if (g <= 0 || ev % g) return 0;
    for (int64_t c0 = 0; c0 < ev; c0 += g)
        for (int x = 0; x < m; x++) {
            T *ax = acc + x * ldacc;
            for (int j = 0; j < n; j++) {
                const T w = p[x * ldp + j] * (T)vs[j * vsr + (c0 / g) * vsc];
                const uint8_t *vj = v + j * ldv;
                for (int64_t c = c0; c < c0 + g; c++) ax[c] += w * (T)sdpa_quantized_value(dt, vj, c);
            }
        }
    return 1;
}

/* integer_qk's scores, the reference: each group's products summed exactly
 * (in 64 bits), converted, scaled, and the groups added in order. */
static int FN(dot_qi)(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q, int64_t ldq,
                      const T *qscale, const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr, int64_t ksc,
                      T *s, int64_t lds, void *work) {
    (void)work;
    if (g <= 0 || e % g || (dt != SDPA_INT8 && dt != SDPA_INT4)) return 0;
    for (int x = 0; x < m; x++)
        for (int j = 0; j < n; j++) {
            const int8_t *qx = q + x * ldq;
            const uint8_t *kj = k + j * ldk;
            T sum = 0;
            for (int64_t c0 = 0; c0 < e; c0 += g) {
                int64_t acc = 0;
                if (dt == SDPA_INT8)
                    for (int64_t c = c0; c < c0 + g; c++) acc += (int64_t)qx[c] * (int8_t)kj[c];
                else
                    for (int64_t c = c0; c < c0 + g; c++)
                        acc += (int64_t)qx[c] * ((int)((kj[c >> 1] >> ((c & 1) * 4)) & 15u) - 8);
                const T t = (T)acc * (T)ks[j * ksr + (c0 / g) * ksc];
                sum = c0 == 0 ? t : sum + t;
            }
            s[x * lds + j] = sum * qscale[x];
        }
    return 1;
}

static void FN(mask_add)(T *s, int nr, int n, int rows, const T *m, int64_t m_rs) {
    for (int x = 0; x < rows; x++)
        for (int j = 0; j < n; j++) s[(int64_t)j * nr + x] += m[x * m_rs + j];
}

static void FN(mask_bool)(T *s, int nr, int n, int rows, const uint8_t *m, int64_t m_rs) {
    for (int x = 0; x < rows; x++)
        for (int j = 0; j < n; j++)
            if (!m[x * m_rs + j]) s[(int64_t)j * nr + x] = -(T)INFINITY;
}

static void FN(pack_q)(T *panel, int nr, const T *const *rows, int n, int64_t e, T scale) {
    for (int64_t c = 0; c < e; c++) {
        T *pc = panel + c * nr;
        for (int x = 0; x < n; x++) pc[x] = scale * rows[x][c];
        for (int x = n; x < nr; x++) pc[x] = 0;
    }
}

static void FN(pack_q_half)(sdpa_dtype dt, T *panel, int nr, const uint16_t *const *rows, int n, int64_t e,
                            T scale) {
    for (int64_t c = 0; c < e; c++) {
        T *pc = panel + c * nr;
        for (int x = 0; x < n; x++) pc[x] = scale * FN(half_value)(dt, rows[x][c]);
        for (int x = n; x < nr; x++) pc[x] = 0;
    }
}

static void FN(store_rows)(T *const *rows, const T *acc, int nr, const T *row_l, int n, int64_t ev) {
    for (int x = 0; x < n; x++) {
        const T l = row_l[x], inv = l == 0 ? 0 : 1 / l;
        for (int64_t c = 0; c < ev; c++) rows[x][c] = l == 0 ? 0 : acc[c * nr + x] * inv;
    }
}

static void FN(store_rows_half)(sdpa_dtype dt, uint16_t *const *rows, const T *acc, int nr, const T *row_l, int n,
                                int64_t ev) {
    for (int x = 0; x < n; x++) {
        const T l = row_l[x], inv = l == 0 ? 0 : 1 / l;
        for (int64_t c = 0; c < ev; c++) {
            const float y = (float)(l == 0 ? 0 : acc[c * nr + x] * inv);
            rows[x][c] = dt == SDPA_BFLOAT16 ? sdpa_f32_to_bf16(y) : sdpa_f32_to_f16(y);
        }
    }
}

static void FN(scale_copy)(T *dst, const T *src, int64_t n, T scale) {
    for (int64_t i = 0; i < n; i++) dst[i] = scale * src[i];
}

static void FN(scale_copy_d)(T *dst, const T *src, int64_t n, double inv) {
    for (int64_t i = 0; i < n; i++) dst[i] = (T)((double)src[i] * inv);
}

#undef FN
#undef CAT
#undef CAT_
