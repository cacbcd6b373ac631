/* The score modifiers for one compute type T (included by exec_impl.h): the
 * softcap, ALiBi, the mask, causality and the window, applied to the scores
 * of a tile (tiled path: keys x nr rows, transposed) by apply_tile_modifiers
 * and to one row's scores (row path) by apply_row_modifiers; and the raw
 * scores kept for the weights. */

/* The mask at (batch index b, head h), or NULL without one. */
static const void *FN(mask_at)(const sdpa_problem *p, int64_t b, int64_t h) {
    if (p->mask_kind == SDPA_MASK_NONE) return NULL;
    return view_at(p, &p->mask, b, h, p->mask_kind == SDPA_MASK_BOOL ? 1 : sizeof(T));
}

/* The mask row of query row `row`, from the mask of one (batch, head). */
static const void *FN(mask_row_of)(const sdpa_problem *p, const void *mask, int64_t row) {
    const int64_t elem = p->mask_kind == SDPA_MASK_BOOL ? 1 : (int64_t)sizeof(T);
    return (const char *)mask + row * p->mask.row_stride * elem;
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
static void FN(mask_scores)(const sdpa_problem *p, const void *mask_row, T *sr, int64_t ss, int64_t s0, int n,
                            int64_t lim) {
    if (mask_row && p->mask_kind == SDPA_MASK_ADDITIVE) {
        const T *mr = (const T *)mask_row;
        for (int j = 0; j < n; j++) sr[j * ss] += mr[(s0 + j) * p->mask.col_stride];
    } else if (mask_row && p->mask_kind == SDPA_MASK_BOOL) {
        const uint8_t *mr = (const uint8_t *)mask_row;
        for (int j = 0; j < n; j++)
            if (!mr[(s0 + j) * p->mask.col_stride]) sr[j * ss] = -(T)INFINITY;
    }
    int64_t first = lim - s0;
    for (int64_t j = first < 0 ? 0 : first; j < n; j++) sr[j * ss] = -(T)INFINITY;
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

/* The mask of a panel's rows on the transposed tile st (n keys x nr rows,
 * keys from s0; keys from kv_end on hidden where the mask is read element by
 * element), then causality and the window where `edges`.  Row x of the panel is
 * position p0 + (phase + x) / g: g = 1 (phase 0) for one head's rows, rows
 * p0..p0+prows; g > 1 for a packed GQA group (no mask then).  The mask goes
 * a block at a time where its keys are contiguous, else element by element. */
static void FN(mask_tile)(const sdpa_problem *p, const KT *kern, const void *mask, T *st, int nr, int64_t p0, int g,
                          int phase, int prows, int64_t s0, int n, int64_t kv_end, int edges) {
    if (mask) {
        const int64_t rs = p->mask.row_stride;
        if (p->mask.col_stride == 1 && p->mask_kind == SDPA_MASK_BOOL) {
            kern->mask_bool(st, nr, n, prows, (const uint8_t *)FN(mask_row_of)(p, mask, p0) + s0, rs);
        } else if (p->mask.col_stride == 1 && p->mask_kind == SDPA_MASK_ADDITIVE) {
            kern->mask_add(st, nr, n, prows, (const T *)FN(mask_row_of)(p, mask, p0) + s0, rs);
        } else {
            for (int x = 0; x < prows; x++)
                FN(mask_scores)(p, FN(mask_row_of)(p, mask, p0 + x), st + x, nr, s0, n, kv_end);
        }
    }
    /* the rows before position t are rows x < g * (t - p0) - phase */
    if (!edges) return;  /* neither causality nor the window cuts the tile (or a block map's full block) */
    if (p->causal) {  /* key s0 + j is hidden from the rows before position s0 + j - offset */
        const int64_t first = s0 - p0 - p->causal_offset;
        for (int j = 0; j < n; j++) {
            int64_t hidden = g * (first + j) - phase;
            if (hidden <= 0) continue;
            if (hidden > prows) hidden = prows;
            for (int64_t x = 0; x < hidden; x++) st[(int64_t)j * nr + x] = -(T)INFINITY;
        }
    }
    if (has_window(p)) {  /* key s is seen by the positions l in [s - o - right, s - o + left] */
        const int64_t o = p->align_offset;
        const int64_t p1 = p0 + (phase + prows - 1) / g;  /* the panel's last position */
        if (p->window_right >= 0) {  /* rows before position s - o - right are hidden: keys past p0 + o + right */
            int64_t j = p0 + o + p->window_right + 1 - s0;
            for (j = j < 0 ? 0 : j; j < n; j++) {
                int64_t below = g * (s0 + j - o - p->window_right - p0) - phase;
                if (below > prows) below = prows;
                T *sj = st + j * nr;
                for (int64_t x = 0; x < below; x++) sj[x] = -(T)INFINITY;
            }
        }
        if (p->window_left >= 0) {  /* rows from position s - o + left + 1 on are hidden: keys before p1 + o - left */
            int64_t end = p1 + o - p->window_left - s0;
            if (end > n) end = n;
            for (int64_t j = 0; j < end; j++) {
                int64_t above = g * (s0 + j - o + p->window_left - p0 + 1) - phase;
                if (above < 0) above = 0;
                T *sj = st + j * nr;
                for (int64_t x = above; x < prows; x++) sj[x] = -(T)INFINITY;
            }
        }
    }
}

/* Every modifier on a transposed score tile (tiled path): a panel's prows
 * rows from position p0 (g rows a position from the phase-th, mask_tile), keys
 * [s0, s0 + n); `edges` when causality or the window cut the tile (else they
 * are not looked at), `mask` NULL when the mask changes nothing there.  ALiBi
 * and masks only with one head's rows (g = 1). */
static void FN(apply_tile_modifiers)(const sdpa_problem *p, const KT *kern, T *st, int nr, int64_t p0, int g,
                                     int phase, int prows, int64_t s0, int n, int64_t kv_end, const void *mask,
                                     int edges, T slope, T cap) {
    if (p->softcap > 0) kern->softcap(st, (int64_t)n * nr, cap);
    if (p->alibi.data) FN(add_alibi_tile)(p, st, nr, p0, prows, s0, n, slope);
    if (mask || edges) FN(mask_tile)(p, kern, mask, st, nr, p0, g, phase, prows, s0, n, kv_end, edges);
}

/* Every modifier on the n scores of query row l from key s0 (row path): keys
 * from `lim` on hidden (causality), the window, the mask row (or NULL). */
static void FN(apply_row_modifiers)(const sdpa_problem *p, const KT *kern, T *sr, int64_t l, int64_t s0, int n,
                                    int64_t lim, const void *mask_row, T slope, T cap) {
    if (p->softcap > 0) kern->softcap(sr, n, cap);
    if (p->alibi.data) FN(add_alibi_row)(p, sr, l, s0, n, slope);
    FN(mask_scores)(p, mask_row, sr, 1, s0, n, lim);
    if (has_window(p)) {
        const int64_t wf = window_first(p, l), we = window_end(p, l);
        for (int j = 0; j < n; j++)
            if (s0 + j < wf || s0 + j >= we) sr[j] = -(T)INFINITY;
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
static void FN(store_raw_scores)(const sdpa_problem *p, T *wr, const T *sr, int64_t ss, int64_t s0, int n) {
    for (int j = 0; j < n; j++) wr[(s0 + j) * p->weights.col_stride] = sr[j * ss];
}
