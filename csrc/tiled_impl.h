/* The tiled path for one compute type T (included by exec_impl.h).
 *
 * One task = (batch index, unit, block of rows) of a part: a unit is a query
 * head (its rows the positions), or the heads of a GQA group packed (rows
 * position-major, task_coords).  The block is cut into panels of nr rows, kept transposed (Q^T, and the
 * accumulator (P V)^T), so that one vector spans nr query rows.  For each
 * visible key block and panel: scores^T = K (scale Q)^T, the modifiers,
 * online softmax (running max and sum, the accumulator rescaled when the max
 * grows), acc^T += V^T P^T.  The output is acc / sum.  K and V are read in
 * place (by the segments of a tile in each block when paged), converted a
 * tile at a time, or taken from the part's packed buffer.  Tasks are
 * independent and each is computed in a fixed order by one thread, so the
 * result does not depend on the number of threads. */

/* Asks for the cache lines of rows [r0, r0 + n) of a view with contiguous rows
 * of `cols` elements of size elem (for writing when `write`), so that they
 * arrive while the caller computes. */
static void FN(prefetch_rows)(const char *base, const sdpa_view *view, size_t elem, int64_t r0, int64_t n,
                              int64_t cols, int write) {
    if (view->col_stride != 1) return;
    const int64_t bytes = cols * (int64_t)elem;
    for (int64_t x = 0; x < n; x++) {
        const char *row = base + (r0 + x) * view->row_stride * (int64_t)elem;
        for (int64_t o = 0; o < bytes; o += 64) {
            if (write)
                __builtin_prefetch(row + o, 1, 3);
            else
                __builtin_prefetch(row + o, 0, 2);
        }
    }
}

/* The query block and unit of a task of the tiled path.  A unit is a (batch
 * index, query head), or, with the heads of a GQA group packed into the rows
 * (plan.tiled.pack_g = G), a (batch index, key/value head) whose rows are
 * position-major: row r is position r / G of head h0 + r % G.  The tasks of
 * one key/value slice are consecutive, so that its K and V stay in cache from
 * one task to the next: per slice, the query blocks from the last (with
 * causality the longest: the tail of the loop is then the short ones) and, per
 * query block, the units of the slice.  *b, *h0: the batch index and the
 * unit's first query head. */
static void FN(task_coords)(const sdpa_problem *p, const plan *pl, int64_t task, int64_t *qb, int64_t *b,
                            int64_t *h0) {
    const int64_t pg = pl->tiled.pack_g, U = p->gqa_group / pg, per_slice = pl->tiled.num_qblocks * U;
    const int64_t slice = task / per_slice, rem = task % per_slice;
    const int64_t unit = slice * U + rem % U, units = p->num_heads / pg;  /* (b, hkv) -> b * H + hkv * G + member */
    *qb = pl->tiled.num_qblocks - 1 - rem / U;
    *b = unit / units;
    *h0 = unit % units * pg;
}

/* The kernels of a panel of prows rows: the set's narrowest table the rows
 * fit in (a task's last panel, the tail of L) where the plan has narrower ones
 * (plan.path.nr_half, nr_quarter: not for the bfloat16 pairs), else the set's
 * own.  A panel lies in the task's scratch at its first row, laid out at its
 * own width (pk->nr; sdpa_panel_at). */
static inline const KT *FN(panel_kernels)(const plan *pl, const KT *kern, int prows) {
    const int w = sdpa_panel_width(pl, prows);
    while (kern->nr > w && kern->half) kern = kern->half;
    return kern;
}

/* The position of row r of a task's unit (pack_g rows a position). */
static inline int64_t FN(row_position)(const plan *pl, int64_t r) { return r / pl->tiled.pack_g; }

/* ptrs[x] = row r0 + x of a unit (pack_g heads from h0, rows position-major;
 * one head when pack_g is 1) in a view of elem-byte elements, batch index b. */
static void FN(unit_rows)(const sdpa_problem *p, const plan *pl, const sdpa_view *view, int64_t b, int64_t h0,
                          int64_t r0, int n, size_t elem, char **ptrs) {
    const int64_t pg = pl->tiled.pack_g, rs = view->row_stride * (int64_t)elem;
    if (pg == 1) {
        char *base = (char *)view_at(p, view, b, h0, elem) + r0 * rs;
        for (int x = 0; x < n; x++) ptrs[x] = base + x * rs;
        return;
    }
    char *head[SDPA_MAX_PANEL];  /* the group's heads at position 0 */
    char *base = (char *)view_at(p, view, b, h0, elem);
    for (int64_t i = 0; i < pg; i++) head[i] = base + i * view->head_stride * (int64_t)elem;
    int64_t g = r0 % pg, off = r0 / pg * rs;  /* the row's head in the group, its position's offset */
    for (int x = 0; x < n; x++) {
        ptrs[x] = head[g] + off;
        if (++g == pg) {
            g = 0;
            off += rs;
        }
    }
}

/* The weights row of row r of the unit at (b, h0): head h0 + r % pack_g,
 * position r / pack_g. */
static T *FN(weights_row)(const sdpa_problem *p, const plan *pl, int64_t b, int64_t h0, int64_t r) {
    const int64_t pg = pl->tiled.pack_g;
    return (T *)view_at(p, &p->weights, b, h0 + r % pg, sizeof(T)) + r / pg * p->weights.row_stride;
}

/* The prows rows from row r0 of the unit at (b, h0), scaled, as a panel of Q^T
 * (E x nr, nr the width of kern's panels): a kernel reads rows of contiguous
 * elements from their pointers, strided ones are read element by element. */
static void FN(pack_panel)(const sdpa_problem *p, const plan *pl, const KT *kern, T *panel, int64_t b, int64_t h0,
                           int64_t r0, int prows) {
    const int nr = kern->nr;
    const int64_t E = p->head_dim, cs = p->query.col_stride;
    const sdpa_dtype qdt = p->dtype;
    const size_t qe = sdpa_dtype_size(qdt);
    const T scale = (T)p->scale;
    char *rows[SDPA_MAX_PANEL];
    FN(unit_rows)(p, pl, &p->query, b, h0, r0, prows, qe, rows);
    if (cs == 1 && qdt == TDT) {
        kern->pack_q(panel, nr, (const T *const *)rows, prows, E, scale);
    } else if (cs == 1) {  /* 16-bit, widened */
        kern->pack_q_half(qdt, panel, nr, (const uint16_t *const *)rows, prows, E, scale);
    } else {
        for (int64_t c = 0; c < E; c++) {
            T *pc = panel + c * nr;
            for (int x = 0; x < prows; x++) pc[x] = scale * FN(load)(rows[x], c * cs, qdt);
            for (int x = prows; x < nr; x++) pc[x] = 0;
        }
    }
}

/* Piece `piece` of `pieces` of what work item `item` reads first, its query
 * rows and first key and value tile: asked for while an earlier task
 * computes, so that a run of short tasks (few keys each) does not wait on
 * memory at each start.  The item a thread takes next is about its last one
 * plus the threads (the loop is dynamic). */
static void FN(prefetch_task)(const call_plan *cp, int64_t item, int piece, int pieces) {
    if (item >= cp->item_start[cp->num_parts]) return;
    int64_t task;
    const part *pt = plan_item(cp, item, &task);
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    if (pl->path.row_mode) return;
    int64_t qb, b, h;
    FN(task_coords)(p, pl, task, &qb, &b, &h);
    const int64_t hkv = h / p->gqa_group, R = p->len_q * pl->tiled.pack_g;
    const size_t qe = sdpa_dtype_size(p->dtype), kve = sdpa_dtype_size(pl->path.kv_dtype);
    int64_t l0, rows;
    sdpa_task_rows(p, pl, qb, R, &l0, &rows);
    const int64_t S_b = key_limit(p, b);
    const int64_t keys = S_b < pl->blocking.tile_k ? S_b : pl->blocking.tile_k;
    const int64_t q0 = rows * piece / pieces, q1 = rows * (piece + 1) / pieces;
    const int64_t k0 = keys * piece / pieces, k1 = keys * (piece + 1) / pieces;
    if (p->query.col_stride == 1) {
        const int64_t bytes = p->head_dim * (int64_t)qe;
        for (int64_t r = l0 + q0; r < l0 + q1; r += SDPA_MAX_PANEL) {
            char *ptrs[SDPA_MAX_PANEL];
            const int n = (int)(l0 + q1 - r < SDPA_MAX_PANEL ? l0 + q1 - r : SDPA_MAX_PANEL);
            FN(unit_rows)(p, pl, &p->query, b, h, r, n, qe, ptrs);
            for (int x = 0; x < n; x++)
                for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(ptrs[x] + o, 0, 2);
        }
    }
    if (p->block_size > 0) return;  /* paged: the first block's rows would need its table */
    FN(prefetch_rows)((const char *)view_at(p, &p->key, b, hkv, kve), &p->key, kve, k0, k1 - k0, p->head_dim, 0);
    FN(prefetch_rows)((const char *)view_at(p, &p->value, b, hkv, kve), &p->value, kve, k0, k1 - k0,
                      p->head_dim_v, 0);
}

#if HAS_BF16
/* Panel pn of a task's rows as bfloat16 pairs, [E2p][nr], unscaled (the
 * scale is applied to the float scores: rounding a scaled query to bfloat16
 * would add error); the pairs past E's are zeros. */
static void bf16_pack_panel(const sdpa_problem *p, const plan *pl, const kernels_f32 *kern, uint32_t *panel,
                            int64_t b, int64_t h0, int64_t l0, int pn, int prows, int64_t E2p) {
    const int64_t E = p->head_dim, E2 = (E + 1) / 2, cs = p->query.col_stride;
    const int nr = kern->nr;
    char *rows[SDPA_MAX_PANEL];
    FN(unit_rows)(p, pl, &p->query, b, h0, l0 + (int64_t)pn * nr, prows, 2, rows);
    memset(panel + E2 * nr, 0, (size_t)(E2p - E2) * nr * 4);  /* pairs padded to whole tiles: zeros */
    if (E % 2 == 0 && cs == 1) {
        kern->bf16.pack_q_pairs(panel, (const uint16_t *const *)rows, prows, E2);
        return;
    }
    for (int64_t pr = 0; pr < E2; pr++) {
        uint32_t *pc = panel + pr * nr;
        for (int x = 0; x < prows; x++) {
            const uint16_t *qr = (const uint16_t *)(const void *)rows[x];
            pc[x] = bf16_pair(qr[2 * pr * cs], 2 * pr + 1 < E ? qr[(2 * pr + 1) * cs] : 0);
        }
        for (int x = prows; x < nr; x++) pc[x] = 0;
    }
}

/* acc (P V)^T += the products of the nk keys' P pairs (pp) and V pairs (a at
 * v_rs, v_ks).  With an odd nk the last pair's second key is one the panel
 * does not see (past its causal limit, its window or the keys): its P is 0,
 * but its V may be inf or NaN, and 0 x NaN is NaN.  So the pairs from the last
 * whole block of 16 on go through a copy (vtail, [Ev][16]) whose last pair's
 * second value is 0; the products are summed in the same order as in one call. */
static void FN(pv_pairs)(const kernels_f32 *kern, int Ev, int nk, const uint32_t *v, int64_t v_rs, int64_t v_ks,
                         const uint32_t *pp, int nr, float *acc, uint32_t *vtail) {
    const int64_t kp = (nk + 1) / 2;
    if (nk % 2 == 0) {
        kern->bf16.gemm_bf16(Ev, kp, v, v_rs, v_ks, pp, nr, acc, nr, 1);
        return;
    }
    const int64_t head = (kp - 1) / 16 * 16, rest = kp - head;
    if (head) kern->bf16.gemm_bf16(Ev, head, v, v_rs, v_ks, pp, nr, acc, nr, 1);
    for (int c = 0; c < Ev; c++)
        for (int64_t q = 0; q < rest; q++) {
            const uint32_t w = v[c * v_rs + (head + q) * v_ks];
            vtail[c * 16 + q] = q == rest - 1 ? (w & 0xFFFFu) : w;
        }
    kern->bf16.gemm_bf16(Ev, rest, vtail, 16, 1, pp + head * nr, nr, acc, nr, 1);
}
#endif

/* A task's rows [l0, l0 + rows) of the unit at (b, h0) finished: their lse
 * (with the sink joining the denominator), output rows (acc / l, stored a
 * panel at a time through their pointers) and weights. */
static void FN(finish_rows)(const sdpa_problem *p, const plan *pl, const KT *kern, int64_t b, int64_t h0, int64_t l0,
                            int rows, T *acc, T *row_m, T *row_l, int64_t S_b) {
    const int64_t Ev = p->head_dim_v, pg = pl->tiled.pack_g, oc = p->out.col_stride;
    const sdpa_dtype odt = pl->path.out_dtype;
    const size_t oe = sdpa_dtype_size(odt);
    for (int x = 0; x < rows; x++) {
        const int64_t r = l0 + x, h = h0 + r % pg, pos = r / pg;
        const T *sink = p->sinks.data ? (const T *)view_at(p, &p->sinks, b, h, sizeof(T)) : NULL;
        if (sink && *sink == -(T)INFINITY) sink = NULL;  /* no sink: the same bits as without */
        const T l = row_l[x], m = row_m[x];
        if (p->lse.data)
            ((T *)view_at(p, &p->lse, b, h, sizeof(T)))[pos * p->lse.row_stride] =
                sink ? FN(log_sum_exp_sink)(m, l, *sink) : FN(log_sum_exp)(m, l);
        if (sink && l != 0) row_l[x] = l + EXP(*sink - m);  /* the sink joins the denominator */
    }
    for (int pn = 0, panels = sdpa_panel_count(pl, rows); pn < panels; pn++) {
        int prows;
        const int x0 = sdpa_panel_at(pl, rows, pn, &prows);
        const KT *pk = FN(panel_kernels)(pl, kern, prows);
        const int pnr = pk->nr;
        const T *pacc = acc + (int64_t)x0 * Ev;
        char *out[SDPA_MAX_PANEL];
        FN(unit_rows)(p, pl, &p->out, b, h0, l0 + x0, prows, oe, out);
        if (oc == 1 && odt == TDT) {
            pk->store_rows((T *const *)out, pacc, pnr, row_l + x0, prows, Ev);
        } else if (oc == 1) {
            pk->store_rows_half(odt, (uint16_t *const *)out, pacc, pnr, row_l + x0, prows, Ev);
        } else {  /* strided: element by element, the same values */
            for (int x = 0; x < prows; x++) {
                const T l = row_l[x0 + x], inv = l == 0 ? 0 : 1 / l;
                /* a row with no visible key gives zeros (even if a V row it multiplied
                 * by a zero weight held NaN); NaN in l passes through */
                for (int64_t c = 0; c < Ev; c++) FN(store)(out[x], c * oc, odt, l == 0 ? 0 : pacc[c * pnr + x] * inv);
            }
        }
    }
    if (p->weights.data)
        for (int x = 0; x < rows; x++)
            FN(normalize_weights)(p, FN(weights_row)(p, pl, b, h0, l0 + x), (l0 + x) / pg, S_b, row_m[x], row_l[x]);
}

/* Phase timers of the tiled path (sdpa_profile_*): a task adds the time since
 * its last mark to a phase, when the call is profiled. */
#define PROF_MARK(ph)                                  \
    do {                                               \
        if (prof) {                                    \
            const uint64_t t_ = prof_ticks();          \
            prof[ph] += t_ - prof_t;                   \
            prof_t = t_;                               \
        }                                              \
    } while (0)

static void FN(run_task)(const call_plan *cp, int64_t item, const part *pt, const KT *kern, T *scratch,
                         const T *packed, int64_t task, interrupt_state *irq, int tid, uint64_t *prof) {
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    const int64_t H = p->num_heads, L = p->len_q;
    const int64_t E = p->head_dim, Ev = p->head_dim_v;
    const int tile_k = pl->blocking.tile_k, nr = pl->path.nr;
    uint64_t prof_t = prof ? prof_ticks() : 0;

    int64_t qb, b, h;
    FN(task_coords)(p, pl, task, &qb, &b, &h);
    const int64_t hkv = h / p->gqa_group;
    /* the unit's rows: pg a position (a packed GQA group's heads), R in all */
    const int64_t pg = pl->tiled.pack_g, R = L * pg;
    /* paged: float K and V of the compute type are read in place, by the
     * segments of a tile in each block as the products read them; other K/V are
     * widened or paired by segments too (K pairs never in place) */
    const int paged = p->block_size > 0;
    const sdpa_dtype qdt = p->dtype, kvdt = pl->path.kv_dtype, odt = pl->path.out_dtype;
    const char *q = (const char *)view_at(p, &p->query, b, h, sdpa_dtype_size(qdt));
    const kv_source ksrc = kv_source_of(p, 0, kvdt, b, hkv, E), vsrc = kv_source_of(p, 1, kvdt, b, hkv, Ev);
    const char *k = ksrc.base, *v = vsrc.base;
    const void *mask = FN(mask_at)(p, b, h);
    T *weights = p->weights.data ? (T *)view_at(p, &p->weights, b, h, sizeof(T)) : NULL;
    /* this task's key/value slice in the part's packed buffer */
    const T *slice = packed ? packed + (b * (H / p->gqa_group) + hkv) * (int64_t)pl->pack.slice_elems : NULL;
#if HAS_BF16
    const int bf16 = pl->bf16.on;  /* bfloat16 pairs and gemm_bf16 (float instance only) */
#endif
    /* float K and V: in place (T elements), from the packed buffer, or converted
     * (or, paged, copied) a tile at a time (make_plan) */
    const int convert_kv = pl->path.convert_kv;
    const int64_t ksr = convert_kv ? E : p->key.row_stride, ksc = convert_kv ? 1 : p->key.col_stride;
    const int64_t vsr = convert_kv ? Ev : p->value.row_stride, vsc = convert_kv ? 1 : p->value.col_stride;
    const int paged_products = paged && !slice && !convert_kv;  /* the products read the blocks */
    T *kbuf = scratch + pl->scratch.k;   /* a K tile as T, tile_k x E (convert_kv, not packed) */
    T *vbuf = scratch + pl->scratch.v;   /* a V tile as T, tile_k x Ev                         */

    T *qt = scratch + pl->scratch.q;     /* panels of Q^T, each E x nr, scaled (bf16: E2 x nr pairs) */
    T *acc = scratch + pl->scratch.acc;  /* panels of (P V)^T, each Ev x nr      */
    T *st = scratch + pl->scratch.s;     /* one score tile, keys x nr            */
    T *row_m = scratch + pl->scratch.m;
    T *row_l = scratch + pl->scratch.l;
#if HAS_BF16
    const T scale = (T)p->scale;
    const int64_t E2 = pl->bf16.e2p;  /* pairs of a K row and a panel column block, padded to whole tiles */
    const int64_t qpanel = bf16 ? E2 : E;  /* elements of a panel column block */
    uint32_t *pp = (uint32_t *)(scratch + pl->scratch.pp);  /* P^T pairs, [tile_k / 2][nr] */
    uint32_t *vp = (uint32_t *)(scratch + pl->scratch.vp);  /* V pairs of a tile, when not packed */
    uint32_t *kp = (uint32_t *)(scratch + pl->scratch.k);   /* K pairs of a tile when not in place, [tile_k][E2] */
    uint32_t *vtail = (uint32_t *)(scratch + pl->scratch.vt);  /* the last V pairs of an odd key count, [Ev][16] */
    /* K read in place when its rows are whole pairs, 32-bit aligned */
    const int k_in_place = paged ? 2 * E2 == E && paged_pairs_in_place(p)
                                 : E % 2 == 0 && 2 * E2 == E && p->key.col_stride == 1 &&
                                       p->key.row_stride % 2 == 0 && ((uintptr_t)k & 3) == 0;
    /* feature c's pair p at vbase[c * vp_rs + p * vp_ks]: P V's a, in its kernel's layout */
    const int byf = bf16 && kern->bf16.values_by_feature;
    const int64_t vp_ld = slice ? (byf ? pl->bf16.vp_ld : Ev) : (byf ? (tile_k + 1) / 2 : Ev);
    const int64_t vp_rs = byf ? vp_ld : 1, vp_ks = byf ? 1 : Ev;
    /* the scale folded into the softmax: it must come before a softcap, ALiBi, an
     * additive mask or raw weights, and a bool mask, causality and windows put
     * -inf, which any scale > 0 keeps */
    const int fold = bf16 && scale > 0 && scale < (T)INFINITY && p->softcap == 0 && !p->alibi.data &&
                     p->mask_kind != SDPA_MASK_ADDITIVE && !weights;
#else
    const int64_t qpanel = E;
#endif

    int64_t l0, task_rows;  /* the task's first row, and its rows */
    sdpa_task_rows(p, pl, qb, R, &l0, &task_rows);
    if (task_rows == 0) return;  /* past the rows of the last query block of a map */
    const int rows = (int)task_rows;
    const int panels = sdpa_panel_count(pl, rows), room = (rows + nr - 1) / nr * nr;  /* rows of scratch */
    const int64_t pos_first = FN(row_position)(pl, l0), pos_last = FN(row_position)(pl, l0 + rows - 1);

    for (int x = 0; x < room; x++) {
        row_m[x] = -(T)INFINITY;
        row_l[x] = 0;
    }
    for (int64_t x = 0; x < (int64_t)room * Ev; x++) acc[x] = 0;

    /* keys past kv_end are masked for every row of the task: never visited */
    const int64_t S_b = key_limit(p, b);
    int64_t kv_end = S_b;
    if (p->causal) {
        int64_t last = pos_last + 1 + p->causal_offset;  /* exclusive */
        kv_end = last < 0 ? 0 : (last < S_b ? last : S_b);
    }
    /* keys a window shows no row of the task are never visited either; the
     * tiles stay on the grid of tile_k keys */
    const int win = has_window(p);
    int64_t kv_begin = 0;
    if (win) {
        const int64_t we = window_end(p, pos_last);
        if (we < kv_end) kv_end = we;
        kv_begin = window_first(p, pos_first) / tile_k * tile_k;
    }
    const T slope = p->alibi.data ? FN(head_value)(p, &p->alibi, b, h) : 0;
    const T cap = FN(softcap_value)(p);
    const int rows_vec = p->out.col_stride == 1;
    int packed_q = 0;  /* panels of Q packed so far */
    int64_t scores = 0;  /* computed, for the profile */
    /* the keys are visited as runs (key_runs): [kv_begin, kv_end), or with a
     * block map each run of the task's query block's blocks (a full block's
     * keys however causality, the window or a bool mask would hide them, a
     * partial one's within [kv_begin, kv_end)), tile by tile from its start */
    key_runs kr = key_runs_start(p, pl->tiled.qb_tasks ? block_states_row(p, b, h, qb / pl->tiled.qb_tasks) : NULL,
                                 S_b, kv_begin, kv_end);

#if HAS_BF16
    unsigned callbacks = tid == 0 ? irq->callbacks : 0;
#endif
    for (int64_t s0 = kr.lo; s0 < kr.hi; s0 = key_runs_next(&kr, s0, tile_k)) {
        const int64_t key_end = kr.full ? kr.hi : kv_end;  /* keys from here on hidden (read element by element) */
        if (should_stop(irq, tid)) return;  /* the output is unspecified then */
#if HAS_BF16
        if (bf16 && tid == 0 && irq->callbacks != callbacks) {
            /* the interrupt callback ran (Python code: it may have used the tiles) */
            callbacks = irq->callbacks;
            kern->bf16.tiles_begin();
        }
#endif
        const int n = (int)(kr.hi - s0 < tile_k ? kr.hi - s0 : tile_k);
        const T *kt = paged ? NULL : (const T *)k + s0 * ksr, *vt = paged ? NULL : (const T *)v + s0 * vsr;
#if HAS_BF16
        const uint32_t *kpt = NULL, *vpt = NULL;
        int64_t k_rs = E2;
        if (bf16) {
            if (slice && pl->pack.slice_k) {  /* packed for the call */
                kpt = (const uint32_t *)slice + s0 * E2;
            } else if (k_in_place) {  /* paged: by block segments in the product */
                kpt = paged ? NULL : (const uint32_t *)((const uint16_t *)k + s0 * p->key.row_stride);
                k_rs = p->key.row_stride / 2;
            } else {
                bf16_pack_key_range(kp, E2, &ksrc, s0, n, E);
                kpt = kp;
            }
            if (slice) {
                vpt = (const uint32_t *)slice + pl->pack.slice_k + (byf ? s0 / 2 : s0 / 2 * Ev);
            } else {
                bf16_pack_value_range(kern, vp, vp_ld, &vsrc, s0, n, Ev);
                vpt = vp;
            }
        } else
#endif
        if (slice) {  /* converted once for the call */
            kt = slice + s0 * E;
            vt = slice + pl->pack.slice_k + s0 * Ev;
        } else if (convert_kv) {  /* once per tile, for every panel */
            FN(convert_range)(kern, kbuf, &ksrc, kvdt, s0, n, E);
            FN(convert_range)(kern, vbuf, &vsrc, kvdt, s0, n, Ev);
            kt = kbuf, vt = vbuf;
        }
        PROF_MARK(PH_PACK);
        for (int pn = 0; pn < panels; pn++) {
            int prows;
            const int x0 = sdpa_panel_at(pl, rows, pn, &prows);  /* the panel's first row in the task */
            const int64_t r0 = l0 + x0;
            const KT *pk = FN(panel_kernels)(pl, kern, prows);  /* the panel's kernels and width */
            const int pnr = pk->nr;
            /* the panel's first and last positions, and its first row's place in its position */
            const int64_t p0 = FN(row_position)(pl, r0), p1 = FN(row_position)(pl, r0 + prows - 1);
            const int phase = (int)(r0 % pg);
            int np = n;
            if (p->causal && !kr.full) {  /* the panel's last row sees keys < lim */
                int64_t lim = p1 + 1 + p->causal_offset;
                if (lim <= s0) continue;
                if (lim - s0 < np) np = (int)(lim - s0);
            }
            int win_edge = 0, j0 = 0;  /* the panel computes keys [s0 + j0, s0 + np) of the tile */
            if (win && !kr.full) {  /* the panel's window: keys [first of its first row, end of its last) */
                const int64_t pf = window_first(p, p0), pe = window_end(p, p1);
                if (s0 >= pe || s0 + np <= pf) continue;
                if (pe - s0 < np) np = (int)(pe - s0);
                if (pf > s0) j0 = (int)((pf - s0) / 16 * 16);  /* from the window's start, in steps of 16 keys */
                win_edge = !(s0 + j0 >= window_first(p, p1) && s0 + np <= window_end(p, p0));
            }
            const int64_t sp = s0 + j0;  /* the panel's first key, and its number of keys */
            const int nk = np - j0;
            T *pmax = row_m + x0, *psum = row_l + x0;
            T *pacc = acc + (int64_t)x0 * Ev;
            const void *tile_mask = kr.full && p->mask_kind == SDPA_MASK_BOOL ? NULL : mask;
            if (tile_mask) {
                const int cls = FN(mask_tile_class)(p, mask, r0, prows, sp, nk);
                if (cls == TILE_NONE_VISIBLE) {  /* adds nothing to any row */
                    if (weights) FN(hide_in_weights)(p, weights, r0, prows, sp, nk);
                    continue;
                }
                if (cls == TILE_ALL_VISIBLE) tile_mask = NULL;
            }

            if (pn >= packed_q) {  /* Q is packed a panel at a time, the next one on its way */
                for (; packed_q <= pn; packed_q++) {
                    int gn;
                    const int gx = sdpa_panel_at(pl, rows, packed_q, &gn);
                    T *panel = qt + (int64_t)gx * qpanel;
                    const int64_t g0 = l0 + gx;
#if HAS_BF16
                    if (bf16) {
                        bf16_pack_panel(p, pl, kern, (uint32_t *)panel, b, h, l0, packed_q, gn, E2);
                        continue;
                    }
#endif
                    FN(pack_panel)(p, pl, FN(panel_kernels)(pl, kern, gn), panel, b, h, g0, gn);
                }
                if (packed_q < panels && pg == 1) {
                    int nn;
                    const int64_t rn = l0 + sdpa_panel_at(pl, rows, packed_q, &nn);
                    FN(prefetch_rows)(q, &p->query, sdpa_dtype_size(qdt), rn, nn, E, 0);
                }
                PROF_MARK(PH_PACK);
            }
            if (mask) {  /* the next panel's mask, or the next tile's first */
                int nn;
                const int64_t rn = l0 + sdpa_panel_at(pl, rows, pn + 1 < panels ? pn + 1 : 0, &nn);
                const int64_t sn = pn + 1 < panels ? s0 : s0 + tile_k;
                const int64_t kn = kr.hi - sn < tile_k ? kr.hi - sn : tile_k;
                FN(prefetch_mask)(p, mask, rn, nn, sn, kn);
            }
            if (s0 + tile_k >= kr.hi) {  /* the last tile (of a run): this panel's output rows and the next task */
                if (rows_vec) {  /* the panel's output rows, for writing */
                    char *orows[SDPA_MAX_PANEL];
                    const int64_t bytes = Ev * (int64_t)sdpa_dtype_size(odt);
                    FN(unit_rows)(p, pl, &p->out, b, h, r0, prows, sdpa_dtype_size(odt), orows);
                    for (int x = 0; x < prows; x++)
                        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(orows[x] + o, 1, 3);
                }
                /* (a packed group's next task: its rows are many short streams, and measured no faster) */
                if (pg == 1) FN(prefetch_task)(cp, item + cp->num_threads, pn, panels);
            }
#if HAS_BF16
            if (bf16) {
                const uint32_t *qp = (const uint32_t *)qt + (int64_t)x0 * E2;
                if (!kpt) {  /* paged keys in place, segment by segment */
                    kv_cursor cur = kv_walk(&ksrc, sp, sp + nk);
                    const char *ka;
                    kv_scales none;
                    for (int64_t a = sp, m; (m = kv_next(&ksrc, &cur, &ka, &none, 0)) > 0; a += m)
                        kern->bf16.gemm_bf16((int)m, E2, (const uint32_t *)ka, k_rs, 1, qp, nr, st + (a - sp) * nr,
                                             nr, 0);
                } else {
                    kern->bf16.gemm_bf16(nk, E2, kpt + j0 * k_rs, k_rs, 1, qp, nr, st, nr, 0);
                }
                PROF_MARK(PH_QK);
                if (!fold) {  /* the scaled scores, for what comes next */
                    kern->scale_copy(st, st, (int64_t)nk * nr, scale);
                }
            } else
#endif
            if (paged_products) {
                kv_cursor cur = kv_walk(&ksrc, sp, sp + nk);
                const char *ka;
                kv_scales none;
                for (int64_t a = sp, m; (m = kv_next(&ksrc, &cur, &ka, &none, 0)) > 0; a += m)
                    pk->gemm((int)m, E, (const T *)ka, ksr, ksc, qt + (int64_t)x0 * E, pnr, st + (a - sp) * pnr,
                             pnr, 0);
                PROF_MARK(PH_QK);
            } else {
                pk->gemm(nk, E, kt + j0 * ksr, ksr, ksc, qt + (int64_t)x0 * E, pnr, st, pnr, 0);
                PROF_MARK(PH_QK);
            }
            const int diagonal = p->causal && !kr.full && sp + nk - 1 > p0 + p->causal_offset;
            FN(apply_tile_modifiers)(p, pk, st, pnr, p0, (int)pg, phase, prows, sp, nk, key_end, tile_mask,
                                     diagonal || win_edge, slope, cap);
            if (weights)
                for (int x = 0; x < prows; x++)
                    FN(store_raw_scores)(p, FN(weights_row)(p, pl, b, h, r0 + x), st + x, pnr, sp, nk);
            PROF_MARK(PH_MASK);
            scores += (int64_t)nk * prows;

#if HAS_BF16
            if (bf16) {
                kern->bf16.online_softmax_pairs(st, nk, fold ? scale : 1, pmax, psum, pacc, Ev, pp);
                PROF_MARK(PH_SOFTMAX);
                FN(pv_pairs)(kern, (int)Ev, nk, vpt + (byf ? j0 / 2 : j0 / 2 * Ev), vp_rs, vp_ks, pp, nr, pacc,
                             vtail);
                PROF_MARK(PH_PV);
                continue;
            }
#endif
            pk->online_softmax_update(st, nk, pmax, psum, pacc, Ev);
            PROF_MARK(PH_SOFTMAX);
            if (paged_products) {
                kv_cursor cur = kv_walk(&vsrc, sp, sp + nk);
                const char *va;
                kv_scales none;
                for (int64_t a = sp, m; (m = kv_next(&vsrc, &cur, &va, &none, 0)) > 0; a += m)
                    pk->gemm((int)Ev, (int)m, (const T *)va, vsc, vsr, st + (a - sp) * pnr, pnr, pacc, pnr, 1);
            } else {
                pk->gemm((int)Ev, nk, vt + j0 * vsr, vsc, vsr, st, pnr, pacc, pnr, 1);
            }
            PROF_MARK(PH_PV);
        }
    }

    FN(finish_rows)(p, pl, kern, b, h, l0, rows, acc, row_m, row_l, S_b);
    PROF_MARK(PH_EPILOGUE);
    if (prof) prof[PH_SCORES] += (uint64_t)scores;
}
#undef PROF_MARK
