/*
 * One decoding step over an int8 key/value cache, through the C API.
 *
 * A cache of B = 1 sequence, 2 key/value heads, S = 1000 positions and
 * E = 64 features is filled with pseudo-random floats in [-1, 1) and
 * quantized with sdpa_quantize_int8: one float32 scale per position and head,
 * then one per group of 16 features.  4 query heads (grouped-query attention,
 * 2 per key/value head) attend it for one new token (L = 1), the int8 cache
 * read in place (kv_dtype SDPA_INT8).
 *
 * The output is compared with
 *   - a double-precision loop over the dequantized cache (each element
 *     (float)q * scale, as the kernels see it): they differ by float32
 *     rounding only, so beyond 1e-5 is a failure;
 *   - the same attention through sdpa over the float32 cache: they differ by
 *     the quantization (at most half a step, max|x| / 254, per element), so
 *     beyond 1e-2 is a failure.
 * Prints the largest differences and exits with status 1 on a failure.
 *
 *   cc -std=c11 int8_decode.c -I csrc/include -L build -lsdpa -lm -o int8_decode
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "sdpa.h"

#define B 1     /* sequences                     */
#define HKV 2   /* key/value heads               */
#define HQ 4    /* query heads: 2 per k/v head   */
#define S 1000  /* cached positions              */
#define E 64    /* features of a key and a value */

#define TOL_DEQUANTIZED 1e-5 /* against the loop over the dequantized cache */
#define TOL_FLOAT 1e-2       /* against attention over the float32 cache    */

/* Pseudo-random floats in [-1, 1): a linear congruential generator, so that
 * every run and every platform sees the same numbers. */
static float next_uniform(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / 8388608.0f - 1.0f; /* 24 bits over 2^23 */
}

/* A dense row-major (B, H, rows, cols) array of any element type. */
static sdpa_view dense_view(void *data, int64_t heads, int64_t rows, int64_t cols) {
    sdpa_view v = {0};
    v.data = data;
    v.batch_strides[0] = heads * rows * cols;
    v.head_stride = rows * cols;
    v.row_stride = cols;
    v.col_stride = 1;
    return v;
}

/* The decoding step every call below shares: the sizes, the query and the
 * output; the key and value views are the caller's. */
static void decode_problem(sdpa_problem *p, float *q, float *out) {
    sdpa_problem_init(p);
    p->dtype = SDPA_FLOAT32; /* of the query and the output */
    p->num_batch_dims = 1;
    p->batch_shape[0] = B;
    p->num_heads = HQ;
    p->gqa_group = HQ / HKV;
    p->len_q = 1; /* one new token; it sees every cached position, so no mask */
    p->len_kv = S;
    p->head_dim = E;
    p->head_dim_v = E;
    p->scale = 1.0 / sqrt((double)E);
    p->query = dense_view(q, HQ, 1, E);
    p->out = dense_view(out, HQ, 1, E);
}

/* Attention of each query head over the dequantized cache, in double: key
 * element (b, h, s, c) is (float)kq[...] * ks[..., c / group], the float32
 * product the kernels compute with. */
static void dequantized_reference(const float *q, const int8_t *kq, const float *ks, const int8_t *vq,
                                  const float *vs, int64_t groups, double scale, double *out) {
    const int64_t width = E / groups; /* features per scale */
    static double scores[S];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < HQ; h++) {
            const int64_t hk = h / (HQ / HKV);
            const float *qr = q + (b * HQ + h) * E;
            const int64_t row0 = (b * HKV + hk) * S; /* first cache row of this k/v head */
            double m = -HUGE_VAL, sum = 0, acc[E] = {0};
            for (int64_t s = 0; s < S; s++) {
                double dot = 0;
                for (int64_t c = 0; c < E; c++) {
                    const float k = (float)kq[(row0 + s) * E + c] * ks[(row0 + s) * groups + c / width];
                    dot += (double)qr[c] * (double)k;
                }
                scores[s] = dot * scale;
                m = fmax(m, scores[s]);
            }
            for (int64_t s = 0; s < S; s++) {
                const double w = exp(scores[s] - m);
                sum += w;
                for (int64_t c = 0; c < E; c++) {
                    const float v = (float)vq[(row0 + s) * E + c] * vs[(row0 + s) * groups + c / width];
                    acc[c] += w * (double)v;
                }
            }
            for (int64_t c = 0; c < E; c++) out[(b * HQ + h) * E + c] = acc[c] / sum;
        }
}

static double max_abs_diff(const float *a, const double *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]);
        if (!(d <= m)) m = d; /* a NaN counts as the largest difference */
    }
    return m;
}

int main(void) {
    static float k[B * HKV * S * E], v[B * HKV * S * E]; /* the float32 cache */
    static int8_t kq[B * HKV * S * E], vq[B * HKV * S * E]; /* the int8 cache */
    static float ks[B * HKV * S * E], vs[B * HKV * S * E];  /* its scales (room for any group) */
    static float q[B * HQ * E], out_float[B * HQ * E], out_int8[B * HQ * E];
    static double out_float_d[B * HQ * E], reference[B * HQ * E];

    uint32_t state = 2024;
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) k[i] = next_uniform(&state);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) v[i] = next_uniform(&state);
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = next_uniform(&state);

    printf("sdpa %s, kernels: %s\n", sdpa_version(), sdpa_isa());
    printf("decode: B=%d, %d query heads over %d key/value heads, S=%d, E=%d\n", B, HQ, HKV, S, E);

    /* The step over the float32 cache, for comparison. */
    sdpa_problem p;
    decode_problem(&p, q, out_float);
    p.key = dense_view(k, HKV, S, E);
    p.value = dense_view(v, HKV, S, E);
    sdpa_status st = sdpa_attention(&p);
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_attention (float32 cache) failed: %s\n", sdpa_status_message(st));
        return 1;
    }
    for (size_t i = 0; i < sizeof out_float / sizeof out_float[0]; i++) out_float_d[i] = (double)out_float[i];

    int ok = 1;
    const int64_t group_sizes[2] = {0 /* one scale per position and head */, 16};
    for (int gi = 0; gi < 2; gi++) {
        const int64_t group = group_sizes[gi];
        const int64_t groups = sdpa_int8_scales_per_row(E, group); /* scales per row: 1, then 4 */

        /* Quantize the cache.  The rows of all heads are contiguous here, so
         * one call per tensor does; a decoder quantizes the T rows of its new
         * tokens at each step, into the positions they take. */
        st = sdpa_quantize_int8(k, E, B * HKV * S, E, group, kq, E, ks, groups);
        if (st == SDPA_OK) st = sdpa_quantize_int8(v, E, B * HKV * S, E, group, vq, E, vs, groups);
        if (st != SDPA_OK) {
            fprintf(stderr, "sdpa_quantize_int8 failed: %s\n", sdpa_status_message(st));
            return 1;
        }

        /* The same step over the int8 cache: int8 key and value views, float32
         * scales beside them, (B, HKV, S, groups). */
        decode_problem(&p, q, out_int8);
        p.kv_dtype = SDPA_INT8;
        p.key = dense_view(kq, HKV, S, E);
        p.value = dense_view(vq, HKV, S, E);
        p.key_scale = dense_view(ks, HKV, S, groups);
        p.value_scale = dense_view(vs, HKV, S, groups);
        p.kv_group_size = group;
        st = sdpa_attention(&p);
        if (st != SDPA_OK) {
            fprintf(stderr, "sdpa_attention (int8 cache) failed: %s\n", sdpa_status_message(st));
            return 1;
        }

        dequantized_reference(q, kq, ks, vq, vs, groups, p.scale, reference);
        const size_t n = sizeof out_int8 / sizeof out_int8[0];
        const double err_ref = max_abs_diff(out_int8, reference, n);
        const double err_float = max_abs_diff(out_int8, out_float_d, n);
        /* bytes of the cache: keys and values, and for int8 their scales */
        const double rows = (double)B * HKV * S;
        const double bytes_int8 = rows * (2.0 * E + 2.0 * (double)groups * sizeof(float));
        const double bytes_float = rows * 2.0 * E * sizeof(float);
        if (group)
            printf("int8, groups of %lld features:\n", (long long)group);
        else
            printf("int8, one scale per position and head:\n");
        printf("  cache %.0f KiB (float32: %.0f KiB, %.2fx)\n", bytes_int8 / 1024, bytes_float / 1024,
               bytes_float / bytes_int8);
        printf("  max |out - dequantized reference| = %.2e (at most %.0e)\n", err_ref, TOL_DEQUANTIZED);
        printf("  max |out - float32 cache output|  = %.2e (at most %.0e)\n", err_float, TOL_FLOAT);
        if (!(err_ref <= TOL_DEQUANTIZED && err_float <= TOL_FLOAT)) ok = 0;
    }
    if (!ok) {
        fprintf(stderr, "int8 decoding differs beyond its bounds\n");
        return 1;
    }
    printf("int8 decoding matches\n");
    return 0;
}
