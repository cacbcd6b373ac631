/* The public entry: validates a problem, has the planner cut it into parts
 * (planner.c) and the executor run them (exec.c), and the facts of this
 * build.  The maths is in the executor's files and the kernels. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "internal.h"
#include "plan.h"
#include "problem.h"

/* Thread counts are capped at this many per CPU (and at least this many). */
#define SDPA_THREADS_PER_CPU 4
#define SDPA_MIN_THREAD_CAP 8

/* ---- element types ---- */

size_t sdpa_dtype_size(sdpa_dtype dt) {
    switch (dt) {
        case SDPA_FLOAT64: return 8;
        case SDPA_BFLOAT16:
        case SDPA_FLOAT16: return 2;
        case SDPA_INT8:
        case SDPA_FP8_E4M3:
        case SDPA_FP8_E5M2:
        case SDPA_INT4: return 1;  /* int4: the unit of its strides, a byte of two values */
        default: return 4;
    }
}

/* ---- validation ---- */

static int mul_ok(int64_t a, int64_t b, int64_t *r) {
    if (a < 0 || b < 0) return 0;
    if (a != 0 && b > INT64_MAX / a) return 0;
    *r = a * b;
    return 1;
}

static int is_single_or_half(sdpa_dtype dt) {
    return dt == SDPA_FLOAT32 || dt == SDPA_BFLOAT16 || dt == SDPA_FLOAT16;
}

/* Whether cu (n + 1 entries) are prefix sums from 0 to total. */
static int prefix_sums(const int64_t *cu, int64_t n, int64_t total) {
    if (cu[0] != 0 || cu[n] != total) return 0;
    for (int64_t i = 0; i < n; i++)
        if (cu[i + 1] < cu[i]) return 0;
    return 1;
}

/* A rule broken: the status, with the name of the field that broke it in
 * *field (sdpa_check's report). */
#define REFUSE(status, name)        \
    do {                            \
        if (field) *field = (name); \
        return (status);            \
    } while (0)

/* The rules of a ragged batch (sdpa.h), and of offsets counted from the end. */
static sdpa_status validate_ragged(const sdpa_problem *p, int64_t count, const char **field) {
    const int ragged = p->cu_seqlens_q || p->cu_seqlens_k;
    if (!ragged) {
        if (p->offsets_from_end && p->block_size == 0) REFUSE(SDPA_ERR_BAD_RAGGED, "offsets_from_end");
        return SDPA_OK;
    }
    if (p->num_batch_dims != 1) REFUSE(SDPA_ERR_BAD_RAGGED, "num_batch_dims");
    if (p->weights.data) REFUSE(SDPA_ERR_BAD_RAGGED, "weights");
    if (p->cu_seqlens_k && (p->block_size != 0 || p->key_lengths))
        REFUSE(SDPA_ERR_BAD_RAGGED, p->block_size != 0 ? "block_size" : "key_lengths");
    if (p->mask_kind != SDPA_MASK_NONE && (p->cu_seqlens_q || p->block_size == 0))
        REFUSE(SDPA_ERR_BAD_RAGGED, "mask_kind");
    if (p->cu_seqlens_q && !prefix_sums(p->cu_seqlens_q, count, p->len_q)) REFUSE(SDPA_ERR_BAD_RAGGED, "cu_seqlens_q");
    if (p->cu_seqlens_k && !prefix_sums(p->cu_seqlens_k, count, p->len_kv)) REFUSE(SDPA_ERR_BAD_RAGGED, "cu_seqlens_k");
    if (p->cu_seqlens_q && p->block_size > 0)  /* a sequence holds its query rows */
        for (int64_t b = 0; b < count; b++)
            if (seq_rows(p, b) > key_limit(p, b)) REFUSE(SDPA_ERR_BAD_RAGGED, "key_lengths");
    return SDPA_OK;
}

/* The rules of top-k lists (sdpa.h): what they go with, and every entry in
 * range (read here, as a paged problem's block table is). */
static sdpa_status validate_topk(const sdpa_problem *p, int64_t count, int64_t work, const char **field) {
    if (!p->topk_indices.data) {
        if (p->topk != 0) REFUSE(SDPA_ERR_NULL_POINTER, "topk_indices");
        return SDPA_OK;
    }
    if (p->topk < 0) REFUSE(SDPA_ERR_BAD_TOPK, "topk");
    if (p->block_size != 0) REFUSE(SDPA_ERR_BAD_TOPK, "block_size");
    if (p->cu_seqlens_q || p->cu_seqlens_k) REFUSE(SDPA_ERR_BAD_TOPK, p->cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k");
    if (p->mask_kind != SDPA_MASK_NONE) REFUSE(SDPA_ERR_BAD_TOPK, "mask_kind");
    if (p->weights.data) REFUSE(SDPA_ERR_BAD_TOPK, "weights");
    if (p->causal) REFUSE(SDPA_ERR_BAD_TOPK, "causal");
    if (has_window(p)) REFUSE(SDPA_ERR_BAD_TOPK, p->window_left >= 0 ? "window_left" : "window_right");
    if (p->alibi.data) REFUSE(SDPA_ERR_BAD_TOPK, "alibi");
    int64_t tmp;
    if (!mul_ok(work, p->topk, &tmp)) REFUSE(SDPA_ERR_OVERFLOW, "topk");
    if (work == 0) return SDPA_OK;
    const int64_t lists = topk_lists_heads(p);
    const sdpa_view *v = &p->topk_indices;
    for (int64_t b = 0; b < count; b++)
        for (int64_t h = 0; h < lists; h++) {
            const int32_t *at = (const int32_t *)view_at(p, v, b, h, sizeof(int32_t));
            for (int64_t l = 0; l < p->len_q; l++)
                for (int64_t j = 0; j < p->topk; j++) {
                    const int32_t s = at[l * v->row_stride + j * v->col_stride];
                    if (s < -1 || s >= p->len_kv) REFUSE(SDPA_ERR_BAD_TOPK, "topk_indices");
                }
        }
    return SDPA_OK;
}

/* The rules of a block map (sdpa.h): what it goes with, and every state
 * one of the three. */
static sdpa_status validate_blocks(const sdpa_problem *p, int64_t count, int64_t work, const char **field) {
    if (!p->block_states.data) return SDPA_OK;
    if (p->block_q < 1) REFUSE(SDPA_ERR_BAD_BLOCKS, "block_q");
    if (p->block_k < 1) REFUSE(SDPA_ERR_BAD_BLOCKS, "block_k");
    if (p->block_size != 0) REFUSE(SDPA_ERR_BAD_BLOCKS, "block_size");
    if (p->cu_seqlens_q || p->cu_seqlens_k)
        REFUSE(SDPA_ERR_BAD_BLOCKS, p->cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k");
    if (p->topk_indices.data) REFUSE(SDPA_ERR_BAD_BLOCKS, "topk_indices");
    if (p->weights.data) REFUSE(SDPA_ERR_BAD_BLOCKS, "weights");
    if (p->key_scores.data) REFUSE(SDPA_ERR_BAD_BLOCKS, "key_scores");
    if (work == 0) return SDPA_OK;
    const sdpa_view *v = &p->block_states;
    const int64_t qb = sdpa_blocks_of(p->len_q, p->block_q), kb = sdpa_blocks_of(p->len_kv, p->block_k);
    for (int64_t b = 0; b < count; b++)
        for (int64_t h = 0; h < p->num_heads; h++) {
            const int8_t *at = (const int8_t *)view_at(p, v, b, h, 1);
            for (int64_t i = 0; i < qb; i++)
                for (int64_t j = 0; j < kb; j++) {
                    const int8_t s = at[i * v->row_stride + j * v->col_stride];
                    if (s < 0 || s > 2) REFUSE(SDPA_ERR_BAD_BLOCKS, "block_states");
                }
            if (v->head_stride == 0) break;  /* every head's map is this one */
        }
    return SDPA_OK;
}

/* Every rule of sdpa.h on *p, in one place: SDPA_OK, or the status of the
 * first rule broken and (field not NULL) the name of the field that broke it. */
static sdpa_status validate(const sdpa_problem *p, int64_t *batch_count, const char **field) {
    const sdpa_dtype kvdt = kv_dtype_of(p);
    const int quantized = sdpa_is_quantized(kvdt);
    /* int8 and int4 need both scales; float8 either may be missing (no scale) */
    const int needs_scales = kvdt == SDPA_INT8 || kvdt == SDPA_INT4;
    if (p->dtype == SDPA_FLOAT64) {
        if (kvdt != SDPA_FLOAT64) REFUSE(SDPA_ERR_BAD_DTYPE, "kv_dtype");
    } else if (!is_single_or_half(p->dtype)) {
        REFUSE(SDPA_ERR_BAD_DTYPE, "dtype");
    } else if (!is_single_or_half(kvdt) && !quantized) {
        REFUSE(SDPA_ERR_BAD_DTYPE, "kv_dtype");
    }
    if (quantized && (p->kv_group_size < 0 || (p->kv_group_size > 0 && (p->head_dim % p->kv_group_size != 0 ||
                                                                        p->head_dim_v % p->kv_group_size != 0))))
        REFUSE(SDPA_ERR_BAD_SHAPE, "kv_group_size");
    /* int4: whole bytes (pairs of values) per row and per group, read along the row */
    if (kvdt == SDPA_INT4) {
        if (p->head_dim % 2) REFUSE(SDPA_ERR_BAD_SHAPE, "head_dim");
        if (p->head_dim_v % 2) REFUSE(SDPA_ERR_BAD_SHAPE, "head_dim_v");
        if (p->kv_group_size % 2) REFUSE(SDPA_ERR_BAD_SHAPE, "kv_group_size");
        if (p->len_kv > 0 && p->head_dim > 0 && p->key.col_stride != 1) REFUSE(SDPA_ERR_BAD_SHAPE, "key");
        if (p->len_kv > 0 && p->head_dim_v > 0 && p->value.col_stride != 1) REFUSE(SDPA_ERR_BAD_SHAPE, "value");
    }
    if (p->num_batch_dims < 0 || p->num_batch_dims > SDPA_MAX_BATCH_DIMS) REFUSE(SDPA_ERR_BAD_SHAPE, "num_batch_dims");
    if (p->num_heads < 0) REFUSE(SDPA_ERR_BAD_SHAPE, "num_heads");
    if (p->len_q < 0 || p->len_q > INT32_MAX) REFUSE(SDPA_ERR_BAD_SHAPE, "len_q");
    if (p->len_kv < 0 || p->len_kv > SDPA_MAX_POSITION) REFUSE(SDPA_ERR_BAD_SHAPE, "len_kv");
    if (p->head_dim < 0 || p->head_dim > INT32_MAX) REFUSE(SDPA_ERR_BAD_SHAPE, "head_dim");
    if (p->head_dim_v < 0 || p->head_dim_v > INT32_MAX) REFUSE(SDPA_ERR_BAD_SHAPE, "head_dim_v");
    if (p->gqa_group < 1 || p->num_heads % p->gqa_group != 0) REFUSE(SDPA_ERR_BAD_GQA, "gqa_group");
    if (p->mask_kind != SDPA_MASK_NONE && p->mask_kind != SDPA_MASK_BOOL &&
        p->mask_kind != SDPA_MASK_ADDITIVE)
        REFUSE(SDPA_ERR_BAD_MASK, "mask_kind");
    if (p->num_threads < 0) REFUSE(SDPA_ERR_BAD_THREADS, "num_threads");
    const int64_t big = SDPA_MAX_POSITION;
    if (p->window_left < -1 || p->window_left > big) REFUSE(SDPA_ERR_BAD_VARIANT, "window_left");
    if (p->window_right < -1 || p->window_right > big) REFUSE(SDPA_ERR_BAD_VARIANT, "window_right");
    if (!(p->softcap >= 0) || p->softcap == (double)INFINITY) REFUSE(SDPA_ERR_BAD_VARIANT, "softcap");
    if ((has_window(p) || p->alibi.data) && (p->align_offset < -big || p->align_offset > big))
        REFUSE(SDPA_ERR_BAD_VARIANT, "align_offset");
    if ((has_window(p) || p->alibi.data) && p->len_q > big) REFUSE(SDPA_ERR_BAD_VARIANT, "len_q");
    int64_t count = 1, tmp;
    for (int d = 0; d < p->num_batch_dims; d++) {
        if (p->batch_shape[d] < 0) REFUSE(SDPA_ERR_BAD_SHAPE, "batch_shape");
        if (!mul_ok(count, p->batch_shape[d], &count)) REFUSE(SDPA_ERR_OVERFLOW, "batch_shape");
    }
    /* a packed query's rows are counted once, not per sequence */
    const int64_t qcount = p->cu_seqlens_q ? (count > 0) : count;
    if (!mul_ok(qcount, p->num_heads, &tmp)) REFUSE(SDPA_ERR_OVERFLOW, "num_heads");
    if (!mul_ok(tmp, p->len_q, &tmp)) REFUSE(SDPA_ERR_OVERFLOW, "len_q");
    if (!mul_ok(tmp, p->len_kv > p->head_dim_v ? p->len_kv : p->head_dim_v, &tmp))
        REFUSE(SDPA_ERR_OVERFLOW, p->len_kv > p->head_dim_v ? "len_kv" : "head_dim_v");
    int64_t work = qcount * p->num_heads * p->len_q;
    if (p->block_size != 0) {  /* paged: every block id that would be read */
        int64_t span;
        if (p->block_size < 0 || p->block_size > SDPA_MAX_POSITION) REFUSE(SDPA_ERR_BAD_PAGES, "block_size");
        if (p->num_batch_dims != 1) REFUSE(SDPA_ERR_BAD_PAGES, "num_batch_dims");
        if (!p->key_lengths) REFUSE(SDPA_ERR_BAD_PAGES, "key_lengths");
        /* a mask only as a bool tree over the last positions, without causality */
        if (p->mask_kind == SDPA_MASK_ADDITIVE || (p->mask_kind == SDPA_MASK_BOOL && (p->causal || p->cu_seqlens_q)))
            REFUSE(SDPA_ERR_BAD_PAGES, "mask_kind");
        if (p->weights.data) REFUSE(SDPA_ERR_BAD_PAGES, "weights");
        if (p->num_blocks < 0) REFUSE(SDPA_ERR_BAD_PAGES, "num_blocks");
        if (p->block_table_stride < 0 || !mul_ok(count, p->block_table_stride, &span))
            REFUSE(SDPA_ERR_BAD_PAGES, "block_table_stride");
        if (work > 0 && p->len_kv > 0 && !p->block_table) REFUSE(SDPA_ERR_NULL_POINTER, "block_table");
        for (int64_t b = 0; work > 0 && b < count; b++) {
            const int64_t len = p->key_lengths[batch_offset_of(p, p->key_lengths_strides, b)];
            if (len < 0 || len > p->len_kv) REFUSE(SDPA_ERR_BAD_PAGES, "key_lengths");
            const int32_t *row = p->block_table + b * p->block_table_stride;
            for (int64_t j = 0; j < (len + p->block_size - 1) / p->block_size; j++)
                if (row[j] < 0 || row[j] >= p->num_blocks) REFUSE(SDPA_ERR_BAD_PAGES, "block_table");
            if (p->mask_kind == SDPA_MASK_BOOL && len < p->len_q)  /* the tree's positions */
                REFUSE(SDPA_ERR_BAD_PAGES, "key_lengths");
        }
    }
    const sdpa_status ragged = validate_ragged(p, count, field);
    if (ragged != SDPA_OK) return ragged;
    const sdpa_status topk = validate_topk(p, count, work, field);
    if (topk != SDPA_OK) return topk;
    const sdpa_status blocks = validate_blocks(p, count, work, field);
    if (blocks != SDPA_OK) return blocks;
    if (!(p->dropout_p >= 0 && p->dropout_p < 1)) REFUSE(SDPA_ERR_BAD_VARIANT, "dropout_p");
    if (p->dropout_p > 0) {
        const sdpa_status dense = dense_only(p, field);
        if (dense != SDPA_OK) return dense;
    }
    if (p->key_scores_rows < 0) REFUSE(SDPA_ERR_BAD_SHAPE, "key_scores_rows");
    if (p->key_scores.data) {  /* what key scores go with (sdpa.h) */
        if (p->cu_seqlens_q || p->cu_seqlens_k)
            REFUSE(SDPA_ERR_BAD_VARIANT, p->cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k");
        if (p->topk_indices.data) REFUSE(SDPA_ERR_BAD_VARIANT, "topk_indices");
        if (p->block_size > 0 && p->mask_kind != SDPA_MASK_NONE) REFUSE(SDPA_ERR_BAD_VARIANT, "mask_kind");
    }
    if (work > 0) {
        if (!p->query.data) REFUSE(SDPA_ERR_NULL_POINTER, "query");
        if (!p->out.data) REFUSE(SDPA_ERR_NULL_POINTER, "out");
        if (p->len_kv > 0 && !p->key.data) REFUSE(SDPA_ERR_NULL_POINTER, "key");
        if (p->len_kv > 0 && !p->value.data) REFUSE(SDPA_ERR_NULL_POINTER, "value");
        if (needs_scales && p->len_kv > 0 && !p->key_scale.data) REFUSE(SDPA_ERR_NULL_POINTER, "key_scale");
        if (needs_scales && p->len_kv > 0 && !p->value_scale.data) REFUSE(SDPA_ERR_NULL_POINTER, "value_scale");
        if (p->mask_kind != SDPA_MASK_NONE && p->len_kv > 0 && !p->mask.data)
            REFUSE(SDPA_ERR_NULL_POINTER, "mask");
    }
    *batch_count = count;
    return SDPA_OK;
}

#undef REFUSE

sdpa_status sdpa_validate(const sdpa_problem *p, int64_t *batch_count) {
    return validate(p, batch_count, NULL);
}

/* ---- public API ---- */

void sdpa_problem_init_sized(sdpa_problem *p, size_t struct_size) {
    if (!p) return;
    if (struct_size != sizeof(*p)) {  /* another layout: write nothing past the size field */
        if (struct_size >= sizeof(p->struct_size)) p->struct_size = struct_size;
        return;
    }
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->dtype = SDPA_FLOAT32;
    p->kv_dtype = SDPA_DTYPE_OF_QUERY;
    p->gqa_group = 1;
    p->scale = 1.0;
    p->mask_kind = SDPA_MASK_NONE;
    p->window_left = p->window_right = -1;
}

/* The symbol of 0.1's sdpa_problem_init (sdpa.h's sdpa_problem_init is now a
 * macro): its callers' structs have no size field and may be smaller than
 * this library's, so only their first 8 bytes (dtype and the next int32 field
 * there) are zeroed.  Whatever the caller then writes there (a dtype below 5
 * and a kv_dtype or batch-dim count) never reads as this struct's size, and
 * sdpa_attention refuses the struct. */
void(sdpa_problem_init)(sdpa_problem *p) {
    if (p) memset(p, 0, 8);
}

sdpa_status sdpa_check(const sdpa_problem *p, const char **field) {
    if (field) *field = NULL;
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) {  /* before reading anything else */
        if (field) *field = "struct_size";
        return SDPA_ERR_ABI;
    }
    int64_t batch_count = 0;
    return validate(p, &batch_count, field);
}

/* Zeroes the key scores of a call that computes nothing (no row). */
static void zero_key_scores(const sdpa_problem *p, int64_t batch_count) {
    const sdpa_view *ks = &p->key_scores;
    for (int64_t b = 0; b < batch_count; b++)
        for (int64_t h = 0; h < (p->gqa_group > 0 ? p->num_heads / p->gqa_group : 0); h++) {
            float *row = (float *)view_at(p, ks, b, h, sizeof(float));
            for (int64_t s = 0; s < p->len_kv; s++) row[s * ks->col_stride] = 0;
        }
}

sdpa_status sdpa_attention(const sdpa_problem *p) {
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) return SDPA_ERR_ABI;  /* before reading anything else */
    int64_t batch_count = 0;
    sdpa_status st = sdpa_validate(p, &batch_count);
    if (st != SDPA_OK) return st;
    if (batch_count * p->num_heads * p->len_q == 0) {  /* empty output */
        if (p->key_scores.data) zero_key_scores(p, batch_count);
        return SDPA_OK;
    }
    if (p->topk_indices.data) return sdpa_sparse_call(p, batch_count);
    if (p->dropout_p > 0) return sdpa_dropout_call(p, batch_count);
    return sdpa_run_valid(p, batch_count);
}

static sdpa_status run_plan(const sdpa_problem *p, int64_t batch_count, int add_scores);

/* Rows [r0, r0 + n) of *p as a problem of their own: the views of rows moved,
 * the offsets (counted from the first row, or from each sequence's last
 * positions when paged or from the end) moved with them. */
static sdpa_problem rows_of(const sdpa_problem *p, int64_t r0, int64_t n) {
    sdpa_problem q = *p;
    const size_t qe = sdpa_dtype_size(p->dtype), ce = compute_size(p);
    struct { sdpa_view *v; size_t elem; } rows[5] = {
        {&q.query, qe}, {&q.out, qe}, {&q.lse, ce}, {&q.weights, ce},
        {&q.mask, p->mask_kind == SDPA_MASK_BOOL ? 1 : ce}};
    for (int i = 0; i < 5; i++) {
        sdpa_view *v = rows[i].v;
        if (v->data) v->data = (char *)v->data + r0 * v->row_stride * (int64_t)rows[i].elem;
    }
    const int64_t delta = p->block_size > 0 || p->offsets_from_end ? r0 + n - p->len_q : r0;
    q.len_q = n;
    q.causal_offset += delta;
    q.align_offset += delta;
    return q;
}

/* Rows per key/value head's group of a call that keeps key scores: the row
 * path holds them all against each key tile. */
#define SDPA_KEY_SCORE_ROWS 64

/* A call with key scores (sdpa.h): the rows before the last key_scores_rows
 * computed on their own (any path), the rows counted in calls of at most
 * SDPA_KEY_SCORE_ROWS rows a group: the first writes the scores, each later
 * one adds its rows' weights, in row order. */
static sdpa_status run_key_scores(const sdpa_problem *p, int64_t batch_count) {
    const int64_t L = p->len_q;
    sdpa_problem c = *p;  /* causal offsets beyond every row's reach are the same as these bounds */
    const int64_t reach = p->len_q + p->len_kv;
    if (c.causal_offset > reach) c.causal_offset = reach;
    if (c.causal_offset < -reach) c.causal_offset = -reach;
    const int64_t W = p->key_scores_rows > 0 && p->key_scores_rows < L ? p->key_scores_rows : L;
    sdpa_status st = SDPA_OK;
    if (W < L) {
        sdpa_problem head = rows_of(&c, 0, L - W);
        memset(&head.key_scores, 0, sizeof(head.key_scores));
        st = run_plan(&head, batch_count, 0);
    }
    const int64_t per = SDPA_KEY_SCORE_ROWS / p->gqa_group > 0 ? SDPA_KEY_SCORE_ROWS / p->gqa_group : 1;
    for (int64_t r0 = L - W; r0 < L && st == SDPA_OK; r0 += per) {
        sdpa_problem rows = rows_of(&c, r0, L - r0 < per ? L - r0 : per);
        rows.key_scores_rows = 0;
        st = run_plan(&rows, batch_count, r0 > L - W);
    }
    return st;
}

sdpa_status sdpa_run_valid(const sdpa_problem *p, int64_t batch_count) {
    return p->key_scores.data ? run_key_scores(p, batch_count) : run_plan(p, batch_count, 0);
}

static sdpa_status run_plan(const sdpa_problem *p, int64_t batch_count, int add_scores) {
    sdpa_status st;
    int by_name = 0;
    const kernel_table *kt = sdpa_kernel_choice(&by_name);
    if (!kt) return SDPA_ERR_BAD_ISA;  /* SDPA_ISA names a set that cannot be used */
    call_plan cp;
    st = sdpa_plan_call(p, batch_count, kt, 0, &cp);
    if (st != SDPA_OK) return st;
    cp.key_scores_add = add_scores;
    if (cp.bf16) {  /* the OS must allow AMX tiles before their first use: asked here */
        kt = sdpa_kernel_table_for_tiles(kt, by_name);
        if (!kt) st = SDPA_ERR_BAD_ISA;
    }
    if (st == SDPA_OK) st = sdpa_run_call(&cp, kt);
    sdpa_plan_free(&cp);
    return st;
}

const char *sdpa_status_message(sdpa_status status) {
    switch (status) {
        case SDPA_OK: return "success";
        case SDPA_ERR_NULL_POINTER: return "a required pointer is NULL";
        case SDPA_ERR_BAD_DTYPE: return "unknown element type";
        case SDPA_ERR_BAD_SHAPE: return "invalid sizes (negative, too large, or too many batch dims)";
        case SDPA_ERR_BAD_GQA: return "gqa_group must be >= 1 and divide num_heads";
        case SDPA_ERR_BAD_MASK: return "unknown mask kind";
        case SDPA_ERR_BAD_THREADS: return "num_threads must be >= 0";
        case SDPA_ERR_NO_MEMORY: return "out of memory for scratch buffers";
        case SDPA_ERR_OVERFLOW: return "sizes overflow 64-bit integers";
        case SDPA_ERR_INTERRUPTED: return "interrupted";
        case SDPA_ERR_BAD_ISA: return "unknown kernel set, or not supported by this CPU";
        case SDPA_ERR_NOT_FINITE:
            return "a value to quantize is NaN or infinite (or, for float8 without scales, beyond its largest finite value)";
        case SDPA_ERR_BAD_PAGES:
            return "paged: a block id out of range, a sequence longer than its block table, no key_lengths, "
                   "num_batch_dims not 1, weights or a mask other than a bool tree (without causality) with paged "
                   "keys, or a negative or too large block size, block count or table stride";
        case SDPA_ERR_BAD_RAGGED:
            return "ragged: cu_seqlens_q or cu_seqlens_k not prefix sums from 0 to len_q / len_kv, num_batch_dims "
                   "not 1, a mask or weights, key_lengths with cu_seqlens_k, a paged sequence with more query rows "
                   "than positions, or offsets_from_end without cu_seqlens";
        case SDPA_ERR_BAD_TOPK:
            return "top-k lists: an entry below -1 or at or past len_kv, a negative topk, or lists with a mask, "
                   "weights, causality, a window, ALiBi, paged or ragged keys";
        case SDPA_ERR_BAD_BLOCKS:
            return "block map: a state other than 0, 1 or 2, a block size below 1, or a map with weights, top-k "
                   "lists, paged or ragged keys";
        case SDPA_ERR_ABI:
            return "the sdpa_problem is not this library's (compiled against another sdpa.h, or not set up by "
                   "sdpa_problem_init)";
        case SDPA_ERR_BAD_VARIANT:
            return "window sides must be -1 or in [0, 2^61], align_offset and len_q at most 2^61 with a window "
                   "or ALiBi, softcap finite and >= 0; key scores not with ragged queries or keys, top-k lists or "
                   "a paged tree mask";
    }
    return "unknown status";
}

int sdpa_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int sdpa_max_threads(void) {
#ifdef _OPENMP
    /* more threads than this never help, and a runtime that cannot create the
     * threads asked for ends the process (libgomp).  Computed once: asking for
     * the processors is a system call. */
    static SDPA_ATOMIC(int) cached = 0;
    int cap = sdpa_atomic_load(&cached);
    if (cap > 0) return cap;
    int procs = omp_get_num_procs(), limit = omp_get_thread_limit();
    cap = procs > 0 && procs <= INT32_MAX / SDPA_THREADS_PER_CPU ? SDPA_THREADS_PER_CPU * procs : 1;
    if (cap < SDPA_MIN_THREAD_CAP) cap = SDPA_MIN_THREAD_CAP;
    if (limit > 0 && limit < cap) cap = limit;
    sdpa_atomic_store(&cached, cap);
    return cap;
#else
    return 1;
#endif
}

int sdpa_default_num_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#define SDPA_STR_(x) #x
#define SDPA_STR(x) SDPA_STR_(x)
const char *sdpa_version(void) {
    return SDPA_STR(SDPA_VERSION_MAJOR) "." SDPA_STR(SDPA_VERSION_MINOR) "." SDPA_STR(SDPA_VERSION_PATCH);
}
