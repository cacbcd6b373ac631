/* The vector vocabulary of simd_impl.h's panel kernels for AVX-512 float at a
 * quarter of the set's width: panels of 8 query rows, one 256-bit vector,
 * 8 x 1 accumulators.  It is avx2_f32.h's vocabulary with AVX-512's
 * operations (VL forms) where the two sets differ: exp_avx512_ps256 is
 * exp_avx512_ps's sequence, so a row's bits do not depend on the panel it
 * lands in (the bfloat16 rounding and the transposes move bits alone).  Built
 * with SIMD_PANELS_ONLY; included inside the ISA's target region after
 * ymm_f32.h; simd_end.h undoes it. */
#include "avx2_f32.h"
#undef SUF
#undef NV
#undef MR
#undef V_MAX_NAN
#undef V_NEGINF_TO_ZERO
#undef V_EXP
#undef V_STORE_NEGINF_WHERE
#define SUF avx512_f32q
#define NV 1
#define MR 8
#define V_MAX_NAN max_nan_ps256
#define V_NEGINF_TO_ZERO neginf_to_zero_ps256
#define V_EXP exp_avx512_ps256
#define V_STORE_NEGINF_WHERE(p, t) \
    _mm256_mask_store_ps(p, _mm256_cmp_ps_mask(t, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), t)
