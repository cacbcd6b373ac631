/*
 * sdpa_attention_backward: the gradients of a dense attention call
 * (backward_impl.h has the loop).  The forward's rules are sdpa_validate's;
 * this file adds the backward's own: which variants it takes and its views.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "internal.h"
#include "kv_source.h"
#include "plan.h"
#include "problem.h"

/* the operands' rows are read without scales (float keys and values) */
static const kv_scales no_scales = {0};

#define T float
#define TDT SDPA_FLOAT32
#define SUF f32
#define KT kernels_f32
#define EXP sdpa_exp_cut_f32
#define HAS_BF16 1
#include "backward_impl.h"
#undef HAS_BF16
#undef T
#undef TDT
#undef SUF
#undef KT
#undef EXP

#define T double
#define TDT SDPA_FLOAT64
#define SUF f64
#define KT kernels_f64
#define EXP sdpa_exp_cut_f64
#define HAS_BF16 0
#include "backward_impl.h"
#undef HAS_BF16
#undef T
#undef TDT
#undef SUF
#undef KT
#undef EXP

void sdpa_grads_init_sized(sdpa_grads *g, size_t struct_size) {
    if (!g) return;
    if (struct_size != sizeof(*g)) {
        if (struct_size >= sizeof(size_t)) g->struct_size = struct_size;
        return;
    }
    memset(g, 0, sizeof(*g));
    g->struct_size = sizeof(*g);
}

#define REFUSE(status, name)           \
    do {                               \
        if (field) *field = (name);    \
        return (status);               \
    } while (0)

/* A written view that broadcasts (a zero stride over more than one element). */
static int broadcasts(const sdpa_problem *p, const sdpa_view *v, int64_t heads, int64_t rows, int64_t cols) {
    for (int d = 0; d < p->num_batch_dims; d++)
        if (p->batch_shape[d] > 1 && v->batch_strides[d] == 0) return 1;
    return (heads > 1 && v->head_stride == 0) || (rows > 1 && v->row_stride == 0) ||
           (cols > 1 && v->col_stride == 0);
}

sdpa_status sdpa_check_backward(const sdpa_problem *p, const sdpa_grads *g, const char **field) {
    if (field) *field = NULL;
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) REFUSE(SDPA_ERR_ABI, "struct_size");
    if (!g) REFUSE(SDPA_ERR_NULL_POINTER, "grads");
    if (g->struct_size != sizeof(*g)) REFUSE(SDPA_ERR_ABI, "grads");
    sdpa_status st = sdpa_check(p, field);
    if (st != SDPA_OK) return st;
    st = dense_only(p, field);
    if (st != SDPA_OK) return st;
    int64_t count = 1;
    for (int d = 0; d < p->num_batch_dims; d++) count *= p->batch_shape[d];
    const int64_t hkv = p->num_heads / p->gqa_group;
    const int64_t L = p->len_q, S = p->len_kv, E = p->head_dim, Ev = p->head_dim_v;
    if (count * p->num_heads * L > 0) {
        if (!p->lse.data) REFUSE(SDPA_ERR_NULL_POINTER, "lse");
        if (Ev > 0 && !g->grad_out.data) REFUSE(SDPA_ERR_NULL_POINTER, "grad_out");
        if (E > 0 && !g->grad_query.data) REFUSE(SDPA_ERR_NULL_POINTER, "grad_query");
    }
    if (count * hkv * S > 0) {
        if (E > 0 && !g->grad_key.data) REFUSE(SDPA_ERR_NULL_POINTER, "grad_key");
        if (Ev > 0 && !g->grad_value.data) REFUSE(SDPA_ERR_NULL_POINTER, "grad_value");
    }
    if (broadcasts(p, &g->grad_query, p->num_heads, L, E)) REFUSE(SDPA_ERR_BAD_SHAPE, "grad_query");
    if (broadcasts(p, &g->grad_key, hkv, S, E)) REFUSE(SDPA_ERR_BAD_SHAPE, "grad_key");
    if (broadcasts(p, &g->grad_value, hkv, S, Ev)) REFUSE(SDPA_ERR_BAD_SHAPE, "grad_value");
    if (g->grad_sinks.data && broadcasts(p, &g->grad_sinks, p->num_heads, 1, 1))
        REFUSE(SDPA_ERR_BAD_SHAPE, "grad_sinks");
    return SDPA_OK;
}

#undef REFUSE

sdpa_status sdpa_attention_backward(const sdpa_problem *p, const sdpa_grads *g) {
    sdpa_status st = sdpa_check_backward(p, g, NULL);
    if (st != SDPA_OK) return st;
    int by_name = 0;
    const kernel_table *kt = sdpa_kernel_choice(&by_name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    int64_t count = 1;
    for (int d = 0; d < p->num_batch_dims; d++) count *= p->batch_shape[d];
    if (count * p->num_heads == 0) return SDPA_OK;
    return p->dtype == SDPA_FLOAT64 ? bwd_run_f64(p, g, kt, &kt->f64, count) : bwd_run_f32(p, g, kt, &kt->f32, count);
}

sdpa_status sdpa_dropout_call(const sdpa_problem *p, int64_t batch_count) {
    int by_name = 0;
    const kernel_table *kt = sdpa_kernel_choice(&by_name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    return p->dtype == SDPA_FLOAT64 ? drop_run_f64(p, kt, &kt->f64, batch_count)
                                    : drop_run_f32(p, kt, &kt->f32, batch_count);
}
