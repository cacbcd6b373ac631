/* Where one key/value slice's rows lie, and the one walk over them.  Internal.
 *
 * A kv_source is the keys (or the values) of one (batch index, key/value head)
 * of a part: a view of the cache's dtype, its scales (quantized caches), and,
 * paged, the sequence's block table.  kv_next hands out the rows of a range in
 * segments of rows that lie at one stride: the whole range for an array, the
 * part of it in each block for a paged cache.  Every reader -- the row path's
 * products, the tiled path's tiles and products, the packing of a call and
 * the copies of a tree's keys -- walks a range with it. */
#ifndef SDPA_KV_SOURCE_H
#define SDPA_KV_SOURCE_H

#include <stdint.h>

#include "problem.h"

/* The row path walks the keys in steps of rows (a block's rows when blocks
 * are shorter).  Paged, it asks for the next step's rows as it hands out one
 * when that step starts another block: the hardware prefetchers stop at each
 * paged block, and the next block is anywhere in the pool; within a block
 * they follow the rows, and asking as well costs (Zen 4, bfloat16, B 8, 32/8
 * heads, S 4,096, 2 threads: one block a sequence 7.3 -> 4.5 ms, the arrays'
 * time, blocks of 128 7.4 -> 6.8 ms, of 16 8.5 -> 7.7 ms).  A step is about
 * 16 KiB of float32 rows, a multiple of 16 rows in [16, 64]: it depends on the
 * head dim alone, not on the cache's dtype, so that the kernels group the keys
 * of a 16-bit or quantized
 * cache as they do float32 ones (the same sums, the same bits).  Arrays are
 * walked in the same steps but not prefetched: their rows stream, and asking
 * for them as well costs bandwidth.  Measured on a 2-core Xeon (decoding,
 * E 128): paged bfloat16 blocks of 16 and 128 at 0.75-0.86x the arrays
 * without the prefetch, 0.9-1.1x with it; arrays with it 0.85x as fast
 * (8 x 32 heads, S 2,048, float32 and bfloat16, 1 and 2 threads). */
#define SDPA_ROW_STEP_BYTES 16384

/* The scales of a quantized key or value view (kv_dtype SDPA_INT8, _INT4, or
 * a float8 type with scales): the group's scale of row j, column c is
 * base[j * rs + (c / group) * cs]. */
typedef struct kv_scales {
    const float *base;      /* at the slice (arrays) or the segment (paged); NULL: none */
    int64_t rs, cs;         /* token and group strides                          */
    int64_t group;          /* channels per scale                               */
} kv_scales;

typedef struct kv_source {
    const sdpa_problem *p;
    const sdpa_view *view;   /* key or value (or a scale view, walked on its own) */
    const sdpa_view *scale_view;  /* its scales, or NULL                         */
    int64_t b, hkv;
    size_t elem;             /* bytes of an element of the view (int4: a byte, two values) */
    int64_t cols;            /* elements of a row (int4: bytes), for the prefetch */
    int64_t groups;          /* scales a row (0: none)                           */
    const char *base;        /* arrays: the slice's first row; paged: NULL       */
    kv_scales sc;            /* the scales' layout (base: at the slice, arrays)  */
    int64_t blocks;          /* paged: the sequence's blocks                     */
    int follow;              /* paged: a block right after another in the pool
                                continues its rows (one stride through both) */
} kv_source;

/* The keys (which = 0) or values (1) of slice (b, hkv) of p, of dtype dt, with
 * cols columns. */
static inline kv_source kv_source_of(const sdpa_problem *p, int which, sdpa_dtype dt, int64_t b, int64_t hkv,
                                     int64_t cols) {
    kv_source s;
    s.p = p;
    s.view = which ? &p->value : &p->key;
    s.scale_view = which ? &p->value_scale : &p->key_scale;
    s.b = b;
    s.hkv = hkv;
    s.elem = sdpa_dtype_size(dt);
    s.cols = dt == SDPA_INT4 ? cols / 2 : cols;  /* int4: a row's bytes hold two values each */
    const int paged = p->block_size > 0;
    s.base = paged ? NULL : (const char *)view_at(p, s.view, b, hkv, s.elem);
    s.blocks = paged ? (key_limit(p, b) + p->block_size - 1) / p->block_size : 0;
    s.follow = paged && s.view->batch_strides[0] == p->block_size * s.view->row_stride;
    s.sc.base = NULL;
    s.sc.rs = s.sc.cs = 0;
    s.sc.group = 1;
    s.groups = 0;
    if (sdpa_is_quantized(dt) && s.scale_view->data) {
        s.sc.base = paged ? NULL : (const float *)view_at(p, s.scale_view, b, hkv, sizeof(float));
        s.sc.rs = s.scale_view->row_stride;
        s.sc.cs = s.scale_view->col_stride;
        const int64_t width = which ? p->head_dim_v : p->head_dim;
        s.sc.group = p->kv_group_size > 0 ? p->kv_group_size : (width > 0 ? width : 1);
        s.groups = width / s.sc.group;
    } else {
        s.scale_view = NULL;
    }
    if (s.scale_view && s.scale_view->batch_strides[0] != p->block_size * s.scale_view->row_stride) s.follow = 0;
    return s;
}

/* Whether table entry j of a paged source (0 < j) is the block right after
 * entry j - 1's in a pool where such blocks continue each other's rows. */
static inline int kv_block_follows(const kv_source *s, int64_t j) {
    const int32_t *table = s->p->block_table + s->b * s->p->block_table_stride;
    return s->follow && j < s->blocks && table[j] == table[j - 1] + 1;
}

/* A walk over rows [pos, end) of a source. */
typedef struct kv_cursor {
    int64_t pos, end;
    int64_t block, row;      /* paged: the table entry and the row in it */
    int64_t ahead;           /* paged: rows before this position have been asked for */
    int64_t ablock, arow;    /* its table entry and row */
} kv_cursor;

static inline kv_cursor kv_walk(const kv_source *s, int64_t pos, int64_t end) {
    kv_cursor c = {pos, end, 0, 0, pos, 0, 0};
    if (s->p->block_size > 0) {  /* two divisions a walk, not one a block */
        c.block = c.ablock = pos / s->p->block_size;
        c.row = c.arow = pos % s->p->block_size;
    }
    return c;
}

/* Asks for n rows of `bytes` bytes each, rs elements of `elem` bytes apart. */
static inline void kv_prefetch_rows(const char *row0, int64_t rs, size_t elem, int64_t n, int64_t bytes) {
    for (int64_t x = 0; x < n; x++) {
        const char *row = row0 + x * rs * (int64_t)elem;
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 2);
    }
}

/* Rows a step of the row path holds (kv_next's `step`) for rows of `cols` values. */
static inline int64_t kv_step_rows(int64_t cols) {
    const int64_t rows = SDPA_ROW_STEP_BYTES / (4 * (cols > 0 ? cols : 1)) / 16 * 16;
    return rows < 16 ? 16 : rows > 64 ? 64 : rows;
}

/* The next segment: its first row (*rows), its scales (sc, base moved to the
 * segment's first row; none when the source has none) and its number of rows;
 * 0 at the end.  With step > 0 (rows; a contiguous view) segments hold at
 * most that many rows, and, paged, the rows of the next step are asked for:
 * those of the block that holds the next position. */
static inline int64_t kv_next(const kv_source *s, kv_cursor *c, const char **rows, kv_scales *sc, int64_t step) {
    const int64_t a = c->pos;
    if (a >= c->end) return 0;
    const sdpa_problem *p = s->p;
    const int64_t rs = s->view->row_stride, bytes = s->cols * (int64_t)s->elem;
    *sc = s->sc;
    if (s->view->col_stride != 1) step = 0;
    if (p->block_size <= 0) {
        int64_t n = c->end - a;
        if (step && n > step) n = step;
        *rows = s->base + a * rs * (int64_t)s->elem;
        if (sc->base) sc->base += a * sc->rs;
        c->pos = a + n;
        return n;
    }
    const int64_t left = p->block_size - c->row;
    int64_t n = left < c->end - a ? left : c->end - a;
    if (step && n > step) n = step;
    *rows = paged_block_row(p, s->view, s->b, s->hkv, c->block, c->row, s->elem);
    if (s->scale_view)
        sc->base = (const float *)paged_block_row(p, s->scale_view, s->b, s->hkv, c->block, c->row, sizeof(float));
    c->row += n;
    if (c->row == p->block_size) {
        c->block++;
        c->row = 0;
        /* the row path: blocks that follow each other in the pool are one segment
         * (sparse_attention's one-position blocks: a run of listed positions) */
        while (step && n < step && a + n < c->end && kv_block_follows(s, c->block)) {
            int64_t more = p->block_size;
            if (more > c->end - a - n) more = c->end - a - n;
            if (more > step - n) more = step - n;
            n += more;
            c->row = more;
            if (c->row < p->block_size) break;
            c->block++;
            c->row = 0;
        }
    }
    c->pos = a + n;
    if (step && p->block_size * bytes >= SDPA_ROW_AHEAD_BYTES) {
        /* the next step, where it starts another block: within a block the
         * hardware's prefetchers follow the rows, and asking as well costs */
        if (c->block < s->blocks && c->row == 0) {
            const int64_t room = p->block_size;
            kv_prefetch_rows(paged_block_row(p, s->view, s->b, s->hkv, c->block, 0, s->elem), rs, s->elem,
                             room < step ? room : step, bytes);
        }
    } else if (step) {  /* small blocks: keep the rows of a step ahead asked for, block by block */
        const int64_t lim = s->blocks * p->block_size;
        const int64_t want = c->pos + step < lim ? c->pos + step : lim;
        if (c->ahead < c->pos) {  /* the first segment of a walk is read unasked */
            c->ahead = c->pos;
            c->ablock = c->block;
            c->arow = c->row;
        }
        while (c->ahead < want) {  /* a run of rows at one stride: this block's, and those that follow it */
            const char *row0 = paged_block_row(p, s->view, s->b, s->hkv, c->ablock, c->arow, s->elem);
            const float *scale0 = s->scale_view ? (const float *)paged_block_row(p, s->scale_view, s->b, s->hkv,
                                                                                 c->ablock, c->arow, sizeof(float))
                                                : NULL;
            int64_t k = 0;
            for (;;) {
                const int64_t room = p->block_size - c->arow;
                const int64_t m = room < want - c->ahead ? room : want - c->ahead;
                k += m;
                c->ahead += m;
                c->arow += m;
                if (c->arow < p->block_size) break;
                c->ablock++;
                c->arow = 0;
                if (c->ahead >= want || !kv_block_follows(s, c->ablock)) break;
            }
            kv_prefetch_rows(row0, rs, s->elem, k, bytes);
            if (scale0) kv_prefetch_rows((const char *)scale0, s->scale_view->row_stride, sizeof(float), k, 4);
        }
    }
    return n;
}

#endif
