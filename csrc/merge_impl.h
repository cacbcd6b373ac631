/* Finishing rows for one compute type T (included by exec_impl.h): the
 * log-sum-exp and the weights of a row, the row path's chunks merged in chunk
 * order (merge_rows), a sequence's parts merged in key order (merge_parts),
 * and the copies made before the tasks (gathered query rows, a tree's keys). */

/* m + log(l): the row's log-sum-exp; -inf for a row that saw no key. */
static T FN(log_sum_exp)(T m, T l) {
    if (l == 0) return -(T)INFINITY;
    return m + (T)log((double)l);
}

/* The log-sum-exp of a row with a sink logit: log(sum_s e^x_s + e^sink) from
 * m, l = sum_s e^(x_s - m); the sink alone when no key was visible (l = 0). */
static T FN(log_sum_exp_sink)(T m, T l, T sink) {
    if (l == 0) return sink;
    if (sink == (T)INFINITY && l == l && m == m) return sink;  /* the limit, not inf - inf */
    const double md = (double)m, sd = (double)sink;
    const double top = md > sd ? md : sd;  /* NaN in either gives NaN below */
    return (T)(top + log((double)l * exp(md - top) + exp(sd - top)));
}

/* Weights of one row from its raw scores: exp(s - m) / l where visible, 0
 * elsewhere; a weight below T's smallest normal number (a term near the
 * exponential's cut over l > 1) is 0, as the exponential keeps none, and one
 * above 1 (the bfloat16 products' sum l may trail its largest term by the
 * polynomial's 3e-6) is 1. */
static void FN(normalize_weights)(const sdpa_problem *p, T *wr, int64_t row, int64_t S_b, T m, T l) {
    const int64_t S = p->len_kv, ws = p->weights.col_stride;
    int64_t row_begin = 0, row_end = S_b;
    if (p->causal) {
        int64_t e = row + p->causal_offset + 1;
        row_end = e < 0 ? 0 : (e < S_b ? e : S_b);
    }
    if (has_window(p)) {  /* keys outside the window were never computed */
        const int64_t we = window_end(p, row);
        row_begin = window_first(p, row);
        if (we < row_end) row_end = we;
        if (row_begin > row_end) row_begin = row_end;
    }
    for (int64_t j = 0; j < row_begin; j++) wr[j * ws] = 0;
    const T tiny = TDT == SDPA_FLOAT64 ? (T)DBL_MIN : (T)FLT_MIN;
    for (int64_t j = row_begin; j < row_end; j++) {
        T w = l == 0 ? 0 : EXP(wr[j * ws] - m) / l;
        w = w < tiny ? 0 : w;  /* NaN passes */
        wr[j * ws] = w > 1 ? 1 : w;
    }
    for (int64_t j = row_end; j < S; j++) wr[j * ws] = 0;
}

/* Combines the chunks of the row path's group g of a part in chunk order (their
 * partials one after the other from `first`) and writes its rows. */
static void FN(merge_rows)(const part *pt, const KT *kern, T *first, int64_t g) {
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    const int64_t L = p->len_q, Ev = p->head_dim_v, group = p->gqa_group;
    const int M = pl->row.rows;
    const int64_t Hkv = p->num_heads / group, chunks = pl->row.num_chunks;
    const int64_t b = g / Hkv, hkv = g % Hkv;
    const int64_t S_b = key_limit(p, b);
    const sdpa_dtype odt = pl->path.out_dtype;
    const size_t oe = sdpa_dtype_size(odt);

    for (int x = 0; x < M; x++) {
        const int64_t h = hkv * group + x / L, l = x % L;
        T m = -(T)INFINITY;
        for (int64_t c = 0; c < chunks; c++) {
            T mc = first[c * pl->row.partial_elems + x];
            if (mc > m || mc != mc) m = mc;
            if (m != m) break;
        }
        /* combined in double: the chunks of a very long row would otherwise lose
         * float32 bits in the sum of their partial results */
        double sum = 0;
        char *orow = (char *)view_at(p, &p->out, b, h, oe) + l * p->out.row_stride * (int64_t)oe;
        const int64_t oc = p->out.col_stride;
        const T *sink = p->sinks.data ? (const T *)view_at(p, &p->sinks, b, h, sizeof(T)) : NULL;
        if (sink && *sink == -(T)INFINITY) sink = NULL;  /* no sink: the same bits as without */
        double denom = 0;  /* sum, and the sink's share */
        if (m == -(T)INFINITY) {
            for (int64_t c = 0; c < Ev; c++) FN(store)(orow, c * oc, odt, 0);
        } else {
            /* each chunk's weight exp(m_chunk - m) replaces its max in the partial
             * (this group's partials belong to this thread alone) */
            for (int64_t ch = 0; ch < chunks; ch++) {
                T *pc = first + ch * pl->row.partial_elems;
                pc[x] = (T)exp((double)pc[x] - (double)m);  /* 0 for a chunk it did not see */
                sum += (double)pc[x] * (double)pc[M + x];
            }
            denom = sink ? sum + exp((double)*sink - (double)m) : sum;
            const double inv = sum == 0 ? 0 : 1 / denom;
            if (chunks == 1) {  /* the row's own result: acc / sum (sum >= 1 here) */
                const T *acc = first + 2 * M + (int64_t)x * Ev;
                if (odt == TDT && oc == 1)  /* the output never overlaps the scratch */
                    kern->scale_copy_d((T *)orow, acc, Ev, inv);
                else if (odt == TDT)
                    for (int64_t c = 0; c < Ev; c++) ((T *)orow)[c * oc] = (T)((double)acc[c] * inv);
                else
                    for (int64_t c = 0; c < Ev; c++) FN(store)(orow, c * oc, odt, (T)((double)acc[c] * inv));
            } else {
                for (int64_t c = 0; c < Ev; c++) {
                    double acc_c = 0;
                    for (int64_t ch = 0; ch < chunks; ch++) {
                        const T *pc = first + ch * pl->row.partial_elems;
                        if (pc[M + x] != 0)  /* a chunk that saw no key adds nothing, NaN included */
                            acc_c += (double)pc[x] * (double)pc[2 * M + (int64_t)x * Ev + c];
                    }
                    FN(store)(orow, c * oc, odt, (T)(acc_c * inv));
                }
            }
        }
        if (p->weights.data) {
            T *wr = (T *)view_at(p, &p->weights, b, h, sizeof(T)) + l * p->weights.row_stride;
            FN(normalize_weights)(p, wr, l, S_b, m, (T)denom);
        }
        if (p->lse.data) {
            T lse_x;
            if (m == -(T)INFINITY) lse_x = sink ? *sink : m;
            else if (sink) lse_x = FN(log_sum_exp_sink)(m, (T)sum, *sink);
            else lse_x = (T)((double)m + log(sum));
            ((T *)view_at(p, &p->lse, b, h, sizeof(T)))[l * p->lse.row_stride] = lse_x;
        }
    }
}

/* The address of row l of sequence b, head h, in a view of the call (packed
 * rows when cu_seqlens_q is set). */
static char *FN(call_row)(const sdpa_problem *c, const sdpa_view *v, int64_t b, int64_t h, int64_t l, size_t elem) {
    const int64_t row = c->cu_seqlens_q ? c->cu_seqlens_q[b] + l : l;
    const int64_t off = (c->cu_seqlens_q ? 0 : batch_offset_of(c, v->batch_strides, b)) + h * v->head_stride +
                        row * v->row_stride;
    return (char *)v->data + off * (int64_t)elem;
}

/*
 * A sequence's parts, merged in key order into its rows of the call's output
 * and lse (sdpa.merge_attention's arithmetic, in double): with m the largest
 * of the parts' lse, out = sum_i e^(lse_i - m) out_i / sum_i e^(lse_i - m) and
 * lse = m + log(sum_i e^(lse_i - m)).  A row no part shows a key gives zeros
 * and -inf; a row whose largest lse is +inf (a sink of +inf) the mean of the
 * parts at +inf; NaN in any lse makes the row NaN.
 */
static void FN(merge_parts)(const call_plan *cp, const merge_group *mg, double *acc) {
    const sdpa_problem *c = cp->call;
    const int64_t b = mg->seq, G = c->gqa_group, Ev = c->head_dim_v;
    const int64_t L = seq_rows(c, b);
    const sdpa_dtype odt = c->dtype;
    const size_t oe = sdpa_dtype_size(odt);
    const contribution *parts = cp->contributions + mg->first;
#define SLOT(i) ((h / G) * parts[i].head_block + (h % G) * L + l + parts[i].offset)
#define LSE(i) (((const T *)cp->parts[parts[i].part].p.lse.data)[SLOT(i)])
#define OUT(i) ((const T *)cp->parts[parts[i].part].p.out.data + SLOT(i) * Ev)
    for (int64_t h = 0; h < c->num_heads; h++)
        for (int64_t l = 0; l < L; l++) {
            T m = -(T)INFINITY;
            for (int64_t i = 0; i < mg->count && m == m; i++) {
                const T x = LSE(i);
                if (x > m || x != x) m = x;
            }
            char *orow = FN(call_row)(c, &c->out, b, h, l, oe);
            const int64_t oc = c->out.col_stride;
            T lse;
            if (m != m || m == -(T)INFINITY) {
                for (int64_t x = 0; x < Ev; x++) FN(store)(orow, x * oc, odt, m != m ? m : 0);
                lse = m;
            } else {
                double denom = 0;
                for (int64_t x = 0; x < Ev; x++) acc[x] = 0;
                for (int64_t i = 0; i < mg->count; i++) {
                    const T li = LSE(i);
                    const double w = m == (T)INFINITY ? (double)(li == (T)INFINITY) : exp((double)li - (double)m);
                    denom += w;
                    if (w == 0) continue;  /* a part that saw no key adds nothing, NaN included */
                    const T *o = OUT(i);
                    for (int64_t x = 0; x < Ev; x++) acc[x] += w * (double)o[x];
                }
                const double inv = 1 / denom;
                for (int64_t x = 0; x < Ev; x++) FN(store)(orow, x * oc, odt, (T)(acc[x] * inv));
                lse = m == (T)INFINITY ? m : (T)((double)m + log(denom));
            }
            if (c->lse.data) *(T *)(void *)FN(call_row)(c, &c->lse, b, h, l, sizeof(T)) = lse;
        }
#undef SLOT
#undef LSE
#undef OUT
}

/* A copy job: a shared prefix's query rows of key/value head hkv, gathered
 * from its sequences (rows hkv * R + offset + g * L_m + l), or a tree's keys
 * and values of key/value head hkv, from the sequence's blocks. */
static void FN(run_copy)(const call_plan *cp, const copy_job *job) {
    const sdpa_problem *c = cp->call;
    const part *pt = &cp->parts[job->part];
    const sdpa_problem *p = &pt->p;
    const int64_t hkv = job->hkv, G = c->gqa_group;
    if (job->kind == COPY_QUERY) {
        const size_t qe = sdpa_dtype_size(c->dtype);
        const int64_t E = c->head_dim, cs = c->query.col_stride;
        char *dst = (char *)p->query.data + (size_t)(hkv * pt->rows_total * E) * qe;
        for (int64_t i = 0; i < pt->num_members; i++) {
            const int64_t m = cp->members[pt->members_at + i];
            const int64_t L = seq_rows(c, m);
            for (int64_t g = 0; g < G; g++)
                for (int64_t l = 0; l < L; l++, dst += (size_t)E * qe) {
                    const char *src = FN(call_row)(c, &c->query, m, hkv * G + g, l, qe);
                    if (cs == 1) {
                        memcpy(dst, src, (size_t)E * qe);
                    } else {
                        for (int64_t x = 0; x < E; x++) memcpy(dst + (size_t)x * qe, src + x * cs * (int64_t)qe, qe);
                    }
                }
        }
        return;
    }
    /* keys [copy_row0, + len_kv) of sequence pt->seq: key, value and their scales */
    const sdpa_dtype kvdt = kv_dtype_of(c);
    const int64_t n = p->len_kv;
    const sdpa_view *views[4] = {&p->key, &p->value, &p->key_scale, &p->value_scale};
    for (int i = 0; i < 4; i++) {
        if (!views[i]->data) continue;
        const int which = i % 2;
        kv_source src = kv_source_of(c, which, kvdt, pt->seq, hkv, 0);
        size_t elem = src.elem;
        if (i >= 2) {  /* the scales, walked as a view of their own */
            src.view = src.scale_view;
            src.scale_view = NULL;
            src.elem = elem = sizeof(float);
            src.base = NULL;
        }
        const int64_t cols = src.cols = views[i]->row_stride;  /* elements (int4: bytes) a row */
        char *dst = (char *)views[i]->data + (size_t)(hkv * views[i]->head_stride) * elem;
        kv_cursor cur = kv_walk(&src, pt->copy_row0, pt->copy_row0 + n);
        const char *rows;
        kv_scales sc;
        for (int64_t m; (m = kv_next(&src, &cur, &rows, &sc, 0)) > 0;)
            for (int64_t j = 0; j < m; j++, dst += (size_t)cols * elem) {
                const char *row = rows + j * src.view->row_stride * (int64_t)elem;
                if (src.view->col_stride == 1 || cols == 1) {
                    memcpy(dst, row, (size_t)cols * elem);
                } else {
                    for (int64_t x = 0; x < cols; x++)
                        memcpy(dst + (size_t)x * elem, row + x * src.view->col_stride * (int64_t)elem, elem);
                }
            }
    }
}
