/* The plan of a call: the planner (planner.c) writes it once from the problem,
 * the executor (exec.c) runs it in one parallel region.  Internal.
 *
 * A call is cut into parts.  A part is a problem in canonical form -- offsets
 * clamped, each paged or ragged sequence's positions resolved, views pointing
 * at its own rows -- with its own plan (path, blocking, scratch).  A dense call
 * is one part; a ragged or paged call one part per sequence; a shared prefix
 * one part for the rows of every sequence that shares it; a tree mask's last
 * positions one part over a copy of their keys.  Each part's tasks form one
 * range of the call's work list.  A sequence whose keys are split among parts
 * has its parts write staged rows (output in the compute type, and the lse),
 * which a merge combines in key order and writes; every other part writes the
 * caller's output itself.
 */
#ifndef SDPA_PLAN_H
#define SDPA_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* The plan of one part: which path computes it, its blocking, and the named
 * regions of a thread's scratch (offsets in elements of the compute type). */
typedef struct plan {
    struct {
        sdpa_dtype kv_dtype;   /* of key and value, resolved                     */
        sdpa_dtype out_dtype;  /* of out: the query's, or the compute type when staged */
        int row_mode;          /* the row path (few query rows per key/value head) */
        int convert_kv;        /* tiled: float K and V widened or copied into scratch */
        int integer_qk;        /* row path: the scores of int8 / int4 keys in integers */
        sdpa_dot_qi_f32_fn dot_qi;
        int integer_pv;        /* row path: P V of int8 / int4 values in integers */
        sdpa_pv_qi_fn pv_qi;
        int nr;                /* the kernel set's panel width                   */
        int nr_half;           /* a task's last panel's width where its rows fit
                                  (the set's half-width table), or nr: none   */
        int nr_quarter;        /* the same at a quarter of the width (float
                                  on AVX-512), or nr_half: none              */
    } path;
    struct {
        int tile_q, tile_k;    /* tile_q a multiple of nr; tile_k sets the order of sums */
        int64_t chunk_len;     /* keys per row-path task (not thread-dependent) */
    } blocking;
    struct {                   /* tiled with bfloat16 pairs and gemm_bf16 */
        int on;
        int64_t e2p;           /* pairs of a K row and of a query panel column block,
                                  ceil(E/2) or, K packed, up to whole tiles of the product */
        int64_t vp_ld;         /* V pairs packed by feature: pairs per feature row */
    } bf16;
    struct {                   /* the tiled path's tasks: (batch, unit, query block) */
        int64_t num_bh, num_qblocks;
        int64_t pack_g;        /* rows a position: 1 (a unit is a head), or G: a GQA
                                  group's heads packed into the rows, position-major */
        int64_t qb_tasks;      /* block map: tasks a query block of block_q rows,
                                  each task within one (0: no map) */
    } tiled;
    struct {                   /* the row path's tasks: (batch, key/value head, key chunk) */
        int rows;              /* query rows per group: gqa_group x L */
        int gather;            /* a tile's keys and values gathered from short
                                  paged blocks (paged_rows_gathered)         */
        int64_t num_groups, num_chunks;
        size_t partial_elems;  /* per task: max, sum and output of each row */
        int ks_local;          /* key scores: a group one task, its p in the thread's scratch */
    } row;
    struct {                   /* K and V packed once per call, per key/value slice */
        int on;
        int64_t chunk, units;  /* packed by units of chunk keys before the tasks */
        size_t slice_k;        /* the K part of a slice (0: K not packed)       */
        size_t slice_elems, buffer_elems;
    } pack;
    struct {                   /* a thread's scratch for this part's tasks */
        size_t q, acc, s, m, l, k, v, pp, vp, vt, qi, pvi, partial;
        size_t ks;             /* row path, key scores kept by the task (row.ks_local) */
        size_t gk, gv;         /* row path, gathered: a tile's K and V rows and scales */
        size_t total;          /* a multiple of SDPA_ALIGN bytes */
    } scratch;
    int64_t num_tasks;
} plan;

/* Key scores: a call of at least this many key/value groups keeps each
 * group's p in the scratch of the thread that computes it (plan.row.ks_local) */
#define SDPA_KEY_SCORE_GROUPS 8

/* Key scores (row path): the tiles a task's keys take at most, each with
 * its rows' maxima kept (part.ks_max). */
static inline int64_t key_score_tiles(const plan *pl) {
    return (pl->blocking.chunk_len + pl->blocking.tile_k - 1) / pl->blocking.tile_k;
}

/* Where a row-path task keeps its key scores (rows_impl.h): the keys it
 * visited (2), each tile's maxima of its rows (tiles x M), the p of its rows
 * (M x len_kv), of the compute type; NULL when none are asked. */
typedef struct key_score_store {
    int64_t *range;
    void *tile_max, *probs;
} key_score_store;

/* A region of `bytes` bytes at *at (a block's offset, moved past it to the
 * next multiple of SDPA_ALIGN): its offset. */
static inline size_t plan_take(size_t *at, size_t bytes) {
    const size_t here = *at;
    *at += (bytes + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN;
    return here;
}

/* Where a region of the call's block is, in bytes from its start; NO_REGION: none. */
#define NO_REGION ((size_t)-1)

typedef struct part {
    sdpa_problem p;          /* canonical; views of gathered or staged rows are set by the executor */
    int64_t batch_count;
    int64_t key_length;      /* one sequence's: p.key_lengths points here */
    int64_t seq;             /* the call's sequence it serves, -1 for a whole batch */
    int staged;              /* writes staged rows for a merge (out and lse of the compute type) */
    int copies_kv;           /* reads a copy of its keys and values (a tree's last positions) */
    plan pl;
    /* regions of the call's block: row-path partials, K/V packed once, the
     * query rows gathered for a shared prefix, staged out and lse, and keys
     * and values (with scales) copied from their blocks */
    size_t partial_at, packed_at, query_at, out_at, lse_at;
    size_t kv_at[4];         /* key, value, key_scale, value_scale */
    int64_t members_at, num_members;  /* a shared prefix's sequences (call_plan.members) */
    int64_t rows_total;      /* a shared prefix's query rows per key/value head */
    int64_t copy_row0;       /* keys copied from the sequence's positions [copy_row0, + len_kv) */
    double task_cost;        /* the estimated cost of its largest task */
    /* key scores (row path; sdpa.h): where the executor keeps them, NULL when
     * not asked: each counted row's p of each key (compute type, (groups, M,
     * len_kv)), as of the row's max after the key's tile; those maxima
     * ((tasks, key_score_tiles, M)); the keys each task visited ((tasks, 2)) */
    void *ks_probs, *ks_max;
    int64_t *ks_range;
} part;

/* A sequence's part: where its row (h, l) lies in the part's staged rows,
 * (h / G) * head_block + (h % G) * L_b + l + offset. */
typedef struct contribution {
    int32_t part;
    int64_t head_block, offset;
} contribution;

/* The staged parts of one sequence, merged in key order into its rows. */
typedef struct merge_group {
    int64_t seq;
    int64_t first, count;    /* in call_plan.contributions */
} merge_group;

/* A copy before the tasks: part's gathered query rows (of one key/value head)
 * or keys and values (of one key/value head). */
typedef struct copy_job {
    int32_t part;
    int32_t kind;            /* COPY_QUERY or COPY_KV */
    int64_t hkv;
} copy_job;
enum { COPY_QUERY = 0, COPY_KV = 1 };

/* A task of the work list: its part (an index into call_plan.parts) and the task. */
typedef struct work_item {
    int32_t part;
    int64_t task;
} work_item;

typedef struct call_plan {
    const sdpa_problem *call;   /* the canonical call: views of the caller's arrays */
    part *parts;
    int32_t num_parts;
    int32_t *order;             /* parts in the order their tasks run (costliest first) */
    /* prefix sums over `order`: the first work item, packing unit and row merge
     * of each part, num_parts + 1 entries each */
    int64_t *item_start, *unit_start, *rmerge_start;
    work_item *items;           /* NULL: the work list is each part's tasks in `order`; else this
                                   list (every task, the costliest first: for many threads) */
    copy_job *copies;
    int64_t num_copies;
    merge_group *merges;
    int64_t num_merges;
    contribution *contributions;
    int64_t *members;
    size_t scratch_elems;       /* per thread: the largest part's */
    size_t block_bytes;         /* partials, packed K/V, gathered and staged rows */
    size_t packed_bytes;        /* of which packed K/V, at the end (dropped when memory is short) */
    size_t merge_bytes;         /* per thread: a merged row's accumulator */
    int num_threads;
    int profile;                /* phase timers on */
    int bf16;                   /* some part multiplies bfloat16 pairs (tiles may be needed) */
    int key_scores_add;         /* key scores added to the output's (else written) */
    void *arena;                /* what the planner allocated */
    part single;                /* the one part of a dense call, without allocation */
    int32_t single_order;
    int64_t single_starts[6];
} call_plan;

/* Whether the phase timers are on, and whether this process is a child forked
 * after a call used threads (exec.c: it then computes on one thread). */
int sdpa_profile_on(void);
int sdpa_forked_after_openmp(void);

/* No tiled task takes more than the call's work over this many per thread:
 * the greedy schedule of the work list (costliest parts first) then ends
 * within a few percent of the ideal (python -m sdpa.bench --plan) */
#define SDPA_TASKS_PER_THREAD 4.0

/* ---- one part (blocking.c) ---- */

/* Plans one part: p canonical, batch_count its batch, task_flops the most
 * work a tiled task may take (0: any), `staged` whether its output is staged
 * for a merge. */
void sdpa_make_plan(const sdpa_problem *p, int64_t batch_count, double task_flops, const kernel_table *kt,
                    int staged, plan *pl);
/* A padding mask as key lengths (limits[b]); 0 when the mask is not one. */
int sdpa_padding_limits(const sdpa_problem *p, int64_t batch_count, int64_t *limits);
/* A decoding problem's large GQA group as the rows of one query. */
void sdpa_fold_group(sdpa_problem *q, const kernel_table *kt);
/* causal_offset clamped to [-L, S]. */
void sdpa_clamp_offsets(sdpa_problem *p);
/* Whether integer_qk applies (int8 or int4 keys, a float32 or 16-bit query),
 * integer_pv (int8 or int4 values), either. */
int sdpa_integer_scores(const sdpa_problem *p);
int sdpa_integer_values(const sdpa_problem *p);
int sdpa_integer_rows(const sdpa_problem *p);

/* integer_pv's scratch for m rows of ev features in ng scale groups: a run's
 * value rows (SDPA_PV_KEYS pointers), its value scales by group (ng x
 * SDPA_PV_KEYS floats) and the kernel's work, each 64-aligned. */
#define SDPA_PVI_ALIGN(b) (((size_t)(b) + 63) / 64 * 64)
#define SDPA_PVI_R SDPA_PVI_ALIGN(SDPA_PV_KEYS * sizeof(void *))
#define SDPA_PVI_V(ng) SDPA_PVI_ALIGN((size_t)(ng) * SDPA_PV_KEYS * 4)
#define SDPA_PVI_BYTES(m, ev, ng) (SDPA_PVI_R + SDPA_PVI_V(ng) + SDPA_PVI_ALIGN(SDPA_PV_WORK_BYTES(m, ev, ng)) + 64)
/* The threads of a call with num_threads 0, before its work caps them. */
int sdpa_call_default_threads(void);
/* The threads of a call: `forced` (the planner's test hook) as given, else
 * num_threads, 0 meaning the default (capped at sdpa_max_threads() and then
 * by `work`: SDPA_MIN_WORK_PER_THREAD a thread); never more than `units`;
 * one without OpenMP or in a child forked after threads ran. */
int sdpa_threads_for(int num_threads, int forced, int64_t units, double work);
/* A block of at least `bytes` bytes aligned to SDPA_ALIGN (NULL: no memory),
 * freed with sdpa_aligned_free (exec.c). */
void *sdpa_aligned_block(size_t bytes);
void sdpa_aligned_free(void *block);
/* A block of at least `bytes` bytes kept from the last call of the same use
 * when it fits (exec.c; NULL: no memory), and its return, with
 * sdpa_kept_give, for the next call. */
enum sdpa_kept_use { SDPA_KEPT_KEY_SCORES, SDPA_KEPT_BACKWARD, SDPA_KEPT_USES };
void *sdpa_kept_take(int use, size_t bytes);
void sdpa_kept_give(int use, void *b);
/* Runs fn(ctx, i, tid) for i in [0, n) on nthreads threads (tid < nthreads),
 * each under the caller's floating-point control flags, as a call's tasks
 * run (exec.c). */
void sdpa_parallel_for(int nthreads, int64_t n, void (*fn)(void *ctx, int64_t i, int tid), void *ctx);
/* The cost model: a part's work (flops of the scores its rows see) and the
 * estimated cost of its task t (ns on one core). */
double sdpa_part_flops(const part *pt);
/* The bytes a stored key or value element takes (0.5 for int4). */
double sdpa_kv_value_bytes(const sdpa_problem *p);
double sdpa_task_cost(const part *pt, int64_t t);

/* Checks a problem against sdpa.h's rules (attention.c); *batch_count is the
 * product of its batch dims. */
sdpa_status sdpa_validate(const sdpa_problem *p, int64_t *batch_count);
/* Plans and runs a valid problem of batch_count batch indices (attention.c). */
sdpa_status sdpa_run_valid(const sdpa_problem *p, int64_t batch_count);
/* Runs a valid problem with top-k lists (sparse.c), through sdpa_run_valid. */
sdpa_status sdpa_sparse_call(const sdpa_problem *p, int64_t batch_count);
/* Runs a valid problem with dropout (backward.c). */
sdpa_status sdpa_dropout_call(const sdpa_problem *p, int64_t batch_count);

/* Plans the validated call *p (offsets clamped) for kernel table kt with
 * `threads` threads (0: the problem's own rule); frees nothing on failure. */
sdpa_status sdpa_plan_call(const sdpa_problem *p, int64_t batch_count, const kernel_table *kt, int threads,
                           call_plan *cp);
void sdpa_plan_free(call_plan *cp);

/* Runs a plan (its staged and gathered views are set here). */
sdpa_status sdpa_run_call(call_plan *cp, const kernel_table *kt);

/* The estimated cost of the task at work-list position i (planner.c's model, in
 * nanoseconds on one core); for the balance report. */
double sdpa_plan_item_cost(const call_plan *cp, int64_t i);

/* The width of the panel that rows (1 <= rows <= nr) of a task's last panel
 * are computed in: the narrowest of the set's tables they fit. */
static inline int sdpa_panel_width(const plan *pl, int rows) {
    return rows <= pl->path.nr_quarter ? pl->path.nr_quarter : rows <= pl->path.nr_half ? pl->path.nr_half : pl->path.nr;
}

/* Whether a tail of rows past a task's whole panels runs as a half panel and
 * a quarter one (AVX-512 float: 17-24 rows pay 24, not 32). */
static inline int sdpa_tail_split(const plan *pl, int tail) {
    return tail > pl->path.nr_half && pl->path.nr_quarter < pl->path.nr_half &&
           tail <= pl->path.nr_half + pl->path.nr_quarter;
}

/* The rows a task's tail (1 <= tail < nr) pays for: the panels it runs in. */
static inline int sdpa_tail_cost(const plan *pl, int tail) {
    return sdpa_tail_split(pl, tail) ? pl->path.nr_half + pl->path.nr_quarter : sdpa_panel_width(pl, tail);
}

/* The panels of a task of `rows` rows: whole panels of nr, then the tail in
 * one narrower panel or split (sdpa_tail_split). */
static inline int sdpa_panel_count(const plan *pl, int rows) {
    const int nr = pl->path.nr, tail = rows % nr;
    return rows / nr + (tail == 0 ? 0 : 1 + sdpa_tail_split(pl, tail));
}

/* Panel i of a task of `rows` rows: its first row (from the task's first) and,
 * in *prows, its rows.  A panel's query, accumulator and running max and sum
 * lie in the task's scratch at its first row, at the panel's own width: the
 * panels of a split tail fit in the room of one whole panel. */
static inline int sdpa_panel_at(const plan *pl, int rows, int i, int *prows) {
    const int nr = pl->path.nr, whole = rows / nr, x0 = whole * nr;
    if (i < whole) {
        *prows = nr;
        return i * nr;
    }
    const int tail = rows - x0;
    if (sdpa_tail_split(pl, tail)) {
        *prows = i == whole ? pl->path.nr_half : tail - pl->path.nr_half;
        return i == whole ? x0 : x0 + pl->path.nr_half;
    }
    *prows = tail;
    return x0;
}

/* The position k in `order` of the part that holds the i-th entry of a list
 * whose parts' entries start at starts[k] (prefix sums), and i's index within
 * that part. */
static inline int32_t plan_find(const int64_t *starts, int32_t num_parts, int64_t i, int64_t *local) {
    int32_t lo = 0, hi = num_parts - 1;
    while (lo < hi) {  /* the last part whose first entry is <= i (parts with none are passed) */
        const int32_t mid = (lo + hi + 1) / 2;
        if (starts[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    *local = i - starts[lo];
    return lo;
}

/* The part and task of work item i. */
static inline part *plan_item(const call_plan *cp, int64_t i, int64_t *task) {
    if (cp->items) {
        *task = cp->items[i].task;
        return &cp->parts[cp->items[i].part];
    }
    return &cp->parts[cp->order[plan_find(cp->item_start, cp->num_parts, i, task)]];
}

/* The rows of tiled task block qb of a unit of R rows, [*l0, *l0 + *rows):
 * tile_q rows a block, or with a block map (plan.tiled.qb_tasks) within
 * query block qb / qb_tasks of block_q rows (*rows may then be 0). */
static inline void sdpa_task_rows(const sdpa_problem *p, const plan *pl, int64_t qb, int64_t R, int64_t *l0,
                                  int64_t *rows) {
    const int64_t tq = pl->blocking.tile_q, per = pl->tiled.qb_tasks;
    int64_t first = qb * tq, end = R;
    if (per) {
        const int64_t i = qb / per;
        first = i * p->block_q + qb % per * tq;
        if ((i + 1) * p->block_q < end) end = (i + 1) * p->block_q;
    }
    const int64_t n = end - first < tq ? end - first : tq;
    *l0 = first;
    *rows = n > 0 ? n : 0;
}

#endif
