/* The attention driver: validates a problem, plans tiles and scratch, and runs
 * the tasks on one OpenMP parallel loop.  The maths is in attention_impl.h and
 * the kernels it calls. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "internal.h"
#include "testing.h"

/* Row mode serves problems with at most SDPA_ROW_MODE_MAX_ROWS query rows per
 * key/value head (gqa_group x L), and those with a short query (L at most
 * SDPA_ROW_MODE_MAX_L) and up to SDPA_ROW_MODE_WIDE_ROWS rows: the tiled path's tiles
 * hold the rows of one head, and below about 24 rows per head it measured slower
 * than the row path (12-50 against 70-85 GFLOP/s a thread for L = 2..16 with GQA). */
#define SDPA_ROW_MODE_MAX_ROWS 8
#define SDPA_ROW_MODE_MAX_L 16
#define SDPA_ROW_MODE_MAX_L_BF16 12 /* bfloat16 query and keys with AVX512-BF16: 81-87
                                      * against 76-80 GFLOP/s at L = 16 on the tiled path */
#define SDPA_ROW_MODE_WIDE_ROWS 128
/* Paged decoding prefetches this many rows of the next block as it starts one
 * (blocks of 16 then run as fast as arrays; without it 0.86-0.92x) */
#define SDPA_PAGED_PREFETCH_ROWS 16
/* Decoding with at least this many query heads per key/value head runs them
 * as the rows of one query (fold_group); bfloat16 with bfloat16 products from 16 */
#define SDPA_FOLD_MIN_GROUP 32
/* The tiled path reads paged float K and V in place from blocks of this many
 * positions; shorter ones are copied a tile (or a call) at a time */
#define SDPA_PAGED_MIN_IN_PLACE 64
#define SDPA_FOLD_MIN_GROUP_BF16 16
/* Thread counts are capped at this many per CPU (and at least this many). */
#define SDPA_THREADS_PER_CPU 4
#define SDPA_MIN_THREAD_CAP 8
/* Longer key sequences are refused, so that offsets and key positions keep
 * far from int64 overflow. */
#define SDPA_MAX_LEN_KV ((int64_t)1 << 61)

/* Work division and scratch layout of one call (offsets in elements). */
typedef struct plan {
    sdpa_dtype kv_dtype;  /* of key and value, resolved                 */
    int bf16;             /* tiled with bfloat16 pairs and products (gemm_bf16) */
    int64_t num_bh;       /* batch count x heads                 */
    int64_t num_qblocks;  /* ceil(L / tile_q)                    */
    int64_t num_tasks;    /* num_bh x num_qblocks                */
    int tile_q, tile_k, nr;  /* tile_q is a multiple of nr        */
    size_t off_q, off_acc, off_s, off_m, off_l, off_k, off_v, off_pp, off_vp, off_vt, off_prof;
    size_t off_qi;        /* row mode, integer_qk: the query as int8, its scales, dot_qi's work */
    int integer_qk;       /* row mode: the scores of int8 / int4 keys in integers (sdpa.h)  */
    sdpa_dot_qi_f32_fn dot_qi;  /* integer_qk's kernel                                  */
    /* K and V packed once per call (tiled path): the float K and V of a 16-bit or
     * int8 cache widened, or bfloat16 V as pairs, per key/value slice, into a
     * call buffer that every query block and every query head of a slice's GQA
     * group reads; packed by pack_units units of pack_chunk keys before the tasks */
    int kv_packed;
    int64_t pack_chunk, pack_units;
    size_t slice_k, slice_elems;  /* K part, whole slice (elements of the compute type) */
    size_t callbuf_elems;
    int64_t vp_ld;                /* bfloat16 V pairs by feature: pairs per feature row */
    int64_t e2p;                  /* bfloat16: pairs of a K row and of a query panel column block,
                                   * ceil(E/2) or, K packed, up to whole tiles of the product */
    int profile;                  /* phase timers on (sdpa_profile_start)            */
    int convert_kv;               /* float K and V widened or copied into scratch (tiled) */
    /* row mode (few query rows per key/value head; see attention_impl.h) */
    int row_mode;
    int rows;               /* query rows per group: gqa_group x L  */
    int64_t num_groups;     /* batch count x key/value heads         */
    int64_t num_chunks;     /* key chunks per group                  */
    int64_t chunk_len;      /* keys per chunk (not thread-dependent) */
    size_t partial_elems;   /* per task: max, sum, output of each row */
    size_t scratch_elems; /* per thread, a multiple of SDPA_ALIGN bytes */
    int num_threads;
} plan;

/* ---- small helpers used by the per-type drivers ---- */

/* Offset (elements) of batch index b, counted over batch_shape, for these
 * batch strides. */
static int64_t batch_offset_of(const sdpa_problem *p, const int64_t *batch_strides, int64_t b) {
    int64_t off = 0;
    for (int d = p->num_batch_dims - 1; d >= 0; d--) {
        int64_t n = p->batch_shape[d];
        off += (b % n) * batch_strides[d];
        b /= n;
    }
    return off;
}

/* The address of (batch index b, head h) in a view of elem-byte elements. */
static void *view_at(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h, size_t elem) {
    int64_t off = batch_offset_of(p, view->batch_strides, b) + h * view->head_stride;
    return (char *)view->data + off * (int64_t)elem;
}

/* Keys visible to batch index b: S, or its key length clipped to [0, S]. */
static int64_t key_limit(const sdpa_problem *p, int64_t b) {
    if (!p->key_lengths) return p->len_kv;
    int64_t len = p->key_lengths[batch_offset_of(p, p->key_lengths_strides, b)];
    return len < 0 ? 0 : (len < p->len_kv ? len : p->len_kv);
}

/* Paged: the address of row `row` of sequence b's block number j (its table's
 * entry j), head h, in a view of elem-byte elements whose batch stride is the
 * stride between blocks. */
static const char *paged_block_row(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h, int64_t j,
                                   int64_t row, size_t elem) {
    const int64_t block = p->block_table[b * p->block_table_stride + j];
    const int64_t off = block * view->batch_strides[0] + h * view->head_stride + row * view->row_stride;
    return (const char *)view->data + off * (int64_t)elem;
}

/* The same for position s: row s % block_size of the sequence's block s / block_size. */
static const char *paged_row(const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h, int64_t s,
                             size_t elem) {
    return paged_block_row(p, view, b, h, s / p->block_size, s % p->block_size, elem);
}

/* Paged: makes q's offsets count from sequence b's last L positions. */
static void paged_positions(sdpa_problem *q, int64_t b) {
    const int64_t shift = key_limit(q, b) - q->len_q;
    q->causal_offset += shift;
    q->align_offset += shift;
}

/* Paged bfloat16 keys the products can read as pairs where they lie: blocks
 * of at least SDPA_PAGED_MIN_IN_PLACE positions, rows of whole pairs, 32-bit
 * aligned (else they are paired a tile or a call at a time). */
static int paged_pairs_in_place(const sdpa_problem *p);

/* Whether the window bounds a side. */
static int has_window(const sdpa_problem *p) { return p->window_left >= 0 || p->window_right >= 0; }

/* The first key the window lets row l see (0 when unbounded on the left);
 * may be past every key. */
static int64_t window_first(const sdpa_problem *p, int64_t l) {
    if (p->window_left < 0) return 0;
    int64_t first = l + p->align_offset - p->window_left;
    return first < 0 ? 0 : first;
}

/* One past the last key the window lets row l see (len_kv when unbounded on
 * the right); may be below window_first. */
static int64_t window_end(const sdpa_problem *p, int64_t l) {
    if (p->window_right < 0) return p->len_kv;
    int64_t end = l + p->align_offset + p->window_right + 1;
    return end < 0 ? 0 : (end > p->len_kv ? p->len_kv : end);
}

static void *aligned_block(size_t bytes) {
    /* over-allocate and store the original pointer just below the aligned one */
    if (bytes == 0) bytes = SDPA_ALIGN;
    if (bytes > SIZE_MAX - 2 * SDPA_ALIGN) return NULL;
    unsigned char *raw = (unsigned char *)malloc(bytes + 2 * SDPA_ALIGN);
    if (!raw) return NULL;
    uintptr_t aligned = ((uintptr_t)raw + 2 * SDPA_ALIGN - 1) & ~(uintptr_t)(SDPA_ALIGN - 1);
    ((void **)aligned)[-1] = raw;
    return (void *)aligned;
}

static void aligned_free(void *block) {
    if (block) free(((void **)block)[-1]);
}

/*
 * Interrupts: thread 0 of a call (the caller's thread) polls the interrupt
 * callback at most every 20 ms, at the start of each task and inside the key
 * loops, so that even a call that is one long task stops soon.  It reads the
 * clock only every 8th poll, which keeps a poll to a few instructions.  Every
 * thread sees the stop flag and leaves its task.
 */
typedef struct interrupt_state {
    const sdpa_problem *p;
    SDPA_ATOMIC(int) stop;  /* shared by the threads of the call */
    double next;            /* thread 0 only */
    unsigned polls;         /* thread 0 only */
    unsigned callbacks;     /* thread 0 only: times the callback ran */
} interrupt_state;

static double monotonic_seconds(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#endif
}

static void interrupt_start(interrupt_state *st, const sdpa_problem *p) {
    st->p = p;
    sdpa_atomic_store(&st->stop, 0);
    st->next = p->interrupt ? monotonic_seconds() + 0.02 : 0;
    st->polls = 0;
    st->callbacks = 0;
}

/* Whether the call is to stop now; thread tid 0 polls the callback. */
static int should_stop(interrupt_state *st, int tid) {
    if (sdpa_atomic_load(&st->stop)) return 1;
    if (tid != 0 || !st->p->interrupt || (++st->polls & 7) != 0) return 0;
    double now = monotonic_seconds();
    if (now < st->next) return 0;
    st->next = now + 0.02;
    st->callbacks++;
    if (!st->p->interrupt(st->p->interrupt_data)) return 0;
    sdpa_atomic_store(&st->stop, 1);
    return 1;
}

/*
 * Floating-point mode: every thread of a call computes under the caller's
 * control flags (x86 MXCSR: flush-to-zero, denormals-are-zero, rounding;
 * AArch64 FPCR), so results do not depend on which thread computed a row.
 * Worker threads take the caller's flags for the call and get their own back
 * after it.
 */
#if SDPA_HAVE_X86_KERNELS
#include <immintrin.h>
typedef unsigned int fp_mode;
#define FP_CONTROL_BITS 0xFFC0u /* MXCSR without the sticky exception flags */
static fp_mode fp_mode_get(void) { return _mm_getcsr(); }
static void fp_mode_adopt(fp_mode caller) {
    _mm_setcsr((_mm_getcsr() & ~FP_CONTROL_BITS) | (caller & FP_CONTROL_BITS));
}
static void fp_mode_restore(fp_mode own) { fp_mode_adopt(own); }
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
typedef uint64_t fp_mode;
static fp_mode fp_mode_get(void) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return fpcr;
}
static void fp_mode_adopt(fp_mode caller) { __asm__ volatile("msr fpcr, %0" : : "r"(caller)); }
static void fp_mode_restore(fp_mode own) { fp_mode_adopt(own); }
#else
typedef int fp_mode;
static fp_mode fp_mode_get(void) { return 0; }
static void fp_mode_adopt(fp_mode caller) { (void)caller; }
static void fp_mode_restore(fp_mode own) { (void)own; }
#endif

/*
 * Fork safety: GNU OpenMP cannot start a thread team in a child forked after the
 * parent ran one (the child waits forever for the parent's pool threads).  A
 * child forked after sdpa used threads therefore computes on its calling
 * thread only.
 */
static SDPA_ATOMIC(int) openmp_used = 0;
static SDPA_ATOMIC(int) forked_after_openmp = 0;

#if defined(_OPENMP) && !defined(_WIN32)
#include <pthread.h>
static void on_fork_child(void) {
    if (sdpa_atomic_load(&openmp_used)) sdpa_atomic_store(&forked_after_openmp, 1);
}
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static void install_fork_handler(void) { pthread_atfork(NULL, NULL, on_fork_child); }
static void note_openmp_used(void) {
    pthread_once(&fork_handler_once, install_fork_handler);
    sdpa_atomic_store(&openmp_used, 1);
}
#else
static void note_openmp_used(void) { sdpa_atomic_store(&openmp_used, 1); }
#endif

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

/* The query block and (batch, head) index of a task of the tiled path.  The
 * tasks of one key/value slice are consecutive, so that its K and V stay in
 * cache from one task to the next: per slice, the query blocks from the last
 * (with causality the longest: the tail of the loop is then the short ones)
 * and, per query block, the query heads of the slice's GQA group. */
static void task_coords(const sdpa_problem *p, const plan *pl, int64_t task, int64_t *qb, int64_t *bh) {
    const int64_t G = p->gqa_group, per_slice = pl->num_qblocks * G;
    const int64_t slice = task / per_slice, rem = task % per_slice;
    *qb = pl->num_qblocks - 1 - rem / G;
    *bh = slice * G + rem % G;  /* (b, hkv) -> b * H + hkv * G + member */
}

/*
 * Phase profile of the tiled path (sdpa_profile_start / _read in testing.h):
 * when on, each task reads a tick counter at the end of each phase of a tile and
 * adds the ticks to its thread's counters, summed into these totals at the end
 * of the call; when off, a call pays one untaken branch per phase and tile.
 * Ticks are the TSC on x86-64 (converted with the nanoseconds that passed
 * between start and read), nanoseconds of the monotonic clock elsewhere.
 */
enum { PH_PACK, PH_QK, PH_MASK, PH_SOFTMAX, PH_PV, PH_EPILOGUE, PH_SCORES, PH_COUNT };
static SDPA_ATOMIC(int) profile_on = 0;
static SDPA_ATOMIC(uint64_t) profile_total[PH_COUNT];
static double profile_t0_ns;
static uint64_t profile_t0_ticks;

static double now_ns(void) {
    struct timespec ts;
#if defined(CLOCK_MONOTONIC)
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return 1e9 * (double)ts.tv_sec + (double)ts.tv_nsec;
}

#if SDPA_HAVE_X86_KERNELS
static inline uint64_t prof_ticks(void) { return __rdtsc(); }
#else
static inline uint64_t prof_ticks(void) { return (uint64_t)now_ns(); }
#endif

static void profile_add(const uint64_t *counts) {
    for (int i = 0; i < PH_COUNT; i++) sdpa_atomic_add(&profile_total[i], counts[i]);
}

void sdpa_profile_start(void) {
    for (int i = 0; i < PH_COUNT; i++) sdpa_atomic_store(&profile_total[i], 0);
    profile_t0_ns = now_ns();
    profile_t0_ticks = prof_ticks();
    sdpa_atomic_store(&profile_on, 1);
}

int sdpa_profile_read(double *ns, int n, double *scores) {
    const double dn = now_ns() - profile_t0_ns, dt = (double)(prof_ticks() - profile_t0_ticks);
    const double per_tick = dt > 0 ? dn / dt : 1;
    for (int i = 0; i < n && i < PH_SCORES; i++) ns[i] = (double)sdpa_atomic_load(&profile_total[i]) * per_tick;
    *scores = (double)sdpa_atomic_load(&profile_total[PH_SCORES]);
    return PH_SCORES;
}

void sdpa_profile_stop(void) { sdpa_atomic_store(&profile_on, 0); }

/* What a mask does to a tile (see mask_tile_class in attention_impl.h). */
enum { TILE_MIXED = 0, TILE_ALL_VISIBLE = 1, TILE_NONE_VISIBLE = 2 };

/* ---- the two compute types ---- */

#define T float
#define TDT SDPA_FLOAT32
#define SUF f32
#define KT kernels_f32
#define EXP sdpa_exp_cut_f32
#define HAS_BF16 1
#include "attention_impl.h"
#undef HAS_BF16
#undef T
#undef TDT
#undef SUF
#undef KT
#undef EXP

#define T double
#define TDT SDPA_FLOAT64
#define SUF f64
#define KT kernels_f64
#define EXP sdpa_exp_cut_f64
#define HAS_BF16 0
#include "attention_impl.h"
#undef HAS_BF16
#undef T
#undef TDT
#undef SUF
#undef KT
#undef EXP

/* ---- validation and planning ---- */

static int mul_ok(int64_t a, int64_t b, int64_t *r) {
    if (a < 0 || b < 0) return 0;
    if (a != 0 && b > INT64_MAX / a) return 0;
    *r = a * b;
    return 1;
}

static int is_single_or_half(sdpa_dtype dt) {
    return dt == SDPA_FLOAT32 || dt == SDPA_BFLOAT16 || dt == SDPA_FLOAT16;
}

/* key and value's dtype, SDPA_DTYPE_OF_QUERY resolved */
static sdpa_dtype kv_dtype_of(const sdpa_problem *p) {
    return p->kv_dtype == SDPA_DTYPE_OF_QUERY ? p->dtype : p->kv_dtype;
}

static sdpa_status validate(const sdpa_problem *p, int64_t *batch_count) {
    const sdpa_dtype kvdt = kv_dtype_of(p);
    const int quantized = sdpa_is_quantized(kvdt);
    /* int8 and int4 need both scales; float8 either may be missing (no scale) */
    const int needs_scales = kvdt == SDPA_INT8 || kvdt == SDPA_INT4;
    if (p->dtype == SDPA_FLOAT64) {
        if (kvdt != SDPA_FLOAT64) return SDPA_ERR_BAD_DTYPE;
    } else if (!is_single_or_half(p->dtype) || (!is_single_or_half(kvdt) && !quantized)) {
        return SDPA_ERR_BAD_DTYPE;
    }
    if (quantized && (p->kv_group_size < 0 || (p->kv_group_size > 0 && (p->head_dim % p->kv_group_size != 0 ||
                                                                        p->head_dim_v % p->kv_group_size != 0))))
        return SDPA_ERR_BAD_SHAPE;
    /* int4: whole bytes (pairs of values) per row and per group, read along the row */
    if (kvdt == SDPA_INT4 && (p->head_dim % 2 || p->head_dim_v % 2 || p->kv_group_size % 2 ||
                              (p->len_kv > 0 && ((p->head_dim > 0 && p->key.col_stride != 1) ||
                                                 (p->head_dim_v > 0 && p->value.col_stride != 1)))))
        return SDPA_ERR_BAD_SHAPE;
    if (p->num_batch_dims < 0 || p->num_batch_dims > SDPA_MAX_BATCH_DIMS) return SDPA_ERR_BAD_SHAPE;
    if (p->num_heads < 0 || p->len_q < 0 || p->len_kv < 0 || p->head_dim < 0 || p->head_dim_v < 0)
        return SDPA_ERR_BAD_SHAPE;
    if (p->len_q > INT32_MAX || p->head_dim > INT32_MAX || p->head_dim_v > INT32_MAX ||
        p->len_kv > SDPA_MAX_LEN_KV)
        return SDPA_ERR_BAD_SHAPE;
    if (p->gqa_group < 1 || p->num_heads % p->gqa_group != 0) return SDPA_ERR_BAD_GQA;
    if (p->mask_kind != SDPA_MASK_NONE && p->mask_kind != SDPA_MASK_BOOL &&
        p->mask_kind != SDPA_MASK_ADDITIVE)
        return SDPA_ERR_BAD_MASK;
    if (p->num_threads < 0) return SDPA_ERR_BAD_THREADS;
    const int64_t big = (int64_t)1 << 61;
    if (p->window_left < -1 || p->window_left > big || p->window_right < -1 || p->window_right > big)
        return SDPA_ERR_BAD_VARIANT;
    if (!(p->softcap >= 0) || p->softcap == (double)INFINITY) return SDPA_ERR_BAD_VARIANT;
    if ((has_window(p) || p->alibi.data) &&
        (p->align_offset < -big || p->align_offset > big || p->len_q > big))
        return SDPA_ERR_BAD_VARIANT;
    int64_t count = 1, tmp;
    for (int d = 0; d < p->num_batch_dims; d++) {
        if (p->batch_shape[d] < 0) return SDPA_ERR_BAD_SHAPE;
        if (!mul_ok(count, p->batch_shape[d], &count)) return SDPA_ERR_OVERFLOW;
    }
    if (!mul_ok(count, p->num_heads, &tmp)) return SDPA_ERR_OVERFLOW;
    if (!mul_ok(tmp, p->len_q, &tmp)) return SDPA_ERR_OVERFLOW;
    if (!mul_ok(tmp, p->len_kv > p->head_dim_v ? p->len_kv : p->head_dim_v, &tmp))
        return SDPA_ERR_OVERFLOW;
    int64_t work = count * p->num_heads * p->len_q;
    if (p->block_size != 0) {  /* paged: every block id that would be read */
        int64_t span;
        if (p->block_size < 0 || p->block_size > SDPA_MAX_LEN_KV || p->num_batch_dims != 1 || !p->key_lengths ||
            p->mask_kind != SDPA_MASK_NONE || p->weights.data || p->num_blocks < 0 || p->block_table_stride < 0 ||
            !mul_ok(count, p->block_table_stride, &span))
            return SDPA_ERR_BAD_PAGES;
        if (work > 0 && p->len_kv > 0 && !p->block_table) return SDPA_ERR_NULL_POINTER;
        for (int64_t b = 0; work > 0 && b < count; b++) {
            const int64_t len = p->key_lengths[batch_offset_of(p, p->key_lengths_strides, b)];
            if (len < 0 || len > p->len_kv) return SDPA_ERR_BAD_PAGES;
            const int32_t *row = p->block_table + b * p->block_table_stride;
            for (int64_t j = 0; j < (len + p->block_size - 1) / p->block_size; j++)
                if (row[j] < 0 || row[j] >= p->num_blocks) return SDPA_ERR_BAD_PAGES;
        }
    }
    if (work > 0) {
        if (!p->query.data || !p->out.data) return SDPA_ERR_NULL_POINTER;
        if (p->len_kv > 0 && (!p->key.data || !p->value.data)) return SDPA_ERR_NULL_POINTER;
        if (needs_scales && p->len_kv > 0 && (!p->key_scale.data || !p->value_scale.data))
            return SDPA_ERR_NULL_POINTER;
        if (p->mask_kind != SDPA_MASK_NONE && p->len_kv > 0 && !p->mask.data)
            return SDPA_ERR_NULL_POINTER;
    }
    *batch_count = count;
    return SDPA_OK;
}

static size_t round_elems(size_t n, size_t elem) {
    size_t per = SDPA_ALIGN / elem;
    return (n + per - 1) / per * per;
}

/* Blocking forced by the test suite (sdpa_testing_set_blocking); 0: the rule. */
static SDPA_ATOMIC(int) forced_tile_q = 0, forced_tile_k = 0, forced_chunk = 0;

/* Packing of K/V once per call forced by the test suite: 0 the rule, 1 never,
 * 2 whenever the call could (sdpa_testing_set_packing). */
static SDPA_ATOMIC(int) forced_packing = 0;

static SDPA_ATOMIC(int) forced_fold = 0;
void sdpa_testing_set_fold_group(int min_group) { sdpa_atomic_store(&forced_fold, min_group); }

void sdpa_testing_set_packing(int mode) { sdpa_atomic_store(&forced_packing, mode == 1 || mode == 2 ? mode : 0); }

void sdpa_testing_set_blocking(int tile_q, int tile_k, int chunk) {
    sdpa_atomic_store(&forced_tile_q, tile_q > 0 ? tile_q : 0);
    sdpa_atomic_store(&forced_tile_k, tile_k > 0 ? tile_k : 0);
    sdpa_atomic_store(&forced_chunk, chunk > 0 ? chunk : 0);
}

static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

#define SDPA_ROW_MODE_CHUNK 1024
/* K and V packed once per call (make_plan) in at most this many bytes, by units
 * of this many keys (even: whole pairs) */
#define SDPA_PACK_BUDGET (512.0 * 1024 * 1024)
#define SDPA_PACK_CHUNK 512

/*
 * The blocking, from the cache sizes and the shape (docs/blocking.md):
 *   tile_k  keys per tile, tiled path: as many as have their K and V rows
 *           (tile_k x (E + Ev)) fill half of L2, as every panel of the task
 *           reads them; a multiple of 16 in [32, 512], no more than S rounded
 *           up to one;
 *   tile_q  query rows per task: as many as have their query and accumulator
 *           panels (tile_q x (E + Ev)) fill the other half; a multiple of nr in
 *           [nr, 512], no more than L rounded up to one, and small enough to
 *           give each thread two tasks when the batch and heads alone do not;
 *   tile_k  keys per tile, row mode (decoding): as many as have the scores of
 *           the task's rows (rows x tile_k) fill half of L1, as they pass
 *           through the three steps of a tile there; a power of two in
 *           [128, 1024];
 *   chunk   keys per task in row mode: SDPA_ROW_MODE_CHUNK.
 * tile_k and chunk set the order of the sums of a row, so they depend on the
 * machine and the shape only, never on the thread count; tile_q does not
 * change a bit of the result.
 */
static void choose_blocking(const sdpa_problem *p, int64_t batch_count, int threads, size_t elem,
                            size_t kv_elem, plan *pl) {
    int64_t l1, l2;
    sdpa_cache_sizes(&l1, &l2);
    const int64_t E = p->head_dim, Ev = p->head_dim_v, nr = pl->nr, el = (int64_t)elem;
    const int64_t width = E + Ev > 0 ? E + Ev : 1;
    int64_t tk, tq = nr;
    if (pl->row_mode) {
        const int64_t rows = p->gqa_group * p->len_q > 0 ? p->gqa_group * p->len_q : 1;
        tk = 128;
        while (tk < 1024 && 2 * tk * rows * el <= l1 / 2) tk *= 2;
    } else {
        tk = clamp64(l2 / 2 / (width * (int64_t)kv_elem) / 16 * 16, 32, 512);
        const int64_t all_keys = (p->len_kv + 15) / 16 * 16;  /* nor for keys */
        if (all_keys < tk) tk = all_keys < 32 ? 32 : all_keys;
        tq = clamp64(l2 / 2 / (width * el) / nr * nr, nr, 512);
        const int64_t all_rows = (p->len_q + nr - 1) / nr * nr;  /* no room for rows that are not there */
        if (all_rows < tq) tq = all_rows < nr ? nr : all_rows;
        const int64_t bh = batch_count * p->num_heads;
        if (bh > 0 && bh < 2 * (int64_t)threads) {  /* split the query rows instead */
            const int64_t blocks = (2 * (int64_t)threads + bh - 1) / bh;
            const int64_t fit = ((p->len_q + blocks - 1) / blocks + nr - 1) / nr * nr;
            if (fit < tq) tq = fit < nr ? nr : fit;
        }
    }
    int64_t chunk = SDPA_ROW_MODE_CHUNK;
    const int fq = sdpa_atomic_load(&forced_tile_q), fk = sdpa_atomic_load(&forced_tile_k);
    const int fc = sdpa_atomic_load(&forced_chunk);
    if (fq) tq = (fq + nr - 1) / nr * nr;
    if (fk) tk = fk;
    if (fc) chunk = fc;
    pl->tile_q = (int)tq;
    pl->tile_k = (int)tk;
    pl->chunk_len = chunk;
}

static void make_plan(const sdpa_problem *p, int64_t batch_count, const kernel_table *kt,
                      plan *pl) {
    size_t elem = p->dtype == SDPA_FLOAT64 ? sizeof(double) : sizeof(float);  /* compute type */
    memset(pl, 0, sizeof(*pl));
    pl->kv_dtype = kv_dtype_of(p);
    pl->nr = p->dtype != SDPA_FLOAT64 ? kt->f32.nr : kt->f64.nr;
    int nthreads = p->num_threads;
    if (nthreads == 0) nthreads = sdpa_default_num_threads();
    if (nthreads > sdpa_max_threads()) nthreads = sdpa_max_threads();
    if (nthreads < 1) nthreads = 1;
    const size_t E = (size_t)p->head_dim, Ev = (size_t)p->head_dim_v;
    const int64_t rows = p->gqa_group * p->len_q;
    /* bfloat16 pairs on the tiled path (AVX512-BF16) are ahead from L = 16 */
    const int bf16_pairs = p->dtype == SDPA_BFLOAT16 && pl->kv_dtype == SDPA_BFLOAT16 &&
                           kt->bf16_products;
    const int64_t max_l = bf16_pairs ? SDPA_ROW_MODE_MAX_L_BF16 : SDPA_ROW_MODE_MAX_L;
    pl->row_mode = rows <= SDPA_ROW_MODE_MAX_ROWS || (p->len_q <= max_l && rows <= SDPA_ROW_MODE_WIDE_ROWS);
    /* quantized tiles are dequantized into float scratch: blocked as float */
    choose_blocking(p, batch_count, nthreads, elem,
                    sdpa_is_quantized(pl->kv_dtype) ? sizeof(float) : sdpa_dtype_size(pl->kv_dtype), pl);
    /* bfloat16 pairs: key tiles of whole pairs (a blocking forced by the tests may be odd) */
    if (bf16_pairs && !pl->row_mode && pl->tile_k % 2) pl->tile_k++;
    size_t off = 0;
    if (pl->row_mode) {
        const size_t tk = (size_t)pl->tile_k, M = (size_t)rows;
        pl->rows = (int)rows;
        pl->num_groups = batch_count * (p->num_heads / p->gqa_group);
        pl->num_chunks = p->len_kv > 0 ? (p->len_kv + pl->chunk_len - 1) / pl->chunk_len : 1;
        pl->num_tasks = pl->num_groups * pl->num_chunks;
        pl->partial_elems = round_elems(M * (2 + Ev), elem);
        pl->off_q = off; off += round_elems(M * E, elem);
        pl->off_s = off; off += round_elems(M * tk, elem);
        pl->off_k = off; off += round_elems(tk * E, elem);
        pl->off_v = off; off += round_elems(tk * Ev, elem);
        pl->off_pp = off; off += round_elems(M * tk, elem);  /* int8: scores of one scale group */
        pl->integer_qk = p->integer_qk && p->dtype != SDPA_FLOAT64 &&
                         (pl->kv_dtype == SDPA_INT8 || pl->kv_dtype == SDPA_INT4);
        if (pl->integer_qk) {  /* int8 rows (M x E), M float scales, then the kernel's work */
            pl->dot_qi = sdpa_dot_qi_for(kt);
            pl->off_qi = off;
            off += round_elems((M * E + 3 * SDPA_ALIGN) / elem + M + SDPA_QI_WORK_BYTES(M, E) / elem + 1, elem);
        }
    } else {
        const size_t tq = (size_t)pl->tile_q, tk = (size_t)pl->tile_k, nr = (size_t)pl->nr;
        pl->num_bh = batch_count * p->num_heads;
        pl->num_qblocks = (p->len_q + pl->tile_q - 1) / pl->tile_q;
        pl->num_tasks = pl->num_bh * pl->num_qblocks;
        pl->off_q = off;   off += round_elems(tq * E, elem);
        pl->off_acc = off; off += round_elems(tq * Ev, elem);
        pl->off_s = off;   off += round_elems(tk * nr, elem);
        pl->off_m = off;   off += round_elems(tq, elem);
        pl->off_l = off;   off += round_elems(tq, elem);
        pl->bf16 = bf16_pairs;
        /* K and V copied (widened) by tiles or packed per call: not of the compute
         * type, or paged in blocks too short for the products to read in place */
        const int convert = !pl->bf16 && (pl->kv_dtype != (p->dtype == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32) ||
                                          (p->block_size > 0 && p->block_size < SDPA_PAGED_MIN_IN_PLACE));
        pl->convert_kv = convert;
        pl->e2p = (int64_t)(E + 1) / 2;
        if (pl->bf16) {  /* pairs of bfloat16, 32 bits each: the size of a float */
            const size_t E2 = (E + 1) / 2, pairs = (tk + 1) / 2;
            pl->off_pp = off; off += round_elems(pairs * nr, elem);
            pl->off_vp = off; off += round_elems(pairs * Ev, elem);  /* V pairs of a tile, when not packed */
            pl->off_vt = off; off += round_elems(16 * Ev, elem);     /* the last pairs of an odd key count */
            /* K pairs of a tile, when neither in place nor packed: E2 a row, or up
             * to E where the rows are padded to whole blocks (below) */
            pl->off_k = off;  off += round_elems(tk * (E > E2 ? E : E2), elem);
            /* the query panels hold E2 pairs, not E floats: within off_q's room */
        } else if (convert) {
            pl->off_k = off; off += round_elems(tk * E, elem);  /* K and V tiles converted */
            pl->off_v = off; off += round_elems(tk * Ev, elem);
        }
        pl->profile = sdpa_atomic_load(&profile_on);
        pl->off_prof = off; off += round_elems(PH_COUNT * 8 / elem, elem);
        /* K/V packed once per call where a slice is read by two or more tasks
         * (query blocks, query heads of a GQA group) and the buffer stays within
         * SDPA_PACK_BUDGET bytes; else a tile at a time in each task */
        const int64_t reuse = pl->num_qblocks * p->gqa_group;
        const int packing = sdpa_atomic_load(&forced_packing);
        if ((pl->bf16 || convert) && (reuse >= 2 || packing == 2) && packing != 1 && p->len_kv > 0) {
            const int64_t S = p->len_kv, slices = batch_count * (p->num_heads / p->gqa_group);
            int64_t e2p = pl->e2p;
            size_t per;
            if (pl->bf16) {
                /* K pairs packed too, padded to whole tiles of the product, when
                 * its rows would end in a part tile (copied through a buffer at
                 * every product) and the panels have room for the padding */
                const int64_t blk = kt->f32.bf16.pairs_block > 1 ? kt->f32.bf16.pairs_block : 1;
                e2p = (pl->e2p + blk - 1) / blk * blk;
                pl->slice_k = e2p != pl->e2p && e2p <= (int64_t)E ? (size_t)(S * e2p) : 0;
                if (p->block_size > 0 && !pl->slice_k && !paged_pairs_in_place(p)) {
                    if (e2p > (int64_t)E) e2p = pl->e2p;  /* no room for the padding in the panels */
                    pl->slice_k = (size_t)(S * e2p);      /* paged short blocks: K pairs too */
                }
                /* V: whole tiles of 16 pairs, and an odd number of 64-byte lines a
                 * feature row: a tile's 16 rows at a stride of a multiple of 4 KiB
                 * would fall in one set of L1 */
                pl->vp_ld = ((S + 1) / 2 + 15) / 16 * 16;
                if (pl->vp_ld / 16 % 2 == 0) pl->vp_ld += 16;
                per = pl->slice_k +
                      (kt->f32.bf16.values_by_feature ? (size_t)pl->vp_ld * Ev : (size_t)((S + 1) / 2) * Ev);
            } else {
                pl->slice_k = (size_t)S * E;
                per = pl->slice_k + (size_t)S * Ev;
            }
            pl->slice_elems = round_elems(per, elem);
            if (!((double)pl->slice_elems * (double)slices * (double)elem <= SDPA_PACK_BUDGET || packing == 2))
                pl->slice_k = 0;  /* not packed: K in place or a tile at a time */
            if ((double)pl->slice_elems * (double)slices * (double)elem <= SDPA_PACK_BUDGET || packing == 2) {
                pl->kv_packed = 1;
                if (pl->slice_k) pl->e2p = e2p;  /* K packed padded to whole blocks */
                pl->callbuf_elems = pl->slice_elems * (size_t)slices;
                pl->pack_chunk = SDPA_PACK_CHUNK;
                pl->pack_units = slices * ((S + pl->pack_chunk - 1) / pl->pack_chunk);
            }
        }
    }
    pl->scratch_elems = off;

    if ((int64_t)nthreads > pl->num_tasks) nthreads = (int)(pl->num_tasks > 0 ? pl->num_tasks : 1);
    /* waking a thread costs tens of microseconds: by default give each at least
     * SDPA_MIN_FLOPS_PER_THREAD of work (results do not depend on the count); an
     * explicit thread count is taken as asked */
    double flops = 2.0 * (double)batch_count * (double)p->num_heads * (double)p->len_q *
                   (double)p->len_kv * (double)(p->head_dim + p->head_dim_v);
    double by_work = flops / SDPA_MIN_FLOPS_PER_THREAD;
    if (p->num_threads == 0 && by_work < (double)nthreads) nthreads = by_work < 1 ? 1 : (int)by_work;
#ifndef _OPENMP
    nthreads = 1;
#endif
    if (sdpa_atomic_load(&forked_after_openmp)) nthreads = 1;
    pl->num_threads = nthreads;
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

/*
 * A bool mask that is the same for every head and query row (a padding mask,
 * (B, 1, 1, S)) and, for each batch index, lets through a prefix of the keys
 * (True ... True False ... False) limits the keys instead: the keys past the
 * prefix are never visited and no mask is applied.  limits[b] (dense over
 * batch_shape) becomes the smaller of the prefix and the key length.  Returns
 * 0 when the mask is not of that shape.
 */
static int padding_limits(const sdpa_problem *p, int64_t batch_count, int64_t *limits) {
    if (p->mask_kind != SDPA_MASK_BOOL || p->mask.row_stride != 0 || p->mask.head_stride != 0) return 0;
    const int64_t S = p->len_kv, cs = p->mask.col_stride;
    for (int64_t b = 0; b < batch_count; b++) {
        const uint8_t *m = (const uint8_t *)p->mask.data + batch_offset_of(p, p->mask.batch_strides, b);
        int64_t prefix = 0;
        while (prefix < S && m[prefix * cs]) prefix++;
        for (int64_t j = prefix + 1; j < S; j++)
            if (m[j * cs]) return 0;
        const int64_t len = key_limit(p, b);
        limits[b] = prefix < len ? prefix : len;
    }
    return 1;
}

/*
 * A single query row per head (decoding) whose GQA group is large (MLA's
 * absorbed decoding: 16-128 query heads over one latent head) reads the same
 * keys for every head of a group: the heads of a group become the rows of one
 * query, so that the tiled path computes them as a block (G rows against each
 * key tile, on AMX tiles where there are) instead of the row path's G dot
 * products a key.  The views are the same memory: a query head's row is the
 * folded query's row.  Done only where every row sees the same keys alike: no
 * mask, weights, window, ALiBi or sinks (per head), and a causal row that sees
 * every key.  Measured against the row path (8,192 keys, 2 threads, E 128):
 * float32 1.0x at G = 8 and 16, 1.6-1.7x at 32 and 64 (1.4x for MLA's E 576);
 * bfloat16 with AMX 1.0x at 8, 2.0x at 16, 3.7-4.1x at 32-128.
 */
static void fold_group(sdpa_problem *q, const kernel_table *kt) {
    const int forced = sdpa_atomic_load(&forced_fold);
    const int pairs = q->dtype == SDPA_BFLOAT16 && kv_dtype_of(q) == SDPA_BFLOAT16 && kt->bf16_products;
    const int64_t rule = pairs ? SDPA_FOLD_MIN_GROUP_BF16 : SDPA_FOLD_MIN_GROUP;
    const int64_t min_group = forced > 0 ? forced : forced < 0 ? INT64_MAX : rule;
    if (q->len_q != 1 || q->gqa_group < min_group || q->mask_kind != SDPA_MASK_NONE || q->weights.data ||
        has_window(q) || q->alibi.data || q->sinks.data)
        return;
    /* the row's last visible key: causal_offset (from the sequence's end when paged) */
    if (q->causal && q->causal_offset < (q->block_size > 0 ? 0 : q->len_kv - 1)) return;
    const int64_t G = q->gqa_group;
    q->causal = 0;
    q->num_heads /= G;
    q->gqa_group = 1;
    q->len_q = G;
    sdpa_view *rows[3] = {&q->query, &q->out, &q->lse};
    for (int i = 0; i < 3; i++) {
        rows[i]->row_stride = rows[i]->head_stride;
        rows[i]->head_stride *= G;
    }
}

static int paged_pairs_in_place(const sdpa_problem *p) {
    return p->block_size >= SDPA_PAGED_MIN_IN_PLACE && p->head_dim % 2 == 0 && p->key.col_stride == 1 &&
           p->key.row_stride % 2 == 0 && p->key.head_stride % 2 == 0 && p->key.batch_strides[0] % 2 == 0 &&
           ((uintptr_t)p->key.data & 3) == 0;
}

/* Plans and computes a validated problem (offsets clamped). */
static sdpa_status run_problem(const sdpa_problem *q, int64_t batch_count, const kernel_table *kt, int by_name) {
    plan pl;
    make_plan(q, batch_count, kt, &pl);
    if (pl.bf16) {  /* the OS must allow AMX tiles before their first use: asked here */
        kt = sdpa_kernel_table_for_tiles(kt, by_name);
        if (!kt) return SDPA_ERR_BAD_ISA;
    }
    return q->dtype == SDPA_FLOAT64 ? attention_f64(q, &pl, &kt->f64) : attention_f32(q, &pl, &kt->f32);
}

/* Rows [0, n) of one head of a paged view (cols elements of elem bytes each)
 * into dst, n x cols contiguous. */
static void gather_rows(char *dst, const sdpa_problem *p, const sdpa_view *view, int64_t b, int64_t h, int64_t n,
                        int64_t cols, size_t elem) {
    const size_t row_bytes = (size_t)cols * elem;
    for (int64_t s = 0; s < n; s++) {
        const char *src = paged_row(p, view, b, h, s, elem);
        char *d = dst + (size_t)s * row_bytes;
        if (view->col_stride == 1) {
            memcpy(d, src, row_bytes);
        } else {
            for (int64_t c = 0; c < cols; c++) memcpy(d + (size_t)c * elem, src + c * view->col_stride * (int64_t)elem, elem);
        }
    }
}

/*
 * A paged problem.  Both paths read the blocks where they are, by the segments
 * of a tile (or of a packing unit) in each block: row mode and the tiled
 * path's float products in place, widening and pairing into scratch as for
 * arrays.  bfloat16 pairs of keys need blocks of an even size (a pair never
 * straddles two blocks): with an odd one, each sequence runs alone over a copy
 * of its blocks, made once, in a buffer of the call.
 */
static sdpa_status run_paged(const sdpa_problem *p, int64_t batch_count, const kernel_table *kt, int by_name) {
    plan pl;
    make_plan(p, batch_count, kt, &pl);
    const sdpa_dtype kvdt = kv_dtype_of(p);
    if (pl.row_mode || !pl.bf16 || p->block_size % 2 == 0) return run_problem(p, batch_count, kt, by_name);
    const int int8 = sdpa_is_quantized(kvdt);  /* with scales to gather (bfloat16 pairs never are) */
    const size_t ke = sdpa_dtype_size(kvdt), qe = sdpa_dtype_size(p->dtype);
    const size_t ce = p->dtype == SDPA_FLOAT64 ? sizeof(double) : sizeof(float);
    const int64_t Hkv = p->num_heads / p->gqa_group, E = p->head_dim, Ev = p->head_dim_v, L = p->len_q;
    const int64_t gk = int8 ? (p->kv_group_size ? E / p->kv_group_size : 1) : 0;
    const int64_t gv = int8 ? (p->kv_group_size ? Ev / p->kv_group_size : 1) : 0;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch_count; b++)
        if (key_limit(p, b) > longest) longest = key_limit(p, b);
    const size_t per_key = (size_t)(E + Ev) * ke + (size_t)(gk + gv) * sizeof(float);
    char *buf = (char *)malloc((size_t)Hkv * (size_t)(longest > 0 ? longest : 1) * per_key);
    if (!buf) return SDPA_ERR_NO_MEMORY;
    sdpa_status st = SDPA_OK;
    for (int64_t b = 0; b < batch_count && st == SDPA_OK; b++) {
        const int64_t S = key_limit(p, b);
        sdpa_problem s = *p;
        s.batch_shape[0] = 1;
        s.block_size = 0;
        s.block_table = NULL;
        s.key_lengths = NULL;
        s.len_kv = S;
        paged_positions(&s, b);
        if (s.causal_offset > S) s.causal_offset = S;
        if (s.causal_offset < -L) s.causal_offset = -L;
        s.query.data = view_at(p, &p->query, b, 0, qe);
        s.out.data = view_at(p, &p->out, b, 0, qe);
        if (p->lse.data) s.lse.data = view_at(p, &p->lse, b, 0, ce);
        if (p->alibi.data) s.alibi.data = view_at(p, &p->alibi, b, 0, ce);
        if (p->sinks.data) s.sinks.data = view_at(p, &p->sinks, b, 0, ce);
        char *kb = buf, *vb = kb + (size_t)(Hkv * S * E) * ke;
        char *ksb = vb + (size_t)(Hkv * S * Ev) * ke, *vsb = ksb + (size_t)(Hkv * S * gk) * sizeof(float);
        for (int64_t h = 0; h < Hkv; h++) {
            gather_rows(kb + (size_t)(h * S * E) * ke, p, &p->key, b, h, S, E, ke);
            gather_rows(vb + (size_t)(h * S * Ev) * ke, p, &p->value, b, h, S, Ev, ke);
            if (int8) {
                gather_rows(ksb + (size_t)(h * S * gk) * sizeof(float), p, &p->key_scale, b, h, S, gk, sizeof(float));
                gather_rows(vsb + (size_t)(h * S * gv) * sizeof(float), p, &p->value_scale, b, h, S, gv, sizeof(float));
            }
        }
        const sdpa_view dense[4] = {{kb, {0}, S * E, E, 1}, {vb, {0}, S * Ev, Ev, 1},
                                    {ksb, {0}, S * gk, gk, 1}, {vsb, {0}, S * gv, gv, 1}};
        s.key = dense[0];
        s.value = dense[1];
        if (int8) {
            s.key_scale = dense[2];
            s.value_scale = dense[3];
        }
        st = run_problem(&s, 1, kt, by_name);
    }
    free(buf);
    return st;
}

sdpa_status sdpa_attention(const sdpa_problem *p) {
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) return SDPA_ERR_ABI;  /* before reading anything else */
    int64_t batch_count = 0;
    sdpa_status st = validate(p, &batch_count);
    if (st != SDPA_OK) return st;
    if (batch_count * p->num_heads * p->len_q == 0) return SDPA_OK;  /* empty output */

    int by_name = 0;
    const kernel_table *kt = sdpa_kernel_choice(&by_name);
    if (!kt) return SDPA_ERR_BAD_ISA;  /* SDPA_ISA names a set that cannot be used */
    /* Row l sees keys s <= l + causal_offset: an offset >= S shows every key,
     * one <= -L none.  Clamped to [-L, S], the driver's sums cannot overflow. */
    sdpa_problem q = *p;
    if (q.block_size > 0) {  /* offsets count from each sequence's end, clamped as above */
        if (q.causal_offset > q.len_kv) q.causal_offset = q.len_kv;
        if (q.causal_offset < -q.len_q - q.len_kv) q.causal_offset = -q.len_q - q.len_kv;
    } else {
        if (q.causal_offset > q.len_kv) q.causal_offset = q.len_kv;
        if (q.causal_offset < -q.len_q) q.causal_offset = -q.len_q;
    }
    int64_t *limits = NULL;
    if (q.mask_kind == SDPA_MASK_BOOL && q.mask.row_stride == 0 && q.mask.head_stride == 0 && q.len_kv > 0) {
        limits = (int64_t *)malloc((size_t)batch_count * sizeof(int64_t));
        if (!limits) return SDPA_ERR_NO_MEMORY;
        if (padding_limits(&q, batch_count, limits)) {
            q.mask_kind = SDPA_MASK_NONE;
            q.key_lengths = limits;
            int64_t stride = 1;
            for (int d = q.num_batch_dims - 1; d >= 0; d--) {
                q.key_lengths_strides[d] = stride;
                stride *= q.batch_shape[d];
            }
        }
    }
    fold_group(&q, kt);
    st = q.block_size > 0 ? run_paged(&q, batch_count, kt, by_name) : run_problem(&q, batch_count, kt, by_name);
    free(limits);
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
                   "num_batch_dims not 1, a mask or weights with paged keys, or a negative or too large block size, "
                   "block count or table stride";
        case SDPA_ERR_ABI:
            return "the sdpa_problem is not this library's (compiled against another sdpa.h, or not set up by "
                   "sdpa_problem_init)";
        case SDPA_ERR_BAD_VARIANT:
            return "window sides must be -1 or in [0, 2^61], align_offset and len_q at most 2^61 with a window "
                   "or ALiBi, softcap finite and >= 0";
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
