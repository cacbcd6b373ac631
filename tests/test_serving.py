"""One plan, one call: ragged batches planned and run by the core at once.

Packed sequences (``varlen_attention``), mixed batches of chunked prefills and
decodes (``paged_attention`` with ``query_start_loc``), shared prefixes (nested
ones included) and tree masks each take one core call (the tests count them
with the core's observer); what the planner made of a call is read with
``paged_plan`` / ``varlen_plan``.  Every result is checked against the
float64 reference on the cache's own values, and sequence by sequence against
the same call on that sequence alone: the same bits where no part of the keys
is shared (each sequence is planned as it would be alone), the same values to
rounding where shared blocks are read once and merged.
"""
import contextlib

import numpy as np
import pytest

import sdpa
from conftest import tolerance
from sdpa import _core, reference
from sdpa.kvcache import dequantize
from sdpa.paged import paged_plan
from sdpa.varlen import varlen_plan

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
CACHE_DTYPES = [np.float32, np.float16, BF16, "int8", "int4", "float8_e4m3fn", "float8_e5m2"]


@contextlib.contextmanager
def core_calls():
    """The query shapes of the core calls made inside the block."""
    seen = []
    _core.set_observer(lambda arrays: seen.append(arrays["q"].shape))
    try:
        yield seen
    finally:
        _core.set_observer(None)


def cache_values(cache, which):
    """A PagedKVCache's keys (0) or values (1) as the kernels read them, float64."""
    data = cache.key_cache if which == 0 else cache.value_cache
    scales = cache.key_scale if which == 0 else cache.value_scale
    if data.dtype in (np.int8, np.uint8):
        return dequantize(int(_core.QUANTIZED[cache.format.name]), data, scales).astype(np.float64)
    return data.astype(np.float64)


def positions(values, table, n):
    """Positions [0, n) of one sequence: (Hkv, n, C)."""
    bs = values.shape[2]
    return np.concatenate([values[table[j]] for j in range(-(-n // bs))], axis=1)[:, :n]


def filled_cache(rng, dtype, lens, bs=16, hkv=2, e=32, shared=0):
    """A PagedKVCache holding sequences of these lengths; with `shared`, the
    first two fork one prompt of that many positions."""
    cache = sdpa.PagedKVCache(sum(-(-n // bs) for n in lens) + 8, bs, hkv, e, dtype=dtype)
    ids = []
    for i, n in enumerate(lens):
        if shared and i == 1:
            s = cache.fork(ids[0])
            n -= shared
        else:
            s = cache.add_sequence()
            if shared and i == 0:
                cache.append(s, rng.standard_normal((hkv, shared, e)), rng.standard_normal((hkv, shared, e)))
                n -= shared
        cache.append(s, rng.standard_normal((hkv, n, e)), rng.standard_normal((hkv, n, e)))
        ids.append(s)
    return cache, ids


def mixed_reference(q, qsl, cache, bt, lens, **kw):
    """float64 attention of each sequence's packed rows over its positions."""
    kf, vf = cache_values(cache, 0), cache_values(cache, 1)
    T, Hq, _ = q.shape
    out = np.zeros((T, Hq, vf.shape[-1]))
    lse = np.full((T, Hq), -np.inf)
    for b in range(len(lens)):
        a, z = int(qsl[b]), int(qsl[b + 1])
        if a == z:
            continue
        n = int(lens[b])
        k, v = positions(kf, bt[b], n)[None], positions(vf, bt[b], n)[None]
        o, s = reference.scaled_dot_product_attention(
            q[a:z].transpose(1, 0, 2)[None].astype(np.float64), k, v, is_causal="bottom_right", enable_gqa=True,
            return_lse=True, **kw)
        out[a:z], lse[a:z] = o[0].transpose(1, 0, 2), s[0].T
    return out, lse


def query_dtype(cache_dtype):
    return cache_dtype if cache_dtype in (np.float16, BF16) else np.float32


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_mixed_batch_matches_the_reference_on_every_kernel_set(isa, rng, dtype):
    """Chunks of prefill beside single-token decodes and sequences with no rows
    at all, in one packed call over every cache dtype."""
    lens = [70, 33, 9, 120, 48, 17]
    rows = [24, 1, 0, 1, 16, 1]
    cache, ids = filled_cache(rng, dtype, lens)
    bt, sl = cache.tables(ids)
    qsl = np.concatenate([[0], np.cumsum(rows)])
    qdt = query_dtype(dtype)
    q = rng.standard_normal((int(qsl[-1]), 8, 32)).astype(qdt)
    with core_calls() as seen:
        out, lse = cache.attend(ids, q, query_start_loc=qsl, return_lse=True)
    assert seen == [q.shape]  # one core call
    assert out.shape == (q.shape[0], 8, 32) and out.dtype == qdt and lse.shape == (q.shape[0], 8)
    ref, ref_lse = mixed_reference(q, qsl, cache, bt, sl)
    tol = tolerance(qdt, 32)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    for b, s in enumerate(ids):  # each sequence as alone, bit for bit
        a, z = int(qsl[b]), int(qsl[b + 1])
        if a < z:
            alone, alone_lse = cache.attend([s], q[a:z].transpose(1, 0, 2)[None], return_lse=True)
            assert np.array_equal(out[a:z], alone[0].transpose(1, 0, 2)), f"sequence {b}"
            assert np.array_equal(lse[a:z], alone_lse[0].T), f"sequence {b}"


@pytest.mark.parametrize("integer_qk", [False, True])
@pytest.mark.parametrize("threads", [1, 8])
def test_mixed_batch_of_chunked_decodes_and_prefills(isa, rng, integer_qk, threads):
    """Decoding rows over keys in several chunks (a thread prepares a group's
    query rows once for the chunks it takes in a row) beside prefill chunks on
    the tiled path, which write over the threads' scratch: one thread, every
    task in turn, and 8, whose work list is sorted by cost; each sequence as
    alone, bit for bit, and the float64 reference on the query as the kernels
    see it."""
    from sdpa import _core

    lens = [300, 90, 260, 70]
    rows = [1, 20, 1, 24]  # prefill chunks of 80 and 96 rows a key/value head: the tiled path
    cache, ids = filled_cache(rng, "int8", lens, bs=16, hkv=2, e=64)
    bt, sl = cache.tables(ids)
    qsl = np.concatenate([[0], np.cumsum(rows)])
    q = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float32)
    _core.set_blocking(0, 0, 64)  # chunks of 64 keys: 5 and 4 chunks a decoding group
    try:
        out = cache.attend(ids, q, query_start_loc=qsl, integer_qk=integer_qk, num_threads=threads)
        for b, s in enumerate(ids):
            a, z = int(qsl[b]), int(qsl[b + 1])
            alone = cache.attend([s], q[a:z].transpose(1, 0, 2)[None], integer_qk=integer_qk, num_threads=1)
            assert np.array_equal(out[a:z], alone[0].transpose(1, 0, 2)), f"sequence {b}"
    finally:
        _core.set_blocking(0, 0, 0)
    seen = q.astype(np.float64)
    if integer_qk:  # the decoding rows rounded to int8, each with its scale
        scaled = q * np.float32(1 / 8)
        qscale = np.abs(scaled).max(-1, keepdims=True) / np.float32(127)
        rounded = np.clip(np.round(scaled / qscale), -127, 127) * qscale.astype(np.float64) * 8
        for b in range(len(lens)):
            if rows[b] == 1:
                seen[qsl[b]] = rounded[qsl[b]]
    ref, _ = mixed_reference(seen, qsl, cache, bt, sl)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kw", [{}, {"is_causal": False}, {"window": (20, 0), "softcap": 4.0},
                                {"sinks": "per-head"}, {"alibi_slopes": "per-sequence"}])
def test_mixed_batch_variants(rng, kw):
    lens = [50, 41, 90]
    rows = [12, 1, 7]
    cache, ids = filled_cache(rng, np.float32, lens, bs=8)
    bt, sl = cache.tables(ids)
    qsl = np.concatenate([[0], np.cumsum(rows)])
    q = rng.standard_normal((int(qsl[-1]), 4, 32)).astype(np.float32)
    kw = dict(kw)
    if kw.get("sinks") == "per-head":
        kw["sinks"] = rng.standard_normal(4).astype(np.float32)
    if kw.get("alibi_slopes") == "per-sequence":
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, (3, 4)).astype(np.float32)
    out = sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, query_start_loc=qsl, **kw)
    causal = kw.pop("is_causal", True)
    for b in range(3):  # the same call, one sequence at a time (its own slopes)
        a, z = int(qsl[b]), int(qsl[b + 1])
        one = {k: (v[b : b + 1] if k == "alibi_slopes" else v) for k, v in kw.items()}
        alone = sdpa.paged_attention(q[a:z].transpose(1, 0, 2)[None], cache.key_cache, cache.value_cache, bt[b : b + 1],
                                     sl[b : b + 1], is_causal=causal, **one)
        assert np.array_equal(out[a:z], alone[0].transpose(1, 0, 2)), f"sequence {b} {kw}"


def test_mixed_batch_with_shared_prefixes(isa, rng):
    """Two forks of one prompt, one prefilling a chunk and one decoding, beside
    a sequence of their own: the prompt's blocks are one part, for the rows of
    both; the merged rows agree with the calls on each sequence alone."""
    cache, ids = filled_cache(rng, np.float32, [80, 75, 40], bs=8, shared=64)
    bt, sl = cache.tables(ids)
    assert (bt[0, :8] == bt[1, :8]).all()
    rows = [9, 1, 5]
    qsl = np.concatenate([[0], np.cumsum(rows)])
    q = rng.standard_normal((int(qsl[-1]), 8, 32)).astype(np.float32)
    plan = paged_plan(q, cache.key_cache, cache.value_cache, bt, sl, query_start_loc=qsl)
    shared = [p for p in plan["parts"] if p["members"]]
    # the prompt's blocks every row of both sees whole: 8 - the chunk's own reach
    assert len(shared) == 1 and shared[0]["members"] == 2 and shared[0]["rows"] == 4 * (9 + 1)
    assert plan["merges"] == 2
    with core_calls() as seen:
        out, lse = cache.attend(ids, q, query_start_loc=qsl, return_lse=True)
    assert len(seen) == 1
    ref, ref_lse = mixed_reference(q, qsl, cache, bt, sl)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_nested_shared_prefixes_are_read_once_at_each_level(isa, rng):
    """A system prompt shared by every sequence, then two conversations each
    forked twice: one part for the system prompt (all 5 sequences' rows), one
    for each conversation's blocks (its forks' rows), and each sequence's own
    keys; one core call, merged exactly."""
    bs, e = 8, 32
    cache = sdpa.PagedKVCache(80, bs, 2, e)
    system = cache.add_sequence()
    cache.append(system, rng.standard_normal((2, 48, e)), rng.standard_normal((2, 48, e)))
    conversations = [cache.fork(system), cache.fork(system)]
    for c in conversations:
        cache.append(c, rng.standard_normal((2, 32, e)), rng.standard_normal((2, 32, e)))
    ids = [system]
    for c in conversations:
        ids += [c, cache.fork(c)]
    for s in ids:
        n = int(rng.integers(1, 12))
        cache.append(s, rng.standard_normal((2, n, e)), rng.standard_normal((2, n, e)))
    bt, sl = cache.tables(ids)
    q = rng.standard_normal((len(ids), 4, 1, e)).astype(np.float32)
    plan = paged_plan(q, cache.key_cache, cache.value_cache, bt, sl)
    levels = sorted((p["members"], p["keys"]) for p in plan["parts"] if p["members"])
    assert levels == [(2, 32), (2, 32), (5, 48)]
    assert plan["merges"] == 5
    with core_calls() as seen:
        out = cache.attend(ids, q)
    assert len(seen) == 1
    kf, vf = cache_values(cache, 0), cache_values(cache, 1)
    for b in range(len(ids)):
        n = int(sl[b])
        ref = reference.scaled_dot_product_attention(q[b : b + 1].astype(np.float64), positions(kf, bt[b], n)[None],
                                                     positions(vf, bt[b], n)[None], enable_gqa=True)
        np.testing.assert_allclose(out[b : b + 1], ref, rtol=2e-5, atol=2e-5, err_msg=f"sequence {b}")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_integer_qk_holds_across_a_shared_prefix(rng, dtype):
    """integer_qk is computed in integers over shared blocks too, also for more
    rows than a GQA group of the row path takes at once."""
    cache, ids = filled_cache(rng, dtype, [64, 64], bs=16, shared=48)
    for _ in range(5):  # 7 forks: 28 rows for each key/value head
        ids.append(cache.fork(ids[0]))
    q = rng.standard_normal((len(ids), 8, 1, 32)).astype(np.float32)
    batched = cache.attend(ids, q, integer_qk=True)
    alone = np.concatenate([cache.attend([s], q[i : i + 1], integer_qk=True) for i, s in enumerate(ids)])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
@pytest.mark.parametrize("ev", [2, 6])
def test_shared_prefix_with_narrow_values_on_several_threads(isa, rng, dtype, ev):
    """Each thread's scratch follows the one before and its merge accumulator
    (Ev + 8 doubles): with Ev = 2 or 6 it was not a whole number of aligned
    blocks, and a tiled task on the second thread faulted on an aligned load."""
    cache = sdpa.PagedKVCache(64, 1, 2, 2, ev, dtype=dtype)
    a = cache.add_sequence()
    cache.append(a, rng.standard_normal((2, 44, 2)), rng.standard_normal((2, 44, ev)))
    ids = [a, cache.fork(a), cache.fork(a), cache.fork(a)]
    q = rng.standard_normal((4, 8, 3, 2)).astype(np.float32)
    one = cache.attend(ids, q, num_threads=1)
    for threads in (2, 3) * 4:  # which thread takes a tiled task is the schedule's choice
        np.testing.assert_array_equal(cache.attend(ids, q, num_threads=threads), one)


def test_results_do_not_depend_on_the_thread_count(rng):
    cache, ids = filled_cache(rng, "int8", [200, 180, 150, 33], bs=16, shared=128)
    bt, sl = cache.tables(ids)
    qsl = np.array([0, 40, 41, 60, 61])
    q = rng.standard_normal((61, 8, 32)).astype(np.float32)
    first = cache.attend(ids, q, query_start_loc=qsl, num_threads=1)
    for n in (2, 3, 7):
        assert np.array_equal(first, cache.attend(ids, q, query_start_loc=qsl, num_threads=n))


def test_every_sequence_empty_and_no_rows(rng):
    cache, ids = filled_cache(rng, np.float32, [10, 20])
    q = np.zeros((0, 4, 32), np.float32)
    out, lse = cache.attend(ids, q, query_start_loc=[0, 0, 0], return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)


BAD_STARTS = [
    ([1, 3, 4], "must start at 0"),
    ([0, 3, 2], "non-decreasing"),
    ([0, 2, 3], "ends at 3"),
    ([0, 4], "expected 3 prefix sums"),
    ([0.0, 2.0, 4.0], "expected integers"),
    ([[0, 2, 4]], "expected a 1-D array"),
]


@pytest.mark.parametrize("starts, match", BAD_STARTS)
def test_bad_query_start_loc_names_it_and_writes_nothing(rng, starts, match):
    cache, ids = filled_cache(rng, np.float32, [10, 20])
    bt, sl = cache.tables(ids)
    q = rng.standard_normal((4, 4, 32)).astype(np.float32)
    out = np.full((4, 4, 32), 7.0, np.float32)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, query_start_loc=starts, out=out)
    assert "query_start_loc" in str(info.value)
    assert (out == 7.0).all()


def test_more_rows_than_positions_is_refused_naming_query_start_loc(rng):
    cache, ids = filled_cache(rng, np.float32, [3, 20])
    bt, sl = cache.tables(ids)
    q = rng.standard_normal((6, 4, 32)).astype(np.float32)
    out = np.full((6, 4, 32), 7.0, np.float32)
    with pytest.raises(ValueError, match="query_start_loc: sequence 0 has 4 query rows, more than its 3"):
        sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, query_start_loc=[0, 4, 6], out=out)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="tree_mask: not with query_start_loc"):
        sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, query_start_loc=[0, 2, 6],
                             tree_mask=np.ones((2, 2), bool))


def test_varlen_is_one_call_planned_per_sequence(rng):
    lens = np.array([9, 0, 40, 3, 64, 17])
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q = rng.standard_normal((T, 8, 32)).astype(np.float32)
    k = rng.standard_normal((T, 2, 32)).astype(np.float32)
    v = rng.standard_normal((T, 2, 32)).astype(np.float32)
    with core_calls() as seen:
        sdpa.varlen_attention(q, k, v, cu, cu, is_causal=True)
    assert seen == [q.shape]
    plan = varlen_plan(q, k, v, cu, cu, is_causal=True)
    assert sorted(p["seq"] for p in plan["parts"]) == [0, 2, 3, 4, 5]  # no part for the empty sequence
    assert {p["seq"]: p["rows"] for p in plan["parts"]} == {0: 9, 2: 40, 3: 3, 4: 64, 5: 17}
    assert plan["costs"].shape == (sum(p["tasks"] for p in plan["parts"]),)
    # the costliest parts first (they balance best at the head of the list)
    firsts = [p["cost"] for p in plan["parts"]]
    assert firsts == sorted(firsts, reverse=True)


@pytest.mark.parametrize("cu, match", [([1, 3, 4], "must start at 0"), ([0, 3, 2], "non-decreasing"),
                                       ([0, 2, 3], "ends at 3")])
def test_bad_cu_seqlens_name_them_and_write_nothing(rng, cu, match):
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    out = np.full((4, 2, 8), 7.0, np.float32)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        given = {"cu_seqlens_q": [0, 2, 4], "cu_seqlens_k": [0, 2, 4], name: cu}
        with pytest.raises(ValueError, match=f"{name}: .*{match}"):
            sdpa.varlen_attention(q, q, q, given["cu_seqlens_q"], given["cu_seqlens_k"], out=out)
        assert (out == 7.0).all()


def test_plan_balance_on_many_threads(rng):
    """The plan made for 64 threads gives a mixed batch's tasks a list whose
    greedy schedule (each thread takes the next task) ends within 10% of the
    ideal, by the plan's own cost model: the prefill chunks are cut fine enough
    and run first."""
    from sdpa.bench.plan import balance

    lens = [4096, 2048, 3000, 1024] + [int(x) for x in rng.integers(512, 4097, 60)]
    rows = [256] * 4 + [1] * 60
    bs, hkv, e = 16, 8, 128
    blocks = sum(-(-n // bs) for n in lens)
    kc = np.zeros((blocks, hkv, bs, e), np.float32)
    bt = np.full((64, -(-max(lens) // bs)), -1, np.int32)
    at = 0
    for b, n in enumerate(lens):
        m = -(-n // bs)
        bt[b, :m] = np.arange(at, at + m)
        at += m
    qsl = np.concatenate([[0], np.cumsum(rows)])
    q = np.zeros((int(qsl[-1]), 32, e), np.float32)
    plan = paged_plan(q, kc, kc, bt, np.array(lens), query_start_loc=qsl, threads=64)
    assert balance(plan["costs"], 64) >= 0.9
