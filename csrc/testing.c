/* Hooks for the test suite (testing.h), all in this unit: a kernel set's
 * kernels on their own, the sets the tests name (the emulated amx set among
 * them) and the tile state they stand in for, the completeness of the tables,
 * the floating-point control flags each OpenMP thread runs with, and a switch
 * for flush-to-zero in the calling thread. */
#ifdef _OPENMP
#include <omp.h>
#endif

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testing.h"

sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n) {
    const kernel_table *kt = sdpa_kernel_table_named(name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    if (dtype == SDPA_FLOAT32) kt->f32.exp((float *)x, n);
    else if (dtype == SDPA_FLOAT64) kt->f64.exp((double *)x, n);
    else return SDPA_ERR_BAD_DTYPE;
    return SDPA_OK;
}

int sdpa_testing_panel_rows(const char *name, sdpa_dtype dtype) {
    const kernel_table *kt = sdpa_testing_table(name);
    if (!kt) return 0;
    return dtype == SDPA_FLOAT64 ? kt->f64.nr : kt->f32.nr;
}

/* n elements of size elem into 64-byte aligned memory (NULL: out of memory) */
static void *aligned_copy(const void *src, size_t n, size_t elem) {
    size_t bytes = (n * elem + 63) / 64 * 64;
    void *d = aligned_alloc(64, bytes ? bytes : 64);
    if (d && n) memcpy(d, src, n * elem);
    return d;
}

sdpa_status sdpa_testing_softmax(const char *name, sdpa_dtype dtype, int row, void *s, int n, void *row_max,
                                 void *row_sum, void *acc, int64_t ev) {
    const kernel_table *kt = sdpa_testing_table(name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    if (dtype != SDPA_FLOAT32 && dtype != SDPA_FLOAT64) return SDPA_ERR_BAD_DTYPE;
    const size_t elem = dtype == SDPA_FLOAT32 ? 4 : 8;
    const size_t nr = row == 1 ? 1 : (size_t)(dtype == SDPA_FLOAT64 ? kt->f64.nr : kt->f32.nr);
    if (row == 2 && dtype != SDPA_FLOAT32) return SDPA_ERR_BAD_DTYPE;
    void *bs = aligned_copy(s, (size_t)n * nr, elem), *bm = aligned_copy(row_max, nr, elem);
    void *bl = aligned_copy(row_sum, nr, elem), *ba = aligned_copy(acc, (size_t)ev * nr, elem);
    sdpa_status st = SDPA_ERR_NO_MEMORY;
    if (bs && bm && bl && ba) {
        if (dtype == SDPA_FLOAT32 && row == 2) {  /* online_softmax_pairs: P as pairs back into s's first rows */
            if (!kt->bf16_products) {
                st = SDPA_ERR_BAD_ISA;
                goto done;
            }
            uint32_t *pp = (uint32_t *)aligned_copy(bs, (size_t)n * nr, elem);
            if (!pp) goto done;
            kt->f32.bf16.online_softmax_pairs(bs, n, 1.0f, bm, bl, ba, ev, pp);
            memset(bs, 0, (size_t)n * nr * elem);
            memcpy(bs, pp, (size_t)((n + 1) / 2) * nr * 4);
            free(pp);
        } else if (dtype == SDPA_FLOAT32 && row) kt->f32.row_online_softmax_update(bs, n, bm, bl, ba, ev);
        else if (dtype == SDPA_FLOAT32) kt->f32.online_softmax_update(bs, n, bm, bl, ba, ev);
        else if (row) kt->f64.row_online_softmax_update(bs, n, bm, bl, ba, ev);
        else kt->f64.online_softmax_update(bs, n, bm, bl, ba, ev);
        memcpy(s, bs, (size_t)n * nr * elem);
        memcpy(row_max, bm, nr * elem);
        memcpy(row_sum, bl, nr * elem);
        memcpy(acc, ba, (size_t)ev * nr * elem);
        st = SDPA_OK;
    }
done:
    free(bs), free(bm), free(bl), free(ba);
    return st;
}

int sdpa_testing_have_amx_kernels(void) { return SDPA_HAVE_AMX_KERNELS; }

/* ---- the sets the tests name, and the tile state ---- */

const kernel_table *sdpa_testing_table(const char *name) {
    int tiles = 0;
    const kernel_table *kt = sdpa_dispatch_find(name, &tiles, 0);
#if SDPA_HAVE_X86_KERNELS
    if (kt && strcmp(name, sdpa_kernels_amx_emulated.name) == 0) return kt; /* its tiles are a model */
#endif
    return kt && tiles && !sdpa_dispatch_tiles_permitted() ? NULL : kt; /* tiles only once granted */
}

int sdpa_testing_table_complete(const char *name, int declared) {
    const kernel_table *kt = sdpa_dispatch_find(name, NULL, declared);
    return kt ? sdpa_table_is_complete(kt) : -1;
}

int sdpa_testing_tile_requests(void) { return sdpa_dispatch_tile_requests(); }

int sdpa_testing_ask_for_tiles(void) { return sdpa_dispatch_ask_for_tiles(); }

sdpa_status sdpa_testing_use_kernels(const char *name) {
#if SDPA_HAVE_X86_KERNELS
    if (name && strcmp(name, sdpa_kernels_amx_emulated.name) == 0) {
        const kernel_table *kt = sdpa_dispatch_find(name, NULL, 0);
        return kt ? sdpa_dispatch_use(kt, 1) : SDPA_ERR_BAD_ISA; /* its other kernels are avx512_bf16's */
    }
#endif
    return sdpa_set_isa(name);
}

sdpa_status sdpa_testing_stand_in(int mode, int as_default) {
#if SDPA_HAVE_X86_KERNELS
    if (mode == 0) {
        sdpa_dispatch_set_tile_state(0, 0); /* asked again when next needed */
        return SDPA_OK;
    }
    const kernel_table *kt = sdpa_dispatch_find(sdpa_kernels_amx_emulated.name, NULL, 0);
    if (!kt) return SDPA_ERR_BAD_ISA;
    sdpa_dispatch_set_tile_state(mode < 0 ? -1 : 0, 1);
    return sdpa_dispatch_use(kt, !as_default);
#else
    (void)as_default;
    return mode == 0 ? SDPA_OK : SDPA_ERR_BAD_ISA;
#endif
}

#if !SDPA_HAVE_X86_KERNELS
long sdpa_testing_amx_emulated_calls(void) { return 0; }
#endif

sdpa_status sdpa_testing_gemm_bf16(const char *name, int m, int64_t kpairs, const uint32_t *a, int64_t a_rs,
                                   int64_t a_ks, const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                                   int accumulate, long repeat) {
    const kernel_table *kt = sdpa_testing_table(name);
    if (!kt || !kt->bf16_products) return SDPA_ERR_BAD_ISA;
    /* as a task of the driver runs it: the set's tile state set up once around its products */
    kt->f32.bf16.tiles_begin();
    for (long r = 0; r < (repeat > 0 ? repeat : 1); r++)
        kt->f32.bf16.gemm_bf16(m, kpairs, a, a_rs, a_ks, b, ldb, c, ldc, accumulate);
    kt->f32.bf16.tiles_end();
    return SDPA_OK;
}

#if SDPA_HAVE_X86_KERNELS
#include <immintrin.h>
static int fp_flags_here(void) { return (int)(_mm_getcsr() & 0x8040u); }
int sdpa_set_flush_to_zero(int on) {
    _mm_setcsr(on ? _mm_getcsr() | 0x8040u : _mm_getcsr() & ~0x8040u);
    return 1;
}
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
static int fp_flags_here(void) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (int)((fpcr >> 24) & 1);
}
int sdpa_set_flush_to_zero(int on) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    fpcr = on ? fpcr | (1ull << 24) : fpcr & ~(1ull << 24);
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
    return 1;
}
#else
static int fp_flags_here(void) { return 0; }
int sdpa_set_flush_to_zero(int on) {
    (void)on;
    return 0;
}
#endif

void sdpa_fp_flags_in_threads(int num_threads, int *flags) {
    for (int i = 0; i < num_threads; i++) flags[i] = -1;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads)
    flags[omp_get_thread_num()] = fp_flags_here();
#else
    flags[0] = fp_flags_here();
#endif
}
