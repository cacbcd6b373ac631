/* Reading a problem: where an operand's rows lie, which keys a row sees.
 * Shared by the planner (planner.c) and the executor (exec.c); internal. */
#ifndef SDPA_PROBLEM_H
#define SDPA_PROBLEM_H

#include <stdint.h>

#include "internal.h"

/* key and value's dtype, SDPA_DTYPE_OF_QUERY resolved */
static inline sdpa_dtype kv_dtype_of(const sdpa_problem *p) {
    return p->kv_dtype == SDPA_DTYPE_OF_QUERY ? p->dtype : p->kv_dtype;
}

/* Bytes of one element of the compute type (weights, lse, masks, slopes). */
static inline size_t compute_size(const sdpa_problem *p) {
    return p->dtype == SDPA_FLOAT64 ? sizeof(double) : sizeof(float);
}

/* Offset (elements) of batch index b, counted over batch_shape, for these
 * batch strides. */
static inline int64_t batch_offset_of(const sdpa_problem *p, const int64_t *batch_strides, int64_t b) {
    int64_t off = 0;
    for (int d = p->num_batch_dims - 1; d >= 0; d--) {
        int64_t n = p->batch_shape[d];
        off += (b % n) * batch_strides[d];
        b /= n;
    }
    return off;
}

/* The address of (batch index b, head h) in a view of elem-byte elements. */
static inline void *view_at(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h, size_t elem) {
    int64_t off = batch_offset_of(p, view->batch_strides, b) + h * view->head_stride;
    return (char *)view->data + off * (int64_t)elem;
}

/* Keys visible to batch index b: S, or its key length clipped to [0, S]. */
static inline int64_t key_limit(const sdpa_problem *p, int64_t b) {
    if (!p->key_lengths) return p->len_kv;
    int64_t len = p->key_lengths[batch_offset_of(p, p->key_lengths_strides, b)];
    return len < 0 ? 0 : (len < p->len_kv ? len : p->len_kv);
}

/* Paged: the address of row `row` of sequence b's block number j (its table's
 * entry j), head h, in a view of elem-byte elements whose batch stride is the
 * stride between blocks. */
static inline const char *paged_block_row(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h,
                                          int64_t j, int64_t row, size_t elem) {
    const int64_t block = p->block_table[b * p->block_table_stride + j];
    const int64_t off = block * view->batch_strides[0] + h * view->head_stride + row * view->row_stride;
    return (const char *)view->data + off * (int64_t)elem;
}

/* The row path's paged blocks of fewer bytes than this (one-position blocks:
 * top-k lists) are asked for a step ahead, block by block (kv_source.h): one
 * block ahead is too short a time for the memory to answer; and a key tile's
 * rows are gathered from them into scratch, so that the products run over a
 * tile, not a block at a time (rows_impl.h).
 * Larger blocks ask for the next block's rows only (a step ahead measured
 * 10% slower there: paged bfloat16, blocks of 16 and 128, Zen 4). */
#define SDPA_ROW_AHEAD_BYTES 4096

/* Whether the row path gathers a tile's keys and values from short paged
 * blocks (SDPA_ROW_AHEAD_BYTES) before its products: rows of adjacent
 * elements, `row_bytes` bytes a key row. */
static inline int paged_rows_gathered(const sdpa_problem *p, int64_t row_bytes) {
    return p->block_size > 0 && p->block_size * row_bytes < SDPA_ROW_AHEAD_BYTES && p->key.col_stride == 1 &&
           p->value.col_stride == 1;
}

/* The rules of a problem with dropout, and of the backward pass: dense
 * float keys and values of the query's dtype, no weights or key scores (the
 * status and the field that breaks them; SDPA_OK, NULL). */
static inline sdpa_status dense_only(const sdpa_problem *p, const char **field) {
    const char *f = NULL;
    sdpa_status st = SDPA_ERR_BAD_VARIANT;
    if (p->dtype != SDPA_FLOAT32 && p->dtype != SDPA_FLOAT64 && p->dtype != SDPA_BFLOAT16 &&
        p->dtype != SDPA_FLOAT16)
        f = "dtype", st = SDPA_ERR_BAD_DTYPE;
    else if (kv_dtype_of(p) != p->dtype) f = "kv_dtype", st = SDPA_ERR_BAD_DTYPE;
    else if (p->block_size > 0) f = "block_size";
    else if (p->cu_seqlens_q) f = "cu_seqlens_q";
    else if (p->cu_seqlens_k) f = "cu_seqlens_k";
    else if (p->topk_indices.data) f = "topk_indices";
    else if (p->block_states.data) f = "block_states";
    else if (p->weights.data) f = "weights";
    else if (p->key_scores.data) f = "key_scores";
    if (!f) return SDPA_OK;
    if (field) *field = f;
    return st;
}

/* What a mask does to a tile (mask_tile_class in scores_impl.h). */
enum { TILE_MIXED = 0, TILE_ALL_VISIBLE = 1, TILE_NONE_VISIBLE = 2 };

/* Whether the window bounds a side. */
static inline int has_window(const sdpa_problem *p) { return p->window_left >= 0 || p->window_right >= 0; }

/* The first key the window lets row l see (0 when unbounded on the left);
 * may be past every key. */
static inline int64_t window_first(const sdpa_problem *p, int64_t l) {
    if (p->window_left < 0) return 0;
    int64_t first = l + p->align_offset - p->window_left;
    return first < 0 ? 0 : first;
}

/* One past the last key the window lets row l see (len_kv when unbounded on
 * the right); may be below window_first. */
static inline int64_t window_end(const sdpa_problem *p, int64_t l) {
    if (p->window_right < 0) return p->len_kv;
    int64_t end = l + p->align_offset + p->window_right + 1;
    return end < 0 ? 0 : (end > p->len_kv ? p->len_kv : end);
}

/* The tiled path reads paged float K and V in place from blocks of this many
 * positions; shorter ones are copied a tile (or a call) at a time */
#define SDPA_PAGED_MIN_IN_PLACE 64

/* Paged bfloat16 keys the products can read as pairs where they lie: blocks
 * of at least SDPA_PAGED_MIN_IN_PLACE positions, rows of whole pairs, 32-bit
 * aligned (else they are paired a tile or a call at a time). */
static inline int paged_pairs_in_place(const sdpa_problem *p) {
    return p->block_size >= SDPA_PAGED_MIN_IN_PLACE && p->head_dim % 2 == 0 && p->key.col_stride == 1 &&
           p->key.row_stride % 2 == 0 && p->key.head_stride % 2 == 0 && p->key.batch_strides[0] % 2 == 0 &&
           ((uintptr_t)p->key.data & 3) == 0;
}

/* Query rows of sequence (batch index) b: len_q, or its share of a packed query. */
static inline int64_t seq_rows(const sdpa_problem *c, int64_t b) {
    return c->cu_seqlens_q ? c->cu_seqlens_q[b + 1] - c->cu_seqlens_q[b] : c->len_q;
}

/* Top-k lists: how many a batch index has, one per key/value head, or one
 * for all heads (a single key/value head, or a head_stride of 0). */
static inline int64_t topk_lists_heads(const sdpa_problem *p) {
    const int64_t hkv = p->gqa_group > 0 ? p->num_heads / p->gqa_group : 0;
    return hkv <= 1 || p->topk_indices.head_stride == 0 ? 1 : hkv;
}

/* Blocks of `size` that cover n: ceil(n / size), 0 for n 0. */
static inline int64_t sdpa_blocks_of(int64_t n, int64_t size) { return n > 0 ? (n - 1) / size + 1 : 0; }

/* Block map: the states of query block i of (batch index b, query head h),
 * block_states.col_stride apart (sdpa.h). */
static inline const int8_t *block_states_row(const sdpa_problem *p, int64_t b, int64_t h, int64_t i) {
    return (const int8_t *)view_at(p, &p->block_states, b, h, 1) + i * p->block_states.row_stride;
}

/* Block map: the next run of neighbouring key blocks of one state other
 * than 0 among the kb blocks of a query block's states (row, col_stride cs),
 * from block *j on, of bk keys each: its keys [*s0, *s1), clipped to S_b, and
 * whether its blocks are full (state 2).  *j moves past the run.  Returns 0
 * when no block is left. */
static inline int block_run_next(const int8_t *row, int64_t cs, int64_t kb, int64_t bk, int64_t S_b, int64_t *j,
                                 int64_t *s0, int64_t *s1, int *full) {
    int64_t a = *j;
    while (a < kb && row[a * cs] == 0) a++;
    if (a >= kb || a * bk >= S_b) return 0;
    const int8_t state = row[a * cs];
    int64_t e = a + 1;
    while (e < kb && row[e * cs] == state) e++;
    *j = e;
    *s0 = a * bk;
    *s1 = e * bk < S_b ? e * bk : S_b;
    *full = state == 2;
    return 1;
}

/* The keys a tiled task visits, run after run (tiled_impl.h): without a
 * block map one run, [begin, end); with one, each run of neighbouring blocks
 * of one state of its query block's states, a partial run clipped to [begin,
 * end) (causality and the window), a full one not.  The current run is
 * [lo, hi), `full` when its blocks are; lo = hi = 0 once no run is left. */
typedef struct key_runs {
    const int8_t *states;  /* the query block's states, or NULL */
    int64_t cs, num_kb, bk, S_b, next_kb;
    int64_t begin, end;
    int64_t lo, hi;
    int full;
} key_runs;

/* The next run with keys into *r; 0 when none is left. */
static inline int key_runs_advance(key_runs *r) {
    if (!r->states) return 0;
    while (block_run_next(r->states, r->cs, r->num_kb, r->bk, r->S_b, &r->next_kb, &r->lo, &r->hi, &r->full)) {
        if (!r->full) {
            if (r->lo < r->begin) r->lo = r->begin;
            if (r->hi > r->end) r->hi = r->end;
        }
        if (r->lo < r->hi) return 1;
    }
    return 0;
}

/* The runs of a task whose keys under causality and the window are [begin,
 * end), with its query block's states (NULL: no map), at the first run. */
static inline key_runs key_runs_start(const sdpa_problem *p, const int8_t *states, int64_t S_b, int64_t begin,
                                      int64_t end) {
    key_runs r = {states, p->block_states.col_stride, states ? sdpa_blocks_of(p->len_kv, p->block_k) : 0,
                  p->block_k, S_b, 0, begin, end, begin, end, 0};
    if (states && !key_runs_advance(&r)) r.lo = r.hi = 0;
    return r;
}

/* The tile after the one at s0 (tiles of `step` keys from each run's start),
 * moving to the next run past this one's end; 0 with r->hi 0 when none is left. */
static inline int64_t key_runs_next(key_runs *r, int64_t s0, int64_t step) {
    if (s0 + step < r->hi) return s0 + step;
    if (key_runs_advance(r)) return r->lo;
    r->lo = r->hi = 0;
    return 0;
}

/* The scale view of a key or value view. */
static inline const sdpa_view *scales_of(const sdpa_problem *p, const sdpa_view *view) {
    return view == &p->key ? &p->key_scale : &p->value_scale;
}

#endif
