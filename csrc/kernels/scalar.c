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

/* integer_pv's scale of one row and group (internal.h) from its largest
 * weight and whether one is NaN. */
static float pv_scale(float mx, int nan) { return nan ? NAN : mx / 255.0f >= FLT_MIN ? mx / 255.0f : 0.0f; }

/* integer_pv's products (internal.h), the reference: exact int32 sums */
int sdpa_pv_qi_portable(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const float *p, int64_t ldp,
                        const float *vs, const uint8_t *const *rows, float *acc, int64_t ldacc, void *work) {
    if ((dt != SDPA_INT8 && dt != SDPA_INT4) || g <= 0 || ev % g || n > SDPA_PV_KEYS) return 0;
    const int64_t ng = ev / g;
    int32_t *sum = (int32_t *)work;
    float *scale = (float *)(sum + ev);  /* [ng] */
    uint8_t *u = (uint8_t *)(scale + ng);  /* [ng][SDPA_PV_KEYS] */
    float w[SDPA_PV_KEYS];
    for (int x = 0; x < m; x++) {
        for (int64_t i = 0; i < ng; i++) {
            float mx = 0;
            int nan = 0;
            for (int j = 0; j < n; j++) {
                w[j] = p[x * ldp + j] * vs[i * SDPA_PV_KEYS + j];
                mx = w[j] > mx ? w[j] : mx;
                nan |= w[j] != w[j];
            }
            const float sc = scale[i] = pv_scale(mx, nan), inv = sc > 0 ? 1.0f / sc : 0.0f;
            for (int j = 0; j < n; j++) {
                const float r = w[j] * inv + 0.5f;
                u[i * SDPA_PV_KEYS + j] = (uint8_t)(int)(r < 255.0f ? r : 255.0f);
            }
        }
        for (int64_t c = 0; c < ev; c++) sum[c] = 0;
        for (int j = 0; j < n; j++) {
            const uint8_t *vj = rows[j];
            for (int64_t c = 0; c < ev; c++) {
                const int32_t val = dt == SDPA_INT8 ? (int32_t)(int8_t)vj[c]
                                                    : (int32_t)((vj[c >> 1] >> ((c & 1) * 4)) & 15u) - 8;
                sum[c] += (int32_t)u[(c / g) * SDPA_PV_KEYS + j] * val;
            }
        }
        float *ax = acc + x * ldacc;
        for (int64_t c = 0; c < ev; c++) ax[c] = ax[c] + (float)sum[c] * scale[c / g];
    }
    return 1;
}

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
    .scale_copy = scale_copy_##suf, .scale_copy_d = scale_copy_d_##suf

/* Every entry but the bfloat16 products: what completes every other set's table. */
const kernel_table sdpa_kernels_scalar = {
    .name = "scalar",
    .features = 0,
    .f32 = {PORTABLE(f32), .bf16 = {.tiles_begin = tiles_none, .tiles_end = tiles_none}},
    .f64 = {PORTABLE(f64)},
};
