/*
 * The backward pass for one compute type (included by backward.c with T, TDT,
 * SUF, KT, EXP).  FlashAttention-2's loop: a task owns one (batch index,
 * key/value head) and a split of its key blocks (blocks c, c + C, ...); for
 * each key block it walks the query panels of every head of the group that
 * see the block, recomputes P = exp(S - lse) a tile at a time and adds
 *     dV += P^T dO,  dK += dS^T (scale Q),  dQ += dS K   (dS = P (dP - D)),
 * dP = dO V^T, D = rowsum(dO o O).  Each key block's dK and dV are finished by
 * its task and written; dQ's partial sums wait in the task's accumulator and
 * are added over the splits in order afterwards.  Every product goes through
 * the set's gemm (internal.h): scores transposed (keys x nr rows) as the
 * forward keeps them, so that the mask, causality, the window, ALiBi and
 * softcap are the forward's own (scores_impl.h).
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

#include "kv_impl.h"
#include "scores_impl.h"

/* dst[i * cs] = f * src[i * ss] in dtype dt (rounded once), i < n */
static void FN(bwd_store)(sdpa_dtype dt, char *dst, int64_t cs, const T *src, int64_t ss, int64_t n, T f) {
    for (int64_t i = 0; i < n; i++) FN(store)(dst, i * cs, dt, f * src[i * ss]);
}

/* The address of row r of (b, h) in a view of elements of `elem` bytes. */
static char *FN(bwd_row)(const sdpa_problem *p, const sdpa_view *v, int64_t b, int64_t h, int64_t r, size_t elem) {
    return (char *)view_at(p, v, b, h, elem) + r * v->row_stride * (int64_t)elem;
}

/* n elements of `size` bytes at *at bytes from base (plan_take moves *at on,
 * aligned); NULL when base is (a layout only sized) */
static void *FN(bwd_take)(char *base, size_t *at, int64_t n, size_t size) {
    const size_t here = plan_take(at, (size_t)n * size);
    return base ? base + here : NULL;
}

/* dst[i] = keep * src[i] where mask[i] is set, else 0: an AND of the bits (a
 * dropped NaN is 0 too), vectorized */
static void FN(drop_apply)(const uint32_t *mask, const T *src, T *dst, int64_t n, T keep) {
    if (sizeof(T) == sizeof(uint32_t)) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &src[i], sizeof(u));
            u &= mask[i];
            memcpy(&dst[i], &u, sizeof(u));
            dst[i] *= keep;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            uint64_t u;
            memcpy(&u, &src[i], sizeof(u));
            u &= (uint64_t)mask[i] | ((uint64_t)mask[i] << 32);
            memcpy(&dst[i], &u, sizeof(u));
            dst[i] *= keep;
        }
    }
}

/* A tile's dropout (sdpa.h): the n keys x nr rows of st from key s0 and row
 * r0 of (b, h) times keep where kept, 0 where dropped, into dst (st itself
 * allowed); bits: n x nr words, the keep masks, left there. */
static void FN(drop_tile)(const sdpa_problem *p, const kernel_table *kt, int64_t b, int64_t h, int64_t r0, int nr,
                          int64_t s0, int n, uint32_t *bits, const T *st, T *dst, uint32_t thr, T keep) {
    kt->dropout_bits(p->dropout_seed, (uint32_t)b, (uint32_t)h, (uint32_t)(r0 / 8), nr / 8, (uint64_t)s0, n, thr,
                     bits);
    FN(drop_apply)(bits, st, dst, (int64_t)n * nr, keep);
}

/* dropout's threshold on a 16-bit number (kept when u >= it) and the kept
 * weights' factor, 1 / (1 - thr / 65536) */
static void FN(drop_constants)(const sdpa_problem *p, uint32_t *thr, T *keep) {
    const double t = ceil(p->dropout_p * 65536.0);
    *thr = t >= 65535.0 ? 65535u : (uint32_t)t;
    *keep = (T)(65536.0 / (65536.0 - (double)*thr));
}

#if HAS_BF16
/* Whether a bfloat16 problem's S = K Q^T and dP = V dO^T multiply the stored
 * pairs (gemm_bf16 of a set with bfloat16 products, reading its operands a
 * pair at a time: not AMX's tiles): K and V rows of whole 32-bit pairs where
 * they lie, query and dO rows contiguous. */
static int FN(bwd_pairs)(const sdpa_problem *p, const sdpa_grads *g, const kernel_table *kt, const KT *kern) {
    if (p->dtype != SDPA_BFLOAT16 || !kt->bf16_products || !kern->bf16.gemm_bf16 || kern->bf16.pairs_block > 1 ||
        kern->nr > SDPA_MAX_PANEL)
        return 0;
    if (p->head_dim % 2 || p->head_dim_v % 2) return 0;
    const sdpa_view *kv[2] = {&p->key, &p->value};
    for (int i = 0; i < 2; i++) {
        const sdpa_view *v = kv[i];
        if (v->col_stride != 1 || v->row_stride % 2 || v->head_stride % 2 || ((uintptr_t)v->data & 3)) return 0;
        for (int d = 0; d < p->num_batch_dims; d++)
            if (v->batch_strides[d] % 2) return 0;
    }
    return p->query.col_stride == 1 && g->grad_out.col_stride == 1;
}
#endif

typedef struct FN(bwd_call) {
    const sdpa_problem *p;
    const sdpa_grads *g;
    sdpa_problem mods;   /* *p without softcap: the modifiers after the cap (applied apart) */
    const KT *kern;
    const kernel_table *kt;  /* its set (dropout's bits) */
    uint32_t thr;        /* dropout (sdpa.h): kept where the word >= thr, times keep */
    T keep;
    int nr, nk;          /* panel rows, keys a block */
    int64_t G, hkv, np;  /* heads a group, key/value heads, panels of L */
    int64_t Ep, Evp;     /* E and Ev rounded up to nr */
    int64_t splits;      /* key splits a (batch, head): tasks = batch_count * hkv * splits */
    int pairs;           /* bfloat16: S and dP multiply the stored pairs (bwd_pairs) */
    T *dq;               /* tasks x G x np x E x nr: each task's dQ^T panels */
    int64_t dq_task;     /* elements of dq a task */
    size_t scratch_bytes;
    char *scratch;       /* per thread */
} FN(bwd_call);

/* the rows [lo, hi) that may see some key of [s0, s0 + n) (causality, the window) */
static void FN(bwd_rows_seeing)(const sdpa_problem *p, int64_t s0, int64_t n, int64_t *lo, int64_t *hi) {
    int64_t a = 0, z = p->len_q;
    if (p->causal && s0 - p->causal_offset > a) a = s0 - p->causal_offset;  /* s0 <= l + off */
    if (p->window_right >= 0 && s0 - p->align_offset - p->window_right > a)
        a = s0 - p->align_offset - p->window_right;
    if (p->window_left >= 0 && s0 + n - p->align_offset + p->window_left < z)
        z = s0 + n - p->align_offset + p->window_left;
    *lo = a;
    *hi = z < a ? a : z;
}

/* A thread's scratch in the backward: the group's panels, packed once (Q^T
 * and Q scaled, dO^T, dO; as bfloat16 pairs too for S and dP), the rows' lse
 * and D, a key block's K, V and dK, dV, a tile's S, dP, softcapped S, P
 * dropped and dropout's masks, a row, and (one split) dQ's sums. */
typedef struct FN(bwd_scratch) {
    T *qt, *qr, *ot, *orow, *lse, *dd, *kb, *vb, *dk, *dv, *st, *dp, *sc, *pd, *rowbuf, *dq;
    uint32_t *bits, *qpairs, *opairs;
} FN(bwd_scratch);

/* The regions of one thread's scratch from base (NULL: sized only): its bytes. */
static size_t FN(bwd_layout)(const FN(bwd_call) *c, char *base, FN(bwd_scratch) *s) {
    const sdpa_problem *p = c->p;
    const int64_t E = p->head_dim, Ev = p->head_dim_v, G = c->G, np = c->np, nr = c->nr, nk = c->nk;
    const int64_t panels = G * np * nr, tile = nk * nr;
    const int drop = p->dropout_p > 0;
    size_t at = 0;
    s->qt = (T *)FN(bwd_take)(base, &at, panels * E, sizeof(T));
    s->qr = (T *)FN(bwd_take)(base, &at, panels * c->Ep, sizeof(T));
    s->ot = (T *)FN(bwd_take)(base, &at, panels * Ev, sizeof(T));
    s->orow = (T *)FN(bwd_take)(base, &at, panels * c->Evp, sizeof(T));
    s->lse = (T *)FN(bwd_take)(base, &at, panels, sizeof(T));
    s->dd = (T *)FN(bwd_take)(base, &at, panels, sizeof(T));
    s->kb = (T *)FN(bwd_take)(base, &at, nk * E, sizeof(T));
    s->vb = (T *)FN(bwd_take)(base, &at, nk * Ev, sizeof(T));
    s->dk = (T *)FN(bwd_take)(base, &at, nk * c->Ep, sizeof(T));
    s->dv = (T *)FN(bwd_take)(base, &at, nk * c->Evp, sizeof(T));
    s->st = (T *)FN(bwd_take)(base, &at, tile, sizeof(T));
    s->dp = (T *)FN(bwd_take)(base, &at, tile, sizeof(T));
    s->sc = (T *)FN(bwd_take)(base, &at, tile, sizeof(T));
    s->pd = drop ? (T *)FN(bwd_take)(base, &at, tile, sizeof(T)) : s->st;  /* P dropped, for dV */
    s->bits = drop ? (uint32_t *)FN(bwd_take)(base, &at, tile, sizeof(uint32_t)) : NULL;
    s->rowbuf = (T *)FN(bwd_take)(base, &at, 2 * (E > Ev ? E : Ev), sizeof(T));
    s->dq = c->splits == 1 ? (T *)FN(bwd_take)(base, &at, c->dq_task, sizeof(T)) : NULL;
    s->qpairs = c->pairs ? (uint32_t *)FN(bwd_take)(base, &at, panels * (E / 2), sizeof(uint32_t)) : NULL;
    s->opairs = c->pairs ? (uint32_t *)FN(bwd_take)(base, &at, panels * (Ev / 2), sizeof(uint32_t)) : NULL;
    return at;
}

static void FN(bwd_write_dq)(const FN(bwd_call) *c, int64_t bh, const T *base, T *row);

static void FN(bwd_task)(void *ctx, int64_t t, int tid) {
    FN(bwd_call) *c = (FN(bwd_call) *)ctx;
    const sdpa_problem *p = c->p;
    const sdpa_grads *g = c->g;
    const KT *kern = c->kern;
    const sdpa_dtype dt = p->dtype;
    const size_t de = sdpa_dtype_size(dt), ce = sizeof(T);
    const int nr = c->nr, nk = c->nk;
    const int64_t L = p->len_q, E = p->head_dim, Ev = p->head_dim_v, G = c->G, np = c->np;
    const int64_t Ep = c->Ep, Evp = c->Evp, Lp = np * nr;
    const int64_t split = t % c->splits, bh = t / c->splits, b = bh / c->hkv, hk = bh % c->hkv;
    const int64_t kv_end = key_limit(p, b);
    const T scale = (T)p->scale;
    const T cap = p->softcap > 0 ? FN(softcap_value)(p) : 0;

    FN(bwd_scratch) sb;
    FN(bwd_layout)(c, c->scratch + (size_t)tid * c->scratch_bytes, &sb);
    T *qt = sb.qt, *qr = sb.qr, *ot = sb.ot, *orow = sb.orow, *lse = sb.lse, *dd = sb.dd, *kb = sb.kb, *vb = sb.vb;
    T *dk = sb.dk, *dv = sb.dv, *st = sb.st, *dp = sb.dp, *sc = sb.sc, *pd = sb.pd, *rowbuf = sb.rowbuf;
    uint32_t *bits = sb.bits;
    /* one split: dQ's sums in the thread's scratch, finished here */
    T *dq = c->splits == 1 ? sb.dq : c->dq + t * c->dq_task;
#if HAS_BF16
    /* bfloat16 pairs: the group's Q and dO panels as pairs, for S and dP */
    uint32_t *qpairs = sb.qpairs, *opairs = sb.opairs;
    if (c->pairs) {
        kern->bf16.tiles_begin();
        for (int64_t gi = 0; gi < G; gi++)
            for (int64_t pi = 0; pi < np; pi++) {
                const uint16_t *qrows[SDPA_MAX_PANEL], *orows[SDPA_MAX_PANEL];
                const int rows = (int)(L - pi * nr < nr ? L - pi * nr : nr);
                for (int x = 0; x < rows; x++) {
                    qrows[x] =
                        (const uint16_t *)(const void *)FN(bwd_row)(p, &p->query, b, hk * G + gi, pi * nr + x, 2);
                    orows[x] = (const uint16_t *)(const void *)FN(bwd_row)(p, &g->grad_out, b, hk * G + gi, pi * nr + x,
                                                                          2);
                }
                kern->bf16.pack_q_pairs(qpairs + (gi * np + pi) * (E / 2) * nr, qrows, rows, E / 2);
                kern->bf16.pack_q_pairs(opairs + (gi * np + pi) * (Ev / 2) * nr, orows, rows, Ev / 2);
            }
    }
#endif

    memset(qr, 0, (size_t)(G * np * nr * Ep) * sizeof(T));
    memset(orow, 0, (size_t)(G * np * nr * Evp) * sizeof(T));
    memset(qt, 0, (size_t)(G * np * E * nr) * sizeof(T));
    memset(ot, 0, (size_t)(G * np * Ev * nr) * sizeof(T));
    memset(dq, 0, (size_t)c->dq_task * sizeof(T));
    for (int64_t gi = 0; gi < G; gi++) {
        const int64_t h = hk * G + gi;
        T sink_grad = 0;
        const T sink = p->sinks.data ? FN(head_value)(p, &p->sinks, b, h) : 0;
        for (int64_t l = 0; l < Lp; l++) {
            T *lr = lse + gi * Lp + l, *dr = dd + gi * Lp + l;
            if (l >= L) {  /* past the rows: P = 0 */
                *lr = (T)INFINITY;
                *dr = 0;
                continue;
            }
            const int64_t pi = l / nr, x = l % nr;
            T *q = rowbuf, *o = rowbuf + (E > Ev ? E : Ev);
            FN(convert_rows)(kern, q, FN(bwd_row)(p, &p->query, b, h, l, de), &p->query, dt, 1, E, &no_scales);
            T *qrr = qr + ((gi * np + pi) * nr + x) * Ep, *qtp = qt + (gi * np + pi) * E * nr;
            for (int64_t e = 0; e < E; e++) {
                qrr[e] = scale * q[e];
                qtp[e * nr + x] = scale * q[e];
            }
            FN(convert_rows)(kern, q, FN(bwd_row)(p, &g->grad_out, b, h, l, de), &g->grad_out, dt, 1, Ev, &no_scales);
            FN(convert_rows)(kern, o, FN(bwd_row)(p, &p->out, b, h, l, de), &p->out, dt, 1, Ev, &no_scales);
            T *orr = orow + ((gi * np + pi) * nr + x) * Evp, *otp = ot + (gi * np + pi) * Ev * nr;
            T d = 0;
            for (int64_t e = 0; e < Ev; e++) {
                orr[e] = q[e];
                otp[e * nr + x] = q[e];
                d += q[e] * o[e];
            }
            *dr = d;
            const T m = *(const T *)(const void *)FN(bwd_row)(p, &p->lse, b, h, l, ce);
            *lr = m == -(T)INFINITY ? (T)INFINITY : m;  /* a row that sees nothing: P = 0 */
            if (p->sinks.data && m != -(T)INFINITY) sink_grad -= EXP(sink - m) * d;
        }
        if (split == 0 && p->sinks.data && g->grad_sinks.data)
            *(T *)view_at(p, &g->grad_sinks, b, h, ce) = sink_grad;
    }

    const int edges = p->causal || has_window(p);
    const int64_t kblocks = sdpa_blocks_of(p->len_kv, nk);
    for (int64_t kbi = split; kbi < kblocks; kbi += c->splits) {
        const int64_t s0 = kbi * nk;
        const int n = (int)(p->len_kv - s0 < nk ? p->len_kv - s0 : nk);
        memset(dk, 0, (size_t)(nk * Ep) * sizeof(T));
        memset(dv, 0, (size_t)(nk * Evp) * sizeof(T));
        const int nv = s0 >= kv_end ? 0 : (int)(kv_end - s0 < n ? kv_end - s0 : n);  /* keys seen */
        int64_t lo = 0, hi = 0;
        if (nv > 0) FN(bwd_rows_seeing)(p, s0, nv, &lo, &hi);
        if (hi > lo) {
            FN(convert_rows)(kern, kb, FN(bwd_row)(p, &p->key, b, hk, s0, de), &p->key, dt, nv, E, &no_scales);
            if (!c->pairs)
                FN(convert_rows)(kern, vb, FN(bwd_row)(p, &p->value, b, hk, s0, de), &p->value, dt, nv, Ev, &no_scales);
        }
        for (int64_t gi = 0; gi < G && hi > lo; gi++) {
            const int64_t h = hk * G + gi;
            const void *mask = FN(mask_at)(p, b, h);
            const T slope = p->alibi.data ? FN(head_value)(p, &p->alibi, b, h) : 0;
            for (int64_t pi = lo / nr; pi * nr < hi; pi++) {
                const int64_t r0 = pi * nr;
                const int prows = (int)(L - r0 < nr ? L - r0 : nr);
                const T *qtp = qt + (gi * np + pi) * E * nr, *qrp = qr + (gi * np + pi) * nr * Ep;
                const T *otp = ot + (gi * np + pi) * Ev * nr, *orp = orow + (gi * np + pi) * nr * Evp;
                const T *lr = lse + gi * Lp + r0, *dr = dd + gi * Lp + r0;
                /* S^T = K (scale Q)^T, with the forward's modifiers */
#if HAS_BF16
                if (c->pairs) {  /* the stored pairs, exact products: K where it lies, then the scale */
                    kern->bf16.gemm_bf16(nv, E / 2,
                                         (const uint32_t *)(const void *)FN(bwd_row)(p, &p->key, b, hk, s0, 2),
                                         p->key.row_stride / 2, 1, qpairs + (gi * np + pi) * (E / 2) * nr, nr, st, nr,
                                         0);
                    kern->scale_copy(st, st, (int64_t)nv * nr, scale);
                } else
#endif
                    kern->gemm(nv, E, kb, E, 1, qtp, nr, st, nr, 0);
                if (p->softcap > 0) {
                    kern->softcap(st, (int64_t)nv * nr, cap);
                    memcpy(sc, st, (size_t)nv * (size_t)nr * sizeof(T));
                }
                FN(apply_tile_modifiers)(&c->mods, kern, st, nr, r0, 1, 0, prows, s0, nv, kv_end, mask, edges,
                                         slope, cap);
                kern->bwd_probs(st, nv, nr, lr);  /* P^T */
                /* dP^T = V dO^T, then dS^T = P (dP - D) (times the cap's slope) */
#if HAS_BF16
                if (c->pairs)
                    kern->bf16.gemm_bf16(nv, Ev / 2,
                                         (const uint32_t *)(const void *)FN(bwd_row)(p, &p->value, b, hk, s0, 2),
                                         p->value.row_stride / 2, 1, opairs + (gi * np + pi) * (Ev / 2) * nr, nr, dp,
                                         nr, 0);
                else
#endif
                    kern->gemm(nv, Ev, vb, Ev, 1, otp, nr, dp, nr, 0);
                if (p->dropout_p > 0) {  /* the forward's mask: dV takes P dropped, dP is dropped */
                    FN(drop_tile)(p, c->kt, b, h, r0, nr, s0, nv, bits, st, pd, c->thr, c->keep);
                    FN(drop_apply)(bits, dp, dp, (int64_t)nv * nr, c->keep);
                }
                kern->bwd_dscores(dp, st, nv, nr, dr);
                if (p->softcap > 0) {
                    const T ic = 1 / cap;
                    for (int64_t i = 0; i < (int64_t)nv * nr; i++) {
                        const T y = sc[i] * ic;
                        dp[i] *= 1 - y * y;
                    }
                }
                /* dV += P^T dO, dK += dS^T (scale Q), dQ^T += K^T dS^T */
                for (int64_t e = 0; e < Evp; e += nr) kern->gemm(nv, nr, pd, nr, 1, orp + e, Evp, dv + e, Evp, 1);
                for (int64_t e = 0; e < Ep; e += nr) kern->gemm(nv, nr, dp, nr, 1, qrp + e, Ep, dk + e, Ep, 1);
                kern->gemm((int)E, nv, kb, 1, E, dp, nr, dq + (gi * np + pi) * E * nr, nr, 1);
            }
        }
        for (int j = 0; j < n; j++) {  /* rows past the keys seen: 0 */
            FN(bwd_store)(dt, FN(bwd_row)(p, &g->grad_key, b, hk, s0 + j, de), g->grad_key.col_stride, dk + j * Ep,
                          1, E, 1);
            FN(bwd_store)(dt, FN(bwd_row)(p, &g->grad_value, b, hk, s0 + j, de), g->grad_value.col_stride,
                          dv + j * Evp, 1, Ev, 1);
        }
    }
    if (c->splits == 1) FN(bwd_write_dq)(c, bh, dq, rowbuf);
#if HAS_BF16
    if (c->pairs) kern->bf16.tiles_end();
#endif
}

/* dQ of (b, head group) = scale * the sum of its splits' partials (dQ^T
 * panels from base, one split after another), in order; row: E of scratch */
static void FN(bwd_write_dq)(const FN(bwd_call) *c, int64_t bh, const T *base, T *row) {
    const sdpa_problem *p = c->p;
    const int nr = c->nr;
    const int64_t E = p->head_dim, b = bh / c->hkv, hk = bh % c->hkv;
    const size_t de = sdpa_dtype_size(p->dtype);
    for (int64_t gi = 0; gi < c->G; gi++)
        for (int64_t l = 0; l < p->len_q; l++) {
            const int64_t off = (gi * c->np + l / nr) * E * nr + l % nr;
            for (int64_t e = 0; e < E; e++) row[e] = base[off + e * nr];
            for (int64_t s = 1; s < c->splits; s++) {
                const T *part = base + s * c->dq_task + off;
                for (int64_t e = 0; e < E; e++) row[e] += part[e * nr];
            }
            FN(bwd_store)(p->dtype, FN(bwd_row)(p, &c->g->grad_query, b, hk * c->G + gi, l, de),
                          c->g->grad_query.col_stride, row, 1, E, (T)p->scale);
        }
}

/* the splits' dQ of one (b, head group), after every task */
static void FN(bwd_finish)(void *ctx, int64_t bh, int tid) {
    FN(bwd_call) *c = (FN(bwd_call) *)ctx;
    FN(bwd_write_dq)(c, bh, c->dq + bh * c->splits * c->dq_task,
                     (T *)(void *)(c->scratch + (size_t)tid * c->scratch_bytes));
}

/* The backward of *p (batch_count batch indices) on kern's products: the
 * tasks, then, with key splits, the dQ of each head group. */
static sdpa_status FN(bwd_run)(const sdpa_problem *p, const sdpa_grads *g, const kernel_table *kt, const KT *kern,
                               int64_t batch_count) {
    FN(bwd_call) c;
    memset(&c, 0, sizeof(c));
    c.p = p;
    c.kt = kt;
    FN(drop_constants)(p, &c.thr, &c.keep);
    c.g = g;
    c.mods = *p;
    c.mods.softcap = 0;
    c.kern = kern;
    c.nr = kern->nr;
    c.nk = c.nr * ((64 + c.nr - 1) / c.nr);
    c.G = p->gqa_group;
    c.hkv = p->num_heads / p->gqa_group;
    c.np = sdpa_blocks_of(p->len_q, c.nr);
    c.Ep = sdpa_blocks_of(p->head_dim, c.nr) * c.nr;  /* dK, dV rows of whole panels */
    c.Evp = sdpa_blocks_of(p->head_dim_v, c.nr) * c.nr;
    const int64_t E = p->head_dim, Ev = p->head_dim_v, G = c.G, np = c.np, nr = c.nr, nk = c.nk;
    const int64_t groups = batch_count * c.hkv, kblocks = sdpa_blocks_of(p->len_kv, nk);
    c.dq_task = G * np * E * nr;
    /* splits of the keys when there are few groups (a fixed number: the result
     * must not depend on the threads), bounded by their dQ partials' memory */
    int64_t splits = groups >= 16 ? 1 : (16 + groups - 1) / groups;
    if (splits > kblocks) splits = kblocks > 0 ? kblocks : 1;
    const double part_bytes = (double)groups * (double)c.dq_task * sizeof(T);
    while (splits > 1 && (double)splits * part_bytes > (double)((size_t)256 << 20)) splits--;
    c.splits = splits;
#if HAS_BF16
    c.pairs = FN(bwd_pairs)(p, g, kt, kern);
#endif
    const int64_t tasks = groups * splits;
    FN(bwd_scratch) sized;
    c.scratch_bytes = FN(bwd_layout)(&c, NULL, &sized);
    const double flops = 2.0 * (double)batch_count * (double)p->num_heads * (double)p->len_q *
                         (double)p->len_kv * (double)(3 * E + 2 * Ev);
    const int nthreads = sdpa_threads_for(p->num_threads, 0, tasks, flops);
    /* the threads' scratch kept from call to call (fresh pages cost their zeroing) */
    c.scratch = (char *)sdpa_kept_take(SDPA_KEPT_BACKWARD, (size_t)nthreads * c.scratch_bytes);
    c.dq = splits > 1 ? (T *)sdpa_aligned_block((size_t)tasks * (size_t)c.dq_task * sizeof(T)) : NULL;
    if (!c.scratch || (splits > 1 && !c.dq)) {
        sdpa_aligned_free(c.dq);
        sdpa_kept_give(SDPA_KEPT_BACKWARD, c.scratch);
        return SDPA_ERR_NO_MEMORY;
    }
    sdpa_parallel_for(nthreads, tasks, FN(bwd_task), &c);
    if (splits > 1) sdpa_parallel_for(nthreads, groups, FN(bwd_finish), &c);
    sdpa_aligned_free(c.dq);
    sdpa_kept_give(SDPA_KEPT_BACKWARD, c.scratch);
    return SDPA_OK;
}

/* ---- the forward with dropout: a task is one query panel of one (b, h) ---- */

typedef struct FN(drop_call) {
    const sdpa_problem *p;
    const kernel_table *kt;
    const KT *kern;
    int nr, nk;
    int64_t np;
    uint32_t thr;
    T keep;
    size_t scratch_bytes;
    char *scratch;
} FN(drop_call);

/* A thread's scratch in the forward with dropout: the panel's Q^T, a tile's
 * S, the accumulator, the rows' statistics, a row, a key block's K and V
 * (16-bit), the tile's keep masks. */
typedef struct FN(drop_scratch) {
    T *qt, *st, *acc, *row_max, *row_sum, *row, *kb, *vb;
    uint32_t *bits;
} FN(drop_scratch);

/* The regions of one thread's scratch from base (NULL: sized only): its bytes. */
static size_t FN(drop_layout)(const FN(drop_call) *c, char *base, FN(drop_scratch) *s) {
    const int64_t E = c->p->head_dim, Ev = c->p->head_dim_v, nr = c->nr, nk = c->nk;
    size_t at = 0;
    s->qt = (T *)FN(bwd_take)(base, &at, E * nr, sizeof(T));
    s->st = (T *)FN(bwd_take)(base, &at, nk * nr, sizeof(T));
    s->acc = (T *)FN(bwd_take)(base, &at, Ev * nr, sizeof(T));
    s->row_max = (T *)FN(bwd_take)(base, &at, nr, sizeof(T));
    s->row_sum = (T *)FN(bwd_take)(base, &at, nr, sizeof(T));
    s->row = (T *)FN(bwd_take)(base, &at, E > Ev ? E : Ev, sizeof(T));
    s->kb = (T *)FN(bwd_take)(base, &at, nk * E, sizeof(T));
    s->vb = (T *)FN(bwd_take)(base, &at, nk * Ev, sizeof(T));
    s->bits = (uint32_t *)FN(bwd_take)(base, &at, nk * nr, sizeof(uint32_t));
    return at;
}

static void FN(drop_task)(void *ctx, int64_t t, int tid) {
    FN(drop_call) *c = (FN(drop_call) *)ctx;
    const sdpa_problem *p = c->p;
    const KT *kern = c->kern;
    const sdpa_dtype dt = p->dtype;
    const size_t de = sdpa_dtype_size(dt), ce = sizeof(T);
    const int nr = c->nr, nk = c->nk;
    const int64_t E = p->head_dim, Ev = p->head_dim_v, H = p->num_heads, L = p->len_q;
    const int64_t pi = t % c->np, h = (t / c->np) % H, b = t / (c->np * H), hk = h / p->gqa_group;
    const int64_t r0 = pi * nr, kv_end = key_limit(p, b);
    const int prows = (int)(L - r0 < nr ? L - r0 : nr);
    FN(drop_scratch) sb;
    FN(drop_layout)(c, c->scratch + (size_t)tid * c->scratch_bytes, &sb);
    T *qt = sb.qt, *st = sb.st, *acc = sb.acc, *row_max = sb.row_max, *row_sum = sb.row_sum, *row = sb.row;
    T *kb = sb.kb, *vb = sb.vb;
    uint32_t *bits = sb.bits;
    memset(qt, 0, (size_t)(E * nr) * sizeof(T));
    memset(acc, 0, (size_t)(Ev * nr) * sizeof(T));
    for (int x = 0; x < nr; x++) row_max[x] = -(T)INFINITY, row_sum[x] = 0;
    for (int x = 0; x < prows; x++) {
        FN(convert_rows)(kern, row, FN(bwd_row)(p, &p->query, b, h, r0 + x, de), &p->query, dt, 1, E, &no_scales);
        for (int64_t e = 0; e < E; e++) qt[e * nr + x] = (T)p->scale * row[e];
    }
    /* the keys the panel's rows may see */
    const int64_t last = r0 + prows - 1;
    int64_t lo = 0, hi = kv_end;
    if (p->causal && last + p->causal_offset + 1 < hi) hi = last + p->causal_offset + 1;
    if (p->window_right >= 0 && last + p->align_offset + p->window_right + 1 < hi)
        hi = last + p->align_offset + p->window_right + 1;
    if (p->window_left >= 0 && r0 + p->align_offset - p->window_left > lo) lo = r0 + p->align_offset - p->window_left;
    const void *mask = FN(mask_at)(p, b, h);
    const T slope = p->alibi.data ? FN(head_value)(p, &p->alibi, b, h) : 0;
    const T cap = p->softcap > 0 ? FN(softcap_value)(p) : 0;
    const int edges = p->causal || has_window(p);
    const int in_place = dt == TDT;  /* float keys and values read where they lie */
    for (int64_t s0 = lo; s0 < hi; s0 += nk) {
        const int n = (int)(hi - s0 < nk ? hi - s0 : nk);
        const T *k = kb, *v = vb;
        int64_t k_rs = E, k_cs = 1, v_rs = Ev, v_cs = 1;
        if (in_place) {
            k = (const T *)(const void *)FN(bwd_row)(p, &p->key, b, hk, s0, ce);
            v = (const T *)(const void *)FN(bwd_row)(p, &p->value, b, hk, s0, ce);
            k_rs = p->key.row_stride, k_cs = p->key.col_stride, v_rs = p->value.row_stride, v_cs = p->value.col_stride;
        } else {
            FN(convert_rows)(kern, kb, FN(bwd_row)(p, &p->key, b, hk, s0, de), &p->key, dt, n, E, &no_scales);
            FN(convert_rows)(kern, vb, FN(bwd_row)(p, &p->value, b, hk, s0, de), &p->value, dt, n, Ev, &no_scales);
        }
        kern->gemm(n, E, k, k_rs, k_cs, qt, nr, st, nr, 0);
        FN(apply_tile_modifiers)(p, kern, st, nr, r0, 1, 0, prows, s0, n, kv_end, mask, edges, slope, cap);
        kern->online_softmax_update(st, n, row_max, row_sum, acc, Ev);
        FN(drop_tile)(p, c->kt, b, h, r0, nr, s0, n, bits, st, st, c->thr, c->keep);
        kern->gemm((int)Ev, n, v, v_cs, v_rs, st, nr, acc, nr, 1);
    }
    const T sink = p->sinks.data ? FN(head_value)(p, &p->sinks, b, h) : 0;
    for (int x = 0; x < prows; x++) {
        T m = row_max[x], l = row_sum[x], f = 1;
        if (p->sinks.data && m != -(T)INFINITY) {  /* the sink joins the denominator */
            const T m2 = sink > m ? sink : m;
            f = EXP(m - m2);
            l = l * f + EXP(sink - m2);
            m = m2;
        }
        const int none = m == -(T)INFINITY || l == 0;  /* no key seen: zeros */
        FN(bwd_store)(dt, FN(bwd_row)(p, &p->out, b, h, r0 + x, de), p->out.col_stride, acc + x, nr, Ev,
                      none ? 0 : f / l);
        if (p->lse.data) {
            T *lr = (T *)(void *)FN(bwd_row)(p, &p->lse, b, h, r0 + x, ce);
            *lr = none ? (p->sinks.data ? sink : -(T)INFINITY)
                       : m + (TDT == SDPA_FLOAT64 ? (T)log(l) : (T)logf((float)l));
        }
    }
}

static sdpa_status FN(drop_run)(const sdpa_problem *p, const kernel_table *kt, const KT *kern, int64_t batch_count) {
    FN(drop_call) c;
    memset(&c, 0, sizeof(c));
    c.p = p;
    c.kt = kt;
    c.kern = kern;
    c.nr = kern->nr;
    c.nk = c.nr * ((64 + c.nr - 1) / c.nr);
    c.np = sdpa_blocks_of(p->len_q, c.nr);
    FN(drop_constants)(p, &c.thr, &c.keep);
    const int64_t E = p->head_dim, Ev = p->head_dim_v;
    FN(drop_scratch) sized;
    c.scratch_bytes = FN(drop_layout)(&c, NULL, &sized);
    const int64_t tasks = batch_count * p->num_heads * c.np;
    const double flops = 2.0 * (double)batch_count * (double)p->num_heads * (double)p->len_q * (double)p->len_kv *
                         (double)(E + Ev);
    const int nthreads = sdpa_threads_for(p->num_threads, 0, tasks, flops);
    c.scratch = (char *)sdpa_kept_take(SDPA_KEPT_BACKWARD, (size_t)nthreads * c.scratch_bytes);
    if (!c.scratch) return SDPA_ERR_NO_MEMORY;
    sdpa_parallel_for(nthreads, tasks, FN(drop_task), &c);
    sdpa_kept_give(SDPA_KEPT_BACKWARD, c.scratch);
    return SDPA_OK;
}

#undef FN
#undef CAT
#undef CAT_
