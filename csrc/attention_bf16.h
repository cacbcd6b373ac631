/*
 * The tiled task of a bfloat16 problem (bfloat16 query, key and value) on a
 * kernel set with bfloat16 dot products (gemm_bf16).  Included by
 * attention_impl.h in its float instance.
 *
 * The same tiling as run_task: scores transposed (keys x nr query rows), an
 * online softmax in float per panel.  The products are bfloat16 x bfloat16
 * summed in float, so both operands are kept as pairs of bfloat16 in 32 bits:
 *   Q K^T: K pairs along E are read in place (a K row is E/2 pairs) against the
 *          query panel packed once per task as [E/2][nr] pairs, unscaled (the
 *          scale is applied to the float scores, so that rounding the scaled
 *          query to bfloat16 adds no error);
 *   P V:   P rounded to bfloat16 and paired along the keys per panel, against
 *          the V tile packed once per key tile as [keys/2][Ev] pairs, or as
 *          [Ev][tile_k/2] where the kernel set asks for it (AMX tiles load
 *          rows of pairs in place).
 */

/* (lo, hi) in one 32-bit pair, lo in the low half */
static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* Rows [s0, s0 + n) of a bfloat16 key view as pairs along E: dst[j][p] for
 * p < ceil(E/2), an odd E padded with zero. */
static void bf16_pack_rows(uint32_t *dst, const uint16_t *base, const sdpa_view *view, int64_t s0, int n, int64_t E) {
    const int64_t E2 = (E + 1) / 2;
    for (int j = 0; j < n; j++) {
        const uint16_t *row = base + (s0 + j) * view->row_stride;
        uint32_t *d = dst + (int64_t)j * E2;
        for (int64_t p = 0; p < E2; p++) {
            const uint16_t lo = row[2 * p * view->col_stride];
            const uint16_t hi = 2 * p + 1 < E ? row[(2 * p + 1) * view->col_stride] : 0;
            d[p] = bf16_pair(lo, hi);
        }
    }
}

/* Rows [s0, s0 + n) of a bfloat16 value view as pairs along the keys:
 * dst[p][c] = (V[s0 + 2p][c], V[s0 + 2p + 1][c]), the row past an odd n zero. */
static void bf16_pack_value_pairs(uint32_t *dst, const uint16_t *base, const sdpa_view *view, int64_t s0, int n,
                                  int64_t Ev) {
    const int64_t rs = view->row_stride, cs = view->col_stride;
    for (int p = 0; 2 * p < n; p++) {
        const uint16_t *r0 = base + (s0 + 2 * p) * rs;
        uint32_t *d = dst + (int64_t)p * Ev;
        if (2 * p + 1 < n) {
            const uint16_t *r1 = r0 + rs;
            for (int64_t c = 0; c < Ev; c++) d[c] = bf16_pair(r0[c * cs], r1[c * cs]);
        } else {
            for (int64_t c = 0; c < Ev; c++) d[c] = bf16_pair(r0[c * cs], 0);
        }
    }
}

/* The same pairs feature by feature: dst[c * ld + p], ld >= ceil(n/2).  V is
 * read along its rows; the writes of one pair of rows fall in Ev lines that
 * the next pairs fill further. */
static void bf16_pack_value_pairs_by_feature(uint32_t *dst, int64_t ld, const uint16_t *base, const sdpa_view *view,
                                             int64_t s0, int n, int64_t Ev) {
    const int64_t rs = view->row_stride, cs = view->col_stride;
    for (int p = 0; 2 * p < n; p++) {
        const uint16_t *r0 = base + (s0 + 2 * p) * rs;
        if (2 * p + 1 < n) {
            const uint16_t *r1 = r0 + rs;
            for (int64_t c = 0; c < Ev; c++) dst[c * ld + p] = bf16_pair(r0[c * cs], r1[c * cs]);
        } else {
            for (int64_t c = 0; c < Ev; c++) dst[c * ld + p] = bf16_pair(r0[c * cs], 0);
        }
    }
}

static void run_task_bf16(const sdpa_problem *p, const plan *pl, const kernels_f32 *kern, float *scratch,
                          int64_t task, interrupt_state *irq, int tid) {
    const int64_t H = p->num_heads, L = p->len_q;
    const int64_t E = p->head_dim, Ev = p->head_dim_v, E2 = (E + 1) / 2;
    const int tile_q = pl->tile_q, tile_k = pl->tile_k, nr = pl->nr;

    int64_t qb, bh;
    if (p->causal) {  /* the longest query blocks first, so the triangle balances */
        qb = pl->num_qblocks - 1 - task / pl->num_bh;
        bh = task % pl->num_bh;
    } else {
        qb = task % pl->num_qblocks;
        bh = task / pl->num_qblocks;
    }
    const int64_t b = bh / H, h = bh % H, hkv = h / p->gqa_group;
    const uint16_t *q = (const uint16_t *)view_at(p, &p->query, b, h, 2);
    const uint16_t *k = (const uint16_t *)view_at(p, &p->key, b, hkv, 2);
    const uint16_t *v = (const uint16_t *)view_at(p, &p->value, b, hkv, 2);
    char *out = (char *)view_at(p, &p->out, b, h, 2);
    const void *mask = mask_at_f32(p, b, h);
    float *weights = p->weights.data ? (float *)view_at(p, &p->weights, b, h, sizeof(float)) : NULL;

    /* K read in place when its rows are whole pairs, 32-bit aligned */
    const int64_t ksr = p->key.row_stride;
    const int k_in_place = E % 2 == 0 && p->key.col_stride == 1 && ksr % 2 == 0 && ((uintptr_t)k & 3) == 0;

    uint32_t *qp = (uint32_t *)(scratch + pl->off_q);   /* panels of Q pairs, each [E2][nr] */
    float *acc = scratch + pl->off_acc;                 /* panels of (P V)^T, each Ev x nr   */
    float *st = scratch + pl->off_s;                    /* one score tile, keys x nr         */
    float *row_m = scratch + pl->off_m, *row_l = scratch + pl->off_l;
    uint32_t *pp = (uint32_t *)(scratch + pl->off_pp);  /* P^T pairs, [tile_k / 2][nr]       */
    uint32_t *vp = (uint32_t *)(scratch + pl->off_vp);  /* V pairs, [tile_k / 2][Ev] or [Ev][tile_k / 2] */
    /* feature c's pair p at vp[c * vp_rs + p * vp_ks]: P V's a, in its kernel's layout */
    const int64_t vp_rs = kern->bf16_values_by_feature ? (tile_k + 1) / 2 : 1;
    const int64_t vp_ks = kern->bf16_values_by_feature ? 1 : Ev;
    uint32_t *kp = (uint32_t *)(scratch + pl->off_k);   /* K pairs when not in place, [tile_k][E2] */

    const int64_t l0 = qb * tile_q;
    const int rows = (int)(L - l0 < tile_q ? L - l0 : tile_q);
    const int panels = (rows + nr - 1) / nr;
    const float scale = (float)p->scale;

    for (int pn = 0; pn < panels; pn++) {
        uint32_t *panel = qp + (int64_t)pn * E2 * nr;
        const int64_t r0 = l0 + (int64_t)pn * nr;
        const int prows = (int)(L - r0 < nr ? L - r0 : nr);
        for (int64_t pr = 0; pr < E2; pr++) {
            uint32_t *pc = panel + pr * nr;
            for (int x = 0; x < prows; x++) {
                const uint16_t *qr = q + (r0 + x) * p->query.row_stride;
                const uint16_t lo = qr[2 * pr * p->query.col_stride];
                const uint16_t hi = 2 * pr + 1 < E ? qr[(2 * pr + 1) * p->query.col_stride] : 0;
                pc[x] = bf16_pair(lo, hi);
            }
            for (int x = prows; x < nr; x++) pc[x] = 0;
        }
    }
    for (int x = 0; x < panels * nr; x++) {
        row_m[x] = -INFINITY;
        row_l[x] = 0;
    }
    for (int64_t x = 0; x < (int64_t)panels * nr * Ev; x++) acc[x] = 0;

    const int64_t S_b = key_limit(p, b);
    int64_t kv_end = S_b;
    if (p->causal) {
        int64_t last = l0 + rows + p->causal_offset;  /* exclusive */
        kv_end = last < 0 ? 0 : (last < S_b ? last : S_b);
    }
    float *lse = p->lse.data ? (float *)view_at(p, &p->lse, b, h, sizeof(float)) : NULL;

    for (int64_t s0 = 0; s0 < kv_end; s0 += tile_k) {
        if (should_stop(irq, tid)) return;  /* the output is unspecified then */
        const int n = (int)(kv_end - s0 < tile_k ? kv_end - s0 : tile_k);
        const uint32_t *kt;
        int64_t k_rs;
        if (k_in_place) {
            kt = (const uint32_t *)(k + s0 * ksr);
            k_rs = ksr / 2;
        } else {
            bf16_pack_rows(kp, k, &p->key, s0, n, E);
            kt = kp;
            k_rs = E2;
        }
        if (kern->bf16_values_by_feature)
            bf16_pack_value_pairs_by_feature(vp, vp_rs, v, &p->value, s0, n, Ev);
        else
            bf16_pack_value_pairs(vp, v, &p->value, s0, n, Ev);
        for (int pn = 0; pn < panels; pn++) {
            const int64_t r0 = l0 + (int64_t)pn * nr;
            const int prows = (int)(L - r0 < nr ? L - r0 : nr);
            int np = n;
            if (p->causal) {  /* the panel's last row sees keys < lim */
                int64_t lim = r0 + prows + p->causal_offset;
                if (lim <= s0) continue;
                if (lim - s0 < np) np = (int)(lim - s0);
            }
            float *pmax = row_m + (int64_t)pn * nr, *psum = row_l + (int64_t)pn * nr;
            float *pacc = acc + (int64_t)pn * Ev * nr;
            const void *tile_mask = mask;
            if (mask) {
                const int cls = mask_tile_class_f32(p, mask, r0, prows, s0, np);
                if (cls == TILE_NONE_VISIBLE) {  /* adds nothing to any row */
                    if (weights) hide_in_weights_f32(p, weights, r0, prows, s0, np);
                    continue;
                }
                if (cls == TILE_ALL_VISIBLE) tile_mask = NULL;
            }

            kern->gemm_bf16(np, E2, kt, k_rs, 1, qp + (int64_t)pn * E2 * nr, nr, st, nr, 0);
            for (int64_t i = 0; i < (int64_t)np * nr; i++) st[i] *= scale;

            const int diagonal = p->causal && s0 + np - 1 > r0 + p->causal_offset;
            if (tile_mask || diagonal) mask_tile_f32(p, kern, tile_mask, st, nr, r0, prows, s0, np, kv_end);
            if (weights)
                for (int x = 0; x < prows; x++)
                    store_raw_scores_f32(p, weights + (r0 + x) * p->weights.row_stride, st + x, nr, s0, np);

            kern->softmax(st, np, pmax, psum, pacc, Ev);
            kern->pairs_bf16(st, np, pp);
            kern->gemm_bf16((int)Ev, (np + 1) / 2, vp, vp_rs, vp_ks, pp, nr, pacc, nr, 1);
        }
    }

    for (int x = 0; x < rows; x++) {
        const int64_t row = l0 + x;
        const float l = row_l[x], m = row_m[x];
        const float *ax = acc + (int64_t)(x / nr) * Ev * nr + x % nr;
        const int64_t o0 = row * p->out.row_stride, oc = p->out.col_stride;
        const float inv = l == 0 ? 0 : 1 / l;
        for (int64_t c = 0; c < Ev; c++) store_f32(out, o0 + c * oc, SDPA_BFLOAT16, l == 0 ? 0 : ax[c * nr] * inv);
        if (weights) normalize_weights_f32(p, weights + row * p->weights.row_stride, row, S_b, m, l);
        if (lse) lse[row * p->lse.row_stride] = log_sum_exp_f32(m, l);
    }
}
