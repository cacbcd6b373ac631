/* The planner: cuts a validated call into parts, plans each (path, blocking,
 * scratch), and lays out the work list, the copies, the merges and the call's
 * memory (plan.h).  Nothing here computes attention or starts a thread. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "problem.h"
#include "testing.h"

/* Row mode serves problems with at most SDPA_ROW_MODE_MAX_ROWS query rows per
 * key/value head (gqa_group x L), and those with a short query (L at most
 * SDPA_ROW_MODE_MAX_L) and up to SDPA_ROW_MODE_WIDE_ROWS rows: the tiled path's tiles
 * hold the rows of one head, and below about 24 rows per head it measured slower
 * than the row path (12-50 against 70-85 GFLOP/s a thread for L = 2..16 with GQA). */
#define SDPA_ROW_MODE_MAX_ROWS 8
#define SDPA_ROW_MODE_MAX_L 16
#define SDPA_ROW_MODE_MAX_L_BF16 12 /* bfloat16 query and keys with AVX512-BF16: 81-87
                                      * against 76-80 GFLOP/s at L = 16 on the tiled path */
#define SDPA_ROW_MODE_WIDE_ROWS 128
/* ... except where a GQA group packs into the tiled path's rows (pack_group):
 * from this many rows a key/value head the tiled path is ahead (2 threads,
 * Hq 16 / Hkv 4, E 128: L = 6 1.1x, L = 8 1.3-1.5x, L = 16 1.5-1.7x over
 * S = 16-4,096; L = 4 0.7-1.0x) */
#define SDPA_PACKED_MIN_ROWS 24
/* Decoding with at least this many query heads per key/value head runs them
 * as the rows of one query (fold_group); bfloat16 with bfloat16 products from 16 */
#define SDPA_FOLD_MIN_GROUP 32
#define SDPA_FOLD_MIN_GROUP_BF16 16
/* Keys per row-path task */
#define SDPA_ROW_MODE_CHUNK 1024
/* K and V packed once per call in at most this many bytes, by units of this
 * many keys (even: whole pairs) */
#define SDPA_PACK_BUDGET (512.0 * 1024 * 1024)
#define SDPA_PACK_CHUNK 512
/* A shared prefix's rows attend its blocks as one GQA group (the row path) up
 * to this many rows per key/value head, else as the rows of one head (tiled) */
#define SDPA_SHARED_ROW_MODE_ROWS 16
/* A shared prefix is read in parts of at most this many keys (whole blocks), so
 * that a long one gives tasks to many threads */
#define SDPA_SHARED_PART_KEYS 4096
/* From this many threads on, a call of several parts runs its tasks sorted by
 * their estimated cost, costliest first (with fewer, the parts' order is as
 * good, and sorting would only add to the call's fixed cost) */
#define SDPA_SORTED_LIST_THREADS 8
/* No tiled task takes more than the call's work over this many per thread:
 * the greedy schedule of the work list (costliest parts first) then ends
 * within a few percent of the ideal (python -m sdpa.bench --plan) */
#define SDPA_TASKS_PER_THREAD 4.0

/* ---- the process's thread setting (internal.h) ---- */

static SDPA_ATOMIC(int) threads_setting = 0;

void sdpa_set_threads_setting(int n) { sdpa_atomic_store(&threads_setting, n > 0 ? n : 0); }

int sdpa_threads_setting(void) { return sdpa_atomic_load(&threads_setting); }

/* The threads of a call with num_threads 0, before its work caps them. */
static int default_threads(void) {
    const int n = sdpa_atomic_load(&threads_setting);
    return n > 0 ? n : sdpa_default_num_threads();
}

/* ---- what the test suite may force ---- */

/* Blocking forced by the test suite (sdpa_testing_set_blocking); 0: the rule. */
static SDPA_ATOMIC(int) forced_tile_q = 0, forced_tile_k = 0, forced_chunk = 0;
/* Packing of K/V once per call: 0 the rule, 1 never, 2 whenever the call could. */
static SDPA_ATOMIC(int) forced_packing = 0;
/* The smallest group folded into one query: 0 the rule, n from n, -1 never. */
static SDPA_ATOMIC(int) forced_fold = 0;

void sdpa_testing_set_fold_group(int min_group) { sdpa_atomic_store(&forced_fold, min_group); }

void sdpa_testing_set_packing(int mode) { sdpa_atomic_store(&forced_packing, mode == 1 || mode == 2 ? mode : 0); }

void sdpa_testing_set_blocking(int tile_q, int tile_k, int chunk) {
    sdpa_atomic_store(&forced_tile_q, tile_q > 0 ? tile_q : 0);
    sdpa_atomic_store(&forced_tile_k, tile_k > 0 ? tile_k : 0);
    sdpa_atomic_store(&forced_chunk, chunk > 0 ? chunk : 0);
}

/* ---- one part's plan ---- */

static size_t round_elems(size_t n, size_t elem) {
    size_t per = SDPA_ALIGN / elem;
    return (n + per - 1) / per * per;
}

static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

static double most_keys(const sdpa_problem *p);

/*
 * The blocking, from the cache sizes and the shape (docs/blocking.md):
 *   tile_k  keys per tile, tiled path: as many as have their K and V rows
 *           (tile_k x (E + Ev)) fill half of L2, as every panel of the task
 *           reads them; a multiple of 16 in [32, 512], no more than S rounded
 *           up to one;
 *   tile_q  query rows per task: as many as have their query and accumulator
 *           panels (tile_q x (E + Ev)) fill the other half; a multiple of nr in
 *           [nr, 512], no more than L rounded up to one, and small enough to
 *           give each thread two tasks when the call's heads alone do not
 *           (`units`: the (sequence, head) pairs of the whole call);
 *   tile_k  keys per tile, row mode (decoding): as many as have the scores of
 *           the task's rows (rows x tile_k) fill half of L1, as they pass
 *           through the three steps of a tile there; a power of two in
 *           [128, 1024];
 *   chunk   keys per task in row mode: SDPA_ROW_MODE_CHUNK.
 * tile_k and chunk set the order of the sums of a row, so they depend on the
 * machine and the shape only, never on the thread count; tile_q does not
 * change a bit of the result.
 */
static void choose_blocking(const sdpa_problem *p, double task_flops, size_t elem, size_t kv_elem, plan *pl) {
    int64_t l1, l2;
    sdpa_cache_sizes(&l1, &l2);
    const int64_t E = p->head_dim, Ev = p->head_dim_v, nr = pl->path.nr, el = (int64_t)elem;
    const int64_t width = E + Ev > 0 ? E + Ev : 1;
    int64_t tk, tq = nr;
    if (pl->path.row_mode) {
        const int64_t rows = p->gqa_group * p->len_q > 0 ? p->gqa_group * p->len_q : 1;
        (void)task_flops;
        tk = 128;
        while (tk < 1024 && 2 * tk * rows * el <= l1 / 2) tk *= 2;
    } else {
        tk = clamp64(l2 / 2 / (width * (int64_t)kv_elem) / 16 * 16, 32, 512);
        const int64_t all_keys = (p->len_kv + 15) / 16 * 16;  /* nor for keys */
        if (all_keys < tk) tk = all_keys < 32 ? 32 : all_keys;
        tq = clamp64(l2 / 2 / (width * el) / nr * nr, nr, 512);
        const int64_t R = p->len_q * pl->tiled.pack_g;  /* a unit's rows */
        const int64_t all_rows = (R + nr - 1) / nr * nr;  /* no room for rows that are not there */
        if (all_rows < tq) tq = all_rows < nr ? nr : all_rows;
        /* no task past its share of the call (SDPA_TASKS_PER_THREAD) */
        const double row_flops = 2.0 * (double)width * most_keys(p);  /* the last rows' (causal: the most) */
        if (task_flops > 0 && row_flops > 0 && (double)tq * row_flops > task_flops) {
            const double fit = task_flops / row_flops;
            tq = fit < (double)nr ? nr : (int64_t)fit / nr * nr;
        }
    }
    int64_t chunk = SDPA_ROW_MODE_CHUNK;
    const int fq = sdpa_atomic_load(&forced_tile_q), fk = sdpa_atomic_load(&forced_tile_k);
    const int fc = sdpa_atomic_load(&forced_chunk);
    if (fq) tq = (fq + nr - 1) / nr * nr;
    if (fk) tk = fk;
    if (fc) chunk = fc;
    pl->blocking.tile_q = (int)tq;
    pl->blocking.tile_k = (int)tk;
    pl->blocking.chunk_len = chunk;
}

/* Whether integer_qk applies: int8 or int4 keys with a float32 or 16-bit query. */
static int integer_scores(const sdpa_problem *p) {
    const sdpa_dtype kvdt = kv_dtype_of(p);
    return p->integer_qk && p->dtype != SDPA_FLOAT64 && (kvdt == SDPA_INT8 || kvdt == SDPA_INT4);
}

/* Forced packing of GQA groups into the tiled path's rows (tests): 0 the
 * rule, 1 never, 2 whenever allowed. */
static SDPA_ATOMIC(int) forced_pack_group = 0;
void sdpa_testing_set_pack_group(int mode) { sdpa_atomic_store(&forced_pack_group, mode == 1 || mode == 2 ? mode : 0); }

/* Whether a tiled problem's GQA groups may be packed into its rows: several
 * query heads a key/value head (at most a panel's rows), nothing per head
 * but the rows themselves (no mask or ALiBi; weights are written row by
 * row, so that asking for them changes no path and no bit). */
static int pack_group(const sdpa_problem *p) {
    const int forced = sdpa_atomic_load(&forced_pack_group);
    if (p->gqa_group < 2 || p->gqa_group > SDPA_MAX_PANEL || p->mask_kind != SDPA_MASK_NONE || p->alibi.data ||
        forced == 1)
        return 0;
    return 1;
}

/* Plans one part: p canonical, batch_count its batch, task_flops the most
 * work a tiled task may take (0: any), `staged` whether its output is staged
 * for a merge. */
static void make_plan(const sdpa_problem *p, int64_t batch_count, double task_flops, const kernel_table *kt,
                      int staged, plan *pl) {
    size_t elem = compute_size(p);
    memset(pl, 0, sizeof(*pl));
    pl->path.kv_dtype = kv_dtype_of(p);
    pl->path.out_dtype = staged ? (p->dtype == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32) : p->dtype;
    pl->path.nr = p->dtype != SDPA_FLOAT64 ? kt->f32.nr : kt->f64.nr;
    const size_t E = (size_t)p->head_dim, Ev = (size_t)p->head_dim_v;
    const int64_t rows = p->gqa_group * p->len_q;
    /* bfloat16 pairs on the tiled path (AVX512-BF16) are ahead from L = 16;
     * paged, blocks of an even size (a pair never straddles two blocks) */
    const int bf16_pairs = p->dtype == SDPA_BFLOAT16 && pl->path.kv_dtype == SDPA_BFLOAT16 && kt->bf16_products &&
                           (p->block_size <= 0 || p->block_size % 2 == 0);
    const int64_t max_l = bf16_pairs ? SDPA_ROW_MODE_MAX_L_BF16 : SDPA_ROW_MODE_MAX_L;
    /* a short query whose GQA group packs into the tiled path's rows goes there
     * from SDPA_PACKED_MIN_ROWS rows (decoding, one row a head, stays on the
     * row path; so does integer_qk, which only the row path computes, for
     * decoding rows however many share a head; and bfloat16 pairs, whose
     * products round P, keep their own rule) */
    const int packs = p->len_q >= 2 && !bf16_pairs && pack_group(p) && !integer_scores(p);
    pl->path.row_mode = rows <= SDPA_ROW_MODE_MAX_ROWS ||
                        (p->len_q <= max_l && rows <= SDPA_ROW_MODE_WIDE_ROWS && !(packs && rows >= SDPA_PACKED_MIN_ROWS)) ||
                        (p->len_q == 1 && integer_scores(p));
    /* the tiled path packs a GQA group's heads into the rows of one task where
     * nothing depends on the head but the output (no mask, ALiBi or weights):
     * position-major, a causal panel's diagonal wastes little, and each K and V
     * tile serves the whole group */
    pl->tiled.pack_g = !pl->path.row_mode && pack_group(p) ? p->gqa_group : 1;
    /* quantized tiles are dequantized into float scratch: blocked as float */
    choose_blocking(p, task_flops, elem,
                    sdpa_is_quantized(pl->path.kv_dtype) ? sizeof(float) : sdpa_dtype_size(pl->path.kv_dtype), pl);
    /* bfloat16 pairs: key tiles of whole pairs (a blocking forced by the tests may be odd) */
    if (bf16_pairs && !pl->path.row_mode && pl->blocking.tile_k % 2) pl->blocking.tile_k++;
    size_t off = 0;
    if (pl->path.row_mode) {
        const size_t tk = (size_t)pl->blocking.tile_k, M = (size_t)rows;
        pl->row.rows = (int)rows;
        pl->row.num_groups = batch_count * (p->num_heads / p->gqa_group);
        pl->row.num_chunks = p->len_kv > 0 ? (p->len_kv + pl->blocking.chunk_len - 1) / pl->blocking.chunk_len : 1;
        pl->num_tasks = pl->row.num_groups * pl->row.num_chunks;
        pl->row.partial_elems = round_elems(M * (2 + Ev), elem);
        if (pl->row.num_chunks == 1) {  /* a group's only partial: the thread's, finished by its task */
            pl->scratch.partial = off;
            off += pl->row.partial_elems;
        }
        pl->scratch.q = off; off += round_elems(M * E, elem);
        pl->scratch.s = off; off += round_elems(M * tk, elem);
        pl->scratch.k = off; off += round_elems(tk * E, elem);
        pl->scratch.v = off; off += round_elems(tk * Ev, elem);
        pl->scratch.pp = off; off += round_elems(M * tk, elem);  /* quantized: the scores of one scale group */
        pl->path.integer_qk = integer_scores(p);
        if (pl->path.integer_qk) {  /* int8 rows (M x E), M float scales, then the kernel's work */
            pl->path.dot_qi = sdpa_dot_qi_for(kt);
            pl->scratch.qi = off;
            off += round_elems((M * E + 3 * SDPA_ALIGN) / elem + M + SDPA_QI_WORK_BYTES(M, E) / elem + 1, elem);
        }
    } else {
        const size_t tq = (size_t)pl->blocking.tile_q, tk = (size_t)pl->blocking.tile_k, nr = (size_t)pl->path.nr;
        pl->tiled.num_bh = batch_count * p->num_heads / pl->tiled.pack_g;
        pl->tiled.num_qblocks = (p->len_q * pl->tiled.pack_g + pl->blocking.tile_q - 1) / pl->blocking.tile_q;
        pl->num_tasks = pl->tiled.num_bh * pl->tiled.num_qblocks;
        pl->scratch.q = off;   off += round_elems(tq * E, elem);
        pl->scratch.acc = off; off += round_elems(tq * Ev, elem);
        pl->scratch.s = off;   off += round_elems(tk * nr, elem);
        pl->scratch.m = off;   off += round_elems(tq, elem);
        pl->scratch.l = off;   off += round_elems(tq, elem);
        pl->bf16.on = bf16_pairs;
        /* K and V copied (widened) by tiles or packed per call: not of the compute
         * type, or paged in blocks too short for the products to read in place */
        const int convert = !bf16_pairs && (pl->path.kv_dtype != (p->dtype == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32) ||
                                            (p->block_size > 0 && p->block_size < SDPA_PAGED_MIN_IN_PLACE));
        pl->path.convert_kv = convert;
        pl->bf16.e2p = (int64_t)(E + 1) / 2;
        if (bf16_pairs) {  /* pairs of bfloat16, 32 bits each: the size of a float */
            const size_t E2 = (E + 1) / 2, pairs = (tk + 1) / 2;
            pl->scratch.pp = off; off += round_elems(pairs * nr, elem);
            pl->scratch.vp = off; off += round_elems(pairs * Ev, elem);  /* V pairs of a tile, when not packed */
            pl->scratch.vt = off; off += round_elems(16 * Ev, elem);     /* the last pairs of an odd key count */
            /* K pairs of a tile, when neither in place nor packed: E2 a row, or up
             * to E where the rows are padded to whole blocks (below) */
            pl->scratch.k = off;  off += round_elems(tk * (E > E2 ? E : E2), elem);
            /* the query panels hold E2 pairs, not E floats: within scratch.q's room */
        } else if (convert) {
            pl->scratch.k = off; off += round_elems(tk * E, elem);  /* K and V tiles converted */
            pl->scratch.v = off; off += round_elems(tk * Ev, elem);
        }
        /* K/V packed once per call where a slice is read by two or more tasks
         * (query blocks, query heads of a GQA group) and the buffer stays within
         * SDPA_PACK_BUDGET bytes; else a tile at a time in each task */
        const int64_t reuse = pl->tiled.num_qblocks * p->gqa_group / pl->tiled.pack_g;
        const int packing = sdpa_atomic_load(&forced_packing);
        /* float K and V of short paged blocks are only copied a tile at a time: a
         * copy of the whole slice per call costs more than the copies it saves
         * (a mixed batch's chunks of 256 rows over blocks of 16: 0.85x the
         * contiguous call packed, 1.0x a tile at a time) */
        const int copy_only = convert && pl->path.kv_dtype == (p->dtype == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32);
        if ((bf16_pairs || (convert && (!copy_only || packing == 2))) && (reuse >= 2 || packing == 2) && packing != 1 &&
            p->len_kv > 0) {
            const int64_t S = p->len_kv, slices = batch_count * (p->num_heads / p->gqa_group);
            int64_t e2p = pl->bf16.e2p;
            size_t per;
            if (bf16_pairs) {
                /* K pairs packed too, padded to whole tiles of the product, when
                 * its rows would end in a part tile (copied through a buffer at
                 * every product) and the panels have room for the padding */
                const int64_t blk = kt->f32.bf16.pairs_block > 1 ? kt->f32.bf16.pairs_block : 1;
                e2p = (pl->bf16.e2p + blk - 1) / blk * blk;
                pl->pack.slice_k = e2p != pl->bf16.e2p && e2p <= (int64_t)E ? (size_t)(S * e2p) : 0;
                if (p->block_size > 0 && !pl->pack.slice_k && !paged_pairs_in_place(p)) {
                    if (e2p > (int64_t)E) e2p = pl->bf16.e2p;  /* no room for the padding in the panels */
                    pl->pack.slice_k = (size_t)(S * e2p);      /* paged short blocks: K pairs too */
                }
                /* V: whole tiles of 16 pairs, and an odd number of 64-byte lines a
                 * feature row: a tile's 16 rows at a stride of a multiple of 4 KiB
                 * would fall in one set of L1 */
                pl->bf16.vp_ld = ((S + 1) / 2 + 15) / 16 * 16;
                if (pl->bf16.vp_ld / 16 % 2 == 0) pl->bf16.vp_ld += 16;
                per = pl->pack.slice_k +
                      (kt->f32.bf16.values_by_feature ? (size_t)pl->bf16.vp_ld * Ev : (size_t)((S + 1) / 2) * Ev);
            } else {
                pl->pack.slice_k = (size_t)S * E;
                per = pl->pack.slice_k + (size_t)S * Ev;
            }
            pl->pack.slice_elems = round_elems(per, elem);
            const int fits = (double)pl->pack.slice_elems * (double)slices * (double)elem <= SDPA_PACK_BUDGET;
            if (fits || packing == 2) {
                pl->pack.on = 1;
                if (pl->pack.slice_k) pl->bf16.e2p = e2p;  /* K packed padded to whole blocks */
                pl->pack.buffer_elems = pl->pack.slice_elems * (size_t)slices;
                pl->pack.chunk = SDPA_PACK_CHUNK;
                pl->pack.units = slices * ((S + pl->pack.chunk - 1) / pl->pack.chunk);
            } else {
                pl->pack.slice_k = 0;  /* not packed: K in place or a tile at a time */
            }
        }
    }
    pl->scratch.total = off;
}

/* ---- the canonical call ---- */

/*
 * A bool mask that is the same for every head and query row (a padding mask,
 * (B, 1, 1, S)) and, for each batch index, lets through a prefix of the keys
 * (True ... True False ... False) limits the keys instead: the keys past the
 * prefix are never visited and no mask is applied.  limits[b] (dense over
 * batch_shape) becomes the smaller of the prefix and the key length.  Returns
 * 0 when the mask is not of that shape.
 */
static int padding_limits(const sdpa_problem *p, int64_t batch_count, int64_t *limits) {
    if (p->mask_kind != SDPA_MASK_BOOL || p->mask.row_stride != 0 || p->mask.head_stride != 0) return 0;
    const int64_t S = p->len_kv, cs = p->mask.col_stride;
    for (int64_t b = 0; b < batch_count; b++) {
        const uint8_t *m = (const uint8_t *)p->mask.data + batch_offset_of(p, p->mask.batch_strides, b);
        int64_t prefix = 0;
        while (prefix < S && m[prefix * cs]) prefix++;
        for (int64_t j = prefix + 1; j < S; j++)
            if (m[j * cs]) return 0;
        const int64_t len = key_limit(p, b);
        limits[b] = prefix < len ? prefix : len;
    }
    return 1;
}

/*
 * A single query row per head (decoding) whose GQA group is large (MLA's
 * absorbed decoding: 16-128 query heads over one latent head) reads the same
 * keys for every head of a group: the heads of a group become the rows of one
 * query, so that the tiled path computes them as a block (G rows against each
 * key tile, on AMX tiles where there are) instead of the row path's G dot
 * products a key.  The views are the same memory: a query head's row is the
 * folded query's row.  Done only where every row sees the same keys alike: no
 * mask, weights, window, ALiBi or sinks (per head), and a causal row that sees
 * every key.  Measured against the row path (8,192 keys, 2 threads, E 128):
 * float32 1.0x at G = 8 and 16, 1.6-1.7x at 32 and 64 (1.4x for MLA's E 576);
 * bfloat16 with AMX 1.0x at 8, 2.0x at 16, 3.7-4.1x at 32-128.
 */
static void fold_group(sdpa_problem *q, const kernel_table *kt) {
    const int forced = sdpa_atomic_load(&forced_fold);
    const int pairs = q->dtype == SDPA_BFLOAT16 && kv_dtype_of(q) == SDPA_BFLOAT16 && kt->bf16_products;
    const int64_t rule = pairs ? SDPA_FOLD_MIN_GROUP_BF16 : SDPA_FOLD_MIN_GROUP;
    const int64_t min_group = forced > 0 ? forced : forced < 0 ? INT64_MAX : rule;
    if (q->len_q != 1 || q->gqa_group < min_group || q->mask_kind != SDPA_MASK_NONE || q->weights.data ||
        has_window(q) || q->alibi.data || q->sinks.data || integer_scores(q))  /* integer_qk: the row path */
        return;
    if (q->causal && q->causal_offset < q->len_kv - 1) return;  /* the row's last visible key */
    const int64_t G = q->gqa_group;
    q->causal = 0;
    q->num_heads /= G;
    q->gqa_group = 1;
    q->len_q = G;
    sdpa_view *rows[3] = {&q->query, &q->out, &q->lse};
    for (int i = 0; i < 3; i++) {
        rows[i]->row_stride = rows[i]->head_stride;
        rows[i]->head_stride *= G;
    }
}

/* Row l sees keys s <= l + causal_offset: an offset >= S shows every key, one
 * <= -L none.  Clamped to [-L, S], the driver's sums cannot overflow. */
static void clamp_offsets(sdpa_problem *p) {
    if (p->causal_offset > p->len_kv) p->causal_offset = p->len_kv;
    if (p->causal_offset < -p->len_q) p->causal_offset = -p->len_q;
}

/* ---- the cost model (planner only: the order of the work list, and the
 * balance report) ---- */

/* Nanoseconds on one core: multiply-adds at these rates, the keys' bytes at
 * this bandwidth, and a fixed cost per task (measured on 2-core Xeon and Zen 4
 * VMs: tiled products 90-120 GFLOP/s a core, the row path 40-60, 8-15 GB/s). */
#define COST_TILED_FLOPS_PER_NS 100.0
#define COST_ROW_FLOPS_PER_NS 50.0
#define COST_BYTES_PER_NS 10.0
#define COST_TASK_NS 1500.0

/* Keys a row range [l0, l1) of part p (batch index b) sees at most: all, or
 * up to the last row's causal reach. */
static double visible_keys(const sdpa_problem *p, int64_t b, int64_t l0, int64_t l1) {
    int64_t S = key_limit(p, b), first = 0;
    if (p->causal) {
        const int64_t reach = l1 - 1 + p->causal_offset + 1;
        if (reach < S) S = reach < 0 ? 0 : reach;
    }
    if (has_window(p)) {
        const int64_t we = window_end(p, l1 - 1);
        if (we < S) S = we;
        first = window_first(p, l0);
    }
    return S > first ? (double)(S - first) : 0.0;
}

/* The keys a row of p sees on average (of batch index 0: the parts of a
 * ragged call have one; a batch's lengths are taken as its first's). */
static double row_keys(const sdpa_problem *p) {
    if (p->len_q <= 0) return 0;
    return 0.5 * (visible_keys(p, 0, 0, 1) + visible_keys(p, 0, p->len_q - 1, p->len_q));
}

/* The keys the last row of p sees (of batch index 0), the most a row does. */
static double most_keys(const sdpa_problem *p) {
    return p->len_q > 0 ? visible_keys(p, 0, p->len_q - 1, p->len_q) : 0;
}

/* A part's work: 2 (E + Ev) multiply-adds for every score its rows see. */
static double part_flops(const part *pt) {
    const sdpa_problem *p = &pt->p;
    return 2.0 * (double)(p->head_dim + p->head_dim_v) * (double)pt->batch_count * (double)p->num_heads *
           (double)p->len_q * row_keys(p);
}

static double kv_bytes(const sdpa_problem *p) {
    const sdpa_dtype dt = kv_dtype_of(p);
    return dt == SDPA_INT4 ? 0.5 : (double)sdpa_dtype_size(dt);
}

/* The estimated cost of task t of a part. */
static double task_cost(const part *pt, int64_t t) {
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    const double width = (double)(p->head_dim + p->head_dim_v);
    if (pl->path.row_mode) {
        const int64_t g = t / pl->row.num_chunks, chunk = t % pl->row.num_chunks;
        const int64_t b = g / (p->num_heads / p->gqa_group);
        double keys = visible_keys(p, b, 0, p->len_q) - (double)(chunk * pl->blocking.chunk_len);
        if (keys > (double)pl->blocking.chunk_len) keys = (double)pl->blocking.chunk_len;
        if (keys < 0) keys = 0;
        const double flops = 2.0 * width * keys * (double)pl->row.rows, bytes = width * keys * kv_bytes(p);
        const double ns = flops / COST_ROW_FLOPS_PER_NS, ns_mem = bytes / COST_BYTES_PER_NS;
        return COST_TASK_NS + (ns > ns_mem ? ns : ns_mem);
    }
    const int64_t pg = pl->tiled.pack_g, U = p->gqa_group / pg, per = pl->tiled.num_qblocks;
    const int64_t qb = per - 1 - (t % (per * U)) / U;
    const int64_t b = t / (per * (p->num_heads / pg));
    const int64_t r0 = qb * pl->blocking.tile_q, R = p->len_q * pg;
    const int64_t r1 = r0 + pl->blocking.tile_q < R ? r0 + pl->blocking.tile_q : R;
    const int64_t l0 = r0 / pg, l1 = (r1 - 1) / pg + 1;  /* the task's positions */
    /* rows pay whole panels, against their part of the keys (half, causal) */
    const double panels = (double)((r1 - r0 + pl->path.nr - 1) / pl->path.nr) * pl->path.nr;
    double keys = visible_keys(p, b, l0, l1);
    if (p->causal && keys > 0) {
        const double first = visible_keys(p, b, l0, l0 + 1);
        keys = 0.5 * (keys + first);
    }
    return COST_TASK_NS + 2.0 * width * keys * panels / COST_TILED_FLOPS_PER_NS;
}

double sdpa_plan_item_cost(const call_plan *cp, int64_t i) {
    int64_t t;
    const part *pt = plan_item(cp, i, &t);
    return task_cost(pt, t);
}

/* ---- parts ---- */

/* Keys of sequence b (its positions, paged). */
static int64_t seq_keys(const sdpa_problem *c, int64_t b) {
    if (c->cu_seqlens_k) return c->cu_seqlens_k[b + 1] - c->cu_seqlens_k[b];
    return key_limit(c, b);
}

/* Moves a view's data to (batch index b, row `row`) and makes its batch dims
 * unused (the part has batch 1). */
static void move_view(const sdpa_problem *c, sdpa_view *v, int64_t b, int64_t row, size_t elem) {
    if (!v->data) return;
    const int64_t off = batch_offset_of(c, v->batch_strides, b) + row * v->row_stride;
    v->data = (char *)v->data + off * (int64_t)elem;
    for (int d = 0; d < SDPA_MAX_BATCH_DIMS; d++) v->batch_strides[d] = 0;
}

/*
 * The part of sequence b over its keys [k0, k0 + S): the call's problem with
 * its views at b's rows, one batch index, its own lengths, and positions
 * resolved: row l is position pos0 + l of the sequence (its last L_b positions
 * when paged or counted from the end), key j position k0 + j.  Paged, the keys
 * stay in their blocks, the table from entry k0 / block_size.
 */
static void sequence_part(part *pt, const sdpa_problem *c, int64_t b, int64_t k0, int64_t S) {
    memset(pt, 0, sizeof(*pt));
    sdpa_problem *p = &pt->p;
    *p = *c;
    const size_t qe = sdpa_dtype_size(c->dtype), ce = compute_size(c), ke = sdpa_dtype_size(kv_dtype_of(c));
    const int64_t L = seq_rows(c, b), S_b = seq_keys(c, b);
    const int64_t qb = c->cu_seqlens_q ? 0 : b, qrow = c->cu_seqlens_q ? c->cu_seqlens_q[b] : 0;
    move_view(c, &p->query, qb, qrow, qe);
    move_view(c, &p->out, qb, qrow, qe);
    move_view(c, &p->lse, qb, qrow, ce);
    move_view(c, &p->alibi, b, 0, ce);
    move_view(c, &p->sinks, b, 0, ce);
    if (c->mask_kind != SDPA_MASK_NONE) move_view(c, &p->mask, b, 0, c->mask_kind == SDPA_MASK_BOOL ? 1 : ce);
    if (c->block_size > 0) {
        p->block_table = c->block_table + b * c->block_table_stride + k0 / c->block_size;
        pt->key_length = S;
        p->key_lengths = &pt->key_length;
        for (int d = 0; d < SDPA_MAX_BATCH_DIMS; d++) p->key_lengths_strides[d] = 0;
    } else {
        const int64_t kb = c->cu_seqlens_k ? 0 : b, krow = (c->cu_seqlens_k ? c->cu_seqlens_k[b] : 0) + k0;
        move_view(c, &p->key, kb, krow, ke);
        move_view(c, &p->value, kb, krow, ke);
        move_view(c, &p->key_scale, kb, krow, sizeof(float));
        move_view(c, &p->value_scale, kb, krow, sizeof(float));
        p->key_lengths = NULL;
    }
    p->num_batch_dims = 1;
    p->batch_shape[0] = 1;
    p->len_q = L;
    p->len_kv = S;
    p->cu_seqlens_q = p->cu_seqlens_k = NULL;
    p->offsets_from_end = 0;
    const int64_t from_end = c->block_size > 0 || c->offsets_from_end ? S_b - L : 0;
    p->causal_offset += from_end - k0;
    p->align_offset += from_end - k0;
    clamp_offsets(p);
    pt->batch_count = 1;
    pt->seq = b;
    pt->partial_at = pt->packed_at = pt->query_at = pt->out_at = pt->lse_at = NO_REGION;
    for (int i = 0; i < 4; i++) pt->kv_at[i] = NO_REGION;
}

/* Views of a part's staged rows: out (..., rows, Ev) and lse of the compute
 * type, `heads` heads of `rows` rows, contiguous (placed by the executor). */
static void stage_views(part *pt, int64_t heads, int64_t rows) {
    sdpa_problem *p = &pt->p;
    const int64_t Ev = p->head_dim_v;
    memset(&p->out, 0, sizeof(p->out));
    p->out.head_stride = rows * Ev;
    p->out.row_stride = Ev;
    p->out.col_stride = 1;
    memset(&p->lse, 0, sizeof(p->lse));
    p->lse.head_stride = rows;
    p->lse.row_stride = 1;
    p->lse.col_stride = 1;
    (void)heads;
    pt->staged = 1;
}

/* A growing array in the planner's arena. */
typedef struct grow {
    void *data;
    size_t count, cap, elem;
} grow;

static void *grow_push(grow *g) {
    if (g->count == g->cap) {
        const size_t cap = g->cap ? 2 * g->cap : 16;
        void *d = realloc(g->data, cap * g->elem);
        if (!d) return NULL;
        g->data = d;
        g->cap = cap;
    }
    return (char *)g->data + g->elem * g->count++;
}

/* A node of the shared-prefix tree: the sequences (members) that share the
 * table entries [d0, d1). */
typedef struct share_node {
    int64_t members_at, count, d0, d1;
} share_node;

typedef struct sharing {
    const sdpa_problem *c;
    const int64_t *full;      /* blocks every row of each sequence sees whole */
    int64_t *scratch;         /* sort keys */
    grow nodes;               /* share_node */
    grow members;             /* int64_t */
    int failed;
} sharing;

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int32_t table_entry(const sdpa_problem *c, int64_t b, int64_t j) {
    return c->block_table[b * c->block_table_stride + j];
}

/* The nodes under the sequences `set` (n of them), which share entries [0, d0). */
static void share_tree(sharing *sh, const int64_t *set, int64_t n, int64_t d0) {
    if (n < 2 || sh->failed) return;
    /* the sequences that go on past d0, sorted by (entry d0, index) */
    uint64_t *keys = (uint64_t *)malloc((size_t)n * sizeof(uint64_t));
    int64_t *run = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    if (!keys || !run) {
        free(keys);
        free(run);
        sh->failed = 1;
        return;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (sh->full[set[i]] > d0)
            keys[m++] = ((uint64_t)(uint32_t)table_entry(sh->c, set[i], d0) << 32) | (uint64_t)set[i];
    qsort(keys, (size_t)m, sizeof(uint64_t), cmp_u64);
    for (int64_t i = 0; i < m;) {
        int64_t j = i + 1;
        while (j < m && (keys[j] >> 32) == (keys[i] >> 32)) j++;
        if (j - i >= 2) {
            int64_t cnt = j - i;
            for (int64_t x = 0; x < cnt; x++) run[x] = (int64_t)(keys[i + x] & 0xFFFFFFFFu);
            /* the entries every member of the run shares from d0 on */
            int64_t d1 = d0 + 1;
            for (;; d1++) {
                int same = 1;
                for (int64_t x = 0; x < cnt && same; x++)
                    same = sh->full[run[x]] > d1 && table_entry(sh->c, run[x], d1) == table_entry(sh->c, run[0], d1);
                if (!same) break;
            }
            share_node *node = (share_node *)grow_push(&sh->nodes);
            if (!node) {
                sh->failed = 1;
                break;
            }
            node->members_at = (int64_t)sh->members.count;
            node->count = cnt;
            node->d0 = d0;
            node->d1 = d1;
            for (int64_t x = 0; x < cnt; x++) {
                int64_t *slot = (int64_t *)grow_push(&sh->members);
                if (!slot) {
                    sh->failed = 1;
                    break;
                }
                *slot = run[x];
            }
            share_tree(sh, run, cnt, d1);
        }
        i = j;
    }
    free(keys);
    free(run);
}

/* The row-path or tiled layout of a shared prefix's part: its gathered rows
 * (rows per key/value head) as one GQA group of rows heads, or as the rows of
 * one head. */
static void shared_part(part *pt, const sdpa_problem *c, const share_node *node, int64_t d0, int64_t d1,
                        int64_t rows, const int64_t *members) {
    memset(pt, 0, sizeof(*pt));
    sdpa_problem *p = &pt->p;
    *p = *c;
    const int64_t Hkv = c->num_heads / c->gqa_group, E = c->head_dim;
    const int row_layout = rows <= SDPA_SHARED_ROW_MODE_ROWS || integer_scores(c);  /* integer_qk: the row path */
    memset(&p->query, 0, sizeof(p->query));
    p->query.col_stride = 1;
    if (row_layout) {  /* (1, Hkv * rows, 1, E), gqa rows */
        p->num_heads = Hkv * rows;
        p->gqa_group = rows;
        p->len_q = 1;
        p->query.head_stride = E;
        p->query.row_stride = E;
    } else {  /* (1, Hkv, rows, E) */
        p->num_heads = Hkv;
        p->gqa_group = 1;
        p->len_q = rows;
        p->query.head_stride = rows * E;
        p->query.row_stride = E;
    }
    stage_views(pt, p->num_heads, p->len_q);
    p->num_batch_dims = 1;
    p->batch_shape[0] = 1;
    p->block_table = c->block_table + members[0] * c->block_table_stride + d0;
    p->len_kv = (d1 - d0) * c->block_size;
    pt->key_length = p->len_kv;
    p->key_lengths = &pt->key_length;
    for (int d = 0; d < SDPA_MAX_BATCH_DIMS; d++) p->key_lengths_strides[d] = 0;
    p->causal = 0;
    p->causal_offset = p->align_offset = 0;
    p->mask_kind = SDPA_MASK_NONE;
    memset(&p->mask, 0, sizeof(p->mask));
    memset(&p->alibi, 0, sizeof(p->alibi));
    memset(&p->sinks, 0, sizeof(p->sinks));
    p->window_left = p->window_right = -1;
    p->cu_seqlens_q = p->cu_seqlens_k = NULL;
    p->offsets_from_end = 0;
    pt->batch_count = 1;
    pt->seq = -1;
    pt->rows_total = rows;
    pt->num_members = node->count;
    pt->members_at = node->members_at;
    pt->partial_at = pt->packed_at = pt->query_at = pt->out_at = pt->lse_at = NO_REGION;
    for (int i = 0; i < 4; i++) pt->kv_at[i] = NO_REGION;
}

/* The part of sequence b's last L positions under a tree mask: over a copy of
 * their keys and values (dense), the mask's rows and columns. */
static void tree_part(part *pt, const sdpa_problem *c, int64_t b) {
    const int64_t L = seq_rows(c, b), S_b = seq_keys(c, b);
    sequence_part(pt, c, b, S_b - L, L);
    sdpa_problem *p = &pt->p;
    const int64_t E = c->head_dim, Ev = c->head_dim_v;
    const sdpa_dtype kvdt = kv_dtype_of(c);
    const int64_t w = kvdt == SDPA_INT4 ? 2 : 1;  /* int4: strides count bytes */
    p->block_size = 0;
    p->block_table = NULL;
    p->key_lengths = NULL;
    p->num_blocks = 0;
    p->block_table_stride = 0;
    const int64_t cols[4] = {E / w, Ev / w, 0, 0};
    sdpa_view *views[4] = {&p->key, &p->value, &p->key_scale, &p->value_scale};
    const int64_t G = c->kv_group_size;
    const int64_t sc[2] = {G ? E / G : 1, G ? Ev / G : 1};
    for (int i = 0; i < 4; i++) {
        if (i >= 2 && !views[i]->data) continue;
        const int64_t n = i < 2 ? cols[i] : sc[i - 2];
        memset(views[i]->batch_strides, 0, sizeof(views[i]->batch_strides));
        views[i]->head_stride = L * n;
        views[i]->row_stride = n;
        views[i]->col_stride = 1;
        views[i]->data = NULL;  /* the copy, placed by the executor */
    }
    pt->copy_row0 = S_b - L;
    pt->copies_kv = 1;
}

/* ---- the call ---- */

/* n elements of `elem` bytes from *cur, aligned to SDPA_ALIGN. */
static void *carve(char **cur, size_t n, size_t elem) {
    char *at = (char *)(((uintptr_t)*cur + SDPA_ALIGN - 1) & ~(uintptr_t)(SDPA_ALIGN - 1));
    *cur = at + n * elem;
    return at;
}

typedef struct ranked {
    double cost;
    int32_t index;
} ranked;

static int by_cost(const void *a, const void *b) {
    const ranked *x = (const ranked *)a, *y = (const ranked *)b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static void order_and_count(call_plan *cp) {
    /* parts by the cost of their largest task, costliest first */
    if (cp->num_parts > 1) {
        ranked *r = (ranked *)malloc((size_t)cp->num_parts * sizeof(ranked));
        if (r) {
            for (int32_t i = 0; i < cp->num_parts; i++) r[i] = (ranked){cp->parts[i].task_cost, i};
            qsort(r, (size_t)cp->num_parts, sizeof(ranked), by_cost);
            for (int32_t i = 0; i < cp->num_parts; i++) cp->order[i] = r[i].index;
            free(r);
        }  /* else in the order made: the same results */
    }
    cp->item_start[0] = cp->unit_start[0] = cp->rmerge_start[0] = 0;
    for (int32_t k = 0; k < cp->num_parts; k++) {
        const plan *pl = &cp->parts[cp->order[k]].pl;
        cp->item_start[k + 1] = cp->item_start[k] + pl->num_tasks;
        cp->unit_start[k + 1] = cp->unit_start[k] + (pl->pack.on ? pl->pack.units : 0);
        cp->rmerge_start[k + 1] =
            cp->rmerge_start[k] + (pl->path.row_mode && pl->row.num_chunks > 1 ? pl->row.num_groups : 0);
    }
}

/* The work list sorted by the tasks' estimated costs, costliest first
 * (counting sort into buckets of an eighth of an octave; ties in the parts'
 * order); left as it is when memory is short (the same results). */
static void sort_items(call_plan *cp) {
    enum { BUCKETS = 8 * 64 };
    const int64_t n = cp->item_start[cp->num_parts];
    work_item *items = (work_item *)malloc((size_t)(n > 0 ? n : 1) * sizeof(work_item));
    uint16_t *key = (uint16_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    int64_t *start = (int64_t *)calloc(BUCKETS + 1, sizeof(int64_t));
    if (!items || !key || !start) {
        free(items);
        free(key);
        free(start);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t t;
        const part *pt = plan_item(cp, i, &t);
        const double c = task_cost(pt, t);  /* at least COST_TASK_NS: a positive log */
        int k = (int)(8.0 * log2(c > 1 ? c : 1));
        k = k < 0 ? 0 : k >= BUCKETS ? BUCKETS - 1 : k;
        key[i] = (uint16_t)(BUCKETS - 1 - k);  /* costliest first */
        start[key[i] + 1]++;
    }
    for (int b = 0; b < BUCKETS; b++) start[b + 1] += start[b];
    for (int64_t i = 0; i < n; i++) {
        int64_t t;
        const part *pt = plan_item(cp, i, &t);
        items[start[key[i]]++] = (work_item){(int32_t)(pt - cp->parts), t};
    }
    free(key);
    free(start);
    cp->items = items;
}

static size_t take(size_t *at, size_t bytes) {
    const size_t here = *at;
    *at += (bytes + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN;
    return here;
}

/* The regions of the call's block, the threads, and the costs. */
static void finish(call_plan *cp, const kernel_table *kt, int threads_asked) {
    const sdpa_problem *c = cp->call;
    const size_t ce = compute_size(c);
    size_t at = 0, scratch = 0;
    double flops = 0;
    int64_t units = 0;
    for (int32_t i = 0; i < cp->num_parts; i++) {
        part *pt = &cp->parts[i];
        const plan *pl = &pt->pl;
        if (pl->scratch.total > scratch) scratch = pl->scratch.total;
        if (pl->path.row_mode && pl->row.num_chunks > 1)  /* merged after every chunk is done */
            pt->partial_at = take(&at, (size_t)pl->num_tasks * pl->row.partial_elems * ce);
        if (pl->bf16.on) cp->bf16 = 1;
        double worst = 0;
        if (pl->path.row_mode) {
            for (int64_t t = 0; t < pl->row.num_chunks && t < pl->num_tasks; t++) {
                const double x = task_cost(pt, t);
                if (x > worst) worst = x;
            }
        } else if (pl->num_tasks > 0) {
            worst = task_cost(pt, 0);  /* the last query block of the first head: the longest */
        }
        pt->task_cost = worst;
        const sdpa_problem *p = &pt->p;
        flops += 2.0 * (double)pt->batch_count * (double)p->num_heads * (double)p->len_q * (double)p->len_kv *
                 (double)(p->head_dim + p->head_dim_v);
        units += pl->num_tasks;
    }
    for (int32_t i = 0; i < cp->num_parts; i++) {  /* gathered and staged rows */
        part *pt = &cp->parts[i];
        const sdpa_problem *p = &pt->p;
        const int64_t Hkv = p->num_heads / p->gqa_group;
        if (pt->num_members)
            pt->query_at = take(&at, (size_t)(Hkv * pt->rows_total * p->head_dim) * sdpa_dtype_size(p->dtype));
        if (pt->staged) {
            pt->out_at = take(&at, (size_t)(p->num_heads * p->len_q * p->head_dim_v) * ce);
            pt->lse_at = take(&at, (size_t)(p->num_heads * p->len_q) * ce);
        }
        if (pt->copies_kv) {
            const sdpa_dtype kvdt = kv_dtype_of(p);
            const int64_t w = kvdt == SDPA_INT4 ? 2 : 1;
            const int64_t rows = Hkv * p->len_kv;
            pt->kv_at[0] = take(&at, (size_t)(rows * p->head_dim / w) * sdpa_dtype_size(kvdt));
            pt->kv_at[1] = take(&at, (size_t)(rows * p->head_dim_v / w) * sdpa_dtype_size(kvdt));
            const int64_t G = p->kv_group_size;
            if (p->key_scale.head_stride)
                pt->kv_at[2] = take(&at, (size_t)(rows * (G ? p->head_dim / G : 1)) * sizeof(float));
            if (p->value_scale.head_stride)
                pt->kv_at[3] = take(&at, (size_t)(rows * (G ? p->head_dim_v / G : 1)) * sizeof(float));
        }
    }
    const size_t packed_from = at;  /* last: dropped when memory is short */
    for (int32_t i = 0; i < cp->num_parts; i++) {
        part *pt = &cp->parts[i];
        if (pt->pl.pack.on) pt->packed_at = take(&at, pt->pl.pack.buffer_elems * ce);
    }
    cp->packed_bytes = at - packed_from;
    cp->merge_bytes = cp->num_merges ? (size_t)(c->head_dim_v + 8) * sizeof(double) : 0;
    cp->scratch_elems = scratch;
    cp->block_bytes = at;
    order_and_count(cp);

    int nthreads = threads_asked ? threads_asked : c->num_threads;
    if (nthreads == 0) nthreads = default_threads();
    if (!threads_asked && nthreads > sdpa_max_threads()) nthreads = sdpa_max_threads();
    if (nthreads < 1) nthreads = 1;
    if ((int64_t)nthreads > units) nthreads = (int)(units > 0 ? units : 1);
    /* waking a thread costs tens of microseconds: by default give each at least
     * SDPA_MIN_FLOPS_PER_THREAD of work (results do not depend on the count); an
     * explicit thread count is taken as asked */
    const double by_work = flops / SDPA_MIN_FLOPS_PER_THREAD;
    if (c->num_threads == 0 && !threads_asked && by_work < (double)nthreads) nthreads = by_work < 1 ? 1 : (int)by_work;
#ifndef _OPENMP
    if (!threads_asked) nthreads = 1;
#endif
    if (!threads_asked && sdpa_forked_after_openmp()) nthreads = 1;
    cp->num_threads = nthreads;
    if (nthreads >= SDPA_SORTED_LIST_THREADS && cp->num_parts > 1) sort_items(cp);
    (void)kt;
}

/* Whether sequence b's keys are read in parts merged afterwards. */
static int is_split(const int64_t *path_len, const sdpa_problem *c, int64_t b) {
    return path_len[b] > 0 || (c->mask_kind == SDPA_MASK_BOOL && c->block_size > 0);
}

sdpa_status sdpa_plan_call(const sdpa_problem *user, int64_t batch_count, const kernel_table *kt, int threads,
                           call_plan *cp) {
    memset(cp, 0, sizeof(*cp));
    const int profile = sdpa_profile_on();
    cp->profile = profile;
    const int sim_threads = threads > 0 ? threads : 0;
    const int plan_threads = threads > 0 ? threads
                                         : (user->num_threads > 0 ? user->num_threads : default_threads());
    sdpa_problem *c = (sdpa_problem *)malloc(sizeof(sdpa_problem) + (size_t)batch_count * sizeof(int64_t));
    if (!c) return SDPA_ERR_NO_MEMORY;
    *c = *user;
    cp->call = c;
    cp->arena = c;
    const int ragged = c->cu_seqlens_q || c->cu_seqlens_k;
    const int paged = c->block_size > 0;

    if (!ragged && !paged) {  /* one part: the whole batch */
        clamp_offsets(c);
        int64_t *limits = (int64_t *)(c + 1);
        if (c->mask_kind == SDPA_MASK_BOOL && c->mask.row_stride == 0 && c->mask.head_stride == 0 && c->len_kv > 0 &&
            padding_limits(c, batch_count, limits)) {
            c->mask_kind = SDPA_MASK_NONE;
            c->key_lengths = limits;
            int64_t stride = 1;
            for (int d = c->num_batch_dims - 1; d >= 0; d--) {
                c->key_lengths_strides[d] = stride;
                stride *= c->batch_shape[d];
            }
        }
        fold_group(c, kt);
        part *pt = &cp->single;
        pt->p = *c;
        pt->batch_count = batch_count;
        pt->seq = -1;
        pt->partial_at = pt->packed_at = pt->query_at = pt->out_at = pt->lse_at = NO_REGION;
        for (int i = 0; i < 4; i++) pt->kv_at[i] = NO_REGION;
        make_plan(&pt->p, batch_count, part_flops(pt) / (SDPA_TASKS_PER_THREAD * plan_threads), kt, 0, &pt->pl);
        cp->parts = pt;
        cp->num_parts = 1;
        cp->order = &cp->single_order;
        cp->item_start = cp->single_starts;
        cp->unit_start = cp->single_starts + 2;
        cp->rmerge_start = cp->single_starts + 4;
        finish(cp, kt, sim_threads);
        return SDPA_OK;
    }

    /* one sequence at a time: shared prefixes first, then each sequence's own keys.
     * Offsets beyond every sequence's lengths are the same as these bounds */
    const int64_t reach = c->len_q + c->len_kv;
    if (c->causal_offset > reach) c->causal_offset = reach;
    if (c->causal_offset < -reach) c->causal_offset = -reach;
    if (!has_window(c) && !c->alibi.data) c->align_offset = 0;  /* not used */
    const int64_t B = batch_count;
    const int tree = paged && c->mask_kind == SDPA_MASK_BOOL;
    int64_t *full = (int64_t *)calloc((size_t)(B > 0 ? B : 1), 3 * sizeof(int64_t));
    if (!full) return SDPA_ERR_NO_MEMORY;
    int64_t *path_len = full + B, *leaf_from = full + 2 * B;  /* shared nodes above each sequence; its own first key */
    sharing sh = {c, full, NULL, {NULL, 0, 0, sizeof(share_node)}, {NULL, 0, 0, sizeof(int64_t)}, 0};
    const int may_share = paged && B > 1 && !has_window(c) && !c->alibi.data;
    if (may_share) {
        int64_t *all = (int64_t *)malloc((size_t)B * sizeof(int64_t));
        if (!all) {
            free(full);
            return SDPA_ERR_NO_MEMORY;
        }
        for (int64_t b = 0; b < B; b++) {
            const int64_t L = seq_rows(c, b), S_b = seq_keys(c, b);
            int64_t seen = tree ? S_b - L : S_b;  /* keys every row of b sees */
            if (c->causal && !tree) {
                const int64_t first_row = S_b - L + c->causal_offset + 1;  /* row 0's reach */
                if (first_row < seen) seen = first_row < 0 ? 0 : first_row;
            }
            full[b] = L > 0 ? seen / c->block_size : 0;
            all[b] = b;
        }
        share_tree(&sh, all, B, 0);
        free(all);
        if (sh.failed) {
            free(sh.nodes.data);
            free(sh.members.data);
            free(full);
            return SDPA_ERR_NO_MEMORY;
        }
    }
    const share_node *nodes = (const share_node *)sh.nodes.data;
    const int64_t *mem = (const int64_t *)sh.members.data;
    const int64_t num_nodes = (int64_t)sh.nodes.count;
    /* each sequence's depth of sharing, and where its own keys start */
    for (int64_t i = 0; i < num_nodes; i++)
        for (int64_t x = 0; x < nodes[i].count; x++) {
            const int64_t b = mem[nodes[i].members_at + x];
            path_len[b]++;
            if (nodes[i].d1 * c->block_size > leaf_from[b]) leaf_from[b] = nodes[i].d1 * c->block_size;
        }

    /* the parts: each shared node (in parts of at most SDPA_SHARED_PART_KEYS
     * keys), each sequence's own keys, each tree */
    int64_t num_parts = 0, num_contrib = 0, num_merges = 0;
    const int64_t bs = paged ? c->block_size : 1;
    const int64_t node_step = paged ? (SDPA_SHARED_PART_KEYS / bs > 0 ? SDPA_SHARED_PART_KEYS / bs : 1) : 1;
    int64_t *node_parts = (int64_t *)calloc((size_t)(num_nodes > 0 ? num_nodes : 1), sizeof(int64_t));
    if (!node_parts) {
        free(sh.nodes.data);
        free(sh.members.data);
        free(full);
        return SDPA_ERR_NO_MEMORY;
    }
    for (int64_t i = 0; i < num_nodes; i++) {
        node_parts[i] = (nodes[i].d1 - nodes[i].d0 + node_step - 1) / node_step;
        num_parts += node_parts[i];
        num_contrib += node_parts[i] * nodes[i].count;
    }
    for (int64_t b = 0; b < B; b++) {
        if (seq_rows(c, b) == 0) continue;
        num_parts += 1 + (tree != 0);
        if (is_split(path_len, c, b)) {
            num_merges++;
            num_contrib += 1 + (tree != 0);
        }
    }
    int64_t Hkv = c->num_heads / c->gqa_group;
    /* the arena: parts, order and prefix sums, merges and contributions, members, copies */
    const size_t bytes = (size_t)num_parts * sizeof(part) + (size_t)num_parts * sizeof(int32_t) +
                         3 * (size_t)(num_parts + 1) * sizeof(int64_t) + (size_t)num_merges * sizeof(merge_group) +
                         (size_t)num_contrib * sizeof(contribution) + sh.members.count * sizeof(int64_t) +
                         (size_t)num_parts * (size_t)Hkv * sizeof(copy_job) + 8 * SDPA_ALIGN;
    char *arena = (char *)realloc(c, sizeof(sdpa_problem) + bytes);
    if (!arena) {
        free(node_parts);
        free(sh.nodes.data);
        free(sh.members.data);
        free(full);
        return SDPA_ERR_NO_MEMORY;
    }
    c = (sdpa_problem *)arena;
    cp->call = c;
    cp->arena = arena;
    sh.c = c;
    char *cur = arena + sizeof(sdpa_problem);
    cp->parts = (part *)carve(&cur, (size_t)num_parts, sizeof(part));
    cp->order = (int32_t *)carve(&cur, (size_t)num_parts, sizeof(int32_t));
    cp->item_start = (int64_t *)carve(&cur, (size_t)num_parts + 1, sizeof(int64_t));
    cp->unit_start = (int64_t *)carve(&cur, (size_t)num_parts + 1, sizeof(int64_t));
    cp->rmerge_start = (int64_t *)carve(&cur, (size_t)num_parts + 1, sizeof(int64_t));
    cp->merges = (merge_group *)carve(&cur, (size_t)num_merges, sizeof(merge_group));
    cp->contributions = (contribution *)carve(&cur, (size_t)num_contrib, sizeof(contribution));
    cp->members = (int64_t *)carve(&cur, sh.members.count, sizeof(int64_t));
    cp->copies = (copy_job *)carve(&cur, (size_t)(num_parts * Hkv), sizeof(copy_job));
    if (sh.members.count) memcpy(cp->members, mem, sh.members.count * sizeof(int64_t));

    const int64_t G = c->gqa_group;
    int32_t np = 0;
    int64_t nc = 0, ncopy = 0;
    /* where each shared node's first part and row offsets are: parts of a node
     * are consecutive from node_first[i] */
    int64_t *node_first = node_parts;  /* reused: the first part of node i */
    for (int64_t i = 0; i < num_nodes; i++) {
        const int64_t count = node_parts[i];
        node_first[i] = np;
        int64_t rows = 0;
        for (int64_t x = 0; x < nodes[i].count; x++) rows += G * seq_rows(c, mem[nodes[i].members_at + x]);
        for (int64_t k = 0; k < count; k++) {
            const int64_t d0 = nodes[i].d0 + k * node_step;
            const int64_t d1 = d0 + node_step < nodes[i].d1 ? d0 + node_step : nodes[i].d1;
            part *pt = &cp->parts[np];
            shared_part(pt, c, &nodes[i], d0, d1, rows, cp->members + nodes[i].members_at);
            pt->members_at = nodes[i].members_at;
            for (int64_t h = 0; h < Hkv; h++) cp->copies[ncopy++] = (copy_job){np, COPY_QUERY, h};
            np++;
        }
    }
    /* each sequence: its merge group (shared nodes in depth order, its own keys,
     * its tree), its parts */
    int64_t ng = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_rows(c, b);
        if (L == 0) continue;
        const int64_t S_b = seq_keys(c, b);
        const int split = is_split(path_len, c, b);
        merge_group *mg = split ? &cp->merges[ng++] : NULL;
        if (mg) {
            mg->seq = b;
            mg->first = nc;
        }
        /* the shared nodes above b, outermost first (nodes were made parent first) */
        for (int64_t i = 0; i < num_nodes && mg; i++) {
            int64_t off = 0, x = 0;
            for (; x < nodes[i].count && mem[nodes[i].members_at + x] != b; x++)
                off += G * seq_rows(c, mem[nodes[i].members_at + x]);
            if (x == nodes[i].count) continue;
            const part *first = &cp->parts[node_first[i]];
            for (int64_t k = 0; k < (nodes[i].d1 - nodes[i].d0 + node_step - 1) / node_step; k++)
                cp->contributions[nc++] = (contribution){(int32_t)(node_first[i] + k), first->rows_total, off};
        }
        /* b's own keys: from its last shared block (paged), up to the tree's */
        const int64_t k0 = leaf_from[b], own_end = tree ? S_b - L : S_b;
        part *pt = &cp->parts[np];
        sequence_part(pt, c, b, k0, own_end - k0);
        if (tree) {  /* the positions before the tree: all seen */
            pt->p.causal = 0;
            pt->p.mask_kind = SDPA_MASK_NONE;
            memset(&pt->p.mask, 0, sizeof(pt->p.mask));
            memset(&pt->p.sinks, 0, sizeof(pt->p.sinks));  /* the tree's part adds them */
        }
        if (!split) {
            fold_group(&pt->p, kt);
        } else {
            stage_views(pt, c->num_heads, L);
            cp->contributions[nc++] = (contribution){np, G * L, 0};
        }
        np++;
        if (tree) {
            part *tp = &cp->parts[np];
            tree_part(tp, c, b);
            stage_views(tp, c->num_heads, L);
            tp->p.causal = 0;
            cp->contributions[nc++] = (contribution){np, G * L, 0};
            for (int64_t h = 0; h < Hkv; h++) cp->copies[ncopy++] = (copy_job){np, COPY_KV, h};
            np++;
        }
        if (mg) mg->count = nc - mg->first;
    }
    /* each part planned with its share of the call's work as the most a task takes */
    double total = 0;
    for (int32_t i = 0; i < np; i++) total += part_flops(&cp->parts[i]);
    for (int32_t i = 0; i < np; i++)
        make_plan(&cp->parts[i].p, 1, total / (SDPA_TASKS_PER_THREAD * plan_threads), kt, cp->parts[i].staged, &cp->parts[i].pl);
    cp->num_parts = np;
    cp->num_merges = ng;
    cp->num_copies = ncopy;
    for (int32_t i = 0; i < np; i++) cp->order[i] = i;
    free(node_parts);
    free(sh.nodes.data);
    free(sh.members.data);
    free(full);
    finish(cp, kt, sim_threads);
    return SDPA_OK;
}

void sdpa_plan_free(call_plan *cp) {
    free(cp->items);
    cp->items = NULL;
    free(cp->arena);
    cp->arena = NULL;
}

sdpa_status sdpa_testing_plan(const sdpa_problem *p, int threads, sdpa_part_info *parts, int64_t max_parts,
                              int64_t *num_parts, double *costs, int64_t max_items, int64_t *num_items,
                              int *num_threads, int64_t *num_merges) {
    if (!p) return SDPA_ERR_NULL_POINTER;
    if (p->struct_size != sizeof(*p)) return SDPA_ERR_ABI;
    int64_t batch_count = 0;
    sdpa_status st = sdpa_validate(p, &batch_count);
    if (st != SDPA_OK) return st;
    *num_parts = *num_items = *num_merges = 0;
    *num_threads = 0;
    if (batch_count * p->num_heads * p->len_q == 0) return SDPA_OK;
    const kernel_table *kt = sdpa_kernel_table();
    if (!kt) return SDPA_ERR_BAD_ISA;
    call_plan cp;
    st = sdpa_plan_call(p, batch_count, kt, threads, &cp);
    if (st != SDPA_OK) return st;
    for (int32_t k = 0; k < cp.num_parts && k < max_parts; k++) {
        const part *pt = &cp.parts[cp.order[k]];
        const sdpa_problem *q = &pt->p;
        parts[k] = (sdpa_part_info){pt->seq, pt->num_members, q->num_heads, q->len_q, q->len_kv, pt->pl.num_tasks,
                                    pt->pl.path.row_mode, pt->staged, pt->copies_kv, pt->pl.pack.on, pt->task_cost};
    }
    const int64_t items = cp.item_start[cp.num_parts];
    for (int64_t i = 0; i < items && i < max_items; i++) costs[i] = sdpa_plan_item_cost(&cp, i);
    *num_parts = cp.num_parts;
    *num_items = items;
    *num_threads = cp.num_threads;
    *num_merges = cp.num_merges;
    sdpa_plan_free(&cp);
    return SDPA_OK;
}
