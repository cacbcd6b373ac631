/* The vector vocabulary of simd_impl.h for AArch64 Advanced SIMD float:
 * panels of 16 query rows (4 vectors of 4), 6 x 4 accumulators (24 of the
 * 32 vector registers, 4 for the panel row and 1 for the broadcast).
 * Included inside the set's target region; simd_end.h undoes it. */
#define T float
#define SUF neon_f32
#define V float32x4_t
#define LANES 4
#define NV 4
#define MR 6
#define V_ZERO() vdupq_n_f32(0.0f)
#define V_SET1(x) vdupq_n_f32(x)
#define V_LOAD(p) vld1q_f32(p)
#define V_STORE(p, v) vst1q_f32(p, v)
#define V_ADD vaddq_f32
#define V_SUB vsubq_f32
#define V_MUL vmulq_f32
#define V_DIV vdivq_f32
#define V_FMA(a, b, c) vfmaq_f32(c, a, b)
#define V_MAX_NAN vmaxq_f32 /* FMAX: NaN when either operand is */
#define V_NEGINF_TO_ZERO neginf_to_zero_ps
#define V_EXP exp_neon_ps
#define V_LOADU(p) vld1q_f32(p)
#define V_STOREU(p, v) vst1q_f32(p, v)
#define V_HSUM hsum_ps
#define V_HSUM_LANES hsum_lanes_ps
#define V_HMAX_NAN hmax_nan_ps
#define S_EXP sdpa_exp_cut_f32
#define RESCALE sdpa_rescale_f32
#define V_TRANSPOSE transpose4_ps
#define V_BOOL_TO_NEGINF bool_to_neginf_ps
#define V_STORE_NEGINF_WHERE(p, t) vst1q_f32(p, vbslq_f32(vceqq_f32(t, vdupq_n_f32(-INFINITY)), t, vld1q_f32(p)))
#define V_LOADU_BF16(p) load_bf16_ps(p)
#define V_LOADU_F16(p) load_f16_ps(p)
#define V_LOADU_I8(p) load_i8_ps(p)
#define V_LOADU_E4M3(p) load_e4m3_ps(p)
#define V_LOADU_E5M2(p) load_e5m2_ps(p)
#define V_LOADU_I4(p) load_i4_ps(p)
#define V_LOAD16_I8(p, o) load16_i8_ps(p, o)
#define V_LOAD16_E4M3(p, o) load16_e4m3_ps(p, o)
#define V_LOAD16_E5M2(p, o) load16_e5m2_ps(p, o)
#define V_LOAD16_I4(p, o) load16_i4_ps(p, o)
#define V_STOREU_BF16(p, v) store_bf16_ps(p, v)
#define V_STOREU_F16(p, v) store_f16_ps(p, v)
