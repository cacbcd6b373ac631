/* Keys and values into the layouts the products read, for one compute type T
 * (included by exec_impl.h): elements converted to T, quantized rows
 * dequantized, bfloat16 rows paired, a slice packed once for a call. */

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

/* n rows of a key or value view (dt elements) from `base` as T, row-major with
 * ld = cols, in buf: with a widening kernel for contiguous 16-bit rows;
 * quantized rows times their scales (sc, at the first row; none when
 * sc->base is NULL). */
static void FN(convert_rows)(const KT *kern, T *buf, const char *base, const sdpa_view *view, sdpa_dtype dt, int n,
                             int64_t cols, const kv_scales *sc) {
    const size_t elem = sdpa_dtype_size(dt);
    if (dt == SDPA_INT8) {  /* (float)q * scale, in float: the values cache.keys shows */
        const int64_t cs = view->col_stride, g = sc->group;
        for (int j = 0; j < n; j++) {
            const int8_t *row = (const int8_t *)base + j * view->row_stride;
            const float *srow = sc->base + j * sc->rs;
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
            const uint8_t *row = (const uint8_t *)base + j * view->row_stride;
            T *dst = buf + (int64_t)j * cols;
            if (!sc->base) {
                for (int64_t c = 0; c < cols; c++) dst[c] = (T)sdpa_quantized_value(dt, row, c * cs);
                continue;
            }
            const float *srow = sc->base + j * sc->rs;
            for (int64_t c0 = 0; c0 < cols; c0 += g) {
                const float f = srow[(c0 / g) * sc->cs];
                for (int64_t c = c0; c < c0 + g; c++) dst[c] = (T)(sdpa_quantized_value(dt, row, c * cs) * f);
            }
        }
        return;
    }
    if (view->col_stride == 1 && dt == TDT && view->row_stride == cols) {  /* a block's rows: one copy */
        memcpy(buf, base, (size_t)n * (size_t)cols * sizeof(T));
        return;
    }
    for (int j = 0; j < n; j++) {
        const char *row = base + j * view->row_stride * (int64_t)elem;
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

/* convert_rows over rows [s0, s0 + n) of a source, segment by segment. */
static void FN(convert_range)(const KT *kern, T *buf, const kv_source *src, sdpa_dtype dt, int64_t s0, int n,
                              int64_t cols) {
    kv_cursor cur = kv_walk(src, s0, s0 + n);
    const char *rows;
    kv_scales sc;
    for (int64_t a = s0, m; (m = kv_next(src, &cur, &rows, &sc, 0)) > 0; a += m)
        FN(convert_rows)(kern, buf + (a - s0) * cols, rows, src->view, dt, (int)m, cols, &sc);
}

#if HAS_BF16
/* (lo, hi) in one 32-bit pair, lo in the low half */
static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* n rows of a bfloat16 key view from `base` as pairs along E: dst[j*ld + p]
 * for p < ceil(E/2), an odd E padded with zero, and zero pairs up to ld (K not
 * readable in place, or padded to whole tiles). */
static void bf16_pack_rows(uint32_t *dst, int64_t ld, const uint16_t *base, const sdpa_view *view, int n, int64_t E) {
    const int64_t E2 = (E + 1) / 2;
    for (int j = 0; j < n; j++) {
        const uint16_t *row = base + j * view->row_stride;
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

/* n rows of a bfloat16 value view from `base` as pairs along the keys in the
 * layout of the kernel set, pair p of feature c at dst[c * ld + p] (by
 * feature) or dst[p * ld + c]: with the set's kernel for contiguous rows, else
 * element by element. */
static void bf16_pack_values(const kernels_f32 *kern, uint32_t *dst, int64_t ld, const uint16_t *base,
                             const sdpa_view *view, int n, int64_t Ev) {
    const int64_t rs = view->row_stride, cs = view->col_stride;
    const int byf = kern->bf16.values_by_feature;
    if (cs == 1) {
        kern->bf16.pack_v_pairs(byf, dst, ld, base, rs, n, Ev);
        return;
    }
    for (int p = 0; 2 * p < n; p++) {
        const uint16_t *r0 = base + (int64_t)2 * p * rs;
        const int two = 2 * p + 1 < n;
        for (int64_t c = 0; c < Ev; c++) {
            const uint32_t w = bf16_pair(r0[c * cs], two ? r0[rs + c * cs] : 0);
            if (byf) dst[c * ld + p] = w;
            else dst[(int64_t)p * ld + c] = w;
        }
    }
}

/* The pairs of rows [s0, s0 + n) of a key source (rows along E) or a value
 * source (pairs along the keys; s0 even), segment by segment; a pair of values
 * that straddles two segments (blocks of an odd size: one-position blocks of
 * sparse lists) is packed from its two rows where they lie. */
static void bf16_pack_key_range(uint32_t *dst, int64_t ld, const kv_source *src, int64_t s0, int n, int64_t E) {
    kv_cursor cur = kv_walk(src, s0, s0 + n);
    const char *rows;
    kv_scales sc;
    for (int64_t a = s0, m; (m = kv_next(src, &cur, &rows, &sc, 0)) > 0; a += m)
        bf16_pack_rows(dst + (a - s0) * ld, ld, (const uint16_t *)rows, src->view, (int)m, E);
}

static void bf16_pack_value_range(const kernels_f32 *kern, uint32_t *dst, int64_t ld, const kv_source *src,
                                  int64_t s0, int n, int64_t Ev) {
    const int byf = kern->bf16.values_by_feature;
    kv_cursor cur = kv_walk(src, s0, s0 + n);
    const char *rows;
    kv_scales sc;
    const uint16_t *pending = NULL;  /* the first row of a pair whose second is in the next segment */
    for (int64_t a = s0, m; (m = kv_next(src, &cur, &rows, &sc, 0)) > 0; a += m) {
        const uint16_t *r = (const uint16_t *)rows;
        int64_t at = a, left = m;
        if (pending) {  /* pair (at - 1, at): two rows one stride apart, that stride their distance */
            sdpa_view two = *src->view;
            two.row_stride = (int64_t)(r - pending);
            const int64_t q = (at - 1 - s0) / 2;
            bf16_pack_values(kern, dst + (byf ? q : q * ld), ld, pending, &two, 2, Ev);
            pending = NULL;
            r += src->view->row_stride;
            at++;
            left--;
        }
        const int64_t whole = left & ~(int64_t)1, q = (at - s0) / 2;
        if (whole) bf16_pack_values(kern, dst + (byf ? q : q * ld), ld, r, src->view, (int)whole, Ev);
        if (left & 1) pending = r + whole * src->view->row_stride;
    }
    if (pending) {  /* the range's last row, an odd count: its pair with zero */
        const int64_t q = (n - 1) / 2;
        bf16_pack_values(kern, dst + (byf ? q : q * ld), ld, pending, src->view, 1, Ev);
    }
}
#endif

/* The key/value slice (batch index, key/value head) of packing unit u, and the
 * keys [s0, s0 + n) it packs; 0 when there are none. */
static int FN(pack_unit)(const sdpa_problem *p, const plan *pl, int64_t u, int64_t *b, int64_t *hkv, int64_t *s0,
                         int *n) {
    const int64_t per = (p->len_kv + pl->pack.chunk - 1) / pl->pack.chunk;
    const int64_t slice = u / per, Hkv = p->num_heads / p->gqa_group;
    *b = slice / Hkv;
    *hkv = slice % Hkv;
    *s0 = (u % per) * pl->pack.chunk;
    const int64_t S_b = key_limit(p, *b);
    if (*s0 >= S_b) return 0;
    *n = (int)(S_b - *s0 < pl->pack.chunk ? S_b - *s0 : pl->pack.chunk);
    return 1;
}

/* Packing unit u of a part's call buffer (pl->pack.on): the keys of one chunk
 * of one key/value slice into the layout the products read, once per call for
 * every query block and every query head of the GQA group. */
static void FN(pack_kv_unit)(const sdpa_problem *p, const plan *pl, const KT *kern, T *packed, int64_t u) {
    int64_t b, hkv, s0;
    int n;
    if (!FN(pack_unit)(p, pl, u, &b, &hkv, &s0, &n)) return;
    const int64_t E = p->head_dim, Ev = p->head_dim_v;
    T *slice = packed + (b * (p->num_heads / p->gqa_group) + hkv) * (int64_t)pl->pack.slice_elems;
    const sdpa_dtype kvdt = pl->path.kv_dtype;
    const kv_source ks = kv_source_of(p, 0, kvdt, b, hkv, E), vs = kv_source_of(p, 1, kvdt, b, hkv, Ev);
#if HAS_BF16
    if (pl->bf16.on) {  /* V pairs; K read in place, or as pairs padded to whole tiles */
        uint32_t *vp = (uint32_t *)slice + pl->pack.slice_k;
        if (pl->pack.slice_k) bf16_pack_key_range((uint32_t *)slice + s0 * pl->bf16.e2p, pl->bf16.e2p, &ks, s0, n, E);
        if (kern->bf16.values_by_feature)
            bf16_pack_value_range(kern, vp + s0 / 2, pl->bf16.vp_ld, &vs, s0, n, Ev);
        else
            bf16_pack_value_range(kern, vp + s0 / 2 * Ev, Ev, &vs, s0, n, Ev);
        return;
    }
#endif
    FN(convert_range)(kern, slice + s0 * E, &ks, kvdt, s0, n, E);
    FN(convert_range)(kern, slice + pl->pack.slice_k + s0 * Ev, &vs, kvdt, s0, n, Ev);
}
