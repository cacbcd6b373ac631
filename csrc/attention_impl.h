/*
 * The fused attention driver for one element type, included by attention.c with
 *   T     the element type            SUF   the name suffix (f32, f64)
 *   KT    the kernel struct type      KSEL  the member of kernel_table (f32, f64)
 *   EXP   libm's exp for T
 *
 * One task = (batch index, query head, block of query rows).  The block is cut
 * into panels of nr rows, kept transposed (Q^T, and the accumulator (P V)^T), so
 * that one vector spans nr query rows.  For each visible key block and panel:
 * scores^T = K (scale Q)^T, mask, online softmax (running max and sum, the
 * accumulator rescaled when the max grows), acc^T += V^T P^T.  The output is
 * acc / sum.  K and V are read in place, with their own strides.  Tasks are independent and each is computed in a fixed order by
 * one thread, so the result does not depend on the number of threads.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

static void FN(run_task)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch,
                         int64_t task) {
    const int64_t H = p->num_heads, L = p->len_q, S = p->len_kv;
    const int64_t E = p->head_dim, Ev = p->head_dim_v;
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

    const T *q = (const T *)p->query.data + batch_offset(p, &p->query, b) + h * p->query.head_stride;
    const T *k = (const T *)p->key.data + batch_offset(p, &p->key, b) + hkv * p->key.head_stride;
    const T *v = (const T *)p->value.data + batch_offset(p, &p->value, b) + hkv * p->value.head_stride;
    T *out = (T *)p->out.data + batch_offset(p, &p->out, b) + h * p->out.head_stride;
    const void *mask = NULL;
    if (p->mask_kind != SDPA_MASK_NONE)
        mask = (const char *)p->mask.data +
               (batch_offset(p, &p->mask, b) + h * p->mask.head_stride) *
                   (p->mask_kind == SDPA_MASK_BOOL ? 1 : (int64_t)sizeof(T));
    T *weights = NULL;
    if (p->weights.data)
        weights = (T *)p->weights.data + batch_offset(p, &p->weights, b) + h * p->weights.head_stride;
    const int64_t ksr = p->key.row_stride, ksc = p->key.col_stride;
    const int64_t vsr = p->value.row_stride, vsc = p->value.col_stride;

    T *qt = scratch + pl->off_q;     /* panels of Q^T, each E x nr, scaled   */
    T *acc = scratch + pl->off_acc;  /* panels of (P V)^T, each Ev x nr      */
    T *st = scratch + pl->off_s;     /* one score tile, keys x nr            */
    T *row_m = scratch + pl->off_m;
    T *row_l = scratch + pl->off_l;

    const int64_t l0 = qb * tile_q;
    const int rows = (int)(L - l0 < tile_q ? L - l0 : tile_q);
    const int panels = (rows + nr - 1) / nr;
    const T scale = (T)p->scale;

    for (int x = 0; x < panels * nr; x++) {
        T *panel = qt + (int64_t)(x / nr) * E * nr + x % nr;
        if (x < rows) {
            const T *qr = q + (l0 + x) * p->query.row_stride;
            for (int64_t c = 0; c < E; c++) panel[c * nr] = scale * qr[c * p->query.col_stride];
        } else {
            for (int64_t c = 0; c < E; c++) panel[c * nr] = 0;
        }
        row_m[x] = -(T)INFINITY;
        row_l[x] = 0;
    }
    for (int64_t x = 0; x < (int64_t)panels * nr * Ev; x++) acc[x] = 0;

    /* keys past kv_end are masked for every row of the task: never visited */
    int64_t kv_end = S;
    if (p->causal) {
        int64_t last = l0 + rows + p->causal_offset;  /* exclusive */
        kv_end = last < 0 ? 0 : (last < S ? last : S);
    }

    for (int64_t s0 = 0; s0 < kv_end; s0 += tile_k) {
        const int n = (int)(kv_end - s0 < tile_k ? kv_end - s0 : tile_k);
        for (int pn = 0; pn < panels; pn++) {
            const int64_t r0 = l0 + (int64_t)pn * nr;
            const int prows = (int)(L - r0 < nr ? L - r0 : nr);
            int np = n;
            if (p->causal) {  /* the panel's last row sees keys < lim */
                int64_t lim = r0 + prows + p->causal_offset;
                if (lim <= s0) continue;
                if (lim - s0 < np) np = (int)(lim - s0);
            }
            T *pmax = row_m + (int64_t)pn * nr, *psum = row_l + (int64_t)pn * nr;
            T *pacc = acc + (int64_t)pn * Ev * nr;

            kern->gemm(np, E, k + s0 * ksr, ksr, ksc, qt + (int64_t)pn * E * nr, nr, st, nr, 0);

            if (p->causal && s0 + np - 1 > r0 + p->causal_offset) {
                for (int x = 0; x < nr; x++) {
                    int64_t first = r0 + x + p->causal_offset + 1 - s0;
                    for (int64_t j = first < 0 ? 0 : first; j < np; j++) st[j * nr + x] = -(T)INFINITY;
                }
            }
            if (p->mask_kind == SDPA_MASK_BOOL) {
                for (int x = 0; x < prows; x++) {
                    const uint8_t *mr = (const uint8_t *)mask + (r0 + x) * p->mask.row_stride;
                    for (int j = 0; j < np; j++)
                        if (!mr[(s0 + j) * p->mask.col_stride]) st[j * nr + x] = -(T)INFINITY;
                }
            } else if (p->mask_kind == SDPA_MASK_ADDITIVE) {
                for (int x = 0; x < prows; x++) {
                    const T *mr = (const T *)mask + (r0 + x) * p->mask.row_stride;
                    for (int j = 0; j < np; j++) st[j * nr + x] += mr[(s0 + j) * p->mask.col_stride];
                }
            }
            if (weights) {  /* raw scores now; normalised once the row is complete */
                for (int x = 0; x < prows; x++) {
                    T *wr = weights + (r0 + x) * p->weights.row_stride;
                    for (int j = 0; j < np; j++) wr[(s0 + j) * p->weights.col_stride] = st[j * nr + x];
                }
            }

            kern->softmax(st, np, pmax, psum, pacc, Ev);
            kern->gemm((int)Ev, np, v + s0 * vsr, vsc, vsr, st, nr, pacc, nr, 1);
        }
    }

    for (int x = 0; x < rows; x++) {
        const int64_t row = l0 + x;
        const T l = row_l[x], m = row_m[x];
        const T *ax = acc + (int64_t)(x / nr) * Ev * nr + x % nr;
        T *orow = out + row * p->out.row_stride;
        /* a row with no visible key gives zeros; NaN in l passes through */
        if (l == 0) {
            for (int64_t c = 0; c < Ev; c++) orow[c * p->out.col_stride] = 0;
        } else {
            for (int64_t c = 0; c < Ev; c++) orow[c * p->out.col_stride] = ax[c * nr] / l;
        }
        if (weights) {
            T *wr = weights + row * p->weights.row_stride;
            const int64_t ws = p->weights.col_stride;
            int64_t row_end = S;
            if (p->causal) {
                int64_t e = row + p->causal_offset + 1;
                row_end = e < 0 ? 0 : (e < S ? e : S);
            }
            for (int64_t j = 0; j < row_end; j++) wr[j * ws] = l == 0 ? 0 : EXP(wr[j * ws] - m) / l;
            for (int64_t j = row_end; j < S; j++) wr[j * ws] = 0;
        }
    }
}

static sdpa_status FN(attention)(const sdpa_problem *p, const plan *pl, const KT *kern) {
    const size_t per_thread = pl->scratch_elems;
    int nthreads = pl->num_threads;
    T *scratch = (T *)aligned_block(per_thread * sizeof(T) * (size_t)nthreads);
    if (!scratch) return SDPA_ERR_NO_MEMORY;

    volatile int stop = 0;
    interrupt_clock clk;
    interrupt_clock_start(&clk);
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
#endif
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        T *mine = scratch + (size_t)tid * per_thread;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < pl->num_tasks; t++) {
            if (stop) continue;
            if (tid == 0 && p->interrupt && interrupt_due(&clk) && p->interrupt(p->interrupt_data)) {
                stop = 1;
#ifdef _OPENMP
#pragma omp flush
#endif
                continue;
            }
            FN(run_task)(p, pl, kern, mine, t);
        }
    }
    aligned_free(scratch);
    return stop ? SDPA_ERR_INTERRUPTED : SDPA_OK;
}

#undef FN
#undef CAT
#undef CAT_
