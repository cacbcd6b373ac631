/* Portable kernels for one element type.  Included by scalar.c with
 * T (the element type), SUF (the name suffix) and EXP (libm's exp) defined. */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

static void FN(qk)(int m, int n, int64_t e, const T *q, const T *kp, T *s, int64_t ld_s) {
    int panels = (n + SCALAR_NR - 1) / SCALAR_NR;
    for (int i = 0; i < m; i++) {
        const T *qi = q + (int64_t)i * e;
        for (int pnl = 0; pnl < panels; pnl++) {
            const T *panel = kp + (int64_t)pnl * e * SCALAR_NR;
            T acc[SCALAR_NR];
            for (int j = 0; j < SCALAR_NR; j++) acc[j] = 0;
            for (int64_t c = 0; c < e; c++) {
                T qc = qi[c];
                for (int j = 0; j < SCALAR_NR; j++) acc[j] += qc * panel[c * SCALAR_NR + j];
            }
            T *si = s + (int64_t)i * ld_s + pnl * SCALAR_NR;
            for (int j = 0; j < SCALAR_NR; j++) si[j] = acc[j];
        }
    }
}

static void FN(pv)(int m, int n, int64_t ev, const T *p, int64_t ld_p, const T *v, int64_t ld_v,
                   T *acc) {
    for (int i = 0; i < m; i++) {
        T *ai = acc + (int64_t)i * ev;
        const T *pi = p + (int64_t)i * ld_p;
        for (int j = 0; j < n; j++) {
            T w = pi[j];
            const T *vj = v + (int64_t)j * ld_v;
            for (int64_t c = 0; c < ev; c++) ai[c] += w * vj[c];
        }
    }
}

static T FN(softmax)(const T *s, int n, T row_max, T *p) {
    T sum = 0;
    for (int j = 0; j < n; j++) {
        T x = EXP(s[j] - row_max);
        p[j] = x;
        sum += x;
    }
    return sum;
}

static T FN(row_max)(const T *s, int n) {
    T mx = -(T)INFINITY;
    for (int j = 0; j < n; j++) {
        T x = s[j];
        if (x > mx || x != x) mx = x;  /* a NaN score makes the whole row NaN */
        if (mx != mx) break;
    }
    return mx;
}

#undef FN
#undef CAT
#undef CAT_
