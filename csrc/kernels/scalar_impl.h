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

static void FN(softmax)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
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

static void FN(row_softmax)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
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

#undef FN
#undef CAT
#undef CAT_
