/* The rules of one part's plan (planner.c builds the parts): its path, its
 * blocking and the regions of its scratch (make_plan), the canonical forms a
 * problem is put in first (padding masks as key lengths, large decoding groups
 * folded into rows), the process's thread setting, the test suite's forced
 * choices, and the cost model that orders the work list. */
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

/* ---- the process's thread setting (internal.h) ---- */

static SDPA_ATOMIC(int) threads_setting = 0;

void sdpa_set_threads_setting(int n) { sdpa_atomic_store(&threads_setting, n > 0 ? n : 0); }

int sdpa_threads_setting(void) { return sdpa_atomic_load(&threads_setting); }

/* The threads of a call with num_threads 0, before its work caps them. */
int sdpa_call_default_threads(void) {
    const int n = sdpa_atomic_load(&threads_setting);
    return n > 0 ? n : sdpa_default_num_threads();
}

int sdpa_threads_for(int num_threads, int forced, int64_t units, double work) {
    int n = forced ? forced : num_threads;
    if (n == 0) n = sdpa_call_default_threads();
    if (!forced && n > sdpa_max_threads()) n = sdpa_max_threads();
    if (n > SDPA_MAX_THREADS) n = SDPA_MAX_THREADS;
    if (n < 1) n = 1;
    if ((int64_t)n > units) n = (int)(units > 0 ? units : 1);
    /* starting and joining threads costs microseconds: by default give each at
     * least SDPA_MIN_WORK_PER_THREAD of work (results do not depend on the
     * count); an explicit count is taken as asked */
    const double by_work = work / SDPA_MIN_WORK_PER_THREAD;
    if (num_threads == 0 && !forced && by_work < (double)n) n = by_work < 1 ? 1 : (int)by_work;
#ifndef _OPENMP
    if (!forced) n = 1;
#endif
    if (!forced && sdpa_forked_after_openmp()) n = 1;
    return n;
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
    sdpa_atomic_store(&forced_tile_q, tile_q > 0 && tile_q <= SDPA_TESTING_MAX_TILE ? tile_q : 0);
    sdpa_atomic_store(&forced_tile_k, tile_k > 0 && tile_k <= SDPA_TESTING_MAX_TILE ? tile_k : 0);
    sdpa_atomic_store(&forced_chunk, chunk > 0 && chunk <= SDPA_TESTING_MAX_CHUNK ? chunk : 0);
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
int sdpa_integer_scores(const sdpa_problem *p) {
    const sdpa_dtype kvdt = kv_dtype_of(p);
    return p->integer_qk && p->dtype != SDPA_FLOAT64 && (kvdt == SDPA_INT8 || kvdt == SDPA_INT4);
}

/* Whether integer_pv applies: int8 or int4 values with a float32 or 16-bit query. */
int sdpa_integer_values(const sdpa_problem *p) {
    const sdpa_dtype kvdt = kv_dtype_of(p);
    return p->integer_pv && p->dtype != SDPA_FLOAT64 && (kvdt == SDPA_INT8 || kvdt == SDPA_INT4);
}

/* Whether a product in integers is asked for: only the row path computes them. */
int sdpa_integer_rows(const sdpa_problem *p) { return sdpa_integer_scores(p) || sdpa_integer_values(p); }

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
        p->block_states.data || forced == 1)
        return 0;
    return 1;
}

/* Plans one part: p canonical, batch_count its batch, task_flops the most
 * work a tiled task may take (0: any), `staged` whether its output is staged
 * for a merge. */
void sdpa_make_plan(const sdpa_problem *p, int64_t batch_count, double task_flops, const kernel_table *kt,
                      int staged, plan *pl) {
    size_t elem = compute_size(p);
    memset(pl, 0, sizeof(*pl));
    pl->path.kv_dtype = kv_dtype_of(p);
    pl->path.out_dtype = staged ? (p->dtype == SDPA_FLOAT64 ? SDPA_FLOAT64 : SDPA_FLOAT32) : p->dtype;
    pl->path.nr = p->dtype != SDPA_FLOAT64 ? kt->f32.nr : kt->f64.nr;
    pl->path.nr_half = p->dtype != SDPA_FLOAT64 ? (kt->f32.half ? kt->f32.half->nr : kt->f32.nr)
                                                : (kt->f64.half ? kt->f64.half->nr : kt->f64.nr);
    pl->path.nr_quarter = p->dtype != SDPA_FLOAT64 && kt->f32.half && kt->f32.half->half ? kt->f32.half->half->nr
                                                                                          : pl->path.nr_half;
    const size_t E = (size_t)p->head_dim, Ev = (size_t)p->head_dim_v;
    const int64_t rows = p->gqa_group * p->len_q;
    /* bfloat16 pairs on the tiled path (AVX512-BF16) are ahead from L = 16;
     * paged blocks of any size (kv_impl.h packs a pair of values that
     * straddles two blocks from its rows) */
    const int bf16_pairs = p->dtype == SDPA_BFLOAT16 && pl->path.kv_dtype == SDPA_BFLOAT16 && kt->bf16_products;
    const int64_t max_l = bf16_pairs ? SDPA_ROW_MODE_MAX_L_BF16 : SDPA_ROW_MODE_MAX_L;
    /* a short query whose GQA group packs into the tiled path's rows goes there
     * from SDPA_PACKED_MIN_ROWS rows (decoding, one row a head, stays on the
     * row path; so does integer_qk, which only the row path computes, for
     * decoding rows however many share a head, and integer_pv; and bfloat16 pairs, whose
     * products round P, keep their own rule) */
    const int packs = p->len_q >= 2 && !bf16_pairs && pack_group(p) && !sdpa_integer_rows(p);
    pl->path.row_mode = rows <= SDPA_ROW_MODE_MAX_ROWS ||
                        (p->len_q <= max_l && rows <= SDPA_ROW_MODE_WIDE_ROWS && !(packs && rows >= SDPA_PACKED_MIN_ROWS)) ||
                        (p->len_q == 1 && sdpa_integer_rows(p));
    if (p->block_states.data) pl->path.row_mode = 0;  /* a block map is read by query blocks: tiled */
    if (p->key_scores.data) pl->path.row_mode = 1;    /* the row path keeps the p of key scores */
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
        /* key scores: with groups enough to share among threads and their p in
         * half of L2, a group's keys are one task, which keeps its p in the
         * thread's scratch and reduces them once its rows are finished: no
         * trip through memory (decoding 32 heads over 32,768 keys: 4-6% added
         * with the p kept for the call, in memory) */
        if (p->key_scores.data && pl->row.num_groups >= SDPA_KEY_SCORE_GROUPS) {
            int64_t l1, l2;
            sdpa_cache_sizes(&l1, &l2);
            pl->row.ks_local = (double)M * (double)p->len_kv * (double)elem <= (double)l2 / 2;
        }
        if (pl->row.ks_local) pl->blocking.chunk_len = p->len_kv > 0 ? p->len_kv : 1;
        pl->row.num_chunks = p->len_kv > 0 ? (p->len_kv + pl->blocking.chunk_len - 1) / pl->blocking.chunk_len : 1;
        pl->num_tasks = pl->row.num_groups * pl->row.num_chunks;
        pl->row.partial_elems = round_elems(M * (2 + Ev), elem);
        if (pl->row.num_chunks == 1) {  /* a group's only partial: the thread's, finished by its task */
            pl->scratch.partial = off;
            off += pl->row.partial_elems;
        }
        if (pl->row.ks_local) {  /* the keys' range (64 bytes), each tile's row maxima, the p of every key */
            pl->scratch.ks = off;
            off += round_elems(SDPA_ALIGN / elem + (size_t)key_score_tiles(pl) * M + M * (size_t)p->len_kv, elem);
        }
        pl->scratch.q = off; off += round_elems(M * E, elem);
        pl->scratch.s = off; off += round_elems(M * tk, elem);
        pl->scratch.k = off; off += round_elems(tk * E, elem);
        pl->scratch.v = off; off += round_elems(tk * Ev, elem);
        pl->scratch.pp = off; off += round_elems(M * tk, elem);  /* quantized: the scores of one scale group */
        /* rows gathered from short blocks: a tile's scales (a group's, or one a
         * row), then its rows of the cache's dtype from the next 64 bytes */
        const sdpa_dtype kvdt = pl->path.kv_dtype;
        const size_t kb = kvdt == SDPA_INT4 ? 1 : sdpa_dtype_size(kvdt), kw = kvdt == SDPA_INT4 ? 2 : 1;
        pl->row.gather = paged_rows_gathered(p, (int64_t)(E / kw * kb));
        if (pl->row.gather) {
            const size_t gs = (size_t)(p->kv_group_size > 0 ? p->kv_group_size : 0);
            const size_t nk = gs ? E / gs : 1, nv = gs ? Ev / gs : 1;
            pl->scratch.gk = off; off += round_elems((tk * (E / kw * kb + nk * sizeof(float)) + 64) / elem + 1, elem);
            pl->scratch.gv = off; off += round_elems((tk * (Ev / kw * kb + nv * sizeof(float)) + 64) / elem + 1, elem);
        }
        pl->path.integer_qk = sdpa_integer_scores(p);
        if (pl->path.integer_qk) {  /* int8 rows (M x E), M float scales, then the kernel's work */
            pl->path.dot_qi = sdpa_dot_qi_for(kt);
            pl->scratch.qi = off;
            off += round_elems((M * E + 3 * SDPA_ALIGN) / elem + M + SDPA_QI_WORK_BYTES(M, E) / elem + 1, elem);
        }
        pl->path.integer_pv = sdpa_integer_values(p);
        if (pl->path.integer_pv) {  /* a run's weights, their scales, its rows, the kernel's work */
            pl->path.pv_qi = sdpa_pv_qi_for(kt);
            pl->scratch.pvi = off;
            const size_t ng = Ev / (size_t)(p->kv_group_size > 0 ? p->kv_group_size : (int64_t)(Ev > 0 ? Ev : 1));
            off += round_elems(SDPA_PVI_BYTES(M, Ev, ng) / elem + 1, elem);
        }
    } else {
        const size_t tq = (size_t)pl->blocking.tile_q, tk = (size_t)pl->blocking.tile_k, nr = (size_t)pl->path.nr;
        pl->tiled.num_bh = batch_count * p->num_heads / pl->tiled.pack_g;
        pl->tiled.num_qblocks = (p->len_q * pl->tiled.pack_g + pl->blocking.tile_q - 1) / pl->blocking.tile_q;
        if (p->block_states.data) {  /* a task's rows within one query block of the map */
            const int64_t bq = p->block_q < p->len_q ? p->block_q : (p->len_q > 0 ? p->len_q : 1);
            const int64_t nr = pl->path.nr;
            if (bq < pl->blocking.tile_q) pl->blocking.tile_q = (int)((bq + nr - 1) / nr * nr);
            pl->tiled.qb_tasks = (bq + pl->blocking.tile_q - 1) / pl->blocking.tile_q;
            pl->tiled.num_qblocks = sdpa_blocks_of(p->len_q, p->block_q) * pl->tiled.qb_tasks;
        }
        pl->num_tasks = pl->tiled.num_bh * pl->tiled.num_qblocks;
        pl->scratch.q = off;   off += round_elems(tq * E, elem);
        pl->scratch.acc = off; off += round_elems(tq * Ev, elem);
        pl->scratch.s = off;   off += round_elems(tk * nr, elem);
        pl->scratch.m = off;   off += round_elems(tq, elem);
        pl->scratch.l = off;   off += round_elems(tq, elem);
        pl->bf16.on = bf16_pairs;
        if (bf16_pairs) pl->path.nr_half = pl->path.nr_quarter = pl->path.nr;  /* the pairs keep their one width */
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
        /* (packed V pairs are read from an even key: not with a map's odd blocks) */
        const int odd_blocks = p->block_states.data && p->block_k % 2;
        if ((bf16_pairs || (convert && (!copy_only || packing == 2))) && (reuse >= 2 || packing == 2) && packing != 1 &&
            p->len_kv > 0 && !(bf16_pairs && odd_blocks)) {
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
int sdpa_padding_limits(const sdpa_problem *p, int64_t batch_count, int64_t *limits) {
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
void sdpa_fold_group(sdpa_problem *q, const kernel_table *kt) {
    const int forced = sdpa_atomic_load(&forced_fold);
    const int pairs = q->dtype == SDPA_BFLOAT16 && kv_dtype_of(q) == SDPA_BFLOAT16 && kt->bf16_products;
    const int64_t rule = pairs ? SDPA_FOLD_MIN_GROUP_BF16 : SDPA_FOLD_MIN_GROUP;
    const int64_t min_group = forced > 0 ? forced : forced < 0 ? INT64_MAX : rule;
    if (q->len_q != 1 || q->gqa_group < min_group || q->mask_kind != SDPA_MASK_NONE || q->weights.data ||
        q->block_states.data || q->key_scores.data ||
        has_window(q) || q->alibi.data || q->sinks.data || sdpa_integer_rows(q))  /* integer products: the row path */
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
void sdpa_clamp_offsets(sdpa_problem *p) {
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
double sdpa_part_flops(const part *pt) {
    const sdpa_problem *p = &pt->p;
    return 2.0 * (double)(p->head_dim + p->head_dim_v) * (double)pt->batch_count * (double)p->num_heads *
           (double)p->len_q * row_keys(p);
}

double sdpa_kv_value_bytes(const sdpa_problem *p) {
    const sdpa_dtype dt = kv_dtype_of(p);
    return dt == SDPA_INT4 ? 0.5 : (double)sdpa_dtype_size(dt);
}

/* The estimated cost of task t of a part. */
double sdpa_task_cost(const part *pt, int64_t t) {
    const sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    const double width = (double)(p->head_dim + p->head_dim_v);
    if (pl->path.row_mode) {
        const int64_t g = t / pl->row.num_chunks, chunk = t % pl->row.num_chunks;
        const int64_t b = g / (p->num_heads / p->gqa_group);
        double keys = visible_keys(p, b, 0, p->len_q) - (double)(chunk * pl->blocking.chunk_len);
        if (keys > (double)pl->blocking.chunk_len) keys = (double)pl->blocking.chunk_len;
        if (keys < 0) keys = 0;
        const double flops = 2.0 * width * keys * (double)pl->row.rows, bytes = width * keys * sdpa_kv_value_bytes(p);
        const double ns = flops / COST_ROW_FLOPS_PER_NS, ns_mem = bytes / COST_BYTES_PER_NS;
        return COST_TASK_NS + (ns > ns_mem ? ns : ns_mem);
    }
    const int64_t pg = pl->tiled.pack_g, U = p->gqa_group / pg, per = pl->tiled.num_qblocks;
    const int64_t qb = per - 1 - (t % (per * U)) / U;
    const int64_t b = t / (per * (p->num_heads / pg));
    const int64_t r0 = qb * pl->blocking.tile_q, R = p->len_q * pg;
    const int64_t r1 = r0 + pl->blocking.tile_q < R ? r0 + pl->blocking.tile_q : R;
    const int64_t l0 = r0 / pg, l1 = (r1 - 1) / pg + 1;  /* the task's positions */
    /* rows pay whole panels (the last a narrower one where its rows fit),
     * against their part of the keys (half, causal) */
    const int64_t nr = pl->path.nr, whole = (r1 - r0) / nr * nr, tail = (r1 - r0) - whole;
    const double panels = (double)(whole + (tail == 0 ? 0 : sdpa_tail_cost(pl, (int)tail)));
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
    return sdpa_task_cost(pt, t);
}

