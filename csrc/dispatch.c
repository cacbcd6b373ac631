/* Chooses the kernel table: the best level this CPU supports, decided once
 * (cpuid + xgetbv), unless SDPA_ISA names another or sdpa_set_isa switches. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if SDPA_HAVE_X86_KERNELS
#include <cpuid.h>

static unsigned long long read_xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

/* 0 = scalar, 1 = avx2 + fma, 2 = avx512 f/bw/dq/vl; OS support included. */
static int detect_level(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int has_fma = (c >> 12) & 1, has_osxsave = (c >> 27) & 1, has_avx = (c >> 28) & 1;
    if (!has_osxsave || !has_avx || !has_fma) return 0;
    unsigned long long xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) return 0;  /* the OS saves SSE and AVX state */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int has_avx2 = (b >> 5) & 1;
    if (!has_avx2) return 0;
    const int avx512 = ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);
    if (avx512 && (xcr0 & 0xE0) == 0xE0) return 2;  /* opmask and zmm state too */
    return 1;
}
#else
static int detect_level(void) { return 0; }
#endif

static const kernel_table *table_for_level(int level) {
#if SDPA_HAVE_X86_KERNELS
    if (level >= 2) return &sdpa_kernels_avx512;
    if (level == 1) return &sdpa_kernels_avx2;
#endif
    (void)level;
    return &sdpa_kernels_scalar;
}

static int level_of_name(const char *name) {
    if (!name) return -1;
    if (strcmp(name, "scalar") == 0) return 0;
    if (strcmp(name, "avx2") == 0) return 1;
    if (strcmp(name, "avx512") == 0) return 2;
    return -1;
}

static int cpu_level(void) {
    static volatile int cached = -1;  /* a benign race: every thread finds the same */
    int level = cached;
    if (level < 0) {
        level = detect_level();
        cached = level;
    }
    return level;
}

static const kernel_table *volatile chosen = NULL;

const kernel_table *sdpa_kernel_table(void) {
    const kernel_table *kt = chosen;
    if (!kt) {
        int level = cpu_level();
        int forced = level_of_name(getenv("SDPA_ISA"));
        if (forced >= 0 && forced < level) level = forced;  /* never above what the CPU has */
        kt = table_for_level(level);
        chosen = kt;
    }
    return kt;
}

int sdpa_isa_supported(const char *name) {
    int level = level_of_name(name);
    return level >= 0 && level <= cpu_level();  /* cpu_level is 0 without x86 kernels */
}

sdpa_status sdpa_set_isa(const char *name) {
    if (!sdpa_isa_supported(name)) return SDPA_ERR_BAD_ISA;
    chosen = table_for_level(level_of_name(name));
    return SDPA_OK;
}

const char *sdpa_isa(void) { return sdpa_kernel_table()->name; }

sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n) {
    if (!sdpa_isa_supported(name)) return SDPA_ERR_BAD_ISA;
    const kernel_table *kt = table_for_level(level_of_name(name));
    if (dtype == SDPA_FLOAT32) kt->f32.exp((float *)x, n);
    else if (dtype == SDPA_FLOAT64) kt->f64.exp((double *)x, n);
    else return SDPA_ERR_BAD_DTYPE;
    return SDPA_OK;
}

/* Floating-point control flags that change results (x86: MXCSR FTZ and DAZ),
 * as seen by each of num_threads OpenMP threads; for the tests that check that
 * a call leaves them as they were. */
#ifdef _OPENMP
#include <omp.h>
#endif
#if SDPA_HAVE_X86_KERNELS
#include <immintrin.h>
static int fp_flags_here(void) { return (int)(_mm_getcsr() & 0x8040u); }
#else
static int fp_flags_here(void) { return 0; }
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
