/* The planner: cuts a validated call into parts (one per sequence of a
 * ragged or paged batch, one per shared prefix and tree), has each planned
 * (blocking.c), and lays out the work list, the copies, the merges and the
 * call's memory (plan.h).  Nothing here computes attention or starts a thread. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "problem.h"
#include "testing.h"

/* A shared prefix's rows attend its blocks as one GQA group (the row path) up
 * to this many rows per key/value head, else as the rows of one head (tiled) */
#define SDPA_SHARED_ROW_MODE_ROWS 16
/* A shared prefix is read in parts of at most this many keys (whole blocks), so
 * that a long one gives tasks to many threads */
#define SDPA_SHARED_PART_KEYS 4096
/* From this many threads on, a call of several parts runs its tasks sorted by
 * their estimated cost, costliest first (with fewer, the parts' order is as
 * good, and sorting would only add to the call's fixed cost) */
#define SDPA_SORTED_LIST_THREADS 8



/* ---- parts ---- */

/* Keys of sequence b (its positions, paged). */
static int64_t seq_keys(const sdpa_problem *c, int64_t b) {
    if (c->cu_seqlens_k) return c->cu_seqlens_k[b + 1] - c->cu_seqlens_k[b];
    return key_limit(c, b);
}

/* Moves a view's data to (batch index b, row `row`) and makes its batch dims
 * unused (the part has batch 1). */
static void move_view(const sdpa_problem *c, sdpa_view *v, int64_t b, int64_t row, size_t elem) {
    if (!v->data) return;
    const int64_t off = batch_offset_of(c, v->batch_strides, b) + row * v->row_stride;
    v->data = (char *)v->data + off * (int64_t)elem;
    for (int d = 0; d < SDPA_MAX_BATCH_DIMS; d++) v->batch_strides[d] = 0;
}

/*
 * The part of sequence b over its keys [k0, k0 + S): the call's problem with
 * its views at b's rows, one batch index, its own lengths, and positions
 * resolved: row l is position pos0 + l of the sequence (its last L_b positions
 * when paged or counted from the end), key j position k0 + j.  Paged, the keys
 * stay in their blocks, the table from entry k0 / block_size.
 */
static void sequence_part(part *pt, const sdpa_problem *c, int64_t b, int64_t k0, int64_t S) {
    memset(pt, 0, sizeof(*pt));
    sdpa_problem *p = &pt->p;
    *p = *c;
    const size_t qe = sdpa_dtype_size(c->dtype), ce = compute_size(c), ke = sdpa_dtype_size(kv_dtype_of(c));
    const int64_t L = seq_rows(c, b), S_b = seq_keys(c, b);
    const int64_t qb = c->cu_seqlens_q ? 0 : b, qrow = c->cu_seqlens_q ? c->cu_seqlens_q[b] : 0;
    move_view(c, &p->query, qb, qrow, qe);
    move_view(c, &p->out, qb, qrow, qe);
    move_view(c, &p->lse, qb, qrow, ce);
    move_view(c, &p->alibi, b, 0, ce);
    move_view(c, &p->sinks, b, 0, ce);
    if (c->mask_kind != SDPA_MASK_NONE) move_view(c, &p->mask, b, 0, c->mask_kind == SDPA_MASK_BOOL ? 1 : ce);
    move_view(c, &p->key_scores, b, 0, sizeof(float));
    if (p->key_scores.data) p->key_scores.data = (float *)p->key_scores.data + k0 * p->key_scores.col_stride;
    if (c->block_size > 0) {
        p->block_table = c->block_table + b * c->block_table_stride + k0 / c->block_size;
        pt->key_length = S;
        p->key_lengths = &pt->key_length;
        for (int d = 0; d < SDPA_MAX_BATCH_DIMS; d++) p->key_lengths_strides[d] = 0;
    } else {
        const int64_t kb = c->cu_seqlens_k ? 0 : b, krow = (c->cu_seqlens_k ? c->cu_seqlens_k[b] : 0) + k0;
        move_view(c, &p->key, kb, krow, ke);
        move_view(c, &p->value, kb, krow, ke);
        move_view(c, &p->key_scale, kb, krow, sizeof(float));
        move_view(c, &p->value_scale, kb, krow, sizeof(float));
        p->key_lengths = NULL;
    }
    p->num_batch_dims = 1;
    p->batch_shape[0] = 1;
    p->len_q = L;
    p->len_kv = S;
    p->cu_seqlens_q = p->cu_seqlens_k = NULL;
    p->offsets_from_end = 0;
    const int64_t from_end = c->block_size > 0 || c->offsets_from_end ? S_b - L : 0;
    p->causal_offset += from_end - k0;
    p->align_offset += from_end - k0;
    sdpa_clamp_offsets(p);
    pt->batch_count = 1;
    pt->seq = b;
    pt->partial_at = pt->packed_at = pt->query_at = pt->out_at = pt->lse_at = NO_REGION;
    for (int i = 0; i < 4; i++) pt->kv_at[i] = NO_REGION;
}

/* Views of a part's staged rows: out (..., rows, Ev) and lse of the compute
 * type, `heads` heads of `rows` rows, contiguous (placed by the executor). */
static void stage_views(part *pt, int64_t heads, int64_t rows) {
    sdpa_problem *p = &pt->p;
    const int64_t Ev = p->head_dim_v;
    memset(&p->out, 0, sizeof(p->out));
    p->out.head_stride = rows * Ev;
    p->out.row_stride = Ev;
    p->out.col_stride = 1;
    memset(&p->lse, 0, sizeof(p->lse));
    p->lse.head_stride = rows;
    p->lse.row_stride = 1;
    p->lse.col_stride = 1;
    (void)heads;
    pt->staged = 1;
}

/* A growing array in the planner's arena. */
typedef struct grow {
    void *data;
    size_t count, cap, elem;
} grow;

static void *grow_push(grow *g) {
    if (g->count == g->cap) {
        const size_t cap = g->cap ? 2 * g->cap : 16;
        void *d = realloc(g->data, cap * g->elem);
        if (!d) return NULL;
        g->data = d;
        g->cap = cap;
    }
    return (char *)g->data + g->elem * g->count++;
}

/* A node of the shared-prefix tree: the sequences (members) that share the
 * table entries [d0, d1). */
typedef struct share_node {
    int64_t members_at, count, d0, d1;
} share_node;

typedef struct sharing {
    const sdpa_problem *c;
    const int64_t *full;      /* blocks every row of each sequence sees whole */
    int64_t *scratch;         /* sort keys */
    grow nodes;               /* share_node */
    grow members;             /* int64_t */
    int failed;
} sharing;

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int32_t table_entry(const sdpa_problem *c, int64_t b, int64_t j) {
    return c->block_table[b * c->block_table_stride + j];
}

/* The nodes under the sequences `set` (n of them), which share entries [0, d0). */
static void share_tree(sharing *sh, const int64_t *set, int64_t n, int64_t d0) {
    if (n < 2 || sh->failed) return;
    /* the sequences that go on past d0, sorted by (entry d0, index) */
    uint64_t *keys = (uint64_t *)malloc((size_t)n * sizeof(uint64_t));
    int64_t *run = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    if (!keys || !run) {
        free(keys);
        free(run);
        sh->failed = 1;
        return;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (sh->full[set[i]] > d0)
            keys[m++] = ((uint64_t)(uint32_t)table_entry(sh->c, set[i], d0) << 32) | (uint64_t)set[i];
    qsort(keys, (size_t)m, sizeof(uint64_t), cmp_u64);
    for (int64_t i = 0; i < m;) {
        int64_t j = i + 1;
        while (j < m && (keys[j] >> 32) == (keys[i] >> 32)) j++;
        if (j - i >= 2) {
            int64_t cnt = j - i;
            for (int64_t x = 0; x < cnt; x++) run[x] = (int64_t)(keys[i + x] & 0xFFFFFFFFu);
            /* the entries every member of the run shares from d0 on */
            int64_t d1 = d0 + 1;
            for (;; d1++) {
                int same = 1;
                for (int64_t x = 0; x < cnt && same; x++)
                    same = sh->full[run[x]] > d1 && table_entry(sh->c, run[x], d1) == table_entry(sh->c, run[0], d1);
                if (!same) break;
            }
            share_node *node = (share_node *)grow_push(&sh->nodes);
            if (!node) {
                sh->failed = 1;
                break;
            }
            node->members_at = (int64_t)sh->members.count;
            node->count = cnt;
            node->d0 = d0;
            node->d1 = d1;
            for (int64_t x = 0; x < cnt; x++) {
                int64_t *slot = (int64_t *)grow_push(&sh->members);
                if (!slot) {
                    sh->failed = 1;
                    break;
                }
                *slot = run[x];
            }
            share_tree(sh, run, cnt, d1);
        }
        i = j;
    }
    free(keys);
    free(run);
}

/* The row-path or tiled layout of a shared prefix's part: its gathered rows
 * (rows per key/value head) as one GQA group of rows heads, or as the rows of
 * one head. */
static void shared_part(part *pt, const sdpa_problem *c, const share_node *node, int64_t d0, int64_t d1,
                        int64_t rows, const int64_t *members) {
    memset(pt, 0, sizeof(*pt));
    sdpa_problem *p = &pt->p;
    *p = *c;
    const int64_t Hkv = c->num_heads / c->gqa_group, E = c->head_dim;
    const int row_layout = rows <= SDPA_SHARED_ROW_MODE_ROWS || sdpa_integer_rows(c);  /* integer products: the row path */
    memset(&p->query, 0, sizeof(p->query));
    p->query.col_stride = 1;
    if (row_layout) {  /* (1, Hkv * rows, 1, E), gqa rows */
        p->num_heads = Hkv * rows;
        p->gqa_group = rows;
        p->len_q = 1;
        p->query.head_stride = E;
        p->query.row_stride = E;
    } else {  /* (1, Hkv, rows, E) */
        p->num_heads = Hkv;
        p->gqa_group = 1;
        p->len_q = rows;
        p->query.head_stride = rows * E;
        p->query.row_stride = E;
    }
    stage_views(pt, p->num_heads, p->len_q);
    p->num_batch_dims = 1;
    p->batch_shape[0] = 1;
    p->block_table = c->block_table + members[0] * c->block_table_stride + d0;
    p->len_kv = (d1 - d0) * c->block_size;
    pt->key_length = p->len_kv;
    p->key_lengths = &pt->key_length;
    for (int d = 0; d < SDPA_MAX_BATCH_DIMS; d++) p->key_lengths_strides[d] = 0;
    p->causal = 0;
    p->causal_offset = p->align_offset = 0;
    p->mask_kind = SDPA_MASK_NONE;
    memset(&p->mask, 0, sizeof(p->mask));
    memset(&p->alibi, 0, sizeof(p->alibi));
    memset(&p->sinks, 0, sizeof(p->sinks));
    p->window_left = p->window_right = -1;
    p->cu_seqlens_q = p->cu_seqlens_k = NULL;
    p->offsets_from_end = 0;
    pt->batch_count = 1;
    pt->seq = -1;
    pt->rows_total = rows;
    pt->num_members = node->count;
    pt->members_at = node->members_at;
    pt->partial_at = pt->packed_at = pt->query_at = pt->out_at = pt->lse_at = NO_REGION;
    for (int i = 0; i < 4; i++) pt->kv_at[i] = NO_REGION;
}

/* The part of sequence b's last L positions under a tree mask: over a copy of
 * their keys and values (dense), the mask's rows and columns. */
static void tree_part(part *pt, const sdpa_problem *c, int64_t b) {
    const int64_t L = seq_rows(c, b), S_b = seq_keys(c, b);
    sequence_part(pt, c, b, S_b - L, L);
    sdpa_problem *p = &pt->p;
    const int64_t E = c->head_dim, Ev = c->head_dim_v;
    const sdpa_dtype kvdt = kv_dtype_of(c);
    const int64_t w = kvdt == SDPA_INT4 ? 2 : 1;  /* int4: strides count bytes */
    p->block_size = 0;
    p->block_table = NULL;
    p->key_lengths = NULL;
    p->num_blocks = 0;
    p->block_table_stride = 0;
    const int64_t cols[4] = {E / w, Ev / w, 0, 0};
    sdpa_view *views[4] = {&p->key, &p->value, &p->key_scale, &p->value_scale};
    const int64_t G = c->kv_group_size;
    const int64_t sc[2] = {G ? E / G : 1, G ? Ev / G : 1};
    for (int i = 0; i < 4; i++) {
        if (i >= 2 && !views[i]->data) continue;
        const int64_t n = i < 2 ? cols[i] : sc[i - 2];
        memset(views[i]->batch_strides, 0, sizeof(views[i]->batch_strides));
        views[i]->head_stride = L * n;
        views[i]->row_stride = n;
        views[i]->col_stride = 1;
        views[i]->data = NULL;  /* the copy, placed by the executor */
    }
    pt->copy_row0 = S_b - L;
    pt->copies_kv = 1;
}

/* ---- the call ---- */

/* n elements of `elem` bytes from *cur, aligned to SDPA_ALIGN. */
static void *carve(char **cur, size_t n, size_t elem) {
    char *at = (char *)(((uintptr_t)*cur + SDPA_ALIGN - 1) & ~(uintptr_t)(SDPA_ALIGN - 1));
    *cur = at + n * elem;
    return at;
}

typedef struct ranked {
    double cost;
    int32_t index;
} ranked;

static int by_cost(const void *a, const void *b) {
    const ranked *x = (const ranked *)a, *y = (const ranked *)b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static void order_and_count(call_plan *cp) {
    /* parts by the cost of their largest task, costliest first */
    if (cp->num_parts > 1) {
        ranked *r = (ranked *)malloc((size_t)cp->num_parts * sizeof(ranked));
        if (r) {
            for (int32_t i = 0; i < cp->num_parts; i++) r[i] = (ranked){cp->parts[i].task_cost, i};
            qsort(r, (size_t)cp->num_parts, sizeof(ranked), by_cost);
            for (int32_t i = 0; i < cp->num_parts; i++) cp->order[i] = r[i].index;
            free(r);
        }  /* else in the order made: the same results */
    }
    cp->item_start[0] = cp->unit_start[0] = cp->rmerge_start[0] = 0;
    for (int32_t k = 0; k < cp->num_parts; k++) {
        const plan *pl = &cp->parts[cp->order[k]].pl;
        cp->item_start[k + 1] = cp->item_start[k] + pl->num_tasks;
        cp->unit_start[k + 1] = cp->unit_start[k] + (pl->pack.on ? pl->pack.units : 0);
        cp->rmerge_start[k + 1] =
            cp->rmerge_start[k] + (pl->path.row_mode && pl->row.num_chunks > 1 ? pl->row.num_groups : 0);
    }
}

/* The work list sorted by the tasks' estimated costs, costliest first
 * (counting sort into buckets of an eighth of an octave; ties in the parts'
 * order); left as it is when memory is short (the same results). */
static void sort_items(call_plan *cp) {
    enum { BUCKETS = 8 * 64 };
    const int64_t n = cp->item_start[cp->num_parts];
    work_item *items = (work_item *)malloc((size_t)(n > 0 ? n : 1) * sizeof(work_item));
    uint16_t *key = (uint16_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    int64_t *start = (int64_t *)calloc(BUCKETS + 1, sizeof(int64_t));
    if (!items || !key || !start) {
        free(items);
        free(key);
        free(start);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t t;
        const part *pt = plan_item(cp, i, &t);
        const double c = sdpa_task_cost(pt, t);  /* at least COST_TASK_NS: a positive log */
        int k = (int)(8.0 * log2(c > 1 ? c : 1));
        k = k < 0 ? 0 : k >= BUCKETS ? BUCKETS - 1 : k;
        key[i] = (uint16_t)(BUCKETS - 1 - k);  /* costliest first */
        start[key[i] + 1]++;
    }
    for (int b = 0; b < BUCKETS; b++) start[b + 1] += start[b];
    for (int64_t i = 0; i < n; i++) {
        int64_t t;
        const part *pt = plan_item(cp, i, &t);
        items[start[key[i]]++] = (work_item){(int32_t)(pt - cp->parts), t};
    }
    free(key);
    free(start);
    cp->items = items;
}

/* The regions of the call's block, the threads, and the costs. */
static void finish(call_plan *cp, const kernel_table *kt, int threads_asked) {
    const sdpa_problem *c = cp->call;
    const size_t ce = compute_size(c);
    size_t at = 0, scratch = 0;
    double flops = 0, kv_bytes = 0;
    int64_t units = 0;
    for (int32_t i = 0; i < cp->num_parts; i++) {
        part *pt = &cp->parts[i];
        const plan *pl = &pt->pl;
        if (pl->scratch.total > scratch) scratch = pl->scratch.total;
        if (pl->path.row_mode && pl->row.num_chunks > 1)  /* merged after every chunk is done */
            pt->partial_at = plan_take(&at, (size_t)pl->num_tasks * pl->row.partial_elems * ce);
        if (pl->bf16.on) cp->bf16 = 1;
        double worst = 0;
        if (pl->path.row_mode) {
            for (int64_t t = 0; t < pl->row.num_chunks && t < pl->num_tasks; t++) {
                const double x = sdpa_task_cost(pt, t);
                if (x > worst) worst = x;
            }
        } else if (pl->num_tasks > 0) {
            worst = sdpa_task_cost(pt, 0);  /* the last query block of the first head: the longest */
        }
        pt->task_cost = worst;
        const sdpa_problem *p = &pt->p;
        flops += 2.0 * (double)pt->batch_count * (double)p->num_heads * (double)p->len_q * (double)p->len_kv *
                 (double)(p->head_dim + p->head_dim_v);
        kv_bytes += (double)pt->batch_count * (double)(p->num_heads / p->gqa_group) * (double)p->len_kv *
                    (double)(p->head_dim + p->head_dim_v) * sdpa_kv_value_bytes(p);
        units += pl->num_tasks;
    }
    for (int32_t i = 0; i < cp->num_parts; i++) {  /* gathered and staged rows */
        part *pt = &cp->parts[i];
        const sdpa_problem *p = &pt->p;
        const int64_t Hkv = p->num_heads / p->gqa_group;
        if (pt->num_members)
            pt->query_at = plan_take(&at, (size_t)(Hkv * pt->rows_total * p->head_dim) * sdpa_dtype_size(p->dtype));
        if (pt->staged) {
            pt->out_at = plan_take(&at, (size_t)(p->num_heads * p->len_q * p->head_dim_v) * ce);
            pt->lse_at = plan_take(&at, (size_t)(p->num_heads * p->len_q) * ce);
        }
        if (pt->copies_kv) {
            const sdpa_dtype kvdt = kv_dtype_of(p);
            const int64_t w = kvdt == SDPA_INT4 ? 2 : 1;
            const int64_t rows = Hkv * p->len_kv;
            pt->kv_at[0] = plan_take(&at, (size_t)(rows * p->head_dim / w) * sdpa_dtype_size(kvdt));
            pt->kv_at[1] = plan_take(&at, (size_t)(rows * p->head_dim_v / w) * sdpa_dtype_size(kvdt));
            const int64_t G = p->kv_group_size;
            if (p->key_scale.head_stride)
                pt->kv_at[2] = plan_take(&at, (size_t)(rows * (G ? p->head_dim / G : 1)) * sizeof(float));
            if (p->value_scale.head_stride)
                pt->kv_at[3] = plan_take(&at, (size_t)(rows * (G ? p->head_dim_v / G : 1)) * sizeof(float));
        }
    }
    const size_t packed_from = at;  /* last: dropped when memory is short */
    for (int32_t i = 0; i < cp->num_parts; i++) {
        part *pt = &cp->parts[i];
        if (pt->pl.pack.on) pt->packed_at = plan_take(&at, pt->pl.pack.buffer_elems * ce);
    }
    cp->packed_bytes = at - packed_from;
    /* a thread's merge accumulator sits between its scratch and the next
     * thread's, whose aligned loads need it a whole number of SDPA_ALIGN */
    cp->merge_bytes = cp->num_merges ? ((size_t)(c->head_dim_v + 8) * sizeof(double) + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN
                                     : 0;
    cp->scratch_elems = scratch;
    cp->block_bytes = at;
    order_and_count(cp);

    /* a decoding step is bound by its reads: the work counts SDPA_WORK_PER_BYTE
     * for each byte of keys and values besides the flops */
    const int nthreads = sdpa_threads_for(c->num_threads, threads_asked, units, flops + SDPA_WORK_PER_BYTE * kv_bytes);
    cp->num_threads = nthreads;
    if (nthreads >= SDPA_SORTED_LIST_THREADS && cp->num_parts > 1) sort_items(cp);
    (void)kt;
}

/* Whether sequence b's keys are read in parts merged afterwards. */
static int is_split(const int64_t *path_len, const sdpa_problem *c, int64_t b) {
    return path_len[b] > 0 || (c->mask_kind == SDPA_MASK_BOOL && c->block_size > 0);
}

sdpa_status sdpa_plan_call(const sdpa_problem *user, int64_t batch_count, const kernel_table *kt, int threads,
                           call_plan *cp) {
    memset(cp, 0, sizeof(*cp));
    const int profile = sdpa_profile_on();
    cp->profile = profile;
    const int sim_threads = threads > 0 ? threads : 0;
    const int plan_threads = threads > 0 ? threads
                                         : (user->num_threads > 0 ? user->num_threads : sdpa_call_default_threads());
    sdpa_problem *c = (sdpa_problem *)malloc(sizeof(sdpa_problem) + (size_t)batch_count * sizeof(int64_t));
    if (!c) return SDPA_ERR_NO_MEMORY;
    *c = *user;
    cp->call = c;
    cp->arena = c;
    const int ragged = c->cu_seqlens_q || c->cu_seqlens_k;
    const int paged = c->block_size > 0;
    if (c->block_size == 1) {  /* blocks of one position: a row's stride is the block's, so that blocks that
                                  follow each other in the pool are read as one run (kv_source.h) */
        sdpa_view *views[4] = {&c->key, &c->value, &c->key_scale, &c->value_scale};
        for (int i = 0; i < 4; i++) views[i]->row_stride = views[i]->batch_strides[0];
    }

    if (!ragged && !paged) {  /* one part: the whole batch */
        sdpa_clamp_offsets(c);
        int64_t *limits = (int64_t *)(c + 1);
        /* (not with a block map: its full blocks do not look at a bool mask) */
        if (c->mask_kind == SDPA_MASK_BOOL && c->mask.row_stride == 0 && c->mask.head_stride == 0 && c->len_kv > 0 &&
            !c->block_states.data && sdpa_padding_limits(c, batch_count, limits)) {
            c->mask_kind = SDPA_MASK_NONE;
            c->key_lengths = limits;
            int64_t stride = 1;
            for (int d = c->num_batch_dims - 1; d >= 0; d--) {
                c->key_lengths_strides[d] = stride;
                stride *= c->batch_shape[d];
            }
        }
        sdpa_fold_group(c, kt);
        part *pt = &cp->single;
        pt->p = *c;
        pt->batch_count = batch_count;
        pt->seq = -1;
        pt->partial_at = pt->packed_at = pt->query_at = pt->out_at = pt->lse_at = NO_REGION;
        for (int i = 0; i < 4; i++) pt->kv_at[i] = NO_REGION;
        sdpa_make_plan(&pt->p, batch_count, sdpa_part_flops(pt) / (SDPA_TASKS_PER_THREAD * plan_threads), kt, 0, &pt->pl);
        cp->parts = pt;
        cp->num_parts = 1;
        cp->order = &cp->single_order;
        cp->item_start = cp->single_starts;
        cp->unit_start = cp->single_starts + 2;
        cp->rmerge_start = cp->single_starts + 4;
        finish(cp, kt, sim_threads);
        return SDPA_OK;
    }

    /* one sequence at a time: shared prefixes first, then each sequence's own keys.
     * Offsets beyond every sequence's lengths are the same as these bounds */
    const int64_t reach = c->len_q + c->len_kv;
    if (c->causal_offset > reach) c->causal_offset = reach;
    if (c->causal_offset < -reach) c->causal_offset = -reach;
    if (!has_window(c) && !c->alibi.data) c->align_offset = 0;  /* not used */
    const int64_t B = batch_count;
    const int tree = paged && c->mask_kind == SDPA_MASK_BOOL;
    int64_t *full = (int64_t *)calloc((size_t)(B > 0 ? B : 1), 3 * sizeof(int64_t));
    if (!full) return SDPA_ERR_NO_MEMORY;
    int64_t *path_len = full + B, *leaf_from = full + 2 * B;  /* shared nodes above each sequence; its own first key */
    sharing sh = {c, full, NULL, {NULL, 0, 0, sizeof(share_node)}, {NULL, 0, 0, sizeof(int64_t)}, 0};
    /* integer_pv rounds P in runs of each tile's keys against the run's largest:
     * shared blocks would be rounded in other runs than a sequence's own call
     * rounds them, so its sequences are computed alone (bit for bit as such) */
    const int may_share = paged && B > 1 && !has_window(c) && !c->alibi.data && !sdpa_integer_values(c) &&
                          !c->key_scores.data;  /* (key scores: each sequence's rows keep their own p) */
    if (may_share) {
        int64_t *all = (int64_t *)malloc((size_t)B * sizeof(int64_t));
        if (!all) {
            free(full);
            return SDPA_ERR_NO_MEMORY;
        }
        for (int64_t b = 0; b < B; b++) {
            const int64_t L = seq_rows(c, b), S_b = seq_keys(c, b);
            int64_t seen = tree ? S_b - L : S_b;  /* keys every row of b sees */
            if (c->causal && !tree) {
                const int64_t first_row = S_b - L + c->causal_offset + 1;  /* row 0's reach */
                if (first_row < seen) seen = first_row < 0 ? 0 : first_row;
            }
            full[b] = L > 0 ? seen / c->block_size : 0;
            all[b] = b;
        }
        share_tree(&sh, all, B, 0);
        free(all);
        if (sh.failed) {
            free(sh.nodes.data);
            free(sh.members.data);
            free(full);
            return SDPA_ERR_NO_MEMORY;
        }
    }
    const share_node *nodes = (const share_node *)sh.nodes.data;
    const int64_t *mem = (const int64_t *)sh.members.data;
    const int64_t num_nodes = (int64_t)sh.nodes.count;
    /* each sequence's depth of sharing, and where its own keys start */
    for (int64_t i = 0; i < num_nodes; i++)
        for (int64_t x = 0; x < nodes[i].count; x++) {
            const int64_t b = mem[nodes[i].members_at + x];
            path_len[b]++;
            if (nodes[i].d1 * c->block_size > leaf_from[b]) leaf_from[b] = nodes[i].d1 * c->block_size;
        }

    /* the parts: each shared node (in parts of at most SDPA_SHARED_PART_KEYS
     * keys), each sequence's own keys, each tree */
    int64_t num_parts = 0, num_contrib = 0, num_merges = 0;
    const int64_t bs = paged ? c->block_size : 1;
    const int64_t node_step = paged ? (SDPA_SHARED_PART_KEYS / bs > 0 ? SDPA_SHARED_PART_KEYS / bs : 1) : 1;
    int64_t *node_parts = (int64_t *)calloc((size_t)(num_nodes > 0 ? num_nodes : 1), sizeof(int64_t));
    if (!node_parts) {
        free(sh.nodes.data);
        free(sh.members.data);
        free(full);
        return SDPA_ERR_NO_MEMORY;
    }
    for (int64_t i = 0; i < num_nodes; i++) {
        node_parts[i] = (nodes[i].d1 - nodes[i].d0 + node_step - 1) / node_step;
        num_parts += node_parts[i];
        num_contrib += node_parts[i] * nodes[i].count;
    }
    for (int64_t b = 0; b < B; b++) {
        if (seq_rows(c, b) == 0) continue;
        num_parts += 1 + (tree != 0);
        if (is_split(path_len, c, b)) {
            num_merges++;
            num_contrib += 1 + (tree != 0);
        }
    }
    int64_t Hkv = c->num_heads / c->gqa_group;
    /* the arena: parts, order and prefix sums, merges and contributions, members, copies */
    const size_t bytes = (size_t)num_parts * sizeof(part) + (size_t)num_parts * sizeof(int32_t) +
                         3 * (size_t)(num_parts + 1) * sizeof(int64_t) + (size_t)num_merges * sizeof(merge_group) +
                         (size_t)num_contrib * sizeof(contribution) + sh.members.count * sizeof(int64_t) +
                         (size_t)num_parts * (size_t)Hkv * sizeof(copy_job) + 8 * SDPA_ALIGN;
    char *arena = (char *)realloc(c, sizeof(sdpa_problem) + bytes);
    if (!arena) {
        free(node_parts);
        free(sh.nodes.data);
        free(sh.members.data);
        free(full);
        return SDPA_ERR_NO_MEMORY;
    }
    c = (sdpa_problem *)arena;
    cp->call = c;
    cp->arena = arena;
    sh.c = c;
    char *cur = arena + sizeof(sdpa_problem);
    cp->parts = (part *)carve(&cur, (size_t)num_parts, sizeof(part));
    cp->order = (int32_t *)carve(&cur, (size_t)num_parts, sizeof(int32_t));
    cp->item_start = (int64_t *)carve(&cur, (size_t)num_parts + 1, sizeof(int64_t));
    cp->unit_start = (int64_t *)carve(&cur, (size_t)num_parts + 1, sizeof(int64_t));
    cp->rmerge_start = (int64_t *)carve(&cur, (size_t)num_parts + 1, sizeof(int64_t));
    cp->merges = (merge_group *)carve(&cur, (size_t)num_merges, sizeof(merge_group));
    cp->contributions = (contribution *)carve(&cur, (size_t)num_contrib, sizeof(contribution));
    cp->members = (int64_t *)carve(&cur, sh.members.count, sizeof(int64_t));
    cp->copies = (copy_job *)carve(&cur, (size_t)(num_parts * Hkv), sizeof(copy_job));
    if (sh.members.count) memcpy(cp->members, mem, sh.members.count * sizeof(int64_t));

    const int64_t G = c->gqa_group;
    int32_t np = 0;
    int64_t nc = 0, ncopy = 0;
    /* where each shared node's first part and row offsets are: parts of a node
     * are consecutive from node_first[i] */
    int64_t *node_first = node_parts;  /* reused: the first part of node i */
    for (int64_t i = 0; i < num_nodes; i++) {
        const int64_t count = node_parts[i];
        node_first[i] = np;
        int64_t rows = 0;
        for (int64_t x = 0; x < nodes[i].count; x++) rows += G * seq_rows(c, mem[nodes[i].members_at + x]);
        for (int64_t k = 0; k < count; k++) {
            const int64_t d0 = nodes[i].d0 + k * node_step;
            const int64_t d1 = d0 + node_step < nodes[i].d1 ? d0 + node_step : nodes[i].d1;
            part *pt = &cp->parts[np];
            shared_part(pt, c, &nodes[i], d0, d1, rows, cp->members + nodes[i].members_at);
            pt->members_at = nodes[i].members_at;
            for (int64_t h = 0; h < Hkv; h++) cp->copies[ncopy++] = (copy_job){np, COPY_QUERY, h};
            np++;
        }
    }
    /* each sequence: its merge group (shared nodes in depth order, its own keys,
     * its tree), its parts */
    int64_t ng = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_rows(c, b);
        if (L == 0) continue;
        const int64_t S_b = seq_keys(c, b);
        const int split = is_split(path_len, c, b);
        merge_group *mg = split ? &cp->merges[ng++] : NULL;
        if (mg) {
            mg->seq = b;
            mg->first = nc;
        }
        /* the shared nodes above b, outermost first (nodes were made parent first) */
        for (int64_t i = 0; i < num_nodes && mg; i++) {
            int64_t off = 0, x = 0;
            for (; x < nodes[i].count && mem[nodes[i].members_at + x] != b; x++)
                off += G * seq_rows(c, mem[nodes[i].members_at + x]);
            if (x == nodes[i].count) continue;
            const part *first = &cp->parts[node_first[i]];
            for (int64_t k = 0; k < (nodes[i].d1 - nodes[i].d0 + node_step - 1) / node_step; k++)
                cp->contributions[nc++] = (contribution){(int32_t)(node_first[i] + k), first->rows_total, off};
        }
        /* b's own keys: from its last shared block (paged), up to the tree's */
        const int64_t k0 = leaf_from[b], own_end = tree ? S_b - L : S_b;
        part *pt = &cp->parts[np];
        sequence_part(pt, c, b, k0, own_end - k0);
        if (tree) {  /* the positions before the tree: all seen */
            pt->p.causal = 0;
            pt->p.mask_kind = SDPA_MASK_NONE;
            memset(&pt->p.mask, 0, sizeof(pt->p.mask));
            memset(&pt->p.sinks, 0, sizeof(pt->p.sinks));  /* the tree's part adds them */
        }
        if (!split) {
            sdpa_fold_group(&pt->p, kt);
        } else {
            stage_views(pt, c->num_heads, L);
            cp->contributions[nc++] = (contribution){np, G * L, 0};
        }
        np++;
        if (tree) {
            part *tp = &cp->parts[np];
            tree_part(tp, c, b);
            stage_views(tp, c->num_heads, L);
            tp->p.causal = 0;
            cp->contributions[nc++] = (contribution){np, G * L, 0};
            for (int64_t h = 0; h < Hkv; h++) cp->copies[ncopy++] = (copy_job){np, COPY_KV, h};
            np++;
        }
        if (mg) mg->count = nc - mg->first;
    }
    /* each part planned with its share of the call's work as the most a task takes */
    double total = 0;
    for (int32_t i = 0; i < np; i++) total += sdpa_part_flops(&cp->parts[i]);
    for (int32_t i = 0; i < np; i++)
        sdpa_make_plan(&cp->parts[i].p, 1, total / (SDPA_TASKS_PER_THREAD * plan_threads), kt, cp->parts[i].staged, &cp->parts[i].pl);
    cp->num_parts = np;
    cp->num_merges = ng;
    cp->num_copies = ncopy;
    for (int32_t i = 0; i < np; i++) cp->order[i] = i;
    free(node_parts);
    free(sh.nodes.data);
    free(sh.members.data);
    free(full);
    finish(cp, kt, sim_threads);
    return SDPA_OK;
}

void sdpa_plan_free(call_plan *cp) {
    free(cp->items);
    cp->items = NULL;
    free(cp->arena);
    cp->arena = NULL;
}

sdpa_status sdpa_testing_plan(const sdpa_problem *p, int threads, sdpa_part_info *parts, int64_t max_parts,
                              int64_t *num_parts, double *costs, int64_t max_items, int64_t *num_items,
                              int *num_threads, int64_t *num_merges) {
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) return SDPA_ERR_ABI;
    int64_t batch_count = 0;
    sdpa_status st = sdpa_validate(p, &batch_count);
    if (st != SDPA_OK) return st;
    *num_parts = *num_items = *num_merges = 0;
    *num_threads = 0;
    if (batch_count * p->num_heads * p->len_q == 0) return SDPA_OK;
    const kernel_table *kt = sdpa_kernel_table();
    if (!kt) return SDPA_ERR_BAD_ISA;
    call_plan cp;
    st = sdpa_plan_call(p, batch_count, kt, threads, &cp);
    if (st != SDPA_OK) return st;
    for (int32_t k = 0; k < cp.num_parts && k < max_parts; k++) {
        const part *pt = &cp.parts[cp.order[k]];
        const sdpa_problem *q = &pt->p;
        parts[k] = (sdpa_part_info){pt->seq, pt->num_members, q->num_heads, q->len_q, q->len_kv, pt->pl.num_tasks,
                                    pt->pl.path.row_mode, pt->staged, pt->copies_kv, pt->pl.pack.on, pt->task_cost};
    }
    const int64_t items = cp.item_start[cp.num_parts];
    for (int64_t i = 0; i < items && i < max_items; i++) costs[i] = sdpa_plan_item_cost(&cp, i);
    *num_parts = cp.num_parts;
    *num_items = items;
    *num_threads = cp.num_threads;
    *num_merges = cp.num_merges;
    sdpa_plan_free(&cp);
    return SDPA_OK;
}
