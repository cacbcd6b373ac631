/* The vector vocabulary of simd_impl.h for AVX2 + FMA double:
 * panels of 8 query rows (2 vectors), 6 x 2 accumulators.
 * Included inside the ISA's target region; simd_end.h undoes it. */
#define T double
#define SUF avx2_f64
#define V __m256d
#define LANES 4
#define NV 2
#define MR 6
#define V_ZERO() _mm256_setzero_pd()
#define V_SET1(x) _mm256_set1_pd(x)
#define V_LOAD(p) _mm256_load_pd(p)
#define V_STORE(p, v) _mm256_store_pd(p, v)
#define V_ADD _mm256_add_pd
#define V_SUB _mm256_sub_pd
#define V_MUL _mm256_mul_pd
#define V_DIV _mm256_div_pd
#define V_FMA _mm256_fmadd_pd
#define V_MAX_NAN max_nan_pd
#define V_NEGINF_TO_ZERO neginf_to_zero_pd
#define V_EXP exp_avx2_pd
#define V_LOADU(p) _mm256_loadu_pd(p)
#define V_STOREU(p, v) _mm256_storeu_pd(p, v)
#define V_HSUM hsum_pd
#define V_HSUM_LANES hsum_lanes_pd
#define V_HMAX_NAN hmax_nan_pd
#define S_EXP sdpa_exp_cut_f64
#define RESCALE sdpa_rescale_f64
