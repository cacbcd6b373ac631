/*
 * The worked example of the attention tutorial, computed through the C API.
 *
 *   Q = K = [[1, 0],     V = [[2, 3],     d_k = 2, scale = 1/sqrt(2)
 *            [0, 1]]          [4, 5]]
 *
 * The scaled scores are Q K^T / sqrt(2) = [[0.707, 0], [0, 0.707]]; their row
 * softmax gives the weights [[0.67, 0.33], [0.33, 0.67]] and the output is
 * weights x V = [[2.66, 3.66], [3.34, 4.34]].
 *
 * Prints the weights and the output to two decimals and exits with status 1
 * if they do not round to those values.
 *
 *   cc seed_example.c -I csrc/include -L build -lsdpa -lm -o seed_example
 */
#include <math.h>
#include <stdio.h>

#include "sdpa.h"

#define N 2 /* query rows = key rows = d_k = d_v */

/* A view of a row-major N x N matrix: element (r, c) is data[r * N + c].
 * There are no batch dimensions and a single head, so the batch and head
 * strides are never used and stay 0. */
static sdpa_view matrix_view(float *data) {
    sdpa_view v = {0};
    v.data = data;
    v.row_stride = N; /* strides count elements, not bytes */
    v.col_stride = 1;
    return v;
}

static int print_and_check(const char *name, const float m[N][N], const double expected[N][N]) {
    int ok = 1;
    printf("%s:\n", name);
    for (int r = 0; r < N; r++) {
        printf("  [");
        for (int c = 0; c < N; c++) {
            printf("%s%.2f", c ? ", " : "", m[r][c]);
            /* compare the values rounded to two decimals */
            if (lround(m[r][c] * 100.0) != lround(expected[r][c] * 100.0)) ok = 0;
        }
        printf("]\n");
    }
    return ok;
}

int main(void) {
    float q[N][N] = {{1, 0}, {0, 1}};
    float k[N][N] = {{1, 0}, {0, 1}};
    float v[N][N] = {{2, 3}, {4, 5}};
    float out[N][N], weights[N][N];

    /* Start from an empty problem: no mask, no weights, gqa_group 1, scale 1. */
    sdpa_problem p;
    sdpa_problem_init(&p);

    /* Sizes: one head, L = S = 2 rows, E = Ev = 2 columns. */
    p.dtype = SDPA_FLOAT32;
    p.num_batch_dims = 0;
    p.num_heads = 1;
    p.len_q = N;
    p.len_kv = N;
    p.head_dim = N;
    p.head_dim_v = N;
    p.scale = 1.0 / sqrt((double)N); /* 1 / sqrt(d_k) */

    /* Operands and outputs, all row-major 2 x 2 matrices. */
    p.query = matrix_view(&q[0][0]);
    p.key = matrix_view(&k[0][0]);
    p.value = matrix_view(&v[0][0]);
    p.out = matrix_view(&out[0][0]);
    p.weights = matrix_view(&weights[0][0]); /* optional: leave data NULL to skip */

    p.num_threads = 1; /* a 2 x 2 problem gains nothing from threads */

    sdpa_status st = sdpa_attention(&p);
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_attention failed: %s\n", sdpa_status_message(st));
        return 1;
    }

    static const double expected_weights[N][N] = {{0.67, 0.33}, {0.33, 0.67}};
    static const double expected_out[N][N] = {{2.66, 3.66}, {3.34, 4.34}};
    printf("sdpa %s, kernels: %s\n", sdpa_version(), sdpa_isa());
    int ok = print_and_check("weights", (const float(*)[N])weights, expected_weights);
    ok &= print_and_check("output", (const float(*)[N])out, expected_out);
    if (!ok) {
        fprintf(stderr, "mismatch with the worked example\n");
        return 1;
    }
    printf("matches the worked example\n");
    return 0;
}
