/* Portable C kernels: plain loops the compiler can vectorize for the baseline
 * target.  They define the contracts in internal.h for every other level. */
#include <math.h>

#include "../convert.h"
#include "../internal.h"

void sdpa_widen_portable(sdpa_dtype dt, const uint16_t *src, float *dst, int64_t n) {
    if (dt == SDPA_BFLOAT16)
        for (int64_t i = 0; i < n; i++) dst[i] = sdpa_bf16_to_f32(src[i]);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = sdpa_f16_to_f32(src[i]);
}

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

const kernel_table sdpa_kernels_scalar = {
    .name = "scalar",
    .f32 = {.nr = SCALAR_NR, .widen = sdpa_widen_portable,
            .gemm = gemm_f32, .softmax = softmax_f32, .exp = exp_f32, .softcap = softcap_f32,
            .dot = dot_f32, .pv_rows = pv_rows_f32, .row_softmax = row_softmax_f32},
    .f64 = {.nr = SCALAR_NR,
            .gemm = gemm_f64, .softmax = softmax_f64, .exp = exp_f64, .softcap = softcap_f64,
            .dot = dot_f64, .pv_rows = pv_rows_f64, .row_softmax = row_softmax_f64},
};
