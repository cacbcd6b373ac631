/* The indexer of sparse attention (sdpa_index_topk, sdpa.h): each query row's
 * scores of the keys it sees, as a sum over index heads of ReLU(q . k), and
 * the k best positions, without storing a row's scores.
 *
 * A task is (row, chunk of keys).  The keys of a chunk are taken a panel (the
 * kernel set's nr keys) at a time: widened to float32 and packed as the
 * tiled path packs a query panel, then one gemm of the row's `heads` query
 * vectors against it gives the heads x nr dot products, and the weighted
 * ReLU sum is summed over the heads in order.  Panels start at multiples of
 * nr from position 0, so a position's score has the same bits whatever the
 * chunks (and so the thread count).  Each score, with its position, becomes
 * a 64-bit key that orders as the result does (score descending, position
 * ascending, NaN last); a task keeps the keys below its running threshold,
 * selects the k smallest when it holds 2k, and hands its k to the row's
 * merge, which selects and sorts the row's k. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "plan.h"

/* A chunk holds at least this many keys (a task's fixed cost is small
 * against them); chunks are cut only when rows are too few for the threads. */
#define TOPK_MIN_CHUNK 2048
/* Keys a gemm takes at once (a multiple of every panel width) */
#define TOPK_TILE 128

void sdpa_topk_problem_init_sized(sdpa_topk_problem *p, size_t struct_size) {
    if (!p) return;
    if (struct_size != sizeof(*p)) {
        if (struct_size >= sizeof(p->struct_size)) p->struct_size = struct_size;
        return;
    }
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->key_dtype = SDPA_FLOAT32;
}

/* The order key of (score, position): smaller for a better score, the lower
 * position first among equal scores, every NaN after every number. */
static inline uint64_t order_key(float s, int64_t pos) {
    if (s != s) return ((uint64_t)0xFFFFFFFFu << 32) | (uint64_t)pos;
    s += 0.0f;  /* -0 as +0: equal scores order by position */
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    const uint32_t up = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  /* ascending with s */
    return ((uint64_t)~up << 32) | (uint64_t)pos;
}

static inline float key_score(uint64_t key) {
    const uint32_t hi = (uint32_t)(key >> 32);
    if (hi == 0xFFFFFFFFu) return NAN;
    const uint32_t up = ~hi;
    const uint32_t u = (up & 0x80000000u) ? (up & 0x7FFFFFFFu) : ~up;
    float s;
    memcpy(&s, &u, sizeof s);
    return s;
}

static inline void swap_u64(uint64_t *a, uint64_t *b) {
    const uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges a[0..n) so that its k smallest come first (in any order); k < n. */
static void select_smallest(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (hi > lo) {
        const int64_t mid = lo + (hi - lo) / 2;  /* median of three as the pivot, at hi */
        if (a[mid] < a[lo]) swap_u64(a + mid, a + lo);
        if (a[hi] < a[lo]) swap_u64(a + hi, a + lo);
        if (a[mid] < a[hi]) swap_u64(a + mid, a + hi);
        const uint64_t pivot = a[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++)
            if (a[i] < pivot) swap_u64(a + i, a + store++);
        swap_u64(a + store, a + hi);
        if (store == k || store == k - 1) return;  /* a[0..store] are the store + 1 smallest */
        if (store < k) lo = store + 1;
        else hi = store - 1;
    }
}

static int cmp_u64(const void *x, const void *y) {
    const uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

typedef struct topk_ctx {
    const sdpa_topk_problem *p;
    const kernels_f32 *kern;
    int nr;
    int64_t heads_padded;  /* heads rounded up to whole panels */
    int64_t chunks, chunk_len;
    int64_t kept;          /* min(k, len_kv): what a task or a row can select */
    uint64_t *cand;        /* (rows * chunks) x k: each task's selection */
    int64_t *cand_n;       /* its size */
    char *scratch;         /* per thread */
    size_t scratch_bytes;
    float key_unit;        /* e4m3 keys widen to value / 256 (convert.h's trick): times 256 after */
} topk_ctx;

#define TOPK_ALIGN(b) (((size_t)(b) + 63) / 64 * 64)

/* Positions [0, end) row (b, l) sees. */
static int64_t row_limit(const sdpa_topk_problem *p, int64_t b, int64_t l) {
    int64_t lim = p->len_kv;
    if (p->key_lengths) {
        const int64_t kl = p->key_lengths[b];
        lim = kl < 0 ? 0 : (kl < lim ? kl : lim);
    }
    if (p->causal) {
        const int64_t c = lim - p->len_q + l + 1;
        lim = c < 0 ? 0 : (c < lim ? c : lim);
    }
    return lim;
}

/* Rows [j, j + n) of batch b's 8-bit keys widened to float32 into dst (rows
 * of E; e4m3: value / 256), through `half` (n x E float16 bits): the rows
 * taken as one run where they are contiguous. */
static void widen_keys8(const topk_ctx *cx, int64_t b, int64_t j, int n, float *dst, uint16_t *half) {
    const sdpa_topk_problem *p = cx->p;
    const int64_t E = p->head_dim, rs = p->key_strides[1];
    const int runs = rs == E ? 1 : n;
    const int64_t len = rs == E ? (int64_t)n * E : E;
    for (int x = 0; x < runs; x++) {
        const int8_t *r8 = (const int8_t *)p->key + b * p->key_strides[0] + (j + x) * rs;
        const uint8_t *r = (const uint8_t *)r8;
        float *d = dst + (int64_t)x * E;
        switch (p->key_dtype) {
            case SDPA_INT8:
                for (int64_t c = 0; c < len; c++) d[c] = (float)r8[c];
                break;
            case SDPA_FP8_E5M2:  /* the top byte of a float16 */
                for (int64_t c = 0; c < len; c++) half[c] = (uint16_t)((unsigned)r[c] << 8);
                cx->kern->widen(SDPA_FLOAT16, half, d, len);
                break;
            default:  /* e4m3: sign-extended, shifted by 7, bit 14 cleared: the float16 of value / 256 */
                for (int64_t c = 0; c < len; c++) half[c] = (uint16_t)((uint16_t)(int16_t)r8[c] << 7) & (uint16_t)0xBFFFu;
                cx->kern->widen(SDPA_FLOAT16, half, d, len);
                for (int64_t c = 0; c < len; c++) d[c] = (r[c] & 0x7Fu) == 0x7Fu ? NAN : d[c];
                break;
        }
    }
}

/* Task t: row t / chunks, chunk t % chunks. */
static void topk_task(void *vctx, int64_t t, int tid) {
    const topk_ctx *cx = (const topk_ctx *)vctx;
    const sdpa_topk_problem *p = cx->p;
    const kernels_f32 *kern = cx->kern;
    const int nr = cx->nr;
    const int64_t E = p->head_dim, H = p->heads, HP = cx->heads_padded, K = cx->kept;
    const int64_t row = t / cx->chunks, chunk = t % cx->chunks;
    const int64_t b = row / p->len_q, l = row % p->len_q;
    uint64_t *sel = cx->cand + t * K;
    cx->cand_n[t] = 0;
    const int64_t lim = row_limit(p, b, l);
    const int64_t c0 = chunk * cx->chunk_len;
    const int64_t c1 = c0 + cx->chunk_len < lim ? c0 + cx->chunk_len : lim;
    if (c0 >= c1 || K == 0) return;

    char *at = cx->scratch + (size_t)tid * cx->scratch_bytes;
    float *panels = (float *)(void *)at;                              /* HP / nr panels of E x nr */
    at += TOPK_ALIGN((size_t)HP * E * 4);
    float *dots = (float *)(void *)at;                                /* HP / nr blocks of TILE x nr */
    at += TOPK_ALIGN((size_t)HP * TOPK_TILE * 4);
    float *kbuf = (float *)(void *)at;                                /* TILE x E: widened keys */
    at += TOPK_ALIGN((size_t)TOPK_TILE * E * 4);
    uint16_t *half = (uint16_t *)(void *)at;                          /* TILE x E */
    at += TOPK_ALIGN((size_t)TOPK_TILE * E * 2);
    const float **qrows = (const float **)(void *)at;                 /* nr */
    at += TOPK_ALIGN((size_t)nr * sizeof(void *));
    uint64_t *buf = (uint64_t *)(void *)at;                           /* 2K + TILE */

    /* the row's query vectors, packed once: panel i holds heads [i nr, (i + 1) nr) */
    const float *q = p->query + b * p->query_strides[0] + l * p->query_strides[2];
    for (int64_t h0 = 0; h0 < HP; h0 += nr) {
        const int n = (int)(H - h0 < nr ? (H - h0 > 0 ? H - h0 : 0) : nr);
        for (int x = 0; x < n; x++) qrows[x] = q + (h0 + x) * p->query_strides[1];
        kern->pack_q(panels + h0 * E, nr, qrows, n, E, 1.0f);
    }
    const float *w = p->weights + b * p->weights_strides[0] + l * p->weights_strides[1];

    const sdpa_dtype dt = p->key_dtype;
    uint64_t thr = UINT64_MAX;
    int64_t cnt = 0;
    for (int64_t j0 = c0; j0 < c1; j0 += TOPK_TILE) {
        const int n = (int)(c1 - j0 < TOPK_TILE ? c1 - j0 : TOPK_TILE);
        if (dt == SDPA_FLOAT32) {  /* copied: the gemm then reads a tile in cache, and the copy streams */
            const float *src = (const float *)p->key + b * p->key_strides[0] + j0 * p->key_strides[1];
            if (p->key_strides[1] == E) {
                memcpy(kbuf, src, (size_t)n * (size_t)E * sizeof(float));
            } else {
                for (int x = 0; x < n; x++) memcpy(kbuf + (int64_t)x * E, src + x * p->key_strides[1], (size_t)E * 4);
            }
        } else if (dt == SDPA_BFLOAT16 || dt == SDPA_FLOAT16) {
            for (int x = 0; x < n; x++)
                kern->widen(dt, (const uint16_t *)p->key + b * p->key_strides[0] + (j0 + x) * p->key_strides[1],
                            kbuf + (int64_t)x * E, E);
        } else {
            widen_keys8(cx, b, j0, n, kbuf, half);
        }
        for (int64_t h0 = 0; h0 < HP; h0 += nr)  /* dots of every head, key by key */
            kern->gemm(n, E, kbuf, E, 1, panels + h0 * E, nr, dots + h0 * TOPK_TILE, nr, 0);
        for (int x = 0; x < n; x++) {
            const int64_t j = j0 + x;
            float f = cx->key_unit;
            if (p->key_scale) f *= p->key_scale[b * p->key_scale_strides[0] + j * p->key_scale_strides[1]];
            /* sum over the heads in eight lanes (head h0 + y of a panel in lane y % 8,
             * in order), a fixed order: the same bits for every chunking.  Only the H
             * heads: a padded head's dot with a key holding an infinity is NaN, not 0. */
            float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t h0 = 0; h0 < H; h0 += nr) {  /* panel by panel */
                const float *d = dots + h0 * TOPK_TILE + (int64_t)x * nr;
                const float *wh = w + h0;
                const int valid = (int)(H - h0 < nr ? H - h0 : nr), whole = valid / 8 * 8;
                for (int y = 0; y < whole; y += 8)
                    for (int u = 0; u < 8; u++) {
                        const float v = d[y + u] * f;
                        lane[u] += wh[y + u] * (v < 0.0f ? 0.0f : v);
                    }
                for (int y = whole; y < valid; y++) {
                    const float v = d[y] * f;
                    lane[y % 8] += wh[y] * (v < 0.0f ? 0.0f : v);
                }
            }
            const float score = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
            const uint64_t key = order_key(score, j);
            if (key < thr) buf[cnt++] = key;
        }
        if (cnt >= 2 * K) {
            select_smallest(buf, cnt, K);
            cnt = K;
            thr = 0;
            for (int64_t i = 0; i < K; i++) thr = buf[i] > thr ? buf[i] : thr;
        }
    }
    if (cnt > K) {
        select_smallest(buf, cnt, K);
        cnt = K;
    }
    memcpy(sel, buf, (size_t)cnt * sizeof(uint64_t));
    cx->cand_n[t] = cnt;
}

/* Row r: its tasks' selections merged, the k best sorted and written. */
static void topk_merge(void *vctx, int64_t r, int tid) {
    (void)tid;
    const topk_ctx *cx = (const topk_ctx *)vctx;
    const sdpa_topk_problem *p = cx->p;
    const int64_t K = cx->kept;
    uint64_t *all = cx->cand + r * cx->chunks * K;
    int64_t n = 0;
    for (int64_t c = 0; c < cx->chunks; c++) {
        const int64_t m = cx->cand_n[r * cx->chunks + c];
        if (c && m) memmove(all + n, all + c * K, (size_t)m * sizeof(uint64_t));
        n += m;
    }
    if (n > K) {
        select_smallest(all, n, K);
        n = K;
    }
    qsort(all, (size_t)n, sizeof(uint64_t), cmp_u64);
    int32_t *idx = p->indices + r * p->k;
    float *sc = p->scores ? p->scores + r * p->k : NULL;
    for (int64_t i = 0; i < p->k; i++) {
        idx[i] = i < n ? (int32_t)(all[i] & 0xFFFFFFFFu) : -1;
        if (sc) sc[i] = i < n ? key_score(all[i]) : -INFINITY;
    }
}

static int mul_ok(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0 || (a && b > INT64_MAX / a)) return 0;
    *out = a * b;
    return 1;
}

sdpa_status sdpa_index_topk(const sdpa_topk_problem *p) {
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) return SDPA_ERR_ABI;
    if (p->batch < 0 || p->len_q < 0 || p->len_kv < 0 || p->k < 0 || p->heads < 1 || p->head_dim < 1 ||
        p->len_kv >= ((int64_t)1 << 31))
        return SDPA_ERR_BAD_SHAPE;
    switch (p->key_dtype) {
        case SDPA_FLOAT32: case SDPA_BFLOAT16: case SDPA_FLOAT16: case SDPA_INT8: case SDPA_FP8_E4M3:
        case SDPA_FP8_E5M2: break;
        default: return SDPA_ERR_BAD_DTYPE;
    }
    if (p->num_threads < 0) return SDPA_ERR_BAD_THREADS;
    int64_t rows = 0, outs = 0;
    if (!mul_ok(p->batch, p->len_q, &rows) || !mul_ok(rows, p->k, &outs)) return SDPA_ERR_OVERFLOW;
    if (outs == 0) return SDPA_OK;
    if (!p->query || !p->weights || !p->indices || (p->len_kv && !p->key) ||
        (p->key_dtype == SDPA_INT8 && !p->key_scale))
        return SDPA_ERR_NULL_POINTER;

    int by_name = 0;
    const kernel_table *kt = sdpa_kernel_choice(&by_name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    topk_ctx cx;
    memset(&cx, 0, sizeof cx);
    cx.p = p;
    cx.kern = &kt->f32;
    cx.nr = kt->f32.nr;
    cx.key_unit = p->key_dtype == SDPA_FP8_E4M3 ? 256.0f : 1.0f;
    const int64_t S = p->len_kv, E = p->head_dim, H = p->heads, K = p->k < S ? p->k : S, nr = cx.nr;
    cx.kept = K;  /* a k beyond the positions pads, and takes no more memory */
    const double work = 2.0 * (double)rows * (double)S * (double)H * (double)E;
    const int want = sdpa_threads_for(p->num_threads, 0, rows * ((S + TOPK_MIN_CHUNK - 1) / TOPK_MIN_CHUNK), work);
    /* chunks only when the rows are too few to give each thread four tasks */
    int64_t chunks = 1;
    if (rows < 4 * (int64_t)want && S > TOPK_MIN_CHUNK) {
        chunks = (4 * (int64_t)want + rows - 1) / rows;
        const int64_t most = (S + TOPK_MIN_CHUNK - 1) / TOPK_MIN_CHUNK;
        if (chunks > most) chunks = most;
    }
    int64_t chunk_len = (S + chunks - 1) / chunks;
    chunk_len = (chunk_len + TOPK_TILE - 1) / TOPK_TILE * TOPK_TILE;  /* tiles start at multiples of TOPK_TILE */
    chunks = S ? (S + chunk_len - 1) / chunk_len : 1;
    cx.chunks = chunks;
    cx.chunk_len = chunk_len;
    const int64_t tasks = rows * chunks;
    const int threads = (int64_t)want > tasks ? (int)tasks : want;

    int64_t cand_elems = 0;
    if (!mul_ok(tasks, K, &cand_elems)) return SDPA_ERR_OVERFLOW;
    cx.heads_padded = (H + nr - 1) / nr * nr;  /* whole panels */
    const int64_t HP = cx.heads_padded;
    cx.scratch_bytes = TOPK_ALIGN((size_t)HP * E * 4) + TOPK_ALIGN((size_t)HP * TOPK_TILE * 4) +
                       TOPK_ALIGN((size_t)TOPK_TILE * E * 4) + TOPK_ALIGN((size_t)TOPK_TILE * E * 2) +
                       TOPK_ALIGN((size_t)nr * sizeof(void *)) + TOPK_ALIGN((size_t)(2 * K + TOPK_TILE) * 8);
    cx.cand = (uint64_t *)malloc((size_t)(cand_elems > 0 ? cand_elems : 1) * sizeof(uint64_t));
    cx.cand_n = (int64_t *)malloc((size_t)tasks * sizeof(int64_t));
    void *scratch = sdpa_aligned_block(cx.scratch_bytes * (size_t)threads);
    cx.scratch = (char *)scratch;
    if (!cx.cand || !cx.cand_n || !cx.scratch) {
        free(cx.cand);
        free(cx.cand_n);
        sdpa_aligned_free(scratch);
        return SDPA_ERR_NO_MEMORY;
    }
    sdpa_parallel_for(threads, tasks, topk_task, &cx);
    sdpa_parallel_for(threads, rows, topk_merge, &cx);
    free(cx.cand);
    free(cx.cand_n);
    sdpa_aligned_free(scratch);
    return SDPA_OK;
}
