/*
 * Fuzzing the C API: every field of sdpa_problem comes from the input bytes.
 *
 * Sizes (0 and negative included), the query's and the key/value dtypes (16-bit
 * ones, combinations that are refused, unknown values) and mask kinds,
 * GQA groups, batch dims, strides of every view (dense, permuted, padded,
 * reversed, zero for inputs), scale (0, huge, NaN, inf), causality with any
 * int64 offset (both ends of the range), key lengths (negative, past S, int64
 * extremes) with their strides, weights and lse outputs, thread counts, an
 * interrupt callback, the model variants (window sides, the alignment offset,
 * softcap, ALiBi slopes and sink logits, with values out of range too), top-k
 * lists (per key/value head or shared, -1 entries, repeats, entries out of
 * range, with the options they refuse), block maps (blocks of 1-20 rows and
 * keys, states 0-2, a bad state or block size, with weights), key scores
 * (every row or the last ones, with lists or a map), and values with NaN,
 * infinities and subnormals.  For each problem:
 *
 *   - a problem the harness built invalid must get an error status, a valid
 *     one SDPA_OK (or SDPA_ERR_INTERRUPTED when its callback stops it);
 *   - outputs, weights, lse and key scores are compared with a
 *     double-precision reference written here, when every input value is
 *     finite;
 *   - the bits must not change with the thread count or the output's layout
 *     (except which NaN a NaN result is);
 *   - the inputs must be unchanged.
 *
 * Built with libFuzzer (clang -fsanitize=fuzzer,address,undefined, see
 * fuzz/README.md), or with -DSDPA_FUZZ_STANDALONE as a program that runs
 * files given as arguments, or N random inputs: sdpa_fuzz_problem --runs N
 * [--seed S].  A failed check prints the problem and aborts;
 * SDPA_FUZZ_VERBOSE=1 prints every problem and its status.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "sdpa.h"

#define MAX_DIMS (SDPA_MAX_BATCH_DIMS + 3)

/* ---- reading decisions from the bytes (zeros once they run out) ---- */

typedef struct reader {
    const uint8_t *data;
    size_t size, pos;
} reader;

static uint64_t take(reader *r, int nbytes) {
    uint64_t x = 0;
    for (int i = 0; i < nbytes; i++) x = (x << 8) | (r->pos < r->size ? r->data[r->pos++] : 0);
    return x;
}

/* an int in [lo, hi] (hi - lo < 2^32) */
static int64_t range(reader *r, int64_t lo, int64_t hi) {
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(take(r, span <= 256 ? 1 : span <= 65536 ? 2 : 4) % span);
}

/* true one time in n; never on zero bytes, so a short input is a plain problem */
static int one_in(reader *r, int n) { return range(r, 0, n - 1) == n - 1; }

/* ---- failing ---- */

static char problem_text[2048];
static long stat_skipped, stat_refused, stat_computed, stat_compared, stat_interrupted;

static void fail(const char *what) {
    fprintf(stderr, "fuzz_problem: %s\n%s\n", what, problem_text);
    abort();
}

/* ---- operands ---- */

typedef struct operand {
    int nd;                   /* logical dims: batch..., head, row[, col]   */
    int64_t n[MAX_DIMS];
    int64_t stride[MAX_DIMS]; /* elements; may be 0 (inputs) or negative    */
    size_t elem;
    size_t total;             /* elements allocated                         */
    unsigned char *base, *data;
} operand;

/* Lays out an operand: dims in a random order, some padded, some reversed,
 * and (inputs only) some broadcast with stride 0. */
static int make_operand(reader *r, operand *o, int nd, const int64_t *n, size_t elem, int input) {
    memset(o, 0, sizeof(*o));
    o->nd = nd, o->elem = elem;
    int order[MAX_DIMS];
    for (int d = 0; d < nd; d++) order[d] = nd - 1 - d, o->n[d] = n[d];
    if (one_in(r, 3))
        for (int i = nd - 1; i > 0; i--) {
            int j = (int)range(r, 0, i), t = order[i];
            order[i] = order[j], order[j] = t;
        }
    int64_t cur = 1, offset = 0;
    for (int i = 0; i < nd; i++) {
        const int d = order[i];
        const int zero = input && one_in(r, 6);
        const int64_t stored = zero || n[d] == 0 ? 1 : n[d];
        int64_t s = zero ? 0 : cur;
        if (!zero && one_in(r, 5)) {
            s = -s;
            offset += (stored - 1) * cur;
        }
        o->stride[d] = s;
        cur *= stored + (one_in(r, 4) ? range(r, 1, 2) : 0);
        if (cur > (1 << 22)) return 0; /* too large for a fuzz input */
    }
    o->total = (size_t)cur;
    o->base = (unsigned char *)calloc(o->total ? o->total : 1, elem);
    if (!o->base) return 0;
    o->data = o->base + offset * (int64_t)elem;
    return 1;
}

static void free_operand(operand *o) { free(o->base); }

static int64_t offset_of(const operand *o, const int64_t *idx) {
    int64_t off = 0;
    for (int d = 0; d < o->nd; d++) off += idx[d] * o->stride[d];
    return off;
}

static sdpa_view view_of(const operand *o, int nb) {
    sdpa_view v;
    memset(&v, 0, sizeof(v));
    v.data = o->data;
    for (int d = 0; d < nb; d++) v.batch_strides[d] = o->stride[d];
    v.head_stride = o->stride[nb];
    v.row_stride = o->stride[nb + 1];
    v.col_stride = o->nd > nb + 2 ? o->stride[nb + 2] : 0;
    return v;
}

static double load(const operand *o, sdpa_dtype dt, int64_t off) {
    switch (dt) {
        case SDPA_FLOAT64: return ((const double *)o->data)[off];
        case SDPA_BFLOAT16: return sdpa_bf16_to_f32(((const uint16_t *)o->data)[off]);
        case SDPA_FLOAT16: return sdpa_f16_to_f32(((const uint16_t *)o->data)[off]);
        default: return ((const float *)o->data)[off];
    }
}

static size_t dtype_size(sdpa_dtype dt) { return dt == SDPA_FLOAT64 ? 8 : dt == SDPA_FLOAT32 ? 4 : 2; }

/* Values: small multiples of 1/32, and with `specials` now and then NaN,
 * infinities, a subnormal or a huge value. */
static double value(reader *r, int specials) {
    int kind = (int)range(r, 0, 15);
    if (!specials || kind >= 6) return (double)((int64_t)take(r, 1) - 128) / 32.0;
    static const double special[6] = {NAN, INFINITY, -INFINITY, 1e-40, -3e38, 1e300};
    return special[kind];
}

static void store(unsigned char *base, size_t i, sdpa_dtype dt, double x) {
    switch (dt) {
        case SDPA_FLOAT64: ((double *)base)[i] = x; break;
        case SDPA_BFLOAT16: ((uint16_t *)base)[i] = sdpa_f32_to_bf16((float)x); break;
        case SDPA_FLOAT16: ((uint16_t *)base)[i] = sdpa_f32_to_f16((float)x); break;
        default: ((float *)base)[i] = (float)x; break;
    }
}

static void fill(reader *r, operand *o, sdpa_dtype dt, int specials) {
    for (size_t i = 0; i < o->total; i++) store(o->base, i, dt, value(r, specials));
}

/* ---- the interrupt callback: stops after a number of polls ---- */

typedef struct stopper {
    int polls, stop_after;
} stopper;

static int poll_stopper(void *data) {
    stopper *s = (stopper *)data;
    return ++s->polls > s->stop_after;
}

/* ---- one input ---- */

static const sdpa_status ERRORS_OF_INVALID[] = {SDPA_ERR_NULL_POINTER, SDPA_ERR_BAD_DTYPE, SDPA_ERR_BAD_SHAPE,
                                                SDPA_ERR_BAD_GQA, SDPA_ERR_BAD_MASK, SDPA_ERR_BAD_THREADS,
                                                SDPA_ERR_OVERFLOW, SDPA_ERR_BAD_VARIANT, SDPA_ERR_BAD_TOPK,
                                                SDPA_ERR_BAD_BLOCKS};

static int is_validation_error(sdpa_status st) {
    for (size_t i = 0; i < sizeof(ERRORS_OF_INVALID) / sizeof(ERRORS_OF_INVALID[0]); i++)
        if (st == ERRORS_OF_INVALID[i]) return 1;
    return 0;
}

static int run_input(const uint8_t *data, size_t size) {
    reader rd = {data, size, 0}, *r = &rd;
    sdpa_problem p;
    sdpa_problem_init(&p);
    int valid = 1;

    /* element type, sizes, heads */
    /* the query's dtype and the key/value dtype: float64 goes with float64 only,
     * the others (float32, bfloat16, float16) with each other (the quantized
     * keys and values, SDPA_INT8 to SDPA_INT4, are tested by the C and Python
     * suites: an unknown kv_dtype here starts above them) */
    p.dtype = one_in(r, 40) ? (sdpa_dtype)range(r, 4, 9) : (sdpa_dtype)range(r, 0, 3);
    if (p.dtype > SDPA_FLOAT16) valid = 0;
    if (one_in(r, 3)) {
        p.kv_dtype = one_in(r, 40) ? (sdpa_dtype)range(r, SDPA_INT4 + 1, SDPA_INT4 + 5) : (sdpa_dtype)range(r, 0, 3);
        if (p.kv_dtype > SDPA_FLOAT16 || (p.dtype == SDPA_FLOAT64) != (p.kv_dtype == SDPA_FLOAT64)) valid = 0;
    }
    const sdpa_dtype dt = p.dtype <= SDPA_FLOAT16 ? p.dtype : SDPA_FLOAT32;
    const sdpa_dtype kvdt = p.kv_dtype == SDPA_DTYPE_OF_QUERY ? dt : p.kv_dtype <= SDPA_FLOAT16 ? p.kv_dtype : SDPA_FLOAT32;
    const sdpa_dtype cdt = dt == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32; /* weights, lse, mask */
    const size_t elem = dtype_size(dt), kvelem = dtype_size(kvdt), celem = dtype_size(cdt);
    int nb = (int)range(r, 0, 3);
    if (one_in(r, 40)) nb = one_in(r, 2) ? -1 : SDPA_MAX_BATCH_DIMS + 1, valid = 0;
    p.num_batch_dims = nb;
    const int nbv = nb < 0 ? 0 : nb > SDPA_MAX_BATCH_DIMS ? SDPA_MAX_BATCH_DIMS : nb;
    int64_t batch_count = 1;
    for (int d = 0; d < nbv; d++) {
        p.batch_shape[d] = range(r, 0, 3);
        if (one_in(r, 60)) p.batch_shape[d] = -range(r, 1, 3), valid = 0;
        batch_count *= p.batch_shape[d] > 0 ? p.batch_shape[d] : 0;
    }
    const int64_t hkv = range(r, 0, 3), group = range(r, 1, 4);
    p.num_heads = hkv * group;
    p.gqa_group = group;
    if (one_in(r, 40)) p.gqa_group = range(r, -1, 0), valid = 0;
    else if (one_in(r, 40) && p.num_heads % (group + 1)) p.gqa_group = group + 1, valid = 0;
    p.len_q = range(r, 0, 20);
    p.len_kv = range(r, 0, 70);
    p.head_dim = range(r, 0, 40);
    p.head_dim_v = range(r, 0, 40);
    if (one_in(r, 40)) {
        int64_t *field[] = {&p.num_heads, &p.len_q, &p.len_kv, &p.head_dim, &p.head_dim_v};
        *field[range(r, 0, 4)] = -range(r, 1, 5);
        valid = 0;
    }
    const int64_t H = p.num_heads > 0 ? p.num_heads : 0, L = p.len_q > 0 ? p.len_q : 0;
    const int64_t S = p.len_kv > 0 ? p.len_kv : 0, E = p.head_dim > 0 ? p.head_dim : 0;
    const int64_t Ev = p.head_dim_v > 0 ? p.head_dim_v : 0;
    const int64_t G = p.gqa_group > 0 ? p.gqa_group : 1, Hkv = H / G;

    /* masks, scale, causality, key lengths, outputs, threads */
    p.mask_kind = (sdpa_mask_kind)range(r, 0, 2);
    if (one_in(r, 40)) p.mask_kind = (sdpa_mask_kind)range(r, 3, 9), valid = 0;
    static const double scales[] = {0, -1, 1e30, NAN, INFINITY};
    p.scale = one_in(r, 8) ? scales[range(r, 0, 4)] : (E > 0 ? 1 / sqrt((double)E) : 1) * (1 + 0.25 * range(r, -2, 2));
    p.causal = (int32_t)range(r, 0, 1);
    static const int64_t far[] = {INT64_MAX, INT64_MAX - 5, INT64_MIN, INT64_MIN + 5, (int64_t)1 << 62};
    switch (range(r, 0, 3)) {
        case 0: p.causal_offset = 0; break;
        case 1: p.causal_offset = S - L; break;
        case 2: p.causal_offset = range(r, -30, 80); break;
        default: p.causal_offset = far[range(r, 0, 4)]; break;
    }
    /* the model variants, in half of the problems: window sides (-1 leaves a
     * side unbounded; below -1 or past 2^61 is refused), the alignment offset
     * (past 2^61 either way is refused with a window or ALiBi), softcap (finite
     * and >= 0, or refused), ALiBi slopes and sink logits */
    const int64_t big = (int64_t)1 << 61;
    int with_alibi = 0, with_sinks = 0;
    /* top-k lists (in a quarter of the problems): k entries a row, per key/value
     * head or shared.  They go without a mask, weights, causality, a window or
     * ALiBi (else refused): in 9 of 10 such problems those are turned off where
     * the rest of the problem allows it */
    const int with_topk = one_in(r, 4), topk_alone = with_topk && !one_in(r, 10);
    if (one_in(r, 2)) {
        int64_t *side[2] = {&p.window_left, &p.window_right};
        static const int64_t wide[] = {80, (int64_t)1 << 40, ((int64_t)1 << 61) - 1, (int64_t)1 << 61};
        static const int64_t bad_side[] = {-2, INT64_MIN, ((int64_t)1 << 61) + 1, INT64_MAX};
        for (int i = 0; i < 2; i++) switch (range(r, 0, 31)) {
                case 0: *side[i] = -range(r, 2, 5); valid = 0; break;
                case 1: *side[i] = bad_side[range(r, 0, 3)]; valid = 0; break;
                case 2: case 3: case 4: case 5: *side[i] = wide[range(r, 0, 3)]; break;
                case 6: case 7: case 8: case 9: *side[i] = 0; break;
                case 10: case 11: case 12: case 13: case 14: case 15: case 16: case 17: *side[i] = range(r, 1, 40); break;
                default: *side[i] = -1; break;
            }
        static const int64_t far_align[] = {(int64_t)1 << 61, -((int64_t)1 << 61), ((int64_t)1 << 61) + 1,
                                            -((int64_t)1 << 61) - 1, INT64_MAX, INT64_MIN};
        switch (range(r, 0, 5)) {
            case 0: p.align_offset = 0; break;
            case 1: case 2: p.align_offset = S - L; break;
            case 3: case 4: p.align_offset = range(r, -30, 80); break;
            default: p.align_offset = far_align[range(r, 0, 5)]; break;
        }
        with_alibi = one_in(r, 3), with_sinks = one_in(r, 3);
        if (topk_alone) { /* (sides out of range stay: refused anyway) */
            with_alibi = 0;
            if (p.window_left >= -1 && p.window_left <= big) p.window_left = -1;
            if (p.window_right >= -1 && p.window_right <= big) p.window_right = -1;
        }
        if ((p.window_left >= 0 || p.window_right >= 0 || with_alibi) && (p.align_offset > big || p.align_offset < -big))
            valid = 0;
        static const double caps[] = {0.5, 1, 2.5, 5, 20, 50};
        static const double far_caps[] = {4.9e-324, 1e-300, 1e-30, 1e-3, 1e4, 1e30, 1e300, -0.0};
        static const double bad_caps[] = {NAN, -1, -1e-300, INFINITY, -INFINITY};
        switch (range(r, 0, 31)) {
            case 0: p.softcap = bad_caps[range(r, 0, 4)]; valid = 0; break;
            case 1: case 2: case 3: p.softcap = far_caps[range(r, 0, 7)]; break;
            case 4: case 5: case 6: case 7: case 8: case 9: case 10: case 11: case 12: case 13:
                p.softcap = caps[range(r, 0, 5)];
                break;
            default: p.softcap = 0; break;
        }
    }
    int with_lengths = one_in(r, 3), with_weights = one_in(r, 4), with_lse = one_in(r, 3);
    int64_t K = 0;
    int topk_shared = 0;
    if (with_topk) {
        K = range(r, 0, 9);
        topk_shared = one_in(r, 2);
        if (topk_alone) { /* (an unknown mask kind stays: refused anyway) */
            if (p.mask_kind <= SDPA_MASK_ADDITIVE) p.mask_kind = SDPA_MASK_NONE;
            p.causal = 0, with_weights = 0;
        }
        if (p.mask_kind != SDPA_MASK_NONE || p.causal || with_weights || with_alibi || p.window_left >= 0 ||
            p.window_right >= 0)
            valid = 0;
    }
    /* a block map (in a fifth of the problems without lists): blocks of 1-20
     * rows and keys (0 refused), states 0-2 (3 refused, below); not with
     * weights (refused: in 9 of 10 such problems they are turned off) */
    const int with_blocks = !with_topk && one_in(r, 5);
    int64_t bq = 1, bk = 1;
    if (with_blocks) {
        bq = range(r, 1, 20), bk = range(r, 1, 20);
        if (one_in(r, 40)) *(one_in(r, 2) ? &bq : &bk) = 0, valid = 0;
        if (!one_in(r, 10)) with_weights = 0;
        if (with_weights) valid = 0;
    }
    const int64_t QB = bq > 0 ? (L + bq - 1) / bq : 1, KB = bk > 0 ? (S + bk - 1) / bk : 1;
    /* key scores (in a fifth of the problems): the last W rows (0: all); not
     * with lists or a map, nor a negative W (refused) */
    const int with_scores = one_in(r, 5);
    int64_t W = 0;
    if (with_scores) {
        W = range(r, 0, L + 2);
        if (one_in(r, 40)) W = -range(r, 1, 3), valid = 0;
        if (with_topk || with_blocks) valid = 0;
    }
    p.num_threads = (int32_t)range(r, 0, 3);
    if (one_in(r, 60)) p.num_threads = -1, valid = 0;
    stopper stop = {0, (int)range(r, 0, 3)};
    if (one_in(r, 10)) p.interrupt = poll_stopper, p.interrupt_data = &stop;

    /* the operands */
    int64_t shape[MAX_DIMS];
    for (int d = 0; d < nbv; d++) shape[d] = p.batch_shape[d] > 0 ? p.batch_shape[d] : 0;
    operand q, k, v, out, mask, weights, lse, lengths, alibi, sinks, lists, states, scores;
    operand *all[13] = {&q, &k, &v, &out, &mask, &weights, &lse, &lengths, &alibi, &sinks, &lists, &states, &scores};
    for (int i = 0; i < 13; i++) memset(all[i], 0, sizeof(operand));
    int ok = 1;
    const int specials = one_in(r, 4);
    shape[nbv] = H, shape[nbv + 1] = L, shape[nbv + 2] = E;
    ok &= make_operand(r, &q, nbv + 3, shape, elem, 1);
    shape[nbv] = Hkv, shape[nbv + 1] = S;
    ok = ok && make_operand(r, &k, nbv + 3, shape, kvelem, 1);
    shape[nbv + 2] = Ev;
    ok = ok && make_operand(r, &v, nbv + 3, shape, kvelem, 1);
    shape[nbv] = H, shape[nbv + 1] = L;
    ok = ok && make_operand(r, &out, nbv + 3, shape, elem, 0);
    shape[nbv + 2] = S;
    const size_t mask_elem = p.mask_kind == SDPA_MASK_BOOL ? 1 : celem;
    if (ok && (p.mask_kind == SDPA_MASK_BOOL || p.mask_kind == SDPA_MASK_ADDITIVE))
        ok = make_operand(r, &mask, nbv + 3, shape, mask_elem, 1);
    if (ok && with_weights) ok = make_operand(r, &weights, nbv + 3, shape, celem, 0);
    if (ok && with_lse) ok = make_operand(r, &lse, nbv + 2, shape, celem, 0);
    if (ok && with_lengths) ok = make_operand(r, &lengths, nbv, shape, sizeof(int64_t), 1);
    shape[nbv] = H; /* a slope or sink per (batch, head) */
    if (ok && with_alibi) ok = make_operand(r, &alibi, nbv + 1, shape, celem, 1);
    if (ok && with_sinks) ok = make_operand(r, &sinks, nbv + 1, shape, celem, 1);
    shape[nbv] = topk_shared ? 1 : Hkv, shape[nbv + 1] = L, shape[nbv + 2] = K;
    if (ok && with_topk) ok = make_operand(r, &lists, nbv + 3, shape, sizeof(int32_t), 1);
    shape[nbv] = H, shape[nbv + 1] = QB, shape[nbv + 2] = KB;
    if (ok && with_blocks) ok = make_operand(r, &states, nbv + 3, shape, 1, 1);
    shape[nbv] = Hkv, shape[nbv + 1] = S;
    if (ok && with_scores) ok = make_operand(r, &scores, nbv + 2, shape, sizeof(float), 0);
    if (!ok) {
        stat_skipped++;
        for (int i = 0; i < 13; i++) free_operand(all[i]);
        return 0;
    }
    fill(r, &q, dt, specials);
    fill(r, &k, kvdt, specials);
    fill(r, &v, kvdt, specials);
    if (p.mask_kind == SDPA_MASK_BOOL)
        for (size_t i = 0; i < mask.total; i++) mask.base[i] = (unsigned char)(take(r, 1) % 5 != 0);
    else if (p.mask_kind == SDPA_MASK_ADDITIVE)
        for (size_t i = 0; i < mask.total; i++)
            store(mask.base, i, cdt, one_in(r, 4) ? -INFINITY : value(r, specials)); /* -inf masks */
    static const int64_t far_len[] = {INT64_MAX, INT64_MIN, -1, (int64_t)1 << 40};
    for (size_t i = 0; i < lengths.total; i++)
        ((int64_t *)lengths.base)[i] = one_in(r, 6) ? far_len[range(r, 0, 3)] : range(r, 0, S + 3);
    for (size_t i = 0; i < alibi.total; i++) /* slopes: mostly >= 0, as models have them */
        store(alibi.base, i, cdt, one_in(r, 4) ? value(r, specials) : fabs(value(r, specials)) / 4);
    for (size_t i = 0; i < sinks.total; i++) /* -inf: no sink; a large one overflows exp in float32 */
        store(sinks.base, i, cdt, one_in(r, 6) ? -INFINITY : one_in(r, 6) ? (double)range(r, -120, 120) : value(r, specials));

    for (size_t i = 0; i < lists.total; i++) /* -1 now and then, repeats of small positions */
        ((int32_t *)lists.base)[i] = (int32_t)(one_in(r, 5) || S == 0 ? -1 : range(r, 0, S - 1));
    if (with_topk) {
        p.topk_indices = view_of(&lists, nbv);
        if (topk_shared) p.topk_indices.head_stride = 0;
        p.topk = K;
        if (one_in(r, 40)) p.topk = -range(r, 1, 3), valid = 0;
        else if (one_in(r, 30) && batch_count * H * L * K > 0) { /* read first: out of range */
            *(int32_t *)lists.data = one_in(r, 2) ? (int32_t)-range(r, 2, 5) : (int32_t)(S + range(r, 0, 3));
            valid = 0;
        }
    }
    for (size_t i = 0; i < states.total; i++) states.base[i] = (unsigned char)range(r, 0, 2);
    if (with_blocks) {
        p.block_states = view_of(&states, nbv);
        p.block_q = bq, p.block_k = bk;
        if (one_in(r, 30) && batch_count * H * L * QB * KB > 0) { /* read first: refused */
            *(int8_t *)states.data = (int8_t)(one_in(r, 2) ? 3 : -1);
            valid = 0;
        }
    }
    if (with_scores) { /* (..., Hkv, S): the keys along col_stride */
        p.key_scores = view_of(&scores, nbv);
        p.key_scores.col_stride = p.key_scores.row_stride, p.key_scores.row_stride = 0;
        p.key_scores_rows = W;
    }
    p.query = view_of(&q, nbv), p.key = view_of(&k, nbv), p.value = view_of(&v, nbv), p.out = view_of(&out, nbv);
    if (mask.base) p.mask = view_of(&mask, nbv);
    if (with_weights) p.weights = view_of(&weights, nbv);
    if (with_lse) p.lse = view_of(&lse, nbv);
    if (with_alibi) p.alibi = view_of(&alibi, nbv);
    if (with_sinks) p.sinks = view_of(&sinks, nbv);
    if (with_lengths) {
        p.key_lengths = (const int64_t *)lengths.data;
        for (int d = 0; d < nbv; d++) p.key_lengths_strides[d] = lengths.stride[d];
    }
    if (one_in(r, 60)) { /* a required pointer missing: an error when there is work */
        p.query.data = NULL;
        if (batch_count * H * L > 0) valid = 0;
    }
    snprintf(problem_text, sizeof(problem_text),
             "dtype=%d/%d nb=%d batch=%lld,%lld,%lld H=%lld G=%lld L=%lld S=%lld E=%lld Ev=%lld mask=%d scale=%g "
             "causal=%d offset=%lld lengths=%d weights=%d lse=%d threads=%d interrupt=%d specials=%d "
             "window=%lld,%lld align=%lld softcap=%g alibi=%d sinks=%d topk=%lld%s blocks=%lld,%lld scores=%lld valid=%d",
             (int)p.dtype, (int)p.kv_dtype, nb, (long long)p.batch_shape[0], (long long)p.batch_shape[1],
             (long long)p.batch_shape[2], (long long)p.num_heads, (long long)p.gqa_group, (long long)p.len_q,
             (long long)p.len_kv, (long long)p.head_dim, (long long)p.head_dim_v, (int)p.mask_kind, p.scale,
             p.causal, (long long)p.causal_offset, with_lengths, with_weights, with_lse, p.num_threads,
             p.interrupt != NULL, specials, (long long)p.window_left, (long long)p.window_right,
             (long long)p.align_offset, p.softcap, with_alibi, with_sinks, with_topk ? (long long)p.topk : -1LL,
             topk_shared ? " shared" : "", with_blocks ? (long long)bq : 0LL, with_blocks ? (long long)bk : 0LL,
             with_scores ? (long long)W : -1LL, valid);

    /* inputs kept, to check they are not written */
    unsigned char *copies[9];
    const operand *inputs[9] = {&q, &k, &v, &mask, &lengths, &alibi, &sinks, &lists, &states};
    for (int i = 0; i < 9; i++) {
        size_t bytes = inputs[i]->total * inputs[i]->elem;
        copies[i] = (unsigned char *)malloc(bytes ? bytes : 1);
        if (inputs[i]->base) memcpy(copies[i], inputs[i]->base, bytes);
    }

    sdpa_status st = sdpa_attention(&p);
    stat_refused += st != SDPA_OK && st != SDPA_ERR_INTERRUPTED;
    if (getenv("SDPA_FUZZ_VERBOSE")) fprintf(stderr, "%d %s\n%s\n", (int)st, sdpa_status_message(st), problem_text);
    stat_interrupted += st == SDPA_ERR_INTERRUPTED;
    stat_computed += st == SDPA_OK && batch_count * H * L > 0;
    if (!valid) {
        if (st == SDPA_OK || !is_validation_error(st)) fail("an invalid problem was not refused");
    } else if (st == SDPA_ERR_INTERRUPTED) {
        if (!p.interrupt) fail("interrupted without a callback");
    } else if (st != SDPA_OK) {
        fail("a valid problem was refused");
    }
    for (int i = 0; i < 9; i++)
        if (inputs[i]->base && memcmp(copies[i], inputs[i]->base, inputs[i]->total * inputs[i]->elem))
            fail("an input was written");

    if (valid && st == SDPA_OK) {
        /* the same bits with another thread count */
        operand out2;
        int64_t oshape[MAX_DIMS];
        for (int d = 0; d < out.nd; d++) oshape[d] = out.n[d];
        reader none = {NULL, 0, 0};
        if (make_operand(&none, &out2, out.nd, oshape, elem, 0)) {
            sdpa_problem p2 = p;
            p2.out = view_of(&out2, nbv);
            p2.weights.data = NULL, p2.lse.data = NULL, p2.interrupt = NULL;
            p2.num_threads = p.num_threads == 3 ? 1 : 3;
            if (sdpa_attention(&p2) != SDPA_OK) fail("the second call failed");
            int64_t idx[MAX_DIMS] = {0};
            int64_t count = 1;
            for (int d = 0; d < out.nd; d++) count *= out.n[d];
            for (int64_t i = 0; i < count; i++) {
                int64_t rem = i;
                for (int d = out.nd - 1; d >= 0; d--) idx[d] = rem % out.n[d], rem /= out.n[d];
                const int64_t a = offset_of(&out, idx), b = offset_of(&out2, idx);
                /* a NaN may come back with another sign or payload: the
                 * output's layout picks a vector or a scalar store, and which
                 * NaN operand a product returns is the hardware's choice */
                if (memcmp(out.data + a * (int64_t)elem, out2.data + b * (int64_t)elem, elem) &&
                    !(isnan(load(&out, dt, a)) && isnan(load(&out2, dt, b))))
                    fail("the result depends on the thread count or the output's layout");
            }
            free_operand(&out2);
        }

        /* the reference, for small finite values and a moderate scale (a huge
         * one turns rounding differences of the scores into different weights) */
        if (!specials && fabs(p.scale) <= 100) {
            stat_compared++;
            const int64_t total = batch_count * H * L;
            double *s = (double *)malloc(sizeof(double) * (size_t)(S ? S : 1));
            int64_t *mult = (int64_t *)malloc(sizeof(int64_t) * (size_t)(S ? S : 1));
            /* key scores: each (batch index, key/value head, key)'s sum and its tolerance */
            const size_t ks_n = with_scores ? (size_t)(batch_count * Hkv * S) : 0;
            double *ks_ref = (double *)calloc(ks_n ? ks_n : 1, sizeof(double));
            double *ks_tol = (double *)calloc(ks_n ? ks_n : 1, sizeof(double));
            const int64_t counted = W > 0 && W < L ? W : L;
            int64_t idx[MAX_DIMS], si[MAX_DIMS];
            for (int64_t row = 0; row < total; row++) {
                int64_t rem = row;
                const int64_t l = rem % L;
                rem /= L;
                const int64_t h = rem % H;
                rem /= H;
                for (int d = nbv - 1; d >= 0; d--) idx[d] = rem % p.batch_shape[d], rem /= p.batch_shape[d];
                int64_t limit = S;
                if (with_lengths) {
                    int64_t len = ((const int64_t *)lengths.data)[offset_of(&lengths, idx)];
                    limit = len < 0 ? 0 : len < S ? len : S;
                }
                idx[nbv] = h;
                const double slope = with_alibi ? load(&alibi, cdt, offset_of(&alibi, idx)) : 0;
                const double sink = with_sinks ? load(&sinks, cdt, offset_of(&sinks, idx)) : -INFINITY;
                /* top-k: how many times the row's list names each key (0: unseen) */
                for (int64_t j = 0; j < S; j++) mult[j] = 1;
                if (with_topk) {
                    for (int64_t j = 0; j < S; j++) mult[j] = 0;
                    int64_t li[MAX_DIMS];
                    memcpy(li, idx, sizeof(li));
                    li[nbv] = topk_shared ? 0 : h / G, li[nbv + 1] = l;
                    for (int64_t e = 0; e < K; e++) {
                        li[nbv + 2] = e;
                        const int32_t pos = ((const int32_t *)lists.data)[offset_of(&lists, li)];
                        if (pos >= 0 && pos < S) mult[pos]++;
                    }
                }
                double mx = -INFINITY;
                for (int64_t j = 0; j < S; j++) {
                    int visible = j < limit && (!p.causal || j - l <= p.causal_offset) && mult[j] > 0;
                    /* (a valid problem with a window has |align_offset| <= 2^61) */
                    if (p.window_left >= 0) visible &= j >= l + p.align_offset - p.window_left;
                    if (p.window_right >= 0) visible &= j <= l + p.align_offset + p.window_right;
                    idx[nbv] = h, idx[nbv + 1] = l;
                    double dot = 0;
                    for (int64_t c = 0; c < E; c++) {
                        idx[nbv + 2] = c;
                        const double qv = load(&q, dt, offset_of(&q, idx));
                        idx[nbv] = h / G, idx[nbv + 1] = j;
                        dot += qv * load(&k, kvdt, offset_of(&k, idx));
                        idx[nbv] = h, idx[nbv + 1] = l;
                    }
                    double sj = p.scale * dot;
                    if (p.softcap > 0) sj = p.softcap * tanh(sj / p.softcap);
                    if (with_alibi) sj -= slope * fabs((double)(l + p.align_offset - j));
                    if (mask.base) {
                        idx[nbv + 2] = j;
                        const int64_t mo = offset_of(&mask, idx);
                        if (p.mask_kind == SDPA_MASK_BOOL) visible &= mask.data[mo] != 0;
                        else sj += load(&mask, cdt, mo);
                    }
                    if (with_blocks) { /* skipped: hidden; full: every key within the length; partial: the rules */
                        memcpy(si, idx, sizeof(si));
                        si[nbv] = h, si[nbv + 1] = l / bq, si[nbv + 2] = j / bk;
                        const int state = (int8_t)states.data[offset_of(&states, si)];
                        visible = state == 0 ? 0 : state == 2 ? j < limit : visible;
                    }
                    s[j] = visible ? sj : -INFINITY;
                    if (s[j] > mx) mx = s[j];
                }
                /* a sink joins the max and the denominator of a row that sees a
                 * key; a sink of -inf is none */
                const double top = mx != -INFINITY && sink > mx ? sink : mx;
                double sum = 0;
                for (int64_t j = 0; j < S; j++) sum += s[j] == -INFINITY ? 0 : mult[j] * exp(s[j] - top);
                const int seen = mx != -INFINITY; /* (sum may underflow to 0 below a large sink) */
                const double denom = seen && sink != -INFINITY ? sum + exp(sink - top) : sum;
                /* (a 16-bit output adds its own rounding) */
                const double tol = dt == SDPA_FLOAT64 ? 1e-9 : dt == SDPA_BFLOAT16 ? 1e-2 : 2e-3;
                const double tol_c = dt == SDPA_FLOAT64 ? 1e-9 : 2e-3; /* weights and lse: compute type */
                /* scores carry rounding in proportion to their size, and a
                 * softcap an absolute error of a few ulp of the cap */
                const double size = isfinite(mx) ? 1 + fabs(mx) : 1;
                const double cap_err = p.softcap > 0 ? 16 * p.softcap * (cdt == SDPA_FLOAT64 ? 0x1p-52 : 0x1p-23) : 0;
                idx[nbv] = h, idx[nbv + 1] = l;
                for (int64_t c = 0; c < Ev; c++) {
                    double ref = 0, scale = 0;
                    for (int64_t j = 0; j < S; j++) {
                        if (s[j] == -INFINITY) continue;
                        idx[nbv] = h / G, idx[nbv + 1] = j, idx[nbv + 2] = c;
                        const double w = mult[j] * exp(s[j] - top) / denom, vv = load(&v, kvdt, offset_of(&v, idx));
                        ref += w * vv;
                        scale += fabs(w * vv);
                    }
                    idx[nbv] = h, idx[nbv + 1] = l, idx[nbv + 2] = c;
                    const double got = load(&out, dt, offset_of(&out, idx));
                    if (!(fabs(got - ref) <= (1 + scale) * (tol * size + 2 * cap_err))) {
                        fprintf(stderr, "row %lld h %lld l %lld c %lld: got %g ref %g\n", (long long)row, (long long)h, (long long)l, (long long)c, got, ref);
                        fail("output differs from the reference");
                    }
                }
                if (with_scores && l >= L - counted) {
                    const int64_t at = (row / (H * L) * Hkv + h / G) * S;
                    for (int64_t j = 0; j < S; j++) {
                        if (s[j] == -INFINITY) continue;
                        ks_ref[at + j] += mult[j] * exp(s[j] - top) / denom;
                        ks_tol[at + j] += tol_c * size + 2 * cap_err;
                    }
                }
                if (with_weights) {
                    idx[nbv] = h, idx[nbv + 1] = l;
                    for (int64_t j = 0; j < S; j++) {
                        idx[nbv + 2] = j;
                        const double got = load(&weights, cdt, offset_of(&weights, idx));
                        const double ref = s[j] == -INFINITY ? 0 : exp(s[j] - top) / denom;
                        if (!(fabs(got - ref) <= tol_c * size + 2 * cap_err)) {
                            fprintf(stderr, "row %lld h %lld l %lld key %lld: got %g ref %g\n", (long long)row, (long long)h, (long long)l, (long long)j, got, ref);
                            fail("weights differ from the reference");
                        }
                    }
                }
                if (with_lse) {
                    idx[nbv] = h, idx[nbv + 1] = l;
                    const double got = load(&lse, cdt, offset_of(&lse, idx));
                    /* a row that sees no key: the sink alone (-inf without one) */
                    const double ref = seen ? top + log(denom) : sink;
                    if (!(got == ref || fabs(got - ref) <= tol_c * (1 + fabs(ref)) + 2 * cap_err)) {
                        fprintf(stderr, "row %lld h %lld l %lld: got %g ref %g\n", (long long)row, (long long)h, (long long)l, got, ref);
                        fail("lse differs from the reference");
                    }
                }
            }
            for (size_t i = 0; i < ks_n; i++) {  /* the key scores, (batch..., Hkv, S) */
                int64_t rem = (int64_t)i;
                idx[nbv + 1] = rem % S, rem /= S;
                idx[nbv] = rem % Hkv, rem /= Hkv;
                for (int d = nbv - 1; d >= 0; d--) idx[d] = rem % p.batch_shape[d], rem /= p.batch_shape[d];
                const double got = ((const float *)scores.data)[offset_of(&scores, idx)];
                if (!(fabs(got - ks_ref[i]) <= ks_tol[i] + 1e-6 * (1 + ks_ref[i]))) {
                    fprintf(stderr, "key score %zu: got %g ref %g\n", i, got, ks_ref[i]);
                    fail("key scores differ from the reference");
                }
            }
            free(s);
            free(mult);
            free(ks_ref);
            free(ks_tol);
        }
    }
    for (int i = 0; i < 9; i++) free(copies[i]);
    for (int i = 0; i < 13; i++) free_operand(all[i]);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return run_input(data, size); }

#ifdef SDPA_FUZZ_STANDALONE
/* Without libFuzzer: the files named on the command line, or --runs N inputs
 * of random bytes from --seed S (a splitmix64 stream). */
int main(int argc, char **argv) {
    long runs = 0;
    uint64_t seed = 1;
    int files = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atol(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else {
            FILE *f = fopen(argv[i], "rb");
            if (!f) {
                perror(argv[i]);
                return 2;
            }
            static uint8_t buf[1 << 16];
            size_t n = fread(buf, 1, sizeof(buf), f);
            fclose(f);
            run_input(buf, n);
            files++;
        }
    }
    uint8_t buf[4096];
    for (long i = 0; i < runs; i++) {
        uint64_t z = 0;
        for (size_t j = 0; j < sizeof(buf); j++) {
            z = (seed += 0x9e3779b97f4a7c15ull);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            buf[j] = (uint8_t)(z ^ (z >> 31));
        }
        run_input(buf, (size_t)((z >> 40) % sizeof(buf)));
    }
    printf("fuzz_problem: %ld random inputs and %d files passed: %ld computed (%ld checked against the "
           "reference), %ld refused, %ld interrupted, %ld too large to lay out\n",
           runs, files, stat_computed, stat_compared, stat_refused, stat_interrupted, stat_skipped);
    return 0;
}
#endif
