/* Portable C kernels: plain loops the compiler can vectorize for the baseline
 * target.  They define the contracts in internal.h for every other set, and
 * fill in whatever another set does not have (sdpa_complete_table). */
#include <float.h>
#include <math.h>

#include "../convert.h"
#include "../internal.h"

#define SCALAR_NR 16

#define T float
#define SUF f32
#define EXP sdpa_exp_cut_f32
#define RESCALE sdpa_rescale_f32
#include "scalar_impl.h"
#undef T
#undef SUF
#undef EXP
#undef RESCALE

#define T double
#define SUF f64
#define EXP sdpa_exp_cut_f64
#define RESCALE sdpa_rescale_f64
#include "scalar_impl.h"
#undef T
#undef SUF
#undef EXP
#undef RESCALE

/* the SIMD sets' widening tails */
void sdpa_widen_portable(sdpa_dtype dt, const uint16_t *src, float *dst, int64_t n) { widen_f32(dt, src, dst, n); }

/* integer_pv's products (internal.h), the reference: exact int32 sums */
#define PV_QI_NAME sdpa_pv_qi_portable
#include "pv_qi_impl.h"
#undef PV_QI_NAME

/* dropout's bits (internal.h) */
#define PHILOX_NAME dropout_bits_portable
#include "philox_impl.h"
#undef PHILOX_NAME

/* the bfloat16 products' state around a task: none without tiles */
static void tiles_none(void) {}

#define PORTABLE(suf)                                                                                          \
    .nr = SCALAR_NR, .widen = widen_##suf, .gemm = gemm_##suf, .online_softmax_update = online_softmax_update_##suf, \
    .exp = exp_##suf, .softcap = softcap_##suf, .dot = dot_##suf, .pv_rows = pv_rows_##suf,                    \
    .row_online_softmax_update = row_online_softmax_update_##suf, .dot_half = dot_half_##suf,                  \
    .pv_rows_half = pv_rows_half_##suf, .dot_q = dot_q_##suf, .pv_rows_q = pv_rows_q_##suf,                \
    .dot_q_grouped = dot_q_grouped_##suf, .pv_rows_q_grouped = pv_rows_q_grouped_##suf, .dot_qi = dot_qi_##suf,                    \
    .mask_add = mask_add_##suf, .mask_bool = mask_bool_##suf, .pack_q = pack_q_##suf,                          \
    .store_rows = store_rows_##suf, .pack_q_half = pack_q_half_##suf, .store_rows_half = store_rows_half_##suf, \
    .scale_copy = scale_copy_##suf, .scale_copy_d = scale_copy_d_##suf, .bwd_probs = bwd_probs_##suf,          \
    .bwd_dscores = bwd_dscores_##suf

/* Every entry but the bfloat16 products: what completes every other set's table. */
const kernel_table sdpa_kernels_scalar = {
    .name = "scalar",
    .features = 0,
    .dropout_bits = dropout_bits_portable,
    .f32 = {PORTABLE(f32), .bf16 = {.tiles_begin = tiles_none, .tiles_end = tiles_none}},
    .f64 = {PORTABLE(f64)},
};
