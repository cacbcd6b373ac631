/* Portable kernels for one element type (contracts in internal.h).  Included by
 * scalar.c with T (the element type), SUF (the name suffix), EXP (libm's exp). */
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
    for (int64_t c = 0; c < ev; c++)
        for (int x = 0; x < SCALAR_NR; x++) acc[c * SCALAR_NR + x] *= alpha[x];
}

static void FN(exp)(T *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = EXP(x[i]);
}

#undef FN
#undef CAT
#undef CAT_
