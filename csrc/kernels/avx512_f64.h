/* The vector vocabulary of simd_impl.h for AVX-512 double:
 * panels of 16 query rows (2 vectors), 8 x 2 accumulators.
 * Included inside the ISA's target region; simd_end.h undoes it. */
#define T double
#define SUF avx512_f64
#define V __m512d
#define LANES 8
#define NV 2
#define MR 8
#define V_ZERO() _mm512_setzero_pd()
#define V_SET1(x) _mm512_set1_pd(x)
#define V_LOAD(p) _mm512_load_pd(p)
#define V_STORE(p, v) _mm512_store_pd(p, v)
#define V_ADD _mm512_add_pd
#define V_SUB _mm512_sub_pd
#define V_MUL _mm512_mul_pd
#define V_DIV _mm512_div_pd
#define V_FMA _mm512_fmadd_pd
#define V_MAX_NAN max_nan_pd
#define V_NEGINF_TO_ZERO neginf_to_zero_pd
#define V_EXP exp_avx512_pd
#define V_LOADU(p) _mm512_loadu_pd(p)
#define V_STOREU(p, v) _mm512_storeu_pd(p, v)
#define V_HSUM _mm512_reduce_add_pd
#define V_HSUM_LANES hsum_lanes_pd
#define V_HMAX_NAN hmax_nan_pd
#define S_EXP sdpa_exp_cut_f64
#define RESCALE sdpa_rescale_f64
