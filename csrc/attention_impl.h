/*
 * The fused attention driver for one element type, included by attention.c with
 *   T     the element type            SUF   the name suffix (f32, f64)
 *   KT    the kernel struct type      KSEL  the member of kernel_table (f32, f64)
 *   EXP   libm's exp for T
 *
 * One task = (batch index, query head, block of query rows).  A task walks the
 * visible key blocks: scores = (scale Q) K^T, mask, online softmax (running max
 * and sum, the accumulator rescaled when the max grows), acc += P V; the output
 * is acc / sum.  Tasks are independent and each is computed in a fixed order by
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
    const int64_t ld_s = pl->ld_s;

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

    T *qp = scratch + pl->off_q;
    T *kp = scratch + pl->off_k;
    T *sc = scratch + pl->off_s;
    T *vp = scratch + pl->off_v;
    T *acc = scratch + pl->off_acc;
    T *row_m = scratch + pl->off_m;
    T *row_l = scratch + pl->off_l;

    const int64_t l0 = qb * tile_q;
    const int rows = (int)(L - l0 < tile_q ? L - l0 : tile_q);
    const T scale = (T)p->scale;

    /* Q block, scaled, row-major */
    for (int i = 0; i < rows; i++) {
        const T *qi = q + (l0 + i) * p->query.row_stride;
        for (int64_t c = 0; c < E; c++) qp[i * E + c] = scale * qi[c * p->query.col_stride];
    }
    for (int i = 0; i < rows; i++) {
        row_m[i] = -(T)INFINITY;
        row_l[i] = 0;
    }
    for (int64_t x = 0; x < (int64_t)rows * Ev; x++) acc[x] = 0;

    /* keys past kv_end are masked for every row of the block: never visited */
    int64_t kv_end = S;
    if (p->causal) {
        int64_t last_visible = l0 + rows - 1 + p->causal_offset;
        kv_end = last_visible + 1 < 0 ? 0 : (last_visible + 1 < S ? last_visible + 1 : S);
    }

    for (int64_t s0 = 0; s0 < kv_end; s0 += tile_k) {
        const int n = (int)(kv_end - s0 < tile_k ? kv_end - s0 : tile_k);
        const int panels = (n + nr - 1) / nr;

        /* K block packed in panels of nr keys (e x nr each), zero padded */
        for (int pnl = 0; pnl < panels; pnl++) {
            T *panel = kp + (int64_t)pnl * E * nr;
            for (int j = 0; j < nr; j++) {
                int64_t key = (int64_t)pnl * nr + j;
                if (key < n) {
                    const T *kj = k + (s0 + key) * p->key.row_stride;
                    for (int64_t c = 0; c < E; c++) panel[c * nr + j] = kj[c * p->key.col_stride];
                } else {
                    for (int64_t c = 0; c < E; c++) panel[c * nr + j] = 0;
                }
            }
        }
        kern->qk(rows, n, E, qp, kp, sc, ld_s);

        for (int i = 0; i < rows; i++) {
            T *si = sc + i * ld_s;
            const int64_t row = l0 + i;
            if (p->causal) {
                int64_t first_masked = row + p->causal_offset + 1 - s0;
                for (int64_t j = first_masked < 0 ? 0 : first_masked; j < n; j++) si[j] = -(T)INFINITY;
            }
            if (p->mask_kind == SDPA_MASK_BOOL) {
                const uint8_t *mr = (const uint8_t *)mask + row * p->mask.row_stride;
                for (int j = 0; j < n; j++)
                    if (!mr[(s0 + j) * p->mask.col_stride]) si[j] = -(T)INFINITY;
            } else if (p->mask_kind == SDPA_MASK_ADDITIVE) {
                const T *mr = (const T *)mask + row * p->mask.row_stride;
                for (int j = 0; j < n; j++) si[j] += mr[(s0 + j) * p->mask.col_stride];
            }
            if (weights) {  /* raw scores now; normalised once the row is complete */
                T *wr = weights + row * p->weights.row_stride;
                for (int j = 0; j < n; j++) wr[(s0 + j) * p->weights.col_stride] = si[j];
            }

            T block_max = kern->row_max(si, n);
            T m_old = row_m[i];
            T m_new = (block_max > m_old || block_max != block_max) ? block_max : m_old;
            if (m_new == -(T)INFINITY) {  /* nothing visible yet: contributes nothing */
                for (int j = 0; j < n; j++) si[j] = 0;
                continue;
            }
            if (m_new != m_old) {
                T alpha = EXP(m_old - m_new);  /* 0 when m_old is -inf */
                T *ai = acc + i * Ev;
                for (int64_t c = 0; c < Ev; c++) ai[c] *= alpha;
                row_l[i] *= alpha;
                row_m[i] = m_new;
            }
            row_l[i] += kern->softmax(si, n, m_new, si);
        }

        const T *vb;
        int64_t ld_v;
        if (p->value.col_stride == 1) {
            vb = v + s0 * p->value.row_stride;
            ld_v = p->value.row_stride;
        } else {
            for (int j = 0; j < n; j++) {
                const T *vj = v + (s0 + j) * p->value.row_stride;
                for (int64_t c = 0; c < Ev; c++) vp[j * Ev + c] = vj[c * p->value.col_stride];
            }
            vb = vp;
            ld_v = Ev;
        }
        kern->pv(rows, n, Ev, sc, ld_s, vb, ld_v, acc);
    }

    for (int i = 0; i < rows; i++) {
        const int64_t row = l0 + i;
        const T l = row_l[i], m = row_m[i];
        T *oi = out + row * p->out.row_stride;
        const T *ai = acc + i * Ev;
        /* a row with no visible key gives zeros; NaN in l passes through */
        if (l == 0) {
            for (int64_t c = 0; c < Ev; c++) oi[c * p->out.col_stride] = 0;
        } else {
            for (int64_t c = 0; c < Ev; c++) oi[c * p->out.col_stride] = ai[c] / l;
        }
        if (weights) {
            T *wr = weights + row * p->weights.row_stride;
            const int64_t ws = p->weights.col_stride;
            if (l == 0) {
                for (int64_t j = 0; j < kv_end; j++) wr[j * ws] = 0;
            } else {
                for (int64_t j = 0; j < kv_end; j++) wr[j * ws] = EXP(wr[j * ws] - m) / l;
            }
            for (int64_t j = kv_end; j < S; j++) wr[j * ws] = 0;
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
