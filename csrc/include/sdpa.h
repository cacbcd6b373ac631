/*
 * sdpa: fused scaled dot-product attention on CPUs -- the public C API.
 *
 *   out = softmax(scale * Q K^T + mask) V
 *
 * Plain C11: no Python, no NumPy.  Shapes and strides are int64 and strides
 * are counted in elements (not bytes); a zero stride broadcasts a dimension.
 * Buffers belong to the caller.  Every call returns an sdpa_status.
 */
#ifndef SDPA_H
#define SDPA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(SDPA_BUILD_SHARED)
#define SDPA_API __declspec(dllexport)
#elif defined(__GNUC__) && defined(SDPA_BUILD_SHARED)
#define SDPA_API __attribute__((visibility("default")))
#else
#define SDPA_API
#endif

#define SDPA_VERSION_MAJOR 0
#define SDPA_VERSION_MINOR 7
#define SDPA_VERSION_PATCH 0

/* Leading batch dimensions, in front of the head dimension. */
#define SDPA_MAX_BATCH_DIMS 8

/* The largest key count, position offset (align_offset, causal_offset) and
 * window side, 2^61: positions keep far from int64 overflow.  A window side
 * of SDPA_MAX_POSITION already shows every key. */
#define SDPA_MAX_POSITION ((int64_t)1 << 61)

/* A thread count above this is taken as this (a sanity bound, not a tuning
 * knob: a call never takes more threads than it has units of work). */
#define SDPA_MAX_THREADS 65536

/* The largest magnitude each quantized kv_dtype stores (sdpa_quantize scales
 * max|x| to it): int8 127, int4 7, float8 e4m3fn 448, e5m2 57344. */
#define SDPA_INT8_MAX 127.0f
#define SDPA_INT4_MAX 7.0f
#define SDPA_FP8_E4M3_MAX 448.0f
#define SDPA_FP8_E5M2_MAX 57344.0f

/* integer_pv: the keys whose weights share one scale (a run of a key tile). */
#define SDPA_PV_KEYS 64

typedef enum sdpa_status {
    SDPA_OK = 0,
    SDPA_ERR_NULL_POINTER = 1,      /* a required pointer is NULL            */
    SDPA_ERR_BAD_DTYPE = 2,         /* unknown element type                  */
    SDPA_ERR_BAD_SHAPE = 3,         /* negative size, too many batch dims... */
    SDPA_ERR_BAD_GQA = 4,           /* gqa_group < 1 or not dividing heads  */
    SDPA_ERR_BAD_MASK = 5,          /* unknown mask kind                     */
    SDPA_ERR_BAD_THREADS = 6,       /* negative thread count                 */
    SDPA_ERR_NO_MEMORY = 7,         /* scratch allocation failed             */
    SDPA_ERR_OVERFLOW = 8,          /* a size product overflows int64        */
    SDPA_ERR_INTERRUPTED = 9,       /* the interrupt callback asked to stop  */
    SDPA_ERR_BAD_ISA = 10,          /* unknown or unsupported kernel set     */
    SDPA_ERR_BAD_VARIANT = 11,      /* window, softcap or alignment offset
                                       out of range, or key scores with what
                                       they do not go with                   */
    SDPA_ERR_NOT_FINITE = 12,       /* a value to quantize is NaN or infinite
                                       (or, for float8 without scales, outside
                                       the format's finite range)            */
    SDPA_ERR_ABI = 13,              /* *p is not this library's sdpa_problem:
                                       the caller was compiled against another
                                       sdpa.h (or did not call
                                       sdpa_problem_init)                    */
    SDPA_ERR_BAD_PAGES = 14,        /* paged: a block id out of range where it
                                       is read, a sequence longer than its
                                       table, no key_lengths, num_batch_dims
                                       not 1, weights, a mask that is not a
                                       bool tree over the last positions, or a
                                       negative or too large block_size,
                                       num_blocks or block_table_stride      */
    SDPA_ERR_BAD_RAGGED = 15,       /* ragged: cu_seqlens_q or cu_seqlens_k not
                                       prefix sums from 0 to len_q / len_kv,
                                       num_batch_dims not 1, a mask or weights,
                                       key_lengths with cu_seqlens_k, a paged
                                       sequence with more query rows than
                                       positions, or offsets_from_end without
                                       cu_seqlens                            */
    SDPA_ERR_BAD_TOPK = 16,         /* top-k lists: an entry below -1 or at or
                                       past len_kv, a negative topk, or lists
                                       with a mask, weights, causality, a
                                       window, ALiBi, paged or ragged keys   */
    SDPA_ERR_BAD_BLOCKS = 17        /* a block map: a state other than 0, 1
                                       or 2, a block size below 1, or a map
                                       with weights, top-k lists, paged or
                                       ragged keys (0.6)                     */
} sdpa_status;

/*
 * Element types.  A problem computes in float64 when its dtype is
 * SDPA_FLOAT64, else in float32 (products and softmax statistics in float32,
 * whatever the storage); weights, lse and an additive mask are stored in that
 * compute type.  The 16-bit types are stored as uint16_t.
 */
typedef enum sdpa_dtype {
    SDPA_FLOAT32 = 0,   /* float                                          */
    SDPA_FLOAT64 = 1,   /* double                                         */
    SDPA_BFLOAT16 = 2,  /* bfloat16: the upper 16 bits of a float          */
    SDPA_FLOAT16 = 3,   /* IEEE 754 binary16                               */
    SDPA_INT8 = 4,      /* kv_dtype only, with a float32 or 16-bit query:
                           int8_t, each element times its float32 scale
                           (key_scale / value_scale, kv_group_size)       */
    SDPA_FP8_E4M3 = 5,  /* kv_dtype only, like SDPA_INT8: float8 e4m3fn in a
                           byte (sign, 4 exponent bits biased by 7, 3
                           mantissa bits; no infinities, S.1111.111 is NaN;
                           largest 448), times its scale if there are scales */
    SDPA_FP8_E5M2 = 6,  /* kv_dtype only: float8 e5m2 (sign, 5 exponent bits
                           biased by 15, 2 mantissa bits: the upper byte of a
                           float16; largest finite 57344), scaled likewise   */
    SDPA_INT4 = 7,      /* kv_dtype only: 4-bit integers, two a byte, each
                           times its float32 scale.  Value c of a row is in
                           byte c / 2 of the row, in the low nibble for even c
                           and the high nibble for odd c; a nibble holds the
                           value plus 8 (0..15 for -8..7; sdpa_quantize writes
                           -7..7).  Strides of an int4 key or value view
                           count bytes (pairs of values); col_stride must be 1,
                           and head_dim, head_dim_v and a nonzero
                           kv_group_size even.                            */
    SDPA_DTYPE_OF_QUERY = -1  /* kv_dtype only: the same as dtype          */
} sdpa_dtype;

typedef enum sdpa_mask_kind {
    SDPA_MASK_NONE = 0,
    SDPA_MASK_BOOL = 1,     /* uint8/bool elements: nonzero = takes part        */
    SDPA_MASK_ADDITIVE = 2  /* elements of the compute type (float, or double for
                               SDPA_FLOAT64), added to the scores             */
} sdpa_mask_kind;

/*
 * A strided view of one operand.  The element at (batch index b[0..nb),
 * head h, row r, column c) is
 *     data[sum_i b[i]*batch_strides[i] + h*head_stride + r*row_stride + c*col_stride]
 * For key and value, h is the key/value head (query head / gqa_group).
 */
typedef struct sdpa_view {
    void *data;
    int64_t batch_strides[SDPA_MAX_BATCH_DIMS];
    int64_t head_stride;
    int64_t row_stride;
    int64_t col_stride;
} sdpa_view;

/* Optional callback polled between tiles; returning nonzero stops the call
 * with SDPA_ERR_INTERRUPTED (the output is then unspecified). */
typedef int (*sdpa_interrupt_fn)(void *user_data);

typedef struct sdpa_problem {
    size_t struct_size;    /* sizeof(sdpa_problem) in the caller's sdpa.h, set
                              by sdpa_problem_init: sdpa_attention refuses any
                              other (SDPA_ERR_ABI).  Always the first field. */
    sdpa_dtype dtype;      /* of query and out: SDPA_FLOAT32, _FLOAT64,
                              _BFLOAT16 or _FLOAT16                            */
    sdpa_dtype kv_dtype;   /* of key and value: SDPA_DTYPE_OF_QUERY (the
                              default), or with a float32 or 16-bit dtype any
                              of SDPA_FLOAT32, _BFLOAT16, _FLOAT16 (a float32
                              query can attend a 16-bit cache in place) or
                              SDPA_INT8, SDPA_FP8_E4M3, SDPA_FP8_E5M2 or
                              SDPA_INT4 (a quantized cache, read in place)  */
    int32_t num_batch_dims;                    /* 0..SDPA_MAX_BATCH_DIMS       */
    int64_t batch_shape[SDPA_MAX_BATCH_DIMS];
    int64_t num_heads;     /* query heads = output heads (Hq)                   */
    int64_t gqa_group;     /* query heads per key/value head (>= 1, divides Hq) */
    int64_t len_q;         /* L  */
    int64_t len_kv;        /* S (at most 2^61) */
    int64_t head_dim;      /* E  */
    int64_t head_dim_v;    /* Ev */

    sdpa_view query;       /* (..., Hq,  L, E)                     read only */
    sdpa_view key;         /* (..., Hkv, S, E)                     read only */
    sdpa_view value;       /* (..., Hkv, S, Ev)                    read only */
    sdpa_view out;         /* (..., Hq,  L, Ev)                    written   */

    sdpa_mask_kind mask_kind;
    sdpa_view mask;        /* (..., Hq, L, S), broadcast by zero strides     */

    double scale;          /* multiplies Q K^T (NaN or inf: NaN results)       */
    int32_t causal;        /* nonzero: key s is masked for row l when          */
    int64_t causal_offset; /*   s > l + causal_offset (0: top-left aligned,    */
                           /*   S - L: bottom-right aligned); any int64 value  */

    sdpa_view weights;     /* optional (..., Hq, L, S) output, compute type;
                              data NULL = skip                                 */
    sdpa_view lse;         /* optional (..., Hq, L) output, compute type: the
                              log-sum-exp of the scaled, masked scores of each
                              row (-inf for a row with no visible key);
                              col_stride unused                                */

    /* optional: keys at or past key_lengths[b] are ignored for batch index b
       (read through key_lengths_strides over batch_shape; values clip to [0, S]) */
    const int64_t *key_lengths;
    int64_t key_lengths_strides[SDPA_MAX_BATCH_DIMS];

    int32_t num_threads;   /* 0 = the OpenMP default, fewer for small problems
                              (at least 1 MFLOP a thread, a byte of keys and
                              values read counting as 2); n > 0: n threads.
                              Either is capped at sdpa_max_threads().        */
    sdpa_interrupt_fn interrupt;  /* optional */
    void *interrupt_data;

    /* Model variants; sdpa_problem_init turns them all off.  Row l and key s
     * are aligned by align_offset (0: top-left, S - L: bottom-right), at most
     * 2^61 in magnitude; the window and ALiBi use it.
     *   window: key s is visible to row l only when
     *     l + align_offset - window_left <= s <= l + align_offset + window_right;
     *     -1 leaves a side unbounded (at most 2^61; key tiles outside the
     *     window are never visited);
     *   softcap > 0: each scaled score x becomes softcap * tanh(x / softcap),
     *     before the mask and ALiBi are added (0: off; finite);
     *   alibi (data non-NULL): adds -slope * |l + align_offset - s| to the score,
     *     slope = the (batch, head) element of alibi (compute type; row_stride
     *     and col_stride unused);
     *   sinks (data non-NULL): a logit per (batch, head) (compute type) that
     *     joins each row's softmax denominator, unscaled, and adds no value:
     *     out = sum_s e^(x_s - m) v_s / (sum_s e^(x_s - m) + e^(sink - m)); the
     *     lse and the weights include it, and a row that sees no key gives
     *     zeros.                                                            */
    int64_t window_left, window_right;
    int64_t align_offset;
    double softcap;
    sdpa_view alibi;
    sdpa_view sinks;

    /* Quantized keys and values (kv_dtype SDPA_INT8, _FP8_E4M3, _FP8_E5M2 or
     * _INT4): the value of key element
     * (b, h, s, c) is (float)key[b, h, s, c] * key_scale[b, h, s, c / G] with
     * G = kv_group_size, or G = head_dim when kv_group_size is 0 (one scale
     * per token and head); values alike with value_scale and head_dim_v.  The
     * scale views are float32, (..., Hkv, S, E / G) and (..., Hkv, S, Ev / G),
     * any strides.  A nonzero kv_group_size divides head_dim and head_dim_v.
     * sdpa_quantize writes such rows.  The kernels dequantize a tile at a
     * time (in registers when decoding); the cache is never copied.  The
     * float8 types may go without scales (key_scale.data or value_scale.data
     * NULL: the stored values as they are); int8 and int4 need both.
     *
     * integer_qk (int8 and int4 keys, a float32 or 16-bit query; else ignored):
     * nonzero computes the scores of the row path (decoding, short queries) in
     * integers: each query row, scaled, is quantized to int8 with its own scale
     * max|q| / 127, and each key group's dot product is an exact int32 sum of
     * int8 x int8 (or x int4) products (AVX512-VNNI or AVX-VNNI where the CPU
     * has them, the same sums in portable C where not), then scaled in float.
     * It adds the query's rounding to the scores (relative error about
     * 2^-8 of max|q| |k| per term).  The tiled path (long queries) ignores it.
     *
     * integer_pv (0.5; int8 and int4 values, a float32 or 16-bit query; else
     * ignored): nonzero computes the row path's P V in integers.  For each
     * query row, each run of SDPA_PV_KEYS keys of a key tile and each value
     * scale group, the weights p_j * value_scale_j (p_j in [0, 1] after the
     * running maximum) are rounded to 0..255 with the scale max_j / 255 (as
     * floor(w * (1 / scale) + 1/2): a weight's own rounding, not the exact
     * quotient's, which the kernels' bits define), and
     * summed against the stored values in exact int32 sums (u8 x int8 or
     * int4: AVX512-VNNI where the CPU has it, the same sums in portable C
     * elsewhere), then converted and scaled in float.  It adds the weights'
     * rounding (at most 2^-9 of the run's largest weight per term); the
     * VNNI and portable sums are the same.  Float8 values are not integers in a byte:
     * ignored for them.  The tiled path ignores it. */
    sdpa_view key_scale;
    sdpa_view value_scale;
    int64_t kv_group_size;

    /* Paged keys and values (block_size > 0): each of the batch_shape[0]
     * sequences (num_batch_dims must be 1) keeps its keys in blocks of
     * block_size positions.  Position s of sequence b is row s % block_size of
     * block  block_table[b * block_table_stride + s / block_size], an id in
     * [0, num_blocks).  In key, value, key_scale and value_scale,
     * batch_strides[0] is then the stride between blocks (the caches are
     * (num_blocks, Hkv, block_size, E)): the blocks are read in place.
     *   key_lengths is required: sequence b has S_b = key_lengths[b] positions,
     *     at most len_kv (the table's capacity, max_blocks x block_size);
     *     table entries past the blocks S_b needs are never read (they may be
     *     -1);
     *   query row l of sequence b is position S_b - L + l: causal_offset and
     *     align_offset are added to S_b - L (0, 0: each sequence's last L
     *     positions, bottom-right aligned; the causal flag as usual);
     *   no weights; a mask only as a tree over the last positions: a bool
     *     mask (b, h, l, j), j < L, decides whether row l sees position
     *     S_b - L + j, every earlier position is seen (speculative tree
     *     verification; causal must be 0, and cu_seqlens_q NULL);
     *   sequences whose tables start with the same block ids, wholly visible
     *     to each of their rows (forks of one prompt, a common system prompt),
     *     have those blocks read once for the rows of all of them, at each
     *     level of sharing, the parts merged exactly (no window or ALiBi).
     * The blocks are read where they lie, by the part of each tile in each
     * block: decoding and float products on blocks of 64 or more positions in
     * place; shorter blocks and 16-bit or int8 caches copied or widened a tile
     * (or a call) at a time, as arrays of those types are (bfloat16 pairs of
     * keys that straddle two blocks of an odd size paired from both).
     * Blocks that follow each other in the pool (consecutive ids, blocks back
     * to back) are read as one run: a table of one-position blocks over a
     * contiguous cache attends a selection of its positions (sparse
     * attention; examples/c/sparse_decode.c). */
    const int32_t *block_table;
    int64_t block_table_stride;  /* entries between sequences' tables      */
    int64_t block_size;          /* 0: not paged                           */
    int64_t num_blocks;          /* blocks in the caches                   */

    int32_t integer_qk;          /* see the quantized keys above; 0: float */

    /* Ragged batches (0.5): B = batch_shape[0] sequences of different lengths
     * in one call (num_batch_dims 1), planned and run together.
     *   cu_seqlens_q: NULL, or B + 1 prefix sums from 0, never decreasing,
     *     ending at len_q: query, out and lse are packed, row l of sequence b
     *     is row cu_seqlens_q[b] + l of their views (batch_strides[0] is not
     *     used), and sequence b has L_b = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
     *     rows (0 allowed).  Paged, these are vLLM's query_start_loc: sequence
     *     b's rows are its last L_b positions, L_b <= key_lengths[b].
     *   cu_seqlens_k: NULL, or (not paged) B + 1 prefix sums ending at len_kv:
     *     key, value and their scales are packed the same way, key s of
     *     sequence b at row cu_seqlens_k[b] + s, S_b keys.  Without it the keys
     *     are those of batch index b (key_lengths clip them as usual).
     *   offsets_from_end: nonzero: causal_offset and align_offset count from
     *     each sequence's S_b - L_b (bottom-right alignment per sequence); paged
     *     problems always count so.
     * Ragged problems take no mask and no weights (SDPA_ERR_BAD_RAGGED). */
    const int64_t *cu_seqlens_q;
    const int64_t *cu_seqlens_k;
    int32_t offsets_from_end;
    int32_t integer_pv;          /* see the quantized values above; 0: float */

    /* Top-k sparse attention (0.5): with topk_indices.data set (int32_t
     * elements), row l of batch index b attends, for key/value head h, only
     * the key positions
     *     topk_indices[b, h, l, j],  0 <= j < topk
     * (batch_strides over batch_shape, head_stride over the Hkv key/value
     * heads, row_stride over the L rows, col_stride over j; a head_stride of 0
     * gives every head the same list).  The result is attention over the
     * gathered keys and values key[b, h, list, :]:
     *   an entry of -1, or at or past key_lengths[b] (when given), is ignored;
     *   a position listed twice counts twice;
     *   a row left with no position gives 0 and lse -inf (with sinks: 0 and
     *     lse the sink).
     * An entry below -1 or at or past len_kv is SDPA_ERR_BAD_TOPK.  Every
     * kv_dtype and scale layout is read where it lies (value may be a column
     * view of key: MLA's latent cache), never gathered into a copy: the cache
     * is seen as a pool of one-position blocks and each row's list, ascending,
     * as its block table, the positions every row of a group of 64 rows lists
     * first (read once for the group).  Results do not depend on the thread
     * count.  Lists take no mask, weights, causality, window or ALiBi, and
     * keys that are neither paged nor ragged (SDPA_ERR_BAD_TOPK naming the
     * field); over a paged cache, a table of one-position blocks is such a
     * list already (examples/c/sparse_decode.c).  sdpa_index_topk writes the
     * lists of DeepSeek-style sparse attention. */
    sdpa_view topk_indices;
    int64_t topk;                /* entries a row's list holds (k >= 0)    */

    /* Block-sparse attention (0.6): with block_states.data set (int8_t
     * elements), the scores of each query head are cut into blocks of block_q
     * query rows x block_k keys, and
     *     block_states[b, h, i, j],  i < ceil(L / block_q), j < ceil(S / block_k)
     * (batch_strides over batch_shape, head_stride over the Hq query heads,
     * row_stride over i, col_stride over j; zero strides broadcast) says how
     * block (i, j) is computed:
     *   0  not at all: its keys are never read for those rows;
     *   1  partial: with every rule of the problem (mask, causality, window,
     *      key_lengths);
     *   2  full: without the element tests (a bool mask, causality and the
     *      window are not looked at); an additive mask, softcap and ALiBi
     *      still apply, and keys at or past key_lengths[b] are still ignored.
     * A row that sees no key gives 0 and lse -inf (with sinks: 0 and lse the
     * sink).  A row's blocks are computed in key order, neighbouring blocks
     * of one state as one range of keys; the result does not depend on the
     * thread count.  Another state, a block size below 1, or a map with
     * weights, top-k lists, paged or ragged keys is SDPA_ERR_BAD_BLOCKS
     * (naming the field).  The cost is in proportion to the blocks computed. */
    sdpa_view block_states;
    int64_t block_q, block_k;    /* rows and keys a block (>= 1 with a map) */

    /* Key scores (0.6): with key_scores.data set, a float32 output (..., Hkv,
     * S) (batch_strides over batch_shape, head_stride over the key/value
     * heads, col_stride over the keys; row_stride unused): for each key, the
     * sum of the softmax weights it received from the query rows counted, over
     * every query head of its key/value head's group -- the attention mass of
     * H2O-style cache eviction.  key_scores_rows > 0 counts the last
     * key_scores_rows query rows only (a window of recent queries, SnapKV),
     * 0 every row.  A masked key, or one at or past key_lengths[b], scores 0;
     * a row that sees no key adds nothing.  The scores come from the
     * probabilities the output is computed with (the rows counted are
     * computed on the row path, as decoding rows are), so each row adds 1 to
     * the sum over keys, to rounding (less a sink's share).  Paged: the
     * scores are indexed by position, key_scores (B, Hkv, len_kv); shared
     * prefixes are then read by each sequence.  Not with ragged queries or
     * keys, top-k lists, a block map or a tree mask (SDPA_ERR_BAD_VARIANT). */
    sdpa_view key_scores;
    int64_t key_scores_rows;

    /* Dropout (0.7): with dropout_p in (0, 1), each weight of the output's
     * sum is kept with probability 1 - d and divided by it, or dropped:
     * out = sum_s keep(b, h, l, s) p_s v_s / (1 - d), where d is dropout_p
     * rounded up to a multiple of 2^-16, t / 65536 with t = ceil(dropout_p
     * 65536) (at most 65535).  The softmax (its denominator, the lse, sinks)
     * is that of every key, before dropout.  keep(b, h, l, s) is a function
     * of dropout_seed and the position alone -- batch index b (over
     * batch_shape), query head h, row l, key s -- drawn by Philox-4x32-10: the
     * words of the counter (s mod 2^32, l / 8, h, b mod 2^32) under the key
     * (seed's low half, its high half xor s / 2^32) as eight 16-bit numbers,
     * row l's the half l mod 2 (low first) of word (l mod 8) / 2, kept when
     * it is >= t.  So the mask is the same whatever the tiling, kernel set or
     * thread count, and sdpa_attention_backward draws it again.  0 (the
     * default) is no dropout, the usual path.  Dropout takes what the
     * backward takes (a dense problem: SDPA_ERR_BAD_VARIANT naming the field
     * otherwise) and no weights; a value outside [0, 1) or NaN is
     * SDPA_ERR_BAD_VARIANT. */
    double dropout_p;
    uint64_t dropout_seed;
} sdpa_problem;

/* Fills *p with an empty problem: float32, key and value of the query's
 * dtype, no mask, no weights, gqa_group 1, scale 1, num_threads 0, no window
 * (window_left = window_right = -1), no softcap, ALiBi or sinks, and
 * struct_size.  Callers then set sizes, views and dtypes.
 *
 * The ABI rule: sdpa_problem_init(p) is a macro that passes the caller's
 * sizeof(sdpa_problem) to sdpa_problem_init_sized, which writes the problem
 * only when that size is this library's (else it writes struct_size alone,
 * when there is room for it); sdpa_attention refuses a problem whose
 * struct_size is not this library's with SDPA_ERR_ABI.  Bindings that call the
 * library by symbol (ctypes, cffi) call sdpa_problem_init_sized with their
 * struct's size.  The minor version grows whenever the struct changes.  The
 * symbol sdpa_problem_init is kept for callers compiled against 0.1's header,
 * which had no struct_size: it cannot know the caller's size, so it zeroes
 * only the first 8 bytes (which every 0.1 struct has: its dtype and the int32
 * field after it), which never read as this library's struct_size, and their
 * sdpa_attention calls get SDPA_ERR_ABI instead of a crash. */
SDPA_API void sdpa_problem_init_sized(sdpa_problem *p, size_t struct_size);
SDPA_API void(sdpa_problem_init)(sdpa_problem *p);
#define sdpa_problem_init(p) sdpa_problem_init_sized((p), sizeof(sdpa_problem))

/* Computes the attention described by *p.  Thread safe; p is not modified.
 * Every thread computes under the caller's floating-point control flags (x86
 * MXCSR flush-to-zero, denormals-are-zero and rounding; AArch64 FPCR), which
 * are left as they were. */
SDPA_API sdpa_status sdpa_attention(const sdpa_problem *p);

/* Checks *p against every rule sdpa_attention holds it to, computing and
 * writing nothing (a paged problem's block table and lengths are read, as
 * sdpa_attention reads them): SDPA_OK, or the status sdpa_attention would
 * return, and then, when field is not NULL, *field names the sdpa_problem
 * field that broke the rule ("window_left", "block_table", "cu_seqlens_q",
 * ...; a static string), NULL where there is none to name (p itself NULL).
 * Statuses that only computing can give (SDPA_ERR_NO_MEMORY,
 * SDPA_ERR_INTERRUPTED, SDPA_ERR_BAD_ISA) are not checked.  Thread safe. */
SDPA_API sdpa_status sdpa_check(const sdpa_problem *p, const char **field);

/* ---- the backward pass (training) ---- */

/* The gradients of one attention call, for sdpa_attention_backward.  Views as
 * sdpa_problem's (strides in elements; the same batch dims and heads):
 *   grad_out    (..., Hq, L, Ev)   dtype, read: the loss's gradient of out
 *   grad_query  (..., Hq, L, E)    dtype, written
 *   grad_key    (..., Hkv, S, E)   dtype, written (summed over the GQA group)
 *   grad_value  (..., Hkv, S, Ev)  dtype, written (summed over the GQA group)
 *   grad_sinks  (..., Hq)          compute type, written when data is set
 *                                  (head_stride and batch_strides only)
 * The written views must not overlap each other or any input, and may not
 * broadcast (a zero stride over a dimension of more than one element is
 * SDPA_ERR_BAD_SHAPE): a caller whose key broadcasts sums its gradient. */
typedef struct sdpa_grads {
    size_t struct_size;  /* sizeof(sdpa_grads), set by sdpa_grads_init */
    sdpa_view grad_out;
    sdpa_view grad_query;
    sdpa_view grad_key;
    sdpa_view grad_value;
    sdpa_view grad_sinks;
} sdpa_grads;

SDPA_API void sdpa_grads_init_sized(sdpa_grads *g, size_t struct_size);
#define sdpa_grads_init(g) sdpa_grads_init_sized((g), sizeof(sdpa_grads))

/* The gradients of the attention *p computed, given the loss's gradient of
 * its output (FlashAttention-2's backward pass).  p describes the forward
 * call; its out and lse views are read, as that call wrote them (lse is
 * required).  The probabilities are recomputed a tile at a time from the lse,
 * so the memory beyond the operands is O(L + S) a head (and a dQ accumulator
 * of the compute type, the size of grad_query, once more per key split of a
 * problem with few heads).  Every variant of a dense call is taken: a bool or
 * additive mask, causality, key_lengths, the window, softcap, ALiBi, sinks
 * (grad_sinks), GQA, batch dims; float32, float64, bfloat16 and float16
 * (accumulated in float32, the gradients rounded once), and dropout (the
 * forward's mask drawn again from dropout_seed).  Not with weights, key
 * scores, paged, ragged or quantized keys, top-k lists or a block map
 * (SDPA_ERR_BAD_VARIANT or _BAD_DTYPE naming the field, sdpa_check_backward).
 * The gradients do not depend on the thread count: each dK, dV row is
 * summed by one task in a fixed order, and dQ's partial sums are added in
 * the order of their key splits, which depend on the problem's sizes only.
 * Thread safe; nothing but the gradients is written.  No interrupt. */
SDPA_API sdpa_status sdpa_attention_backward(const sdpa_problem *p, const sdpa_grads *g);

/* sdpa_check for a backward call: SDPA_OK or the status sdpa_attention_backward
 * would return, the field that broke the rule in *field (when not NULL). */
SDPA_API sdpa_status sdpa_check_backward(const sdpa_problem *p, const sdpa_grads *g, const char **field);

/* ---- the indexer of sparse attention ---- */

/* A top-k indexer problem (DeepSeek's sparse attention): for each query row
 * (b, l), the scores of the keys it sees,
 *   score[s] = sum_{h < heads} weights[b, l, h] * max(q[b, h, l, :] . k'[b, s, :], 0),
 * k' the keys widened (times key_scale[b, s], where given), h in order; and
 * the k best positions: scores descending, ties to the lower position, NaN
 * last.  Row l of batch b sees positions below len_kv, or key_lengths[b]
 * (clipped to [0, len_kv]) when given; with causal, only up to
 * limit - len_q + l (bottom-right aligned).  Rows that see fewer than k
 * positions end with -1 and -inf.  Set up with sdpa_topk_problem_init (the
 * same ABI rule as sdpa_problem). */
typedef struct sdpa_topk_problem {
    size_t struct_size;       /* sizeof(sdpa_topk_problem): set by the init */
    int64_t batch, heads, len_q, len_kv, head_dim, k;
    const float *query;       /* (batch, heads, len_q, head_dim): float32, rows contiguous */
    int64_t query_strides[3]; /* elements: batch, head, row                       */
    sdpa_dtype key_dtype;     /* SDPA_FLOAT32, _BFLOAT16, _FLOAT16, _INT8 (with
                                 key_scale), _FP8_E4M3 or _FP8_E5M2 (key_scale
                                 optional): one index head of keys            */
    const void *key;          /* (batch, len_kv, head_dim), rows contiguous      */
    int64_t key_strides[2];   /* elements: batch (0: shared), row                */
    const float *key_scale;   /* (batch, len_kv) or NULL                         */
    int64_t key_scale_strides[2];
    const float *weights;     /* (batch, len_q, heads), heads contiguous          */
    int64_t weights_strides[2];
    const int64_t *key_lengths; /* (batch) or NULL                               */
    int causal;
    int num_threads;          /* 0: the library's default; results do not depend on it */
    int32_t *indices;         /* out: (batch, len_q, k), contiguous              */
    float *scores;            /* out: (batch, len_q, k), contiguous, or NULL     */
} sdpa_topk_problem;

SDPA_API void sdpa_topk_problem_init_sized(sdpa_topk_problem *p, size_t struct_size);
#define sdpa_topk_problem_init(p) sdpa_topk_problem_init_sized((p), sizeof(sdpa_topk_problem))

/* Computes *p's top k of every row.  Never builds the scores of a whole row:
 * each thread keeps a running selection over its keys.  Thread safe; the
 * result does not depend on num_threads.  SDPA_ERR_ABI, _NULL_POINTER,
 * _BAD_DTYPE, _BAD_SHAPE (negative sizes, heads or head_dim below 1, len_kv
 * at or past 2^31), _BAD_THREADS, _NO_MEMORY. */
SDPA_API sdpa_status sdpa_index_topk(const sdpa_topk_problem *p);

/* Quantizes `rows` rows of `cols` floats (src, rows src_row_stride apart) to
 * int8, symmetric, round to nearest (ties to even): each group of group_size
 * consecutive columns (0: the whole row) gets the scale max|x| / 127 (0 for a
 * group of zeros; one float lower where 127 * scale would overflow, so that
 * finite values dequantize to finite ones), scales[r * scale_row_stride + g], and the values
 * dst[r * dst_row_stride + c] = round(x / scale), in [-127, 127].  group_size
 * must divide cols (else SDPA_ERR_BAD_SHAPE).  A NaN or infinite value gives
 * SDPA_ERR_NOT_FINITE and writes nothing.  Thread safe; no allocation. */
SDPA_API sdpa_status sdpa_quantize_int8(const float *src, int64_t src_row_stride, int64_t rows, int64_t cols,
                                        int64_t group_size, int8_t *dst, int64_t dst_row_stride, float *scales,
                                        int64_t scale_row_stride);

/* Quantizes like sdpa_quantize_int8 to any quantized dtype dt:
 *   SDPA_INT8: as sdpa_quantize_int8 (scale max|x| / 127, values in [-127, 127]);
 *   SDPA_INT4: scale max|x| / 7, values round(x / scale) in [-7, 7] stored plus
 *     8, two a byte (SDPA_INT4's order); cols and a nonzero group_size even,
 *     dst_row_stride in bytes;
 *   SDPA_FP8_E4M3 / SDPA_FP8_E5M2: scale max|x| / 448 (/ 57344), values x /
 *     scale rounded to nearest (ties to even) in the format, saturating at its
 *     largest finite value.  scales NULL: no scale, the values themselves
 *     rounded, SDPA_ERR_NOT_FINITE (nothing written) when one is larger in
 *     magnitude than the format's largest finite value.
 * A group of zeros (or of values so small that their scale would be
 * subnormal) gets the scale 0.  NaN or infinite values: SDPA_ERR_NOT_FINITE,
 * nothing written.  Any other dt: SDPA_ERR_BAD_DTYPE. */
SDPA_API sdpa_status sdpa_quantize(sdpa_dtype dt, const float *src, int64_t src_row_stride, int64_t rows,
                                   int64_t cols, int64_t group_size, void *dst, int64_t dst_row_stride,
                                   float *scales, int64_t scale_row_stride);

/* Scales per row of `cols` columns in groups of group_size (0: whole rows):
 * cols / group_size, 1 for group_size 0; -1 when group_size is negative or
 * does not divide cols.  A (..., H, S, E) int8 key cache takes H*S*E bytes
 * and H*S*sdpa_int8_scales_per_row(E, G) floats of scales. */
SDPA_API int64_t sdpa_int8_scales_per_row(int64_t cols, int64_t group_size);

/* A static, human-readable message for a status. */
SDPA_API const char *sdpa_status_message(sdpa_status status);

/* Kernel sets ("isa"): "scalar" (portable C), "avx2" (AVX2 + FMA + F16C),
 * "avx512" (AVX-512 F/BW/DQ/VL), "avx512_bf16" (that and AVX512_BF16) and "amx" (that and AMX-TILE + AMX-BF16,
 * Linux only) on x86-64; "neon" (Advanced SIMD) and "neon_bf16" (that and FEAT_BF16) on AArch64.  The best one this CPU supports is chosen at first use, unless the environment variable SDPA_ISA
 * names another.  "amx" is asked of the OS (arch_prctl) once, by the first call that would run a tile instruction (a
 * bfloat16 problem on the tiled path); if refused, the default runs as "avx512_bf16" and, with "amx" named, such
 * calls return SDPA_ERR_BAD_ISA.
 * sdpa_isa_supported: 1 if this build and CPU can run the named set ("amx": and the OS has not refused the tile state,
 * which it is only asked for by that first call).
 * sdpa_set_isa: switch to it for later calls (SDPA_ERR_BAD_ISA if not supported).
 * sdpa_isa: the name of the set in use.
 * sdpa_isa_name: the i-th of every set's name, in the order above, whether
 * this build or CPU can run it or not; NULL from i = their count on. */
SDPA_API int sdpa_isa_supported(const char *name);
SDPA_API const char *sdpa_isa_name(int i);
SDPA_API sdpa_status sdpa_set_isa(const char *name);
SDPA_API const char *sdpa_isa(void);

/* Build and runtime facts.  sdpa_max_threads: the most threads a call uses,
 * 4 per CPU but at least 8, and not above OMP_THREAD_LIMIT (1 without OpenMP). */
SDPA_API int sdpa_has_openmp(void);
SDPA_API int sdpa_default_num_threads(void);
SDPA_API int sdpa_max_threads(void);
SDPA_API const char *sdpa_version(void);

/* The L1 data and L2 cache sizes in bytes (either pointer may be NULL) that the
 * tiles are chosen from (docs/blocking.md): cpuid on x86, sysfs on Linux,
 * sysctl on macOS, else 32 KiB and 1 MiB.  Detected once. */
SDPA_API void sdpa_cache_sizes(int64_t *l1d, int64_t *l2);

#ifdef __cplusplus
}
#endif
#endif /* SDPA_H */
