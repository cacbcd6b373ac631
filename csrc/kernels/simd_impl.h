/*
 * SIMD kernels for one element type and instruction set (contracts in
 * internal.h), written once over a small vector vocabulary.  The including
 * file includes a vocabulary header (avx512_f32.h, ...) inside its target
 * region, then this file, then simd_end.h.  The vocabulary:
 *
 *   T, SUF           element type and name suffix (e.g. float, avx512_f32)
 *   V, LANES         vector type and its number of elements
 *   NV               vectors per panel row: nr = NV * LANES query rows
 *   MR               rows of the register block of gemm (MR x NV accumulators)
 *   V_ZERO() V_SET1(x) V_LOAD(p) V_STORE(p, v)    (p aligned)
 *   V_ADD V_SUB V_MUL V_DIV V_FMA(a, b, c) = a*b + c
 *   V_MAX_NAN(acc, x)      max that keeps a NaN of either argument
 *   V_NEGINF_TO_ZERO(x)    lanes equal to -inf become 0
 *   V_EXP(x)               e^x, exactly 0 below the cut of internal.h, never
 *                          subnormal (see the exp notes in the including file)
 *   V_LOADU(p) V_STOREU(p, v)                     (any alignment)
 *   V_HSUM(v)              the sum of the lanes
 *   V_HSUM_LANES(a)        a vector whose lane i is V_HSUM(a[i]), a[0..LANES)
 *   V_HSUM4(a)             (optional) lanes 0-3: the sums of a[0..4), each by
 *                          V_HSUM_LANES's tree: float keys' dot over 4 query rows
 *   V_LOADU_BF16(p) V_LOADU_F16(p)   (float only, optional) LANES 16-bit values
 *                          widened to T: the row kernels over a 16-bit cache
 *   V_STOREU_BF16(p, v) V_STOREU_F16(p, v)  (float only, optional) LANES values
 *                          rounded to 16 bits as convert.h does: the 16-bit epilogue
 *   V_LOADU_I8(p)          (float only, optional) LANES int8 values widened to
 *                          T: the row kernels over an int8 cache
 *   V_TRANSPOSE(r)         (float only, optional) r[0..LANES) as rows of a square
 *                          block become its columns: the vectorised masks
 *   V_BOOL_TO_NEGINF(p)    LANES bool bytes: 0 where nonzero, -inf where zero
 *   V_STORE_NEGINF_WHERE(p, t)  -inf stored at aligned p in the lanes where t is
 *                          -inf, the others left as they are
 *   V_HMAX_NAN(v)          the largest lane, NaN if a lane is NaN
 *   S_EXP(x)               libm's exp for T with the kernels' cut (internal.h)
 *   RESCALE(a, f)          a * f, without a subnormal product for a tiny f (internal.h)
 *
 * With SIMD_PANELS_ONLY defined (simd_half.h), only the panel kernels (gemm, the softmax
 * update, masks, query panels and finished rows) are built: a set's half-width
 * instance, NV halved under another SUF, for a task's last panel when its rows
 * fit (kernel_table.f32_half).
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)
#define NR (NV * LANES)

/* The panel width, for the kernel table: nr query rows per vector block. */
enum { FN(panel_rows) = NR };

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

static void FN(online_softmax_update)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
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
    /* rescale only when some row's max grew (alpha != 1) */
    T alphas[NR] __attribute__((aligned(64)));
    for (int v = 0; v < NV; v++) V_STORE(alphas + v * LANES, alpha[v]);
    int changed = 0;
    for (int x = 0; x < NR; x++) changed |= alphas[x] != 1;
    if (!changed) return;
    int small = 0;  /* a max that grew by more than about 41 (internal.h) */
    for (int x = 0; x < NR; x++) small |= alphas[x] > 0 && alphas[x] < (T)SDPA_RESCALE_SMALL;
    if (small) {  /* lane by lane: the small factors' rows careful, the others as below */
        for (int64_t c = 0; c < ev; c++)
            for (int x = 0; x < NR; x++) acc[c * NR + x] = RESCALE(acc[c * NR + x], alphas[x]);
        return;
    }
    for (int64_t c = 0; c < ev; c++)
        for (int v = 0; v < NV; v++) {
            T *ac = acc + c * NR + v * LANES;
            V_STORE(ac, V_MUL(V_LOAD(ac), alpha[v]));
        }
}

#ifndef SIMD_PANELS_ONLY /* the element-wise kernels take no panel width */
/* x[i] = cap * tanh(x[i] / cap), tanh(y) as 1 - 2 / (e^(2y) + 1): exact at the
 * ends (+-cap for +-inf), NaN kept; absolute error a few ulp of cap.  The last
 * elements go through a padded vector too, so an element's bits do not depend
 * on where it lies (a score tile of a narrower panel ends mid-vector). */
static inline __attribute__((always_inline)) V FN(softcap_vec)(V x, V vc, V two_over_c) {
    const V one = V_SET1((T)1), two = V_SET1((T)2);
    return V_MUL(vc, V_SUB(one, V_DIV(two, V_ADD(V_EXP(V_MUL(x, two_over_c)), one))));
}

static void FN(softcap)(T *x, int64_t n, T cap) {
    const V vc = V_SET1(cap), two_over_c = V_SET1((T)2 / cap);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) V_STOREU(x + i, FN(softcap_vec)(V_LOADU(x + i), vc, two_over_c));
    if (i < n) {
        T tmp[LANES] __attribute__((aligned(64)));
        for (int l = 0; l < LANES; l++) tmp[l] = i + l < n ? x[i + l] : 0;
        V_STORE(tmp, FN(softcap_vec)(V_LOAD(tmp), vc, two_over_c));
        for (int l = 0; i + l < n; l++) x[i + l] = tmp[l];
    }
}

static void FN(exp)(T *x, int64_t n) {
    int64_t i = 0;
    T tmp[LANES] __attribute__((aligned(64)));
    for (; i + LANES <= n; i += LANES) V_STOREU(x + i, V_EXP(V_LOADU(x + i)));
    if (i < n) {
        for (int l = 0; l < LANES; l++) tmp[l] = i + l < n ? x[i + l] : 0;
        V_STORE(tmp, V_EXP(V_LOAD(tmp)));
        for (int l = 0; i + l < n; l++) x[i + l] = tmp[l];
    }
}

/* The backward's tiles (internal.h): any nr that is a multiple of LANES. */
static void FN(bwd_probs)(T *s, int n, int nr, const T *lse) {
    for (int x = 0; x < nr; x += LANES) {
        const V l = V_LOAD(lse + x);
        for (int j = 0; j < n; j++) {
            T *p = s + (int64_t)j * nr + x;
            V_STORE(p, V_EXP(V_SUB(V_LOAD(p), l)));
        }
    }
}

static void FN(bwd_dscores)(T *d, const T *p, int n, int nr, const T *dd) {
    for (int x = 0; x < nr; x += LANES) {
        const V dv = V_LOAD(dd + x);
        for (int j = 0; j < n; j++) {
            T *dj = d + (int64_t)j * nr + x;
            V_STORE(dj, V_MUL(V_LOAD(p + (int64_t)j * nr + x), V_SUB(V_LOAD(dj), dv)));
        }
    }
}

#endif

/* ---- masks on a transposed score tile ---- */

#ifdef V_TRANSPOSE
/*
 * s is n keys x NR query rows (row stride NR); the mask element of row x and
 * key j is m[x*m_rs + j] (the caller handles other layouts).  Blocks of LANES
 * rows x LANES keys of the mask are read row by row, as they lie in memory,
 * transposed in registers and applied to LANES key rows of s at once.  Rows at
 * or past `rows` (a partial panel) are not read.
 */
static inline __attribute__((always_inline)) void FN(mask_tile)(T *s, int n, int rows, const void *m, int64_t m_rs,
                                                              const int is_bool) {
    const int nblocks = (rows + LANES - 1) / LANES;
    int j = 0;
    for (; j + LANES <= n; j += LANES) {
        for (int rb = 0; rb < nblocks; rb++) {
            V t[LANES];
            for (int i = 0; i < LANES; i++) {
                const int x = rb * LANES + i;
                if (x >= rows) {
                    t[i] = V_ZERO();
                    continue;
                }
                /* the rows' next cache lines: 16 or 32 streams at once are more
                 * than the hardware prefetcher follows */
                __builtin_prefetch(is_bool ? (const void *)((const uint8_t *)m + x * m_rs + j + 64)
                                           : (const void *)((const T *)m + x * m_rs + j + 2 * LANES));
                if (is_bool) {
                    t[i] = V_BOOL_TO_NEGINF((const uint8_t *)m + x * m_rs + j);
                } else {
                    t[i] = V_LOADU((const T *)m + x * m_rs + j);
                }
            }
            V_TRANSPOSE(t);
            for (int i = 0; i < LANES; i++) {
                T *sj = s + (int64_t)(j + i) * NR + rb * LANES;
                if (is_bool) V_STORE_NEGINF_WHERE(sj, t[i]);
                else V_STORE(sj, V_ADD(V_LOAD(sj), t[i]));
            }
        }
    }
    for (; j < n; j++)  /* the last keys, one at a time */
        for (int x = 0; x < rows; x++) {
            T *sj = s + (int64_t)j * NR + x;
            if (is_bool) {
                if (!((const uint8_t *)m)[x * m_rs + j]) *sj = -(T)INFINITY;
            } else {
                *sj += ((const T *)m)[x * m_rs + j];
            }
        }
}

/* the panel kernels take nr for the contract's sake; each set's are built for its own NR */
static void FN(mask_add)(T *s, int nr, int n, int rows, const T *m, int64_t m_rs) {
    (void)nr;
    FN(mask_tile)(s, n, rows, m, m_rs, 0);
}

static void FN(mask_bool)(T *s, int nr, int n, int rows, const uint8_t *m, int64_t m_rs) {
    (void)nr;
    FN(mask_tile)(s, n, rows, m, m_rs, 1);
}

/*
 * Query panels and finished rows of 16-bit data share the code of T's: the
 * kind of a row's elements is T (0), bfloat16 (1) or float16 (2, float sets
 * with V_LOADU_BF16 and V_STOREU_BF16 only), widened exactly as it is loaded
 * and rounded once (as convert.h rounds) as it is stored.
 */
#if defined(V_LOADU_BF16) && defined(V_STOREU_BF16)
#define ROWS_HALF 1
#else
#define ROWS_HALF 0
#endif
#define ROW_ES(kind) ((kind) ? (int64_t)2 : (int64_t)sizeof(T))

static inline __attribute__((always_inline)) V FN(row_load)(const char *row, int64_t c, const int kind) {
#if ROWS_HALF
    if (kind == 1) return V_LOADU_BF16((const uint16_t *)row + c);
    if (kind == 2) return V_LOADU_F16((const uint16_t *)row + c);
#endif
    return V_LOADU((const T *)row + c);
}

static inline __attribute__((always_inline)) T FN(row_get)(const char *row, int64_t c, const int kind) {
    if (kind == 1) return (T)sdpa_bf16_to_f32(((const uint16_t *)row)[c]);
    if (kind == 2) return (T)sdpa_f16_to_f32(((const uint16_t *)row)[c]);
    return ((const T *)row)[c];
}

static inline __attribute__((always_inline)) void FN(row_store)(char *row, int64_t c, V y, const int kind) {
#if ROWS_HALF
    if (kind == 1) {
        V_STOREU_BF16((uint16_t *)row + c, y);
        return;
    }
    if (kind == 2) {
        V_STOREU_F16((uint16_t *)row + c, y);
        return;
    }
#endif
    V_STOREU((T *)row + c, y);
}

static inline __attribute__((always_inline)) void FN(row_put)(char *row, int64_t c, T y, const int kind) {
    if (kind == 1) ((uint16_t *)row)[c] = sdpa_f32_to_bf16((float)y);
    else if (kind == 2) ((uint16_t *)row)[c] = sdpa_f32_to_f16((float)y);
    else ((T *)row)[c] = y;
}

/*
 * A query panel: panel[c*NR + x] = scale * rows[x][c] for x < n, c < e, and 0
 * for the rows x in [n, NR).  Blocks of LANES rows x LANES columns are loaded
 * along the rows, as they lie in memory, and transposed in registers.
 */
static inline __attribute__((always_inline)) void FN(pack_q_kind)(const int kind, T *panel, const char *const *rows,
                                                               int n, int64_t e, T scale) {
    const V vs = V_SET1(scale);
    const int64_t es = ROW_ES(kind);
    int64_t c = 0;
    for (; c + LANES <= e; c += LANES)
        for (int rb = 0; rb < NV; rb++) {
            V t[LANES];
            for (int i = 0; i < LANES; i++) {
                const int x = rb * LANES + i;
                if (x >= n) {
                    t[i] = V_ZERO();
                    continue;
                }
                __builtin_prefetch(rows[x] + c * es + 128);
                t[i] = FN(row_load)(rows[x], c, kind);
            }
            V_TRANSPOSE(t);
            for (int i = 0; i < LANES; i++) V_STORE(panel + (c + i) * NR + rb * LANES, V_MUL(vs, t[i]));
        }
    for (; c < e; c++)  /* the last columns, one at a time */
        for (int x = 0; x < NR; x++) panel[c * NR + x] = x < n ? scale * FN(row_get)(rows[x], c, kind) : 0;
}

static void FN(pack_q)(T *panel, int nr, const T *const *rows, int n, int64_t e, T scale) {
    (void)nr;
    FN(pack_q_kind)(0, panel, (const char *const *)rows, n, e, scale);
}

/*
 * Finished rows out of an accumulator panel: rows[x][c] = acc[c*NR + x] / l
 * (as acc * (1 / l)) with l = row_l[x], for x < n, c < ev; a row with l == 0
 * (no visible key) is zeros.  LANES x LANES blocks are transposed in registers
 * and stored along the rows.
 */
static inline __attribute__((always_inline)) void FN(store_rows_kind)(const int kind, char *const *rows, const T *acc,
                                                                   const T *row_l, int n, int64_t ev) {
    T inv[NR];
    for (int x = 0; x < n; x++) inv[x] = row_l[x] == 0 ? 0 : 1 / row_l[x];
    int64_t c = 0;
    for (; c + LANES <= ev; c += LANES)
        for (int rb = 0; rb * LANES < n; rb++) {
            V t[LANES];
            for (int i = 0; i < LANES; i++) t[i] = V_LOAD(acc + (c + i) * NR + rb * LANES);
            V_TRANSPOSE(t);
            for (int i = 0; i < LANES && rb * LANES + i < n; i++) {
                const int x = rb * LANES + i;
                FN(row_store)(rows[x], c, row_l[x] == 0 ? V_ZERO() : V_MUL(t[i], V_SET1(inv[x])), kind);
            }
        }
    for (; c < ev; c++)
        for (int x = 0; x < n; x++) FN(row_put)(rows[x], c, row_l[x] == 0 ? 0 : acc[c * NR + x] * inv[x], kind);
}

static void FN(store_rows)(T *const *rows, const T *acc, int nr, const T *row_l, int n, int64_t ev) {
    (void)nr;
    FN(store_rows_kind)(0, (char *const *)rows, acc, row_l, n, ev);
}

#if ROWS_HALF
/* pack_q and store_rows over 16-bit rows (dt bfloat16 or float16) */
static void FN(pack_q_half)(sdpa_dtype dt, T *panel, int nr, const uint16_t *const *rows, int n, int64_t e,
                            T scale) {
    (void)nr;
    if (dt == SDPA_BFLOAT16) FN(pack_q_kind)(1, panel, (const char *const *)rows, n, e, scale);
    else FN(pack_q_kind)(2, panel, (const char *const *)rows, n, e, scale);
}

static void FN(store_rows_half)(sdpa_dtype dt, uint16_t *const *rows, const T *acc, int nr, const T *row_l, int n,
                                int64_t ev) {
    (void)nr;
    if (dt == SDPA_BFLOAT16) FN(store_rows_kind)(1, (char *const *)rows, acc, row_l, n, ev);
    else FN(store_rows_kind)(2, (char *const *)rows, acc, row_l, n, ev);
}
#endif
#undef ROWS_HALF
#undef ROW_ES
#endif

#ifndef SIMD_PANELS_ONLY /* a panel-only instance (a set's half width) has no row kernels */

/* ---- row kernels ---- */

/*
 * Keys and values of the row kernels are read as T or, for a float problem
 * over a 16-bit cache, as bfloat16 / float16 widened in registers (kind 1 / 2),
 * so that decoding moves half the bytes and never copies the cache.
 */
#define KV_T 0
#define KV_BF16 1
#define KV_F16 2
#define KV_I8 3
#define KV_E4M3 4
#define KV_E5M2 5
#define KV_I4 6
#define KV_G 8 /* a flag: a float32 scale per group of features, applied to each vector (FN(gscale)) */
#define KV_BASE(kind) ((kind) & 7)
/* the unit of a kind's row strides: bytes of one element, and one byte (two values) for int4 */
#define KV_SIZE(kind) \
    (KV_BASE(kind) == KV_T ? (int64_t)sizeof(T) : KV_BASE(kind) == KV_BF16 || KV_BASE(kind) == KV_F16 ? 2 : 1)
/* the byte offset of value c in a row */
#define KV_COL(kind, c) (KV_BASE(kind) == KV_I4 ? (int64_t)(c) >> 1 : (int64_t)(c) * KV_SIZE(kind))

/* The scales of KV_I8G rows: row j's features c .. c + LANES (one group) scale by
 * base[j * rs + (c >> shift) * cs]; groups of 1 << shift features, a multiple of LANES. */
typedef struct {
    const float *base;
    int64_t rs, cs;
    int shift;
} FN(gscale);

static inline __attribute__((always_inline)) V FN(scaled)(V kv, const int kind, const FN(gscale) *gs, int64_t j,
                                                       int64_t c) {
    if (!(kind & KV_G)) return kv;
    return V_MUL(kv, V_SET1((T)gs->base[j * gs->rs + (c >> gs->shift) * gs->cs]));
}

/* V_LOADU_E4M3 widens float8 e4m3fn values divided by 256 (float16s of a bias
 * 8 more), so that the multiply by 256 is done once a sum, not once a vector:
 * the dot's scores are multiplied by it, and P V's accumulators divided by it
 * on their way in and multiplied on their way out.  A power of two: the same
 * bits as widening each value exactly, unless a product or a partial sum falls
 * below float's normal range after the division (2^-126; with the caller's
 * flush-to-zero, values below 2^-118 flush) or reached infinity before it. */
#define KV_E4M3_UNIT 256 /* V_LOADU_E4M3's value of 1 is 1 / KV_E4M3_UNIT */
static inline __attribute__((always_inline)) V FN(e4m3_post)(V x, const int kind, T factor) {
    return KV_BASE(kind) == KV_E4M3 ? V_MUL(x, V_SET1(factor)) : x;
}

static inline __attribute__((always_inline)) V FN(load_kv)(const char *p, const int kind) {
#ifdef V_LOADU_BF16
    if (kind == KV_BF16) return V_LOADU_BF16((const uint16_t *)p);
    if (kind == KV_F16) return V_LOADU_F16((const uint16_t *)p);
#endif
#ifdef V_LOADU_I8
    if (KV_BASE(kind) == KV_I8) return V_LOADU_I8((const int8_t *)p);
#endif
#ifdef V_LOADU_I4
    if (KV_BASE(kind) == KV_E4M3) return V_LOADU_E4M3((const uint8_t *)p);
    if (KV_BASE(kind) == KV_E5M2) return V_LOADU_E5M2((const uint8_t *)p);
    if (KV_BASE(kind) == KV_I4) return V_LOADU_I4((const uint8_t *)p);
#endif
    (void)kind;
    return V_LOADU((const T *)p);
}

/* Sets with 4-lane vectors may widen a quantized row's bytes 16 values a load
 * (V_LOAD16_*, into 4 vectors): KV_WIDE(kind) says whether a kind's rows are
 * read so, 4 vectors at a time where 4 lie ahead; load_kv4 gives the values
 * load_kv gives for the 4. */
#if defined(V_LOAD16_I8) && LANES == 4
#define KV_WIDE(kind) (KV_BASE(kind) >= KV_I8)
static inline __attribute__((always_inline)) void FN(load_kv4)(const char *p, const int kind, V *o) {
    if (KV_BASE(kind) == KV_I8) V_LOAD16_I8((const int8_t *)p, o);
    else if (KV_BASE(kind) == KV_E4M3) V_LOAD16_E4M3((const uint8_t *)p, o);
    else if (KV_BASE(kind) == KV_E5M2) V_LOAD16_E5M2((const uint8_t *)p, o);
    else V_LOAD16_I4((const uint8_t *)p, o);
}
#else
#define KV_WIDE(kind) 0
static inline __attribute__((always_inline)) void FN(load_kv4)(const char *p, const int kind, V *o) {
    for (int u = 0; u < 4; u++) o[u] = FN(load_kv)(p + KV_COL(kind, u * LANES), kind);
}
#endif

/* value c of a row of a kind */
static inline __attribute__((always_inline)) T FN(scalar_kv)(const char *row, int64_t c, const int kind) {
    if (kind == KV_BF16) return (T)sdpa_bf16_to_f32(((const uint16_t *)row)[c]);
    if (kind == KV_F16) return (T)sdpa_f16_to_f32(((const uint16_t *)row)[c]);
    if (KV_BASE(kind) >= KV_I8) return (T)sdpa_quantized_value(KV_BASE(kind) + 1, (const uint8_t *)row, c);
    return ((const T *)row)[c];
}

/*
 * dot for several query rows (a GQA group): blocks of RB rows x 4 keys (RB =
 * LANES / 4; 4 for 128-bit vectors), so that each K vector is loaded (and widened) once
 * for RB rows; the RB * 4 accumulators reduce LANES at a time into vectors
 * whose lane x*4 + t (over the whole block) is the score of row x and key t.
 * Returns the number of keys done (a multiple of 4).
 * For 16-bit and quantized keys only: there the widening, not the loads, is the cost (with
 * float keys it measured 4-10% slower than LANES keys per row).
 * Each score is summed exactly as dot_kind's LANES-keys loop sums it (the same
 * lanes, the same reduction tree, the feature tail added last), and only the
 * keys that loop would take, so a 16-bit problem's scores are bit for bit those
 * of the float32 problem on the same values, whatever the number of rows.
 */
#define DOT_RB (LANES >= 8 ? LANES / 4 : 4)
static inline __attribute__((always_inline)) int FN(dot_rows4)(const int kind, const FN(gscale) *gs, int m, int n,
                                                            int64_t e, const T *q,
                                                            int64_t ldq, const char *k, int64_t ldk, T *s,
                                                            int64_t lds) {
    const int64_t es = KV_SIZE(kind);
    const int64_t ev = e / LANES * LANES;
    const int nl = n / LANES * LANES; /* the keys dot_kind takes LANES at a time */
    int j = 0;
    for (; j + 4 <= nl; j += 4) {
        const char *kj = k + (int64_t)j * ldk * es;
        for (int x0 = 0; x0 < m; x0 += DOT_RB) {
            const T *qx[DOT_RB];
            for (int x = 0; x < DOT_RB; x++) qx[x] = q + (x0 + x < m ? x0 + x : m - 1) * ldq;  /* past m: a copy */
            V acc[DOT_RB * 4];
            for (int i = 0; i < DOT_RB * 4; i++) acc[i] = V_ZERO();
            int64_t c = 0;
            for (; KV_WIDE(kind) && c + 4 * LANES <= ev; c += 4 * LANES) {  /* 4 vectors a key from one load */
                V kw[4][4];
                for (int t = 0; t < 4; t++) {
                    FN(load_kv4)(kj + t * ldk * es + KV_COL(kind, c), kind, kw[t]);
                    for (int u = 0; u < 4; u++) kw[t][u] = FN(scaled)(kw[t][u], kind, gs, j + t, c + u * LANES);
                }
                for (int u = 0; u < 4; u++)
                    for (int x = 0; x < DOT_RB; x++) {
                        V qv = V_LOADU(qx[x] + c + u * LANES);
                        for (int t = 0; t < 4; t++) acc[x * 4 + t] = V_FMA(qv, kw[t][u], acc[x * 4 + t]);
                    }
            }
            for (; c < ev; c += LANES) {
                V kv[4];
                for (int t = 0; t < 4; t++)
                    kv[t] = FN(scaled)(FN(load_kv)(kj + t * ldk * es + KV_COL(kind, c), kind), kind, gs, j + t, c);
                for (int x = 0; x < DOT_RB; x++) {
                    V qv = V_LOADU(qx[x] + c);
                    for (int t = 0; t < 4; t++) acc[x * 4 + t] = V_FMA(qv, kv[t], acc[x * 4 + t]);
                }
            }
            T r[DOT_RB * 4] __attribute__((aligned(64)));
            for (int b = 0; b < DOT_RB * 4 / LANES; b++)
                V_STORE(r + b * LANES, FN(e4m3_post)(V_HSUM_LANES(acc + b * LANES), kind, (T)KV_E4M3_UNIT));
            for (int x = 0; x < DOT_RB && x0 + x < m; x++)
                for (int t = 0; t < 4; t++) {
                    T tail = 0;
                    for (int64_t c = ev; c < e; c++) tail += qx[x][c] * FN(scalar_kv)(kj + t * ldk * es, c, kind);
                    s[(x0 + x) * lds + j + t] = ev < e ? r[x * 4 + t] + tail : r[x * 4 + t];
                }
        }
    }
    return j;
}
#undef DOT_RB

#ifdef V_HSUM4
/*
 * Float keys against 4 or more query rows (GQA decoding): a key at a time, its
 * row read once for 4 query rows (one load for 4 FMAs, where the LANES-keys
 * loop reads each key again for each row), the 4 sums reduced together.  Each
 * score is summed exactly as the LANES-keys loop sums it (the same lanes in
 * the same order, V_HSUM_LANES's tree, the feature tail added last), for the
 * keys that loop would take; returns how many.  Rows past m: copies, not
 * stored.  One thread, 4 rows a head, a cache in L3: 1.5x; from memory 1.3x.
 */
static inline __attribute__((always_inline)) int FN(dot_float_rows4)(int m, int n, int64_t e, const T *q, int64_t ldq,
                                                                    const T *k, int64_t ldk, T *s, int64_t lds) {
    const int64_t ev = e / LANES * LANES;
    const int nl = n / LANES * LANES;
    for (int j = 0; j < nl; j++) {
        const T *kj = k + (int64_t)j * ldk;
        for (int x0 = 0; x0 < m; x0 += 4) {
            const T *qx[4];
            for (int x = 0; x < 4; x++) qx[x] = q + (x0 + x < m ? x0 + x : m - 1) * ldq;
            V a[4] = {V_ZERO(), V_ZERO(), V_ZERO(), V_ZERO()};
            for (int64_t c = 0; c < ev; c += LANES) {
                const V kv = V_LOADU(kj + c);
                for (int x = 0; x < 4; x++) a[x] = V_FMA(V_LOADU(qx[x] + c), kv, a[x]);
            }
            T r[LANES] __attribute__((aligned(64)));
            V_STORE(r, V_HSUM4(a));
            for (int x = 0; x < 4 && x0 + x < m; x++) {
                T tail = 0;
                for (int64_t c = ev; c < e; c++) tail += qx[x][c] * kj[c];
                s[(x0 + x) * lds + j] = ev < e ? r[x] + tail : r[x];
            }
        }
    }
    return nl;
}
#endif

/* dot over k rows of kind elements; ldk counts elements */
static inline __attribute__((always_inline)) void FN(dot_kind)(const int kind, const FN(gscale) *gs, int m, int n,
                                                            int64_t e, const T *q,
                                                            int64_t ldq, const char *k, int64_t ldk, T *s,
                                                            int64_t lds) {
    const int64_t es = KV_SIZE(kind);
    const int64_t ev = e / LANES * LANES;
    int j = 0;
    /* 128-bit vectors: blocks of 4 rows from 4 rows up (2 or 3 would be half
     * or a quarter copies) */
    if (kind != KV_T && m >= (LANES >= 8 ? 2 : 4)) j = FN(dot_rows4)(kind, gs, m, n, e, q, ldq, k, ldk, s, lds);
#ifdef V_HSUM4
    if (kind == KV_T && m >= 4) j = FN(dot_float_rows4)(m, n, e, q, ldq, (const T *)k, ldk, s, lds);
#endif
    /* LANES keys at a time: one accumulator per key, reduced together */
    for (; j + LANES <= n; j += LANES) {
        const char *kj = k + (int64_t)j * ldk * es;
        for (int x = 0; x < m; x++) {
            const T *qx = q + x * ldq;
            V acc[LANES];
            for (int t = 0; t < LANES; t++) acc[t] = V_ZERO();
            int64_t c = 0;
            for (; KV_WIDE(kind) && c + 4 * LANES <= ev; c += 4 * LANES) {  /* 4 vectors a key from one load */
                for (int t = 0; t < LANES; t++) {
                    V kw[4];
                    FN(load_kv4)(kj + t * ldk * es + KV_COL(kind, c), kind, kw);
                    for (int u = 0; u < 4; u++)
                        acc[t] = V_FMA(V_LOADU(qx + c + u * LANES), FN(scaled)(kw[u], kind, gs, j + t, c + u * LANES),
                                       acc[t]);
                }
            }
            if (kind == KV_T) {
                /* float keys: key by key, each row read along (the same sums as
                 * a column of all the keys at a time, which reads 16 rows at
                 * once and measured 0.6x the streaming rate of row by row on
                 * Zen 4) */
                const int64_t c1 = c;
                for (int t = 0; t < LANES; t++)
                    for (c = c1; c < ev; c += LANES)
                        acc[t] = V_FMA(V_LOADU(qx + c),
                                       FN(scaled)(FN(load_kv)(kj + t * ldk * es + KV_COL(kind, c), kind), kind, gs, j + t, c),
                                       acc[t]);
            } else {
                /* widened keys: a column at a time, one query vector for the
                 * LANES keys (row by row measured 6% slower for bfloat16) */
                for (; c < ev; c += LANES) {
                    V qv = V_LOADU(qx + c);
                    for (int t = 0; t < LANES; t++)
                        acc[t] = V_FMA(qv, FN(scaled)(FN(load_kv)(kj + t * ldk * es + KV_COL(kind, c), kind), kind, gs, j + t, c),
                                       acc[t]);
                }
            }
            V r = FN(e4m3_post)(V_HSUM_LANES(acc), kind, (T)KV_E4M3_UNIT);
            if (ev < e) {
                T tail[LANES] __attribute__((aligned(64)));
                for (int t = 0; t < LANES; t++) {
                    T sum = 0;
                    for (int64_t c = ev; c < e; c++) sum += qx[c] * FN(scalar_kv)(kj + t * ldk * es, c, kind);
                    tail[t] = sum;
                }
                r = V_ADD(r, V_LOAD(tail));
            }
            V_STOREU(s + x * lds + j, r);
        }
    }
    for (; j < n; j++) {
        const char *kj = k + (int64_t)j * ldk * es;
        for (int x = 0; x < m; x++) {
            const T *qx = q + x * ldq;
            V a = V_ZERO();
            for (int64_t c = 0; c < ev; c += LANES)
                a = V_FMA(V_LOADU(qx + c), FN(scaled)(FN(load_kv)(kj + KV_COL(kind, c), kind), kind, gs, j, c), a);
            T r = KV_BASE(kind) == KV_E4M3 ? V_HSUM(a) * (T)KV_E4M3_UNIT : V_HSUM(a);
            for (int64_t c = ev; c < e; c++) r += qx[c] * FN(scalar_kv)(kj, c, kind);
            s[x * lds + j] = r;
        }
    }
}

/* acc rows x0..x0+mr, columns c0..c0+nvb*LANES, over all n keys (mr * nvb <= 16) */
static inline __attribute__((always_inline)) void FN(pv_rows_block)(
    const int kind, const FN(gscale) *gs, int64_t c0, const int mr, const int nvb, int n, const T *p, int64_t ldp,
    const char *v, int64_t ldv, T *acc, int64_t ldacc) {
    const int64_t es = KV_SIZE(kind);
    V a[4][8];
    for (int x = 0; x < mr; x++)
        for (int t = 0; t < nvb; t++) a[x][t] = FN(e4m3_post)(V_LOADU(acc + x * ldacc + t * LANES), kind, (T)(1.0 / KV_E4M3_UNIT));
    for (int j = 0; j < n; j++) {
        V vv[8];
        const char *vj = v + (int64_t)j * ldv * es;
        if (KV_WIDE(kind) && nvb % 4 == 0)
            for (int t = 0; t < nvb; t += 4) FN(load_kv4)(vj + KV_COL(kind, t * LANES), kind, vv + t);
        else
            for (int t = 0; t < nvb; t++) vv[t] = FN(load_kv)(vj + KV_COL(kind, t * LANES), kind);
        for (int t = 0; t < nvb; t++) vv[t] = FN(scaled)(vv[t], kind, gs, j, c0 + t * LANES);
        for (int x = 0; x < mr; x++) {
            V w = V_SET1(p[x * ldp + j]);
            for (int t = 0; t < nvb; t++) a[x][t] = V_FMA(w, vv[t], a[x][t]);
        }
    }
    for (int x = 0; x < mr; x++)
        for (int t = 0; t < nvb; t++) V_STOREU(acc + x * ldacc + t * LANES, FN(e4m3_post)(a[x][t], kind, (T)KV_E4M3_UNIT));
}

static inline __attribute__((always_inline)) void FN(pv_rows_kind)(const int kind, const FN(gscale) *gs, int m, int n,
                                                                int64_t ev,
                                                                const T *p, int64_t ldp, const char *v,
                                                                int64_t ldv, T *acc, int64_t ldacc) {
    const int64_t es = KV_SIZE(kind);
    for (int x0 = 0; x0 < m; x0 += 4) {
        const int mr = m - x0 < 4 ? m - x0 : 4;
        const T *px = p + x0 * ldp;
        T *ax = acc + x0 * ldacc;
        int64_t c = 0;
        /* one or two rows (MHA decoding): whole V rows of 8 vectors at a time,
         * so that each V row is read once per tile */
        for (; mr <= 2 && c + 8 * LANES <= ev; c += 8 * LANES) {
            const char *vc = v + KV_COL(kind, c);
            if (mr == 1) FN(pv_rows_block)(kind, gs, c, 1, 8, n, px, ldp, vc, ldv, ax + c, ldacc);
            else FN(pv_rows_block)(kind, gs, c, 2, 8, n, px, ldp, vc, ldv, ax + c, ldacc);
        }
        /* float rows of 8 vectors, 3 or 4 query rows (GQA decoding): two rows
         * at a time over whole V rows, the second pass reading them from the
         * cache, rather than each half row from memory in turn: the same sums,
         * decode-gqa-32k float32 1.12x faster on one thread (for 16-bit rows,
         * widened twice, it was 0.84x) */
        if (kind == KV_T && mr > 2 && ev % (8 * LANES) == 0) {
            for (; c < ev; c += 8 * LANES) {
                const char *vc = v + KV_COL(kind, c);
                FN(pv_rows_block)(kind, gs, c, 2, 8, n, px, ldp, vc, ldv, ax + c, ldacc);
                if (mr == 3) FN(pv_rows_block)(kind, gs, c, 1, 8, n, px + 2 * ldp, ldp, vc, ldv, ax + 2 * ldacc + c, ldacc);
                else FN(pv_rows_block)(kind, gs, c, 2, 8, n, px + 2 * ldp, ldp, vc, ldv, ax + 2 * ldacc + c, ldacc);
            }
            continue;
        }
        for (; c + 4 * LANES <= ev; c += 4 * LANES) {
            const char *vc = v + KV_COL(kind, c);
            switch (mr) {
                case 1: FN(pv_rows_block)(kind, gs, c, 1, 4, n, px, ldp, vc, ldv, ax + c, ldacc); break;
                case 2: FN(pv_rows_block)(kind, gs, c, 2, 4, n, px, ldp, vc, ldv, ax + c, ldacc); break;
                case 3: FN(pv_rows_block)(kind, gs, c, 3, 4, n, px, ldp, vc, ldv, ax + c, ldacc); break;
                default: FN(pv_rows_block)(kind, gs, c, 4, 4, n, px, ldp, vc, ldv, ax + c, ldacc); break;
            }
        }
        for (; c + LANES <= ev; c += LANES) {
            const char *vc = v + KV_COL(kind, c);
            switch (mr) {
                case 1: FN(pv_rows_block)(kind, gs, c, 1, 1, n, px, ldp, vc, ldv, ax + c, ldacc); break;
                case 2: FN(pv_rows_block)(kind, gs, c, 2, 1, n, px, ldp, vc, ldv, ax + c, ldacc); break;
                case 3: FN(pv_rows_block)(kind, gs, c, 3, 1, n, px, ldp, vc, ldv, ax + c, ldacc); break;
                default: FN(pv_rows_block)(kind, gs, c, 4, 1, n, px, ldp, vc, ldv, ax + c, ldacc); break;
            }
        }
        for (; c < ev; c++)
            for (int x = 0; x < mr; x++) {
                T sum = ax[x * ldacc + c];
                for (int j = 0; j < n; j++) sum += px[x * ldp + j] * FN(scalar_kv)(v + (int64_t)j * ldv * es, c, kind);
                ax[x * ldacc + c] = sum;
            }
    }
}

static void FN(dot)(int m, int n, int64_t e, const T *q, int64_t ldq, const T *k, int64_t ldk, T *s,
                    int64_t lds) {
    FN(dot_kind)(KV_T, NULL, m, n, e, q, ldq, (const char *)k, ldk, s, lds);
}

static void FN(pv_rows)(int m, int n, int64_t ev, const T *p, int64_t ldp, const T *v, int64_t ldv,
                        T *acc, int64_t ldacc) {
    FN(pv_rows_kind)(KV_T, NULL, m, n, ev, p, ldp, (const char *)v, ldv, acc, ldacc);
}

#ifdef V_LOADU_BF16
static void FN(dot_half)(sdpa_dtype dt, int m, int n, int64_t e, const T *q, int64_t ldq, const uint16_t *k,
                         int64_t ldk, T *s, int64_t lds) {
    if (dt == SDPA_BFLOAT16) FN(dot_kind)(KV_BF16, NULL, m, n, e, q, ldq, (const char *)k, ldk, s, lds);
    else FN(dot_kind)(KV_F16, NULL, m, n, e, q, ldq, (const char *)k, ldk, s, lds);
}

static void FN(pv_rows_half)(sdpa_dtype dt, int m, int n, int64_t ev, const T *p, int64_t ldp, const uint16_t *v,
                             int64_t ldv, T *acc, int64_t ldacc) {
    if (dt == SDPA_BFLOAT16) FN(pv_rows_kind)(KV_BF16, NULL, m, n, ev, p, ldp, (const char *)v, ldv, acc, ldacc);
    else FN(pv_rows_kind)(KV_F16, NULL, m, n, ev, p, ldp, (const char *)v, ldv, acc, ldacc);
}
#endif

#ifdef V_LOADU_I8
/* The kind of a quantized dtype, with the group flag */
static inline int FN(q_kind)(sdpa_dtype dt, int grouped) {
    const int base = dt == SDPA_INT8 ? KV_I8 : dt == SDPA_FP8_E4M3 ? KV_E4M3 : dt == SDPA_FP8_E5M2 ? KV_E5M2 : KV_I4;
    return base | (grouped ? KV_G : 0);
}

/* each kind its own instance of the loops (the kind is a constant in each);
 * a set that widens int8 in registers widens float8 and int4 too */
#ifndef V_LOADU_I4
#error "a kernel set with V_LOADU_I8 defines V_LOADU_E4M3, V_LOADU_E5M2 and V_LOADU_I4 too"
#endif
#define Q_KINDS(X) X(KV_I8) X(KV_E4M3) X(KV_E5M2) X(KV_I4) X(KV_I8 | KV_G) X(KV_E4M3 | KV_G) X(KV_E5M2 | KV_G) \
    X(KV_I4 | KV_G)

static void FN(dot_kinds)(int kind, const FN(gscale) *gs, int m, int n, int64_t e, const T *q, int64_t ldq,
                          const char *k, int64_t ldk, T *s, int64_t lds) {
    switch (kind) {  /* q_kind makes no other */
#define DOT_CASE(K) \
    case K: FN(dot_kind)(K, gs, m, n, e, q, ldq, k, ldk, s, lds); return;
        Q_KINDS(DOT_CASE)
#undef DOT_CASE
        default: return;
    }
}

static void FN(pv_kinds)(int kind, const FN(gscale) *gs, int m, int n, int64_t ev, const T *p, int64_t ldp,
                         const char *v, int64_t ldv, T *acc, int64_t ldacc) {
    switch (kind) {
#define PV_CASE(K) \
    case K: FN(pv_rows_kind)(K, gs, m, n, ev, p, ldp, v, ldv, acc, ldacc); return;
        Q_KINDS(PV_CASE)
#undef PV_CASE
        default: return;
    }
}
#undef Q_KINDS

static void FN(dot_q)(sdpa_dtype dt, int m, int n, int64_t e, const T *q, int64_t ldq, const uint8_t *k, int64_t ldk,
                      T *s, int64_t lds) {
    FN(dot_kinds)(FN(q_kind)(dt, 0), NULL, m, n, e, q, ldq, (const char *)k, ldk, s, lds);
}

static void FN(pv_rows_q)(sdpa_dtype dt, int m, int n, int64_t ev, const T *p, int64_t ldp, const uint8_t *v,
                          int64_t ldv, T *acc, int64_t ldacc) {
    FN(pv_kinds)(FN(q_kind)(dt, 0), NULL, m, n, ev, p, ldp, (const char *)v, ldv, acc, ldacc);
}

/* log2(g) when g is a power of two, a multiple of LANES and divides e; else -1 */
static int FN(group_shift)(int64_t g, int64_t e) {
    int shift = 0;
    while (shift < 62 && ((int64_t)1 << shift) < g) shift++;
    return ((int64_t)1 << shift) == g && g % LANES == 0 && e % g == 0 ? shift : -1;
}

/* dot_q and pv_rows_q with a scale per group of g features, applied to each key
 * or value vector as it is widened; 0 (nothing done) unless g is a power of two, a
 * multiple of the vector width, and divides e / ev */
static int FN(dot_q_grouped)(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const T *q, int64_t ldq,
                             const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr, int64_t ksc, T *s,
                             int64_t lds) {
    const FN(gscale) gs = {ks, ksr, ksc, FN(group_shift)(g, e)};
    if (gs.shift < 0) return 0;
    FN(dot_kinds)(FN(q_kind)(dt, 1), &gs, m, n, e, q, ldq, (const char *)k, ldk, s, lds);
    return 1;
}

static int FN(pv_rows_q_grouped)(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const T *p, int64_t ldp,
                                 const uint8_t *v, int64_t ldv, const float *vs, int64_t vsr, int64_t vsc, T *acc,
                                 int64_t ldacc) {
    const FN(gscale) gs = {vs, vsr, vsc, FN(group_shift)(g, ev)};
    if (gs.shift < 0) return 0;
    FN(pv_kinds)(FN(q_kind)(dt, 1), &gs, m, n, ev, p, ldp, (const char *)v, ldv, acc, ldacc);
    return 1;
}
#endif

#undef KV_T
#undef KV_BF16
#undef KV_F16
#undef KV_I8
#undef KV_E4M3
#undef KV_E5M2
#undef KV_I4
#undef KV_G
#undef KV_BASE
#undef KV_SIZE
#undef KV_COL
#undef KV_WIDE
#undef KV_E4M3_UNIT

static void FN(row_online_softmax_update)(T *s, int n, T *row_max, T *row_sum, T *acc, int64_t ev) {
    const int nv = n / LANES * LANES;
    V vmax = V_SET1(*row_max);
    for (int j = 0; j < nv; j += LANES) vmax = V_MAX_NAN(vmax, V_LOADU(s + j));
    T mx = V_HMAX_NAN(vmax);
    for (int j = nv; j < n && mx == mx; j++)
        if (s[j] > mx || s[j] != s[j]) mx = s[j];
    const T m_sub = mx == -(T)INFINITY ? 0 : mx;  /* nothing visible yet: exp(-inf) = 0 */
    const T alpha = S_EXP(*row_max - m_sub);
    const V vsub = V_SET1(m_sub);
    V vsum = V_ZERO();
    for (int j = 0; j < nv; j += LANES) {
        V pv = V_EXP(V_SUB(V_LOADU(s + j), vsub));
        V_STOREU(s + j, pv);
        vsum = V_ADD(vsum, pv);
    }
    if (nv < n) {
        T tmp[LANES] __attribute__((aligned(64)));
        for (int l = 0; l < LANES; l++) tmp[l] = nv + l < n ? s[nv + l] : -(T)INFINITY;
        V pv = V_EXP(V_SUB(V_LOAD(tmp), vsub));
        V_STORE(tmp, pv);
        vsum = V_ADD(vsum, pv);
        for (int l = 0; nv + l < n; l++) s[nv + l] = tmp[l];
    }
    *row_sum = *row_sum * alpha + V_HSUM(vsum);
    *row_max = mx;
    if (alpha == 1) return;  /* the max did not grow */
    if (alpha > 0 && alpha < (T)SDPA_RESCALE_SMALL) {
        for (int64_t c = 0; c < ev; c++) acc[c] = RESCALE(acc[c], alpha);
        return;
    }
    const int64_t evv = ev / LANES * LANES;
    const V va = V_SET1(alpha);
    for (int64_t c = 0; c < evv; c += LANES) V_STOREU(acc + c, V_MUL(V_LOADU(acc + c), va));
    for (int64_t c = evv; c < ev; c++) acc[c] *= alpha;
}

#endif /* SIMD_PANELS_ONLY */

#undef NR
#undef FN
#undef CAT
#undef CAT_
