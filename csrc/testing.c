/* Hooks for the test suite (testing.h): a kernel set's exp on its own, and the
 * floating-point control flags each OpenMP thread runs with. */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "testing.h"

sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n) {
    const kernel_table *kt = sdpa_kernel_table_named(name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    if (dtype == SDPA_FLOAT32) kt->f32.exp((float *)x, n);
    else if (dtype == SDPA_FLOAT64) kt->f64.exp((double *)x, n);
    else return SDPA_ERR_BAD_DTYPE;
    return SDPA_OK;
}

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
