/* A fixed attention call repeated, for counting instructions per score under
 * an emulator (benchmarks/arm/icount.sh): the count of `icount SET CASE 3`
 * less that of `icount SET CASE 1`, halved, is one call's, setup excluded.
 *
 *   icount SET CASE REPEAT     SET: a kernel set (sdpa_set_isa); CASE below
 *
 * One thread, so that the count is the work's and not the thread pool's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sdpa.h"

typedef struct {
    const char *name;
    sdpa_dtype dtype, kv_dtype;
    int heads, kv_heads, len_q, len_kv, dim, integer_qk;
} bench_case;

static const bench_case CASES[] = {
    {"decode-f32", SDPA_FLOAT32, SDPA_FLOAT32, 8, 8, 1, 256, 64, 0},          /* (1, 8, 1, 256, 64) */
    {"decode-bf16-cache", SDPA_FLOAT32, SDPA_BFLOAT16, 8, 2, 1, 256, 64, 0},  /* GQA 4, bfloat16 cache */
    {"decode-int8", SDPA_FLOAT32, SDPA_INT8, 8, 2, 1, 256, 64, 0},
    {"decode-int8-iqk", SDPA_FLOAT32, SDPA_INT8, 8, 2, 1, 256, 64, 1},
    {"decode-int4-iqk", SDPA_FLOAT32, SDPA_INT4, 8, 2, 1, 256, 64, 1},
    {"decode-int4", SDPA_FLOAT32, SDPA_INT4, 8, 2, 1, 256, 64, 0},
    {"decode-e4m3", SDPA_FLOAT32, SDPA_FP8_E4M3, 8, 2, 1, 256, 64, 0},
    {"decode-e5m2", SDPA_FLOAT32, SDPA_FP8_E5M2, 8, 2, 1, 256, 64, 0},
    {"prefill-f32", SDPA_FLOAT32, SDPA_FLOAT32, 2, 2, 128, 128, 64, 0},
    {"prefill-bf16", SDPA_BFLOAT16, SDPA_BFLOAT16, 2, 2, 128, 128, 64, 0},
    {"prefill-f64", SDPA_FLOAT64, SDPA_FLOAT64, 2, 2, 64, 64, 64, 0},
};

static size_t esize(sdpa_dtype dt) {
    return dt == SDPA_FLOAT64 ? 8 : dt == SDPA_FLOAT32 ? 4 : dt == SDPA_BFLOAT16 || dt == SDPA_FLOAT16 ? 2 : 1;
}

/* n values of dt from a fixed pseudo-random sequence (floats first) */
static void *fill(sdpa_dtype dt, size_t n, unsigned seed) {
    float *f = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        f[i] = (float)((seed >> 9) & 0xffff) / 32768.0f - 1.0f;
    }
    if (dt == SDPA_FLOAT32) return f;
    void *out = malloc(n * esize(dt));
    for (size_t i = 0; i < n; i++) {
        if (dt == SDPA_FLOAT64) ((double *)out)[i] = f[i];
        if (dt == SDPA_BFLOAT16) { /* truncated: any bfloat16 values do */
            uint32_t u;
            memcpy(&u, &f[i], 4);
            ((uint16_t *)out)[i] = (uint16_t)(u >> 16);
        }
    }
    free(f);
    return out;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s SET CASE REPEAT\n", argv[0]);
        return 2;
    }
    const bench_case *c = NULL;
    for (size_t i = 0; i < sizeof(CASES) / sizeof(CASES[0]); i++)
        if (strcmp(argv[2], CASES[i].name) == 0) c = &CASES[i];
    if (!c || sdpa_set_isa(argv[1]) != SDPA_OK) {
        fprintf(stderr, "unknown case, or a kernel set this CPU cannot run\n");
        return 2;
    }
    const int repeat = atoi(argv[3]);
    const int64_t H = c->heads, Hk = c->kv_heads, L = c->len_q, S = c->len_kv, E = c->dim;
    const int quantized = c->kv_dtype == SDPA_INT8 || c->kv_dtype == SDPA_INT4 || c->kv_dtype == SDPA_FP8_E4M3 ||
                          c->kv_dtype == SDPA_FP8_E5M2;
    void *q = fill(c->dtype, (size_t)(H * L * E), 1), *out = calloc((size_t)(H * L * E), esize(c->dtype));
    void *k, *v;
    float *ks = NULL, *vs = NULL;
    int64_t rb = E; /* bytes (int4: pairs) or elements of a cache row */
    if (quantized) {
        float *kf = (float *)fill(SDPA_FLOAT32, (size_t)(Hk * S * E), 2), *vf = (float *)fill(SDPA_FLOAT32, (size_t)(Hk * S * E), 3);
        rb = c->kv_dtype == SDPA_INT4 ? E / 2 : E;
        k = malloc((size_t)(Hk * S * rb)), v = malloc((size_t)(Hk * S * rb));
        ks = (float *)malloc((size_t)(Hk * S) * sizeof(float)), vs = (float *)malloc((size_t)(Hk * S) * sizeof(float));
        if (sdpa_quantize(c->kv_dtype, kf, E, Hk * S, E, 0, k, rb, ks, 1) != SDPA_OK ||
            sdpa_quantize(c->kv_dtype, vf, E, Hk * S, E, 0, v, rb, vs, 1) != SDPA_OK)
            return 1;
        free(kf), free(vf);
    } else {
        k = fill(c->kv_dtype, (size_t)(Hk * S * E), 2), v = fill(c->kv_dtype, (size_t)(Hk * S * E), 3);
    }
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = c->dtype, p.kv_dtype = c->kv_dtype, p.integer_qk = c->integer_qk;
    p.num_heads = H, p.gqa_group = H / Hk, p.len_q = L, p.len_kv = S, p.head_dim = E, p.head_dim_v = E;
    p.num_threads = 1;
    p.query = (sdpa_view){.data = q, .head_stride = L * E, .row_stride = E, .col_stride = 1};
    p.out = (sdpa_view){.data = out, .head_stride = L * E, .row_stride = E, .col_stride = 1};
    p.key = (sdpa_view){.data = k, .head_stride = S * rb, .row_stride = rb, .col_stride = 1};
    p.value = (sdpa_view){.data = v, .head_stride = S * rb, .row_stride = rb, .col_stride = 1};
    if (quantized) {
        p.key_scale = (sdpa_view){.data = ks, .head_stride = S, .row_stride = 1, .col_stride = 1};
        p.value_scale = (sdpa_view){.data = vs, .head_stride = S, .row_stride = 1, .col_stride = 1};
    }
    for (int r = 0; r < repeat; r++) {
        const sdpa_status st = sdpa_attention(&p);
        if (st != SDPA_OK) {
            fprintf(stderr, "%s\n", sdpa_status_message(st));
            return 1;
        }
    }
    printf("%s %s: %lld scores a call\n", argv[1], c->name, (long long)(H * L * S));
    free(q), free(out), free(k), free(v), free(ks), free(vs);
    return 0;
}
