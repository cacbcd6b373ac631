/*
 * Tests of the C core through its public API (sdpa.h), with no Python.
 *
 * Every result is compared with a naive double-precision implementation of
 * attention written here (scores, mask, causal mask, key lengths, softmax,
 * weighted sum), for every kernel set the CPU supports, float32 and float64,
 * and strided, transposed, padded, reversed and broadcast views.  Each call is
 * repeated with 1, 2 and 3 threads, whose results must be bitwise identical.
 * The model variants are checked against what they stand for: a window
 * against its bool mask, ALiBi against its additive mask, a sink against one
 * more key, the softcap against a reference; out-of-range values must be
 * refused with SDPA_ERR_BAD_VARIANT.
 *
 *   sdpa_test_core            the full run (a few seconds)
 *   sdpa_test_core --quick    small sizes, for valgrind (also SDPA_TEST_QUICK=1)
 *
 * Prints one line per check and ends with "N passed, M failed"; the exit
 * status is nonzero when a check failed.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "convert.h" /* the library's own scalar 16-bit conversions */
#include "sdpa.h"

/* ---- reporting ---- */

static int n_passed = 0, n_failed = 0, n_skipped = 0;
static int quick = 0;

static int check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s - ", ok ? "ok" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    if (ok) n_passed++;
    else n_failed++;
    fflush(stdout);
    return ok;
}

static void skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("skip - ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    n_skipped++;
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- a small deterministic random generator (splitmix64) ---- */

static uint64_t rng_state = 0x5d9a1f3c7b2e4a61ull;

static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }

/* an integer in [lo, hi] */
static int64_t rng_int(int64_t lo, int64_t hi) { return lo + (int64_t)(rng_next() % (uint64_t)(hi - lo + 1)); }

/* ---- strided buffers ---- */

#define MAX_DIMS (SDPA_MAX_BATCH_DIMS + 3)

enum layout_style {
    LAYOUT_CONTIGUOUS = 0, /* row-major, dense                                  */
    LAYOUT_STRIDED = 1,    /* random dim order, padding, some reversed dims      */
    LAYOUT_TRANSPOSED = 2  /* column-major: the last dim has the largest stride  */
};

/*
 * One operand in memory: nd logical dims (batch dims, then head, row and, for
 * all but lse, column).  Broadcast dims are stored once and have stride 0.
 * Element (i_0, ..., i_{nd-1}) is at data + sum i_d * stride[d], where data is
 * base + offset elements (reversed dims start at their far end).
 */
typedef struct buffer {
    int nd;
    int64_t n[MAX_DIMS];
    int64_t stride[MAX_DIMS];
    int64_t offset; /* elements from base to data */
    int64_t total;  /* elements allocated          */
    size_t elem;
    unsigned char *base;
    unsigned char *data;
} buffer;

static void buffer_make(buffer *b, int nd, const int64_t *n, size_t elem, unsigned bcast, int style) {
    memset(b, 0, sizeof(*b));
    b->nd = nd;
    b->elem = elem;
    int order[MAX_DIMS]; /* order[0] is the innermost dim */
    for (int d = 0; d < nd; d++) {
        b->n[d] = n[d];
        order[d] = style == LAYOUT_TRANSPOSED ? d : nd - 1 - d;
    }
    if (style == LAYOUT_STRIDED)
        for (int i = nd - 1; i > 0; i--) {
            int j = (int)rng_int(0, i), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
    int64_t cur = 1, offset = 0;
    for (int i = 0; i < nd; i++) {
        const int d = order[i];
        const int64_t stored = (bcast >> d) & 1 ? 1 : n[d];
        const int64_t extent = stored + (style == LAYOUT_STRIDED ? rng_int(0, 2) : 0);
        int64_t s = (bcast >> d) & 1 ? 0 : cur;
        if (style == LAYOUT_STRIDED && s != 0 && rng_int(0, 3) == 0) {
            s = -s; /* reversed: data points at the far end of this dim */
            if (stored > 0) offset += (stored - 1) * cur;
        }
        b->stride[d] = s;
        cur *= extent > 0 ? extent : 1;
    }
    b->total = cur;
    b->offset = offset;
    b->base = (unsigned char *)xcalloc((size_t)cur, elem);
    b->data = b->base + offset * (int64_t)elem;
}

static void buffer_free(buffer *b) {
    free(b->base);
    b->base = b->data = NULL;
}

static int64_t buffer_off(const buffer *b, const int64_t *idx) {
    int64_t off = 0;
    for (int d = 0; d < b->nd; d++) off += idx[d] * b->stride[d];
    return off;
}

/* The sdpa_view of a buffer with nb batch dims. */
static sdpa_view buffer_view(const buffer *b, int nb) {
    sdpa_view v;
    memset(&v, 0, sizeof(v));
    v.data = b->data;
    for (int d = 0; d < nb; d++) v.batch_strides[d] = b->stride[d];
    v.head_stride = b->stride[nb];
    v.row_stride = b->stride[nb + 1];
    v.col_stride = b->nd > nb + 2 ? b->stride[nb + 2] : 0;
    return v;
}

static double load(const void *data, sdpa_dtype dt, int64_t off) {
    switch (dt) {
        case SDPA_FLOAT32: return (double)((const float *)data)[off];
        case SDPA_BFLOAT16: return (double)sdpa_bf16_to_f32(((const uint16_t *)data)[off]);
        case SDPA_FLOAT16: return (double)sdpa_f16_to_f32(((const uint16_t *)data)[off]);
        default: return ((const double *)data)[off];
    }
}

static void store(void *data, sdpa_dtype dt, int64_t off, double x) {
    switch (dt) {
        case SDPA_FLOAT32: ((float *)data)[off] = (float)x; break;
        case SDPA_BFLOAT16: ((uint16_t *)data)[off] = sdpa_f32_to_bf16((float)x); break;
        case SDPA_FLOAT16: ((uint16_t *)data)[off] = sdpa_f32_to_f16((float)x); break;
        default: ((double *)data)[off] = x; break;
    }
}

static size_t dtype_size(sdpa_dtype dt) {
    return dt == SDPA_FLOAT64 ? 8 : dt == SDPA_FLOAT32 ? 4 : 2;
}

/* The compute type: float64 for float64 problems, float32 for the others
 * (weights, lse and additive masks are stored in it). */
static sdpa_dtype compute_dtype(sdpa_dtype dt) { return dt == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32; }

static const char *dtype_name(sdpa_dtype dt) {
    switch (dt) {
        case SDPA_FLOAT32: return "f32";
        case SDPA_FLOAT64: return "f64";
        case SDPA_BFLOAT16: return "bf16";
        case SDPA_FLOAT16: return "f16";
        default: return "?";
    }
}

/* Fills every stored element of a float buffer with uniform values in [lo, hi). */
static void fill_uniform(buffer *b, sdpa_dtype dt, double lo, double hi) {
    for (int64_t i = 0; i < b->total; i++) store(b->base, dt, i, lo + (hi - lo) * rng_uniform());
}

/* Sets every element, in the view or not, to x (the sentinel of outputs). */
static void fill_all(buffer *b, sdpa_dtype dt, double x) {
    for (int64_t i = 0; i < b->total; i++) store(b->base, dt, i, x);
}

/* Advances a multi-index over dims [0, nd) of sizes n, last dim fastest;
 * returns 0 after the last index. */
static int next_index(int64_t *idx, const int64_t *n, int nd) {
    for (int d = nd - 1; d >= 0; d--) {
        if (++idx[d] < n[d]) return 1;
        idx[d] = 0;
    }
    return 0;
}

static int64_t product(const int64_t *n, int nd) {
    int64_t p = 1;
    for (int d = 0; d < nd; d++) p *= n[d];
    return p;
}

/* ---- test cases ---- */

enum mask_mode { MASK_NONE, MASK_BOOL, MASK_ADD };
enum causal_mode { CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT, CAUSAL_OFFSET };

typedef struct test_case {
    char name[96];
    sdpa_dtype dtype;     /* of query and out                                */
    sdpa_dtype kv_dtype;  /* of key and value                                */
    int nb;
    int64_t batch[SDPA_MAX_BATCH_DIMS];
    int64_t H, G, L, S, E, Ev;
    int mask;             /* enum mask_mode                                   */
    int causal;           /* enum causal_mode                                 */
    int64_t offset;       /* the causal offset for CAUSAL_OFFSET              */
    int weights, lse;     /* request these outputs                            */
    int key_lengths;      /* per-batch key lengths                            */
    int style_in, style_out; /* enum layout_style of inputs / outputs         */
    unsigned bq, bkv, bm, bkl; /* broadcast dims of q, k and v, mask, key lengths:
                                  bit d = logical dim d (batch dims, then head,
                                  row, column; the mask may broadcast any)   */
    double scale;         /* 0: 1 / sqrt(E)                                   */
} test_case;

static test_case make_case(const char *name, sdpa_dtype dt, int64_t H, int64_t G, int64_t L, int64_t S,
                           int64_t E, int64_t Ev) {
    test_case tc;
    memset(&tc, 0, sizeof(tc));
    snprintf(tc.name, sizeof(tc.name), "%s", name);
    tc.dtype = dt;
    tc.kv_dtype = dt;
    tc.H = H;
    tc.G = G;
    tc.L = L;
    tc.S = S;
    tc.E = E;
    tc.Ev = Ev;
    return tc;
}

static const char *const MASK_NAMES[] = {"none", "bool", "additive"};
static const char *const CAUSAL_NAMES[] = {"none", "top-left", "bottom-right", "offset"};

/* All buffers of one case, with the reference results (double, dense). */
typedef struct instance {
    const test_case *tc;
    sdpa_problem p;
    buffer q, k, v, out, mask, weights, lse, kl;
    int64_t count; /* batch count */
    double *ref_out, *ref_w, *ref_lse;
} instance;

static const char *const ISAS[] = {"scalar", "avx2", "avx512", "avx512_bf16", "amx", "neon", "neon_bf16"};
#define NUM_ISAS ((int)(sizeof(ISAS) / sizeof(ISAS[0])))

/* The set SDPA_ISA names, if any: then the cases run on it alone (one test
 * per set, as ctest registers them under an emulator), else on every set. */
static const char *only_isa = NULL;

static int tested(const char *isa) {
    return sdpa_isa_supported(isa) && (!only_isa || strcmp(isa, only_isa) == 0);
}

static void instance_build(instance *in, const test_case *tc) {
    memset(in, 0, sizeof(*in));
    in->tc = tc;
    const sdpa_dtype dt = tc->dtype, kvdt = tc->kv_dtype, cdt = compute_dtype(dt);
    const size_t es = dtype_size(dt), kves = dtype_size(kvdt), ces = dtype_size(cdt);
    const int nb = tc->nb;
    const int64_t Hkv = tc->H / tc->G;
    int64_t dims[MAX_DIMS];
    memcpy(dims, tc->batch, sizeof(int64_t) * (size_t)nb);
    in->count = product(tc->batch, nb);

    dims[nb] = tc->H, dims[nb + 1] = tc->L, dims[nb + 2] = tc->E;
    buffer_make(&in->q, nb + 3, dims, es, tc->bq, tc->style_in);
    fill_uniform(&in->q, dt, -1, 1);
    dims[nb] = Hkv, dims[nb + 1] = tc->S, dims[nb + 2] = tc->E;
    buffer_make(&in->k, nb + 3, dims, kves, tc->bkv, tc->style_in);
    fill_uniform(&in->k, kvdt, -1, 1);
    dims[nb + 2] = tc->Ev;
    buffer_make(&in->v, nb + 3, dims, kves, tc->bkv, tc->style_in);
    fill_uniform(&in->v, kvdt, -1, 1);
    dims[nb] = tc->H, dims[nb + 1] = tc->L, dims[nb + 2] = tc->Ev;
    buffer_make(&in->out, nb + 3, dims, es, 0, tc->style_out);

    dims[nb + 2] = tc->S;
    if (tc->mask != MASK_NONE) {
        /* bool: 80% visible; additive: values in [-1, 1), 10% -inf.  About one
           stored row in ten is then masked completely. */
        const int is_bool = tc->mask == MASK_BOOL;
        buffer_make(&in->mask, nb + 3, dims, is_bool ? 1 : ces, tc->bm, tc->style_in);
        for (int64_t i = 0; i < in->mask.total; i++) {
            if (is_bool) in->mask.base[i] = rng_uniform() < 0.8;
            else store(in->mask.base, cdt, i, rng_uniform() < 0.1 ? -INFINITY : 2 * rng_uniform() - 1);
        }
        int64_t idx[MAX_DIMS] = {0};
        const int64_t rows = tc->S > 0 ? product(dims, nb + 2) : 0;
        for (int64_t r = 0; r < rows; r++, next_index(idx, dims, nb + 2)) {
            if (rng_int(0, 9) != 0) continue;
            for (idx[nb + 2] = 0; idx[nb + 2] < tc->S; idx[nb + 2]++) {
                const int64_t off = buffer_off(&in->mask, idx);
                if (is_bool) in->mask.data[off] = 0;
                else store(in->mask.data, cdt, off, -INFINITY);
            }
            idx[nb + 2] = 0;
        }
    }
    if (tc->weights) buffer_make(&in->weights, nb + 3, dims, ces, 0, tc->style_out);
    if (tc->lse) buffer_make(&in->lse, nb + 2, dims, ces, 0, tc->style_out);
    if (tc->key_lengths) {
        /* nb == 0 still has one key length: a 1-dim buffer of size 1 */
        int64_t one = 1;
        buffer_make(&in->kl, nb > 0 ? nb : 1, nb > 0 ? tc->batch : &one, sizeof(int64_t), tc->bkl,
                    tc->style_in);
        int64_t *kl = (int64_t *)in->kl.base;
        for (int64_t i = 0; i < in->kl.total; i++) {
            switch (rng_int(0, 5)) {
                case 0: kl[i] = 0; break;
                case 1: kl[i] = tc->S + rng_int(1, 5); break;   /* clipped to S */
                case 2: kl[i] = -rng_int(1, 3); break;          /* clipped to 0 */
                default: kl[i] = rng_int(0, tc->S); break;
            }
        }
        if (in->kl.total > 1) kl[0] = tc->S > 1 ? tc->S - 1 : tc->S;
    }

    sdpa_problem *p = &in->p;
    sdpa_problem_init(p);
    p->dtype = dt;
    if (kvdt != dt) p->kv_dtype = kvdt;
    p->num_batch_dims = nb;
    for (int d = 0; d < nb; d++) p->batch_shape[d] = tc->batch[d];
    p->num_heads = tc->H;
    p->gqa_group = tc->G;
    p->len_q = tc->L;
    p->len_kv = tc->S;
    p->head_dim = tc->E;
    p->head_dim_v = tc->Ev;
    p->query = buffer_view(&in->q, nb);
    p->key = buffer_view(&in->k, nb);
    p->value = buffer_view(&in->v, nb);
    p->out = buffer_view(&in->out, nb);
    p->scale = tc->scale != 0 ? tc->scale : 1.0 / sqrt((double)(tc->E > 0 ? tc->E : 1));
    if (tc->mask != MASK_NONE) {
        p->mask_kind = tc->mask == MASK_BOOL ? SDPA_MASK_BOOL : SDPA_MASK_ADDITIVE;
        p->mask = buffer_view(&in->mask, nb);
    }
    switch (tc->causal) {
        case CAUSAL_TOP_LEFT: p->causal = 1, p->causal_offset = 0; break;
        case CAUSAL_BOTTOM_RIGHT: p->causal = 1, p->causal_offset = tc->S - tc->L; break;
        case CAUSAL_OFFSET: p->causal = 1, p->causal_offset = tc->offset; break;
        default: break;
    }
    if (tc->weights) p->weights = buffer_view(&in->weights, nb);
    if (tc->lse) p->lse = buffer_view(&in->lse, nb);
    if (tc->key_lengths) {
        p->key_lengths = (const int64_t *)in->kl.data;
        for (int d = 0; d < nb; d++) p->key_lengths_strides[d] = in->kl.stride[d];
    }
}

static void instance_free(instance *in) {
    buffer_free(&in->q);
    buffer_free(&in->k);
    buffer_free(&in->v);
    buffer_free(&in->out);
    if (in->mask.base) buffer_free(&in->mask);
    if (in->weights.base) buffer_free(&in->weights);
    if (in->lse.base) buffer_free(&in->lse);
    if (in->kl.base) buffer_free(&in->kl);
    free(in->ref_out);
    free(in->ref_w);
    free(in->ref_lse);
}

/*
 * The reference: for each batch index, query head h (key/value head h / G) and
 * query row l, in double precision and in the plainest order:
 *   s_j = scale * q_l . k_j (+ additive mask),  j < S
 *   s_j = -inf where the bool mask is 0, j >= key length, or (causal) j > l + offset
 *   w_j = exp(s_j - max) / sum exp(s - max),  out = sum_j w_j v_j,  lse = max + log(sum)
 * A row with no visible key (or only -inf scores) has zero weights and output
 * and lse = -inf.  Results are stored dense: out (count, H, L, Ev), weights
 * (count, H, L, S), lse (count, H, L).
 */
static void instance_reference(instance *in) {
    const test_case *tc = in->tc;
    const sdpa_problem *p = &in->p;
    const sdpa_dtype dt = tc->dtype;
    const int nb = tc->nb;
    const int64_t H = tc->H, L = tc->L, S = tc->S, E = tc->E, Ev = tc->Ev;
    in->ref_out = (double *)xcalloc((size_t)(in->count * H * L * Ev), sizeof(double));
    in->ref_w = (double *)xcalloc((size_t)(in->count * H * L * S), sizeof(double));
    in->ref_lse = (double *)xcalloc((size_t)(in->count * H * L), sizeof(double));
    double *s = (double *)xcalloc((size_t)S, sizeof(double));

    /* offsets by logical dim: ix holds (batch index..., head, row, col) */
    int64_t ix[MAX_DIMS] = {0};
    for (int64_t b = 0; b < in->count; b++, next_index(ix, tc->batch, nb)) {
        int64_t S_b = S;
        if (tc->key_lengths) {
            /* with no batch dims, kl is one element and ix[0] is 0 */
            const int64_t len = ((const int64_t *)in->kl.data)[buffer_off(&in->kl, ix)];
            S_b = len < 0 ? 0 : (len > S ? S : len);
        }
        for (int64_t h = 0; h < H; h++) {
            const int64_t hkv = h / tc->G;
            ix[nb] = hkv, ix[nb + 1] = ix[nb + 2] = 0;
            const int64_t k0 = buffer_off(&in->k, ix), v0 = buffer_off(&in->v, ix);
            for (int64_t l = 0; l < L; l++) {
                ix[nb] = h, ix[nb + 1] = l;
                const int64_t q0 = buffer_off(&in->q, ix);
                const int64_t m0 = tc->mask != MASK_NONE ? buffer_off(&in->mask, ix) : 0;
                double mx = -INFINITY;
                for (int64_t j = 0; j < S; j++) {
                    double dot = 0;
                    for (int64_t c = 0; c < E; c++)
                        dot += load(in->q.data, dt, q0 + c * in->q.stride[nb + 2]) *
                               load(in->k.data, tc->kv_dtype, k0 + j * in->k.stride[nb + 1] + c * in->k.stride[nb + 2]);
                    double sj = p->scale * dot;
                    int visible = j < S_b && (!p->causal || j - l <= p->causal_offset); /* no overflow */
                    const int64_t mj = m0 + j * (tc->mask != MASK_NONE ? in->mask.stride[nb + 2] : 0);
                    if (tc->mask == MASK_BOOL) visible &= in->mask.data[mj] != 0;
                    if (tc->mask == MASK_ADD) sj += load(in->mask.data, compute_dtype(dt), mj);
                    s[j] = visible ? sj : -INFINITY;
                    if (s[j] > mx) mx = s[j];
                }
                const int64_t row = (b * H + h) * L + l;
                if (mx == -INFINITY) {
                    in->ref_lse[row] = -INFINITY; /* out and weights stay 0 */
                    continue;
                }
                double sum = 0;
                for (int64_t j = 0; j < S; j++) sum += s[j] = exp(s[j] - mx);
                double *w = in->ref_w + row * S;
                for (int64_t j = 0; j < S; j++) w[j] = s[j] / sum;
                for (int64_t c = 0; c < Ev; c++) {
                    double acc = 0;
                    for (int64_t j = 0; j < S; j++)
                        acc += w[j] * load(in->v.data, tc->kv_dtype, v0 + j * in->v.stride[nb + 1] + c * in->v.stride[nb + 2]);
                    in->ref_out[row * Ev + c] = acc;
                }
                in->ref_lse[row] = mx + log(sum);
            }
        }
        ix[nb] = ix[nb + 1] = ix[nb + 2] = 0;
    }
    free(s);
}

/* Distance of a result from the reference, scaled by (1 + |ref|); infinities
 * must match exactly, NaN never does. */
static double rel_err(double got, double ref) {
    if (isinf(ref) || isinf(got)) return got == ref ? 0 : INFINITY;
    if (isnan(got) || isnan(ref)) return INFINITY;
    return fabs(got - ref) / (1 + fabs(ref));
}

#define SENTINEL (-776.0) /* exact in every element type */

typedef struct compare_result {
    double err_out, err_w, err_lse; /* largest rel_err of each output */
    int64_t pad_touched;            /* elements outside the views that changed */
    char where[160];                /* the first element beyond tolerance */
} compare_result;

static void note_where(compare_result *r, const char *what, const int64_t *idx, int nd, double got,
                       double ref) {
    if (r->where[0]) return;
    int n = snprintf(r->where, sizeof(r->where), "%s[", what);
    for (int d = 0; d < nd && n < (int)sizeof(r->where); d++)
        n += snprintf(r->where + n, sizeof(r->where) - (size_t)n, "%s%lld", d ? "," : "", (long long)idx[d]);
    if (n < (int)sizeof(r->where))
        snprintf(r->where + n, sizeof(r->where) - (size_t)n, "] got %.9g want %.9g", got, ref);
}

/* Compares one output buffer with its dense reference and checks that the
 * elements outside its view still hold the sentinel. */
static double compare_buffer(const buffer *b, sdpa_dtype dt, const double *ref, double tol, const char *what,
                             compare_result *r) {
    double worst = 0;
    const int64_t n = product(b->n, b->nd);
    unsigned char *seen = (unsigned char *)xcalloc((size_t)b->total, 1);
    int64_t idx[MAX_DIMS] = {0};
    for (int64_t i = 0; i < n; i++, next_index(idx, b->n, b->nd)) {
        const int64_t off = buffer_off(b, idx);
        seen[b->offset + off] = 1;
        const double got = load(b->data, dt, off), e = rel_err(got, ref[i]);
        if (e > worst) worst = e;
        if (e > tol) note_where(r, what, idx, b->nd, got, ref[i]);
    }
    for (int64_t i = 0; i < b->total; i++)
        if (!seen[i] && load(b->base, dt, i) != SENTINEL) r->pad_touched++;
    free(seen);
    return worst;
}

static void reset_outputs(instance *in) {
    fill_all(&in->out, in->tc->dtype, SENTINEL);
    if (in->weights.base) fill_all(&in->weights, compute_dtype(in->tc->dtype), SENTINEL);
    if (in->lse.base) fill_all(&in->lse, compute_dtype(in->tc->dtype), SENTINEL);
}

/* A copy of the raw bytes of every output buffer, padding included. */
static unsigned char *snapshot(const instance *in, size_t *len) {
    const buffer *bs[3] = {&in->out, &in->weights, &in->lse};
    size_t total = 0;
    for (int i = 0; i < 3; i++)
        if (bs[i]->base) total += (size_t)bs[i]->total * bs[i]->elem;
    unsigned char *snap = (unsigned char *)xcalloc(total, 1), *at = snap;
    for (int i = 0; i < 3; i++)
        if (bs[i]->base) {
            memcpy(at, bs[i]->base, (size_t)bs[i]->total * bs[i]->elem);
            at += (size_t)bs[i]->total * bs[i]->elem;
        }
    *len = total;
    return snap;
}

static void describe(const test_case *tc, char *buf, size_t size) {
    char batch[64] = "-";
    int n = 0;
    for (int d = 0; d < tc->nb; d++)
        n += snprintf(batch + n, sizeof(batch) - (size_t)n, "%s%lld", d ? "x" : "", (long long)tc->batch[d]);
    char dts[16];
    snprintf(dts, sizeof(dts), "%s%s%s", dtype_name(tc->dtype), tc->kv_dtype != tc->dtype ? "/" : "",
             tc->kv_dtype != tc->dtype ? dtype_name(tc->kv_dtype) : "");
    snprintf(buf, size, "%s %s B=%s H=%lld/%lld L=%lld S=%lld E=%lld Ev=%lld mask=%s causal=%s%s%s%s layout=%d/%d",
             tc->name, dts, batch, (long long)tc->H,
             (long long)(tc->H / tc->G), (long long)tc->L, (long long)tc->S, (long long)tc->E,
             (long long)tc->Ev, MASK_NAMES[tc->mask], CAUSAL_NAMES[tc->causal], tc->weights ? " +weights" : "",
             tc->lse ? " +lse" : "", tc->key_lengths ? " +key_lengths" : "", tc->style_in, tc->style_out);
}

/* Runs one case on every supported kernel set with 1, 2 and 3 threads. */
static void run_case(const test_case *tc) {
    instance in;
    instance_build(&in, tc);
    instance_reference(&in);
    /* the reference reads the stored (rounded) inputs; a 16-bit output adds
     * its own rounding, half an ulp: 2^-9 (bfloat16) or 2^-12 (float16) */
    const double tol = tc->dtype == SDPA_FLOAT64 ? 1e-12
                       : tc->dtype == SDPA_BFLOAT16 ? 4e-3
                       : tc->dtype == SDPA_FLOAT16 ? 6e-4 : 2e-5;
    const double tol_c = tc->dtype == SDPA_FLOAT64 ? 1e-12 : 2e-5; /* weights, lse: compute type */
    const sdpa_dtype cdt = compute_dtype(tc->dtype);
    char desc[256];
    describe(tc, desc, sizeof(desc));

    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i])) continue;
        sdpa_set_isa(ISAS[i]);
        unsigned char *first = NULL;
        size_t first_len = 0;
        int identical = 1, status_ok = 1;
        sdpa_status bad = SDPA_OK;
        compare_result r;
        memset(&r, 0, sizeof(r));
        for (int threads = 1; threads <= 3; threads++) {
            reset_outputs(&in);
            in.p.num_threads = threads;
            sdpa_status st = sdpa_attention(&in.p);
            if (st != SDPA_OK) {
                status_ok = 0;
                bad = st;
                break;
            }
            if (threads == 1) {
                r.err_out = compare_buffer(&in.out, tc->dtype, in.ref_out, tol, "out", &r);
                if (in.weights.base) r.err_w = compare_buffer(&in.weights, cdt, in.ref_w, tol_c, "weights", &r);
                if (in.lse.base) r.err_lse = compare_buffer(&in.lse, cdt, in.ref_lse, tol_c, "lse", &r);
                first = snapshot(&in, &first_len);
            } else {
                size_t len;
                unsigned char *snap = snapshot(&in, &len);
                if (len != first_len || memcmp(snap, first, len) != 0) identical = 0;
                free(snap);
            }
        }
        free(first);
        if (!status_ok) {
            check(0, "[%s] %s: status %d (%s)", ISAS[i], desc, (int)bad, sdpa_status_message(bad));
            continue;
        }
        const int accurate = r.err_out <= tol && r.err_w <= tol_c && r.err_lse <= tol_c && r.pad_touched == 0;
        check(accurate, "[%s] %s: max err out %.2g weights %.2g lse %.2g%s%s%s", ISAS[i], desc, r.err_out,
              r.err_w, r.err_lse, r.pad_touched ? ", elements outside the views written" : "",
              r.where[0] ? ", first: " : "", r.where);
        check(identical, "[%s] %s: threads 1, 2, 3 bitwise identical", ISAS[i], desc);
    }
    instance_free(&in);
}

/* ---- argument and status checks ---- */

/* A valid problem on small static buffers (L = S = E = Ev = 2, one head). */
static float vq[4], vk[4], vv[4], vo[4];

static void valid_problem(sdpa_problem *p) {
    sdpa_problem_init(p);
    p->num_heads = 1;
    p->len_q = p->len_kv = p->head_dim = p->head_dim_v = 2;
    sdpa_view *views[4] = {&p->query, &p->key, &p->value, &p->out};
    float *data[4] = {vq, vk, vv, vo};
    for (int i = 0; i < 4; i++) {
        views[i]->data = data[i];
        views[i]->row_stride = 2;
        views[i]->col_stride = 1;
    }
}

static void check_status(sdpa_status got, sdpa_status want, const char *what) {
    check(got == want, "status: %s -> %d (%s), want %d", what, (int)got, sdpa_status_message(got), (int)want);
}

/* sdpa_check on a problem one field has broken: the status sdpa_attention
 * returns, and the name of that field. */
static void check_field(sdpa_problem *p, sdpa_status want, const char *want_field, const char *what) {
    const char *field = "unset";
    const sdpa_status got = sdpa_check(p, &field);
    check(got == want && field && strcmp(field, want_field) == 0, "sdpa_check: %s -> %d (%s), field %s; want %d, %s",
          what, (int)got, sdpa_status_message(got), field ? field : "NULL", (int)want, want_field);
    check_status(sdpa_attention(p), want, what);
    check(sdpa_check(p, NULL) == want, "sdpa_check without a field: %s", what);
}

static void test_check(void) {
    sdpa_problem p;
    const char *field = "unset";
    check(sdpa_check(NULL, &field) == SDPA_ERR_NULL_POINTER && field == NULL, "sdpa_check(NULL)");
    valid_problem(&p);
    vo[0] = 12345.0f;
    field = "unset";
    check(sdpa_check(&p, &field) == SDPA_OK && field == NULL && vo[0] == 12345.0f,
          "sdpa_check: a valid problem is SDPA_OK, names no field and computes nothing");
    valid_problem(&p);
    p.dtype = (sdpa_dtype)7;
    check_field(&p, SDPA_ERR_BAD_DTYPE, "dtype", "dtype 7");
    valid_problem(&p);
    p.kv_dtype = SDPA_FLOAT64;
    check_field(&p, SDPA_ERR_BAD_DTYPE, "kv_dtype", "a float32 query with float64 keys");
    const char *names[] = {"num_heads", "len_q", "len_kv", "head_dim", "head_dim_v"};
    for (int i = 0; i < 5; i++) {
        valid_problem(&p);
        int64_t *sizes[] = {&p.num_heads, &p.len_q, &p.len_kv, &p.head_dim, &p.head_dim_v};
        *sizes[i] = -1;
        check_field(&p, SDPA_ERR_BAD_SHAPE, names[i], names[i]);
    }
    valid_problem(&p);
    p.num_batch_dims = 1;
    p.batch_shape[0] = -3;
    check_field(&p, SDPA_ERR_BAD_SHAPE, "batch_shape", "batch_shape[0] = -3");
    valid_problem(&p);
    p.gqa_group = 0;
    check_field(&p, SDPA_ERR_BAD_GQA, "gqa_group", "gqa_group 0");
    valid_problem(&p);
    p.mask_kind = (sdpa_mask_kind)9;
    check_field(&p, SDPA_ERR_BAD_MASK, "mask_kind", "mask kind 9");
    valid_problem(&p);
    p.num_threads = -2;
    check_field(&p, SDPA_ERR_BAD_THREADS, "num_threads", "num_threads -2");
    valid_problem(&p);
    p.window_left = -2;
    check_field(&p, SDPA_ERR_BAD_VARIANT, "window_left", "window_left -2");
    valid_problem(&p);
    p.window_right = SDPA_MAX_POSITION + 1;
    check_field(&p, SDPA_ERR_BAD_VARIANT, "window_right", "window_right past SDPA_MAX_POSITION");
    valid_problem(&p);
    p.softcap = -1.0;
    check_field(&p, SDPA_ERR_BAD_VARIANT, "softcap", "softcap -1");
    valid_problem(&p);
    p.offsets_from_end = 1;
    check_field(&p, SDPA_ERR_BAD_RAGGED, "offsets_from_end", "offsets from the end of a dense problem");
    valid_problem(&p);
    p.value.data = NULL;
    check_field(&p, SDPA_ERR_NULL_POINTER, "value", "no value data");
    valid_problem(&p);
    p.out.data = NULL;
    check_field(&p, SDPA_ERR_NULL_POINTER, "out", "no output");
    /* paged: a block id out of range where it is read */
    int32_t table[1] = {3};
    int64_t lengths[1] = {2};
    valid_problem(&p);
    p.num_batch_dims = 1;
    p.batch_shape[0] = 1;
    p.block_size = 2;
    p.num_blocks = 1;
    p.block_table = table;
    p.block_table_stride = 1;
    p.key_lengths = lengths;
    check_field(&p, SDPA_ERR_BAD_PAGES, "block_table", "block id 3 of 1 block");
    table[0] = 0;
    lengths[0] = 5;
    check_field(&p, SDPA_ERR_BAD_PAGES, "key_lengths", "a length past the table");
    /* ragged: prefix sums that do not end at the rows */
    int64_t cu[2] = {0, 1};
    valid_problem(&p);
    p.num_batch_dims = 1;
    p.batch_shape[0] = 1;
    p.cu_seqlens_q = cu;
    check_field(&p, SDPA_ERR_BAD_RAGGED, "cu_seqlens_q", "cu_seqlens_q ending at 1 of 2 rows");
    sdpa_problem other;
    valid_problem(&other);
    other.struct_size = 8;
    field = "unset";
    check(sdpa_check(&other, &field) == SDPA_ERR_ABI && field && strcmp(field, "struct_size") == 0,
          "sdpa_check: another struct's size");
}

static int stop_now(void *data) {
    ++*(int *)data;
    return 1;
}

static int keep_going(void *data) {
    ++*(int *)data;
    return 0;
}

static void test_statuses(void) {
    sdpa_problem p;
    check_status(sdpa_attention(NULL), SDPA_ERR_NULL_POINTER, "NULL problem");

    valid_problem(&p);
    check_status(sdpa_attention(&p), SDPA_OK, "valid 2x2 problem");

    valid_problem(&p);
    p.dtype = (sdpa_dtype)7;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_DTYPE, "dtype 7");

    const char *neg_names[] = {"num_heads", "len_q", "len_kv", "head_dim", "head_dim_v"};
    for (int i = 0; i < 5; i++) {
        valid_problem(&p);
        int64_t *field[] = {&p.num_heads, &p.len_q, &p.len_kv, &p.head_dim, &p.head_dim_v};
        *field[i] = -1;
        char what[64];
        snprintf(what, sizeof(what), "%s = -1", neg_names[i]);
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_SHAPE, what);
    }
    valid_problem(&p);
    p.len_kv = ((int64_t)1 << 61) + 1; /* longer key sequences are refused (stride 0 would allow them) */
    p.key.row_stride = p.value.row_stride = 0;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_SHAPE, "len_kv = 2^61 + 1");
    valid_problem(&p);
    p.num_batch_dims = 1;
    p.batch_shape[0] = -3;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_SHAPE, "batch_shape[0] = -3");
    valid_problem(&p);
    p.num_batch_dims = SDPA_MAX_BATCH_DIMS + 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_SHAPE, "num_batch_dims = SDPA_MAX_BATCH_DIMS + 1");
    valid_problem(&p);
    p.num_batch_dims = -1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_SHAPE, "num_batch_dims = -1");

    valid_problem(&p);
    p.num_heads = 8;
    p.gqa_group = 3;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_GQA, "gqa_group 3 with 8 heads");
    valid_problem(&p);
    p.gqa_group = 0;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_GQA, "gqa_group 0");

    valid_problem(&p);
    p.mask_kind = (sdpa_mask_kind)3;
    p.mask.data = vq;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_MASK, "mask kind 3");

    valid_problem(&p);
    p.num_threads = -1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_THREADS, "num_threads = -1");

    valid_problem(&p);
    p.query.data = NULL;
    check_status(sdpa_attention(&p), SDPA_ERR_NULL_POINTER, "query.data NULL");
    valid_problem(&p);
    p.out.data = NULL;
    check_status(sdpa_attention(&p), SDPA_ERR_NULL_POINTER, "out.data NULL");
    valid_problem(&p);
    p.key.data = NULL;
    check_status(sdpa_attention(&p), SDPA_ERR_NULL_POINTER, "key.data NULL");
    valid_problem(&p);
    p.mask_kind = SDPA_MASK_BOOL;
    check_status(sdpa_attention(&p), SDPA_ERR_NULL_POINTER, "bool mask with mask.data NULL");

    /* the model variants: window sides -1 or in [0, 2^61], the alignment at
       most 2^61 in magnitude when a window or ALiBi uses it, softcap finite and
       >= 0 */
    {
        const int64_t big = INT64_C(1) << 61;
        float slope[1] = {0.5f};
        valid_problem(&p);
        p.window_left = -2;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_VARIANT, "window_left = -2");
        valid_problem(&p);
        p.window_right = big + 1;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_VARIANT, "window_right = 2^61 + 1");
        valid_problem(&p);
        p.window_left = p.window_right = big;
        p.align_offset = -big;
        check_status(sdpa_attention(&p), SDPA_OK, "window sides 2^61, align_offset -2^61");
        valid_problem(&p);
        p.window_right = 0;
        p.align_offset = big + 1;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_VARIANT, "a window with align_offset 2^61 + 1");
        valid_problem(&p);
        p.alibi.data = slope;
        p.align_offset = INT64_MIN;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_VARIANT, "ALiBi with align_offset INT64_MIN");
        valid_problem(&p);
        p.sinks.data = slope;
        p.align_offset = INT64_MAX; /* unused without a window or ALiBi */
        check_status(sdpa_attention(&p), SDPA_OK, "sinks with align_offset INT64_MAX (unused)");
        const double bad_caps[] = {NAN, -1, INFINITY, -INFINITY};
        for (int i = 0; i < 4; i++) {
            valid_problem(&p);
            p.softcap = bad_caps[i];
            char what[64];
            snprintf(what, sizeof(what), "softcap = %g", bad_caps[i]);
            check_status(sdpa_attention(&p), SDPA_ERR_BAD_VARIANT, what);
        }
        valid_problem(&p);
        p.softcap = -0.0;
        check_status(sdpa_attention(&p), SDPA_OK, "softcap = -0 (off)");
    }

    valid_problem(&p);
    p.num_batch_dims = 3;
    p.batch_shape[0] = p.batch_shape[1] = p.batch_shape[2] = INT64_C(1) << 30;
    check_status(sdpa_attention(&p), SDPA_ERR_OVERFLOW, "batch 2^30 x 2^30 x 2^30");

    /* an empty output: nothing is read or written, whatever the pointers */
    valid_problem(&p);
    p.len_q = 0;
    p.query.data = p.out.data = p.key.data = p.value.data = NULL;
    check_status(sdpa_attention(&p), SDPA_OK, "L = 0 with NULL data");
    valid_problem(&p);
    p.num_batch_dims = 2;
    p.batch_shape[0] = 3;
    p.batch_shape[1] = 0;
    p.query.data = p.out.data = NULL;
    check_status(sdpa_attention(&p), SDPA_OK, "batch 3 x 0 with NULL data");

    /* the kernel sets */
    check_status(sdpa_set_isa("nonsense"), SDPA_ERR_BAD_ISA, "sdpa_set_isa(\"nonsense\")");
    check(sdpa_has_openmp() ? sdpa_max_threads() >= 8 : sdpa_max_threads() == 1, "sdpa_max_threads() = %d",
          sdpa_max_threads());
    check_status(sdpa_set_isa(NULL), SDPA_ERR_BAD_ISA, "sdpa_set_isa(NULL)");
    {
        int64_t l1d = 0, l2 = 0;
        sdpa_cache_sizes(&l1d, &l2);
        check(l1d >= (8 << 10) && l1d <= (1 << 20) && l2 >= (128 << 10) && l2 <= ((int64_t)256 << 20),
              "sdpa_cache_sizes: L1d %lld, L2 %lld", (long long)l1d, (long long)l2);
        sdpa_cache_sizes(NULL, NULL);  /* either pointer may be NULL */
    }
    check(!sdpa_isa_supported("nonsense") && !sdpa_isa_supported(NULL), "sdpa_isa_supported of unknown names is 0");
    check(sdpa_isa_supported("scalar") == 1, "sdpa_isa_supported(\"scalar\") is 1");
    for (int i = 0; i <= NUM_ISAS; i++) {  /* the library's one list, against the tests' own */
        const char *name = sdpa_isa_name(i);
        check(i < NUM_ISAS ? name && strcmp(name, ISAS[i]) == 0 : name == NULL, "sdpa_isa_name(%d) = %s", i,
              name ? name : "NULL");
    }
    check(sdpa_isa_name(-1) == NULL, "sdpa_isa_name(-1) is NULL");
    for (int i = 0; i < NUM_ISAS; i++) {
        if (sdpa_isa_supported(ISAS[i])) {
            sdpa_status st = sdpa_set_isa(ISAS[i]);
            check(st == SDPA_OK && strcmp(sdpa_isa(), ISAS[i]) == 0, "sdpa_set_isa(\"%s\") -> %s, sdpa_isa() = %s",
                  ISAS[i], sdpa_status_message(st), sdpa_isa());
        } else {
            check_status(sdpa_set_isa(ISAS[i]), SDPA_ERR_BAD_ISA, ISAS[i]);
        }
    }

    /* every status has a message, and no two share one */
    const char *msgs[SDPA_ERR_BAD_VARIANT + 1];
    for (int s = SDPA_OK; s <= SDPA_ERR_BAD_VARIANT; s++) {
        msgs[s] = sdpa_status_message((sdpa_status)s);
        int ok = msgs[s] != NULL && msgs[s][0] != '\0';
        for (int t = 0; ok && t < s; t++) ok = strcmp(msgs[s], msgs[t]) != 0;
        check(ok, "sdpa_status_message(%d) = \"%s\"", s, msgs[s] ? msgs[s] : "(null)");
    }
    const char *unknown = sdpa_status_message((sdpa_status)99);
    check(unknown != NULL && unknown[0] != '\0', "sdpa_status_message(99) = \"%s\"", unknown ? unknown : "(null)");

    /* build facts */
    const char *ver = sdpa_version();
    char want[32];
    snprintf(want, sizeof(want), "%d.%d.%d", SDPA_VERSION_MAJOR, SDPA_VERSION_MINOR, SDPA_VERSION_PATCH);
    check(ver != NULL && strcmp(ver, want) == 0, "sdpa_version() = %s, header says %s", ver ? ver : "(null)", want);
    check(sdpa_default_num_threads() >= 1, "sdpa_default_num_threads() = %d, has_openmp = %d",
          sdpa_default_num_threads(), sdpa_has_openmp());

    /* sdpa_problem_init */
    memset(&p, 0xAB, sizeof(p));
    sdpa_problem_init(&p);
    check(p.gqa_group == 1 && p.scale == 1.0 && p.mask_kind == SDPA_MASK_NONE && p.num_threads == 0 &&
              p.weights.data == NULL && p.lse.data == NULL && p.key_lengths == NULL && p.interrupt == NULL &&
              p.causal == 0 && p.num_batch_dims == 0,
          "sdpa_problem_init: gqa_group 1, scale 1, no mask, weights, lse, key lengths or callback");
    check(p.window_left == -1 && p.window_right == -1 && p.align_offset == 0 && p.softcap == 0 &&
              p.alibi.data == NULL && p.sinks.data == NULL,
          "sdpa_problem_init: no window, softcap, ALiBi or sinks");
    sdpa_problem_init(NULL); /* must not crash */
}

/* The interrupt callback: polled between tiles, nonzero stops the call. */
static void test_interrupt(void) {
    /* buffers for the long call; the short one uses a corner of them */
    const int64_t H = 16, L = 2048, E = 64;
    const size_t n = (size_t)(H * L * E);
    float *q = (float *)xcalloc(n, sizeof(float)), *k = (float *)xcalloc(n, sizeof(float));
    float *v = (float *)xcalloc(n, sizeof(float)), *o = (float *)xcalloc(n, sizeof(float));
    for (size_t i = 0; i < n; i++) {
        q[i] = (float)rng_uniform();
        k[i] = (float)rng_uniform();
        v[i] = (float)rng_uniform();
    }
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.head_dim = p.head_dim_v = E;
    sdpa_view *views[4] = {&p.query, &p.key, &p.value, &p.out};
    float *data[4] = {q, k, v, o};
    for (int i = 0; i < 4; i++) {
        views[i]->data = data[i];
        views[i]->head_stride = L * E;
        views[i]->row_stride = E;
        views[i]->col_stride = 1;
    }
    p.scale = 0.125;

    int calls = 0;
    p.num_heads = 2;
    p.len_q = p.len_kv = quick ? 64 : 512;
    p.interrupt = keep_going;
    p.interrupt_data = &calls;
    sdpa_status st = sdpa_attention(&p);
    check(st == SDPA_OK, "interrupt callback returning 0: %s (%d polls)", sdpa_status_message(st), calls);

    /* the callback is first polled after 20 ms: the full problem takes longer
       (about 8 GFLOP), and the call returns soon after that poll */
    calls = 0;
    p.num_heads = H;
    p.len_q = p.len_kv = L;
    p.interrupt = stop_now;
    p.num_threads = 1;
    const clock_t t0 = clock();
    st = sdpa_attention(&p);
    const double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    if (st == SDPA_OK && calls == 0)
        skip("interrupt: the call finished in %.3f s, before the first poll", secs);
    else
        check(st == SDPA_ERR_INTERRUPTED && calls == 1, "interrupt callback returning 1 -> %s after %d poll(s), %.3f s",
              sdpa_status_message(st), calls, secs);
    free(q);
    free(k);
    free(v);
    free(o);
}

/* The worked example: Q = K = I, V = [[2, 3], [4, 5]], scale 1/sqrt(2). */
static void test_seed_example(sdpa_dtype dt) {
    double q[4] = {1, 0, 0, 1}, v[4] = {2, 3, 4, 5};
    float qf[4], vf[4], of[4], wf[4];
    double od[4], wd[4];
    for (int i = 0; i < 4; i++) qf[i] = (float)q[i], vf[i] = (float)v[i];
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = dt;
    p.num_heads = 1;
    p.len_q = p.len_kv = p.head_dim = p.head_dim_v = 2;
    p.scale = 1 / sqrt(2.0);
    int f32 = dt == SDPA_FLOAT32;
    p.query.data = f32 ? (void *)qf : (void *)q;
    p.key.data = p.query.data;
    p.value.data = f32 ? (void *)vf : (void *)v;
    p.out.data = f32 ? (void *)of : (void *)od;
    p.weights.data = f32 ? (void *)wf : (void *)wd;
    sdpa_view *views[5] = {&p.query, &p.key, &p.value, &p.out, &p.weights};
    for (int i = 0; i < 5; i++) views[i]->row_stride = 2, views[i]->col_stride = 1;
    sdpa_status st = sdpa_attention(&p);
    const double ew[4] = {0.67, 0.33, 0.33, 0.67}, eo[4] = {2.66, 3.66, 3.34, 4.34};
    int ok = st == SDPA_OK;
    for (int i = 0; i < 4 && ok; i++) {
        double w = f32 ? wf[i] : wd[i], o = f32 ? of[i] : od[i];
        ok = lround(w * 100) == lround(ew[i] * 100) && lround(o * 100) == lround(eo[i] * 100);
    }
    double w0 = f32 ? wf[0] : wd[0], o0 = f32 ? of[0] : od[0];
    check(ok, "worked example %s: weights [[0.67, 0.33], [0.33, 0.67]], output [[2.66, 3.66], [3.34, 4.34]] "
              "(got w00 %.4f, o00 %.4f)",
          f32 ? "f32" : "f64", w0, o0);
}

/* ---- the model variants, against what they stand for ---- */

/* One head group of dense, contiguous operands of a float32 or float64
 * problem: q (H, L, E), k (Hkv, S, E), v (Hkv, S, Ev), out (H, L, Ev), weights
 * (H, L, S), lse (H, L); a mask (H, L, S), slopes and sinks (H) when asked. */
typedef struct vprob {
    sdpa_dtype dt;
    size_t es;
    int64_t H, G, L, S, E, Ev;
    void *q, *k, *v, *out, *w, *lse, *mask, *alibi, *sinks;
    sdpa_problem p;
} vprob;

static sdpa_view dense_view(void *data, int64_t rows, int64_t cols) {
    sdpa_view view;
    memset(&view, 0, sizeof(view));
    view.data = data;
    view.head_stride = rows * cols;
    view.row_stride = cols;
    view.col_stride = 1;
    return view;
}

static void vprob_make(vprob *x, sdpa_dtype dt, int64_t H, int64_t G, int64_t L, int64_t S, int64_t E,
                       int64_t Ev) {
    memset(x, 0, sizeof(*x));
    x->dt = dt, x->es = dtype_size(dt);
    x->H = H, x->G = G, x->L = L, x->S = S, x->E = E, x->Ev = Ev;
    const int64_t Hkv = H / G;
    x->q = xcalloc((size_t)(H * L * E), x->es);
    x->k = xcalloc((size_t)(Hkv * S * E), x->es);
    x->v = xcalloc((size_t)(Hkv * S * Ev), x->es);
    x->out = xcalloc((size_t)(H * L * Ev), x->es);
    x->w = xcalloc((size_t)(H * L * S), x->es);
    x->lse = xcalloc((size_t)(H * L), x->es);
    x->alibi = xcalloc((size_t)H, x->es);
    x->sinks = xcalloc((size_t)H, x->es);
    for (int64_t i = 0; i < H * L * E; i++) store(x->q, dt, i, 2 * rng_uniform() - 1);
    for (int64_t i = 0; i < Hkv * S * E; i++) store(x->k, dt, i, 2 * rng_uniform() - 1);
    for (int64_t i = 0; i < Hkv * S * Ev; i++) store(x->v, dt, i, 2 * rng_uniform() - 1);
    sdpa_problem *p = &x->p;
    sdpa_problem_init(p);
    p->dtype = dt;
    p->num_heads = H, p->gqa_group = G;
    p->len_q = L, p->len_kv = S, p->head_dim = E, p->head_dim_v = Ev;
    p->query = dense_view(x->q, L, E);
    p->key = dense_view(x->k, S, E);
    p->value = dense_view(x->v, S, Ev);
    p->out = dense_view(x->out, L, Ev);
    p->weights = dense_view(x->w, L, S);
    p->lse = dense_view(x->lse, L, 1);
    p->scale = 1 / sqrt((double)E);
}

static void vprob_free(vprob *x) {
    void *bufs[] = {x->q, x->k, x->v, x->out, x->w, x->lse, x->mask, x->alibi, x->sinks};
    for (int i = 0; i < 9; i++) free(bufs[i]);
}

/* A dense mask (H, L, S) of the compute type (additive) or bytes (bool). */
static void vprob_mask(vprob *x, sdpa_mask_kind kind) {
    free(x->mask);
    x->mask = xcalloc((size_t)(x->H * x->L * x->S), kind == SDPA_MASK_BOOL ? 1 : x->es);
    x->p.mask_kind = kind;
    x->p.mask = dense_view(x->mask, x->L, x->S);
}

/* The results of a call as doubles: out, then weights, then lse. */
typedef struct vresult {
    sdpa_status st;
    double *out, *w, *lse;
} vresult;

static vresult vprob_run(vprob *x) {
    vresult r;
    const int64_t no = x->H * x->L * x->Ev, nw = x->H * x->L * x->S, nl = x->H * x->L;
    r.st = sdpa_attention(&x->p);
    r.out = (double *)xcalloc((size_t)no, sizeof(double));
    r.w = (double *)xcalloc((size_t)nw, sizeof(double));
    r.lse = (double *)xcalloc((size_t)nl, sizeof(double));
    for (int64_t i = 0; i < no; i++) r.out[i] = load(x->out, x->dt, i);
    for (int64_t i = 0; i < nw; i++) r.w[i] = load(x->w, x->dt, i);
    for (int64_t i = 0; i < nl; i++) r.lse[i] = load(x->lse, x->dt, i);
    return r;
}

static void vresult_free(vresult *r) {
    free(r->out);
    free(r->w);
    free(r->lse);
}

/* The largest rel_err over n elements of got (stride gs) against want (stride ws). */
static double max_err(const double *got, int64_t gs, const double *want, int64_t ws, int64_t n) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const double e = rel_err(got[i * gs], want[i * ws]);
        if (e > worst) worst = e;
    }
    return worst;
}

/* Whether two results agree within tol: out, weights (the first S keys of a
 * row of `want`, which may have more) and lse. */
static int vresult_close(const vprob *x, const vresult *got, const vresult *want, int64_t want_S, double tol,
                         double *worst) {
    const int64_t rows = x->H * x->L;
    double e = max_err(got->out, 1, want->out, 1, rows * x->Ev);
    e = fmax(e, max_err(got->lse, 1, want->lse, 1, rows));
    for (int64_t r = 0; r < rows; r++) e = fmax(e, max_err(got->w + r * x->S, 1, want->w + r * want_S, 1, x->S));
    *worst = e;
    return got->st == SDPA_OK && want->st == SDPA_OK && e <= tol;
}

/* The attention of vprob x with softcap `cap` (and nothing else), in double. */
static void softcap_reference(const vprob *x, double cap, double *out, double *lse) {
    double *s = (double *)xcalloc((size_t)x->S, sizeof(double));
    for (int64_t h = 0; h < x->H; h++)
        for (int64_t l = 0; l < x->L; l++) {
            const int64_t hkv = h / x->G, row = h * x->L + l;
            double mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < x->S; j++) {
                double dot = 0;
                for (int64_t c = 0; c < x->E; c++)
                    dot += load(x->q, x->dt, row * x->E + c) * load(x->k, x->dt, (hkv * x->S + j) * x->E + c);
                s[j] = cap * tanh(x->p.scale * dot / cap);
                mx = fmax(mx, s[j]);
            }
            for (int64_t j = 0; j < x->S; j++) sum += s[j] = exp(s[j] - mx);
            for (int64_t c = 0; c < x->Ev; c++) {
                double acc = 0;
                for (int64_t j = 0; j < x->S; j++) acc += s[j] / sum * load(x->v, x->dt, (hkv * x->S + j) * x->Ev + c);
                out[row * x->Ev + c] = acc;
            }
            lse[row] = mx + log(sum);
        }
    free(s);
}

/* Each variant against what it stands for, for one shape: the window against
 * the bool mask of the same keys, ALiBi against the additive mask of its
 * distances, a sink against an extra key of score `sink` and value 0, the
 * softcap against a double-precision reference. */
static void variant_cases(const char *isa, sdpa_dtype dt, int64_t H, int64_t G, int64_t L, int64_t S) {
    const int64_t E = 16, Ev = 24;
    const double tol = dt == SDPA_FLOAT64 ? 1e-12 : 2e-5;
    char shape[96];
    snprintf(shape, sizeof(shape), "[%s] %s H=%lld/%lld L=%lld S=%lld", isa, dtype_name(dt), (long long)H,
             (long long)(H / G), (long long)L, (long long)S);
    vprob x;
    vprob_make(&x, dt, H, G, L, S, E, Ev);
    double err;

    /* windows: (left, right, align_offset) */
    const int64_t windows[][3] = {{5, 2, S - L}, {-1, 0, 0}, {0, 3, -4}, {7, -1, S - L}, {2, 2, S + 10}};
    for (int i = 0; i < 5; i++) {
        const int64_t left = windows[i][0], right = windows[i][1], off = windows[i][2];
        x.p.window_left = left, x.p.window_right = right, x.p.align_offset = off;
        vresult a = vprob_run(&x);
        x.p.window_left = x.p.window_right = -1, x.p.align_offset = 0;
        vprob_mask(&x, SDPA_MASK_BOOL);
        for (int64_t h = 0; h < H; h++)
            for (int64_t l = 0; l < L; l++)
                for (int64_t j = 0; j < S; j++)
                    ((uint8_t *)x.mask)[(h * L + l) * S + j] =
                        (left < 0 || j >= l + off - left) && (right < 0 || j <= l + off + right);
        vresult b = vprob_run(&x);
        const int same = vresult_close(&x, &a, &b, S, tol, &err);
        check(same, "%s: window (%lld, %lld) aligned at %lld = its bool mask (err %.2g)",
              shape, (long long)left, (long long)right, (long long)off, err);
        vresult_free(&a);
        vresult_free(&b);
        x.p.mask_kind = SDPA_MASK_NONE;
    }

    /* ALiBi, with a window and causality on top */
    for (int64_t h = 0; h < H; h++) store(x.alibi, dt, h, ldexp(1.0, -(int)(h + 1)));
    x.p.alibi = dense_view(x.alibi, 1, 1);
    x.p.align_offset = S - L;
    x.p.window_left = 9;
    x.p.causal = 1, x.p.causal_offset = S - L;
    vresult a = vprob_run(&x);
    x.p.alibi.data = NULL;
    vprob_mask(&x, SDPA_MASK_ADDITIVE);
    for (int64_t h = 0; h < H; h++)
        for (int64_t l = 0; l < L; l++)
            for (int64_t j = 0; j < S; j++)
                store(x.mask, dt, (h * L + l) * S + j, -load(x.alibi, dt, h) * fabs((double)(l + S - L - j)));
    vresult b = vprob_run(&x);
    int same = vresult_close(&x, &a, &b, S, tol, &err);
    check(same, "%s: ALiBi = its additive mask, with a window and causality (err %.2g)",
          shape, err);
    vresult_free(&a);
    vresult_free(&b);
    x.p.mask_kind = SDPA_MASK_NONE, x.p.window_left = -1, x.p.causal = 0;

    /* sinks: one more key, of score `sink` (a zero key and an additive mask)
       and value 0 */
    for (int64_t h = 0; h < H; h++) store(x.sinks, dt, h, h == 0 ? 3.0 : h == 1 ? -INFINITY : -0.5 * (double)h);
    x.p.sinks = dense_view(x.sinks, 1, 1);
    a = vprob_run(&x);
    {
        vprob y;
        vprob_make(&y, dt, H, G, L, S + 1, E, Ev);
        const int64_t Hkv = H / G;
        memcpy(y.q, x.q, (size_t)(H * L * E) * x.es);
        for (int64_t hk = 0; hk < Hkv; hk++) {
            memcpy((char *)y.k + (size_t)(hk * (S + 1) * E) * x.es, (char *)x.k + (size_t)(hk * S * E) * x.es,
                   (size_t)(S * E) * x.es);
            memcpy((char *)y.v + (size_t)(hk * (S + 1) * Ev) * x.es, (char *)x.v + (size_t)(hk * S * Ev) * x.es,
                   (size_t)(S * Ev) * x.es);
            for (int64_t c = 0; c < E; c++) store(y.k, dt, (hk * (S + 1) + S) * E + c, 0);
            for (int64_t c = 0; c < Ev; c++) store(y.v, dt, (hk * (S + 1) + S) * Ev + c, 0);
        }
        y.p.scale = x.p.scale;
        vprob_mask(&y, SDPA_MASK_ADDITIVE);
        for (int64_t h = 0; h < H; h++)
            for (int64_t l = 0; l < L; l++) store(y.mask, dt, (h * L + l) * (S + 1) + S, load(x.sinks, dt, h));
        b = vprob_run(&y);
        same = vresult_close(&x, &a, &b, S + 1, tol, &err);
        check(same, "%s: sinks = one more key of score sink and value 0 (err %.2g)",
              shape, err);
        vresult_free(&b);
        vprob_free(&y);
    }
    /* a sink of -inf is no sink, to the bit */
    x.p.sinks.data = NULL;
    b = vprob_run(&x);
    const int64_t lh = L; /* head 1's rows */
    check(memcmp(a.out + lh * Ev, b.out + lh * Ev, (size_t)(L * Ev) * sizeof(double)) == 0 &&
              memcmp(a.lse + lh, b.lse + lh, (size_t)L * sizeof(double)) == 0,
          "%s: a sink of -inf gives the bits of no sink", shape);
    vresult_free(&a);
    vresult_free(&b);
    /* rows that see no key: zeros, weights 0 and lse = the sink */
    x.p.sinks.data = x.sinks;
    x.p.window_left = x.p.window_right = 0, x.p.align_offset = -L - 5;
    a = vprob_run(&x);
    int empty_ok = a.st == SDPA_OK;
    for (int64_t i = 0; i < H * L * Ev; i++) empty_ok &= a.out[i] == 0;
    for (int64_t i = 0; i < H * L * S; i++) empty_ok &= a.w[i] == 0;
    for (int64_t i = 0; i < H * L; i++) empty_ok &= a.lse[i] == load(x.sinks, dt, i / L);
    check(empty_ok, "%s: rows that see no key give zeros, and the sink as lse", shape);
    vresult_free(&a);
    x.p.sinks.data = NULL, x.p.window_left = x.p.window_right = -1, x.p.align_offset = 0;

    /* softcap */
    double *ro = (double *)xcalloc((size_t)(H * L * Ev), sizeof(double));
    double *rl = (double *)xcalloc((size_t)(H * L), sizeof(double));
    for (int i = 0; i < 2; i++) {
        const double cap = i == 0 ? 0.3 : 30;
        x.p.softcap = cap;
        x.p.scale = 4; /* scores of a few units: the cap matters */
        a = vprob_run(&x);
        softcap_reference(&x, cap, ro, rl);
        err = fmax(max_err(a.out, 1, ro, 1, H * L * Ev), max_err(a.lse, 1, rl, 1, H * L));
        check(a.st == SDPA_OK && err <= tol, "%s: softcap %g against the reference (err %.2g)", shape, cap, err);
        vresult_free(&a);
    }
    /* caps beyond the compute type's range give finite results: a tiny one
       makes every score about 0 (the mean of the values); the first query row,
       of zeros, has scores of exactly 0 */
    for (int64_t c = 0; c < E; c++) store(x.q, dt, c, 0);
    const double far_caps[] = {1e-300, 4.9e-324, 1e39, 1e300};
    for (int i = 0; i < 4; i++) {
        x.p.softcap = far_caps[i];
        a = vprob_run(&x);
        int finite = a.st == SDPA_OK;
        for (int64_t j = 0; j < H * L * Ev; j++) finite &= isfinite(a.out[j]);
        for (int64_t j = 0; j < H * L; j++) finite &= isfinite(a.lse[j]);
        if (far_caps[i] < 1) {
            softcap_reference(&x, far_caps[i] < 1e-300 ? 1e-300 : far_caps[i], ro, rl);
            err = max_err(a.out, 1, ro, 1, H * L * Ev);
        } else {
            err = 0;
        }
        check(finite && err <= tol, "%s: softcap %g gives finite results (err %.2g)", shape, far_caps[i], err);
        vresult_free(&a);
    }
    free(ro);
    free(rl);
    vprob_free(&x);
}

static void test_variants(void) {
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i])) continue;
        sdpa_set_isa(ISAS[i]);
        for (int d = 0; d < 2; d++) {
            const sdpa_dtype dt = d == 0 ? SDPA_FLOAT32 : SDPA_FLOAT64;
            variant_cases(ISAS[i], dt, 4, 2, 3, 70);                   /* 6 rows per group: row mode */
            variant_cases(ISAS[i], dt, 2, 1, quick ? 20 : 37, quick ? 80 : 150); /* tiled, several key tiles */
        }
    }
}

/* ---- the case lists ---- */

static const int64_t SWEEP_LENS[] = {0, 1, 7, 64, 65, 130, 300};
static const int64_t SWEEP_DIMS[] = {1, 8, 31, 64, 80, 128};

/* L x S over SWEEP_LENS, E and Ev cycling over SWEEP_DIMS, the options drawn
 * at random (but reproducibly) for each pair. */
static void sweep(sdpa_dtype dt, sdpa_dtype kvdt) {
    const int nl = quick ? 5 : 7; /* quick: L, S in 0, 1, 7, 64, 65 */
    const int nd = quick ? 4 : 6; /* quick: E, Ev in 1, 8, 31, 64 */
    for (int i = 0; i < nl; i++)
        for (int j = 0; j < nl; j++) {
            const int64_t L = SWEEP_LENS[i], S = SWEEP_LENS[j];
            const int64_t E = SWEEP_DIMS[(i + 2 * j) % nd], Ev = SWEEP_DIMS[(2 * i + j + 1) % nd];
            test_case tc = make_case("sweep", dt, 2, 1, L, S, E, Ev);
            tc.kv_dtype = kvdt;
            tc.nb = 1;
            tc.batch[0] = 2;
            tc.mask = (int)rng_int(0, 2);
            tc.causal = (int)rng_int(0, 2);
            tc.weights = rng_int(0, 1);
            tc.lse = rng_int(0, 1);
            tc.style_in = (int)rng_int(0, 2);
            tc.style_out = (int)rng_int(0, 1);
            run_case(&tc);
        }
}

/* make_case with the key/value dtype of the feature cases */
static sdpa_dtype case_kv_dtype;

static test_case make_kv_case(const char *name, sdpa_dtype dt, int64_t H, int64_t G, int64_t L, int64_t S,
                              int64_t E, int64_t Ev) {
    test_case tc = make_case(name, dt, H, G, L, S, E, Ev);
    tc.kv_dtype = case_kv_dtype;
    return tc;
}

static void feature_cases(sdpa_dtype dt, sdpa_dtype kvdt) {
    case_kv_dtype = kvdt;
    const int64_t big = quick ? 65 : 300, mid = quick ? 33 : 130;
    const int64_t E = quick ? 8 : 64, Ev = quick ? 31 : 80;
    test_case tc;

    /* batch dims that broadcast: K and V over dim 0, Q over dim 1, the mask
       over dim 1 and heads */
    tc = make_kv_case("broadcast batch", dt, 2, 1, mid, mid + 1, E, Ev);
    tc.nb = 2, tc.batch[0] = 2, tc.batch[1] = 3;
    tc.bkv = 1u << 0, tc.bq = 1u << 1;
    tc.mask = MASK_ADD, tc.bm = (1u << 1) | (1u << 2);
    run_case(&tc);
    snprintf(tc.name, sizeof(tc.name), "broadcast batch, mask over keys");
    tc.mask = MASK_BOOL, tc.bm = (1u << 0) | (1u << 4); /* batch dim 0 and the key dim */
    tc.weights = 1;
    run_case(&tc);
    snprintf(tc.name, sizeof(tc.name), "broadcast batch, 3 dims, strided");
    tc.nb = 3, tc.batch[0] = 2, tc.batch[1] = 1, tc.batch[2] = 3;
    tc.bkv = 1u << 2, tc.bq = 1u << 0;
    tc.mask = MASK_BOOL, tc.bm = (1u << 0) | (1u << 4); /* batch dim 0 and the row dim */
    tc.style_in = LAYOUT_STRIDED, tc.style_out = LAYOUT_STRIDED;
    tc.weights = tc.lse = 1;
    run_case(&tc);

    /* grouped-query attention: 8 query heads on 2 key/value heads */
    tc = make_kv_case("gqa", dt, 8, 4, mid, big, E, Ev);
    tc.nb = 1, tc.batch[0] = 2;
    tc.causal = CAUSAL_BOTTOM_RIGHT, tc.weights = tc.lse = 1;
    run_case(&tc);
    tc = make_kv_case("gqa, strided", dt, 6, 3, 3, mid, E, Ev); /* 9 rows per group: tile mode */
    tc.mask = MASK_BOOL, tc.style_in = LAYOUT_STRIDED, tc.lse = 1;
    run_case(&tc);

    /* masks with fully masked rows, on their own and with causality */
    tc = make_kv_case("bool mask", dt, 3, 1, mid, big, E, Ev);
    tc.mask = MASK_BOOL, tc.weights = tc.lse = 1;
    run_case(&tc);
    tc.causal = CAUSAL_TOP_LEFT;
    snprintf(tc.name, sizeof(tc.name), "bool mask, causal");
    run_case(&tc);
    tc = make_kv_case("additive mask", dt, 3, 1, big, mid, E, Ev);
    tc.mask = MASK_ADD, tc.weights = tc.lse = 1;
    run_case(&tc);
    tc.causal = CAUSAL_BOTTOM_RIGHT, tc.style_out = LAYOUT_STRIDED;
    snprintf(tc.name, sizeof(tc.name), "additive mask, causal");
    run_case(&tc);

    /* causal: top-left and bottom-right for L < S and L > S, and offsets */
    const int64_t ls[][2] = {{mid, big}, {big, mid}, {65, 65}, {7, 130}};
    for (int i = 0; i < 4; i++)
        for (int c = CAUSAL_TOP_LEFT; c <= CAUSAL_BOTTOM_RIGHT; c++) {
            tc = make_kv_case("causal", dt, 2, 1, ls[i][0], ls[i][1], E, Ev);
            tc.causal = c, tc.weights = tc.lse = 1;
            run_case(&tc);
        }
    /* offsets near the ends of int64 must neither overflow nor mask every key */
    const int64_t offsets[] = {-5, 17, -200, INT64_MAX, INT64_MAX - 5, INT64_MIN, INT64_MIN + 5};
    for (int i = 0; i < (int)(sizeof(offsets) / sizeof(offsets[0])); i++) {
        tc = make_kv_case("causal offset", dt, 2, 1, mid, mid, E, Ev);
        tc.causal = CAUSAL_OFFSET, tc.offset = offsets[i], tc.lse = tc.weights = 1;
        run_case(&tc);
    }

    /* key lengths (0, clipped, negative) alone, with causality and in row mode */
    tc = make_kv_case("key lengths", dt, 2, 1, mid, big, E, Ev);
    tc.nb = 2, tc.batch[0] = 3, tc.batch[1] = 2, tc.key_lengths = 1;
    tc.weights = tc.lse = 1, tc.style_in = LAYOUT_STRIDED;
    run_case(&tc);
    tc.causal = CAUSAL_BOTTOM_RIGHT, tc.bkl = 1u << 1;
    snprintf(tc.name, sizeof(tc.name), "key lengths, causal, broadcast");
    run_case(&tc);
    tc = make_kv_case("key lengths, no batch dims", dt, 2, 1, mid, big, E, Ev);
    tc.key_lengths = 1, tc.lse = 1;
    run_case(&tc);

    /* transposed and strided views: every operand column-major, then padded,
       permuted and reversed */
    tc = make_kv_case("transposed", dt, 2, 2, big, mid, E, Ev);
    tc.nb = 1, tc.batch[0] = 2;
    tc.style_in = tc.style_out = LAYOUT_TRANSPOSED, tc.weights = tc.lse = 1, tc.mask = MASK_ADD;
    run_case(&tc);
    for (int i = 0; i < 3; i++) {
        tc = make_kv_case("strided", dt, 4, 2, mid - 2 * i, big + i, E + i, Ev - i);
        tc.nb = 1, tc.batch[0] = 2;
        tc.style_in = tc.style_out = LAYOUT_STRIDED, tc.weights = tc.lse = 1;
        tc.mask = 1 + i % 2, tc.causal = i;
        run_case(&tc);
    }

    /* scales: 0 (uniform weights) and large (peaked softmax) */
    tc = make_kv_case("scale 0", dt, 1, 1, mid, big, E, Ev);
    tc.scale = 1e-300, tc.weights = 1; /* effectively 0 */
    run_case(&tc);
    tc = make_kv_case("scale 3", dt, 1, 1, mid, big, 8, Ev);
    tc.scale = 3, tc.weights = tc.lse = 1;
    run_case(&tc);

    /* decoding: few query rows per key/value head, long keys (row mode,
       split into chunks of 1024 keys) */
    const int64_t S_dec = 3000;
    const int64_t Ed = quick ? 8 : 64, Evd = quick ? 8 : 128;
    tc = make_kv_case("decode", dt, 4, 1, 1, S_dec, Ed, Evd);
    tc.nb = 1, tc.batch[0] = 2, tc.lse = 1;
    run_case(&tc);
    tc = make_kv_case("decode gqa 8/2", dt, 8, 4, 1, S_dec, Ed, Evd);
    tc.weights = tc.lse = 1, tc.mask = MASK_BOOL;
    run_case(&tc);
    tc = make_kv_case("decode gqa 8/1", dt, 8, 8, 1, S_dec, Ed, Evd);
    tc.lse = 1, tc.mask = MASK_ADD, tc.style_in = LAYOUT_TRANSPOSED; /* strided K and V rows */
    run_case(&tc);
    tc = make_kv_case("decode L=8 causal", dt, 2, 1, 8, S_dec, Ed, 31);
    tc.causal = CAUSAL_BOTTOM_RIGHT, tc.weights = tc.lse = 1, tc.style_in = LAYOUT_STRIDED;
    run_case(&tc);
    tc = make_kv_case("decode L=4 top-left", dt, 2, 2, 4, S_dec, Ed, Evd);
    tc.causal = CAUSAL_TOP_LEFT, tc.weights = tc.lse = 1;
    run_case(&tc);
    tc = make_kv_case("decode key lengths", dt, 2, 2, 2, S_dec, Ed, Evd);
    tc.nb = 1, tc.batch[0] = 6, tc.key_lengths = 1, tc.weights = tc.lse = 1, tc.style_out = LAYOUT_STRIDED;
    run_case(&tc);
    tc.causal = CAUSAL_BOTTOM_RIGHT, tc.mask = MASK_BOOL, tc.style_in = LAYOUT_STRIDED;
    snprintf(tc.name, sizeof(tc.name), "decode key lengths, causal, mask");
    run_case(&tc);
    const int64_t dec_offsets[] = {-3, -10, 5000, INT64_MAX, INT64_MAX - 5, INT64_MIN};
    for (int i = 0; i < (int)(sizeof(dec_offsets) / sizeof(dec_offsets[0])); i++) {
        /* rows that see no key, an offset past S, and the ends of int64 */
        tc = make_kv_case("decode L=8 causal offset", dt, 2, 1, 8, S_dec, Ed, Evd);
        tc.causal = CAUSAL_OFFSET, tc.offset = dec_offsets[i], tc.weights = tc.lse = 1;
        run_case(&tc);
    }
    tc = make_kv_case("decode chunk edge", dt, 1, 1, 1, 1025, Ed, Evd);
    tc.lse = 1, tc.weights = 1;
    run_case(&tc);
    tc = make_kv_case("decode S=0", dt, 2, 1, 1, 0, Ed, Evd);
    tc.lse = 1;
    run_case(&tc);

    /* tiny and empty head dims: E = 0 gives zero scores (uniform weights),
       Ev = 0 an empty output but full weights and lse */
    tc = make_kv_case("E=1 Ev=1", dt, 2, 1, mid, big, 1, 1);
    tc.weights = tc.lse = 1, tc.causal = CAUSAL_TOP_LEFT;
    run_case(&tc);
    for (int row_mode = 0; row_mode < 2; row_mode++) {
        const int64_t L = row_mode ? 2 : mid;
        tc = make_kv_case("E=0", dt, 2, 1, L, big, 0, Ev);
        tc.weights = tc.lse = 1, tc.mask = MASK_BOOL;
        run_case(&tc);
        tc = make_kv_case("Ev=0", dt, 2, 1, L, big, E, 0);
        tc.weights = tc.lse = 1, tc.causal = CAUSAL_BOTTOM_RIGHT;
        run_case(&tc);
    }
}

/* Value c of a quantized row, written out from the formats' definitions. */
static double quantized_value(sdpa_dtype dt, const uint8_t *row, int c) {
    if (dt == SDPA_INT8) return (double)(int8_t)row[c];
    if (dt == SDPA_INT4) return (double)((row[c / 2] >> (c % 2 * 4)) & 15) - 8;
    const int b = row[c], sign = b & 0x80 ? -1 : 1;
    if (dt == SDPA_FP8_E4M3) {
        const int e = (b >> 3) & 15, m = b & 7;
        if ((b & 0x7f) == 0x7f) return NAN;
        return sign * (e ? ldexp(1 + m / 8.0, e - 7) : ldexp(m / 8.0, -6));
    }
    const int e = (b >> 2) & 31, m = b & 3;
    if (e == 31) return m ? NAN : sign * INFINITY;
    return sign * (e ? ldexp(1 + m / 4.0, e - 15) : ldexp(m / 4.0, -14));
}

/* Keys and values quantized to dt by sdpa_quantize (whole-row and grouped
 * scales; float8 also without), then attention over them (row and tiled
 * paths) on every kernel set, against a float64 loop over the dequantized
 * values; with integer_qk, over the query rows as the core rounds them (int8,
 * a scale each). */
static void test_quantized_attention(sdpa_dtype dt, int integer_qk, const float *kf, const float *vf) {
    enum { S = 300, E = 32, H = 2, G = 2 /* query heads per kv head */ };
    const int width = dt == SDPA_INT4 ? 2 : 1, rb = E / width, fp8 = dt == SDPA_FP8_E4M3 || dt == SDPA_FP8_E5M2;
    const char *name = dt == SDPA_INT8 ? "int8" : dt == SDPA_INT4 ? "int4" : dt == SDPA_FP8_E4M3 ? "e4m3" : "e5m2";
    uint8_t *kq = (uint8_t *)xcalloc((size_t)H * S * rb, 1), *vq = (uint8_t *)xcalloc((size_t)H * S * rb, 1);
    float *ks = (float *)xcalloc((size_t)H * S * E, sizeof(float)), *vs = (float *)xcalloc((size_t)H * S * E, sizeof(float));
    const int groups[3] = {0, 8, -1}; /* -1: float8 without scales */
    /* L = 1 and 2: 2 and 4 query rows a key/value head on the row path (the
     * 4-key blocks of its dot); L = 20: the tiled path.  integer_qk's rows of
     * L > 1 are checked by tests/test_kvcache_lowbit.py. */
    const int lens[3] = {1, 20, 2};
    for (int gi = 0; gi < (fp8 ? 3 : 2); gi++) {
        const int g = groups[gi] < 0 ? 0 : groups[gi], ng = (int)sdpa_int8_scales_per_row(E, g), gw = g ? g : E;
        float *ksp = groups[gi] < 0 ? NULL : ks, *vsp = groups[gi] < 0 ? NULL : vs;
        int ok = sdpa_quantize(dt, kf, E, H * S, E, g, kq, rb, ksp, ng) == SDPA_OK &&
                 sdpa_quantize(dt, vf, E, H * S, E, g, vq, rb, vsp, ng) == SDPA_OK;
        check(ok, "%s: sdpa_quantize, group %d%s", name, g, ksp ? "" : ", no scales");
        for (int li = 0; li < (integer_qk ? 2 : 3); li++) {
            const int L = lens[li];
            float *q = (float *)xcalloc((size_t)H * G * L * E, sizeof(float)), *out = (float *)xcalloc((size_t)H * G * L * E, sizeof(float));
            double *qd = (double *)xcalloc((size_t)H * G * L * E, sizeof(double));  /* the query the scores see */
            for (int i = 0; i < H * G * L * E; i++) q[i] = (float)((i * 37) % 101 - 50) / 50.0f;
            const double scale = 1.0 / sqrt((double)E);
            for (int r = 0; r < H * G * L; r++) {
                const float *x = q + r * E;
                if (!integer_qk || L > 1) {  /* the tiled path computes in float */
                    for (int c = 0; c < E; c++) qd[r * E + c] = (double)x[c] * scale;
                    continue;
                }
                float xs[E], mx = 0;
                for (int c = 0; c < E; c++) xs[c] = x[c] * (float)scale, mx = fmaxf(mx, fabsf(xs[c]));
                const float qs = mx / 127.0f, inv = 1.0f / qs;
                for (int c = 0; c < E; c++) qd[r * E + c] = (double)nearbyintf(xs[c] * inv) * qs;
            }
            for (int isa = 0; isa < NUM_ISAS; isa++) {
                if (!tested(ISAS[isa])) continue;
                sdpa_set_isa(ISAS[isa]);
                sdpa_problem p;
                sdpa_problem_init(&p);
                p.kv_dtype = dt;
                p.integer_qk = integer_qk;
                p.num_heads = H * G, p.gqa_group = G, p.len_q = L, p.len_kv = S, p.head_dim = E, p.head_dim_v = E;
                p.query = (sdpa_view){.data = q, .head_stride = L * E, .row_stride = E, .col_stride = 1};
                p.out = (sdpa_view){.data = out, .head_stride = L * E, .row_stride = E, .col_stride = 1};
                p.key = (sdpa_view){.data = kq, .head_stride = S * rb, .row_stride = rb, .col_stride = 1};
                p.value = (sdpa_view){.data = vq, .head_stride = S * rb, .row_stride = rb, .col_stride = 1};
                if (ksp) {
                    p.key_scale = (sdpa_view){.data = ks, .head_stride = S * ng, .row_stride = ng, .col_stride = 1};
                    p.value_scale = (sdpa_view){.data = vs, .head_stride = S * ng, .row_stride = ng, .col_stride = 1};
                }
                p.kv_group_size = g;
                p.scale = scale;
                p.causal = 1, p.causal_offset = S - L;
                const sdpa_status st = sdpa_attention(&p);
                double err = 0;
                for (int h = 0; h < H * G; h++)
                    for (int l = 0; l < L; l++) {
                        const int hk = h / G, last = S - L + l;
                        double m = -INFINITY, sum = 0, acc[E] = {0};
                        double *sc = (double *)xcalloc(S, sizeof(double));
                        for (int s = 0; s <= last; s++) {
                            double d = 0;
                            for (int c = 0; c < E; c++) {
                                const double f = ksp ? ks[(hk * S + s) * ng + c / gw] : 1.0;
                                d += qd[(h * L + l) * E + c] * (double)(float)(quantized_value(dt, kq + (hk * S + s) * rb, c) * f);
                            }
                            sc[s] = d;
                            m = fmax(m, sc[s]);
                        }
                        for (int s = 0; s <= last; s++) {
                            const double w = exp(sc[s] - m);
                            sum += w;
                            for (int c = 0; c < E; c++) {
                                const double f = vsp ? vs[(hk * S + s) * ng + c / gw] : 1.0;
                                acc[c] += w * (double)(float)(quantized_value(dt, vq + (hk * S + s) * rb, c) * f);
                            }
                        }
                        for (int c = 0; c < E; c++) {  /* not fmax: GCC 12's aarch64 vectorizer fails on it here */
                            const double d = fabs(acc[c] / sum - out[(h * L + l) * E + c]);
                            if (!(d <= err)) err = d;
                        }
                        free(sc);
                    }
                check(st == SDPA_OK && err < 2e-5, "%s%s: %s, group %d%s, L %d: max error %.2e", name,
                      integer_qk ? " integer_qk" : "", ISAS[isa], g, ksp ? "" : " (no scales)", L, err);
            }
            free(q), free(out), free(qd);
        }
    }
    free(kq), free(vq), free(ks), free(vs);
}

/* integer_pv: decoding over int8 and int4 values (one scale a row and groups
 * of 32) on every kernel set, within the weights' rounding of the float
 * products (and not equal to them); float8 values ignore the field.  (VNNI
 * against the portable sums, bit for bit: tests/test_integer_pv.py.) */
static void test_integer_pv(void) {
    enum { S = 300, E = 128, H = 2, G = 4 };
    const sdpa_dtype dts[3] = {SDPA_INT8, SDPA_INT4, SDPA_FP8_E4M3};
    float *kf = (float *)xcalloc((size_t)H * S * E, sizeof(float)), *vf = (float *)xcalloc((size_t)H * S * E, sizeof(float));
    float *q = (float *)xcalloc((size_t)H * G * E, sizeof(float));
    uint32_t seed = 777;
    for (int i = 0; i < H * S * E; i++) {
        seed = seed * 1664525u + 1013904223u;
        kf[i] = (float)((int)(seed >> 9) % 2001 - 1000) / 400.0f;
        seed = seed * 1664525u + 1013904223u;
        vf[i] = (float)((int)(seed >> 9) % 2001 - 1000) / 500.0f;
    }
    for (int i = 0; i < H * G * E; i++) q[i] = (float)((i * 37) % 101 - 50) / 25.0f;
    for (int di = 0; di < 3; di++)
        for (int g = 0; g <= 32; g += 32) {
            const sdpa_dtype dt = dts[di];
            const int rb = dt == SDPA_INT4 ? E / 2 : E, ng = g ? E / g : 1;
            uint8_t *kq = (uint8_t *)xcalloc((size_t)H * S * rb, 1), *vq = (uint8_t *)xcalloc((size_t)H * S * rb, 1);
            float *ks = (float *)xcalloc((size_t)H * S * ng, sizeof(float)), *vs = (float *)xcalloc((size_t)H * S * ng, sizeof(float));
            check(sdpa_quantize(dt, kf, E, H * S, E, g, kq, rb, ks, ng) == SDPA_OK &&
                      sdpa_quantize(dt, vf, E, H * S, E, g, vq, rb, vs, ng) == SDPA_OK,
                  "integer_pv: sdpa_quantize");
            float *out[2 * NUM_ISAS + 2];
            int have[NUM_ISAS] = {0};
            for (int isa = 0; isa < NUM_ISAS; isa++) {
                if (!tested(ISAS[isa])) continue;
                have[isa] = 1;
                sdpa_set_isa(ISAS[isa]);
                for (int ipv = 0; ipv < 2; ipv++) {
                    float *o = out[2 * isa + ipv] = (float *)xcalloc((size_t)H * G * E, sizeof(float));
                    sdpa_problem p;
                    sdpa_problem_init(&p);
                    p.kv_dtype = dt, p.integer_pv = ipv, p.kv_group_size = g;
                    p.num_heads = H * G, p.gqa_group = G, p.len_q = 1, p.len_kv = S, p.head_dim = E, p.head_dim_v = E;
                    p.query = (sdpa_view){.data = q, .head_stride = E, .row_stride = E, .col_stride = 1};
                    p.out = (sdpa_view){.data = o, .head_stride = E, .row_stride = E, .col_stride = 1};
                    p.key = (sdpa_view){.data = kq, .head_stride = S * rb, .row_stride = rb, .col_stride = 1};
                    p.value = (sdpa_view){.data = vq, .head_stride = S * rb, .row_stride = rb, .col_stride = 1};
                    p.key_scale = (sdpa_view){.data = ks, .head_stride = S * ng, .row_stride = ng, .col_stride = 1};
                    p.value_scale = (sdpa_view){.data = vs, .head_stride = S * ng, .row_stride = ng, .col_stride = 1};
                    p.scale = 1.0 / sqrt((double)E);
                    check(sdpa_attention(&p) == SDPA_OK, "integer_pv: %s on %s", ipv ? "on" : "off", ISAS[isa]);
                }
                double err = 0;
                for (int i = 0; i < H * G * E; i++) {  /* not fmax: GCC 12's aarch64 vectorizer fails on it */
                    const double d = fabs((double)out[2 * isa][i] - out[2 * isa + 1][i]);
                    if (!(d <= err)) err = d;
                }
                const int fp8 = dt == SDPA_FP8_E4M3;
                check(fp8 ? err == 0 : err < 1e-2 && err > 0, "integer_pv: dtype %d group %d on %s: %.2e from float",
                      (int)dt, g, ISAS[isa], err);
            }
            for (int isa = 0; isa < NUM_ISAS; isa++)
                if (have[isa]) free(out[2 * isa]), free(out[2 * isa + 1]);
            free(kq), free(vq), free(ks), free(vs);
        }
    free(kf), free(vf), free(q);
}

/* int8 keys and values: sdpa_quantize_int8, then attention over them (row and
 * tiled paths, whole-row and grouped scales) against a float64 loop over the
 * dequantized values, on every kernel set. */
static void test_int8(void) {
    enum { S = 300, E = 32, H = 2, G = 2 /* query heads per kv head */ };
    float *kf = (float *)xcalloc((size_t)H * S * E, sizeof(float)), *vf = (float *)xcalloc((size_t)H * S * E, sizeof(float));
    int8_t *kq = (int8_t *)xcalloc((size_t)H * S * E, 1), *vq = (int8_t *)xcalloc((size_t)H * S * E, 1);
    float *ks = (float *)xcalloc((size_t)H * S * E, sizeof(float)), *vs = (float *)xcalloc((size_t)H * S * E, sizeof(float));
    uint32_t seed = 12345;
    for (int i = 0; i < H * S * E; i++) {
        seed = seed * 1664525u + 1013904223u;
        kf[i] = (float)((int)(seed >> 9) % 2001 - 1000) / 400.0f;
        seed = seed * 1664525u + 1013904223u;
        vf[i] = (float)((int)(seed >> 9) % 2001 - 1000) / 400.0f;
    }
    check(sdpa_int8_scales_per_row(E, 0) == 1 && sdpa_int8_scales_per_row(E, 8) == 4 &&
              sdpa_int8_scales_per_row(E, 5) == -1, "int8: sdpa_int8_scales_per_row");
    float bad[4] = {1, NAN, 2, 3};
    int8_t untouched[4] = {7, 7, 7, 7};
    float bad_scale = 9;
    check(sdpa_quantize_int8(bad, 4, 1, 4, 0, untouched, 4, &bad_scale, 1) == SDPA_ERR_NOT_FINITE &&
              untouched[0] == 7 && bad_scale == 9, "int8: a NaN is refused, nothing written");
    check(sdpa_quantize_int8(kf, E, 1, E, 5, kq, E, ks, 1) == SDPA_ERR_BAD_SHAPE, "int8: a group not dividing E");
    {  /* the float32 maximum: FLT_MAX / 127 rounds up, and 127 times that scale overflowed */
        const float big[4] = {FLT_MAX, -FLT_MAX, 1, 0};
        int8_t bq[4];
        float bs = 0;
        check(sdpa_quantize_int8(big, 4, 1, 4, 0, bq, 4, &bs, 1) == SDPA_OK && bq[0] == 127 && bq[1] == -127 &&
                  isfinite(127.0f * bs) && isfinite(-127.0f * bs) && 127.0f * bs >= FLT_MAX * (1 - 1e-6f),
              "int8: FLT_MAX quantizes to a finite value");
    }
    free(kq), free(vq), free(ks), free(vs);
    test_quantized_attention(SDPA_INT8, 0, kf, vf);
    test_quantized_attention(SDPA_INT8, 1, kf, vf);
    test_quantized_attention(SDPA_INT4, 0, kf, vf);
    test_quantized_attention(SDPA_INT4, 1, kf, vf);
    test_quantized_attention(SDPA_FP8_E4M3, 0, kf, vf);
    test_quantized_attention(SDPA_FP8_E5M2, 0, kf, vf);
    free(kf), free(vf);
}

/* The ABI guard: a caller compiled against 0.1's header (no struct_size: the
 * struct starts with dtype and kv_dtype, 8 bytes smaller) calls the symbol
 * sdpa_problem_init and then sdpa_attention.  Its struct is allocated at its
 * own size, so that a write or read past it shows under valgrind and ASan:
 * the call returns SDPA_ERR_ABI, and the struct is left as the caller set it. */
/* Flush-to-zero in the calling thread: x86 MXCSR FTZ + DAZ, AArch64 FPCR.FZ;
 * 0 where there is no such mode. */
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
static int set_ftz(int on) {
    _mm_setcsr(on ? _mm_getcsr() | 0x8040u : _mm_getcsr() & ~0x8040u);
    return 1;
}
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
static int set_ftz(int on) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    fpcr = on ? fpcr | (1ull << 24) : fpcr & ~(1ull << 24);
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
    return 1;
}
#else
static int set_ftz(int on) {
    (void)on;
    return 0;
}
#endif

/* Every worker computes in the caller's floating-point mode: values V of a
 * subnormal size give 0 everywhere with flush-to-zero on in the caller, for
 * 1, 2 and 3 threads, on the row and tiled paths of every set, and their own
 * (nonzero) weighted sums with it off, before and after. */
static void test_fp_mode(void) {
    enum { H = 6, S = 40, E = 16 };
    const float tiny = FLT_MIN / 8; /* subnormal */
    float *q = (float *)xcalloc((size_t)H * S * E, sizeof(float)), *k = (float *)xcalloc((size_t)H * S * E, sizeof(float));
    float *v = (float *)xcalloc((size_t)H * S * E, sizeof(float)), *out = (float *)xcalloc((size_t)H * S * E, sizeof(float));
    for (int i = 0; i < H * S * E; i++) {
        q[i] = (float)((i * 7) % 13 - 6) / 6.0f;
        k[i] = (float)((i * 5) % 11 - 5) / 5.0f;
        v[i] = tiny * (float)(1 + i % 3);
    }
    /* the mode must work in this thread first: valgrind, for one, computes
     * subnormals whatever MXCSR says */
    volatile float probe = tiny;
    const int have_ftz = set_ftz(1);
    const int works = have_ftz && probe * 1.5f == 0.0f;
    set_ftz(0);
    if (!works) {
        skip(have_ftz ? "flush-to-zero: not honoured by this CPU or emulator (valgrind), so not tested"
                      : "flush-to-zero: no such mode here");
        free(q), free(k), free(v), free(out);
        return;
    }
    const char *initial = sdpa_isa();
    for (int isa = 0; isa < NUM_ISAS; isa++) {
        if (!tested(ISAS[isa])) continue;
        sdpa_set_isa(ISAS[isa]);
        for (int L = 1; L <= S; L += S - 1) { /* decoding (row mode), then the tiled path */
            for (int phase = 0; phase < 3; phase++) { /* off, on, off: the workers' modes follow both ways */
                const int ftz = phase == 1;
                set_ftz(ftz);
                int zeros[3] = {0}, nonzero_everywhere = 1;
                sdpa_status st = SDPA_OK;
                for (int t = 1; t <= 3; t++) {
                    sdpa_problem p;
                    sdpa_problem_init(&p);
                    p.num_heads = H, p.gqa_group = 1, p.len_q = L, p.len_kv = S, p.head_dim = E, p.head_dim_v = E;
                    p.num_threads = t;
                    p.query = (sdpa_view){.data = q, .head_stride = S * E, .row_stride = E, .col_stride = 1};
                    p.key = (sdpa_view){.data = k, .head_stride = S * E, .row_stride = E, .col_stride = 1};
                    p.value = (sdpa_view){.data = v, .head_stride = S * E, .row_stride = E, .col_stride = 1};
                    p.out = (sdpa_view){.data = out, .head_stride = S * E, .row_stride = E, .col_stride = 1};
                    for (int i = 0; i < H * S * E; i++) out[i] = -1.0f;
                    const sdpa_status s1 = sdpa_attention(&p);
                    if (s1 != SDPA_OK) st = s1;
                    for (int h = 0; h < H; h++)
                        for (int i = 0; i < L * E; i++) {
                            const float o = out[h * S * E + i];
                            zeros[t - 1] += o == 0.0f;
                            nonzero_everywhere &= o > 0.0f;
                        }
                }
                set_ftz(0);
                if (ftz)
                    check(st == SDPA_OK && zeros[0] == H * L * E && zeros[1] == H * L * E && zeros[2] == H * L * E,
                          "[%s] L=%d: flush-to-zero in the caller holds in every thread (zeros %d/%d/%d of %d)",
                          ISAS[isa], L, zeros[0], zeros[1], zeros[2], H * L * E);
                else
                    check(st == SDPA_OK && nonzero_everywhere, "[%s] L=%d: without it, subnormal sums are kept",
                          ISAS[isa], L);
            }
        }
    }
    sdpa_set_isa(initial);
    free(q), free(k), free(v), free(out);
}

/* The NaN contract and subnormal inputs on every set, decoding and the tiled
 * path: NaN in a query row makes that row (and its lse) NaN and changes no
 * other bit; NaN in a K row changes nothing for the rows causality hides it
 * from, and makes the rows of its head group that see it NaN; subnormal keys
 * and values are computed, not flushed (float32 and float64, the caller's
 * default mode), against a float64 loop. */
static void test_special_values(void) {
    enum { H = 4, G = 2, S = 70, E = 16 };
    const char *initial = sdpa_isa();
    const sdpa_dtype dts[] = {SDPA_FLOAT32, SDPA_FLOAT64, SDPA_BFLOAT16};
    for (int isa = 0; isa < NUM_ISAS; isa++) {
        if (!tested(ISAS[isa])) continue;
        sdpa_set_isa(ISAS[isa]);
        for (int d = 0; d < 3; d++)
            for (int L = 1; L <= 64; L += 63) {
                const sdpa_dtype dt = dts[d], ct = compute_dtype(dt);
                const size_t es = dtype_size(dt), rowb = (size_t)E * es;
                const int64_t off = L == 1 ? S - 11 : S - L; /* the last row sees keys 0 .. off + L - 1 */
                void *q = xcalloc((size_t)H * L * E, es), *k = xcalloc((size_t)(H / G) * S * E, es);
                void *v = xcalloc((size_t)(H / G) * S * E, es);
                void *out0 = xcalloc((size_t)H * L * E, es), *out1 = xcalloc((size_t)H * L * E, es);
                void *lse0 = xcalloc((size_t)H * L, dtype_size(ct)), *lse1 = xcalloc((size_t)H * L, dtype_size(ct));
                for (int64_t i = 0; i < H * L * E; i++) store(q, dt, i, 2 * rng_uniform() - 1);
                for (int64_t i = 0; i < (H / G) * S * E; i++) store(k, dt, i, 2 * rng_uniform() - 1), store(v, dt, i, 2 * rng_uniform() - 1);
                sdpa_problem p;
                sdpa_problem_init(&p);
                p.dtype = dt;
                p.num_heads = H, p.gqa_group = G, p.len_q = L, p.len_kv = S, p.head_dim = E, p.head_dim_v = E;
                p.causal = 1, p.causal_offset = off;
                p.query = dense_view(q, L, E), p.key = dense_view(k, S, E), p.value = dense_view(v, S, E);
                p.lse = dense_view(lse0, L, 1), p.out = dense_view(out0, L, E);
                sdpa_status st = sdpa_attention(&p);
                p.lse = dense_view(lse1, L, 1), p.out = dense_view(out1, L, E);
                char what[96];
                snprintf(what, sizeof what, "[%s] %s L=%d", ISAS[isa], dtype_name(dt), L);
                /* NaN in query row (head 1, row L - 1) */
                const int64_t qr = 1 * L + (L - 1);
                const double saved = load(q, dt, qr * E + 3);
                store(q, dt, qr * E + 3, NAN);
                st |= sdpa_attention(&p);
                store(q, dt, qr * E + 3, saved);
                int ok = st == SDPA_OK && isnan(load(lse1, ct, qr));
                for (int64_t r = 0; r < H * L; r++) {
                    if (r == qr) {
                        for (int c = 0; c < E; c++) ok &= isnan(load(out1, dt, r * E + c));
                        continue;
                    }
                    ok &= memcmp((char *)out0 + r * rowb, (char *)out1 + r * rowb, rowb) == 0 &&
                          load(lse0, ct, r) == load(lse1, ct, r);
                }
                check(ok, "%s: NaN in a query row makes that row NaN and changes no other bit", what);
                /* NaN in K row j of kv head 0: rows l see it when j <= off + l */
                const int64_t j = L == 1 ? S - 5 : off + L / 2;
                const double kept = load(k, dt, j * E + 2);
                store(k, dt, j * E + 2, NAN);
                st = sdpa_attention(&p);
                store(k, dt, j * E + 2, kept);
                ok = st == SDPA_OK;
                for (int64_t h = 0; h < H; h++)
                    for (int64_t l = 0; l < L; l++) {
                        const int64_t r = h * L + l;
                        if (h < G && j <= off + l) {
                            ok &= isnan(load(out1, dt, r * E)) && isnan(load(lse1, ct, r));
                            continue;
                        }
                        ok &= memcmp((char *)out0 + r * rowb, (char *)out1 + r * rowb, rowb) == 0;
                    }
                check(ok, "%s: NaN in a K row reaches only the rows that see it", what);
                /* subnormal keys and values */
                if (dt != SDPA_BFLOAT16) {
                    const double tiny = dt == SDPA_FLOAT32 ? FLT_MIN / 8 : DBL_MIN / 8;
                    for (int64_t i = 0; i < (H / G) * S * E; i++)
                        store(k, dt, i, tiny * (1 + rng_uniform())), store(v, dt, i, tiny * (1 + rng_uniform()));
                    p.lse = (sdpa_view){0};
                    st = sdpa_attention(&p);
                    double worst = 0;
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t l = 0; l < L; l++)
                            for (int c = 0; c < E; c++) { /* scores of ~tiny^2: equal weights over the keys seen */
                                double sum = 0;
                                const int64_t seen = off + l + 1;
                                for (int64_t s2 = 0; s2 < seen; s2++) sum += load(v, dt, ((h / G) * S + s2) * E + c);
                                const double want = sum / (double)seen, got = load(out1, dt, (h * L + l) * E + c);
                                const double e = fabs(got - want) / want;
                                if (!(e <= worst)) worst = e;
                            }
                    check(st == SDPA_OK && worst < 1e-4, "%s: subnormal keys and values computed (relative error %.1e)",
                          what, worst);
                }
                free(q), free(k), free(v), free(out0), free(out1), free(lse0), free(lse1);
            }
    }
    sdpa_set_isa(initial);
}

static void test_abi_guard(void) {
    typedef struct {
        sdpa_dtype dtype;
        sdpa_dtype kv_dtype;
        int32_t num_batch_dims;
        int64_t rest[(sizeof(sdpa_problem) - 8 - 16) / 8];
    } old_problem;
    check(sizeof(old_problem) + 8 == sizeof(sdpa_problem), "abi: the 0.1 layout is 8 bytes smaller");
    const int dtypes[] = {SDPA_FLOAT32, SDPA_FLOAT64, SDPA_BFLOAT16, SDPA_FLOAT16};
    const int kv_dtypes[] = {SDPA_DTYPE_OF_QUERY, SDPA_FLOAT32, SDPA_INT8};
    for (int d = 0; d < 4; d++)
        for (int kd = 0; kd < 3; kd++) {
            old_problem *old = (old_problem *)malloc(sizeof(old_problem));
            memset(old, 0x5a, sizeof(*old));
            (sdpa_problem_init)((sdpa_problem *)old);  /* the 0.1 symbol */
            old->dtype = (sdpa_dtype)dtypes[d];
            old->kv_dtype = (sdpa_dtype)kv_dtypes[kd];
            old->num_batch_dims = 0;
            for (size_t i = 0; i < sizeof(old->rest) / 8; i++) old->rest[i] = 1;
            const sdpa_status st = sdpa_attention((const sdpa_problem *)old);
            check(st == SDPA_ERR_ABI && old->dtype == (sdpa_dtype)dtypes[d] && old->rest[0] == 1,
                  "abi: a 0.1-layout problem is refused with SDPA_ERR_ABI (dtype %d, kv_dtype %d)", dtypes[d],
                  kv_dtypes[kd]);
            free(old);
        }
    /* the 0.1 symbol zeroes the first 8 bytes, as sdpa.h and docs/c_api.md say, and no more */
    {
        unsigned char *raw = (unsigned char *)malloc(sizeof(old_problem));
        memset(raw, 0x5a, sizeof(old_problem));
        (sdpa_problem_init)((sdpa_problem *)raw);
        int ok = 1;
        for (size_t i = 0; i < sizeof(old_problem); i++) ok &= raw[i] == (i < 8 ? 0 : 0x5a);
        check(ok, "abi: the 0.1 symbol zeroes exactly the first 8 bytes");
        free(raw);
    }
    /* a smaller struct given to sdpa_problem_init_sized: only the size is written */
    unsigned char *small = (unsigned char *)malloc(64);
    memset(small, 0x5a, 64);
    sdpa_problem_init_sized((sdpa_problem *)small, 64);
    size_t written;
    memcpy(&written, small, sizeof written);
    check(written == 64 && small[sizeof(size_t)] == 0x5a && small[63] == 0x5a, "abi: a smaller struct keeps its bytes");
    check(sdpa_attention((const sdpa_problem *)small) == SDPA_ERR_ABI, "abi: and is refused");
    free(small);
    sdpa_problem p;
    sdpa_problem_init(&p);
    check(p.struct_size == sizeof(sdpa_problem), "abi: sdpa_problem_init sets struct_size");
    p.struct_size = sizeof(sdpa_problem) + 8;
    check(sdpa_attention(&p) == SDPA_ERR_ABI, "abi: a larger size is refused too");
    check(strstr(sdpa_status_message(SDPA_ERR_ABI), "sdpa.h") != NULL, "abi: the status message names the header");
}

/* Paged keys and values: two sequences of different lengths whose positions
 * lie in blocks (of an odd size or an even one) scattered over a pool, against the same problem
 * on each sequence's keys laid out contiguously (bottom-right aligned), on
 * every kernel set, for decoding (row mode) and a longer query (the tiled path;
 * bfloat16 pairs over blocks of an odd size copy each sequence's blocks); then the refusals (SDPA_ERR_BAD_PAGES),
 * with nothing written. */
static void paged_case(const char *isa, sdpa_dtype dt, int64_t L, int variant, int64_t BS) {
    enum { PB = 2, PH = 4, PG = 2, PE = 24, NB = 48, MAXB = 20 };
    const int64_t lens[PB] = {L + 37, L + 3};
    const size_t es = dtype_size(dt), ce = dtype_size(compute_dtype(dt));
    const int64_t Hkv = PH / PG;
    void *kc = xcalloc((size_t)(NB * Hkv * BS * PE), es), *vc = xcalloc((size_t)(NB * Hkv * BS * PE), es);
    void *q = xcalloc((size_t)(PB * PH * L * PE), es), *out = xcalloc((size_t)(PB * PH * L * PE), es);
    void *lse = xcalloc((size_t)(PB * PH * L), ce), *sinks = xcalloc((size_t)(PB * PH), ce);
    int32_t table[PB][MAXB];
    for (int64_t i = 0; i < NB * Hkv * BS * PE; i++) {
        store(kc, dt, i, 2 * rng_uniform() - 1);
        store(vc, dt, i, 2 * rng_uniform() - 1);
    }
    for (int64_t i = 0; i < PB * PH * L * PE; i++) store(q, dt, i, 2 * rng_uniform() - 1);
    for (int64_t i = 0; i < PB * PH; i++) store(sinks, compute_dtype(dt), i, rng_uniform());
    for (int b = 0; b < PB; b++)
        for (int j = 0; j < MAXB; j++) table[b][j] = j < (lens[b] + BS - 1) / BS ? (int32_t)((17 * (b * MAXB + j) + 5) % NB) : -1;
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = dt;
    p.num_batch_dims = 1, p.batch_shape[0] = PB;
    p.num_heads = PH, p.gqa_group = PG, p.len_q = L, p.len_kv = MAXB * BS, p.head_dim = p.head_dim_v = PE;
    p.query = dense_view(q, L, PE);
    p.query.batch_strides[0] = PH * L * PE;
    p.out = p.query;
    p.out.data = out;
    p.lse = dense_view(lse, L, 1);
    p.lse.batch_strides[0] = PH * L;
    p.key = dense_view(kc, BS, PE);
    p.key.batch_strides[0] = Hkv * BS * PE;
    p.value = p.key;
    p.value.data = vc;
    p.scale = 0.3;
    p.causal = 1;
    p.key_lengths = lens;
    p.key_lengths_strides[0] = 1;
    p.block_table = &table[0][0], p.block_table_stride = MAXB, p.block_size = BS, p.num_blocks = NB;
    if (variant) {  /* a window and sinks, aligned to each sequence's end */
        p.window_left = 9, p.window_right = 0;
        p.sinks = dense_view(sinks, 1, 1);
        p.sinks.head_stride = 1, p.sinks.batch_strides[0] = PH;
    }
    sdpa_status st = sdpa_attention(&p);
    char what[128];
    snprintf(what, sizeof(what), "paged %s %s L=%lld blocks of %lld%s", isa, dtype_name(dt), (long long)L,
             (long long)BS, variant ? " window+sinks" : "");
    double worst = 0;
    for (int b = 0; b < PB && st == SDPA_OK; b++) {
        const int64_t S = lens[b];
        vprob x;
        vprob_make(&x, dt, PH, PG, L, S, PE, PE);
        for (int64_t i = 0; i < PH * L * PE; i++) store(x.q, dt, i, load(q, dt, b * PH * L * PE + i));
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t s = 0; s < S; s++)
                for (int64_t c = 0; c < PE; c++) {
                    const int64_t at = ((int64_t)table[b][s / BS] * Hkv + h) * BS * PE + (s % BS) * PE + c;
                    store(x.k, dt, (h * S + s) * PE + c, load(kc, dt, at));
                    store(x.v, dt, (h * S + s) * PE + c, load(vc, dt, at));
                }
        x.p.scale = 0.3, x.p.causal = 1, x.p.causal_offset = S - L;
        x.p.weights.data = NULL;
        /* lse and sinks in the compute type (vprob's buffers hold the storage type) */
        void *ref_lse = xcalloc((size_t)(PH * L), ce);
        x.p.lse = dense_view(ref_lse, L, 1);
        if (variant) {
            x.p.window_left = 9, x.p.window_right = 0, x.p.align_offset = S - L;
            x.p.sinks = dense_view((char *)sinks + (size_t)(b * PH) * ce, 1, 1);
            x.p.sinks.head_stride = 1;
        }
        const sdpa_status cst = sdpa_attention(&x.p);
        for (int64_t i = 0; i < PH * L * PE && cst == SDPA_OK; i++)
            worst = fmax(worst, rel_err(load(out, dt, b * PH * L * PE + i), load(x.out, dt, i)));
        for (int64_t i = 0; i < PH * L && cst == SDPA_OK; i++)
            worst = fmax(worst, rel_err(load(lse, compute_dtype(dt), b * PH * L + i), load(ref_lse, compute_dtype(dt), i)));
        if (cst != SDPA_OK) worst = INFINITY;
        free(ref_lse);
        vprob_free(&x);
    }
    const double tol = dt == SDPA_FLOAT64 ? 1e-12 : dt == SDPA_FLOAT32 ? 1e-5 : 1e-2;
    check(st == SDPA_OK && worst <= tol, "%s: status %d, max rel err %.3g", what, (int)st, worst);

    /* refusals: nothing written */
    store(out, dt, 0, 123.0);
    const int32_t kept = table[1][0];
    table[1][0] = NB;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged: a block id past the pool");
    table[1][0] = -1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged: a block id -1 that is read");
    table[1][0] = kept;
    p.len_kv = lens[0] - 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged: a sequence longer than its table");
    p.len_kv = MAXB * BS;
    p.key_lengths = NULL;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged: no key_lengths");
    p.key_lengths = lens;
    p.weights = dense_view(out, L, MAXB * BS);
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged: weights");
    p.weights.data = NULL;
    p.num_batch_dims = 2, p.batch_shape[1] = 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged: two batch dims");
    check(load(out, dt, 0) == 123.0, "paged refusals write nothing");
    free(kc), free(vc), free(q), free(out), free(lse), free(sinks);
}

static void test_paged(void) {
    const char *initial = sdpa_isa();
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        const sdpa_dtype dts[] = {SDPA_FLOAT32, SDPA_FLOAT64, SDPA_BFLOAT16};
        for (int d = 0; d < 3; d++) {
            paged_case(ISAS[i], dts[d], 1, 0, 5);
            paged_case(ISAS[i], dts[d], 40, 0, 5);
            paged_case(ISAS[i], dts[d], 40, 0, 4);  /* bfloat16 pairs by block segments, float copied */
            paged_case(ISAS[i], dts[d], 40, 0, 64); /* float products on the blocks in place */
            if (!quick) paged_case(ISAS[i], dts[d], 3, 1, 4), paged_case(ISAS[i], dts[d], 33, 1, 5);
        }
    }
    sdpa_set_isa(initial);
}

/* Ragged batches (C API 0.5).  Packed sequences (cu_seqlens_q / _k, 0-row
 * sequences among them) give, sequence by sequence, the bits of a call on that
 * sequence alone, causal from the top left or from each end; a paged mixed
 * batch (cu_seqlens_q over block tables) likewise against a paged call per
 * sequence; then the refusals (SDPA_ERR_BAD_RAGGED), nothing written. */
static void ragged_case(const char *isa, sdpa_dtype dt, int from_end) {
    enum { RB = 5, RH = 4, RG = 2, RE = 24 };
    const int64_t rows[RB] = {7, 0, 33, 1, 16}, keys[RB] = {7, 5, 40, 9, 16};
    const int64_t Hkv = RH / RG;
    int64_t cq[RB + 1] = {0}, ck[RB + 1] = {0};
    for (int b = 0; b < RB; b++) cq[b + 1] = cq[b] + rows[b], ck[b + 1] = ck[b] + keys[b];
    const int64_t T = cq[RB], TK = ck[RB];
    const size_t es = dtype_size(dt), ce = dtype_size(compute_dtype(dt));
    void *q = xcalloc((size_t)(T * RH * RE), es), *k = xcalloc((size_t)(TK * Hkv * RE), es);
    void *v = xcalloc((size_t)(TK * Hkv * RE), es), *out = xcalloc((size_t)(T * RH * RE), es);
    void *lse = xcalloc((size_t)(T * RH), ce);
    for (int64_t i = 0; i < T * RH * RE; i++) store(q, dt, i, 2 * rng_uniform() - 1);
    for (int64_t i = 0; i < TK * Hkv * RE; i++) store(k, dt, i, 2 * rng_uniform() - 1), store(v, dt, i, 2 * rng_uniform() - 1);
    /* packed: (T, H, E), row stride H * E, head stride E */
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = dt;
    p.num_batch_dims = 1, p.batch_shape[0] = RB;
    p.num_heads = RH, p.gqa_group = RG, p.len_q = T, p.len_kv = TK, p.head_dim = p.head_dim_v = RE;
    const sdpa_view qv = {q, {0}, RE, RH * RE, 1}, kv = {k, {0}, RE, Hkv * RE, 1};
    p.query = qv, p.key = kv, p.value = kv, p.value.data = v, p.out = qv, p.out.data = out;
    p.lse = (sdpa_view){lse, {0}, 1, RH, 1};
    p.scale = 0.25, p.causal = 1, p.offsets_from_end = from_end;
    p.window_left = 20, p.window_right = from_end ? 0 : 3;
    p.cu_seqlens_q = cq, p.cu_seqlens_k = ck;
    sdpa_status st = sdpa_attention(&p);
    int same = st == SDPA_OK;
    for (int b = 0; b < RB && same; b++) {  /* each sequence alone */
        const int64_t L = rows[b], S = keys[b];
        if (L == 0) continue;
        void *o1 = xcalloc((size_t)(L * RH * RE), es), *l1 = xcalloc((size_t)(L * RH), ce);
        sdpa_problem s1 = p;
        s1.num_batch_dims = 0;
        s1.len_q = L, s1.len_kv = S;
        s1.cu_seqlens_q = s1.cu_seqlens_k = NULL, s1.offsets_from_end = 0;
        s1.query.data = (char *)q + (size_t)(cq[b] * RH * RE) * es;
        s1.key.data = (char *)k + (size_t)(ck[b] * Hkv * RE) * es;
        s1.value.data = (char *)v + (size_t)(ck[b] * Hkv * RE) * es;
        s1.out.data = o1, s1.lse.data = l1;
        s1.causal_offset = s1.align_offset = from_end ? S - L : 0;
        same = sdpa_attention(&s1) == SDPA_OK && memcmp(o1, (char *)out + (size_t)(cq[b] * RH * RE) * es,
                                                        (size_t)(L * RH * RE) * es) == 0 &&
               memcmp(l1, (char *)lse + (size_t)(cq[b] * RH) * ce, (size_t)(L * RH) * ce) == 0;
        free(o1), free(l1);
    }
    check(same, "ragged %s %s%s: each sequence's bits as alone", isa, dtype_name(dt), from_end ? " from the end" : "");

    /* refusals: nothing written */
    store(out, dt, 0, 123.0);
    cq[0] = 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "ragged: cu_seqlens_q not from 0");
    cq[0] = 0, cq[2] = cq[3] + 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "ragged: cu_seqlens_q decreasing");
    cq[2] = cq[1] + rows[1];
    p.len_kv = TK - 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "ragged: cu_seqlens_k not ending at len_kv");
    p.len_kv = TK;
    p.mask_kind = SDPA_MASK_BOOL, p.mask = dense_view(out, 1, 1);
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "ragged: a mask");
    p.mask_kind = SDPA_MASK_NONE, p.mask.data = NULL;
    p.key_lengths = keys;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "ragged: key_lengths with cu_seqlens_k");
    p.key_lengths = NULL;
    p.num_batch_dims = 2, p.batch_shape[1] = 1;
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "ragged: two batch dims");
    p.num_batch_dims = 1;
    p.cu_seqlens_q = p.cu_seqlens_k = NULL, p.len_q = 1, p.len_kv = 1, p.batch_shape[0] = 1;
    check_status(sdpa_attention(&p), from_end ? SDPA_ERR_BAD_RAGGED : SDPA_OK, "offsets_from_end without ragged");
    check(load(out, dt, 0) == 123.0 || !from_end, "ragged refusals write nothing");
    free(q), free(k), free(v), free(out), free(lse);
}

/* A paged mixed batch: sequences of 5, 0, 1 and 12 rows over block tables (the
 * first and the third sharing their first two blocks, read once for both and
 * merged), each sequence against a paged call of it alone: the same bits, or
 * within rounding for the two that share; a sequence with more rows than
 * positions, and a tree with a packed query, refused. */
static void paged_mixed_case(const char *isa, sdpa_dtype dt) {
    enum { PB = 4, PH = 4, PG = 2, PE = 16, BS = 4, NB = 40, MAXB = 10 };
    const int64_t lens[PB] = {21, 13, 30, 12}, rows[PB] = {5, 0, 1, 12};
    const int64_t Hkv = PH / PG;
    int64_t cq[PB + 1] = {0};
    for (int b = 0; b < PB; b++) cq[b + 1] = cq[b] + rows[b];
    const int64_t T = cq[PB];
    const size_t es = dtype_size(dt), ce = dtype_size(compute_dtype(dt));
    void *kc = xcalloc((size_t)(NB * Hkv * BS * PE), es), *vc = xcalloc((size_t)(NB * Hkv * BS * PE), es);
    void *q = xcalloc((size_t)(T * PH * PE), es), *out = xcalloc((size_t)(T * PH * PE), es);
    void *lse = xcalloc((size_t)(T * PH), ce);
    int32_t table[PB][MAXB];
    for (int64_t i = 0; i < NB * Hkv * BS * PE; i++) store(kc, dt, i, 2 * rng_uniform() - 1), store(vc, dt, i, 2 * rng_uniform() - 1);
    for (int64_t i = 0; i < T * PH * PE; i++) store(q, dt, i, 2 * rng_uniform() - 1);
    for (int b = 0; b < PB; b++)
        for (int j = 0; j < MAXB; j++)
            table[b][j] = j < (lens[b] + BS - 1) / BS ? (int32_t)(b == 2 && j < 2 ? table[0][j] : (7 * (b * MAXB + j) + 3) % NB) : -1;
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = dt;
    p.num_batch_dims = 1, p.batch_shape[0] = PB;
    p.num_heads = PH, p.gqa_group = PG, p.len_q = T, p.len_kv = MAXB * BS, p.head_dim = p.head_dim_v = PE;
    p.query = (sdpa_view){q, {0}, PE, PH * PE, 1};
    p.out = p.query, p.out.data = out;
    p.lse = (sdpa_view){lse, {0}, 1, PH, 1};
    p.key = dense_view(kc, BS, PE);
    p.key.batch_strides[0] = Hkv * BS * PE;
    p.value = p.key, p.value.data = vc;
    p.scale = 0.3, p.causal = 1;
    p.key_lengths = lens, p.key_lengths_strides[0] = 1;
    p.block_table = &table[0][0], p.block_table_stride = MAXB, p.block_size = BS, p.num_blocks = NB;
    p.cu_seqlens_q = cq;
    int same = sdpa_attention(&p) == SDPA_OK;
    double worst = 0;  /* the sequences that share blocks */
    for (int b = 0; b < PB && same; b++) {
        const int64_t L = rows[b];
        const int shares = b == 0 || b == 2;
        if (L == 0) continue;
        void *o1 = xcalloc((size_t)(L * PH * PE), es), *l1 = xcalloc((size_t)(L * PH), ce);
        sdpa_problem s1 = p;
        s1.batch_shape[0] = 1, s1.len_q = L, s1.cu_seqlens_q = NULL;
        s1.query = dense_view((char *)q + (size_t)(cq[b] * PH * PE) * es, L, PE);  /* (H, L, E) from (L, H, E) */
        s1.query.head_stride = PE, s1.query.row_stride = PH * PE;
        s1.out = dense_view(o1, L, PE);
        s1.lse = dense_view(l1, L, 1);
        s1.key_lengths = &lens[b], s1.block_table = &table[b][0];
        same = sdpa_attention(&s1) == SDPA_OK;
        for (int64_t h = 0; h < PH && same && shares; h++)
            for (int64_t l = 0; l < L; l++) {
                for (int64_t c = 0; c < PE; c++)
                    worst = fmax(worst, rel_err(load(out, dt, ((cq[b] + l) * PH + h) * PE + c), load(o1, dt, (h * L + l) * PE + c)));
                worst = fmax(worst, rel_err(load(lse, compute_dtype(dt), (cq[b] + l) * PH + h),
                                            load(l1, compute_dtype(dt), h * L + l)));
            }
        for (int64_t h = 0; h < PH && same && !shares; h++)
            for (int64_t l = 0; l < L && same; l++)
                same = memcmp((char *)o1 + (size_t)((h * L + l) * PE) * es,
                              (char *)out + (size_t)(((cq[b] + l) * PH + h) * PE) * es, (size_t)PE * es) == 0 &&
                       memcmp((char *)l1 + (size_t)(h * L + l) * ce, (char *)lse + (size_t)((cq[b] + l) * PH + h) * ce,
                              ce) == 0;
        free(o1), free(l1);
    }
    const double tol = dt == SDPA_FLOAT64 ? 1e-12 : dt == SDPA_FLOAT32 ? 1e-5 : 1e-2;
    check(same && worst <= tol, "paged mixed batch %s %s: each sequence's bits as alone, or within %.3g when it "
          "shares blocks (%.3g)", isa, dtype_name(dt), tol, worst);
    store(out, dt, 0, 123.0);
    const int64_t kept = cq[4];
    cq[4] = cq[3] + lens[3] + 1, p.len_q = cq[4];
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_RAGGED, "paged mixed batch: more rows than positions");
    cq[4] = kept, p.len_q = T;
    p.mask_kind = SDPA_MASK_BOOL, p.mask = dense_view(out, 1, 1);
    check_status(sdpa_attention(&p), SDPA_ERR_BAD_PAGES, "paged mixed batch: a tree");
    check(load(out, dt, 0) == 123.0, "paged mixed refusals write nothing");
    free(kc), free(vc), free(q), free(out), free(lse);
}

static void test_ragged(void) {
    const char *initial = sdpa_isa();
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        const sdpa_dtype dts[] = {SDPA_FLOAT32, SDPA_FLOAT64, SDPA_BFLOAT16};
        for (int d = 0; d < 3; d++) {
            ragged_case(ISAS[i], dts[d], 0);
            ragged_case(ISAS[i], dts[d], 1);
            paged_mixed_case(ISAS[i], dts[d]);
        }
    }
    sdpa_set_isa(initial);
}

/* The indexer (sdpa_index_topk, C API 0.5): on every kernel set, small
 * integer queries, keys and weights make every score exact in float32, so
 * the positions (ties to the lower one), the scores and the padding are
 * those of a double loop over all positions, for float32, bfloat16 and
 * float8 e4m3 keys (scaled by powers of two), causal rows, a key length, on
 * 1 and 3 threads; then the refusals. */
static void test_index_topk(void) {
    enum { TB = 2, TH = 3, TL = 2, TS = 300, TE = 16, TK = 40 };
    const char *initial = sdpa_isa();
    float q[TB][TH][TL][TE], w[TB][TL][TH], kf[TB][TS][TE], scale[TB][TS];
    uint16_t kb[TB][TS][TE];
    uint8_t k8[TB][TS][TE];
    int32_t idx[TB][TL][TK];
    float sc[TB][TL][TK];
    const int64_t lens[TB] = {TS, 250};
    unsigned st = 7;
    for (int b = 0; b < TB; b++) {
        for (int h = 0; h < TH; h++)
            for (int l = 0; l < TL; l++)
                for (int c = 0; c < TE; c++) q[b][h][l][c] = (float)((int)((st = st * 1103515245u + 12345u) >> 16) % 5 - 2);
        for (int l = 0; l < TL; l++)
            for (int h = 0; h < TH; h++) w[b][l][h] = (float)((int)((st = st * 1103515245u + 12345u) >> 16) % 3);
        for (int s = 0; s < TS; s++) {
            scale[b][s] = (float)(1 << ((st = st * 1103515245u + 12345u) >> 16) % 3) * 0.5f;
            for (int c = 0; c < TE; c++) {
                const int v = (int)((st = st * 1103515245u + 12345u) >> 16) % 5 - 2;
                kf[b][s][c] = (float)v;
                kb[b][s][c] = sdpa_f32_to_bf16((float)v);
                k8[b][s][c] = sdpa_f32_to_e4m3((float)v);
            }
        }
    }
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        for (int kind = 0; kind < 3; kind++)
            for (int causal = 0; causal < 2; causal++)
                for (int threads = 1; threads <= 3; threads += 2) {
                    sdpa_topk_problem p;
                    sdpa_topk_problem_init(&p);
                    p.batch = TB, p.heads = TH, p.len_q = TL, p.len_kv = TS, p.head_dim = TE, p.k = TK;
                    p.query = &q[0][0][0][0];
                    p.query_strides[0] = TH * TL * TE, p.query_strides[1] = TL * TE, p.query_strides[2] = TE;
                    p.key_dtype = kind == 0 ? SDPA_FLOAT32 : kind == 1 ? SDPA_BFLOAT16 : SDPA_FP8_E4M3;
                    p.key = kind == 0 ? (const void *)kf : kind == 1 ? (const void *)kb : (const void *)k8;
                    p.key_strides[0] = TS * TE, p.key_strides[1] = TE;
                    if (kind == 2) p.key_scale = &scale[0][0], p.key_scale_strides[0] = TS, p.key_scale_strides[1] = 1;
                    p.weights = &w[0][0][0];
                    p.weights_strides[0] = TL * TH, p.weights_strides[1] = TH;
                    p.key_lengths = lens;
                    p.causal = causal;
                    p.num_threads = threads;
                    p.indices = &idx[0][0][0];
                    p.scores = &sc[0][0][0];
                    check_status(sdpa_index_topk(&p), SDPA_OK, "sdpa_index_topk");
                    int bad = 0;
                    for (int b = 0; b < TB; b++)
                        for (int l = 0; l < TL; l++) {
                            int64_t lim = lens[b];
                            if (causal) lim = lim - TL + l + 1;
                            double all[TS];
                            for (int s = 0; s < lim; s++) {
                                double score = 0;
                                for (int h = 0; h < TH; h++) {
                                    double d = 0;
                                    for (int c = 0; c < TE; c++) d += (double)q[b][h][l][c] * kf[b][s][c];
                                    if (kind == 2) d *= scale[b][s];
                                    score += w[b][l][h] * (d > 0 ? d : 0);
                                }
                                all[s] = score;
                            }
                            for (int j = 0; j < TK; j++) { /* the j-th best: selection by repeated scans */
                                int best = -1;
                                for (int s = 0; s < lim; s++) {
                                    int taken = 0;
                                    for (int x = 0; x < j && !taken; x++) taken = idx[b][l][x] == s;
                                    if (!taken && (best < 0 || all[s] > all[best])) best = s;
                                }
                                if (best < 0) bad += idx[b][l][j] != -1 || sc[b][l][j] != -INFINITY;
                                else bad += idx[b][l][j] != best || sc[b][l][j] != (float)all[best];
                            }
                        }
                    check(bad == 0, "index_topk %s, keys %d, causal %d, %d threads: %d entries differ", ISAS[i], kind,
                          causal, threads, bad);
                }
    }
    sdpa_set_isa(initial);
    sdpa_topk_problem p;
    sdpa_topk_problem_init(&p);
    p.batch = 1, p.heads = 1, p.len_q = 1, p.len_kv = 4, p.head_dim = 4, p.k = 2;
    check_status(sdpa_index_topk(&p), SDPA_ERR_NULL_POINTER, "index_topk without arrays");
    p.heads = 0;
    check_status(sdpa_index_topk(&p), SDPA_ERR_BAD_SHAPE, "index_topk with no head");
    p.heads = 1, p.key_dtype = SDPA_INT4;
    check_status(sdpa_index_topk(&p), SDPA_ERR_BAD_DTYPE, "index_topk of int4 keys");
    p.key_dtype = SDPA_FLOAT32, p.num_threads = -1;
    check_status(sdpa_index_topk(&p), SDPA_ERR_BAD_THREADS, "index_topk on -1 threads");
    p.struct_size -= 8;
    check_status(sdpa_index_topk(&p), SDPA_ERR_ABI, "index_topk of another struct size");
}

/* Top-k lists in the descriptor (C API 0.5): each row of a sparse call
 * against a dense call over the keys and values its list gathers (within
 * rounding; the bits of 1 and 3 threads the same), with -1 entries, repeats,
 * empty rows, key_lengths, sinks, lists per key/value head or shared, caches
 * whose slices fold into one pool and caches that do not (positions before
 * heads), float, bfloat16 and int8 caches; then the refusals, nothing written. */
enum { SB = 2, SH = 4, SG = 2, SL = 70, SS = 50, SE = 16, SK = 9 };

/* Entry j of row l's list for batch index b and list h (a fixed pattern). */
static int32_t sparse_entry(int64_t b, int64_t h, int64_t l, int64_t j) {
    if (l % 13 == 5) return -1;                                /* a row with nothing */
    if (l % 11 == 3) return (int32_t)(5 * j + b);              /* a row already ascending */
    if (j < 3) return (int32_t)(3 + 8 * j + b + (l >= 64));    /* listed by every row of a group */
    if (j == SK - 1) return sparse_entry(b, h, l, 4);          /* a repeat */
    const int64_t x = (l * 31 + j * 17 + h * 7 + b * 3) % (SS + 3) - 1;
    return (int32_t)(x >= SS ? -1 : x);                        /* -1 now and then */
}

static void sparse_case(const char *isa, sdpa_dtype qdt, sdpa_dtype kvdt, int per_head, int heads_inner,
                        int with_lengths, int with_sinks) {
    const int64_t Hkv = SH / SG, lists = per_head ? Hkv : 1;
    const size_t qs = dtype_size(qdt), ks = kvdt == SDPA_INT8 ? 1 : dtype_size(kvdt);
    const int64_t nkv = SB * Hkv * SS * SE;
    void *q = xcalloc((size_t)(SB * SH * SL * SE), qs), *k = xcalloc((size_t)nkv, ks), *v = xcalloc((size_t)nkv, ks);
    float *ksc = (float *)xcalloc((size_t)(SB * Hkv * SS), sizeof(float));
    float *vsc = (float *)xcalloc((size_t)(SB * Hkv * SS), sizeof(float));
    void *out = xcalloc((size_t)(SB * SH * SL * SE), qs), *out3 = xcalloc((size_t)(SB * SH * SL * SE), qs);
    float *lse = (float *)xcalloc((size_t)(SB * SH * SL), sizeof(float));
    float *lse3 = (float *)xcalloc((size_t)(SB * SH * SL), sizeof(float));
    int32_t *idx = (int32_t *)xcalloc((size_t)(SB * lists * SL * SK), sizeof(int32_t));
    float sinks[SB * SH];
    const int64_t lengths[SB] = {SS, 30};
    for (int64_t i = 0; i < SB * SH * SL * SE; i++) store(q, qdt, i, 2 * rng_uniform() - 1);
    for (int64_t i = 0; i < nkv; i++) {
        if (kvdt == SDPA_INT8) {
            ((int8_t *)k)[i] = (int8_t)(rng_next() % 255 - 127);
            ((int8_t *)v)[i] = (int8_t)(rng_next() % 255 - 127);
        } else {
            store(k, kvdt, i, 2 * rng_uniform() - 1), store(v, kvdt, i, 2 * rng_uniform() - 1);
        }
    }
    for (int64_t i = 0; i < SB * Hkv * SS; i++) ksc[i] = 0.01f + 0.01f * (float)rng_uniform(), vsc[i] = 0.01f;
    for (int i = 0; i < SB * SH; i++) sinks[i] = (float)(rng_uniform() - 0.5);
    for (int64_t b = 0; b < SB; b++)
        for (int64_t h = 0; h < lists; h++)
            for (int64_t l = 0; l < SL; l++)
                for (int64_t j = 0; j < SK; j++) idx[((b * lists + h) * SL + l) * SK + j] = sparse_entry(b, h, l, j);
    /* the cache: (B, Hkv, S, E), or (B, S, Hkv, E) with heads_inner; scales alike with one column */
    const int64_t hs = heads_inner ? SE : SS * SE, rs = heads_inner ? Hkv * SE : SE;
    const int64_t shs = heads_inner ? 1 : SS, srs = heads_inner ? Hkv : 1;
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = qdt, p.kv_dtype = kvdt;
    p.num_batch_dims = 1, p.batch_shape[0] = SB;
    p.num_heads = SH, p.gqa_group = SG, p.len_q = SL, p.len_kv = SS, p.head_dim = p.head_dim_v = SE;
    p.scale = 0.3;
    p.query = (sdpa_view){q, {SH * SL * SE}, SL * SE, SE, 1};
    p.out = (sdpa_view){out, {SL * SH * SE}, SE, SH * SE, 1};  /* (B, L, H, E) */
    p.key = (sdpa_view){k, {Hkv * SS * SE}, hs, rs, 1};
    p.value = p.key, p.value.data = v;
    if (kvdt == SDPA_INT8) {
        p.key_scale = (sdpa_view){ksc, {Hkv * SS}, shs, srs, 1};
        p.value_scale = p.key_scale, p.value_scale.data = vsc;
    }
    p.lse = (sdpa_view){lse, {SH * SL}, SL, 1, 0};
    if (with_sinks) p.sinks = (sdpa_view){sinks, {SH}, 1, 0, 0};
    if (with_lengths) p.key_lengths = lengths, p.key_lengths_strides[0] = 1;
    p.topk_indices = (sdpa_view){idx, {lists * SL * SK}, per_head ? SL * SK : 0, SK, 1};
    p.topk = SK;
    p.num_threads = 1;
    sdpa_status st = sdpa_attention(&p);
    sdpa_problem p3 = p;
    p3.num_threads = 3, p3.out.data = out3, p3.lse.data = lse3;
    const int same = st == SDPA_OK && sdpa_attention(&p3) == SDPA_OK &&
                     memcmp(out, out3, (size_t)(SB * SH * SL * SE) * qs) == 0 &&
                     memcmp(lse, lse3, (size_t)(SB * SH * SL) * sizeof(float)) == 0;

    /* each row against a dense call over its gathered keys and values */
    double worst = st == SDPA_OK ? 0 : INFINITY;
    void *gk = xcalloc((size_t)(Hkv * SK * SE), ks), *gv = xcalloc((size_t)(Hkv * SK * SE), ks);
    float gks[SB * SK * 2], gvs[SB * SK * 2];
    void *go = xcalloc((size_t)(SH * SE), qs);
    float glse[SH];
    for (int64_t b = 0; b < SB && st == SDPA_OK; b++)
        for (int64_t h = 0; h < lists; h++)
            for (int64_t l = 0; l < SL; l++) {
                const int64_t limit = with_lengths ? lengths[b] : SS, heads = SH / lists;
                const int64_t h0 = per_head ? h : 0, h1 = per_head ? h + 1 : Hkv;
                int64_t c = 0;
                for (int64_t j = 0; j < SK; j++) {
                    const int32_t s = idx[((b * lists + h) * SL + l) * SK + j];
                    if (s < 0 || s >= limit) continue;
                    for (int64_t g = h0; g < h1; g++) {
                        const int64_t src = b * Hkv * SS * SE + g * hs + s * rs;
                        const int64_t dst = ((g - h0) * SK + c) * SE;
                        memcpy((char *)gk + (size_t)dst * ks, (char *)k + (size_t)src * ks, (size_t)SE * ks);
                        memcpy((char *)gv + (size_t)dst * ks, (char *)v + (size_t)src * ks, (size_t)SE * ks);
                        gks[(g - h0) * SK + c] = ksc[b * Hkv * SS + g * shs + s * srs];
                        gvs[(g - h0) * SK + c] = vsc[b * Hkv * SS + g * shs + s * srs];
                    }
                    c++;
                }
                sdpa_problem d = p;
                memset(&d.topk_indices, 0, sizeof(d.topk_indices));
                d.topk = 0, d.key_lengths = NULL;
                d.num_batch_dims = 0, d.num_heads = heads, d.len_q = 1, d.len_kv = c;
                d.query.data = (char *)q + (size_t)((b * SH + h * heads) * SL * SE + l * SE) * qs;
                d.out = (sdpa_view){go, {0}, SE, SE, 1};
                d.lse = (sdpa_view){glse, {0}, 1, 1, 0};
                d.key = (sdpa_view){gk, {0}, SK * SE, SE, 1};
                d.value = d.key, d.value.data = gv;
                if (kvdt == SDPA_INT8) {
                    d.key_scale = (sdpa_view){gks, {0}, SK, 1, 1};
                    d.value_scale = d.key_scale, d.value_scale.data = gvs;
                }
                if (with_sinks) d.sinks = (sdpa_view){sinks + b * SH + h * heads, {0}, 1, 0, 0};
                if (sdpa_attention(&d) != SDPA_OK) {
                    worst = INFINITY;
                    continue;
                }
                for (int64_t j = 0; j < heads; j++) {
                    const int64_t hq = h * heads + j;
                    for (int64_t e = 0; e < SE; e++) {
                        const double x = load(out, qdt, b * SL * SH * SE + l * SH * SE + hq * SE + e);
                        const double y = load(go, qdt, j * SE + e);
                        if (!(fabs(x - y) <= worst)) worst = fabs(x - y) == fabs(x - y) ? fabs(x - y) : INFINITY;
                    }
                    const double a = lse[(b * SH + hq) * SL + l], e2 = glse[j];
                    if (!(a == e2 || fabs(a - e2) <= worst)) worst = fabs(a - e2) == fabs(a - e2) ? fabs(a - e2) : INFINITY;
                }
            }
    const double tol = qdt == SDPA_BFLOAT16 ? 2e-2 : 2e-5;
    check(worst <= tol && same, "sparse %s %s/%s lists %s, %s%s%s: max diff %.2g from dense over the gathered keys%s",
          isa, dtype_name(qdt), kvdt == SDPA_INT8 ? "int8" : dtype_name(kvdt), per_head ? "per head" : "shared",
          heads_inner ? "positions before heads" : "heads before positions", with_lengths ? ", key_lengths" : "",
          with_sinks ? ", sinks" : "", worst, same ? "" : "; 1 and 3 threads differ");

    static int refused = 0;
    if (!refused++) {  /* refusals (once): nothing written */
        const char *field = NULL;
        store(out, qdt, 0, 123.0);
        idx[5] = -2;
        check(sdpa_check(&p, &field) == SDPA_ERR_BAD_TOPK && field && strcmp(field, "topk_indices") == 0,
              "sparse: an entry of -2 refused, naming topk_indices");
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_TOPK, "sparse: an entry of -2");
        idx[5] = SS;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_TOPK, "sparse: an entry at len_kv");
        idx[5] = 0;
        p.causal = 1;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_TOPK, "sparse: causal");
        p.causal = 0, p.window_left = 3;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_TOPK, "sparse: a window");
        p.window_left = -1, p.topk = -1;
        check_status(sdpa_attention(&p), SDPA_ERR_BAD_TOPK, "sparse: topk -1");
        p.topk = SK, p.topk_indices.data = NULL;
        check_status(sdpa_attention(&p), SDPA_ERR_NULL_POINTER, "sparse: topk without lists");
        check(load(out, qdt, 0) == 123.0, "sparse refusals write nothing");
    }
    free(q), free(k), free(v), free(ksc), free(vsc), free(out), free(out3), free(lse), free(lse3), free(idx);
    free(gk), free(gv), free(go);
}

static void test_sparse(void) {
    const char *initial = sdpa_isa();
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        for (int per_head = 0; per_head < 2; per_head++)
            for (int inner = 0; inner < 2; inner++) sparse_case(ISAS[i], SDPA_FLOAT32, SDPA_FLOAT32, per_head, inner, inner, !inner);
        sparse_case(ISAS[i], SDPA_BFLOAT16, SDPA_BFLOAT16, 1, 0, 1, 1);
        sparse_case(ISAS[i], SDPA_FLOAT32, SDPA_INT8, 1, 1, 0, 0);
        sparse_case(ISAS[i], SDPA_FLOAT32, SDPA_INT8, 0, 0, 1, 0);
    }
    sdpa_set_isa(initial);
}

/* Block maps and key scores (C API 0.6), on every kernel set: a map's call
 * against a dense call with the bool mask its states make (a partial block
 * sees every key, no other rule here), and key scores against the sums of the
 * weights the same call writes; then the refusals. */
static void test_blocks_and_key_scores(void) {
    const char *initial = sdpa_isa();
    const int64_t H = 4, G = 2, L = 70, S = 90, E = 16, bq = 16, bk = 20, W = 5;
    const int64_t qb = (L + bq - 1) / bq, kb = (S + bk - 1) / bk;
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        vprob x;
        vprob_make(&x, SDPA_FLOAT32, H, G, L, S, E, E);
        int8_t *states = (int8_t *)xcalloc((size_t)(H * qb * kb), 1);
        uint8_t *mask = (uint8_t *)xcalloc((size_t)(H * L * S), 1);
        float *dense = (float *)xcalloc((size_t)(H * L * E), sizeof(float));
        float *scores = (float *)xcalloc((size_t)(H / G * S), sizeof(float));
        for (int64_t j = 0; j < H * qb * kb; j++) states[j] = (int8_t)rng_int(0, 2);
        for (int64_t h = 0; h < H; h++)
            for (int64_t l = 0; l < L; l++)
                for (int64_t s = 0; s < S; s++)
                    mask[(h * L + l) * S + s] = states[(h * qb + l / bq) * kb + s / bk] != 0;
        sdpa_problem p = x.p;
        p.weights.data = NULL;
        p.block_states = (sdpa_view){.data = states, .head_stride = qb * kb, .row_stride = kb, .col_stride = 1};
        p.block_q = bq, p.block_k = bk;
        check_status(sdpa_attention(&p), SDPA_OK, "a block map");
        sdpa_problem d = x.p;
        d.weights.data = NULL;
        d.out.data = dense;
        d.mask_kind = SDPA_MASK_BOOL;
        d.mask = dense_view(mask, L, S);
        check_status(sdpa_attention(&d), SDPA_OK, "its dense mask");
        double err = 0;
        for (int64_t j = 0; j < H * L * E; j++) {  /* (not fmax: GCC 12 for AArch64 fails on its vectorized form) */
            const double d = fabs((double)((float *)x.out)[j] - dense[j]);
            if (d > err) err = d;
        }
        check(err < 1e-5, "%s: a block map against its dense mask, max error %g", ISAS[i], err);

        sdpa_problem k = x.p;  /* key scores of the last W rows, and the weights of every row */
        k.key_scores = (sdpa_view){.data = scores, .head_stride = S, .col_stride = 1};
        k.key_scores_rows = W;
        k.causal = 1;
        check_status(sdpa_attention(&k), SDPA_OK, "key scores");
        err = 0;
        for (int64_t hk = 0; hk < H / G; hk++)
            for (int64_t s = 0; s < S; s++) {
                double want = 0;
                for (int64_t h = hk * G; h < hk * G + G; h++)
                    for (int64_t l = L - W; l < L; l++) want += ((float *)x.w)[(h * L + l) * S + s];
                const double d = fabs(want - scores[hk * S + s]);
                if (d > err) err = d;
            }
        check(err < 1e-5, "%s: key scores against the weights' sums, max error %g", ISAS[i], err);

        states[3] = 3;
        check_field(&p, SDPA_ERR_BAD_BLOCKS, "block_states", "a state of 3");
        states[3] = 1;
        p.block_k = 0;
        check_field(&p, SDPA_ERR_BAD_BLOCKS, "block_k", "a block of no keys");
        p.block_k = bk;
        p.key_scores = k.key_scores;
        check_field(&p, SDPA_ERR_BAD_BLOCKS, "key_scores", "key scores with a block map");
        k.key_scores_rows = -1;
        check_field(&k, SDPA_ERR_BAD_SHAPE, "key_scores_rows", "a negative window of key scores");
        free(states), free(mask), free(dense), free(scores);
        vprob_free(&x);
    }
    sdpa_set_isa(initial);
}

/* ---- the backward pass and dropout ---- */

enum { BW_H = 4, BW_G = 2, BW_L = 13, BW_S = 17, BW_E = 8, BW_EV = 6 };

typedef struct bw_data {
    double q[BW_H][BW_L][BW_E], k[BW_H / BW_G][BW_S][BW_E], v[BW_H / BW_G][BW_S][BW_EV];
    double g[BW_H][BW_L][BW_EV], out[BW_H][BW_L][BW_EV], lse[BW_H][BW_L], sinks[BW_H], slopes[BW_H];
    double dq[BW_H][BW_L][BW_E], dk[BW_H / BW_G][BW_S][BW_E], dv[BW_H / BW_G][BW_S][BW_EV], dsinks[BW_H];
} bw_data;

static sdpa_view bw_view(void *data, int64_t rows, int64_t cols) {
    return (sdpa_view){.data = data, .head_stride = rows * cols, .row_stride = cols, .col_stride = 1};
}

/* every variant at once: GQA, bottom-right causality, a window, softcap,
 * ALiBi, sinks and, with dropout_p > 0, dropout */
static sdpa_problem bw_problem(bw_data *d, double dropout_p) {
    sdpa_problem p;
    sdpa_problem_init(&p);
    p.dtype = SDPA_FLOAT64;
    p.num_heads = BW_H, p.gqa_group = BW_G, p.len_q = BW_L, p.len_kv = BW_S, p.head_dim = BW_E;
    p.head_dim_v = BW_EV, p.scale = 0.4, p.causal = 1, p.causal_offset = BW_S - BW_L;
    p.window_left = 7, p.window_right = 0, p.align_offset = BW_S - BW_L, p.softcap = 1.7;
    p.query = bw_view(d->q, BW_L, BW_E), p.key = bw_view(d->k, BW_S, BW_E), p.value = bw_view(d->v, BW_S, BW_EV);
    p.out = bw_view(d->out, BW_L, BW_EV), p.lse = bw_view(d->lse, BW_L, 1);
    p.sinks = (sdpa_view){.data = d->sinks, .head_stride = 1};
    p.alibi = (sdpa_view){.data = d->slopes, .head_stride = 1};
    p.dropout_p = dropout_p, p.dropout_seed = 77;
    return p;
}

static double bw_loss(bw_data *d, double dropout_p) {
    sdpa_problem p = bw_problem(d, dropout_p);
    if (sdpa_attention(&p) != SDPA_OK) return NAN;
    double sum = 0;
    for (int i = 0; i < BW_H * BW_L * BW_EV; i++) sum += (&d->g[0][0][0])[i] * (&d->out[0][0][0])[i];
    return sum;
}

/* <grad, u> against the central difference of the loss along u, for random u */
static double bw_directional(bw_data *d, double *x, const double *grad, int n, double dropout_p) {
    double *u = (double *)xcalloc((size_t)n, sizeof(double)), worst = 0;
    for (int t = 0; t < 2; t++) {
        double analytic = 0;
        for (int i = 0; i < n; i++) u[i] = rng_uniform() - 0.5, analytic += u[i] * grad[i];
        const double h = 1e-6;
        for (int i = 0; i < n; i++) x[i] += h * u[i];
        const double up = bw_loss(d, dropout_p);
        for (int i = 0; i < n; i++) x[i] -= 2 * h * u[i];
        const double down = bw_loss(d, dropout_p);
        for (int i = 0; i < n; i++) x[i] += h * u[i];
        const double err = fabs((up - down) / (2 * h) - analytic) / (1 + fabs(analytic));
        if (!(err <= worst)) worst = err;
    }
    free(u);
    return worst;
}

/* bfloat16 operands (on the sets with bfloat16 products, S and dP multiply the
 * stored pairs): the gradients within bfloat16's rounding of float64's over
 * the same (rounded) values */
static void test_backward_bf16(bw_data *d) {
    enum { NQ = BW_H * BW_L * BW_E, NK = BW_H / BW_G * BW_S * BW_E, NV = BW_H / BW_G * BW_S * BW_EV,
           NO = BW_H * BW_L * BW_EV };
    uint16_t *h = (uint16_t *)xcalloc(2 * (NQ + NK) + 2 * NV + 2 * NO, sizeof(uint16_t));
    uint16_t *q = h, *k = q + NQ, *v = k + NK, *g = v + NV, *out = g + NO, *dq = out + NO, *dk = dq + NQ,
             *dv = dk + NK;
    double *src[] = {&d->q[0][0][0], &d->k[0][0][0], &d->v[0][0][0], &d->g[0][0][0]};
    uint16_t *dst[] = {q, k, v, g};
    const int n[] = {NQ, NK, NV, NO};
    for (int a = 0; a < 4; a++)
        for (int j = 0; j < n[a]; j++) {
            dst[a][j] = sdpa_f32_to_bf16((float)(2 * rng_uniform() - 1));
            src[a][j] = sdpa_bf16_to_f32(dst[a][j]);
        }
    const char *initial = sdpa_isa();
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        sdpa_problem p = bw_problem(d, 0.0);  /* float64: the reference */
        sdpa_grads g64;
        sdpa_grads_init(&g64);
        g64.grad_out = bw_view(d->g, BW_L, BW_EV), g64.grad_query = bw_view(d->dq, BW_L, BW_E);
        g64.grad_key = bw_view(d->dk, BW_S, BW_E), g64.grad_value = bw_view(d->dv, BW_S, BW_EV);
        sdpa_attention(&p);
        check_status(sdpa_attention_backward(&p, &g64), SDPA_OK, "the float64 backward");
        float lse[BW_H][BW_L], sinks[BW_H], slopes[BW_H];
        for (int j = 0; j < BW_H; j++) sinks[j] = (float)d->sinks[j], slopes[j] = (float)d->slopes[j];
        sdpa_problem b = p;
        b.dtype = SDPA_BFLOAT16;
        b.query.data = q, b.key.data = k, b.value.data = v, b.out.data = out, b.lse.data = lse;
        b.sinks.data = sinks, b.alibi.data = slopes;
        check_status(sdpa_attention(&b), SDPA_OK, "the bfloat16 forward");
        sdpa_grads g16 = g64;
        g16.grad_out.data = g, g16.grad_query.data = dq, g16.grad_key.data = dk, g16.grad_value.data = dv;
        check_status(sdpa_attention_backward(&b, &g16), SDPA_OK, "the bfloat16 backward");
        const uint16_t *got[] = {dq, dk, dv};
        const double *want[] = {&d->dq[0][0][0], &d->dk[0][0][0], &d->dv[0][0][0]};
        const int m[] = {NQ, NK, NV};
        double worst = 0;
        for (int a = 0; a < 3; a++) {
            double err = 0, top = 0;
            for (int j = 0; j < m[a]; j++) {
                const double e = fabs(sdpa_bf16_to_f32(got[a][j]) - want[a][j]);
                if (e > err) err = e;
                if (fabs(want[a][j]) > top) top = fabs(want[a][j]);
            }
            if (err / top > worst) worst = err / top;
        }
        check(worst < 2e-2, "%s: bfloat16 gradients against float64's, largest error %g of the largest", ISAS[i],
              worst);
    }
    sdpa_set_isa(initial);
    free(h);
}

static void test_backward(void) {
    const char *initial = sdpa_isa();
    bw_data *d = (bw_data *)xcalloc(1, sizeof(bw_data));
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!tested(ISAS[i]) || sdpa_set_isa(ISAS[i]) != SDPA_OK) continue;
        for (int drop = 0; drop < 2; drop++) {
            const double dropout_p = drop ? 0.3 : 0.0;
            double *fill[] = {&d->q[0][0][0], &d->k[0][0][0], &d->v[0][0][0], &d->g[0][0][0], d->sinks, d->slopes};
            const int sizes[] = {BW_H * BW_L * BW_E, BW_H / BW_G * BW_S * BW_E, BW_H / BW_G * BW_S * BW_EV,
                                 BW_H * BW_L * BW_EV, BW_H, BW_H};
            for (int a = 0; a < 6; a++)
                for (int j = 0; j < sizes[a]; j++) fill[a][j] = a == 5 ? 0.3 * rng_uniform() : 2 * rng_uniform() - 1;
            sdpa_problem p = bw_problem(d, dropout_p);
            check_status(sdpa_attention(&p), SDPA_OK, "the forward of the backward's problem");
            sdpa_grads g;
            sdpa_grads_init(&g);
            g.grad_out = bw_view(d->g, BW_L, BW_EV), g.grad_query = bw_view(d->dq, BW_L, BW_E);
            g.grad_key = bw_view(d->dk, BW_S, BW_E), g.grad_value = bw_view(d->dv, BW_S, BW_EV);
            g.grad_sinks = (sdpa_view){.data = d->dsinks, .head_stride = 1};
            check_status(sdpa_attention_backward(&p, &g), SDPA_OK, "sdpa_attention_backward");
            const double eq = bw_directional(d, fill[0], &d->dq[0][0][0], sizes[0], dropout_p);
            const double ek = bw_directional(d, fill[1], &d->dk[0][0][0], sizes[1], dropout_p);
            const double ev = bw_directional(d, fill[2], &d->dv[0][0][0], sizes[2], dropout_p);
            const double es = bw_directional(d, d->sinks, d->dsinks, BW_H, dropout_p);
            check(eq < 1e-7 && ek < 1e-7 && ev < 1e-7 && es < 1e-7,
                  "%s, dropout %.1f: gradients against central differences: dQ %g, dK %g, dV %g, sinks %g", ISAS[i],
                  dropout_p, eq, ek, ev, es);
            p = bw_problem(d, dropout_p);  /* the gradients of 1 and 3 threads, bit for bit */
            double dq1[BW_H * BW_L * BW_E], dk1[BW_H / BW_G * BW_S * BW_E];
            p.num_threads = 1;
            sdpa_attention(&p);
            sdpa_attention_backward(&p, &g);
            memcpy(dq1, d->dq, sizeof(dq1)), memcpy(dk1, d->dk, sizeof(dk1));
            p.num_threads = 3;
            sdpa_attention_backward(&p, &g);
            check(memcmp(dq1, d->dq, sizeof(dq1)) == 0 && memcmp(dk1, d->dk, sizeof(dk1)) == 0,
                  "%s, dropout %.1f: the gradients of 1 and 3 threads differ", ISAS[i], dropout_p);
        }
    }
    sdpa_set_isa(initial);
    test_backward_bf16(d);
    /* refusals, naming the field */
    sdpa_problem p = bw_problem(d, 0.0);
    sdpa_grads g;
    sdpa_grads_init(&g);
    g.grad_out = bw_view(d->g, BW_L, BW_EV), g.grad_query = bw_view(d->dq, BW_L, BW_E);
    g.grad_key = bw_view(d->dk, BW_S, BW_E), g.grad_value = bw_view(d->dv, BW_S, BW_EV);
    const char *field = NULL;
    sdpa_grads bad = g;
    bad.grad_key.row_stride = 0;
    check(sdpa_check_backward(&p, &bad, &field) == SDPA_ERR_BAD_SHAPE && field && !strcmp(field, "grad_key"),
          "a broadcast grad_key: %s", field ? field : "(none)");
    bad = g;
    bad.struct_size = 8;
    check_status(sdpa_attention_backward(&p, &bad), SDPA_ERR_ABI, "a grads struct of another size");
    sdpa_problem q = p;
    q.lse.data = NULL;
    check(sdpa_check_backward(&q, &g, &field) == SDPA_ERR_NULL_POINTER && field && !strcmp(field, "lse"),
          "no lse: %s", field ? field : "(none)");
    q = p;
    q.weights = bw_view(d->dq, BW_L, BW_S);
    check(sdpa_check_backward(&q, &g, &field) == SDPA_ERR_BAD_VARIANT && field && !strcmp(field, "weights"),
          "weights: %s", field ? field : "(none)");
    q = p;
    q.dropout_p = 1.0;
    check_field(&q, SDPA_ERR_BAD_VARIANT, "dropout_p", "dropout_p 1");
    q.dropout_p = 0.5;
    q.weights = bw_view(d->dq, BW_L, BW_S);
    check_field(&q, SDPA_ERR_BAD_VARIANT, "weights", "dropout with weights");
    free(d);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else {
            fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
            return 2;
        }
    }
    const char *env = getenv("SDPA_TEST_QUICK");
    if (env && env[0] && strcmp(env, "0") != 0) quick = 1;

    const char *initial_isa = sdpa_isa();
    const char *named = getenv("SDPA_ISA");
    if (named && *named) {
        only_isa = named;
        check(strcmp(initial_isa, named) == 0 && sdpa_isa_supported(named), "SDPA_ISA=%s is the set in use (%s)",
              named, initial_isa);
    }
    char supported[128] = "";
    for (int i = 0; i < NUM_ISAS; i++)
        if (sdpa_isa_supported(ISAS[i])) strcat(strcat(supported, " "), ISAS[i]);
    printf("# sdpa %s, kernels %s (supported:%s), OpenMP %s, default threads %d%s%s%s\n", sdpa_version(), initial_isa,
           supported, sdpa_has_openmp() ? "yes" : "no", sdpa_default_num_threads(), quick ? ", quick" : "",
           only_isa ? ", cases on " : "", only_isa ? only_isa : "");
    for (int i = 0; i < NUM_ISAS; i++)
        if (!sdpa_isa_supported(ISAS[i])) skip("kernel set %s: not supported by this CPU or build", ISAS[i]);

    const clock_t t0 = clock();
    test_statuses();
    test_check();
    sdpa_set_isa(initial_isa);
    test_seed_example(SDPA_FLOAT32);
    test_seed_example(SDPA_FLOAT64);
    test_interrupt();
    test_variants();
    test_int8();
    test_integer_pv();
    test_abi_guard();
    test_fp_mode();
    test_special_values();
    test_paged();
    test_ragged();
    test_index_topk();
    test_sparse();
    test_blocks_and_key_scores();
    test_backward();
    sdpa_set_isa(initial_isa);
    for (int d = 0; d < 2; d++) {
        const sdpa_dtype dt = d == 0 ? SDPA_FLOAT32 : SDPA_FLOAT64;
        clock_t t = clock();
        sweep(dt, dt);
        printf("# sweep %s: %.2f s cpu\n", dtype_name(dt), (double)(clock() - t) / CLOCKS_PER_SEC);
        t = clock();
        feature_cases(dt, dt);
        printf("# feature cases %s: %.2f s cpu\n", dtype_name(dt), (double)(clock() - t) / CLOCKS_PER_SEC);
    }
    /* 16-bit storage: both 16-bit types alone, and a float32 query against a 16-bit cache */
    const sdpa_dtype pairs[][2] = {{SDPA_BFLOAT16, SDPA_BFLOAT16}, {SDPA_FLOAT16, SDPA_FLOAT16},
                                   {SDPA_FLOAT32, SDPA_BFLOAT16}, {SDPA_FLOAT32, SDPA_FLOAT16},
                                   {SDPA_BFLOAT16, SDPA_FLOAT32}};
    for (int i = 0; i < (int)(sizeof(pairs) / sizeof(pairs[0])); i++) {
        if (quick && i % 2) continue; /* under valgrind: bfloat16 alone, float32/float16, bfloat16/float32 */
        clock_t t = clock();
        feature_cases(pairs[i][0], pairs[i][1]);
        printf("# feature cases %s/%s: %.2f s cpu\n", dtype_name(pairs[i][0]), dtype_name(pairs[i][1]),
               (double)(clock() - t) / CLOCKS_PER_SEC);
    }
    sdpa_set_isa(initial_isa);
    printf("# total: %.2f s cpu\n", (double)(clock() - t0) / CLOCKS_PER_SEC);

    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
