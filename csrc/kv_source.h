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

/* Paged decoding prefetches this many rows of the next block as it starts one
 * (blocks of 16 then run as fast as arrays; without it 0.86-0.92x) */
#define SDPA_PAGED_PREFETCH_ROWS 16

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
    int64_t cols;            /* elements of a row, for the prefetch              */
    const char *base;        /* arrays: the slice's first row; paged: NULL       */
    kv_scales sc;            /* the scales' layout (base: at the slice, arrays)  */
    int64_t blocks;          /* paged: the sequence's blocks                     */
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
    s.cols = cols;
    const int paged = p->block_size > 0;
    s.base = paged ? NULL : (const char *)view_at(p, s.view, b, hkv, s.elem);
    s.blocks = paged ? (key_limit(p, b) + p->block_size - 1) / p->block_size : 0;
    s.sc.base = NULL;
    s.sc.rs = s.sc.cs = 0;
    s.sc.group = 1;
    if (sdpa_is_quantized(dt) && s.scale_view->data) {
        s.sc.base = paged ? NULL : (const float *)view_at(p, s.scale_view, b, hkv, sizeof(float));
        s.sc.rs = s.scale_view->row_stride;
        s.sc.cs = s.scale_view->col_stride;
        const int64_t width = which ? p->head_dim_v : p->head_dim;
        s.sc.group = p->kv_group_size > 0 ? p->kv_group_size : (width > 0 ? width : 1);
    } else {
        s.scale_view = NULL;
    }
    return s;
}

/* A walk over rows [pos, end) of a source. */
typedef struct kv_cursor {
    int64_t pos, end;
    int64_t block, row;      /* paged: the table entry and the row in it */
} kv_cursor;

static inline kv_cursor kv_walk(const kv_source *s, int64_t pos, int64_t end) {
    kv_cursor c = {pos, end, 0, 0};
    if (s->p->block_size > 0) {  /* two divisions a walk, not one a block */
        c.block = pos / s->p->block_size;
        c.row = pos % s->p->block_size;
    }
    return c;
}

static inline void kv_prefetch_rows(const char *row0, int64_t rs, size_t elem, int64_t n, int64_t cols) {
    const int64_t bytes = cols * (int64_t)elem;
    for (int64_t x = 0; x < n; x++) {
        const char *row = row0 + x * rs * (int64_t)elem;
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 2);
    }
}

/* The next segment: its first row (*rows), its scales (sc, base moved to the
 * segment's first row; none when the source has none) and its number of rows;
 * 0 at the end.  Paged, with `prefetch`, the first rows of the sequence's next
 * block are asked for: the next block is anywhere in the pool, out of the
 * hardware prefetchers' sight (a longer block's rest is a stream they follow). */
static inline int64_t kv_next(const kv_source *s, kv_cursor *c, const char **rows, kv_scales *sc, int prefetch) {
    const int64_t a = c->pos;
    if (a >= c->end) return 0;
    const sdpa_problem *p = s->p;
    *sc = s->sc;
    if (p->block_size <= 0) {
        *rows = s->base + a * s->view->row_stride * (int64_t)s->elem;
        if (sc->base) sc->base += a * sc->rs;
        c->pos = c->end;
        return c->end - a;
    }
    const int64_t left = p->block_size - c->row, n = left < c->end - a ? left : c->end - a;
    *rows = paged_block_row(p, s->view, s->b, s->hkv, c->block, c->row, s->elem);
    if (s->scale_view)
        sc->base = (const float *)paged_block_row(p, s->scale_view, s->b, s->hkv, c->block, c->row, sizeof(float));
    if (prefetch && c->block + 1 < s->blocks && s->view->col_stride == 1) {
        const int64_t ahead = p->block_size < SDPA_PAGED_PREFETCH_ROWS ? p->block_size : SDPA_PAGED_PREFETCH_ROWS;
        kv_prefetch_rows(paged_block_row(p, s->view, s->b, s->hkv, c->block + 1, 0, s->elem), s->view->row_stride,
                         s->elem, ahead, s->cols);
    }
    c->block++;
    c->row = 0;
    c->pos = a + n;
    return n;
}

#endif
