/* Portable C kernels: plain loops the compiler can vectorize for the baseline
 * target.  They define the contracts in internal.h for every other level. */
#include <math.h>

#include "../internal.h"

#define SCALAR_NR 16

#define T float
#define SUF f32
#define EXP expf
#include "scalar_impl.h"
#undef T
#undef SUF
#undef EXP

#define T double
#define SUF f64
#define EXP exp
#include "scalar_impl.h"
#undef T
#undef SUF
#undef EXP

const kernel_table sdpa_kernels_scalar = {
    "scalar",
    SCALAR_NR, 64, 64,
    SCALAR_NR, 64, 64,
    {gemm_f32, softmax_f32, exp_f32, dot_f32, pv_rows_f32, row_softmax_f32},
    {gemm_f64, softmax_f64, exp_f64, dot_f64, pv_rows_f64, row_softmax_f64},
};
