/*
 * The fused attention driver for one compute type, included by attention.c with
 *   T     the compute type            SUF   the name suffix (f32, f64)
 *   KT    the kernel struct type      EXP   libm's exp for T
 *   TDT   the sdpa_dtype of T
 *
 * Query and out may be stored in another dtype than T (16-bit for T = float),
 * and so may key and value (pl->kv_dtype): the query is converted as it is
 * packed, key and value tiles into scratch before the kernels read them, and
 * the output as it is written.  Weights, lse and an additive mask are T.
 *
 * One task = (batch index, query head, block of query rows).  The block is cut
 * into panels of nr rows, kept transposed (Q^T, and the accumulator (P V)^T), so
 * that one vector spans nr query rows.  For each visible key block and panel:
 * scores^T = K (scale Q)^T, mask, online softmax (running max and sum, the
 * accumulator rescaled when the max grows), acc^T += V^T P^T.  The output is
 * acc / sum.  K and V are read in place, with their own strides.  Tasks are
 * independent and each is computed in a fixed order by one thread, so the
 * result does not depend on the number of threads.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)
/* The elements of operand `view` at (batch index b, head h). */
#define AT(view, b, h) ((T *)view_at(p, &p->view, b, h, sizeof(T)))

/* The mask at (batch index b, head h), or NULL without one. */
static const void *FN(mask_at)(const sdpa_problem *p, int64_t b, int64_t h) {
    if (p->mask_kind == SDPA_MASK_NONE) return NULL;
    return view_at(p, &p->mask, b, h, p->mask_kind == SDPA_MASK_BOOL ? 1 : sizeof(T));
}

/* Element i of a buffer of dtype dt, as T. */
static inline T FN(load)(const void *base, int64_t i, sdpa_dtype dt) {
    switch (dt) {
        case SDPA_BFLOAT16: return (T)sdpa_bf16_to_f32(((const uint16_t *)base)[i]);
        case SDPA_FLOAT16: return (T)sdpa_f16_to_f32(((const uint16_t *)base)[i]);
        case SDPA_FLOAT32: return (T)((const float *)base)[i];
        case SDPA_INT8: return (T)((const int8_t *)base)[i];  /* unscaled */
        default: return (T)((const double *)base)[i];
    }
}

/* Stores x as element i of a buffer of dtype dt. */
static inline void FN(store)(void *base, int64_t i, sdpa_dtype dt, T x) {
    switch (dt) {
        case SDPA_BFLOAT16: ((uint16_t *)base)[i] = sdpa_f32_to_bf16((float)x); break;
        case SDPA_FLOAT16: ((uint16_t *)base)[i] = sdpa_f32_to_f16((float)x); break;
        case SDPA_FLOAT32: ((float *)base)[i] = (float)x; break;
        default: ((double *)base)[i] = (double)x; break;
    }
}

/* dst[i] = scale * src[i * stride] for i < n, src of dtype dt. */
static void FN(load_scaled)(T *dst, const void *src, int64_t n, int64_t stride, sdpa_dtype dt, T scale) {
    if (dt == TDT) {
        const T *s = (const T *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = scale * s[i * stride];
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = scale * FN(load)(src, i * stride, dt);
    }
}

/* The scales of a quantized key or value view (kv_dtype SDPA_INT8, _INT4, or
 * a float8 type with scales). */
typedef struct FN(kv_scales) {
    const float *base;      /* at (batch index, key/value head); NULL: none    */
    int64_t rs, cs;         /* token and group strides                         */
    int64_t group;          /* channels per scale                              */
} FN(kv_scales);

static FN(kv_scales) FN(kv_scales_at)(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t hkv,
                                      int64_t cols) {
    FN(kv_scales) sc = {NULL, 0, 0, 1};
    if (!sdpa_is_quantized(p->kv_dtype) || !view->data) return sc;
    /* paged: a placeholder, replaced by each block's scales before any read */
    sc.base = p->block_size > 0 ? (const float *)view->data : (const float *)view_at(p, view, b, hkv, sizeof(float));
    sc.rs = view->row_stride;
    sc.cs = view->col_stride;
    sc.group = p->kv_group_size > 0 ? p->kv_group_size : (cols > 0 ? cols : 1);
    return sc;
}

/* Rows [s0, s0 + n) of a key or value view (dt elements) as T, row-major with
 * ld = cols, in buf: with a widening kernel for contiguous 16-bit rows;
 * quantized rows times their scales (sc; none when sc->base is NULL). */
static void FN(convert_rows)(const KT *kern, T *buf, const char *base, const sdpa_view *view, sdpa_dtype dt,
                             int64_t s0, int n, int64_t cols, const FN(kv_scales) *sc) {
    const size_t elem = sdpa_dtype_size(dt);
    if (dt == SDPA_INT8) {  /* (float)q * scale, in float: the values cache.keys shows */
        const int64_t cs = view->col_stride, g = sc->group;
        for (int j = 0; j < n; j++) {
            const int8_t *row = (const int8_t *)base + (s0 + j) * view->row_stride;
            const float *srow = sc->base + (s0 + j) * sc->rs;
            T *dst = buf + (int64_t)j * cols;
            for (int64_t c0 = 0; c0 < cols; c0 += g) {
                const float f = srow[(c0 / g) * sc->cs];
                if (cs == 1)
                    for (int64_t c = c0; c < c0 + g; c++) dst[c] = (T)((float)row[c] * f);
                else
                    for (int64_t c = c0; c < c0 + g; c++) dst[c] = (T)((float)row[c * cs] * f);
            }
        }
        return;
    }
    if (sdpa_is_quantized(dt)) {  /* float8 and int4 alike: each value times its scale, if any */
        const int64_t cs = dt == SDPA_INT4 ? 1 : view->col_stride, g = sc->group;
        for (int j = 0; j < n; j++) {
            const uint8_t *row = (const uint8_t *)base + (s0 + j) * view->row_stride;
            T *dst = buf + (int64_t)j * cols;
            if (!sc->base) {
                for (int64_t c = 0; c < cols; c++) dst[c] = (T)sdpa_quantized_value(dt, row, c * cs);
                continue;
            }
            const float *srow = sc->base + (s0 + j) * sc->rs;
            for (int64_t c0 = 0; c0 < cols; c0 += g) {
                const float f = srow[(c0 / g) * sc->cs];
                for (int64_t c = c0; c < c0 + g; c++) dst[c] = (T)(sdpa_quantized_value(dt, row, c * cs) * f);
            }
        }
        return;
    }
    for (int j = 0; j < n; j++) {
        const char *row = base + (s0 + j) * view->row_stride * (int64_t)elem;
        T *dst = buf + (int64_t)j * cols;
        if (view->col_stride == 1 && (dt == SDPA_BFLOAT16 || dt == SDPA_FLOAT16)) {
            kern->widen(dt, (const uint16_t *)row, dst, cols);
            continue;
        }
        if (view->col_stride == 1 && dt == TDT) {  /* paged blocks copied together */
            memcpy(dst, row, (size_t)cols * sizeof(T));
            continue;
        }
        for (int64_t c = 0; c < cols; c++) dst[c] = FN(load)(row, c * view->col_stride, dt);
    }
}

/* convert_rows over rows [s0, s0 + n) of key/value head (b, hkv): by the
 * segments of the range in each block when paged. */
static void FN(convert_range)(const sdpa_problem *p, const KT *kern, T *buf, const char *base, const sdpa_view *view,
                              sdpa_dtype dt, int64_t b, int64_t hkv, int64_t s0, int n, int64_t cols,
                              const FN(kv_scales) *sc) {
    if (p->block_size <= 0) {
        FN(convert_rows)(kern, buf, base, view, dt, s0, n, cols, sc);
        return;
    }
    const sdpa_view *scales = view == &p->key ? &p->key_scale : &p->value_scale;
    const size_t elem = sdpa_dtype_size(dt);
    int64_t blk = s0 / p->block_size, row = s0 % p->block_size;
    for (int64_t a = s0, m = 0; a < s0 + n; a += m, blk++, row = 0) {
        const int64_t left = p->block_size - row;
        m = left < s0 + n - a ? left : s0 + n - a;
        FN(kv_scales) seg = *sc;
        if (sc->base) seg.base = (const float *)paged_block_row(p, scales, b, hkv, blk, row, sizeof(float));
        FN(convert_rows)(kern, buf + (a - s0) * cols, paged_block_row(p, view, b, hkv, blk, row, elem), view, dt, 0,
                         (int)m, cols, &seg);
    }
}

/* m + log(l): the row's log-sum-exp; -inf for a row that saw no key. */
static T FN(log_sum_exp)(T m, T l) {
    if (l == 0) return -(T)INFINITY;
    return m + (T)log((double)l);
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

/* The log-sum-exp of a row with a sink logit: log(sum_s e^x_s + e^sink) from
 * m, l = sum_s e^(x_s - m); the sink alone when no key was visible (l = 0). */
static T FN(log_sum_exp_sink)(T m, T l, T sink) {
    if (l == 0) return sink;
    if (sink == (T)INFINITY && l == l && m == m) return sink;  /* the limit, not inf - inf */
    const double md = (double)m, sd = (double)sink;
    const double top = md > sd ? md : sd;  /* NaN in either gives NaN below */
    return (T)(top + log((double)l * exp(md - top) + exp(sd - top)));
}

/* The softcap in T, clamped to T's normal range: a finite cap beyond T (above
 * FLT_MAX in a float32 problem) would make cap * tanh(...) inf * 0, and one
 * below it (a subnormal, or 0 once rounded) 2 / cap infinite, NaN for a score
 * of 0.  Within the kernels' absolute error, a few ulp of the cap, the scores
 * are the same. */
static T FN(softcap_value)(const sdpa_problem *p) {
    const double lo = TDT == SDPA_FLOAT64 ? DBL_MIN : FLT_MIN, hi = TDT == SDPA_FLOAT64 ? DBL_MAX : FLT_MAX;
    return (T)(p->softcap < lo ? lo : p->softcap > hi ? hi : p->softcap);
}

/* The ALiBi slope or the sink logit of (b, h), from a view of the compute type. */
static T FN(head_value)(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h) {
    return *(const T *)view_at(p, view, b, h, sizeof(T));
}

/* ALiBi on a transposed score tile (tiled path): st[j * nr + x] -= slope *
 * |r0 + x + align_offset - (s0 + j)| for n keys from s0 and query rows r0..r0+rows. */
static void FN(add_alibi_tile)(const sdpa_problem *p, T *st, int nr, int64_t r0, int rows, int64_t s0, int n,
                               T slope) {
    for (int j = 0; j < n; j++) {
        const T base = (T)(r0 + p->align_offset - (s0 + j));
        T *sj = st + (int64_t)j * nr;
        for (int x = 0; x < rows; x++) {  /* contiguous: vectorised */
            const T d = base + (T)x;
            sj[x] -= slope * (d < 0 ? -d : d);
        }
    }
}

/* ALiBi on n scores of query row l from key s0 (row path): sr[j] -= slope *
 * |l + align_offset - (s0 + j)|. */
static void FN(add_alibi_row)(const sdpa_problem *p, T *sr, int64_t l, int64_t s0, int n, T slope) {
    const T base = (T)(l + p->align_offset - s0);
    for (int j = 0; j < n; j++) {  /* contiguous: vectorised */
        const T d = base - (T)j;
        sr[j] -= slope * (d < 0 ? -d : d);
    }
}

/* Applies the mask row, then causality (keys >= lim are masked, whatever the
 * additive mask added there), to n scores of one query row starting at key s0;
 * the scores are sr[j * ss].  mask_row is NULL without a mask. */
static void FN(mask_scores)(const sdpa_problem *p, const void *mask_row, T *sr, int64_t ss,
                            int64_t s0, int n, int64_t lim) {
    if (p->mask_kind == SDPA_MASK_ADDITIVE) {
        const T *mr = (const T *)mask_row;
        for (int j = 0; j < n; j++) sr[j * ss] += mr[(s0 + j) * p->mask.col_stride];
    } else if (p->mask_kind == SDPA_MASK_BOOL) {
        const uint8_t *mr = (const uint8_t *)mask_row;
        for (int j = 0; j < n; j++)
            if (!mr[(s0 + j) * p->mask.col_stride]) sr[j * ss] = -(T)INFINITY;
    }
    int64_t first = lim - s0;
    for (int64_t j = first < 0 ? 0 : first; j < n; j++) sr[j * ss] = -(T)INFINITY;
}

/* The mask row of query row `row`, from the mask of one (batch, head). */
static const void *FN(mask_row_of)(const sdpa_problem *p, const void *mask, int64_t row) {
    const int64_t elem = p->mask_kind == SDPA_MASK_BOOL ? 1 : (int64_t)sizeof(T);
    return (const char *)mask + row * p->mask.row_stride * elem;
}

/* Asks for the mask of rows [r0, r0 + rows) and keys [s0, s0 + n), when its
 * keys are contiguous: issued a panel ahead, so that a dense mask streams in
 * while the products of the panel before run. */
static void FN(prefetch_mask)(const sdpa_problem *p, const void *mask, int64_t r0, int64_t rows, int64_t s0, int64_t n) {
    if (p->mask.col_stride != 1 || n <= 0) return;
    const int64_t elem = p->mask_kind == SDPA_MASK_BOOL ? 1 : (int64_t)sizeof(T);
    if (p->mask.row_stride == 0) rows = rows > 0 ? 1 : 0;  /* one row for all */
    for (int64_t x = 0; x < rows; x++) {
        const char *m = (const char *)FN(mask_row_of)(p, mask, r0 + x) + s0 * elem;
        for (int64_t o = 0; o < n * elem; o += 64) __builtin_prefetch(m + o, 0, 1);
    }
}

/* What a bool mask does to the tile of rows r0..r0+prows and keys s0..s0+n: 1
 * when it changes nothing (every element True), 2 when it hides everything, 0
 * otherwise (and for masks whose keys are not contiguous).  Additive masks are
 * always applied: reading them twice would cost more than adding zeros, and an
 * additive -inf must not hide a tile (-inf + NaN is NaN: the NaN contract). */
static int FN(mask_tile_class)(const sdpa_problem *p, const void *mask, int64_t r0, int prows, int64_t s0, int n) {
    if (p->mask_kind != SDPA_MASK_BOOL || p->mask.col_stride != 1 || n == 0) return TILE_MIXED;
    const int rows = p->mask.row_stride == 0 ? 1 : prows;  /* a mask broadcast over rows has one */
    int all = 1, none = 1;
    for (int x = 0; x < rows && (all || none); x++) {
        const uint8_t *m = (const uint8_t *)FN(mask_row_of)(p, mask, r0 + x) + s0;
        unsigned char any_hidden = 0, any_visible = 0;
        for (int j = 0; j < n; j++) {
            any_hidden |= m[j] == 0;
            any_visible |= m[j] != 0;
        }
        all &= !any_hidden;
        none &= !any_visible;
    }
    return all ? TILE_ALL_VISIBLE : none ? TILE_NONE_VISIBLE : TILE_MIXED;
}

/* The mask of rows r0..r0+prows on the transposed tile st (n keys x nr rows,
 * keys from s0), then causality: with a kernel a block at a time where the
 * mask's keys are contiguous, else element by element. */
static void FN(mask_tile)(const sdpa_problem *p, const KT *kern, const void *mask, T *st, int nr, int64_t r0, int prows,
                          int64_t s0, int n, int64_t kv_end) {
    if (mask) {
        const int64_t rs = p->mask.row_stride;
        if (p->mask.col_stride == 1 && p->mask_kind == SDPA_MASK_BOOL) {
            kern->mask_bool(st, nr, n, prows, (const uint8_t *)FN(mask_row_of)(p, mask, r0) + s0, rs);
        } else if (p->mask.col_stride == 1 && p->mask_kind == SDPA_MASK_ADDITIVE) {
            kern->mask_add(st, nr, n, prows, (const T *)FN(mask_row_of)(p, mask, r0) + s0, rs);
        } else {
            for (int x = 0; x < prows; x++)
                FN(mask_scores)(p, FN(mask_row_of)(p, mask, r0 + x), st + x, nr, s0, n, kv_end);
        }
    }
    if (p->causal) {  /* key s0 + j is hidden from the rows x < s0 + j - r0 - offset */
        const int64_t first = s0 - r0 - p->causal_offset;
        for (int j = 0; j < n; j++) {
            int64_t hidden = first + j;
            if (hidden <= 0) continue;
            if (hidden > prows) hidden = prows;
            for (int64_t x = 0; x < hidden; x++) st[(int64_t)j * nr + x] = -(T)INFINITY;
        }
    }
    if (has_window(p)) {  /* key s is seen by the rows l in [s - o - right, s - o + left] */
        const int64_t o = p->align_offset;
        if (p->window_right >= 0) {  /* rows x < s - o - right - r0 are hidden: keys past r0 + o + right */
            int64_t j = r0 + o + p->window_right + 1 - s0;
            for (j = j < 0 ? 0 : j; j < n; j++) {
                int64_t below = s0 + j - o - p->window_right - r0;
                if (below > prows) below = prows;
                T *sj = st + j * nr;
                for (int64_t x = 0; x < below; x++) sj[x] = -(T)INFINITY;
            }
        }
        if (p->window_left >= 0) {  /* rows x >= s - o + left - r0 + 1 are hidden: keys before r0 + prows - 1 + o - left */
            int64_t end = r0 + prows - 1 + o - p->window_left - s0;
            if (end > n) end = n;
            for (int64_t j = 0; j < end; j++) {
                int64_t above = s0 + j - o + p->window_left - r0 + 1;
                if (above < 0) above = 0;
                T *sj = st + j * nr;
                for (int64_t x = above; x < prows; x++) sj[x] = -(T)INFINITY;
            }
        }
    }
}

/* Raw scores of -inf (weights of 0) for a tile of hidden keys that is skipped. */
static void FN(hide_in_weights)(const sdpa_problem *p, T *weights, int64_t r0, int prows, int64_t s0, int n) {
    for (int x = 0; x < prows; x++) {
        T *wr = weights + (r0 + x) * p->weights.row_stride;
        for (int j = 0; j < n; j++) wr[(s0 + j) * p->weights.col_stride] = -(T)INFINITY;
    }
}

/* Raw (scaled, masked) scores sr[j * ss] of one row into its weights row from
 * key s0 on; normalize_weights turns them into weights once the row is done. */
static void FN(store_raw_scores)(const sdpa_problem *p, T *wr, const T *sr, int64_t ss, int64_t s0,
                                 int n) {
    for (int j = 0; j < n; j++) wr[(s0 + j) * p->weights.col_stride] = sr[j * ss];
}

/* Panel pn of a task's query rows from l0 on, scaled, as Q^T (E x nr) in panel. */
static void FN(pack_panel)(const sdpa_problem *p, const KT *kern, T *panel, const char *q, int64_t l0, int pn) {
    const int64_t L = p->len_q, E = p->head_dim;
    const int nr = kern->nr;
    const int64_t r0 = l0 + (int64_t)pn * nr;
    const int prows = (int)(L - r0 < nr ? L - r0 : nr);
    const sdpa_dtype qdt = p->dtype;
    const size_t qe = sdpa_dtype_size(qdt);
    const char *q0 = q + r0 * p->query.row_stride * (int64_t)qe;
    const T scale = (T)p->scale;
    if (qdt == TDT && p->query.col_stride == 1) {
        kern->pack_q(panel, nr, (const T *)q0, prows, p->query.row_stride, E, scale);
        return;
    }
    if (qdt != TDT && p->query.col_stride == 1) {  /* 16-bit, widened */
        kern->pack_q_half(qdt, panel, nr, (const uint16_t *)q0, prows, p->query.row_stride, E, scale);
        return;
    }
    for (int64_t c = 0; c < E; c++) {  /* contiguous stores, strided loads */
        T *pc = panel + c * nr;
        FN(load_scaled)(pc, q0 + c * p->query.col_stride * (int64_t)qe, prows, p->query.row_stride, qdt, scale);
        for (int x = prows; x < nr; x++) pc[x] = 0;
    }
}

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

/* Part `part` of `parts` of what a task reads first, its query rows and first
 * key and value tile: asked for while an earlier task computes, so that a run
 * of short tasks (few keys each) does not wait on memory at each start. */
static void FN(prefetch_task)(const sdpa_problem *p, const plan *pl, int64_t task, int part, int parts) {
    if (task >= pl->num_tasks) return;
    int64_t qb, bh;
    task_coords(p, pl, task, &qb, &bh);
    const int64_t b = bh / p->num_heads, h = bh % p->num_heads, hkv = h / p->gqa_group;
    const size_t qe = sdpa_dtype_size(p->dtype), kve = sdpa_dtype_size(pl->kv_dtype);
    const int64_t l0 = qb * pl->tile_q;
    const int64_t rows = p->len_q - l0 < pl->tile_q ? p->len_q - l0 : pl->tile_q;
    const int64_t S_b = key_limit(p, b);
    const int64_t keys = S_b < pl->tile_k ? S_b : pl->tile_k;
    const int64_t q0 = rows * part / parts, q1 = rows * (part + 1) / parts;
    const int64_t k0 = keys * part / parts, k1 = keys * (part + 1) / parts;
    FN(prefetch_rows)((const char *)view_at(p, &p->query, b, h, qe), &p->query, qe, l0 + q0, q1 - q0,
                      p->head_dim, 0);
    if (p->block_size > 0) return;  /* paged: the first block's rows would need its table */
    FN(prefetch_rows)((const char *)view_at(p, &p->key, b, hkv, kve), &p->key, kve, k0, k1 - k0, p->head_dim, 0);
    FN(prefetch_rows)((const char *)view_at(p, &p->value, b, hkv, kve), &p->value, kve, k0, k1 - k0,
                      p->head_dim_v, 0);
}

#if HAS_BF16
/* (lo, hi) in one 32-bit pair, lo in the low half */
static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* Rows [s0, s0 + n) of a bfloat16 key view as pairs along E: dst[j*ld + p]
 * for p < ceil(E/2), an odd E padded with zero, and zero pairs up to ld (K not
 * readable in place, or padded to whole tiles). */
static void bf16_pack_rows(uint32_t *dst, int64_t ld, const uint16_t *base, const sdpa_view *view, int64_t s0, int n,
                           int64_t E) {
    const int64_t E2 = (E + 1) / 2;
    for (int j = 0; j < n; j++) {
        const uint16_t *row = base + (s0 + j) * view->row_stride;
        uint32_t *d = dst + (int64_t)j * ld;
        if (view->col_stride == 1 && E % 2 == 0) {
            memcpy(d, row, (size_t)E2 * 4);  /* the pairs as they lie */
        } else {
            for (int64_t p = 0; p < E2; p++) {
                const uint16_t lo = row[2 * p * view->col_stride];
                const uint16_t hi = 2 * p + 1 < E ? row[(2 * p + 1) * view->col_stride] : 0;
                d[p] = bf16_pair(lo, hi);
            }
        }
        for (int64_t p = E2; p < ld; p++) d[p] = 0;
    }
}

/* Rows [s0, s0 + n) of a bfloat16 value view (s0 even) as pairs along the
 * keys in the layout of the kernel set, pair p of feature c at
 * dst[c * ld + p] (by feature) or dst[p * ld + c]: with the set's kernel for
 * contiguous rows, else element by element. */
static void bf16_pack_values(const kernels_f32 *kern, uint32_t *dst, int64_t ld, const uint16_t *base,
                             const sdpa_view *view, int64_t s0, int n, int64_t Ev) {
    const int64_t rs = view->row_stride, cs = view->col_stride;
    const int byf = kern->bf16.values_by_feature;
    if (cs == 1) {
        kern->bf16.pack_v_pairs(byf, dst, ld, base + s0 * rs, rs, n, Ev);
        return;
    }
    for (int p = 0; 2 * p < n; p++) {
        const uint16_t *r0 = base + (s0 + 2 * p) * rs;
        const int two = 2 * p + 1 < n;
        for (int64_t c = 0; c < Ev; c++) {
            const uint32_t w = bf16_pair(r0[c * cs], two ? r0[rs + c * cs] : 0);
            if (byf) dst[c * ld + p] = w;
            else dst[(int64_t)p * ld + c] = w;
        }
    }
}

/* bf16_pack_rows and bf16_pack_values over rows [s0, s0 + n) of key/value head
 * (b, hkv), by the segments of the range in each block when paged (the blocks
 * hold an even number of rows: pairs never straddle two). */
static void bf16_pack_rows_of(const sdpa_problem *p, uint32_t *dst, int64_t ld, const uint16_t *base, int64_t b,
                              int64_t hkv, int64_t s0, int n, int64_t E) {
    if (p->block_size <= 0) {
        bf16_pack_rows(dst, ld, base, &p->key, s0, n, E);
        return;
    }
    int64_t blk = s0 / p->block_size, row = s0 % p->block_size;
    for (int64_t a = s0, m = 0; a < s0 + n; a += m, blk++, row = 0) {
        const int64_t left = p->block_size - row;
        m = left < s0 + n - a ? left : s0 + n - a;
        bf16_pack_rows(dst + (a - s0) * ld, ld, (const uint16_t *)paged_block_row(p, &p->key, b, hkv, blk, row, 2),
                       &p->key, 0, (int)m, E);
    }
}

static void bf16_pack_values_of(const sdpa_problem *p, const kernels_f32 *kern, uint32_t *dst, int64_t ld,
                                const uint16_t *base, int64_t b, int64_t hkv, int64_t s0, int n, int64_t Ev) {
    if (p->block_size <= 0) {
        bf16_pack_values(kern, dst, ld, base, &p->value, s0, n, Ev);
        return;
    }
    const int byf = kern->bf16.values_by_feature;
    int64_t blk = s0 / p->block_size, row = s0 % p->block_size;
    for (int64_t a = s0, m = 0; a < s0 + n; a += m, blk++, row = 0) {
        const int64_t left = p->block_size - row;
        m = left < s0 + n - a ? left : s0 + n - a;
        const int64_t pairs = (a - s0) / 2;
        bf16_pack_values(kern, dst + (byf ? pairs : pairs * ld), ld,
                         (const uint16_t *)paged_block_row(p, &p->value, b, hkv, blk, row, 2), &p->value, 0, (int)m,
                         Ev);
    }
}

/* Panel pn of a task's query rows from l0 on as bfloat16 pairs, [E2][nr],
 * unscaled (the scale is applied to the float scores: rounding a scaled query
 * to bfloat16 would add error). */
static void bf16_pack_panel(const sdpa_problem *p, const kernels_f32 *kern, uint32_t *panel, const uint16_t *q,
                            int64_t l0, int pn, int64_t E2p) {
    const int64_t L = p->len_q, E = p->head_dim, E2 = (E + 1) / 2;
    const int nr = kern->nr;
    const int64_t r0 = l0 + (int64_t)pn * nr;
    const int prows = (int)(L - r0 < nr ? L - r0 : nr);
    const int64_t rs = p->query.row_stride, cs = p->query.col_stride;
    memset(panel + E2 * nr, 0, (size_t)(E2p - E2) * nr * 4);  /* pairs padded to whole tiles: zeros */
    if (E % 2 == 0 && cs == 1) {
        kern->bf16.pack_q_pairs(panel, q + r0 * rs, prows, rs, E2);
        return;
    }
    for (int64_t pr = 0; pr < E2; pr++) {
        uint32_t *pc = panel + pr * nr;
        for (int x = 0; x < prows; x++) {
            const uint16_t *qr = q + (r0 + x) * rs;
            pc[x] = bf16_pair(qr[2 * pr * cs], 2 * pr + 1 < E ? qr[(2 * pr + 1) * cs] : 0);
        }
        for (int x = prows; x < nr; x++) pc[x] = 0;
    }
}
#endif

#if HAS_BF16
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

/* The key/value slice (batch index, key/value head) of packing unit u, and the
 * keys [s0, s0 + n) it packs; 0 when there are none. */
static int FN(pack_unit)(const sdpa_problem *p, const plan *pl, int64_t u, int64_t *b, int64_t *hkv, int64_t *s0,
                         int *n) {
    const int64_t per = (p->len_kv + pl->pack_chunk - 1) / pl->pack_chunk;
    const int64_t slice = u / per, Hkv = p->num_heads / p->gqa_group;
    *b = slice / Hkv;
    *hkv = slice % Hkv;
    *s0 = (u % per) * pl->pack_chunk;
    const int64_t S_b = key_limit(p, *b);
    if (*s0 >= S_b) return 0;
    *n = (int)(S_b - *s0 < pl->pack_chunk ? S_b - *s0 : pl->pack_chunk);
    return 1;
}

/* Packing unit u of the call buffer (pl->kv_packed): the keys of one chunk of
 * one key/value slice into the layout the products read, once per call for
 * every query block and every query head of the GQA group. */
static void FN(pack_kv_unit)(const sdpa_problem *p, const plan *pl, const KT *kern, T *callbuf, int64_t u) {
    int64_t b, hkv, s0;
    int n;
    if (!FN(pack_unit)(p, pl, u, &b, &hkv, &s0, &n)) return;
    const int64_t E = p->head_dim, Ev = p->head_dim_v;
    T *slice = callbuf + (b * (p->num_heads / p->gqa_group) + hkv) * (int64_t)pl->slice_elems;
    const sdpa_dtype kvdt = pl->kv_dtype;
    const size_t kve = sdpa_dtype_size(kvdt);
#if HAS_BF16
    if (pl->bf16) {  /* V pairs; K read in place, or as pairs padded to whole tiles */
        const int paged = p->block_size > 0;  /* then rows are found per block */
        const uint16_t *v = paged ? NULL : (const uint16_t *)view_at(p, &p->value, b, hkv, 2);
        const uint16_t *k = paged ? NULL : (const uint16_t *)view_at(p, &p->key, b, hkv, 2);
        uint32_t *vp = (uint32_t *)slice + pl->slice_k;
        if (pl->slice_k)  /* K pairs padded to whole tiles */
            bf16_pack_rows_of(p, (uint32_t *)slice + s0 * pl->e2p, pl->e2p, k, b, hkv, s0, n, E);
        if (kern->bf16.values_by_feature)
            bf16_pack_values_of(p, kern, vp + s0 / 2, pl->vp_ld, v, b, hkv, s0, n, Ev);
        else
            bf16_pack_values_of(p, kern, vp + s0 / 2 * Ev, Ev, v, b, hkv, s0, n, Ev);
        return;
    }
#endif
    const int paged = p->block_size > 0;
    const char *k = paged ? NULL : (const char *)view_at(p, &p->key, b, hkv, kve);
    const char *v = paged ? NULL : (const char *)view_at(p, &p->value, b, hkv, kve);
    const FN(kv_scales) kscl = FN(kv_scales_at)(p, &p->key_scale, b, hkv, E);
    const FN(kv_scales) vscl = FN(kv_scales_at)(p, &p->value_scale, b, hkv, Ev);
    FN(convert_range)(p, kern, slice + s0 * E, k, &p->key, kvdt, b, hkv, s0, n, E, &kscl);
    FN(convert_range)(p, kern, slice + pl->slice_k + s0 * Ev, v, &p->value, kvdt, b, hkv, s0, n, Ev, &vscl);
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

static void FN(run_task)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch, const T *callbuf,
                         int64_t task, interrupt_state *irq, int tid) {
    const int64_t H = p->num_heads, L = p->len_q;
    const int64_t E = p->head_dim, Ev = p->head_dim_v;
    const int tile_q = pl->tile_q, tile_k = pl->tile_k, nr = pl->nr;
    uint64_t *prof = pl->profile ? (uint64_t *)(scratch + pl->off_prof) : NULL;
    uint64_t prof_t = prof ? prof_ticks() : 0;

    int64_t qb, bh;
    task_coords(p, pl, task, &qb, &bh);
    const int64_t b = bh / H, h = bh % H, hkv = h / p->gqa_group;
    /* paged: float K and V of the compute type are read in place, the block of
     * each segment of a tile looked up as the products read it; other K/V are
     * widened or paired by block segments (K pairs never in place) */
    const int paged = p->block_size > 0;
    sdpa_problem local;
    if (paged) {  /* rows at the sequence's end */
        local = *p;
        paged_positions(&local, b);
        p = &local;
    }

    const sdpa_dtype qdt = p->dtype, kvdt = pl->kv_dtype;
    const char *q = (const char *)view_at(p, &p->query, b, h, sdpa_dtype_size(qdt));
    const char *k = paged ? NULL : (const char *)view_at(p, &p->key, b, hkv, sdpa_dtype_size(kvdt));
    const char *v = paged ? NULL : (const char *)view_at(p, &p->value, b, hkv, sdpa_dtype_size(kvdt));
    char *out = (char *)view_at(p, &p->out, b, h, sdpa_dtype_size(qdt));
    const void *mask = FN(mask_at)(p, b, h);
    T *weights = p->weights.data ? AT(weights, b, h) : NULL;
    /* this task's key/value slice in the call buffer, when packed once */
    const T *slice = pl->kv_packed ? callbuf + (b * (H / p->gqa_group) + hkv) * (int64_t)pl->slice_elems : NULL;
#if HAS_BF16
    const int bf16 = pl->bf16;  /* bfloat16 pairs and gemm_bf16 (float instance only) */
#endif
    /* float K and V: in place (T elements), from the call buffer, or converted (or, paged,
     * copied) a tile at a time (make_plan) */
    const int convert_kv = pl->convert_kv;
    const int64_t ksr = convert_kv ? E : p->key.row_stride, ksc = convert_kv ? 1 : p->key.col_stride;
    const int64_t vsr = convert_kv ? Ev : p->value.row_stride, vsc = convert_kv ? 1 : p->value.col_stride;
    const FN(kv_scales) kscl = FN(kv_scales_at)(p, &p->key_scale, b, hkv, E);
    const FN(kv_scales) vscl = FN(kv_scales_at)(p, &p->value_scale, b, hkv, Ev);
    const int paged_products = paged && !slice && !convert_kv;  /* the products read the blocks */
    T *kbuf = scratch + pl->off_k;   /* a K tile as T, tile_k x E (convert_kv, not packed) */
    T *vbuf = scratch + pl->off_v;   /* a V tile as T, tile_k x Ev                          */

    T *qt = scratch + pl->off_q;     /* panels of Q^T, each E x nr, scaled (bf16: E2 x nr pairs) */
    T *acc = scratch + pl->off_acc;  /* panels of (P V)^T, each Ev x nr      */
    T *st = scratch + pl->off_s;     /* one score tile, keys x nr            */
    T *row_m = scratch + pl->off_m;
    T *row_l = scratch + pl->off_l;
#if HAS_BF16
    const T scale = (T)p->scale;
    const int64_t E2 = pl->e2p;  /* pairs of a K row and a panel column block, padded to whole tiles */
    const int64_t qpanel = bf16 ? E2 : E;  /* elements of a panel column block */
    uint32_t *pp = (uint32_t *)(scratch + pl->off_pp);  /* P^T pairs, [tile_k / 2][nr] */
    uint32_t *vp = (uint32_t *)(scratch + pl->off_vp);  /* V pairs of a tile, when not packed */
    uint32_t *kp = (uint32_t *)(scratch + pl->off_k);   /* K pairs of a tile when not in place, [tile_k][E2] */
    uint32_t *vtail = (uint32_t *)(scratch + pl->off_vt);  /* the last V pairs of an odd key count, [Ev][16] */
    /* K read in place when its rows are whole pairs, 32-bit aligned */
    const int k_in_place = paged ? 2 * E2 == E && paged_pairs_in_place(p)
                                 : E % 2 == 0 && 2 * E2 == E && p->key.col_stride == 1 &&
                                       p->key.row_stride % 2 == 0 && ((uintptr_t)k & 3) == 0;
    /* feature c's pair p at vbase[c * vp_rs + p * vp_ks]: P V's a, in its kernel's layout */
    const int byf = bf16 && kern->bf16.values_by_feature;
    const int64_t vp_ld = slice ? (byf ? pl->vp_ld : Ev) : (byf ? (tile_k + 1) / 2 : Ev);
    const int64_t vp_rs = byf ? vp_ld : 1, vp_ks = byf ? 1 : Ev;
    /* the scale folded into the softmax: it must come before a softcap, ALiBi, an
     * additive mask or raw weights, and a bool mask, causality and windows put
     * -inf, which any scale > 0 keeps */
    const int fold = bf16 && scale > 0 && scale < (T)INFINITY && p->softcap == 0 && !p->alibi.data &&
                     p->mask_kind != SDPA_MASK_ADDITIVE && !weights;
#else
    const int64_t qpanel = E;
#endif

    const int64_t l0 = qb * tile_q;
    const int rows = (int)(L - l0 < tile_q ? L - l0 : tile_q);
    const int panels = (rows + nr - 1) / nr;

    for (int x = 0; x < panels * nr; x++) {
        row_m[x] = -(T)INFINITY;
        row_l[x] = 0;
    }
    for (int64_t x = 0; x < (int64_t)panels * nr * Ev; x++) acc[x] = 0;

    /* keys past kv_end are masked for every row of the task: never visited */
    const int64_t S_b = key_limit(p, b);
    int64_t kv_end = S_b;
    if (p->causal) {
        int64_t last = l0 + rows + p->causal_offset;  /* exclusive */
        kv_end = last < 0 ? 0 : (last < S_b ? last : S_b);
    }
    /* keys a window shows no row of the task are never visited either; the
     * tiles stay on the grid of tile_k keys */
    const int win = has_window(p);
    int64_t kv_begin = 0;
    if (win) {
        const int64_t we = window_end(p, l0 + rows - 1);
        if (we < kv_end) kv_end = we;
        kv_begin = window_first(p, l0) / tile_k * tile_k;
    }
    const T slope = p->alibi.data ? FN(head_value)(p, &p->alibi, b, h) : 0;
    const T cap = FN(softcap_value)(p);
    T *lse = p->lse.data ? AT(lse, b, h) : NULL;
    const int rows_vec = p->out.col_stride == 1;
    int packed = 0;  /* panels of Q packed so far */
    int64_t scores = 0;  /* computed, for the profile */

#if HAS_BF16
    unsigned callbacks = tid == 0 ? irq->callbacks : 0;
#endif
    for (int64_t s0 = kv_begin; s0 < kv_end; s0 += tile_k) {
        if (should_stop(irq, tid)) return;  /* the output is unspecified then */
#if HAS_BF16
        if (bf16 && tid == 0 && irq->callbacks != callbacks) {
            /* the interrupt callback ran (Python code: it may have used the tiles) */
            callbacks = irq->callbacks;
            kern->bf16.tiles_begin();
        }
#endif
        const int n = (int)(kv_end - s0 < tile_k ? kv_end - s0 : tile_k);
        const T *kt = paged ? NULL : (const T *)k + s0 * ksr, *vt = paged ? NULL : (const T *)v + s0 * vsr;
#if HAS_BF16
        const uint32_t *kpt = NULL, *vpt = NULL;
        int64_t k_rs = E2;
        if (bf16) {
            if (slice && pl->slice_k) {  /* packed for the call */
                kpt = (const uint32_t *)slice + s0 * E2;
            } else if (k_in_place) {  /* paged: by block segments in the product */
                kpt = paged ? NULL : (const uint32_t *)((const uint16_t *)k + s0 * p->key.row_stride);
                k_rs = p->key.row_stride / 2;
            } else {
                bf16_pack_rows_of(p, kp, E2, (const uint16_t *)k, b, hkv, s0, n, E);
                kpt = kp;
            }
            if (slice) {
                vpt = (const uint32_t *)slice + pl->slice_k + (byf ? s0 / 2 : s0 / 2 * Ev);
            } else {
                bf16_pack_values_of(p, kern, vp, vp_ld, (const uint16_t *)v, b, hkv, s0, n, Ev);
                vpt = vp;
            }
        } else
#endif
        if (slice) {  /* converted once for the call */
            kt = slice + s0 * E;
            vt = slice + pl->slice_k + s0 * Ev;
        } else if (convert_kv) {  /* once per tile, for every panel */
            FN(convert_range)(p, kern, kbuf, k, &p->key, kvdt, b, hkv, s0, n, E, &kscl);
            FN(convert_range)(p, kern, vbuf, v, &p->value, kvdt, b, hkv, s0, n, Ev, &vscl);
            kt = kbuf, vt = vbuf;
        }
        PROF_MARK(PH_PACK);
        for (int pn = 0; pn < panels; pn++) {
            const int64_t r0 = l0 + (int64_t)pn * nr;
            const int prows = (int)(L - r0 < nr ? L - r0 : nr);
            int np = n;
            if (p->causal) {  /* the panel's last row sees keys < lim */
                int64_t lim = r0 + prows + p->causal_offset;
                if (lim <= s0) continue;
                if (lim - s0 < np) np = (int)(lim - s0);
            }
            int win_edge = 0, j0 = 0;  /* the panel computes keys [s0 + j0, s0 + np) of the tile */
            if (win) {  /* the panel's window: keys [first of its first row, end of its last) */
                const int64_t pf = window_first(p, r0), pe = window_end(p, r0 + prows - 1);
                if (s0 >= pe || s0 + np <= pf) continue;
                if (pe - s0 < np) np = (int)(pe - s0);
                if (pf > s0) j0 = (int)((pf - s0) / 16 * 16);  /* from the window's start, in steps of 16 keys */
                win_edge = !(s0 + j0 >= window_first(p, r0 + prows - 1) && s0 + np <= window_end(p, r0));
            }
            const int64_t sp = s0 + j0;  /* the panel's first key, and its number of keys */
            const int nk = np - j0;
            T *pmax = row_m + (int64_t)pn * nr, *psum = row_l + (int64_t)pn * nr;
            T *pacc = acc + (int64_t)pn * Ev * nr;
            const void *tile_mask = mask;
            if (mask) {
                const int cls = FN(mask_tile_class)(p, mask, r0, prows, sp, nk);
                if (cls == TILE_NONE_VISIBLE) {  /* adds nothing to any row */
                    if (weights) FN(hide_in_weights)(p, weights, r0, prows, sp, nk);
                    continue;
                }
                if (cls == TILE_ALL_VISIBLE) tile_mask = NULL;
            }

            if (pn >= packed) {  /* Q is packed a panel at a time, the next one on its way */
                for (; packed <= pn; packed++) {
                    T *panel = qt + (int64_t)packed * qpanel * nr;
#if HAS_BF16
                    if (bf16) {
                        bf16_pack_panel(p, kern, (uint32_t *)panel, (const uint16_t *)q, l0, packed, E2);
                        continue;
                    }
#endif
                    FN(pack_panel)(p, kern, panel, q, l0, packed);
                }
                if (packed < panels) {
                    const int64_t rn = l0 + (int64_t)packed * nr;
                    FN(prefetch_rows)(q, &p->query, sdpa_dtype_size(qdt), rn, (int)(L - rn < nr ? L - rn : nr), E, 0);
                }
                PROF_MARK(PH_PACK);
            }
            if (mask) {  /* the next panel's mask, or the next tile's first */
                const int64_t rn = pn + 1 < panels ? r0 + nr : l0, sn = pn + 1 < panels ? s0 : s0 + tile_k;
                const int64_t kn = kv_end - sn < tile_k ? kv_end - sn : tile_k;
                FN(prefetch_mask)(p, mask, rn, L - rn < nr ? L - rn : nr, sn, kn);
            }
            if (s0 + tile_k >= kv_end) {  /* the last tile: this panel's output rows and the next task */
                if (rows_vec) FN(prefetch_rows)(out, &p->out, sdpa_dtype_size(qdt), r0, prows, Ev, 1);
                FN(prefetch_task)(p, pl, task + pl->num_threads, pn, panels);
            }
#if HAS_BF16
            if (bf16) {
                const uint32_t *qp = (const uint32_t *)qt + (int64_t)pn * E2 * nr;
                if (!kpt) {  /* paged keys in place */
                    int64_t blk = sp / p->block_size, row = sp % p->block_size;
                    for (int64_t a = sp, m = 0; a < sp + nk; a += m, blk++, row = 0) {
                        const int64_t left = p->block_size - row;
                        m = left < sp + nk - a ? left : sp + nk - a;
                        const uint32_t *ka = (const uint32_t *)paged_block_row(p, &p->key, b, hkv, blk, row, 2);
                        kern->bf16.gemm_bf16((int)m, E2, ka, k_rs, 1, qp, nr, st + (a - sp) * nr, nr, 0);
                    }
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
                int64_t blk = sp / p->block_size, row = sp % p->block_size;
                for (int64_t a = sp, m = 0; a < sp + nk; a += m, blk++, row = 0) {
                    const int64_t left = p->block_size - row;
                    m = left < sp + nk - a ? left : sp + nk - a;
                    const T *ka = (const T *)paged_block_row(p, &p->key, b, hkv, blk, row, sizeof(T));
                    kern->gemm((int)m, E, ka, ksr, ksc, qt + (int64_t)pn * E * nr, nr, st + (a - sp) * nr, nr, 0);
                }
                PROF_MARK(PH_QK);
            } else {
                kern->gemm(nk, E, kt + j0 * ksr, ksr, ksc, qt + (int64_t)pn * E * nr, nr, st, nr, 0);
                PROF_MARK(PH_QK);
            }
            if (p->softcap > 0) kern->softcap(st, (int64_t)nk * nr, cap);
            if (p->alibi.data) FN(add_alibi_tile)(p, st, nr, r0, prows, sp, nk, slope);

            const int diagonal = p->causal && sp + nk - 1 > r0 + p->causal_offset;
            if (tile_mask || diagonal || win_edge)
                FN(mask_tile)(p, kern, tile_mask, st, nr, r0, prows, sp, nk, kv_end);
            if (weights)
                for (int x = 0; x < prows; x++)
                    FN(store_raw_scores)(p, weights + (r0 + x) * p->weights.row_stride, st + x, nr, sp, nk);
            PROF_MARK(PH_MASK);
            scores += (int64_t)nk * prows;

#if HAS_BF16
            if (bf16) {
                kern->bf16.online_softmax_pairs(st, nk, fold ? scale : 1, pmax, psum, pacc, Ev, pp);
                PROF_MARK(PH_SOFTMAX);
                FN(pv_pairs)(kern, (int)Ev, nk, vpt + (byf ? j0 / 2 : j0 / 2 * Ev), vp_rs, vp_ks, pp, nr, pacc, vtail);
                PROF_MARK(PH_PV);
                continue;
            }
#endif
            kern->online_softmax_update(st, nk, pmax, psum, pacc, Ev);
            PROF_MARK(PH_SOFTMAX);
            if (paged_products) {
                int64_t blk = sp / p->block_size, row = sp % p->block_size;
                for (int64_t a = sp, m = 0; a < sp + nk; a += m, blk++, row = 0) {
                    const int64_t left = p->block_size - row;
                    m = left < sp + nk - a ? left : sp + nk - a;
                    const T *va = (const T *)paged_block_row(p, &p->value, b, hkv, blk, row, sizeof(T));
                    kern->gemm((int)Ev, (int)m, va, vsc, vsr, st + (a - sp) * nr, nr, pacc, nr, 1);
                }
            } else {
                kern->gemm((int)Ev, nk, vt + j0 * vsr, vsc, vsr, st, nr, pacc, nr, 1);
            }
            PROF_MARK(PH_PV);
        }
    }

    const T *sink = p->sinks.data ? (const T *)view_at(p, &p->sinks, b, h, sizeof(T)) : NULL;
    if (sink && *sink == -(T)INFINITY) sink = NULL;  /* no sink: the same bits as without */
    if (lse || sink)
        for (int x = 0; x < rows; x++) {
            const T l = row_l[x], m = row_m[x];
            if (lse) lse[(l0 + x) * p->lse.row_stride] = sink ? FN(log_sum_exp_sink)(m, l, *sink) : FN(log_sum_exp)(m, l);
            if (sink && l != 0) row_l[x] = l + EXP(*sink - m);  /* the sink joins the denominator */
        }
    if (rows_vec)  /* the same values as the loop below, a panel at a time */
        for (int pn = 0; pn < panels; pn++) {
            const int x0 = pn * nr, prows = rows - x0 < nr ? rows - x0 : nr;
            const int64_t off = (l0 + x0) * p->out.row_stride;
            if (qdt == TDT)
                kern->store_rows((T *)out + off, p->out.row_stride, acc + (int64_t)pn * Ev * nr, nr, row_l + x0,
                                 prows, Ev);
            else
                kern->store_rows_half(qdt, (uint16_t *)out + off, p->out.row_stride, acc + (int64_t)pn * Ev * nr, nr,
                                      row_l + x0, prows, Ev);
        }
    for (int x = 0; x < rows; x++) {
        const int64_t row = l0 + x;
        const T l = row_l[x], m = row_m[x];
        const T *ax = acc + (int64_t)(x / nr) * Ev * nr + x % nr;
        const int64_t o0 = row * p->out.row_stride, oc = p->out.col_stride;
        /* a row with no visible key gives zeros (even if a V row it multiplied by
         * a zero weight held NaN); NaN in l passes through */
        const T inv = l == 0 ? 0 : 1 / l;
        if (!rows_vec && qdt == TDT) {
            T *orow = (T *)out + o0;
            for (int64_t c = 0; c < Ev; c++) orow[c * oc] = l == 0 ? 0 : ax[c * nr] * inv;
        } else if (!rows_vec) {
            for (int64_t c = 0; c < Ev; c++) FN(store)(out, o0 + c * oc, qdt, l == 0 ? 0 : ax[c * nr] * inv);
        }
        if (weights) FN(normalize_weights)(p, weights + row * p->weights.row_stride, row, S_b, m, l);
    }
    PROF_MARK(PH_EPILOGUE);
    if (prof) prof[PH_SCORES] += (uint64_t)scores;
}
#undef PROF_MARK

/* integer_qk: a scaled query row rounded to int8 with the scale max|x| / 127
 * (ties to even; 0 for a row of zeros or of values so small that the scale
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
    const float inv = scale > 0 ? 1.0f / scale : 0.0f, magic = 12582912.0f;
    for (int64_t c = 0; c < e; c++) {
        float r = ((float)x[c] * inv + magic) - magic;
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[c] = (int8_t)(int)r;
    }
    *qscale = scale;
}

/* The rows from a up to end of a K or V view that lie contiguous: their
 * address (*rows) and scales (sc->base, int8), and their count.  Arrays: all
 * of them, from base (the head's rows).  Paged: those in the block of the
 * cursor (*block: the table entry, *row: the row in it), which moves on to the
 * next block's first row; the caller starts it at a / block_size, a %
 * block_size (two divisions a tile, not one a block).  The first rows of the
 * next of the sequence's `blocks` blocks (cols elements each) are prefetched. */
static int64_t FN(segment)(const sdpa_problem *p, int64_t b, int64_t hkv, int64_t a, int64_t end, const char *base,
                           const sdpa_view *view, int64_t rs, size_t elem, int64_t cols, int64_t blocks,
                           const char **rows, FN(kv_scales) *sc, int64_t *block, int64_t *row) {
    if (p->block_size <= 0) {
        *rows = base + a * rs * (int64_t)elem;
        if (sc->base) sc->base += a * sc->rs;
        return end - a;
    }
    const sdpa_view *scales = view == &p->key ? &p->key_scale : &p->value_scale;
    const int64_t left = p->block_size - *row;
    *rows = paged_block_row(p, view, b, hkv, *block, *row, elem);
    if (sc->base) sc->base = (const float *)paged_block_row(p, scales, b, hkv, *block, *row, sizeof(float));
    /* the next block is anywhere in the pool, out of the hardware prefetchers' sight */
    if (*block + 1 < blocks)  /* its first rows: a longer block's rest is a stream they follow */
        FN(prefetch_rows)(paged_block_row(p, view, b, hkv, *block + 1, 0, elem), view, elem, 0,
                          p->block_size < SDPA_PAGED_PREFETCH_ROWS ? p->block_size : SDPA_PAGED_PREFETCH_ROWS, cols, 0);
    ++*block;
    *row = 0;
    return left < end - a ? left : end - a;
}

static void FN(run_row_task)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch,
                             T *partial, int64_t task, interrupt_state *irq, int tid) {
    const int64_t L = p->len_q, E = p->head_dim, Ev = p->head_dim_v, group = p->gqa_group;
    const int M = pl->rows, tile_k = pl->tile_k;
    const int64_t Hkv = p->num_heads / group;
    const int64_t g = task / pl->num_chunks, chunk = task % pl->num_chunks;
    const int64_t b = g / Hkv, hkv = g % Hkv;
    const int paged = p->block_size > 0;
    sdpa_problem local;
    if (paged && (p->causal || has_window(p) || p->alibi.data)) {  /* rows at the sequence's end */
        local = *p;
        paged_positions(&local, b);
        p = &local;
    }

    T *pmax = partial + task * pl->partial_elems;
    T *psum = pmax + M;
    T *acc = psum + M;
    for (int x = 0; x < M; x++) {
        pmax[x] = -(T)INFINITY;
        psum[x] = 0;
    }
    for (int64_t i = 0; i < (int64_t)M * Ev; i++) acc[i] = 0;

    /* the keys of this chunk that some row can see */
    const int64_t S_b = key_limit(p, b);
    int64_t s_begin = chunk * pl->chunk_len, s_end = s_begin + pl->chunk_len;
    if (s_end > S_b) s_end = S_b;
    if (p->causal && L - 1 + p->causal_offset + 1 < s_end) s_end = L + p->causal_offset;
    const int win = has_window(p);
    if (win) {  /* the rows' positions are 0..L-1 */
        const int64_t wf = window_first(p, 0), we = window_end(p, L - 1);
        if (wf > s_begin) s_begin = wf;
        if (we < s_end) s_end = we;
    }
    if (s_begin >= s_end) return;

    const sdpa_dtype qdt = p->dtype, kvdt = pl->kv_dtype;
    const size_t qe = sdpa_dtype_size(qdt);
    const size_t kve = sdpa_dtype_size(kvdt);
    /* paged: the block's rows, found per tile */
    const char *k = paged ? NULL : (const char *)view_at(p, &p->key, b, hkv, kve);
    const char *v = paged ? NULL : (const char *)view_at(p, &p->value, b, hkv, kve);
    const int64_t ksr = p->key.row_stride, ksc = p->key.col_stride;
    const int64_t vsr = p->value.row_stride, vsc = p->value.col_stride;
    T *qs = scratch + pl->off_q;     /* M x E, scaled                     */
    T *st = scratch + pl->off_s;     /* M x tile_k scores                 */
    T *kbuf = scratch + pl->off_k;   /* tile_k x E: strided or converted K rows */
    T *vbuf = scratch + pl->off_v;   /* tile_k x Ev: strided or converted V rows */
    T *sg = scratch + pl->off_pp;    /* M x tile_k: quantized, the scores or weights of one scale group */
    const FN(kv_scales) kscl = FN(kv_scales_at)(p, &p->key_scale, b, hkv, E);
    const FN(kv_scales) vscl = FN(kv_scales_at)(p, &p->value_scale, b, hkv, Ev);
    const int half = kvdt == SDPA_BFLOAT16 || kvdt == SDPA_FLOAT16;
    const int k_q = sdpa_is_quantized(kvdt) && ksc == 1;
    const int v_q = sdpa_is_quantized(kvdt) && vsc == 1;
    const int nib = kvdt == SDPA_INT4;  /* int4: value c at byte c / 2 */
    /* integer_qk: the query rows as int8 (each with its scale) and dot_qi's work */
    const int iqk = pl->integer_qk && k_q && kscl.base && sizeof(T) == sizeof(float);
    int8_t *q8 = NULL;
    float *q8s = NULL;
    void *qi_work = NULL;
    sdpa_dot_qi_f32_fn dot_qi = NULL;
    if (iqk) {
        q8 = (int8_t *)(scratch + pl->off_qi);
        q8s = (float *)(void *)(q8 + ((size_t)M * (size_t)E + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN);
        qi_work = (char *)q8s + ((size_t)M * sizeof(float) + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN;
        dot_qi = pl->dot_qi;
    }

    const T scale = (T)p->scale, cap = FN(softcap_value)(p);
    for (int x = 0; x < M; x++) {
        const int64_t h = hkv * group + x / L, l = x % L;
        const char *qr = (const char *)view_at(p, &p->query, b, h, qe) + l * p->query.row_stride * (int64_t)qe;
        if (qdt == TDT && p->query.col_stride == 1)
            kern->scale_copy(qs + (int64_t)x * E, (const T *)qr, E, scale);
        else
            FN(load_scaled)(qs + (int64_t)x * E, qr, E, p->query.col_stride, qdt, scale);
        if (iqk) FN(quantize_query)(qs + (int64_t)x * E, E, q8 + (int64_t)x * E, q8s + x);
    }

    for (int64_t s0 = s_begin; s0 < s_end; s0 += tile_k) {
        if (should_stop(irq, tid)) return;
        const int n = (int)(s_end - s0 < tile_k ? s_end - s0 : tile_k);
        /* a tile is read by segments of contiguous rows: the whole tile, or
         * (paged) the part of it in each block; scores by column offset */
        const int64_t blk0 = paged ? s0 / p->block_size : 0, row0 = paged ? s0 % p->block_size : 0;
        const int64_t blocks = paged ? (S_b + p->block_size - 1) / p->block_size : 0;
        int64_t blk = blk0, row = row0;
        for (int64_t a = s0, m = 0; a < s0 + n; a += m) {
            const char *kt;
            FN(kv_scales) ksct = kscl;
            m = FN(segment)(p, b, hkv, a, s0 + n, k, &p->key, ksr, kve, E, blocks, &kt, &ksct, &blk, &row);
            T *sto = st + (a - s0);
            if (half && ksc == 1) {  /* 16-bit keys read in place */
                kern->dot_half(kvdt, M, m, E, qs, E, (const uint16_t *)kt, ksr, sto, tile_k);
            } else if (iqk && (dot_qi(kvdt, M, m, E, kscl.group, q8, E, q8s, (const uint8_t *)kt, ksr, ksct.base,
                                      kscl.rs, kscl.cs, (float *)(void *)sto, tile_k, qi_work) ||
                               sdpa_kernels_scalar.f32.dot_qi(kvdt, M, m, E, kscl.group, q8, E, q8s,
                                                              (const uint8_t *)kt, ksr, ksct.base, kscl.rs, kscl.cs,
                                                              (float *)(void *)sto, tile_k, qi_work))) {
                /* integer_qk: the scores in integers (the portable kernel where the set's declines) */
            } else if (k_q) {  /* quantized keys read in place, each scale group's dot then scaled */
                const uint8_t *kb = (const uint8_t *)kt;
                const float *ks = ksct.base;
                const int64_t g = kscl.group;
                /* groups: the scales applied to each key vector in the kernel, if it can */
                const int folded =
                    !ks || (g < E && kern->dot_q_grouped(kvdt, M, m, E, g, qs, E, kb, ksr, ks, kscl.rs, kscl.cs, sto, tile_k));
                if (!ks) kern->dot_q(kvdt, M, m, E, qs, E, kb, ksr, sto, tile_k);  /* float8 without scales */
                for (int64_t c0 = 0; c0 < E && !folded; c0 += g) {
                    const float *kg = ks + (c0 / g) * kscl.cs;
                    T *dst = c0 == 0 ? sto : sg;
                    kern->dot_q(kvdt, M, m, g, qs + c0, E, kb + (nib ? c0 / 2 : c0), ksr, dst, tile_k);
                    for (int x = 0; x < M; x++) {
                        T *sx = sto + (int64_t)x * tile_k;
                        const T *gx = dst + (int64_t)x * tile_k;
                        if (c0 == 0 && kscl.rs == 1)  /* one scale a row: contiguous, vectorized */
                            for (int j = 0; j < m; j++) sx[j] = gx[j] * kg[j];
                        else if (c0 == 0)
                            for (int j = 0; j < m; j++) sx[j] = gx[j] * kg[j * kscl.rs];
                        else
                            for (int j = 0; j < m; j++) sx[j] += gx[j] * kg[j * kscl.rs];
                    }
                }
            } else {
                const T *kb = (const T *)kt;
                int64_t ldk = ksr;
                if (ksc != 1 || kvdt != TDT) {
                    FN(convert_rows)(kern, kbuf, kt, &p->key, kvdt, 0, m, E, &ksct);
                    kb = kbuf;
                    ldk = E;
                }
                kern->dot(M, m, E, qs, E, kb, ldk, sto, tile_k);
            }
        }
        for (int x = 0; x < M; x++) {
            const int64_t h = hkv * group + x / L, l = x % L;
            T *sr = st + (int64_t)x * tile_k;
            const int64_t lim = p->causal ? l + p->causal_offset + 1 : s_end;
            const void *mask = FN(mask_at)(p, b, h);
            if (p->softcap > 0) kern->softcap(sr, n, cap);
            if (p->alibi.data) FN(add_alibi_row)(p, sr, l, s0, n, FN(head_value)(p, &p->alibi, b, h));
            FN(mask_scores)(p, mask ? FN(mask_row_of)(p, mask, l) : NULL, sr, 1, s0, n, lim);
            if (win) {
                const int64_t wf = window_first(p, l), we = window_end(p, l);
                for (int j = 0; j < n; j++)
                    if (s0 + j < wf || s0 + j >= we) sr[j] = -(T)INFINITY;
            }
            if (p->weights.data)
                FN(store_raw_scores)(p, AT(weights, b, h) + l * p->weights.row_stride, sr, 1, s0, n);
            kern->row_online_softmax_update(sr, n, pmax + x, psum + x, acc + x * Ev, Ev);
        }
        blk = blk0, row = row0;
        for (int64_t a = s0, m = 0; a < s0 + n; a += m) {
            const char *vt;
            FN(kv_scales) vsct = vscl;
            m = FN(segment)(p, b, hkv, a, s0 + n, v, &p->value, vsr, kve, Ev, blocks, &vt, &vsct, &blk, &row);
            const T *sto = st + (a - s0);
            if (half && vsc == 1) {
                kern->pv_rows_half(kvdt, M, m, Ev, sto, tile_k, (const uint16_t *)vt, vsr, acc, Ev);
            } else if (v_q) {  /* quantized values read in place, the weights of each scale group scaled */
                const uint8_t *vb = (const uint8_t *)vt;
                const float *vs = vsct.base;
                const int64_t g = vscl.group;
                const int folded = !vs || (g < Ev && kern->pv_rows_q_grouped(kvdt, M, m, Ev, g, sto, tile_k, vb, vsr, vs,
                                                                             vscl.rs, vscl.cs, acc, Ev));
                if (!vs) kern->pv_rows_q(kvdt, M, m, Ev, sto, tile_k, vb, vsr, acc, Ev);  /* float8 without scales */
                for (int64_t c0 = 0; c0 < Ev && !folded; c0 += g) {
                    const float *vg = vs + (c0 / g) * vscl.cs;
                    for (int x = 0; x < M; x++) {
                        const T *sx = sto + (int64_t)x * tile_k;
                        T *px = sg + (int64_t)x * tile_k;
                        if (vscl.rs == 1)  /* one scale a row: contiguous, vectorized */
                            for (int j = 0; j < m; j++) px[j] = sx[j] * vg[j];
                        else
                            for (int j = 0; j < m; j++) px[j] = sx[j] * vg[j * vscl.rs];
                    }
                    kern->pv_rows_q(kvdt, M, m, g, sg, tile_k, vb + (nib ? c0 / 2 : c0), vsr, acc + c0, Ev);
                }
            } else {
                const T *vb = (const T *)vt;
                int64_t ldv = vsr;
                if (vsc != 1 || kvdt != TDT) {
                    FN(convert_rows)(kern, vbuf, vt, &p->value, kvdt, 0, m, Ev, &vsct);
                    vb = vbuf;
                    ldv = Ev;
                }
                kern->pv_rows(M, m, Ev, sto, tile_k, vb, ldv, acc, Ev);
            }
        }
    }
}

/* Combines the chunks of group g in chunk order and writes its rows. */
static void FN(merge_rows)(const sdpa_problem *p, const plan *pl, const KT *kern, T *partial, int64_t g) {
    const int64_t L = p->len_q, Ev = p->head_dim_v, group = p->gqa_group;
    const int M = pl->rows;
    const int64_t Hkv = p->num_heads / group;
    const int64_t b = g / Hkv, hkv = g % Hkv;
    const int64_t S_b = key_limit(p, b);
    T *first = partial + g * pl->num_chunks * pl->partial_elems;

    for (int x = 0; x < M; x++) {
        const int64_t h = hkv * group + x / L, l = x % L;
        T m = -(T)INFINITY;
        for (int64_t c = 0; c < pl->num_chunks; c++) {
            T mc = first[c * pl->partial_elems + x];
            if (mc > m || mc != mc) m = mc;
            if (m != m) break;
        }
        /* combined in double: the chunks of a very long row would otherwise lose
         * float32 bits in the sum of their partial results */
        double sum = 0;
        char *orow = (char *)view_at(p, &p->out, b, h, sdpa_dtype_size(p->dtype)) +
                     l * p->out.row_stride * (int64_t)sdpa_dtype_size(p->dtype);
        const int64_t oc = p->out.col_stride;
        const sdpa_dtype odt = p->dtype;
        const T *sink = p->sinks.data ? (const T *)view_at(p, &p->sinks, b, h, sizeof(T)) : NULL;
        if (sink && *sink == -(T)INFINITY) sink = NULL;  /* no sink: the same bits as without */
        double denom = 0;  /* sum, and the sink's share */
        if (m == -(T)INFINITY) {
            for (int64_t c = 0; c < Ev; c++) FN(store)(orow, c * oc, odt, 0);
        } else {
            /* each chunk's weight exp(m_chunk - m) replaces its max in the partial
             * (this group's partials belong to this thread alone) */
            for (int64_t ch = 0; ch < pl->num_chunks; ch++) {
                T *part = first + ch * pl->partial_elems;
                part[x] = (T)exp((double)part[x] - (double)m);  /* 0 for a chunk it did not see */
                sum += (double)part[x] * (double)part[M + x];
            }
            denom = sink ? sum + exp((double)*sink - (double)m) : sum;
            const double inv = sum == 0 ? 0 : 1 / denom;
            if (pl->num_chunks == 1) {  /* the row's own result: acc / sum (sum >= 1 here) */
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
                    for (int64_t ch = 0; ch < pl->num_chunks; ch++) {
                        const T *part = first + ch * pl->partial_elems;
                        if (part[M + x] != 0)  /* a chunk that saw no key adds nothing, NaN included */
                            acc_c += (double)part[x] * (double)part[2 * M + (int64_t)x * Ev + c];
                    }
                    FN(store)(orow, c * oc, odt, (T)(acc_c * inv));
                }
            }
        }
        if (p->weights.data) {
            T *wr = AT(weights, b, h) + l * p->weights.row_stride;
            FN(normalize_weights)(p, wr, l, S_b, m, (T)denom);
        }
        if (p->lse.data) {
            T lse_x;
            if (m == -(T)INFINITY) lse_x = sink ? *sink : m;
            else if (sink) lse_x = FN(log_sum_exp_sink)(m, (T)sum, *sink);
            else lse_x = (T)((double)m + log(sum));
            AT(lse, b, h)[l * p->lse.row_stride] = lse_x;
        }
    }
}

/* One task, unless the call was interrupted.  A row-mode group of one chunk
 * is merged by the task that computed it (no second pass over the groups). */
static void FN(do_task)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch, const T *callbuf,
                        T *partial, int64_t t, int tid, interrupt_state *irq) {
    if (should_stop(irq, tid)) return;
    if (pl->row_mode) {
        FN(run_row_task)(p, pl, kern, scratch, partial, t, irq, tid);
        if (pl->num_chunks == 1 && !sdpa_atomic_load(&irq->stop)) FN(merge_rows)(p, pl, kern, partial, t);
    } else {
#if HAS_BF16
        if (pl->bf16) kern->bf16.tiles_begin();
        FN(run_task)(p, pl, kern, scratch, callbuf, t, irq, tid);
        if (pl->bf16) kern->bf16.tiles_end();
#else
        FN(run_task)(p, pl, kern, scratch, callbuf, t, irq, tid);
#endif
    }
}

/* Packing unit u of the call buffer, timed as packing when profiled. */
static void FN(do_pack)(const sdpa_problem *p, const plan *pl, const KT *kern, T *scratch, T *callbuf, int64_t u,
                        int tid, interrupt_state *irq) {
    if (should_stop(irq, tid)) return;
    const uint64_t t0 = pl->profile ? prof_ticks() : 0;
    FN(pack_kv_unit)(p, pl, kern, callbuf, u);
    if (pl->profile) ((uint64_t *)(scratch + pl->off_prof))[PH_PACK] += prof_ticks() - t0;
}

static sdpa_status FN(attention)(const sdpa_problem *p, const plan *pl_in, const KT *kern) {
    plan pl_own = *pl_in;
    const plan *pl = &pl_own;
    const size_t per_thread = pl->scratch_elems;
    const int nthreads = pl->num_threads;
    const size_t partial_total = pl->row_mode ? (size_t)pl->num_tasks * pl->partial_elems : 0;
    const size_t base = per_thread * (size_t)nthreads + partial_total;
    T *scratch = NULL;
    if (pl->kv_packed) {  /* without room for the packed K/V, tile by tile as before */
        scratch = (T *)aligned_block((base + pl->callbuf_elems) * sizeof(T));
        if (!scratch) pl_own.kv_packed = 0;
    }
    if (!scratch) scratch = (T *)aligned_block(base * sizeof(T));
    if (!scratch) return SDPA_ERR_NO_MEMORY;
    T *partial = scratch + per_thread * (size_t)nthreads;
    T *callbuf = pl->kv_packed ? scratch + base : NULL;
    if (pl->profile)
        for (int t = 0; t < nthreads; t++) memset(scratch + (size_t)t * per_thread + pl->off_prof, 0, PH_COUNT * 8);

    interrupt_state irq;
    interrupt_start(&irq, p);
    if (nthreads == 1) {  /* no OpenMP region at all (also what a forked child needs) */
        for (int64_t u = 0; callbuf && u < pl->pack_units; u++) FN(do_pack)(p, pl, kern, scratch, callbuf, u, 0, &irq);
        for (int64_t t = 0; t < pl->num_tasks; t++)
            FN(do_task)(p, pl, kern, scratch, callbuf, partial, t, 0, &irq);
        if (pl->row_mode && pl->num_chunks > 1)
            for (int64_t g = 0; g < pl->num_groups && !sdpa_atomic_load(&irq.stop); g++)
                FN(merge_rows)(p, pl, kern, partial, g);
    } else {
#ifdef _OPENMP
        note_openmp_used();
        const fp_mode caller_mode = fp_mode_get();
#pragma omp parallel num_threads(nthreads)
        {
            const int tid = omp_get_thread_num();
            const fp_mode own_mode = fp_mode_get();
            fp_mode_adopt(caller_mode);
            T *mine = scratch + (size_t)tid * per_thread;
            if (callbuf) {  /* every slice packed before any task reads it (the barrier of the loop) */
#pragma omp for schedule(dynamic, 1)
                for (int64_t u = 0; u < pl->pack_units; u++) FN(do_pack)(p, pl, kern, mine, callbuf, u, tid, &irq);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < pl->num_tasks; t++)
                FN(do_task)(p, pl, kern, mine, callbuf, partial, t, tid, &irq);
            if (pl->row_mode && pl->num_chunks > 1) {  /* after the barrier above: every chunk is done */
#pragma omp for schedule(static)
                for (int64_t g = 0; g < pl->num_groups; g++)
                    if (!sdpa_atomic_load(&irq.stop)) FN(merge_rows)(p, pl, kern, partial, g);
            }
            fp_mode_restore(own_mode);
        }
#endif
    }
    if (pl->profile)
        for (int t = 0; t < nthreads; t++) profile_add((const uint64_t *)(scratch + (size_t)t * per_thread + pl->off_prof));
    aligned_free(scratch);
    return sdpa_atomic_load(&irq.stop) ? SDPA_ERR_INTERRUPTED : SDPA_OK;
}

#undef AT
#undef FN
#undef CAT
#undef CAT_
