/* The vector vocabulary of simd_impl.h for AVX2 + FMA float:
 * panels of 16 query rows (2 vectors), 6 x 2 accumulators.
 * Included inside the ISA's target region; simd_end.h undoes it. */
#define T float
#define SUF avx2_f32
#define V __m256
#define LANES 8
#define NV 2
#define MR 6
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(x) _mm256_set1_ps(x)
#define V_LOAD(p) _mm256_load_ps(p)
#define V_STORE(p, v) _mm256_store_ps(p, v)
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_DIV _mm256_div_ps
#define V_FMA _mm256_fmadd_ps
#define V_MAX_NAN max_nan_ps
#define V_NEGINF_TO_ZERO neginf_to_zero_ps
#define V_EXP exp_avx2_ps
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_STOREU(p, v) _mm256_storeu_ps(p, v)
#define V_HSUM hsum_ps
#define V_HSUM_LANES hsum_lanes_ps
#define V_HMAX_NAN hmax_nan_ps
#define S_EXP sdpa_exp_cut_f32
#define RESCALE sdpa_rescale_f32
#define V_TRANSPOSE transpose8_ps
#define V_BOOL_TO_NEGINF bool8_to_neginf_ps
#define V_STORE_NEGINF_WHERE(p, t) _mm256_store_ps(p, neginf_where_ps(t, _mm256_load_ps(p)))
#define V_LOADU_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define V_LOADU_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_LOADU_E4M3(p) load_e4m3_ps(p)
#define V_LOADU_E5M2(p) load_e5m2_ps(p)
#define V_LOADU_I4(p) load_i4_ps(p)
#define V_LOADU_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define V_STOREU_BF16(p, v) _mm_storeu_si128((__m128i *)(p), f32_to_bf16_avx2(v))
#define V_STOREU_F16(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
