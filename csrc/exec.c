/* The executor: runs a call's plan (plan.h) in one OpenMP parallel region.
 * The maths is in exec_impl.h and the files it includes, and in the kernels
 * they call. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "kv_source.h"
#include "plan.h"
#include "problem.h"
#include "testing.h"

void *sdpa_aligned_block(size_t bytes) {
    /* over-allocate and store the original pointer just below the aligned one */
    if (bytes == 0) bytes = SDPA_ALIGN;
    if (bytes > SIZE_MAX - 2 * SDPA_ALIGN) return NULL;
    unsigned char *raw = (unsigned char *)malloc(bytes + 2 * SDPA_ALIGN);
    if (!raw) return NULL;
    uintptr_t aligned = ((uintptr_t)raw + 2 * SDPA_ALIGN - 1) & ~(uintptr_t)(SDPA_ALIGN - 1);
    ((void **)aligned)[-1] = raw;
    return (void *)aligned;
}

void sdpa_aligned_free(void *block) {
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

/* What a thread's scratch holds of the row path's query rows between its
 * tasks: group g's of part pt (scaled, and rounded to int8 for integer_qk),
 * or nothing (pt NULL).  A group's chunks are neighbours in the work list, so
 * a thread prepares a group's rows once, not once a chunk. */
typedef struct row_memo {
    const void *pt;
    int64_t g;
} row_memo;

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

/* Nanoseconds of the monotonic clock (the phase profile, machine.c's probes). */
double sdpa_now_ns(void) {
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
static inline uint64_t prof_ticks(void) { return (uint64_t)sdpa_now_ns(); }
#endif

static void profile_add(const uint64_t *counts) {
    for (int i = 0; i < PH_COUNT; i++) sdpa_atomic_add(&profile_total[i], counts[i]);
}

void sdpa_profile_start(void) {
    for (int i = 0; i < PH_COUNT; i++) sdpa_atomic_store(&profile_total[i], 0);
    profile_t0_ns = sdpa_now_ns();
    profile_t0_ticks = prof_ticks();
    sdpa_atomic_store(&profile_on, 1);
}

int sdpa_profile_read(double *ns, int n, double *scores) {
    const double dn = sdpa_now_ns() - profile_t0_ns, dt = (double)(prof_ticks() - profile_t0_ticks);
    const double per_tick = dt > 0 ? dn / dt : 1;
    for (int i = 0; i < n && i < PH_SCORES; i++) ns[i] = (double)sdpa_atomic_load(&profile_total[i]) * per_tick;
    *scores = (double)sdpa_atomic_load(&profile_total[PH_SCORES]);
    return PH_SCORES;
}

void sdpa_profile_stop(void) { sdpa_atomic_store(&profile_on, 0); }

int sdpa_profile_on(void) { return sdpa_atomic_load(&profile_on); }

int sdpa_forked_after_openmp(void) { return sdpa_atomic_load(&forked_after_openmp); }

void sdpa_parallel_for(int nthreads, int64_t n, void (*fn)(void *ctx, int64_t i, int tid), void *ctx) {
#ifdef _OPENMP
    if (nthreads > 1 && n > 1) {
        note_openmp_used();
        const fp_mode caller_mode = fp_mode_get();
#pragma omp parallel num_threads(nthreads)
        {
            const int tid = omp_get_thread_num();
            const fp_mode own_mode = fp_mode_get();
            fp_mode_adopt(caller_mode);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n; i++) fn(ctx, i, tid);
            fp_mode_restore(own_mode);
        }
        return;
    }
#endif
    (void)nthreads;
    for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
}

/*
 * Key scores keep megabytes a call (the p of every counted row and key; 4
 * MiB for 32 query heads over 32,768 keys), and so does the backward pass
 * (its threads' packed panels and dQ sums); fresh pages cost the kernel's
 * zeroing at every call (4% of such a decoding step, measured).  So the
 * block of the last call is kept for the next that fits in it: one block a
 * use (enum sdpa_kept_use in plan.h), taken and given back by an atomic
 * exchange (calls on several threads at once allocate their own), of at most
 * SDPA_KEPT_MAX bytes.
 */
#define SDPA_KEPT_MAX ((size_t)32 << 20)
static SDPA_ATOMIC(void *) kept_block[SDPA_KEPT_USES];

void *sdpa_kept_take(int use, size_t bytes) {
    void *b = sdpa_atomic_exchange(&kept_block[use], NULL);
    if (b && ((size_t *)b)[-2] >= bytes) return b;
    sdpa_aligned_free(b);
    b = sdpa_aligned_block(bytes);
    if (b) ((size_t *)b)[-2] = bytes;  /* below the aligned start: room for two words there */
    return b;
}

void sdpa_kept_give(int use, void *b) {
    if (b && ((size_t *)b)[-2] > SDPA_KEPT_MAX) {
        sdpa_aligned_free(b);
        return;
    }
    sdpa_aligned_free(sdpa_atomic_exchange(&kept_block[use], b));
}

#if defined(__GNUC__) || defined(__clang__)
/* The kept blocks go back when the library is unloaded (process exit):
 * memory checkers then see none of them held past the end. */
__attribute__((destructor)) static void kept_release(void) {
    for (int use = 0; use < SDPA_KEPT_USES; use++) sdpa_aligned_free(sdpa_atomic_exchange(&kept_block[use], NULL));
}
#endif

/* Copies n bytes (a multiple of 4) from src to dst where no one reads them
 * soon: streaming stores on x86-64 (no read of dst's lines first), so that
 * key scores' kept p cost their writes only; a fence before any later read
 * (stream_done).  Elsewhere memcpy. */
static void stream_copy(void *dst, const void *src, size_t n) {
#if SDPA_HAVE_X86_KERNELS
    char *d = (char *)dst;
    const char *s = (const char *)src;
    while (n >= 4 && ((uintptr_t)d & 15)) {
        memcpy(d, s, 4);
        d += 4, s += 4, n -= 4;
    }
    for (; n >= 16; d += 16, s += 16, n -= 16)
        _mm_stream_ps((float *)(void *)d, _mm_loadu_ps((const float *)(const void *)s));
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

static void stream_done(void) {
#if SDPA_HAVE_X86_KERNELS
    _mm_sfence();
#endif
}


/* ---- the two compute types ---- */

#define T float
#define TDT SDPA_FLOAT32
#define SUF f32
#define KT kernels_f32
#define EXP sdpa_exp_cut_f32
#define HAS_BF16 1
#include "exec_impl.h"
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
#include "exec_impl.h"
#undef HAS_BF16
#undef T
#undef TDT
#undef SUF
#undef KT
#undef EXP

sdpa_status sdpa_run_call(call_plan *cp, const kernel_table *kt) {
    return cp->call->dtype == SDPA_FLOAT64 ? run_call_f64(cp, &kt->f64) : run_call_f32(cp, &kt->f32);
}
