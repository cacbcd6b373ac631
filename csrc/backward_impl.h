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

#include "scores_impl.h"

/* n elements of a row of dtype dt (col stride cs) as T */
static void FN(bwd_load)(const KT *kern, sdpa_dtype dt, const char *src, int64_t cs, T *dst, int64_t n) {
    if (dt == TDT && cs == 1) {
        memcpy(dst, src, (size_t)n * sizeof(T));
        return;
    }
#if TDT == SDPA_FLOAT32
    if ((dt == SDPA_BFLOAT16 || dt == SDPA_FLOAT16) && cs == 1) {
        kern->widen(dt, (const uint16_t *)(const void *)src, dst, n);
        return;
    }
#endif
    (void)kern;
    for (int64_t i = 0; i < n; i++) {
        switch (dt) {
            case SDPA_FLOAT64: dst[i] = (T)((const double *)(const void *)src)[i * cs]; break;
            case SDPA_FLOAT32: dst[i] = (T)((const float *)(const void *)src)[i * cs]; break;
            case SDPA_BFLOAT16: dst[i] = (T)sdpa_bf16_to_f32(((const uint16_t *)(const void *)src)[i * cs]); break;
            default: dst[i] = (T)sdpa_f16_to_f32(((const uint16_t *)(const void *)src)[i * cs]); break;
        }
    }
}

/* dst[i * cs] = f * src[i * ss] in dtype dt (rounded once), i < n */
static void FN(bwd_store)(sdpa_dtype dt, char *dst, int64_t cs, const T *src, int64_t ss, int64_t n, T f) {
    for (int64_t i = 0; i < n; i++) {
        const T x = f * src[i * ss];
        switch (dt) {
            case SDPA_FLOAT64: ((double *)(void *)dst)[i * cs] = (double)x; break;
            case SDPA_FLOAT32: ((float *)(void *)dst)[i * cs] = (float)x; break;
            case SDPA_BFLOAT16: ((uint16_t *)(void *)dst)[i * cs] = sdpa_f32_to_bf16((float)x); break;
            default: ((uint16_t *)(void *)dst)[i * cs] = sdpa_f32_to_f16((float)x); break;
        }
    }
}

/* The address of row r of (b, h) in a view of elements of `elem` bytes. */
static char *FN(bwd_row)(const sdpa_problem *p, const sdpa_view *v, int64_t b, int64_t h, int64_t r, size_t elem) {
    return (char *)view_at(p, v, b, h, elem) + r * v->row_stride * (int64_t)elem;
}

/* n elements of T from *w, which moves on to the next 64-byte boundary */
static T *FN(bwd_take)(char **w, int64_t n) {
    T *r = (T *)(void *)*w;
    *w += ((size_t)n * sizeof(T) + 63) / 64 * 64;
    return r;
}

typedef struct FN(bwd_call) {
    const sdpa_problem *p;
    const sdpa_grads *g;
    sdpa_problem mods;   /* *p without softcap: the modifiers after the cap (applied apart) */
    const KT *kern;
    int nr, nk;          /* panel rows, keys a block */
    int64_t G, hkv, np;  /* heads a group, key/value heads, panels of L */
    int64_t Ep, Evp;     /* E and Ev rounded up to nr */
    int64_t splits;      /* key splits a (batch, head): tasks = batch_count * hkv * splits */
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

    /* scratch: the group's panels, packed once (Q^T and Q scaled, dO^T, dO),
     * the rows' lse and D, a key block's K, V and dK, dV, a tile's S and dP */
    char *w = c->scratch + (size_t)tid * c->scratch_bytes;
    T *qt = FN(bwd_take)(&w, G * np * E * nr);
    T *qr = FN(bwd_take)(&w, G * np * nr * Ep);
    T *ot = FN(bwd_take)(&w, G * np * Ev * nr);
    T *orow = FN(bwd_take)(&w, G * np * nr * Evp);
    T *lse = FN(bwd_take)(&w, G * Lp);
    T *dd = FN(bwd_take)(&w, G * Lp);
    T *kb = FN(bwd_take)(&w, (int64_t)nk * E);
    T *vb = FN(bwd_take)(&w, (int64_t)nk * Ev);
    T *dk = FN(bwd_take)(&w, (int64_t)nk * Ep);
    T *dv = FN(bwd_take)(&w, (int64_t)nk * Evp);
    T *st = FN(bwd_take)(&w, (int64_t)nk * nr);
    T *dp = FN(bwd_take)(&w, (int64_t)nk * nr);
    T *sc = FN(bwd_take)(&w, (int64_t)nk * nr);
    T *rowbuf = FN(bwd_take)(&w, 2 * (E > Ev ? E : Ev));
    /* one split: dQ's sums in the thread's scratch, finished here */
    T *dq = c->splits == 1 ? FN(bwd_take)(&w, c->dq_task) : c->dq + t * c->dq_task;

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
            FN(bwd_load)(kern, dt, FN(bwd_row)(p, &p->query, b, h, l, de), p->query.col_stride, q, E);
            T *qrr = qr + ((gi * np + pi) * nr + x) * Ep, *qtp = qt + (gi * np + pi) * E * nr;
            for (int64_t e = 0; e < E; e++) {
                qrr[e] = scale * q[e];
                qtp[e * nr + x] = scale * q[e];
            }
            FN(bwd_load)(kern, dt, FN(bwd_row)(p, &g->grad_out, b, h, l, de), g->grad_out.col_stride, q, Ev);
            FN(bwd_load)(kern, dt, FN(bwd_row)(p, &p->out, b, h, l, de), p->out.col_stride, o, Ev);
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
            for (int j = 0; j < nv; j++) {
                FN(bwd_load)(kern, dt, FN(bwd_row)(p, &p->key, b, hk, s0 + j, de), p->key.col_stride, kb + j * E, E);
                FN(bwd_load)(kern, dt, FN(bwd_row)(p, &p->value, b, hk, s0 + j, de), p->value.col_stride,
                             vb + j * Ev, Ev);
            }
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
                kern->gemm(nv, E, kb, E, 1, qtp, nr, st, nr, 0);
                if (p->softcap > 0) {
                    kern->softcap(st, (int64_t)nv * nr, cap);
                    memcpy(sc, st, (size_t)nv * (size_t)nr * sizeof(T));
                }
                FN(apply_tile_modifiers)(&c->mods, kern, st, nr, r0, 1, 0, prows, s0, nv, kv_end, mask, edges,
                                         slope, cap);
                for (int j = 0; j < nv; j++)
                    for (int x = 0; x < nr; x++) st[j * nr + x] -= lr[x];
                kern->exp(st, (int64_t)nv * nr);  /* P^T */
                /* dP^T = V dO^T, then dS^T = P (dP - D) (times the cap's slope) */
                kern->gemm(nv, Ev, vb, Ev, 1, otp, nr, dp, nr, 0);
                for (int j = 0; j < nv; j++)
                    for (int x = 0; x < nr; x++) dp[j * nr + x] = st[j * nr + x] * (dp[j * nr + x] - dr[x]);
                if (p->softcap > 0) {
                    const T ic = 1 / cap;
                    for (int64_t i = 0; i < (int64_t)nv * nr; i++) {
                        const T y = sc[i] * ic;
                        dp[i] *= 1 - y * y;
                    }
                }
                /* dV += P^T dO, dK += dS^T (scale Q), dQ^T += K^T dS^T */
                for (int64_t e = 0; e < Evp; e += nr) kern->gemm(nv, nr, st, nr, 1, orp + e, Evp, dv + e, Evp, 1);
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
static sdpa_status FN(bwd_run)(const sdpa_problem *p, const sdpa_grads *g, const KT *kern, int64_t batch_count) {
    FN(bwd_call) c;
    memset(&c, 0, sizeof(c));
    c.p = p;
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
    const int64_t tasks = groups * splits;
    const int64_t buf[] = {G * np * E * nr, G * np * nr * c.Ep, G * np * Ev * nr, G * np * nr * c.Evp,
                           G * np * nr, G * np * nr, nk * E, nk * Ev, nk * c.Ep, nk * c.Evp, nk * nr, nk * nr,
                           nk * nr, 2 * (E > Ev ? E : Ev)};
    c.scratch_bytes = splits == 1 ? ((size_t)c.dq_task * sizeof(T) + 63) / 64 * 64 : 0;
    for (size_t i = 0; i < sizeof(buf) / sizeof(buf[0]); i++)
        c.scratch_bytes += ((size_t)buf[i] * sizeof(T) + 63) / 64 * 64;
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

#undef FN
#undef CAT
#undef CAT_
