/* The vector vocabulary of simd_impl.h for AArch64 Advanced SIMD double:
 * panels of 8 query rows (4 vectors of 2), 6 x 4 accumulators.
 * Included inside the set's target region; simd_end.h undoes it. */
#define T double
#define SUF neon_f64
#define V float64x2_t
#define LANES 2
#define NV 4
#define MR 6
#define V_ZERO() vdupq_n_f64(0.0)
#define V_SET1(x) vdupq_n_f64(x)
#define V_LOAD(p) vld1q_f64(p)
#define V_STORE(p, v) vst1q_f64(p, v)
#define V_ADD vaddq_f64
#define V_SUB vsubq_f64
#define V_MUL vmulq_f64
#define V_DIV vdivq_f64
#define V_FMA(a, b, c) vfmaq_f64(c, a, b)
#define V_MAX_NAN vmaxq_f64
#define V_NEGINF_TO_ZERO neginf_to_zero_pd
#define V_EXP exp_neon_pd
#define V_LOADU(p) vld1q_f64(p)
#define V_STOREU(p, v) vst1q_f64(p, v)
#define V_HSUM hsum_pd
#define V_HSUM_LANES hsum_lanes_pd
#define V_HMAX_NAN hmax_nan_pd
#define S_EXP sdpa_exp_cut_f64
#define RESCALE sdpa_rescale_f64
