/* Hooks for the test suite only: not part of the C API. */
#ifndef SDPA_TESTING_H
#define SDPA_TESTING_H

#include "internal.h"

/* The exp kernel of the named set, in place (for the accuracy tests). */
sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n);

/* The softmax step of the named set (internal.h's contract) on copies in
 * aligned memory, written back: row 0: softmax on a panel, s n x nr, row_max
 * and row_sum nr, acc ev x nr, with nr = sdpa_testing_panel_rows; row 1:
 * row_softmax on one row, s n, row_max and row_sum 1, acc ev; row 2 (float32,
 * sets with bfloat16 products): online_softmax_pairs on the panel at scale 1, its P
 * pairs written back over s's first ceil(n/2) rows (the rest zero). */
sdpa_status sdpa_testing_softmax(const char *name, sdpa_dtype dtype, int row, void *s, int n, void *row_max,
                                 void *row_sum, void *acc, int64_t ev);
/* The panel width of the named set for dtype (0 if unknown). */
int sdpa_testing_panel_rows(const char *name, sdpa_dtype dtype);

/* flags[i] = the FTZ/DAZ bits of MXCSR in OpenMP thread i (0 off x86; -1 for a
 * thread the runtime did not start). */
void sdpa_fp_flags_in_threads(int num_threads, int *flags);

/* Turns flush-to-zero and denormals-are-zero on or off in the calling thread
 * (x86 MXCSR FTZ + DAZ; AArch64 FPCR.FZ); returns 0 where there is no such mode. */
int sdpa_set_flush_to_zero(int on);

/* Forces the blocking of later calls (attention.c): query rows per task
 * (rounded up to the panel width), keys per tile, keys per row-mode chunk; 0
 * restores the rule for that one, and so does a value out of range (tiles in
 * 1..SDPA_TESTING_MAX_TILE, chunks in 1..SDPA_TESTING_MAX_CHUNK). */
#define SDPA_TESTING_MAX_TILE 4096
#define SDPA_TESTING_MAX_CHUNK 65536
void sdpa_testing_set_blocking(int tile_q, int tile_k, int chunk);

/* Forces whether later tiled calls pack K and V once per call (attention.c):
 * 1 never (a tile at a time in each task), 2 whenever their format is packed
 * (16-bit or int8 K/V, bfloat16 V pairs), whatever the reuse and the budget;
 * 0 restores the rule. */
void sdpa_testing_set_packing(int mode);
/* Packing of a GQA group's heads into the tiled path's rows (planner.c's
 * pack_group): 0 the rule, 1 never, 2 wherever it is allowed. */
void sdpa_testing_set_pack_group(int mode);

/* The smallest GQA group whose decoding rows are folded into one query
 * (fold_group in attention.c): 0 the rule, n > 0 from n, -1 never. */
void sdpa_testing_set_fold_group(int min_group);
/* integer_qk's kernel: on nonzero, the portable one everywhere; and the name
 * of the one a float problem would run now ("avx512_vnni", "avx_vnni" or
 * "portable"). */
void sdpa_testing_portable_dot_qi(int on);
const char *sdpa_testing_dot_qi_kernel(void);

/* The roofline report's measurements (machine.c): the seconds `threads`
 * threads take to sum `bytes` bytes of buf (each its share), and the
 * operations a second of float32 FMA (kind 0) or int8 dot products (kind 1)
 * on the set in use, `threads` threads for about `seconds`, its probe named
 * in *name. */
double sdpa_probe_read(const void *buf, size_t bytes, int threads);
double sdpa_probe_peak(int kind, int threads, double seconds, const char **name);

/* Asks the OS for the AMX tile state now (arch_prctl), whatever was asked
 * before; 1 when this process may use tiles.  0 off Linux x86 builds. */
int sdpa_testing_ask_for_tiles(void);

/* The emulated set stands in for amx towards the OS (mode != 0): it becomes
 * the set in use, as the default choice (as_default) or as named, and its
 * bfloat16 tiled calls need the tile state, which is asked of the OS at the
 * first such call (mode 1) or taken as refused (mode -1): they then fall back
 * to avx512_bf16, or fail when the set was named.  Mode 0 ends it (the set in
 * use is the caller's to restore). */
sdpa_status sdpa_testing_stand_in(int mode, int as_default);

/* How many times the OS has been asked for the tile state (by calls). */
int sdpa_testing_tile_requests(void);

/* How many times the emulated set's product kernel has run. */
long sdpa_testing_amx_emulated_calls(void);

/* Whether this build has the amx set's kernel (x86-64 Linux, GCC 11 / clang 12). */
int sdpa_testing_have_amx_kernels(void);

/* Like sdpa_set_isa, and also takes "amx_emulated": the amx set's kernel over
 * a software model of the tiles, on any CPU that runs avx512_bf16. */
sdpa_status sdpa_testing_use_kernels(const char *name);

/* The named table (as sdpa_testing_use_kernels names them), or NULL. */
const kernel_table *sdpa_testing_table(const char *name);

/* The named set's gemm_bf16 on its own (internal.h's contract; b and c rows
 * 64-byte aligned), `repeat` times between the set's tiles_begin and
 * tiles_end, as a task runs it; SDPA_ERR_BAD_ISA when the set has none or
 * cannot run. */
sdpa_status sdpa_testing_gemm_bf16(const char *name, int m, int64_t kpairs, const uint32_t *a, int64_t a_rs,
                                   int64_t a_ks, const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                                   int accumulate, long repeat);

/* Whether the named table (as sdpa_testing_table finds it; with `declared`,
 * the set's own table before completion) is complete: every kernel the driver
 * may call is set (sdpa_table_is_complete); -1 when there is no such table. */
int sdpa_testing_table_complete(const char *name, int declared);

/* What dispatch.c lets the testing unit see and drive: the complete table (or
 * the declared one) of any set this CPU has the features for (test-only sets
 * too; needs_tile_state:
 * whether its bfloat16 calls need the OS's tile state), the OS's answer on the
 * tile state (asked once) and how many calls asked, the choice of a set, and
 * the tile state itself (permission 0 not asked, 1 granted, -1 refused; the
 * emulated set standing in for amx). */
const kernel_table *sdpa_dispatch_find(const char *name, int *needs_tile_state, int declared);
int sdpa_dispatch_tiles_permitted(void);
int sdpa_dispatch_tile_requests(void);
int sdpa_dispatch_ask_for_tiles(void);
sdpa_status sdpa_dispatch_use(const kernel_table *kt, int by_name);
void sdpa_dispatch_set_tile_state(int permission, int emulated_stands_in);

/* The phase profile of the tiled path (attention.c): start zeroes the totals
 * and turns the timers on for the calls planned from then on; read fills ns[i]
 * (i < n) with the nanoseconds summed over threads in phase i (pack, Q K^T,
 * scale and masks, softmax with P's pairing, P V, epilogue) and *scores with
 * the scores computed, and returns the number of phases; stop turns them off. */
void sdpa_profile_start(void);
int sdpa_profile_read(double *ns, int n, double *scores);
void sdpa_profile_stop(void);

/* What the planner made of a problem (planner.c), for the tests and the
 * balance report: one entry per part, in the order its tasks run. */
typedef struct sdpa_part_info {
    int64_t seq;        /* the sequence (batch index) it serves; -1: a whole batch or a shared prefix */
    int64_t members;    /* a shared prefix: the sequences that share it; else 0 */
    int64_t heads;      /* query heads, rows per head, keys */
    int64_t rows;
    int64_t keys;
    int64_t tasks;
    int32_t row_mode;   /* the row path; else tiled */
    int32_t staged;     /* its rows are merged with other parts' */
    int32_t tree;       /* over a copy of a tree's last positions */
    int32_t packed;     /* K/V packed once for its tasks */
    double cost;        /* the estimated cost of its largest task (ns on one core) */
} sdpa_part_info;

/* Plans problem p for `threads` threads (> 0, any number, more than this
 * machine has; 0: as a call would) without computing anything: the parts (up
 * to max_parts of them into parts), each work item's estimated cost in the
 * order the list runs (up to max_items into costs), the numbers of parts and
 * items, the threads the call would start, and the merges.  A status for a
 * problem sdpa_attention would refuse. */
sdpa_status sdpa_testing_plan(const sdpa_problem *p, int threads, sdpa_part_info *parts, int64_t max_parts,
                              int64_t *num_parts, double *costs, int64_t max_items, int64_t *num_items,
                              int *num_threads, int64_t *num_merges);

#endif
