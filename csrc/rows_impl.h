/* The row path for one compute type T (included by exec_impl.h): few query
 * rows per key/value head (decoding, short queries).  One task = (batch
 * index, key/value head, chunk of keys) of a part: the G x L rows of the head
 * group against each key tile, each key (and value) read once for all of
 * them, the keys walked by segments (kv_source).  Each task keeps its rows'
 * max, sum and output in its partial (in the call's block when its group has
 * several chunks, else in the thread's scratch); merge_rows combines a group's
 * chunks in chunk order. */

/* integer_qk: a scaled query row rounded to int8 with the scale max|x| / 127,
 * round(x / scale) (ties to even; 0 for a row of zeros or of values so small that the scale
 * would be subnormal); a row with a NaN or an infinity gets the scale NaN, so
 * that its scores, and its output, are NaN. */
static void FN(quantize_query)(const T *x, int64_t e, int8_t *q, float *qscale) {
    float m = 0;
    for (int64_t c = 0; c < e; c++) {
        const float a = fabsf((float)x[c]);
        if (!(a <= m)) m = a;  /* NaN stays */
        if (m != m) break;
    }
    if (!(m <= FLT_MAX)) {  /* NaN or infinite */
        for (int64_t c = 0; c < e; c++) q[c] = 0;
        *qscale = NAN;
        return;
    }
    const float scale = m / 127.0f >= FLT_MIN ? m / 127.0f : 0.0f;
    for (int64_t c = 0; c < e; c++) q[c] = (int8_t)(int)sdpa_round_quotient((float)x[c], scale, 127.0f);
    *qscale = scale;
}

/* The scores of one segment of m keys (rows kt, scales ksct) into sto (row
 * stride tile_k), for every row: 16-bit keys in place, integer_qk, quantized
 * keys in place (a group at a time where the kernel cannot fold the scales),
 * or float keys (converted first when strided or of another type). */
static void FN(row_scores)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch, const T *qs,
                           const char *kt, const kv_scales *ksct, const kv_scales *kscl, int m, T *sto) {
    const int64_t E = p->head_dim;
    const int M = pl->row.rows, tile_k = pl->blocking.tile_k;
    const sdpa_dtype kvdt = pl->path.kv_dtype;
    const int64_t ksr = p->key.row_stride, ksc = p->key.col_stride;
    const int half = kvdt == SDPA_BFLOAT16 || kvdt == SDPA_FLOAT16;
    const int k_q = sdpa_is_quantized(kvdt) && ksc == 1;
    const int nib = kvdt == SDPA_INT4;  /* int4: value c at byte c / 2 */
    if (half && ksc == 1) {  /* 16-bit keys read in place */
        kern->dot_half(kvdt, M, m, E, qs, E, (const uint16_t *)kt, ksr, sto, tile_k);
        return;
    }
    if (pl->path.integer_qk && k_q && ksct->base && sizeof(T) == sizeof(float)) {
        /* the query rows as int8 (each with its scale) and dot_qi's work */
        const int8_t *q8 = (const int8_t *)(scratch + pl->scratch.qi);
        const float *q8s = (const float *)(const void *)(q8 + ((size_t)M * (size_t)E + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN);
        void *qi_work = (char *)(uintptr_t)q8s + ((size_t)M * sizeof(float) + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN;
        /* the set's kernel, or the portable one where it declines */
        if (pl->path.dot_qi(kvdt, M, m, E, kscl->group, q8, E, q8s, (const uint8_t *)kt, ksr, ksct->base, kscl->rs,
                            kscl->cs, (float *)(void *)sto, tile_k, qi_work) ||
            sdpa_kernels_scalar.f32.dot_qi(kvdt, M, m, E, kscl->group, q8, E, q8s, (const uint8_t *)kt, ksr,
                                           ksct->base, kscl->rs, kscl->cs, (float *)(void *)sto, tile_k, qi_work))
            return;
    }
    if (k_q) {  /* quantized keys read in place, each scale group's dot then scaled */
        T *sg = scratch + pl->scratch.pp;  /* M x tile_k: the scores of one scale group */
        const uint8_t *kb = (const uint8_t *)kt;
        const float *ks = ksct->base;
        const int64_t g = kscl->group;
        /* groups: the scales applied to each key vector in the kernel, if it can */
        const int folded =
            !ks || (g < E && kern->dot_q_grouped(kvdt, M, m, E, g, qs, E, kb, ksr, ks, kscl->rs, kscl->cs, sto, tile_k));
        if (!ks) kern->dot_q(kvdt, M, m, E, qs, E, kb, ksr, sto, tile_k);  /* float8 without scales */
        for (int64_t c0 = 0; c0 < E && !folded; c0 += g) {
            const float *kg = ks + (c0 / g) * kscl->cs;
            T *dst = c0 == 0 ? sto : sg;
            kern->dot_q(kvdt, M, m, g, qs + c0, E, kb + (nib ? c0 / 2 : c0), ksr, dst, tile_k);
            for (int x = 0; x < M; x++) {
                T *sx = sto + (int64_t)x * tile_k;
                const T *gx = dst + (int64_t)x * tile_k;
                if (c0 == 0 && kscl->rs == 1)  /* one scale a row: contiguous, vectorized */
                    for (int j = 0; j < m; j++) sx[j] = gx[j] * kg[j];
                else if (c0 == 0)
                    for (int j = 0; j < m; j++) sx[j] = gx[j] * kg[j * kscl->rs];
                else
                    for (int j = 0; j < m; j++) sx[j] += gx[j] * kg[j * kscl->rs];
            }
        }
        return;
    }
    const T *kb = (const T *)kt;
    int64_t ldk = ksr;
    if (ksc != 1 || kvdt != TDT) {
        T *kbuf = scratch + pl->scratch.k;  /* tile_k x E: strided or converted K rows */
        FN(convert_rows)(kern, kbuf, kt, &p->key, kvdt, m, E, ksct);
        kb = kbuf;
        ldk = E;
    }
    kern->dot(M, m, E, qs, E, kb, ldk, sto, tile_k);
}

/* acc += the weights of one segment of m values (rows vt, scales vsct) times
 * them, for every row: 16-bit values in place, quantized values in place (the
 * weights of each scale group scaled, where the kernel cannot fold the
 * scales), or float values (converted first when strided or of another type). */
static void FN(row_values)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch, const T *sto,
                           const char *vt, const kv_scales *vsct, const kv_scales *vscl, int m, T *acc) {
    const int64_t Ev = p->head_dim_v;
    const int M = pl->row.rows, tile_k = pl->blocking.tile_k;
    const sdpa_dtype kvdt = pl->path.kv_dtype;
    const int64_t vsr = p->value.row_stride, vsc = p->value.col_stride;
    const int half = kvdt == SDPA_BFLOAT16 || kvdt == SDPA_FLOAT16;
    const int v_q = sdpa_is_quantized(kvdt) && vsc == 1;
    const int nib = kvdt == SDPA_INT4;
    if (half && vsc == 1) {
        kern->pv_rows_half(kvdt, M, m, Ev, sto, tile_k, (const uint16_t *)vt, vsr, acc, Ev);
        return;
    }
    if (v_q) {
        T *sg = scratch + pl->scratch.pp;
        const uint8_t *vb = (const uint8_t *)vt;
        const float *vs = vsct->base;
        const int64_t g = vscl->group;
        const int folded = !vs || (g < Ev && kern->pv_rows_q_grouped(kvdt, M, m, Ev, g, sto, tile_k, vb, vsr, vs,
                                                                     vscl->rs, vscl->cs, acc, Ev));
        if (!vs) kern->pv_rows_q(kvdt, M, m, Ev, sto, tile_k, vb, vsr, acc, Ev);  /* float8 without scales */
        for (int64_t c0 = 0; c0 < Ev && !folded; c0 += g) {
            const float *vg = vs + (c0 / g) * vscl->cs;
            for (int x = 0; x < M; x++) {
                const T *sx = sto + (int64_t)x * tile_k;
                T *px = sg + (int64_t)x * tile_k;
                if (vscl->rs == 1)  /* one scale a row: contiguous, vectorized */
                    for (int j = 0; j < m; j++) px[j] = sx[j] * vg[j];
                else
                    for (int j = 0; j < m; j++) px[j] = sx[j] * vg[j * vscl->rs];
            }
            kern->pv_rows_q(kvdt, M, m, g, sg, tile_k, vb + (nib ? c0 / 2 : c0), vsr, acc + c0, Ev);
        }
        return;
    }
    const T *vb = (const T *)vt;
    int64_t ldv = vsr;
    if (vsc != 1 || kvdt != TDT) {
        T *vbuf = scratch + pl->scratch.v;  /* tile_k x Ev: strided or converted V rows */
        FN(convert_rows)(kern, vbuf, vt, &p->value, kvdt, m, Ev, vsct);
        vb = vbuf;
        ldv = Ev;
    }
    kern->pv_rows(M, m, Ev, sto, tile_k, vb, ldv, acc, Ev);
}

/* integer_pv (sdpa.h): acc += the weights of keys [s0, s0 + n) (their
 * probabilities in st, row stride tile_k) times int8 or int4 values, a run of
 * SDPA_PV_KEYS keys at a time: the run's value rows and their scales by group
 * gathered from its segments, then the kernel's weights, scales and integer
 * products (internal.h's pv_qi).  Runs count from s0, whatever the segments:
 * the same sums paged or not. */
static void FN(row_values_int)(const sdpa_problem *p, const plan *pl, T *scratch, const T *st, const kv_source *vsrc,
                               int64_t s0, int n, int64_t vstep, T *acc) {
    const int64_t Ev = p->head_dim_v, g = vsrc->sc.group, ng = Ev / g;
    const int M = pl->row.rows, tile_k = pl->blocking.tile_k;
    const sdpa_dtype kvdt = pl->path.kv_dtype;
    char *base = (char *)(scratch + pl->scratch.pvi);
    const uint8_t **vr = (const uint8_t **)(void *)base;
    float *vsc = (float *)(void *)(base + SDPA_PVI_R);  /* [ng][SDPA_PV_KEYS] */
    void *work = base + SDPA_PVI_R + SDPA_PVI_V(ng);
    const int64_t vsr = p->value.row_stride;
    for (int r0 = 0; r0 < n; r0 += SDPA_PV_KEYS) {
        const int rn = n - r0 < SDPA_PV_KEYS ? n - r0 : SDPA_PV_KEYS;
        kv_cursor cur = kv_walk(vsrc, s0 + r0, s0 + r0 + rn);
        const char *rows;
        kv_scales sc;
        for (int64_t a = s0 + r0, m; (m = kv_next(vsrc, &cur, &rows, &sc, vstep)) > 0; a += m) {
            const int64_t o = a - s0 - r0;
            for (int64_t j = 0; j < m; j++) vr[o + j] = (const uint8_t *)rows + j * vsr;
            if (ng == 1 && sc.rs == 1)
                memcpy(vsc + o, sc.base, (size_t)m * sizeof(float));
            else
                for (int64_t j = 0; j < m; j++)
                    for (int64_t i = 0; i < ng; i++) vsc[i * SDPA_PV_KEYS + o + j] = sc.base[j * sc.rs + i * sc.cs];
        }
        const float *pr = (const float *)(const void *)(st + r0);
        if (!pl->path.pv_qi(kvdt, M, rn, Ev, g, pr, tile_k, vsc, vr, (float *)acc, Ev, work))
            sdpa_pv_qi_portable(kvdt, M, rn, Ev, g, pr, tile_k, vsc, vr, (float *)acc, Ev, work);
    }
}

/* The products of key tile [s0, s0 + n) over one source: the scores (values
 * 0: into st, by column offset) or acc += the weights in st times the values
 * (values 1).  Segments are computed where they lie; on short paged blocks
 * (pl->row.gather) segments of fewer than SDPA_GATHER_ROWS rows are gathered
 * into the task's scratch -- their scales first (a group's each, row after
 * row), the rows from the 64 bytes after room for a tile's scales, each at
 * its position in the tile -- and computed together, as rows of an array (rp:
 * the problem with those strides), when a longer segment or the tile's end
 * comes.  `latent` (values of MLA's latent cache, a column view of the keys
 * without scales): the tile's values are in its gathered key rows already,
 * from this address, rp->value.row_stride apart. */
#define SDPA_GATHER_ROWS 16
static void FN(tile_products)(int values, const sdpa_problem *p, const sdpa_problem *rp, const plan *pl,
                              const KT *kern, T *scratch, const T *qs, const kv_source *src, int64_t s0, int n,
                              int64_t step, const char *latent, T *st, T *acc) {
    const int64_t bytes = src->cols * (int64_t)src->elem, rs = src->view->row_stride * (int64_t)src->elem;
    const int64_t ng = src->groups;
    char *buf = (char *)(scratch + (values ? pl->scratch.gv : pl->scratch.gk));
    float *scales = (float *)(void *)buf;
    char *rows = buf + ((size_t)(pl->blocking.tile_k * ng) * sizeof(float) + 63) / 64 * 64;
    const int64_t gbytes = latent ? rp->value.row_stride * (int64_t)src->elem : bytes;  /* between gathered rows */
    const char *gathered = latent ? latent : rows;
    kv_cursor cur = kv_walk(src, s0, s0 + n);
    const char *seg;
    kv_scales sc;
    int64_t g0 = s0, cnt = 0;  /* gathered, not yet computed: positions [g0, g0 + cnt) */
    for (int64_t a = s0, m;; a += m) {
        m = kv_next(src, &cur, &seg, &sc, step);
        if (cnt > 0 && (m == 0 || m >= SDPA_GATHER_ROWS)) {
            const char *g = gathered + (g0 - s0) * gbytes;
            const kv_scales gsc = {ng ? scales + (g0 - s0) * ng : NULL, ng, 1, src->sc.group};
            if (values)
                FN(row_values)(rp, pl, kern, scratch, st + (g0 - s0), g, &gsc, &gsc, (int)cnt, acc);
            else
                FN(row_scores)(rp, pl, kern, scratch, qs, g, &gsc, &gsc, (int)cnt, st + (g0 - s0));
            cnt = 0;
        }
        if (m == 0) return;
        if (!pl->row.gather || m >= SDPA_GATHER_ROWS) {
            if (values)
                FN(row_values)(p, pl, kern, scratch, st + (a - s0), seg, &sc, &src->sc, (int)m, acc);
            else
                FN(row_scores)(p, pl, kern, scratch, qs, seg, &sc, &src->sc, (int)m, st + (a - s0));
            continue;
        }
        if (cnt == 0) g0 = a;
        cnt += m;
        if (latent) continue;
        char *dst = rows + (a - s0) * bytes;
        if (rs == bytes)
            memcpy(dst, seg, (size_t)(m * bytes));
        else
            for (int64_t j = 0; j < m; j++) memcpy(dst + j * bytes, seg + j * rs, (size_t)bytes);
        for (int64_t j = 0; j < m && ng; j++)
            for (int64_t i = 0; i < ng; i++) scales[(a - s0 + j) * ng + i] = sc.base[j * sc.rs + i * sc.cs];
    }
}

/* Where task `task` of a part keeps its key scores (all NULL: none asked):
 * the thread's scratch (plan.row.ks_local: a group one task), or the call's
 * block (part.ks_probs, ks_max, ks_range). */
static key_score_store FN(key_score_at)(const part *pt, T *scratch, int64_t task) {
    const plan *pl = &pt->pl;
    const int64_t M = pl->row.rows, tiles = key_score_tiles(pl);
    key_score_store ks = {NULL, NULL, NULL};
    if (!pt->p.key_scores.data) return ks;
    if (pl->row.ks_local) {  /* the range, then the tiles' maxima, then the p */
        char *base = (char *)(scratch + pl->scratch.ks);
        ks.range = (int64_t *)(void *)base;
        ks.tile_max = base + SDPA_ALIGN;
        ks.probs = (T *)ks.tile_max + tiles * M;
    } else if (pt->ks_probs) {
        ks.range = pt->ks_range + task * 2;
        ks.tile_max = (T *)pt->ks_max + task * tiles * M;
        ks.probs = (T *)pt->ks_probs + task / pl->row.num_chunks * M * pt->p.len_kv;
    }
    return ks;
}

static void FN(run_row_task)(const part *pt, const KT *kern, T *scratch, row_memo *memo, T *slot, int64_t task,
                             interrupt_state *irq, int tid) {
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    const int64_t L = p->len_q, E = p->head_dim, Ev = p->head_dim_v, group = p->gqa_group;
    const int M = pl->row.rows, tile_k = pl->blocking.tile_k;
    const int64_t Hkv = p->num_heads / group;
    const int64_t g = task / pl->row.num_chunks, chunk = task % pl->row.num_chunks;
    const int64_t b = g / Hkv, hkv = g % Hkv;

    T *pmax = slot;  /* the task's partial: max, sum and output of its rows */
    T *psum = pmax + M;
    T *acc = psum + M;
    for (int x = 0; x < M; x++) {
        pmax[x] = -(T)INFINITY;
        psum[x] = 0;
    }
    for (int64_t i = 0; i < (int64_t)M * Ev; i++) acc[i] = 0;

    /* the keys of this chunk that some row can see */
    const int64_t S_b = key_limit(p, b);
    int64_t s_begin = chunk * pl->blocking.chunk_len, s_end = s_begin + pl->blocking.chunk_len;
    if (s_end > S_b) s_end = S_b;
    if (p->causal && L - 1 + p->causal_offset + 1 < s_end) s_end = L + p->causal_offset;
    if (has_window(p)) {  /* the rows' positions are 0..L-1 */
        const int64_t wf = window_first(p, 0), we = window_end(p, L - 1);
        if (wf > s_begin) s_begin = wf;
        if (we < s_end) s_end = we;
    }
    /* key scores: the counted rows' p of each visited key and each tile's max of
     * each row, kept (key_score_reduce) in the thread's scratch or the call's block */
    key_score_store ks = FN(key_score_at)(pt, scratch, task);
    T *ksp = (T *)ks.probs, *ks_max = (T *)ks.tile_max;
    const int64_t ks_first = p->key_scores_rows > 0 && p->key_scores_rows < L ? L - p->key_scores_rows : 0;
    if (ksp) {
        ks.range[0] = s_begin;
        ks.range[1] = s_end;
    }
    if (s_begin >= s_end) return;

    const sdpa_dtype qdt = p->dtype, kvdt = pl->path.kv_dtype;
    const size_t qe = sdpa_dtype_size(qdt);
    const kv_source ksrc = kv_source_of(p, 0, kvdt, b, hkv, E), vsrc = kv_source_of(p, 1, kvdt, b, hkv, Ev);
    /* keys and values in steps, the next one asked for ahead (kv_source.h) */
    const int64_t kstep = kv_step_rows(E), vstep = kv_step_rows(Ev);
    T *qs = scratch + pl->scratch.q;  /* M x E, scaled   */
    T *st = scratch + pl->scratch.s;  /* M x tile_k scores */
    const int iqk = pl->path.integer_qk && sdpa_is_quantized(kvdt) && p->key.col_stride == 1 && ksrc.scale_view &&
                    sizeof(T) == sizeof(float);
    const int ipv = pl->path.integer_pv && sdpa_is_quantized(kvdt) && p->value.col_stride == 1 && vsrc.scale_view &&
                    sizeof(T) == sizeof(float);
    int8_t *q8 = iqk ? (int8_t *)(scratch + pl->scratch.qi) : NULL;
    float *q8s = iqk ? (float *)(void *)(q8 + ((size_t)M * (size_t)E + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN) : NULL;

    /* gathered tiles are read as rows of an array, back to back; MLA's latent
     * values (a column view of the keys, no scales) from the gathered keys,
     * where the values' walk cuts the tile into the keys' segments (the same
     * step: every row the values gather, the keys gathered) */
    sdpa_problem gathered;
    const sdpa_problem *rp = p;
    const char *latent = NULL;
    if (pl->row.gather) {
        gathered = *p;
        gathered.key.row_stride = ksrc.cols;
        gathered.value.row_stride = vsrc.cols;
        rp = &gathered;
        const int64_t off = (int64_t)((const char *)p->value.data - (const char *)p->key.data);
        if (kstep == vstep && !ksrc.scale_view && !vsrc.scale_view && p->value.row_stride == p->key.row_stride &&
            p->value.head_stride == p->key.head_stride && p->value.batch_strides[0] == p->key.batch_strides[0] &&
            off >= 0 && off % (int64_t)ksrc.elem == 0 && off / (int64_t)ksrc.elem + vsrc.cols <= ksrc.cols) {
            gathered.value.row_stride = ksrc.cols;
            latent = (const char *)(scratch + pl->scratch.gk) + off;  /* keys without scales: rows from the start */
        }
    }

    const T scale = (T)p->scale, cap = FN(softcap_value)(p);
    if (memo->pt != (const void *)pt || memo->g != g) {  /* the rows, unless this thread's last task prepared them */
        for (int x = 0; x < M; x++) {
            const int64_t h = hkv * group + x / L, l = x % L;
            const char *qr = (const char *)view_at(p, &p->query, b, h, qe) + l * p->query.row_stride * (int64_t)qe;
            if (qdt == TDT && p->query.col_stride == 1)
                kern->scale_copy(qs + (int64_t)x * E, (const T *)qr, E, scale);
            else
                FN(load_scaled)(qs + (int64_t)x * E, qr, E, p->query.col_stride, qdt, scale);
            if (iqk) FN(quantize_query)(qs + (int64_t)x * E, E, q8 + (int64_t)x * E, q8s + x);
        }
        memo->pt = pt;
        memo->g = g;
    }

    for (int64_t s0 = s_begin; s0 < s_end; s0 += tile_k) {
        if (should_stop(irq, tid)) return;
        const int n = (int)(s_end - s0 < tile_k ? s_end - s0 : tile_k);
        /* a tile is read by segments of contiguous rows: the whole tile, or
         * (paged) the part of it in each block; scores by column offset */
        FN(tile_products)(0, p, rp, pl, kern, scratch, qs, &ksrc, s0, n, kstep, NULL, st, acc);
        for (int x = 0; x < M; x++) {
            const int64_t h = hkv * group + x / L, l = x % L;
            T *sr = st + (int64_t)x * tile_k;
            const int64_t lim = p->causal ? l + p->causal_offset + 1 : s_end;
            const void *mask = FN(mask_at)(p, b, h);
            const T slope = p->alibi.data ? FN(head_value)(p, &p->alibi, b, h) : 0;
            FN(apply_row_modifiers)(p, kern, sr, l, s0, n, lim, mask ? FN(mask_row_of)(p, mask, l) : NULL, slope, cap);
            if (p->weights.data)
                FN(store_raw_scores)(p, (T *)view_at(p, &p->weights, b, h, sizeof(T)) + l * p->weights.row_stride, sr,
                                     1, s0, n);
            kern->row_online_softmax_update(sr, n, pmax + x, psum + x, acc + x * Ev, Ev);
            if (ksp && l >= ks_first) {  /* this tile's p, as of the row's max after it */
                if (pl->row.ks_local)  /* kept in cache for the task's own reduction */
                    memcpy(ksp + (int64_t)x * p->len_kv + s0, sr, (size_t)n * sizeof(T));
                else
                    stream_copy(ksp + (int64_t)x * p->len_kv + s0, sr, (size_t)n * sizeof(T));
            }
        }
        if (ksp) memcpy(ks_max + (s0 - s_begin) / tile_k * M, pmax, (size_t)M * sizeof(T));
        if (ipv) {
            FN(row_values_int)(p, pl, scratch, st, &vsrc, s0, n, vstep, acc);
            continue;
        }
        FN(tile_products)(1, p, rp, pl, kern, scratch, qs, &vsrc, s0, n, vstep, latent, st, acc);
    }
    if (ksp && !pl->row.ks_local) stream_done();
}

/* Key scores (sdpa.h), item i of a part (its task i): the chunk's keys, once
 * every row is finished (its lse written): each key the chunk visited gets
 * the sum over the group's counted rows x of p_x e^(m_x - lse_x), its weight
 * (p as of m_x, the row's max after the key's tile), written, or with `add`
 * added to its score; without `add` the chunk's other keys (and after the
 * last chunk, the call's keys past the part's) get 0.  The rows in a fixed
 * order: the same bits on any thread count. */
#define SDPA_KS_KEYS 1024  /* a row-path tile's keys at most, as blocking.c picks them */
static void FN(key_score_reduce)(const part *pt, int64_t i, const key_score_store *ks, int add,
                                 int64_t call_len_kv) {
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    const int64_t L = p->len_q, group = p->gqa_group, Hkv = p->num_heads / group, chunks = pl->row.num_chunks;
    const int M = pl->row.rows, tile_k = pl->blocking.tile_k;
    const int64_t g = i / chunks, c = i % chunks, b = g / Hkv, hkv = g % Hkv;
    const int64_t s_begin = ks->range[0], s_end = ks->range[1];
    const int64_t first = p->key_scores_rows > 0 && p->key_scores_rows < L ? L - p->key_scores_rows : 0;
    const T *probs = (const T *)ks->probs, *tile_max = (const T *)ks->tile_max;
    float *out = (float *)view_at(p, &p->key_scores, b, hkv, sizeof(float));
    const int64_t cs = p->key_scores.col_stride;
    if (!add) {  /* the keys no row of the chunk saw */
        const int64_t c0 = c * pl->blocking.chunk_len, c1 = c == chunks - 1 ? call_len_kv : c0 + pl->blocking.chunk_len;
        const int64_t seen0 = s_begin < s_end ? s_begin : c1, seen1 = s_begin < s_end ? s_end : c1;
        for (int64_t j = c0; j < seen0; j++) out[j * cs] = 0;
        for (int64_t j = seen1; j < c1; j++) out[j * cs] = 0;
    }
    T sums[SDPA_KS_KEYS], f[SDPA_MAX_PANEL];
    for (int64_t t0 = s_begin; t0 < s_end; t0 += tile_k) {
        const T *mt = tile_max + (t0 - s_begin) / tile_k * M;
        const int64_t t1 = s_end - t0 < tile_k ? s_end : t0 + tile_k;
        for (int64_t j0 = t0; j0 < t1; j0 += SDPA_KS_KEYS) {
            const int n = (int)(t1 - j0 < SDPA_KS_KEYS ? t1 - j0 : SDPA_KS_KEYS);
            int started = 0;  /* sums holds a row's terms (the first row's written, not added) */
            for (int x0 = 0; x0 < M; x0 += SDPA_MAX_PANEL) {
                const int nx = M - x0 < SDPA_MAX_PANEL ? M - x0 : SDPA_MAX_PANEL;
                for (int y = 0; y < nx; y++) {  /* e^(m - lse) = e^(m - m_row) / l_row, a sink's share included */
                    const int64_t h = hkv * group + (x0 + y) / L, l = (x0 + y) % L;
                    const T lse = ((const T *)view_at(p, &p->lse, b, h, sizeof(T)))[l * p->lse.row_stride];
                    /* a row not counted, or that sees no key (lse -inf) or none yet (m -inf), adds nothing */
                    f[y] = l < first || lse == -(T)INFINITY || mt[x0 + y] == -(T)INFINITY ? 0 : EXP(mt[x0 + y] - lse);
                }
                for (int y = 0; y < nx; y++) {
                    if (f[y] == 0) continue;
                    const T *restrict pr = probs + (int64_t)(x0 + y) * p->len_kv + j0;
                    T *restrict sm = sums;
                    const T fy = f[y];
                    if (started)
                        for (int j = 0; j < n; j++) sm[j] += pr[j] * fy;
                    else
                        for (int j = 0; j < n; j++) sm[j] = pr[j] * fy;
                    started = 1;
                }
            }
            if (!started)
                for (int j = 0; j < n; j++) sums[j] = 0;
            float *o = out + j0 * cs;
            if (cs == 1 && !add)
                for (int j = 0; j < n; j++) o[j] = (float)sums[j];
            else
                for (int j = 0; j < n; j++) o[j * cs] = add ? o[j * cs] + (float)sums[j] : (float)sums[j];
        }
    }
}
#undef SDPA_KS_KEYS
