/* Top-k sparse attention (sdpa_problem.topk_indices, sdpa.h): each query row
 * attends the key positions listed for it.
 *
 * It runs as a paged problem over the cache seen as a pool of one-position
 * blocks: block n is the row n row strides into the cache, so a row's listed
 * positions, ascending, are a block table.  A sequence of that problem is one
 * query row with the heads that share its list (every head, or one key/value
 * head's group): the query rows are packed into sequences, the outputs and
 * lses scattered back.  When the slices -- batch indices, and with a list per
 * key/value head the heads -- of every cached operand lie the same whole
 * number of rows apart, one call computes them all (a slice's first row
 * folded into its block numbers); else a call per slice, from the slice's
 * first row.  Within each group of SHARE_ROWS rows of a slice the positions
 * every row lists come first in each row's table, in one order, and the
 * planner reads them once for the group, as the shared prefix of forked
 * sequences. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "plan.h"
#include "problem.h"

/* Rows of a slice grouped (aligned) to share the positions they all list. */
#define SHARE_ROWS 64

typedef struct sparse_ctx {
    const sdpa_problem *p;
    int64_t lists;          /* lists a batch index: 1 or Hkv                    */
    int64_t heads;          /* query heads a list: Hq / lists                   */
    int64_t first_slice;    /* the call's slices (b * lists + h), from here on  */
    int64_t groups;         /* row groups a slice                               */
    int fold;               /* slices folded into the block numbers             */
    int64_t mult_b[SDPA_MAX_BATCH_DIMS], mult_h;  /* folded: rows between slices */
    size_t qsize, csize;    /* bytes of a query / output and of a compute element */
    int32_t *tables;        /* (N, topk)                                         */
    int64_t *lens;          /* (N,)                                              */
    char *q, *o, *lse, *sinks;  /* (N, heads, E), (N, heads, Ev), (N, heads) x 2 */
} sparse_ctx;

/* Sorts n positions (>= 0) ascending: nothing to do when they are (top-k
 * lists often are), else an LSD radix sort by bytes, as many as the largest
 * needs, through tmp (n entries). */
static void sort_positions(int32_t *t, int64_t n, int32_t *tmp) {
    int32_t top = 0;
    int sorted = 1;
    for (int64_t j = 0; j < n; j++) {
        if (j && t[j] < t[j - 1]) sorted = 0;
        if (t[j] > top) top = t[j];
    }
    if (sorted) return;
    int32_t *src = t, *dst = tmp;
    for (int shift = 0; shift < 32 && (top >> shift) > 0; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t j = 0; j < n; j++) count[((src[j] >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (int64_t j = 0; j < n; j++) dst[count[(src[j] >> shift) & 255]++] = src[j];
        int32_t *x = src;
        src = dst;
        dst = x;
    }
    if (src != t) memcpy(t, src, (size_t)n * sizeof(int32_t));
}

/* Copies n elements of `size` bytes from src to dst, `ss` and `ds` elements
 * apart there. */
static void copy_elems(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n, size_t size) {
    if (ss == 1 && ds == 1) {
        memcpy(dst, src, (size_t)n * size);
        return;
    }
    for (int64_t c = 0; c < n; c++) memcpy(dst + c * ds * (int64_t)size, src + c * ss * (int64_t)size, size);
}

/* A group of rows shares the positions all its rows that list any list:
 * those (once each, ascending) lead each row's table, the rest follow,
 * ascending.  The tables (rows x k) hold the rows' valid entries, ascending. */
static void shared_first(int32_t *table, const int64_t *lens, int64_t rows, int64_t k, int32_t *common,
                         int32_t *rest) {
    int64_t nc = 0, r0 = 0;
    while (r0 < rows && lens[r0] == 0) r0++;
    for (int64_t j = 0; r0 < rows && j < lens[r0]; j++)  /* the first such row's positions, once each */
        if (nc == 0 || common[nc - 1] != table[r0 * k + j]) common[nc++] = table[r0 * k + j];
    for (int64_t r = r0 + 1; r < rows && nc > 0; r++) {  /* kept where every row lists them */
        if (lens[r] == 0) continue;
        const int32_t *t = table + r * k;
        int64_t kept = 0, j = 0;
        for (int64_t i = 0; i < nc; i++) {
            while (j < lens[r] && t[j] < common[i]) j++;
            if (j < lens[r] && t[j] == common[i]) common[kept++] = common[i];
        }
        nc = kept;
    }
    if (nc == 0) return;
    for (int64_t r = r0; r < rows; r++) {
        if (lens[r] == 0) continue;
        int32_t *t = table + r * k;
        int64_t ci = 0, nr = 0;
        for (int64_t j = 0; j < lens[r]; j++) {
            if (ci < nc && t[j] == common[ci])
                ci++;  /* a common position's first listing leads the table */
            else
                rest[nr++] = t[j];
        }
        memcpy(t, common, (size_t)nc * sizeof(int32_t));
        memcpy(t + nc, rest, (size_t)nr * sizeof(int32_t));
    }
}

/* Batch index b and list h's first row in the pool (block number offset). */
static int64_t slice_base(const sparse_ctx *cx, int64_t b, int64_t h) {
    if (!cx->fold) return 0;
    const sdpa_problem *p = cx->p;
    int64_t base = h * cx->mult_h;
    for (int d = p->num_batch_dims - 1; d >= 0; d--) {
        base += (b % p->batch_shape[d]) * cx->mult_b[d];
        b /= p->batch_shape[d];
    }
    return base;
}

/* Task i's rows: row group i % groups of the call's slice i / groups. */
typedef struct row_group {
    int64_t b, h;      /* batch index and list                 */
    int64_t l0, rows;  /* its rows [l0, l0 + rows)             */
    int64_t n0;        /* the sequence of row l0 in the call   */
} row_group;

static row_group group_of(const sparse_ctx *cx, int64_t i) {
    const int64_t L = cx->p->len_q, slice = cx->first_slice + i / cx->groups;
    row_group g;
    g.b = slice / cx->lists, g.h = slice % cx->lists;
    g.l0 = (i % cx->groups) * SHARE_ROWS;
    g.rows = L - g.l0 < SHARE_ROWS ? L - g.l0 : SHARE_ROWS;
    g.n0 = (i / cx->groups) * L + g.l0;
    return g;
}

/* Task i: its row group's tables (valid entries ascending, shared ones first,
 * then the slice's base added), packed query rows and sinks. */
static void fill_group(void *vctx, int64_t i, int tid) {
    (void)tid;
    const sparse_ctx *cx = (const sparse_ctx *)vctx;
    const sdpa_problem *p = cx->p;
    const row_group g = group_of(cx, i);
    const int64_t k = p->topk, b = g.b, h = g.h, l0 = g.l0, rows = g.rows, n0 = g.n0;
    const int64_t limit = key_limit(p, b), base = slice_base(cx, b, h);
    const sdpa_view *iv = &p->topk_indices;
    const int32_t *lists = (const int32_t *)view_at(p, iv, b, h, sizeof(int32_t));
    /* each row's scratch: a sort's buffer, then the common positions and the rest */
    int32_t *scratch = (int32_t *)malloc((size_t)(2 * k + 1) * sizeof(int32_t));
    if (!scratch) {  /* nothing is computed: the call reports it */
        cx->lens[n0] = -1;
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        int32_t *t = cx->tables + (n0 + r) * k;
        const int32_t *src = lists + (l0 + r) * iv->row_stride;
        int64_t n = 0;
        for (int64_t j = 0; j < k; j++) {
            const int32_t s = src[j * iv->col_stride];
            if (s >= 0 && s < limit) t[n++] = s;
        }
        sort_positions(t, n, scratch);
        cx->lens[n0 + r] = n;
    }
    if (rows > 1 && k > 0) shared_first(cx->tables + n0 * k, cx->lens + n0, rows, k, scratch, scratch + k);
    free(scratch);
    if (base)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < cx->lens[n0 + r]; j++) cx->tables[(n0 + r) * k + j] += (int32_t)base;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cx->heads; j++) {
            const int64_t hq = h * cx->heads + j, n = n0 + r;
            const char *q = (const char *)view_at(p, &p->query, b, hq, cx->qsize) +
                            (l0 + r) * p->query.row_stride * (int64_t)cx->qsize;
            copy_elems(cx->q + (size_t)((n * cx->heads + j) * p->head_dim) * cx->qsize, 1, q, p->query.col_stride,
                       p->head_dim, cx->qsize);
            if (cx->sinks)
                memcpy(cx->sinks + (size_t)(n * cx->heads + j) * cx->csize, view_at(p, &p->sinks, b, hq, cx->csize),
                       cx->csize);
        }
}

/* Task i: the outputs (and lses) of row group i, back to the caller's views. */
static void scatter_group(void *vctx, int64_t i, int tid) {
    (void)tid;
    const sparse_ctx *cx = (const sparse_ctx *)vctx;
    const sdpa_problem *p = cx->p;
    const row_group g = group_of(cx, i);
    const int64_t b = g.b, h = g.h, l0 = g.l0, rows = g.rows, n0 = g.n0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cx->heads; j++) {
            const int64_t hq = h * cx->heads + j, n = n0 + r, l = l0 + r;
            char *o = (char *)view_at(p, &p->out, b, hq, cx->qsize) + l * p->out.row_stride * (int64_t)cx->qsize;
            copy_elems(o, p->out.col_stride, cx->o + (size_t)((n * cx->heads + j) * p->head_dim_v) * cx->qsize, 1,
                       p->head_dim_v, cx->qsize);
            if (cx->lse) {
                char *ls = (char *)view_at(p, &p->lse, b, hq, cx->csize) + l * p->lse.row_stride * (int64_t)cx->csize;
                memcpy(ls, cx->lse + (size_t)(n * cx->heads + j) * cx->csize, cx->csize);
            }
        }
}

/* Whether view v's slices lie whole rows apart, as many as earlier views'
 * (mult_b, mult_h; *first: none yet). */
static int whole_rows(const sdpa_problem *p, const sdpa_view *v, int64_t lists, int64_t *mult_b, int64_t *mult_h,
                      int *first) {
    const int64_t rs = v->row_stride;
    if (rs <= 0) return 0;
    for (int d = 0; d < p->num_batch_dims; d++) {
        const int64_t st = v->batch_strides[d];
        const int64_t m = p->batch_shape[d] > 1 ? st / rs : 0;
        if (p->batch_shape[d] > 1 && (st < 0 || st % rs != 0)) return 0;
        if (!*first && m != mult_b[d]) return 0;
        mult_b[d] = m;
    }
    const int64_t m = lists > 1 ? v->head_stride / rs : 0;
    if (lists > 1 && (v->head_stride < 0 || v->head_stride % rs != 0)) return 0;
    if (!*first && m != *mult_h) return 0;
    *mult_h = m;
    *first = 0;
    return 1;
}

/* Whether every slice of the cached operands can share one pool: whole rows
 * apart alike, and every block number below 2^31.  Sets the multipliers and
 * *blocks (the pool's size). */
static int foldable(const sdpa_problem *p, int64_t lists, sparse_ctx *cx, int64_t *blocks) {
    const sdpa_view *views[4] = {&p->key, &p->value, &p->key_scale, &p->value_scale};
    int first = 1;
    for (int i = 0; i < 4; i++)
        if ((i < 2 || views[i]->data) && !whole_rows(p, views[i], lists, cx->mult_b, &cx->mult_h, &first)) return 0;
    int64_t top = p->len_kv - 1;
    for (int d = 0; d <= p->num_batch_dims; d++) {
        const int64_t n = d < p->num_batch_dims ? p->batch_shape[d] : lists;
        const int64_t m = d < p->num_batch_dims ? cx->mult_b[d] : cx->mult_h;
        if (m != 0 && n - 1 > INT32_MAX / m) return 0;
        top += (n - 1) * m;
        if (top > INT32_MAX - 1) return 0;
    }
    *blocks = top + 1;
    return 1;
}

/* The pool view of v for slice (b, h): one-position blocks a row apart, from
 * the slice's first row (or, folded, the cache's first). */
static sdpa_view pool_view(const sdpa_problem *p, const sdpa_view *v, int fold, int64_t lists, int64_t b,
                           int64_t h, size_t elem) {
    sdpa_view w = *v;
    if (!v->data) return w;
    if (!fold) w.data = view_at(p, v, b, lists > 1 ? h : 0, elem);
    memset(w.batch_strides, 0, sizeof(w.batch_strides));
    w.batch_strides[0] = v->row_stride;
    if (lists > 1) w.head_stride = 0;
    return w;
}

/* A packed view: rows `heads` x `cols` apart, heads `cols` apart. */
static sdpa_view packed(void *data, int64_t heads, int64_t cols) {
    sdpa_view w;
    memset(&w, 0, sizeof(w));
    w.data = data;
    w.batch_strides[0] = heads * cols;
    w.head_stride = cols;
    w.row_stride = cols;
    w.col_stride = 1;
    return w;
}

sdpa_status sdpa_sparse_call(const sdpa_problem *p, int64_t batch_count) {
    sparse_ctx cx;
    memset(&cx, 0, sizeof(cx));
    cx.p = p;
    cx.lists = topk_lists_heads(p);
    cx.heads = p->num_heads / cx.lists;
    cx.qsize = sdpa_dtype_size(p->dtype);
    cx.csize = compute_size(p);
    cx.groups = (p->len_q + SHARE_ROWS - 1) / SHARE_ROWS;
    const int64_t slices = batch_count * cx.lists, k = p->topk;
    int64_t blocks = p->len_kv;
    cx.fold = slices > 1 && foldable(p, cx.lists, &cx, &blocks);
    const int64_t per_call = cx.fold ? slices : 1;  /* slices a call */
    const int64_t N = per_call * p->len_q;          /* sequences a call */
    const int64_t hq = N * cx.heads;
    const size_t bytes = (size_t)(N * k) * sizeof(int32_t) + (size_t)N * sizeof(int64_t) +
                         (size_t)(hq * (p->head_dim + p->head_dim_v)) * cx.qsize + (size_t)(2 * hq) * cx.csize;
    char *mem = (char *)sdpa_aligned_block(bytes + 64 * 6);
    if (!mem) return SDPA_ERR_NO_MEMORY;
    char *at = mem;
#define CARVE(n) (at += (((size_t)(n) + 63) / 64) * 64, at - (((size_t)(n) + 63) / 64) * 64)
    cx.tables = (int32_t *)CARVE((size_t)(N * k) * sizeof(int32_t));
    cx.lens = (int64_t *)CARVE((size_t)N * sizeof(int64_t));
    cx.q = CARVE((size_t)(hq * p->head_dim) * cx.qsize);
    cx.o = CARVE((size_t)(hq * p->head_dim_v) * cx.qsize);
    cx.lse = p->lse.data ? CARVE((size_t)hq * cx.csize) : NULL;
    cx.sinks = p->sinks.data ? CARVE((size_t)hq * cx.csize) : NULL;
#undef CARVE

    sdpa_problem c = *p;  /* the paged problem of one call */
    memset(c.batch_shape, 0, sizeof(c.batch_shape));
    memset(&c.topk_indices, 0, sizeof(c.topk_indices));
    c.topk = 0;
    c.num_batch_dims = 1;
    c.batch_shape[0] = N;
    c.num_heads = cx.heads;
    c.len_q = 1;
    c.len_kv = k;
    c.query = packed(cx.q, cx.heads, p->head_dim);
    c.out = packed(cx.o, cx.heads, p->head_dim_v);
    c.lse = cx.lse ? packed(cx.lse, cx.heads, 1) : (sdpa_view){0};
    c.sinks = cx.sinks ? packed(cx.sinks, cx.heads, 1) : (sdpa_view){0};
    c.key_lengths = cx.lens;
    memset(c.key_lengths_strides, 0, sizeof(c.key_lengths_strides));
    c.key_lengths_strides[0] = 1;
    c.block_table = cx.tables;
    c.block_table_stride = k;
    c.block_size = 1;
    c.num_blocks = blocks;
    c.offsets_from_end = 1;
    c.causal_offset = c.align_offset = 0;

    const size_t kvsize = sdpa_dtype_size(kv_dtype_of(p));
    const int64_t tasks = per_call * cx.groups;
    /* the lists' preparation by its own work (a small call's stays on one
     * thread, whatever num_threads asks of the products) */
    int threads = sdpa_threads_for(0, 0, tasks, 8.0 * (double)(N * (k + cx.heads * (p->head_dim + p->head_dim_v))));
    if (p->num_threads > 0 && threads > p->num_threads) threads = p->num_threads;
    sdpa_status st = SDPA_OK;
    for (int64_t s = 0; s < slices && st == SDPA_OK; s += per_call) {
        const int64_t b = s / cx.lists, h = s % cx.lists;
        cx.first_slice = s;
        c.key = pool_view(p, &p->key, cx.fold, cx.lists, b, h, kvsize);
        c.value = pool_view(p, &p->value, cx.fold, cx.lists, b, h, kvsize);
        c.key_scale = pool_view(p, &p->key_scale, cx.fold, cx.lists, b, h, sizeof(float));
        c.value_scale = pool_view(p, &p->value_scale, cx.fold, cx.lists, b, h, sizeof(float));
        sdpa_parallel_for(threads, tasks, fill_group, &cx);
        for (int64_t n = 0; n < N; n++)
            if (cx.lens[n] < 0) st = SDPA_ERR_NO_MEMORY;  /* a group's scratch */
        if (st == SDPA_OK) st = sdpa_run_valid(&c, N);
        if (st == SDPA_OK) sdpa_parallel_for(threads, tasks, scatter_group, &cx);
    }
    sdpa_aligned_free(mem);
    return st;
}
