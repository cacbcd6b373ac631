/*
 * SIMD kernels for one element type and instruction set (contracts in
 * internal.h), written once over a small vector vocabulary.  The including
 * file defines, inside its target region:
 *
 *   T, SUF           element type and name suffix (e.g. float, avx512_f32)
 *   V, LANES         vector type and its number of elements
 *   NV               vectors per panel row: nr = NV * LANES query rows
 *   MR               rows of the register block of gemm (MR x NV accumulators)
 *   V_ZERO() V_SET1(x) V_LOAD(p) V_STORE(p, v)    (p aligned)
 *   V_ADD V_SUB V_MUL V_FMA(a, b, c) = a*b + c
 *   V_MAX_NAN(acc, x)      max that keeps a NaN of either argument
 *   V_NEGINF_TO_ZERO(x)    lanes equal to -inf become 0
 *   V_EXP(x)               e^x (see the exp notes in the including file)
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)
#define NR (NV * LANES)

/* The register block: c[r][:] (=|+=) sum_kk a[r*a_rs + kk*a_ks] * b[kk][:], r < mr.
 * Always inlined with a constant mr, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void FN(gemm_block)(
    const int mr, int64_t kdim, const T *a, int64_t a_rs, int64_t a_ks, const T *b, int64_t ldb,
    T *c, int64_t ldc, int accumulate) {
    V acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = accumulate ? V_LOAD(c + r * ldc + v * LANES) : V_ZERO();
    for (int64_t kk = 0; kk < kdim; kk++) {
        V bv[NV];
        for (int v = 0; v < NV; v++) bv[v] = V_LOAD(b + kk * ldb + v * LANES);
        const T *ak = a + kk * a_ks;
        for (int r = 0; r < mr; r++) {
            V av = V_SET1(ak[r * a_rs]);
            for (int v = 0; v < NV; v++) acc[r][v] = V_FMA(av, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) V_STORE(c + r * ldc + v * LANES, acc[r][v]);
}

static void FN(gemm)(int m, int64_t kdim, const T *a, int64_t a_rs, int64_t a_ks, const T *b,
                     int64_t ldb, T *c, int64_t ldc, int accumulate) {
    int r = 0;
    for (; r + MR <= m; r += MR)
        FN(gemm_block)(MR, kdim, a + r * a_rs, a_rs, a_ks, b, ldb, c + r * ldc, ldc, accumulate);
    const T *ar = a + r * a_rs;
    T *cr = c + r * ldc;
    switch (m - r) {
#define REMAINDER_CASE(k)                                                                   \
    case k:                                                                                 \
        if (k < MR) FN(gemm_block)(k < MR ? k : 1, kdim, ar, a_rs, a_ks, b, ldb, cr, ldc, accumulate); \
        break;
        REMAINDER_CASE(1)
        REMAINDER_CASE(2)
        REMAINDER_CASE(3)
        REMAINDER_CASE(4)
        REMAINDER_CASE(5)
        REMAINDER_CASE(6)
        REMAINDER_CASE(7)
        REMAINDER_CASE(8)
        REMAINDER_CASE(9)
        REMAINDER_CASE(10)
        REMAINDER_CASE(11)
#undef REMAINDER_CASE
        default:
            break;
    }
}

static void FN(softmax)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
    V m_new[NV], m_sub[NV], alpha[NV], sum[NV];
    for (int v = 0; v < NV; v++) {
        V mx = V_LOAD(row_max + v * LANES);
        for (int j = 0; j < n; j++) mx = V_MAX_NAN(mx, V_LOAD(s + j * NR + v * LANES));
        m_new[v] = mx;
        m_sub[v] = V_NEGINF_TO_ZERO(mx);  /* nothing visible yet: exp(-inf - 0) = 0 */
        alpha[v] = V_EXP(V_SUB(V_LOAD(row_max + v * LANES), m_sub[v]));
        sum[v] = V_ZERO();
    }
    for (int j = 0; j < n; j++) {
        for (int v = 0; v < NV; v++) {
            T *sj = s + j * NR + v * LANES;
            V pv = V_EXP(V_SUB(V_LOAD(sj), m_sub[v]));
            V_STORE(sj, pv);
            sum[v] = V_ADD(sum[v], pv);
        }
    }
    for (int v = 0; v < NV; v++) {
        V_STORE(row_sum + v * LANES, V_FMA(V_LOAD(row_sum + v * LANES), alpha[v], sum[v]));
        V_STORE(row_max + v * LANES, m_new[v]);
    }
    for (int64_t c = 0; c < ev; c++)
        for (int v = 0; v < NV; v++) {
            T *ac = acc + c * NR + v * LANES;
            V_STORE(ac, V_MUL(V_LOAD(ac), alpha[v]));
        }
}

static void FN(exp)(T *x, int64_t n) {
    int64_t i = 0;
    T tmp[LANES] __attribute__((aligned(64)));
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; l++) tmp[l] = x[i + l];
        V_STORE(tmp, V_EXP(V_LOAD(tmp)));
        for (int l = 0; l < LANES; l++) x[i + l] = tmp[l];
    }
    if (i < n) {
        for (int l = 0; l < LANES; l++) tmp[l] = i + l < n ? x[i + l] : 0;
        V_STORE(tmp, V_EXP(V_LOAD(tmp)));
        for (int l = 0; i + l < n; l++) x[i + l] = tmp[l];
    }
}

#undef NR
#undef FN
#undef CAT
#undef CAT_
