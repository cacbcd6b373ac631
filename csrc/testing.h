/* Hooks for the test suite only: not part of the C API. */
#ifndef SDPA_TESTING_H
#define SDPA_TESTING_H

#include "internal.h"

/* The exp kernel of the named set, in place (for the accuracy tests). */
sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n);

/* flags[i] = the FTZ/DAZ bits of MXCSR in OpenMP thread i (0 off x86; -1 for a
 * thread the runtime did not start). */
void sdpa_fp_flags_in_threads(int num_threads, int *flags);

/* Turns flush-to-zero and denormals-are-zero on or off in the calling thread
 * (x86 MXCSR FTZ + DAZ; AArch64 FPCR.FZ); returns 0 where there is no such mode. */
int sdpa_set_flush_to_zero(int on);

/* Forces the blocking of later calls (attention.c): query rows per task
 * (rounded up to the panel width), keys per tile, keys per row-mode chunk; 0
 * restores the rule for that one. */
void sdpa_testing_set_blocking(int tile_q, int tile_k, int chunk);

#endif
