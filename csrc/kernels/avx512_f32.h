/* The vector vocabulary of simd_impl.h for AVX-512 float:
 * panels of 32 query rows (2 vectors), 8 x 2 accumulators.
 * Included inside the ISA's target region; simd_end.h undoes it. */
#define T float
#define SUF avx512_f32
#define V __m512
#define LANES 16
#define NV 2
#define MR 8
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(x) _mm512_set1_ps(x)
#define V_LOAD(p) _mm512_load_ps(p)
#define V_STORE(p, v) _mm512_store_ps(p, v)
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_DIV _mm512_div_ps
#define V_FMA _mm512_fmadd_ps
#define V_MAX_NAN max_nan_ps
#define V_NEGINF_TO_ZERO neginf_to_zero_ps
#define V_EXP exp_avx512_ps
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_STOREU(p, v) _mm512_storeu_ps(p, v)
#define V_HSUM _mm512_reduce_add_ps
#define V_HSUM_LANES hsum_lanes_ps
#define V_HSUM4 hsum4_ps
#define V_HMAX_NAN hmax_nan_ps
#define S_EXP sdpa_exp_cut_f32
#define RESCALE sdpa_rescale_f32
#define V_TRANSPOSE transpose16_ps
#define V_BOOL_TO_NEGINF bool_to_neginf_ps
#define V_STORE_NEGINF_WHERE(p, t) \
    _mm512_mask_store_ps(p, _mm512_cmp_ps_mask(t, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), t)
#define V_LOADU_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define V_LOADU_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LOADU_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define V_LOADU_E4M3(p) load_e4m3_ps(p)
#define V_LOADU_E5M2(p) load_e5m2_ps(p)
#define V_LOADU_I4(p) load_i4_ps(p)
#define V_STOREU_BF16(p, v) _mm256_storeu_si256((__m256i *)(p), f32_to_bf16_avx512(v))
#define V_STOREU_F16(p, v) \
    _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
