/* Internal declarations shared by the driver, dispatch and kernels. */
#ifndef SDPA_INTERNAL_H
#define SDPA_INTERNAL_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "sdpa.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define SDPA_HAVE_X86_KERNELS 1
#else
#define SDPA_HAVE_X86_KERNELS 0
#endif

/* The neon sets: little-endian AArch64 with GCC or clang (the kernels assemble
 * some vectors from bytes in memory order).  neon_bf16 and the SDOT kernel
 * need their intrinsics under a target attribute (arm_neon.h declares them so
 * from GCC 11, clang 16, Apple clang 15); an older compiler builds neon alone. */
#if defined(__aarch64__) && !defined(__AARCH64EB__) && (defined(__GNUC__) || defined(__clang__))
#define SDPA_HAVE_NEON_KERNELS 1
#if (defined(__clang__) && ((defined(__apple_build_version__) && __clang_major__ >= 15) || \
                            (!defined(__apple_build_version__) && __clang_major__ >= 16))) || \
    (!defined(__clang__) && __GNUC__ >= 11)
#define SDPA_HAVE_NEON_EXT_KERNELS 1
#else
#define SDPA_HAVE_NEON_EXT_KERNELS 0
#endif
#else
#define SDPA_HAVE_NEON_KERNELS 0
#define SDPA_HAVE_NEON_EXT_KERNELS 0
#endif

/* The amx set: Linux only (the OS must grant the tile state, dispatch.c), and
 * compilers with the AMX intrinsics (GCC 11, clang 12). */
#if SDPA_HAVE_X86_KERNELS && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define SDPA_HAVE_AMX_KERNELS 1
#else
#define SDPA_HAVE_AMX_KERNELS 0
#endif

/*
 * The exponential of every kernel is exactly 0 below these cuts, never a
 * subnormal number: e^x is normal (at least FLT_MIN / DBL_MIN) from the cut
 * up.  Intel cores take a microcode assist (about 100 cycles) for each
 * subnormal result or operand unless the caller set flush-to-zero, and the
 * exponential of a masked score, or one far below its row's max, would be one.
 * What is cut weighs less than 2^-125 (2^-1021) of the row's own largest term,
 * 1: far below float32's resolution.  ln FLT_MIN = -87.3365, ln DBL_MIN =
 * -708.3964.
 */
#define SDPA_EXP_CUT_F32 (-87.33f)
#define SDPA_EXP_CUT_F64 (-708.39)

/* libm's exp with the same cut: the scalar kernels' and the SIMD sets' tails. */
static inline float sdpa_exp_cut_f32(float x) { return x < SDPA_EXP_CUT_F32 ? 0.0f : expf(x); }
static inline double sdpa_exp_cut_f64(double x) { return x < SDPA_EXP_CUT_F64 ? 0.0 : exp(x); }

/* The accumulator's rescale by a factor alpha below SDPA_RESCALE_SMALL (the
 * row's max grew by more than about 41 at once): a normal accumulator times
 * alpha could be subnormal, so each product is formed 2^64 higher and kept only
 * where it is normal once brought back, 0 elsewhere: the same bits as
 * acc * alpha wherever that is normal, and no subnormal is computed. */
#define SDPA_RESCALE_SMALL 0x1p-60
static inline float sdpa_rescale_small_f32(float acc, float alpha) {
    const float y = acc * (alpha * 0x1p64f), lim = FLT_MIN * 0x1p64f;
    return y < lim && y > -lim ? 0.0f : y * 0x1p-64f;
}
static inline double sdpa_rescale_small_f64(double acc, double alpha) {
    const double y = acc * (alpha * 0x1p64), lim = DBL_MIN * 0x1p64;
    return y < lim && y > -lim ? 0.0 : y * 0x1p-64;
}

/* acc * alpha, the careful product where alpha is below SDPA_RESCALE_SMALL: a
 * row's rescale in the kernels' rare path (some row of the panel has a small
 * factor), lane by lane */
static inline float sdpa_rescale_f32(float acc, float alpha) {
    return alpha > 0 && alpha < (float)SDPA_RESCALE_SMALL ? sdpa_rescale_small_f32(acc, alpha) : acc * alpha;
}
static inline double sdpa_rescale_f64(double acc, double alpha) {
    return alpha > 0 && alpha < SDPA_RESCALE_SMALL ? sdpa_rescale_small_f64(acc, alpha) : acc * alpha;
}

/* Whether a key/value dtype is quantized (a byte or a nibble a value, scaled). */
static inline int sdpa_is_quantized(sdpa_dtype dt) {
    return dt == SDPA_INT8 || dt == SDPA_FP8_E4M3 || dt == SDPA_FP8_E5M2 || dt == SDPA_INT4;
}

/* Bytes of the scratch a dot_qi kernel may use for m query rows of e features. */
#define SDPA_QI_WORK_BYTES(m, e) ((size_t)(m) * ((size_t)(e) * 2 + 128) + 64)

/* The AVX512-VNNI dot_qi (kernels/avx512.c), for the sets with AVX-512 on a CPU
 * with VNNI, and the AVX-VNNI one (kernels/avx2.c) for the avx2 set on a CPU
 * with AVX-VNNI; NULL where the build has none. */
extern int (*const sdpa_dot_qi_vnni)(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q,
                                     int64_t ldq, const float *qscale, const uint8_t *k, int64_t ldk,
                                     const float *ks, int64_t ksr, int64_t ksc, float *s, int64_t lds,
                                     void *work);
extern int (*const sdpa_dot_qi_avx_vnni)(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q,
                                         int64_t ldq, const float *qscale, const uint8_t *k, int64_t ldk,
                                         const float *ks, int64_t ksr, int64_t ksc, float *s, int64_t lds,
                                         void *work);
/* The SDOT dot_qi (kernels/neon.c), for the neon sets on a CPU with FEAT_DotProd;
 * NULL where the build has none. */
extern int (*const sdpa_dot_qi_neon)(sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q,
                                     int64_t ldq, const float *qscale, const uint8_t *k, int64_t ldk,
                                     const float *ks, int64_t ksr, int64_t ksc, float *s, int64_t lds,
                                     void *work);

/* integer_pv's products over a run of n <= SDPA_PV_KEYS keys (sdpa.h), for
 * x < m rows and the ng = ev / g value scale groups i: the weights
 *     w_xij = p[x*ldp + j] * vs[i*SDPA_PV_KEYS + j]       (float, rounded once)
 * (p: the row's probabilities, vs: the values' scales by group), their scale
 *     scale_xi = NaN if a w_xi. is NaN, else max_j w_xij / 255 (0 below FLT_MIN),
 * inv = scale > 0 ? 1 / scale : 0, each weight rounded to a byte,
 *     u_xij = (int)min(w_xij * inv + 0.5f, 255)             (NaN: 255)
 * (float operations, each rounded), summed against the stored values exactly,
 *     sum_xc = sum_{j<n} u_x(c/g)j * value c of key j        (int32)
 * and acc[x*ldacc + c] = acc[x*ldacc + c] + (float)sum_xc * scale_x(c/g).
 * Key j's values are the row rows[j]: int8 (dt SDPA_INT8) or int4 (SDPA_INT4:
 * nibble - 8, value c at byte c / 2).  Every version gives these bits; a set's
 * returns 0, doing nothing, where it cannot (the portable one then).  work:
 * SDPA_PV_WORK_BYTES(m, ev, ng) bytes, 64-aligned. */
typedef int (*sdpa_pv_qi_fn)(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const float *p, int64_t ldp,
                             const float *vs, const uint8_t *const *rows, float *acc, int64_t ldacc, void *work);
#define SDPA_PV_WORK_BYTES(m, ev, ng) \
    ((size_t)(m) * (size_t)(ng) * (SDPA_PV_KEYS + 4) + (size_t)(ev) * 4 + 192)
int sdpa_pv_qi_portable(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const float *p, int64_t ldp,
                        const float *vs, const uint8_t *const *rows, float *acc, int64_t ldacc, void *work);
/* The AVX512-VNNI one (kernels/avx512.c), and the portable loops compiled for
 * AVX2 (kernels/avx2.c); NULL where the build has none. */
extern const sdpa_pv_qi_fn sdpa_pv_qi_vnni, sdpa_pv_qi_avx2;

/* The roofline report's probes (machine.c): iters steps of 12 independent
 * vector multiply-adds, float32 FMA or int8 dot products (VPDPBUSD, SDOT);
 * each returns the operations it did (2 a multiply-add); NULL where the build
 * has none. */
typedef double (*sdpa_peak_fn)(int64_t iters);
extern const sdpa_peak_fn sdpa_peak_fma_avx512, sdpa_peak_vnni_avx512, sdpa_peak_fma_avx2, sdpa_peak_vnni_avx2,
    sdpa_peak_fma_neon, sdpa_peak_sdot_neon;
/* The probe of kind 0 (float32 FMA) or 1 (int8 dot products) for the set in
 * use and this CPU, and its name ("avx512", "avx512_vnni", ..., "portable"). */
sdpa_peak_fn sdpa_peak_for(int kind, const char **name);

/* Nanoseconds of the monotonic clock (exec.c). */
double sdpa_now_ns(void);

/* The widest panel of any kernel set (nr: AVX-512 float32 and the bfloat16
 * pairs take 32 query rows): the driver's tables of a panel's rows. */
#define SDPA_MAX_PANEL 32

/* Every scratch buffer and packed panel is aligned to this many bytes. */
#define SDPA_ALIGN 64

/* Without an explicit thread count (num_threads 0, or the Python layer's
 * process-wide setting), each thread of a call gets at least this much work:
 * its flops plus SDPA_WORK_PER_BYTE for each byte of keys and values it reads
 * (a decoding step's reads, not its products, set its time).  Measured on 2
 * cores (benchmarks/RESULTS.md 2026-12-04, "threads of a small call"): a
 * second thread gains from about 1e6 of this work a thread, and costs a few
 * microseconds below it. */
#define SDPA_MIN_WORK_PER_THREAD 1e6
#define SDPA_WORK_PER_BYTE 2.0

/* The thread count of calls with num_threads 0, set for the process by the
 * Python layer (sdpa.set_num_threads); 0: the OpenMP default.  Either way a
 * call takes no more threads than its work gives SDPA_MIN_FLOPS_PER_THREAD. */
void sdpa_set_threads_setting(int n);
int sdpa_threads_setting(void);

/*
 * Kernels: single-threaded, allocation free.  Scores are kept transposed, keys
 * by query rows, so that a vector holds nr consecutive query rows and the
 * softmax statistics of nr rows are vector operations.  Contracts (T is float
 * or double; 16-bit and quantized operands widen exactly to T):
 *
 *   widen(dt, src, dst, n)
 *       dst[i] = src[i] as T, for n contiguous bfloat16 or float16 values.
 *   gemm(m, kdim, a, a_rs, a_ks, b, ldb, c, ldc, accumulate)
 *       c[r*ldc + x] (=, or += when accumulate) sum_{kk < kdim} a[r*a_rs + kk*a_ks] * b[kk*ldb + x]
 *       for r < m, x < nr.  a is read element by element (any strides); b and c
 *       rows are nr contiguous, aligned elements.
 *       Q K^T:  m = keys, kdim = E, a = K, b = the packed, scaled Q^T panel.
 *       P V:    m = Ev,  kdim = keys, a = V (transposed by its strides), b = P^T.
 *   online_softmax_update(s, n, row_max, row_sum, acc, ev)
 *       one key block of the online softmax for the nr query rows of a panel:
 *       s is n x nr scores (row stride nr), replaced by p = exp(s - new max);
 *       row_max, row_sum (nr each) are updated; acc (ev x nr) is rescaled by
 *       exp(old max - new max).  A NaN score makes its row NaN; a row whose
 *       scores are all -inf contributes nothing.
 *   exp(x, n)
 *       x[i] = e^x[i] in place; 0 below SDPA_EXP_CUT_F32 / _F64 (-inf included,
 *       never a subnormal), NaN gives NaN.  Both softmax updates use the same
 *       exp: every p they write, every rescale factor, is 0 or normal.
 *   softcap(x, n, cap)
 *       x[i] = cap * tanh(x[i] / cap).
 *
 * Row kernels, for a few query rows against many keys (decoding); rows of q, k,
 * v, p and acc are contiguous, with any alignment:
 *   dot(m, n, e, q, ldq, k, ldk, s, lds)
 *       s[x*lds + j] = sum_{c<e} q[x*ldq + c] * k[j*ldk + c]          x < m, j < n
 *   pv_rows(m, n, ev, p, ldp, v, ldv, acc, ldacc)
 *       acc[x*ldacc + c] += sum_{j<n} p[x*ldp + j] * v[j*ldv + c]     x < m, c < ev
 *   row_online_softmax_update(s, n, row_max, row_sum, acc, ev)
 *       the online softmax step of one row: s[0..n) becomes exp(s - new max),
 *       *row_max and *row_sum are updated, acc[0..ev) is rescaled.
 *   dot_half, pv_rows_half: dot and pv_rows with keys / values of a 16-bit dt,
 *       the same sums as dot and pv_rows over the widened rows.
 *   dot_q, pv_rows_q: dot and pv_rows with quantized keys / values of dt
 *       (SDPA_INT8, _FP8_E4M3, _FP8_E5M2, _INT4), unscaled (the driver applies
 *       the scales to the scores and to p): the sums over the stored values,
 *       widened exactly (sdpa_quantized_value).  ldk / ldv count bytes; value c
 *       of a row is at byte c (int4: c / 2, nibble c % 2; e, ev and the group
 *       offsets the driver passes even).
 *   dot_q_grouped, pv_rows_q_grouped: the same with a float32 scale per group
 *       of g features, applied to each key / value vector as it is widened (row
 *       j's features c.. scale by ks[j * ksr + (c / g) * ksc]); they return 0,
 *       doing nothing, where the set's version cannot take g (the SIMD sets: g
 *       a power of two, a multiple of the vector width, dividing e / ev), and
 *       the driver then takes each group's dot_q / pv_rows_q in turn.
 *   dot_qi: integer_qk's scores (sdpa.h) over int8 or int4 keys (dt), scales per
 *       group of g features (g divides e; g = e: one a row):
 *         s[x*lds + j] = qscale[x] * sum_{groups i} (T)(exact integer sum over the
 *                        group of q[x*ldq + c] * key value c of row j) * ks[j*ksr + i*ksc]
 *       the groups added in order (the portable version); q holds the query rows
 *       rounded to int8 (each scaled by 1 / qscale[x]).  A set's faster version may
 *       sum a group in exact partial sums, each converted and scaled, in another
 *       order.  work: SDPA_QI_WORK_BYTES(m, e) bytes of scratch, 64-aligned.
 *       Returns 0, doing nothing, where it cannot (the driver then runs the
 *       portable one).
 *
 * Panel kernels (nr, the set's panel width, is passed for the portable ones,
 * which serve every width; a set's own are built for its width).  Masks on a
 * transposed score tile s (n keys x nr rows) for its first `rows` rows, the
 * element of row x and key j at m[x*m_rs + j]:
 *   mask_add:  s[j*nr + x] += m[...];   mask_bool: s[j*nr + x] = -inf where m[...] == 0
 * Query panels and finished rows, for rows of contiguous elements anywhere
 * (a table of n <= nr row pointers: one head's rows, or a GQA group's packed):
 *   pack_q:     panel[c*nr + x] = scale * rows[x][c], x < n, c < e; 0 for
 *               the rows in [n, nr)
 *   store_rows: rows[x][c] = l == 0 ? 0 : acc[c*nr + x] * (1 / l), l = row_l[x],
 *               x < n, c < ev
 *   pack_q_half, store_rows_half: the same over rows of a 16-bit dt, the query
 *               widened exactly, the output rounded once as convert.h rounds.
 * Row-mode copies of contiguous rows:
 *   scale_copy:   dst[i] = scale * src[i]                   (a query row, scaled)
 *   scale_copy_d: dst[i] = (T)((double)src[i] * inv)        (a finished row)
 * The backward's tiles (n keys x nr rows, transposed; nr a multiple of the
 * set's vector width, rows and lse / dd aligned), whatever the panel width:
 *   bwd_probs:    s[j*nr + x] = exp(s[j*nr + x] - lse[x])    (P from the lse)
 *   bwd_dscores:  d[j*nr + x] = p[j*nr + x] * (d[j*nr + x] - dd[x])   (dS)
 *
 * Every set declares what it has; sdpa_complete_table fills the rest with the
 * portable kernels (kernels/scalar.c), so that every entry the driver calls is
 * set.  The portable gemm and online_softmax_update are built for the scalar
 * set's panel width: a set of another width declares its own.  The one definition below makes the float and double tables alike:
 * X(return type, name, parameters) for each entry.
 */
#define SDPA_TYPED_KERNELS(X, T)                                                                                  \
    X(void, widen, (sdpa_dtype dt, const uint16_t *src, T *dst, int64_t n))                                       \
    X(void, gemm, (int m, int64_t kdim, const T *a, int64_t a_rs, int64_t a_ks, const T *b, int64_t ldb, T *c,    \
                   int64_t ldc, int accumulate))                                                                  \
    X(void, online_softmax_update, (T * s, int n, T *row_max, T *row_sum, T *acc, int64_t ev))                    \
    X(void, exp, (T * x, int64_t n))                                                                              \
    X(void, softcap, (T * x, int64_t n, T cap))                                                                   \
    X(void, dot, (int m, int n, int64_t e, const T *q, int64_t ldq, const T *k, int64_t ldk, T *s, int64_t lds)) \
    X(void, pv_rows, (int m, int n, int64_t ev, const T *p, int64_t ldp, const T *v, int64_t ldv, T *acc,         \
                      int64_t ldacc))                                                                             \
    X(void, row_online_softmax_update, (T * s, int n, T *row_max, T *row_sum, T *acc, int64_t ev))                \
    X(void, dot_half, (sdpa_dtype dt, int m, int n, int64_t e, const T *q, int64_t ldq, const uint16_t *k,        \
                       int64_t ldk, T *s, int64_t lds))                                                           \
    X(void, pv_rows_half, (sdpa_dtype dt, int m, int n, int64_t ev, const T *p, int64_t ldp, const uint16_t *v,   \
                           int64_t ldv, T *acc, int64_t ldacc))                                                   \
    X(void, dot_q, (sdpa_dtype dt, int m, int n, int64_t e, const T *q, int64_t ldq, const uint8_t *k,            \
                    int64_t ldk, T *s, int64_t lds))                                                              \
    X(void, pv_rows_q, (sdpa_dtype dt, int m, int n, int64_t ev, const T *p, int64_t ldp, const uint8_t *v,       \
                        int64_t ldv, T *acc, int64_t ldacc))                                                      \
    X(int, dot_q_grouped, (sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const T *q, int64_t ldq,            \
                           const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr, int64_t ksc, T *s,        \
                           int64_t lds))                                                                          \
    X(int, pv_rows_q_grouped, (sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const T *p, int64_t ldp,       \
                               const uint8_t *v, int64_t ldv, const float *vs, int64_t vsr, int64_t vsc, T *acc,  \
                               int64_t ldacc))                                                                    \
    X(int, dot_qi, (sdpa_dtype dt, int m, int n, int64_t e, int64_t g, const int8_t *q, int64_t ldq,              \
                    const T *qscale, const uint8_t *k, int64_t ldk, const float *ks, int64_t ksr, int64_t ksc,    \
                    T *s, int64_t lds, void *work))                                                               \
    X(void, mask_add, (T * s, int nr, int n, int rows, const T *m, int64_t m_rs))                                 \
    X(void, mask_bool, (T * s, int nr, int n, int rows, const uint8_t *m, int64_t m_rs))                          \
    X(void, pack_q, (T * panel, int nr, const T *const *rows, int n, int64_t e, T scale))                        \
    X(void, store_rows, (T *const *rows, const T *acc, int nr, const T *row_l, int n, int64_t ev))               \
    X(void, pack_q_half, (sdpa_dtype dt, T *panel, int nr, const uint16_t *const *rows, int n, int64_t e,        \
                          T scale))                                                                               \
    X(void, store_rows_half, (sdpa_dtype dt, uint16_t *const *rows, const T *acc, int nr, const T *row_l, int n, \
                              int64_t ev))                                                                        \
    X(void, scale_copy, (T * dst, const T *src, int64_t n, T scale))                                              \
    X(void, scale_copy_d, (T * dst, const T *src, int64_t n, double inv))                                        \
    X(void, bwd_probs, (T * s, int n, int nr, const T *lse))                                                      \
    X(void, bwd_dscores, (T * d, const T *p, int n, int nr, const T *dd))

#define SDPA_KERNEL_FIELD(ret, name, params) ret(*name) params;

/* The bfloat16 products of a set that declares them (kernel_table.bf16_products;
 * float only).  a and b hold pairs of bfloat16 in 32 bits (the first in the low
 * half), c is float:
 *   gemm_bf16: c[r*ldc + x] (=, or += when accumulate)
 *              sum_{p < kpairs} dot2(a[r*a_rs + p*a_ks], b[p*ldb + x])   r < m, x < nr
 * The tiled path around it (the panel is the set's nr rows: 32 for avx512_bf16
 * and amx, 16 for neon_bf16):
 *   pack_q_pairs:  panel[p*nr + x] = the 32-bit word p of row x, i.e. the pair
 *                  (rows[x][2p], rows[x][2p + 1]), x < n, p < e2; 0 for the rows
 *                  in [n, nr).  Rows of 2*e2 contiguous values.
 *   pack_v_pairs:  n rows of V (row stride rs, ev contiguous values each) as
 *                  pairs along the keys, the row past an odd n zero: by_feature
 *                  1: dst[c*ld + p], 0: dst[p*ld + c]; p < ceil(n/2), c < ev
 *   online_softmax_pairs: the online softmax update on s * scale (scale > 0, s
 *                  not written), then P as pairs, pp[p*nr + x] = (p of key 2p, of
 *                  key 2p + 1) rounded to bfloat16 (the pair past an odd n zero):
 *                  the values of scaling s, the update and rounding P in turn, to
 *                  float's rounding, except that row_max may stay below the rows'
 *                  max by a set headroom (the terms and the sum are then taken
 *                  against it: m + log(sum), e^(s - m) / sum are the same)
 *   tiles_begin, tiles_end: around the products of one task (AMX: the tile
 *                  configuration, loaded once instead of per product; the
 *                  portable ones do nothing). */
typedef struct kernels_bf16 {
    void (*gemm_bf16)(int m, int64_t kpairs, const uint32_t *a, int64_t a_rs, int64_t a_ks, const uint32_t *b,
                      int64_t ldb, float *c, int64_t ldc, int accumulate);
    /* 1: V pairs packed feature by feature, [Ev][pairs], so that P V's a is
     * contiguous along the pairs (AMX tiles load it in place); 0: pair by pair,
     * [pairs][Ev] (a broadcast reads one pair at a time).  gemm_bf16 is correct
     * with either; this is its fast layout. */
    int values_by_feature;
    /* gemm_bf16 reads its a and b in blocks of this many pairs (AMX: 16, a tile
     * row), and a part block goes through a copy: K rows and query panels are
     * then padded with zero pairs to whole blocks where K is packed (0 or 1:
     * any count is as fast) */
    int pairs_block;
    void (*pack_q_pairs)(uint32_t *panel, const uint16_t *const *rows, int n, int64_t e2);
    void (*pack_v_pairs)(int by_feature, uint32_t *dst, int64_t ld, const uint16_t *src, int64_t rs, int n,
                         int64_t ev);
    void (*online_softmax_pairs)(const float *s, int n, float scale, float *row_max, float *row_sum, float *acc,
                                 int64_t ev, uint32_t *pp);
    void (*tiles_begin)(void);
    void (*tiles_end)(void);
} kernels_bf16;

typedef struct kernels_f32 {
    int nr; /* panel width: query rows per vector block (tiles: make_plan) */
    SDPA_TYPED_KERNELS(SDPA_KERNEL_FIELD, float)
    kernels_bf16 bf16;
    /* the same kernels at a narrower panel, or NULL: the set's table points
     * to its f32_half, and that one to its f32_quarter (set by
     * sdpa_complete_table) */
    const struct kernels_f32 *half;
} kernels_f32;

typedef struct kernels_f64 {
    int nr;
    SDPA_TYPED_KERNELS(SDPA_KERNEL_FIELD, double)
    const struct kernels_f64 *half;
} kernels_f64;

/* The kernels whose layout is the panel's (built for one width nr): a set's
 * half-width table declares its own, or the portable ones (any width) serve;
 * gemm and online_softmax_update it must declare. */
#define SDPA_PANEL_KERNELS(X) X(mask_add) X(mask_bool) X(pack_q) X(store_rows) X(pack_q_half) X(store_rows_half)
/* A half-width table's entries from a panel-only instance of suffix suf
 * (kernels/simd_impl.h with SIMD_PANELS_ONLY): the products and the softmax
 * update, and for float the masks, query panels and finished rows too. */
#define SDPA_HALF_KERNELS(suf) .nr = panel_rows_##suf, .gemm = gemm_##suf, .online_softmax_update = online_softmax_update_##suf
#define SDPA_HALF_KERNELS_F32(suf)                                                                               \
    SDPA_HALF_KERNELS(suf), .mask_add = mask_add_##suf, .mask_bool = mask_bool_##suf, .pack_q = pack_q_##suf, \
        .store_rows = store_rows_##suf, .pack_q_half = pack_q_half_##suf, .store_rows_half = store_rows_half_##suf

/* The CPU (and OS) features a kernel set needs: dispatch.c runs the best set
 * whose features the machine has. */
enum {
    SDPA_FEATURE_AVX2 = 1 << 0,        /* AVX2, FMA, F16C; the OS saves ymm */
    SDPA_FEATURE_AVX512 = 1 << 1,      /* AVX-512 F, BW, DQ, VL; the OS saves zmm and opmasks */
    SDPA_FEATURE_AVX512_BF16 = 1 << 2, /* VDPBF16PS, VCVTNEPS2BF16 */
    SDPA_FEATURE_AMX_BF16 = 1 << 3,    /* AMX-TILE, AMX-BF16; the OS saves the tile state (XCR0), and
                                          grants it to the process at the first call that needs it */
    SDPA_FEATURE_AVX512_VNNI = 1 << 4, /* VPDPBUSD (integer_qk's scores); no set needs it */
    SDPA_FEATURE_AVX_VNNI = 1 << 5,    /* VEX VPDPBUSD on ymm (the same, for the avx2 set) */
    SDPA_FEATURE_NEON = 1 << 6,        /* AArch64 Advanced SIMD (every AArch64 CPU) */
    SDPA_FEATURE_NEON_BF16 = 1 << 7,   /* FEAT_BF16: BFDOT, BFMMLA */
    SDPA_FEATURE_NEON_DOTPROD = 1 << 8, /* FEAT_DotProd: SDOT (integer_qk's scores); no set needs it */
};

/* One kernel set: its name, the features it needs, and its kernels for each
 * element type.  Tables are written with designated initializers and hold what
 * the set has; sdpa_complete_table fills the rest. */
/* Dropout's keep masks (sdpa.h, dropout_p): for keys j < n from s0 and row
 * groups g < ng from g0 (rows 8 g0 .. 8 (g0 + ng)), the four 32-bit words of
 * Philox-4x32-10 (kernels/philox_impl.h) under the key (seed lo, seed hi ^
 * (s >> 32)) on the counter (s, g, h, b), s = s0 + j, g = g0 + the group, as
 * eight 16-bit numbers u (row x of the group: half x % 2, the low one first,
 * of word x / 2), each kept when u >= thr:
 *     out[j * 8 ng + 8 g + x] = u >= thr ? 0xFFFFFFFF : 0
 * the layout of a transposed score tile of nr = 8 ng rows (ng 1, 2, 4 or 8).
 * Every set gives the same words (integer arithmetic). */
typedef void (*sdpa_dropout_bits_fn)(uint64_t seed, uint32_t b, uint32_t h, uint32_t g0, int ng, uint64_t s0, int n,
                                     uint32_t thr, uint32_t *out);

typedef struct kernel_table {
    const char *name;
    unsigned features;
    sdpa_dropout_bits_fn dropout_bits; /* filled in from the portable set when not declared */
    int bf16_products; /* 1: f32.bf16 is the set's (bfloat16 problems multiply pairs), 0: none */
    kernels_f32 f32;
    kernels_f64 f64;
    /* Optional: the panel kernels at half the set's width (nr 0: none), for a
     * tiled task's last panel when its rows fit in it (the tails of L: four
     * rows past a multiple of 32 no longer pay for 32).  A row's products and
     * softmax are the same operations in the same order at either width, so
     * its bits do not depend on the panel it lands in.  sdpa_complete_table
     * takes the other entries from the set's own table and points f32.half /
     * f64.half here. */
    kernels_f32 f32_half;
    kernels_f64 f64_half;
    /* Optional, with f32_half: float panel kernels at a quarter of the set's
     * width (AVX-512: 8 rows on 256-bit vectors, which Zen 4 runs at twice the
     * rate of 512-bit ones), the same bits again; f32_half.half points here. */
    kernels_f32 f32_quarter;
} kernel_table;

/* dst = src with every entry src does not set taken from the portable kernels,
 * the scalar set's table (kernels/scalar.c), which has them all: the reference
 * every other set is tested against.  bfloat16 products are not filled in (a
 * set has them or not), their tiles_begin and tiles_end are.  Returns the
 * number of entries filled. */
int sdpa_complete_table(kernel_table *dst, const kernel_table *src);

/* Whether every entry of kt is set (its bfloat16 products too, if it declares
 * them): the completeness of the tables the driver runs with. */
int sdpa_table_is_complete(const kernel_table *kt);

/* Bytes of one element of dt. */
size_t sdpa_dtype_size(sdpa_dtype dt);


/* The portable widening (scalar conversions of convert.h), for the SIMD sets' tails. */
void sdpa_widen_portable(sdpa_dtype dt, const uint16_t *src, float *dst, int64_t n);

/* The table for this CPU, or the one forced by SDPA_ISA, chosen once; NULL when
 * SDPA_ISA names a set that is unknown or that this CPU cannot run. */
const kernel_table *sdpa_kernel_table(void);

/* The same, and whether that set was named (SDPA_ISA, sdpa_set_isa) rather than
 * chosen by default, read together. */
const kernel_table *sdpa_kernel_choice(int *by_name);

/* The table a call whose plan multiplies bfloat16 pairs (plan.bf16) runs with:
 * kt itself, unless kt needs AMX tiles and the OS, asked now if not yet,
 * refuses them: then avx512_bf16's table when kt was the default choice, NULL
 * when it was named. */
const kernel_table *sdpa_kernel_table_for_tiles(const kernel_table *kt, int by_name);

/* The named set in use (SDPA_ISA, sdpa_set_isa), or NULL when it is the
 * default choice; and a return to the choice made at first use. */
const char *sdpa_isa_named(void);
void sdpa_reset_isa(void);

/* The table of the named set, or NULL when it is unknown or not supported here. */
const kernel_table *sdpa_kernel_table_named(const char *name);

/* The dot_qi a float problem on set kt runs: the AVX512-VNNI one where kt has
 * AVX-512 and the CPU VNNI, else the AVX-VNNI one where kt has AVX2 and the CPU
 * AVX-VNNI, unless the tests have asked for the portable one; else kt's. */
typedef int (*sdpa_dot_qi_f32_fn)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                                  const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                                  void *);
sdpa_dot_qi_f32_fn sdpa_dot_qi_for(const kernel_table *kt);

/* The pv_qi a float problem on set kt runs: the AVX512-VNNI one where kt has
 * AVX-512 and the CPU VNNI, else the AVX2 build of the portable loops where kt
 * has AVX2, unless the tests have asked for the portable one. */
sdpa_pv_qi_fn sdpa_pv_qi_for(const kernel_table *kt);

/* Test hook: 1 makes sdpa_dot_qi_for and sdpa_pv_qi_for return the portable
 * kernels everywhere. */
void sdpa_testing_portable_dot_qi(int on);

/* Why SDPA_ISA cannot be honoured (a static message), or NULL when it can. */
const char *sdpa_isa_env_error(void);

/* The declared tables of each set (what the set has; dispatch.c completes them). */
extern const kernel_table sdpa_kernels_scalar;
#if SDPA_HAVE_X86_KERNELS
extern const kernel_table sdpa_kernels_avx2;
extern const kernel_table sdpa_kernels_avx512;
extern const kernel_table sdpa_kernels_avx512_bf16;
/* the amx set's code over a software model of the tiles, for the tests only */
extern const kernel_table sdpa_kernels_amx_emulated;
#endif
#if SDPA_HAVE_AMX_KERNELS
extern const kernel_table sdpa_kernels_amx;
#endif
#if SDPA_HAVE_NEON_KERNELS
extern const kernel_table sdpa_kernels_neon;
#endif
#if SDPA_HAVE_NEON_EXT_KERNELS
extern const kernel_table sdpa_kernels_neon_bf16;
#endif

/* Atomic loads and stores of shared state (the kernel choice, flags set once).
 * MSVC's C mode has no <stdatomic.h> before VS 2022 17.5; its volatile accesses
 * are acquire/release on x86 and ARM64 (/volatile:ms, the default there). */
#if defined(_MSC_VER) && !defined(__clang__)
#define SDPA_ATOMIC(type) volatile type
#define sdpa_atomic_load(p) (*(p))
#define sdpa_atomic_store(p, v) (*(p) = (v))
#define sdpa_atomic_add(p, v) (*(p) += (v)) /* counters of the profile only */
#include <intrin.h>
/* int and long are both 32 bits there; unlike C11's, *expected is not updated
 * on failure */
#define sdpa_atomic_cas(p, expected, desired) \
    (_InterlockedCompareExchange((volatile long *)(p), (desired), *(expected)) == *(expected))
/* pointers only */
#define sdpa_atomic_exchange(p, v) _InterlockedExchangePointer((void *volatile *)(p), (v))
#else
#include <stdatomic.h>
#define SDPA_ATOMIC(type) _Atomic(type)
#define sdpa_atomic_load(p) atomic_load(p)
#define sdpa_atomic_store(p, v) atomic_store(p, v)
#define sdpa_atomic_add(p, v) atomic_fetch_add(p, v)
#define sdpa_atomic_cas(p, expected, desired) atomic_compare_exchange_strong(p, expected, desired)
#define sdpa_atomic_exchange(p, v) atomic_exchange(p, v)
#endif

#endif
