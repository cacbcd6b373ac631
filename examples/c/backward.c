/*
 * The backward pass through the C API: a causal attention of 2 heads sharing
 * one key/value head (GQA), L = S = 5, E = 4, Ev = 3, in double precision;
 * the forward keeps each row's lse, then sdpa_attention_backward gives the
 * gradients of the loss  sum(G o out)  for a fixed G.  Each gradient is
 * checked against central differences of that loss (sdpa_attention again,
 * each input moved by +-h); then the same with dropout (p = 0.25, a seed:
 * the backward draws the forward's mask again).  Exits with status 1 on a
 * mismatch.
 *
 *   cc backward.c -I csrc/include -L build -lsdpa -lm -o backward
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "sdpa.h"

enum { H = 2, L = 5, S = 5, E = 4, EV = 3 };

static double q[H][L][E], k[S][E], v[S][EV], g[H][L][EV], out[H][L][EV], lse[H][L];
static double dq[H][L][E], dk[S][E], dv[S][EV];

/* A view of row-major rows of `cols` elements, heads `rows * cols` apart. */
static sdpa_view view_of(void *data, int64_t rows, int64_t cols) {
    sdpa_view view = {0};
    view.data = data;
    view.head_stride = rows * cols;
    view.row_stride = cols;
    view.col_stride = 1;
    return view;
}

static void describe(sdpa_problem *p, double dropout_p) {
    sdpa_problem_init(p);
    p->dtype = SDPA_FLOAT64;
    p->num_heads = H;
    p->gqa_group = H; /* both query heads read the one key/value head */
    p->len_q = L;
    p->len_kv = S;
    p->head_dim = E;
    p->head_dim_v = EV;
    p->scale = 0.5;
    p->causal = 1;
    p->query = view_of(q, L, E);
    p->key = view_of(k, S, E);
    p->value = view_of(v, S, EV);
    p->out = view_of(out, L, EV);
    p->lse = view_of(lse, L, 1);
    p->num_threads = 1;
    p->dropout_p = dropout_p;
    p->dropout_seed = 2024;
}

/* sum(G o out) of the forward as the operands are now */
static double loss(double dropout_p) {
    sdpa_problem p;
    describe(&p, dropout_p);
    if (sdpa_attention(&p) != SDPA_OK) return NAN;
    double sum = 0;
    for (int h = 0; h < H; h++)
        for (int l = 0; l < L; l++)
            for (int c = 0; c < EV; c++) sum += g[h][l][c] * out[h][l][c];
    return sum;
}

/* The gradient of `loss` in each element of x, by central differences,
 * against the analytic one: the largest difference. */
static double check(double *x, const double *grad, int n, double dropout_p) {
    const double step = 1e-6;
    double worst = 0;
    for (int i = 0; i < n; i++) {
        const double keep = x[i];
        x[i] = keep + step;
        const double up = loss(dropout_p);
        x[i] = keep - step;
        const double down = loss(dropout_p);
        x[i] = keep;
        const double diff = fabs((up - down) / (2 * step) - grad[i]);
        if (!(diff <= worst)) worst = diff; /* NaN too */
    }
    return worst;
}

static int run(double dropout_p) {
    sdpa_problem p;
    describe(&p, dropout_p);
    sdpa_status st = sdpa_attention(&p); /* out and lse */
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_attention: %s\n", sdpa_status_message(st));
        return 0;
    }
    sdpa_grads grads;
    sdpa_grads_init(&grads);
    grads.grad_out = view_of(g, L, EV);
    grads.grad_query = view_of(dq, L, E);
    grads.grad_key = view_of(dk, S, E);
    grads.grad_value = view_of(dv, S, EV);
    st = sdpa_attention_backward(&p, &grads);
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_attention_backward: %s\n", sdpa_status_message(st));
        return 0;
    }
    const double eq = check(&q[0][0][0], &dq[0][0][0], H * L * E, dropout_p);
    const double ek = check(&k[0][0], &dk[0][0], S * E, dropout_p);
    const double ev = check(&v[0][0], &dv[0][0], S * EV, dropout_p);
    printf("dropout %.2f: largest difference from central differences: dQ %.1e, dK %.1e, dV %.1e\n", dropout_p,
           eq, ek, ev);
    return eq < 1e-7 && ek < 1e-7 && ev < 1e-7;
}

int main(void) {
    /* fixed, varied values */
    for (int h = 0; h < H; h++)
        for (int l = 0; l < L; l++) {
            for (int c = 0; c < E; c++) q[h][l][c] = sin(1.0 + h + 0.7 * l + 1.3 * c);
            for (int c = 0; c < EV; c++) g[h][l][c] = cos(0.5 * h + 0.9 * l + 0.4 * c);
        }
    for (int s = 0; s < S; s++) {
        for (int c = 0; c < E; c++) k[s][c] = cos(0.3 + 1.1 * s + 0.6 * c);
        for (int c = 0; c < EV; c++) v[s][c] = sin(2.0 + 0.8 * s - 0.5 * c);
    }
    printf("sdpa %s, kernels: %s\n", sdpa_version(), sdpa_isa());
    const int ok = run(0.0) && run(0.25);
    if (!ok) {
        fprintf(stderr, "the gradients do not match the central differences\n");
        return 1;
    }
    printf("the gradients match\n");
    return 0;
}
