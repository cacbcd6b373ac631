/* One step of sparse decoding through the C API: index, select, attend.
 *
 * A cache of 4,096 positions (2 key/value heads, 64 features) and an index
 * cache (one head of 32 features a position).  The indexer's 4 heads score
 * every position (sdpa_index_topk) and keep the 256 best; 8 query heads then
 * attend only those positions, read where they lie (sdpa_attention with the
 * list as the problem's topk_indices; over a paged cache, a block table of
 * one-position blocks is the same list).  The selection is checked against every
 * position's score in double precision (none left out may score higher than
 * one kept), the output against a double-precision loop over the selected
 * positions; the example fails beyond 1e-5.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "sdpa.h"

enum { S = 4096, HKV = 2, HQ = 8, E = 64, HI = 4, EI = 32, K = 256 };

static unsigned state = 2024;
static float next_float(void) { /* a fixed linear congruential generator, in [-1, 1) */
    state = state * 1103515245u + 12345u;
    return (float)((state >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}

static double index_score(const float (*qi)[EI], const float *w, const float *ki) {
    double score = 0;
    for (int h = 0; h < HI; h++) {
        double dot = 0;
        for (int c = 0; c < EI; c++) dot += (double)qi[h][c] * ki[c];
        score += w[h] * (dot > 0 ? dot : 0);
    }
    return score;
}

int main(void) {
    static float key[HKV][S][E], value[HKV][S][E], k_index[S][EI];
    static float query[HQ][E], out[HQ][E], q_index[HI][EI], weights[HI];
    static int32_t selected[K];
    static float selected_scores[K];
    for (int h = 0; h < HKV; h++)
        for (int s = 0; s < S; s++)
            for (int c = 0; c < E; c++) {
                key[h][s][c] = next_float();
                value[h][s][c] = next_float();
            }
    for (int s = 0; s < S; s++)
        for (int c = 0; c < EI; c++) k_index[s][c] = next_float();
    for (int h = 0; h < HQ; h++)
        for (int c = 0; c < E; c++) query[h][c] = next_float();
    for (int h = 0; h < HI; h++) {
        weights[h] = 0.5f + 0.5f * next_float();
        for (int c = 0; c < EI; c++) q_index[h][c] = next_float();
    }

    /* 1. index: the K best positions of the one query row */
    sdpa_topk_problem t;
    sdpa_topk_problem_init(&t);
    t.batch = 1;
    t.heads = HI;
    t.len_q = 1;
    t.len_kv = S;
    t.head_dim = EI;
    t.k = K;
    t.query = &q_index[0][0];
    t.query_strides[0] = HI * EI; /* batch, head, row */
    t.query_strides[1] = EI;
    t.query_strides[2] = EI;
    t.key_dtype = SDPA_FLOAT32;
    t.key = k_index;
    t.key_strides[0] = S * EI;
    t.key_strides[1] = EI;
    t.weights = weights;
    t.weights_strides[0] = HI;
    t.weights_strides[1] = HI;
    t.indices = selected;
    t.scores = selected_scores;
    sdpa_status st = sdpa_index_topk(&t);
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_index_topk: %s\n", sdpa_status_message(st));
        return 1;
    }

    /* 2. attend the selected positions where they lie: the list in the
     * problem's topk_indices (one list shared by every head: head_stride 0) */
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.num_heads = HQ;
    p.gqa_group = HQ / HKV;
    p.len_q = 1;
    p.len_kv = S;
    p.head_dim = p.head_dim_v = E;
    p.scale = 1.0 / sqrt((double)E);
    p.query = (sdpa_view){.data = query, .head_stride = E, .row_stride = E, .col_stride = 1};
    p.out = p.query;
    p.out.data = out;
    p.key = (sdpa_view){.data = key, .head_stride = S * E, .row_stride = E, .col_stride = 1};
    p.value = p.key;
    p.value.data = value;
    p.topk_indices = (sdpa_view){.data = selected, .head_stride = 0, .row_stride = K, .col_stride = 1};
    p.topk = K;
    st = sdpa_attention(&p);
    if (st != SDPA_OK) {
        fprintf(stderr, "sdpa_attention: %s\n", sdpa_status_message(st));
        return 1;
    }

    /* the selection: no position left out scores above the last one kept */
    static char kept[S];
    double lowest_kept = INFINITY, highest_left = -INFINITY;
    for (int j = 0; j < K; j++) kept[selected[j]] = 1;
    for (int s = 0; s < S; s++) {
        const double sc = index_score(q_index, weights, k_index[s]);
        if (kept[s] && sc < lowest_kept) lowest_kept = sc;
        if (!kept[s] && sc > highest_left) highest_left = sc;
    }
    /* the output: a double-precision loop over the selected positions */
    double worst = 0;
    for (int h = 0; h < HQ; h++) {
        const int hkv = h / (HQ / HKV);
        double scores[K], m = -INFINITY, sum = 0, acc[E] = {0};
        for (int j = 0; j < K; j++) {
            double dot = 0;
            for (int c = 0; c < E; c++) dot += (double)query[h][c] * key[hkv][selected[j]][c];
            scores[j] = dot * p.scale;
            if (scores[j] > m) m = scores[j];
        }
        for (int j = 0; j < K; j++) {
            const double w = exp(scores[j] - m);
            sum += w;
            for (int c = 0; c < E; c++) acc[c] += w * value[hkv][selected[j]][c];
        }
        for (int c = 0; c < E; c++) {
            const double d = fabs(acc[c] / sum - out[h][c]);
            if (d > worst) worst = d;
        }
    }
    printf("sdpa %s, kernels: %s\n", sdpa_version(), sdpa_isa());
    printf("sparse decode: %d of %d positions selected by %d index heads, %d query heads over %d\n", K, S, HI, HQ,
           HKV);
    printf("lowest score kept %.6f, highest left out %.6f\n", lowest_kept, highest_left);
    printf("max |out - reference| = %.2e (at most 1e-05)\n", worst);
    if (!(highest_left <= lowest_kept + 1e-5) || !(worst <= 1e-5)) return 1;
    printf("sparse decoding matches\n");
    return 0;
}
