/*
 * The executor for one compute type, included by exec.c with
 *   T     the compute type            SUF   the name suffix (f32, f64)
 *   KT    the kernel struct type      EXP   libm's exp for T
 *   TDT   the sdpa_dtype of T         HAS_BF16  whether bfloat16 pairs exist
 *
 * Query and out may be stored in another dtype than T (16-bit for T = float),
 * and so may key and value (plan.path.kv_dtype): the query is converted as it
 * is packed, key and value tiles into scratch before the kernels read them,
 * and the output as it is written.  Weights, lse and an additive mask are T.
 *
 * A call's plan (plan.h) runs in one parallel region, in phases separated by
 * the barriers of its loops: the copies (gathered query rows, a tree's keys),
 * the packing of K/V once per part, the work list (every part's tasks, the
 * costliest parts first), the row path's chunk merges, and the merges of the
 * sequences whose keys were read in parts.  Every row is finished by one
 * thread in a fixed order, so no result depends on the thread count.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

#include "kv_impl.h"
#include "scores_impl.h"
#include "merge_impl.h"
#include "tiled_impl.h"
#include "rows_impl.h"

/* One work item, unless the call was interrupted.  A row-path group of one
 * chunk is merged by the task that computed it (no second pass). */
static void FN(do_task)(const call_plan *cp, const KT *kern, T *scratch, row_memo *memo, char *block, int packing,
                        int64_t item, int tid, interrupt_state *irq, uint64_t *prof) {
    if (should_stop(irq, tid)) return;
    int64_t t;
    const part *pt = plan_item(cp, item, &t);
    const plan *pl = &pt->pl;
    if (pl->path.row_mode) {
        /* one chunk: the partial in scratch, merged (finished) at once */
        T *slot = pl->row.num_chunks == 1 ? scratch + pl->scratch.partial
                                          : (T *)(void *)(block + pt->partial_at) + t * pl->row.partial_elems;
        FN(run_row_task)(pt, kern, scratch, memo, slot, t, irq, tid);
        if (pl->row.num_chunks == 1) {
            if (!sdpa_atomic_load(&irq->stop)) FN(merge_rows)(pt, kern, slot, t);
            memo->pt = NULL;  /* its partial, in the scratch, lies where another part's rows may */
            if (pl->row.ks_local && !sdpa_atomic_load(&irq->stop)) {
                const key_score_store ks = FN(key_score_at)(pt, scratch, t);  /* the rows are finished */
                FN(key_score_reduce)(pt, t, &ks, cp->key_scores_add, cp->call->len_kv);
            }
        }
        return;
    }
    const T *packed = packing && pl->pack.on ? (const T *)(const void *)(block + pt->packed_at) : NULL;
    memo->pt = NULL;  /* a tiled task writes over the scratch */
#if HAS_BF16
    if (pl->bf16.on) kern->bf16.tiles_begin();
    FN(run_task)(cp, item, pt, kern, scratch, packed, t, irq, tid, prof);
    if (pl->bf16.on) kern->bf16.tiles_end();
#else
    FN(run_task)(cp, item, pt, kern, scratch, packed, t, irq, tid, prof);
#endif
}

/* Packing unit u of the call (its part's), timed as packing when profiled. */
static void FN(do_pack)(const call_plan *cp, const KT *kern, char *block, int64_t u, int tid, interrupt_state *irq,
                        uint64_t *prof) {
    if (should_stop(irq, tid)) return;
    const uint64_t t0 = prof ? prof_ticks() : 0;
    int64_t local;
    const part *pt = &cp->parts[cp->order[plan_find(cp->unit_start, cp->num_parts, u, &local)]];
    FN(pack_kv_unit)(&pt->p, &pt->pl, kern, (T *)(void *)(block + pt->packed_at), local);
    if (prof) prof[PH_PACK] += prof_ticks() - t0;
}

/* Row-path merge r of the call: a group of its part's chunks. */
static void FN(do_row_merge)(const call_plan *cp, const KT *kern, char *block, int64_t r) {
    int64_t g;
    const part *pt = &cp->parts[cp->order[plan_find(cp->rmerge_start, cp->num_parts, r, &g)]];
    const plan *pl = &pt->pl;
    FN(merge_rows)(pt, kern, (T *)(void *)(block + pt->partial_at) + g * pl->row.num_chunks * pl->row.partial_elems, g);
}

/* Key-score item k of the call: the k-th task, counted over the parts that
 * keep key scores, reduced (FN(key_score_reduce)). */
static void FN(do_key_scores)(const call_plan *cp, int64_t k) {
    for (int32_t i = 0; i < cp->num_parts; i++) {
        const part *pt = &cp->parts[i];
        if (!pt->ks_probs) continue;
        if (k < pt->pl.num_tasks) {
            const key_score_store ks = FN(key_score_at)(pt, NULL, k);
            FN(key_score_reduce)(pt, k, &ks, cp->key_scores_add, cp->call->len_kv);
            return;
        }
        k -= pt->pl.num_tasks;
    }
}

/* Key scores' regions of a row-path part from offset *at of a block at base
 * (NULL: sized only): its kept p, tile maxima and ranges where its tasks do
 * not keep them (plan.row.ks_local), and its rows' lse where the caller asked
 * for none.  Returns the tasks to reduce after the merges. */
static int64_t FN(key_score_layout)(part *pt, char *base, size_t *at) {
    sdpa_problem *p = &pt->p;
    const plan *pl = &pt->pl;
    if (!p->key_scores.data || !pl->path.row_mode) return 0;
    const size_t M = (size_t)pl->row.rows, n = (size_t)pl->num_tasks, groups = (size_t)pl->row.num_groups;
    const int kept = !pl->row.ks_local;
    if (kept) {
        const size_t probs = plan_take(at, groups * M * (size_t)p->len_kv * sizeof(T));
        const size_t tile_max = plan_take(at, n * (size_t)key_score_tiles(pl) * M * sizeof(T));
        const size_t range = plan_take(at, n * 2 * sizeof(int64_t));
        if (base) {
            pt->ks_probs = base + probs;
            pt->ks_max = base + tile_max;
            pt->ks_range = (int64_t *)(void *)(base + range);
        }
    }
    if (!p->lse.data) {  /* the rows' lse, (batch..., Hq, L), contiguous */
        const size_t lse = plan_take(at, groups * M * sizeof(T));
        if (base) {
            memset(&p->lse, 0, sizeof(p->lse));
            p->lse.data = base + lse;
            p->lse.row_stride = p->lse.col_stride = 1;
            p->lse.head_stride = p->len_q;
            int64_t stride = p->num_heads * p->len_q;
            for (int d = p->num_batch_dims - 1; d >= 0; d--) {
                p->lse.batch_strides[d] = stride;
                stride *= p->batch_shape[d];
            }
        }
    }
    return kept ? pl->num_tasks : 0;
}

static sdpa_status FN(run_call)(call_plan *cp, const KT *kern) {
    const int nthreads = cp->num_threads;
    /* per thread: scratch, a merge's accumulator, the phase counters, its row_memo */
    const size_t scratch_bytes = (cp->scratch_elems * sizeof(T) + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN;
    const size_t prof_bytes = cp->profile ? SDPA_ALIGN * ((PH_COUNT * 8 + SDPA_ALIGN - 1) / SDPA_ALIGN) : 0;
    const size_t memo_bytes = (sizeof(row_memo) + SDPA_ALIGN - 1) / SDPA_ALIGN * SDPA_ALIGN;
    const size_t per_thread = scratch_bytes + cp->merge_bytes + prof_bytes + memo_bytes;
    const size_t threads_bytes = per_thread * (size_t)nthreads;
    int packing = cp->packed_bytes > 0;
    /* key scores: each row-path part's kept p, tile maxima and ranges, and
     * its rows' lse where the caller asked for none (FN(key_score_layout)) */
    int64_t ks_items = 0;
    size_t ks_bytes = 0;
    for (int32_t i = 0; i < cp->num_parts; i++) ks_items += FN(key_score_layout)(&cp->parts[i], NULL, &ks_bytes);
    char *ks_mem = NULL;
    if (ks_bytes) {
        ks_mem = (char *)sdpa_kept_take(SDPA_KEPT_KEY_SCORES, ks_bytes);
        if (!ks_mem) return SDPA_ERR_NO_MEMORY;
        size_t at = 0;
        for (int32_t i = 0; i < cp->num_parts; i++) FN(key_score_layout)(&cp->parts[i], ks_mem, &at);
    }
    char *mem = (char *)sdpa_aligned_block(threads_bytes + cp->block_bytes);
    if (!mem && packing) {  /* without room for the packed K/V, tile by tile */
        packing = 0;
        mem = (char *)sdpa_aligned_block(threads_bytes + cp->block_bytes - cp->packed_bytes);
    }
    if (!mem) {
        sdpa_kept_give(SDPA_KEPT_KEY_SCORES, ks_mem);
        return SDPA_ERR_NO_MEMORY;
    }
    char *block = mem + threads_bytes;
    for (int32_t i = 0; i < cp->num_parts; i++) {  /* the views of gathered and staged rows */
        part *pt = &cp->parts[i];
        sdpa_problem *p = &pt->p;
        if (pt->query_at != NO_REGION) p->query.data = block + pt->query_at;
        if (pt->staged) {
            p->out.data = block + pt->out_at;
            p->lse.data = block + pt->lse_at;
        }
        sdpa_view *kv[4] = {&p->key, &p->value, &p->key_scale, &p->value_scale};
        for (int x = 0; x < 4; x++)
            if (pt->kv_at[x] != NO_REGION) kv[x]->data = block + pt->kv_at[x];
    }
    if (cp->profile) memset(mem, 0, threads_bytes);
    const int64_t num_units = packing ? cp->unit_start[cp->num_parts] : 0;
    const int64_t num_items = cp->item_start[cp->num_parts];
    const int64_t num_rmerges = cp->rmerge_start[cp->num_parts];

    interrupt_state irq;
    interrupt_start(&irq, cp->call);
#define THREAD_SCRATCH(t) ((T *)(void *)(mem + (size_t)(t) * per_thread))
#define THREAD_MERGE(t) ((double *)(void *)(mem + (size_t)(t) * per_thread + scratch_bytes))
#define THREAD_PROF(t) (cp->profile ? (uint64_t *)(void *)(mem + (size_t)(t) * per_thread + scratch_bytes + cp->merge_bytes) : NULL)
#define THREAD_MEMO(t) ((row_memo *)(void *)(mem + (size_t)(t) * per_thread + scratch_bytes + cp->merge_bytes + prof_bytes))
    if (nthreads == 1) {  /* no OpenMP region at all (also what a forked child needs) */
        for (int64_t j = 0; j < cp->num_copies; j++) FN(run_copy)(cp, &cp->copies[j]);
        for (int64_t u = 0; u < num_units; u++) FN(do_pack)(cp, kern, block, u, 0, &irq, THREAD_PROF(0));
        THREAD_MEMO(0)->pt = NULL;
        for (int64_t t = 0; t < num_items; t++)
            FN(do_task)(cp, kern, THREAD_SCRATCH(0), THREAD_MEMO(0), block, packing, t, 0, &irq, THREAD_PROF(0));
        for (int64_t r = 0; r < num_rmerges && !sdpa_atomic_load(&irq.stop); r++) FN(do_row_merge)(cp, kern, block, r);
        for (int64_t g = 0; g < cp->num_merges && !sdpa_atomic_load(&irq.stop); g++)
            FN(merge_parts)(cp, &cp->merges[g], THREAD_MERGE(0));
        for (int64_t k = 0; k < ks_items && !sdpa_atomic_load(&irq.stop); k++) FN(do_key_scores)(cp, k);
    } else {
#ifdef _OPENMP
        note_openmp_used();
        const fp_mode caller_mode = fp_mode_get();
#pragma omp parallel num_threads(nthreads)
        {
            const int tid = omp_get_thread_num();
            const fp_mode own_mode = fp_mode_get();
            fp_mode_adopt(caller_mode);
            T *mine = THREAD_SCRATCH(tid);
            row_memo *memo = THREAD_MEMO(tid);
            memo->pt = NULL;
            uint64_t *prof = THREAD_PROF(tid);
            if (cp->num_copies) {  /* before any pack or task reads them */
#pragma omp for schedule(dynamic, 1)
                for (int64_t j = 0; j < cp->num_copies; j++) FN(run_copy)(cp, &cp->copies[j]);
            }
            if (num_units) {  /* every slice packed before any task reads it */
#pragma omp for schedule(dynamic, 1)
                for (int64_t u = 0; u < num_units; u++) FN(do_pack)(cp, kern, block, u, tid, &irq, prof);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < num_items; t++)
                FN(do_task)(cp, kern, mine, memo, block, packing, t, tid, &irq, prof);
            if (num_rmerges) {  /* after the barrier above: every chunk is done */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < num_rmerges; r++)
                    if (!sdpa_atomic_load(&irq.stop)) FN(do_row_merge)(cp, kern, block, r);
            }
            if (cp->num_merges) {  /* every part's rows are written */
#pragma omp for schedule(dynamic, 1)
                for (int64_t g = 0; g < cp->num_merges; g++)
                    if (!sdpa_atomic_load(&irq.stop)) FN(merge_parts)(cp, &cp->merges[g], THREAD_MERGE(tid));
            }
            if (ks_items) {  /* every row finished, its lse written */
#pragma omp for schedule(dynamic, 4)
                for (int64_t k = 0; k < ks_items; k++)
                    if (!sdpa_atomic_load(&irq.stop)) FN(do_key_scores)(cp, k);
            }
            fp_mode_restore(own_mode);
        }
#endif
    }
    if (cp->profile)
        for (int t = 0; t < nthreads; t++) profile_add(THREAD_PROF(t));
#undef THREAD_MEMO
#undef THREAD_SCRATCH
#undef THREAD_MERGE
#undef THREAD_PROF
    sdpa_aligned_free(mem);
    sdpa_kept_give(SDPA_KEPT_KEY_SCORES, ks_mem);
    for (int32_t i = 0; i < cp->num_parts; i++) cp->parts[i].ks_probs = NULL;
    return sdpa_atomic_load(&irq.stop) ? SDPA_ERR_INTERRUPTED : SDPA_OK;
}

#undef FN
#undef CAT
#undef CAT_
