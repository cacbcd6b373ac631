/* One decoding step over a paged KV cache, through the C API.
 *
 * A pool of 64 blocks of 16 positions holds three sequences of 70, 33 and 128
 * positions (2 key/value heads, 64 features), each in blocks scattered over
 * the pool by its block table; 8 query heads (4 per key/value head) decode one
 * token each.  The output is checked against a double-precision loop over each
 * sequence's positions gathered in order, and the example fails beyond 1e-5.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "sdpa.h"

enum { NUM_BLOCKS = 64, BLOCK = 16, HKV = 2, HQ = 8, E = 64, B = 3, MAX_BLOCKS = 8 };

static unsigned state = 12345;
static float next_float(void) { /* a fixed linear congruential generator, in [-1, 1) */
    state = state * 1103515245u + 12345u;
    return (float)((state >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}

int main(void) {
    static float key_cache[NUM_BLOCKS][HKV][BLOCK][E], value_cache[NUM_BLOCKS][HKV][BLOCK][E];
    static float query[B][HQ][1][E], out[B][HQ][1][E];
    const int64_t seq_lens[B] = {70, 33, 128};
    int32_t tables[B][MAX_BLOCKS];
    for (int n = 0; n < NUM_BLOCKS; n++)
        for (int h = 0; h < HKV; h++)
            for (int s = 0; s < BLOCK; s++)
                for (int c = 0; c < E; c++) {
                    key_cache[n][h][s][c] = next_float();
                    value_cache[n][h][s][c] = next_float();
                }
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < MAX_BLOCKS; j++) tables[b][j] = -1; /* never read past a sequence's blocks */
        for (int j = 0; j < (seq_lens[b] + BLOCK - 1) / BLOCK; j++) tables[b][j] = (7 * (b * MAX_BLOCKS + j) + 3) % NUM_BLOCKS;
        for (int h = 0; h < HQ; h++)
            for (int c = 0; c < E; c++) query[b][h][0][c] = next_float();
    }

    sdpa_problem p;
    sdpa_problem_init(&p);
    p.num_batch_dims = 1;
    p.batch_shape[0] = B;
    p.num_heads = HQ;
    p.gqa_group = HQ / HKV;
    p.len_q = 1;
    p.len_kv = MAX_BLOCKS * BLOCK; /* the tables' capacity */
    p.head_dim = p.head_dim_v = E;
    p.scale = 1.0 / sqrt((double)E);
    p.causal = 1; /* the query is each sequence's last position */
    p.query = (sdpa_view){.data = query, .batch_strides = {HQ * E}, .head_stride = E, .row_stride = E, .col_stride = 1};
    p.out = p.query;
    p.out.data = out;
    /* paged: batch_strides[0] is the stride between blocks */
    p.key = (sdpa_view){.data = key_cache, .batch_strides = {HKV * BLOCK * E}, .head_stride = BLOCK * E,
                        .row_stride = E, .col_stride = 1};
    p.value = p.key;
    p.value.data = value_cache;
    p.block_table = &tables[0][0];
    p.block_table_stride = MAX_BLOCKS;
    p.block_size = BLOCK;
    p.num_blocks = NUM_BLOCKS;
    p.key_lengths = seq_lens;
    p.key_lengths_strides[0] = 1;

    sdpa_status st = sdpa_attention(&p);
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_attention: %s\n", sdpa_status_message(st));
        return 1;
    }

    double worst = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < HQ; h++) {
            const int hkv = h / (HQ / HKV);
            double m = -INFINITY, sum = 0, acc[E] = {0};
            double *scores = (double *)malloc(sizeof(double) * (size_t)seq_lens[b]);
            if (!scores) return 1;
            for (int64_t s = 0; s < seq_lens[b]; s++) {
                const float *k = key_cache[tables[b][s / BLOCK]][hkv][s % BLOCK];
                double dot = 0;
                for (int c = 0; c < E; c++) dot += (double)query[b][h][0][c] * k[c];
                scores[s] = dot * p.scale;
                if (scores[s] > m) m = scores[s];
            }
            for (int64_t s = 0; s < seq_lens[b]; s++) {
                const double w = exp(scores[s] - m);
                const float *v = value_cache[tables[b][s / BLOCK]][hkv][s % BLOCK];
                sum += w;
                for (int c = 0; c < E; c++) acc[c] += w * v[c];
            }
            free(scores);
            for (int c = 0; c < E; c++) {
                const double d = fabs(acc[c] / sum - out[b][h][0][c]);
                if (d > worst) worst = d;
            }
        }
    printf("sdpa %s, kernels: %s\n", sdpa_version(), sdpa_isa());
    printf("paged decode: %d sequences of %lld, %lld and %lld positions in blocks of %d, %d query heads over %d\n", B,
           (long long)seq_lens[0], (long long)seq_lens[1], (long long)seq_lens[2], BLOCK, HQ, HKV);
    printf("max |out - reference| = %.2e (at most 1e-05)\n", worst);
    if (!(worst <= 1e-5)) return 1;
    printf("paged decoding matches\n");
    return 0;
}
