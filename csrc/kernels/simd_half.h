/* A set's panel kernels at half its width (kernel_table.f32_half / f64_half):
 * included after a vocabulary header (avx512_f32.h, ...) in place of
 * simd_impl.h, with SIMD_HALF_SUF (the kernels' suffix) and SIMD_HALF_NV
 * (half the vocabulary's NV) defined; builds simd_impl.h's panel kernels alone
 * (SIMD_PANELS_ONLY) at that width, then undoes the vocabulary as simd_end.h
 * does. */
#undef SUF
#undef NV
#define SUF SIMD_HALF_SUF
#define NV SIMD_HALF_NV
#define SIMD_PANELS_ONLY
#include "simd_impl.h"
#undef SIMD_PANELS_ONLY
#include "simd_end.h"
#undef SIMD_HALF_SUF
#undef SIMD_HALF_NV
