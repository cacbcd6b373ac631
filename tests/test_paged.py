"""Paged KV caches: paged_attention, paged_write and PagedKVCache.

Every result is checked against the same attention over the sequence's keys
and values laid out contiguously: the float64 reference, and sdpa's own
contiguous call where the two must agree closely.  Random block tables put a
sequence's blocks anywhere in the pool; shared blocks, forks, tree masks, the
variants and every cache dtype are covered, on every kernel set.
"""
import numpy as np
import pytest

import sdpa
from conftest import tolerance
from sdpa import _core, reference
from sdpa.paged import paged_plan

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def contiguous(cache, table, n):
    """Positions [0, n) of one sequence from a paged cache: (Hkv, n, C)."""
    bs = cache.shape[2]
    return np.concatenate([cache[table[j]] for j in range(-(-n // bs))], axis=1)[:, :n]


def dequantized(cache, scales, group):
    """float32 values of an int8 cache, as the kernels read them."""
    c = cache.astype(np.float32)
    if scales.shape[-1] == 1:
        return c * scales
    return (c.reshape(c.shape[:-1] + (scales.shape[-1], group)) * scales[..., None]).reshape(c.shape)


def random_tables(rng, B, lens, bs, num_blocks, spare=1):
    """Each sequence gets distinct random blocks; unused entries are -1."""
    width = max(-(-int(n) // bs) for n in lens) + spare
    bt = np.full((B, width), -1, np.int32)
    pool = rng.permutation(num_blocks)
    at = 0
    for b, n in enumerate(lens):
        need = -(-int(n) // bs)
        bt[b, :need] = pool[at : at + need]
        at += need
    return bt


def problem(rng, B=3, Hq=8, Hkv=2, L=1, E=32, Ev=None, bs=16, dtype=np.float32, max_len=80, extra_blocks=4):
    Ev = E if Ev is None else Ev
    lens = rng.integers(L, max_len + 1, B)
    num_blocks = int(sum(-(-int(n) // bs) for n in lens)) + extra_blocks
    kc = rng.standard_normal((num_blocks, Hkv, bs, E)).astype(dtype)
    vc = rng.standard_normal((num_blocks, Hkv, bs, Ev)).astype(dtype)
    bt = random_tables(rng, B, lens, bs, num_blocks)
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    return q, kc, vc, bt, lens.astype(np.int64)


def reference_of(q, kc, vc, bt, lens, is_causal=True, tree=None, **kw):
    """float64 attention of each sequence over its contiguous keys."""
    B, Hq, L, _ = q.shape
    outs, lses = [], []
    for b in range(B):
        n = int(lens[b])
        k = contiguous(kc, bt[b], n).astype(np.float64)[None]
        v = contiguous(vc, bt[b], n).astype(np.float64)[None]
        mask = None
        causal = "bottom_right" if is_causal else False
        if tree is not None:
            mask = np.ones((L, n), bool)
            mask[:, n - L :] = tree[b] if tree.ndim == 3 else tree
            causal = False
        extra = {}
        for name in ("alibi_slopes", "sinks"):
            if kw.get(name) is not None:
                a = np.asarray(kw[name], np.float64)
                extra[name] = a[b] if a.ndim == 2 else a
        rest = {x: y for x, y in kw.items() if x not in ("alibi_slopes", "sinks")}
        o, s = reference.scaled_dot_product_attention(
            q[b : b + 1].astype(np.float64), k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
            return_lse=True, **extra, **rest)
        outs.append(o[0])
        lses.append(s[0])
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("L", [1, 3, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
@pytest.mark.parametrize("is_causal", [True, False])
def test_matches_the_reference_on_every_kernel_set(isa, rng, L, dtype, is_causal):
    bs = int(rng.choice([1, 5, 16, 32]))
    q, kc, vc, bt, lens = problem(rng, L=L, dtype=dtype, bs=bs)
    out, lse = sdpa.paged_attention(q, kc, vc, bt, lens, is_causal=is_causal, return_lse=True)
    assert out.dtype == np.dtype(dtype) and out.shape == q.shape
    ref, ref_lse = reference_of(q, kc, vc, bt, lens, is_causal)
    tol = tolerance(dtype, 32)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, BF16, "int8"])
def test_widened_and_paired_blocks_packed_or_not(isa, rng, dtype):
    """The tiled path's 16-bit and int8 caches: widened or paired by block
    segments per tile or packed once per call, bfloat16 keys read as pairs in
    place from long blocks, and bfloat16 pairs over blocks of an odd size (a
    copy of each sequence's blocks)."""
    for bs in (1, 5, 16, 64):  # 64: bfloat16 keys paired in place
        cache = sdpa.PagedKVCache(120, bs, 2, 32, dtype=dtype)
        ids = [cache.add_sequence() for _ in range(2)]
        for s, n in zip(ids, (61, 40)):
            cache.append(s, rng.standard_normal((2, n, 32)), rng.standard_normal((2, n, 32)))
        qdt = BF16 if dtype == BF16 else np.float32
        q = rng.standard_normal((2, 4, 24, 32)).astype(qdt)
        bt, lens = cache.tables(ids)
        if cache.key_scale is not None:
            kf = dequantized(cache.key_cache, cache.key_scale, 32)
            vf = dequantized(cache.value_cache, cache.value_scale, 32)
        else:
            kf, vf = cache.key_cache, cache.value_cache
        ref, _ = reference_of(q, kf, vf, bt, lens)
        for mode in ("never", "always", "rule"):
            _core.set_packing(mode)
            try:
                out = cache.attend(ids, q)
            finally:
                _core.set_packing("rule")
            tol = tolerance(qdt, 32)
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol, err_msg=f"bs {bs} {mode}")


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("L", [1, 4, 24])
def test_equals_the_contiguous_call(isa, rng, L, bs):
    """The same sums as scaled_dot_product_attention over the gathered arrays,
    to float32 rounding: decoding reads blocks in place, the tiled path copies
    short blocks a tile at a time and reads long ones in place."""
    q, kc, vc, bt, lens = problem(rng, B=4, L=L, bs=bs, max_len=300)
    out = sdpa.paged_attention(q, kc, vc, bt, lens)
    for b in range(4):
        n = int(lens[b])
        k, v = contiguous(kc, bt[b], n)[None], contiguous(vc, bt[b], n)[None]
        one = sdpa.scaled_dot_product_attention(q[b : b + 1], k, v, is_causal="bottom_right", enable_gqa=True)
        np.testing.assert_allclose(out[b], one[0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("group", [None, 8])
@pytest.mark.parametrize("L", [1, 20])
def test_int8_cache_matches_attention_over_its_values(isa, rng, group, L):
    cache = sdpa.PagedKVCache(24, 8, 2, 32, dtype="int8", group_size=group)
    ids = [cache.add_sequence() for _ in range(3)]
    for i, s in enumerate(ids):
        n = 20 + 17 * i
        cache.append(s, rng.standard_normal((2, n, 32)), rng.standard_normal((2, n, 32)))
    q = rng.standard_normal((3, 4, L, 32)).astype(np.float32)
    out = cache.attend(ids, q)
    bt, lens = cache.tables(ids)
    g = group or 32
    kf = dequantized(cache.key_cache, cache.key_scale, g)
    vf = dequantized(cache.value_cache, cache.value_scale, g)
    ref, _ = reference_of(q, kf, vf, bt, lens)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bs", [8, 64])
@pytest.mark.parametrize("L", [1, 6, 30])
def test_variants(isa, rng, L, bs):
    q, kc, vc, bt, lens = problem(rng, L=L, bs=bs, max_len=150)
    slopes = rng.uniform(0.01, 0.5, (3, 8)).astype(np.float32)
    sinks = rng.standard_normal(8).astype(np.float32)
    for kw in ({"window": (7, 0)}, {"window": (20, 2), "is_causal": False}, {"softcap": 3.0},
               {"alibi_slopes": slopes}, {"sinks": sinks}, {"scale": 0.3, "alibi_slopes": slopes[0],
                                                             "window": (11, -1), "sinks": sinks}):
        out = sdpa.paged_attention(q, kc, vc, bt, lens, **kw)
        ref, _ = reference_of(q, kc, vc, bt, lens, **kw)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5, err_msg=str(kw))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tree_masks(isa, rng, dtype):
    L = 6
    q, kc, vc, bt, lens = problem(rng, L=L, bs=8, max_len=60, dtype=dtype)
    tree = np.tril(rng.random((3, L, L)) < 0.6)
    tree[:, np.arange(L), np.arange(L)] = True
    for t in (tree, tree[1]):
        out, lse = sdpa.paged_attention(q, kc, vc, bt, lens, tree_mask=t, return_lse=True)
        ref, ref_lse = reference_of(q, kc, vc, bt, lens, tree=t)
        tol = tolerance(dtype, 32)
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    out = sdpa.paged_attention(q, kc, vc, bt, lens, tree_mask=tree, window=(9, 0), softcap=4.0,
                               sinks=np.zeros(8, np.float32))
    ref, _ = reference_of(q, kc, vc, bt, lens, tree=tree, window=(9, 0), softcap=4.0,
                          sinks=np.zeros(8, np.float32))
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tolerance(dtype, 32), atol=tolerance(dtype, 32))


def test_a_lower_triangular_tree_is_the_causal_call(rng):
    q, kc, vc, bt, lens = problem(rng, L=5, bs=4)
    plain = sdpa.paged_attention(q, kc, vc, bt, lens)
    tree = sdpa.paged_attention(q, kc, vc, bt, lens, tree_mask=np.tril(np.ones((5, 5), bool)))
    np.testing.assert_allclose(tree, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, "int8"])
def test_shared_prefix_is_read_once_and_gives_the_same_result(isa, rng, L, dtype):
    """Forks of one prompt: the shared blocks go to the core once, for the
    rows of every fork, and the result equals that over private copies."""
    cache = sdpa.PagedKVCache(64, 8, 2, 16, dtype=dtype)
    root = cache.add_sequence()
    cache.append(root, rng.standard_normal((2, 45, 16)), rng.standard_normal((2, 45, 16)))
    ids = [cache.fork(root) for _ in range(3)] + [root]
    for s in ids:
        n = int(rng.integers(L, 12))
        cache.append(s, rng.standard_normal((2, n, 16)), rng.standard_normal((2, n, 16)))
    other = cache.add_sequence()
    cache.append(other, rng.standard_normal((2, 30, 16)), rng.standard_normal((2, 30, 16)))
    ids.append(other)
    bt, lens = cache.tables(ids)
    assert (bt[:4, :5] == bt[0, :5]).all()  # 45 positions: 5 full blocks shared
    qdt = np.float16 if dtype == np.float16 else np.float32
    q = rng.standard_normal((5, 4, L, 16)).astype(qdt)

    seen = []
    _core.set_observer(lambda arrays: seen.append((arrays["q"].shape, arrays["k"])))
    try:
        out = cache.attend(ids, q)
    finally:
        _core.set_observer(None)
    assert [shape for shape, _ in seen] == [(5, 4, L, 16)]  # one core call
    assert seen[0][1] is cache.key_cache  # read in place
    # the plan: one part for the 5 shared blocks, for the rows of the 4 forks;
    # each sequence's own keys; the forks' rows merged
    bt, lens = cache.tables(ids)
    plan = paged_plan(q, cache.key_cache, cache.value_cache, bt, lens, key_scale=cache.key_scale,
                      value_scale=cache.value_scale)
    shared = [p for p in plan["parts"] if p["members"]]
    assert len(shared) == 1 and shared[0]["members"] == 4 and shared[0]["keys"] == 40
    assert sorted(p["seq"] for p in plan["parts"] if not p["members"]) == [0, 1, 2, 3, 4]
    assert plan["merges"] == 4

    # the same sequences with every block private: no sharing
    private = np.arange(bt.size, dtype=np.int32).reshape(bt.shape)
    kc = np.concatenate([cache.key_cache[np.maximum(bt, 0)].reshape((-1,) + cache.key_cache.shape[1:])])
    vc = np.concatenate([cache.value_cache[np.maximum(bt, 0)].reshape((-1,) + cache.value_cache.shape[1:])])
    kw = {}
    if cache.key_scale is not None:
        kw = {"key_scale": cache.key_scale[np.maximum(bt, 0)].reshape((-1,) + cache.key_scale.shape[1:]),
              "value_scale": cache.value_scale[np.maximum(bt, 0)].reshape((-1,) + cache.value_scale.shape[1:])}
    assert not any(p["members"] for p in paged_plan(q, kc, vc, private, lens, **kw)["parts"])
    alone = sdpa.paged_attention(q, kc, vc, private, lens, **kw)
    tol = 2e-3 if qdt == np.float16 else 3e-6
    np.testing.assert_allclose(out.astype(np.float32), alone.astype(np.float32), rtol=tol, atol=tol)


def test_mla_latent_cache_as_a_view(rng):
    """DeepSeek-style absorbed decoding: V is the first Ev columns of the cached latent."""
    latent = rng.standard_normal((6, 1, 16, 72)).astype(BF16)
    q = rng.standard_normal((2, 16, 1, 72)).astype(BF16)
    bt = np.array([[3, 1, 4], [0, 5, -1]], np.int32)
    lens = np.array([40, 20])
    out = sdpa.paged_attention(q, latent, latent[..., :64], bt, lens, scale=0.1)
    ref, _ = reference_of(q, latent, latent[..., :64], bt, lens, scale=0.1)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=8e-3, atol=8e-3)
    # the contiguous call takes a column view too
    k = contiguous(latent, bt[0], 40)[None]
    one = sdpa.scaled_dot_product_attention(q[:1], k, k[..., :64], scale=0.1, enable_gqa=True)
    np.testing.assert_allclose(one.astype(np.float64), ref[:1], rtol=8e-3, atol=8e-3)


def test_results_do_not_depend_on_the_thread_count(rng):
    for L in (1, 30):
        q, kc, vc, bt, lens = problem(rng, B=4, L=L, bs=16, max_len=3000)
        one = sdpa.paged_attention(q, kc, vc, bt, lens, num_threads=1)
        for n in (2, 3):
            np.testing.assert_array_equal(sdpa.paged_attention(q, kc, vc, bt, lens, num_threads=n), one)


def test_out_and_inputs(rng):
    q, kc, vc, bt, lens = problem(rng, L=2)
    before = [a.copy() for a in (q, kc, vc, bt, lens)]
    out = np.empty((3, 8, 2, 32), np.float32)
    got = sdpa.paged_attention(q, kc, vc, bt, lens, out=out)
    assert got is out
    np.testing.assert_array_equal(out, sdpa.paged_attention(q, kc, vc, bt, lens))
    for a, b in zip(before, (q, kc, vc, bt, lens)):
        np.testing.assert_array_equal(a, b)
    # lists work for the tables, and any integer dtype
    np.testing.assert_array_equal(
        sdpa.paged_attention(q, kc, vc, bt.astype(np.int64).tolist(), lens.tolist()), out)


def bad_calls(q, kc, vc, bt, lens):
    nb = kc.shape[0]
    wrong_id = bt.copy()
    wrong_id[1, 0] = nb
    negative = bt.copy()
    negative[0, 0] = -1
    return [
        ({"block_tables": wrong_id}, ValueError, r"block_tables: entry \(1, 0\) is %d" % nb),
        ({"block_tables": negative}, ValueError, r"block_tables: entry \(0, 0\) is -1"),
        ({"seq_lens": lens + bt.shape[1] * kc.shape[2]}, ValueError, "seq_lens: sequence 0 has"),
        ({"seq_lens": np.zeros_like(lens)}, ValueError, "fewer than the 2 query rows"),
        ({"seq_lens": lens[:2]}, ValueError, "seq_lens: expected shape"),
        ({"block_tables": bt.astype(np.float32)}, TypeError, "block_tables: expected integers"),
        ({"query": q[:, :3]}, ValueError, "query: 3 heads"),
        ({"query": q[..., :8]}, ValueError, "key_cache: 32 features"),
        ({"value_cache": vc.astype(np.float64)}, TypeError, "value_cache: dtype float64 differs"),
        ({"key_cache": kc.astype(np.float64), "value_cache": vc.astype(np.float64)}, TypeError, "key_cache: a"),
        ({"value_cache": vc[:2]}, ValueError, "value_cache: shape"),
        ({"key_cache": kc.astype(np.int32), "value_cache": vc.astype(np.int32)}, TypeError, "key_cache: a KV"),
        ({"tree_mask": np.ones((3, 3), bool)}, ValueError, "tree_mask: expected shape"),
        ({"tree_mask": np.ones((2, 2))}, TypeError, "tree_mask: expected bool"),
        ({"window": (1,)}, TypeError, "window"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"sinks": np.ones(5)}, ValueError, "sinks"),
        ({"num_threads": 0}, ValueError, "num_threads"),
        ({"is_causal": "yes"}, TypeError, "is_causal"),
        ({"key_scale": np.ones((1,), np.float32)}, ValueError, "only a quantized cache"),
        ({"out": np.empty((3, 8, 2, 31), np.float32)}, ValueError, "out: expected shape"),
        ({"out": q[:, :, :, :32]}, ValueError, "out: overlaps the memory of query"),
        ({"out": np.full((3, 8, 2, 32), 7.0)}, TypeError, "out: expected dtype float32"),
    ]


def test_bad_input_names_the_argument_and_writes_nothing(rng):
    q, kc, vc, bt, lens = problem(rng, L=2)
    base = {"query": q, "key_cache": kc, "value_cache": vc, "block_tables": bt, "seq_lens": lens}
    for change, error, match in bad_calls(q, kc, vc, bt, lens):
        kw = dict(base, **change)
        out = kw.pop("out", np.full((3, 8, 2, 32), 7.0, np.float32))
        with pytest.raises(error, match=match):
            sdpa.paged_attention(kw.pop("query"), kw.pop("key_cache"), kw.pop("value_cache"),
                                 kw.pop("block_tables"), kw.pop("seq_lens"), out=out, **kw)
        if out.shape == (3, 8, 2, 32) and out.base is None:
            assert (out == 7.0).all()


def test_the_core_refuses_a_block_id_it_would_read(rng):
    """The C core checks the table itself (a caller of the C API has no Python
    checks): SDPA_ERR_BAD_PAGES, nothing written."""
    q, kc, vc, bt, lens = problem(rng, L=1)
    bt = bt.copy()
    bt[2, 0] = kc.shape[0] + 5
    out = np.full((3, 8, 1, 32), 7.0, np.float32)
    call = _core.plain().prepared(True, 0.2, False, None, None, None, False, False)
    with pytest.raises(ValueError, match=r"paged: a block id out of range.*\(sdpa_problem\.block_table\)$"):
        call.run_paged(q, kc, vc, bt, lens, None, None, out)  # the core names the field (sdpa_check)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match=r"paged.*\(sdpa_problem\.key_lengths\)$"):  # longer than its table
        call.run_paged(q, kc, vc, np.ascontiguousarray(bt[:, :1]), lens, None, None, out)
    assert (out == 7.0).all()
    # arrays not in the core's form are declined as the dense entry declines them
    code = call.run_paged(q, kc, vc, bt[:, :1], lens, None, None, out)
    assert _core.reason(code).startswith("block_tables is not native")
    code = call.run_paged(q, kc, vc, bt, lens.astype(np.int32), None, None, out)
    assert _core.reason(code).startswith("seq_lens has a dtype")
    code = call.run_paged(q, kc, vc, bt, lens, (kc, vc), None, out)
    assert _core.reason(code).startswith("key_scale has a value")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16, "int8"])
def test_paged_write(rng, dtype):
    int8 = dtype == "int8"
    store = np.int8 if int8 else dtype
    kc = np.zeros((5, 2, 4, 8), store)
    vc = np.zeros((5, 2, 4, 12), store)
    ks = np.zeros((5, 2, 4, 2), np.float32) if int8 else None
    vs = np.zeros((5, 2, 4, 3), np.float32) if int8 else None
    k = rng.standard_normal((4, 2, 8))
    v = rng.standard_normal((4, 2, 12))
    slots = np.array([13, -1, 0, 19])
    sdpa.paged_write(k, v, kc, vc, slots, key_scale=ks, value_scale=vs)
    got_k = dequantized(kc, ks, 4) if int8 else kc.astype(np.float64)
    got_v = dequantized(vc, vs, 4) if int8 else vc.astype(np.float64)
    tol = 0.02 if int8 or dtype in (np.float16, BF16) else 1e-6
    for t, s in ((0, 13), (2, 0), (3, 19)):
        np.testing.assert_allclose(got_k[s // 4, :, s % 4], k[t], atol=tol, rtol=tol)
        np.testing.assert_allclose(got_v[s // 4, :, s % 4], v[t], atol=tol, rtol=tol)
    assert np.count_nonzero(got_k.any(axis=-1)) == 3 * 2  # the skipped token wrote nothing


def test_a_float64_query_on_a_quantized_cache_is_computed_in_float32(rng):
    """The rule of KVCache.attend: a quantized cache takes a float32 or 16-bit
    query; a float64 one is read as float32, and so is the output."""
    kc = np.zeros((4, 2, 4, 8), np.int8)
    vc = np.zeros((4, 2, 4, 8), np.int8)
    ks = np.zeros((4, 2, 4, 1), np.float32)
    vs = np.zeros((4, 2, 4, 1), np.float32)
    sdpa.paged_write(rng.standard_normal((7, 2, 8)), rng.standard_normal((7, 2, 8)), kc, vc, np.arange(7),
                     key_scale=ks, value_scale=vs)
    q = rng.standard_normal((1, 4, 1, 8))
    bt, lens = np.array([[0, 1]], np.int32), np.array([7])
    got = sdpa.paged_attention(q, kc, vc, bt, lens, key_scale=ks, value_scale=vs)
    want = sdpa.paged_attention(q.astype(np.float32), kc, vc, bt, lens, key_scale=ks, value_scale=vs)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    cache = sdpa.KVCache(1, 2, 8, 8, dtype="int8")
    assert cache.result_dtype(np.float64) == got.dtype


def test_paged_write_checks_everything_first(rng):
    kc = np.zeros((2, 1, 4, 8), np.int8)
    vc = np.zeros((2, 1, 4, 8), np.int8)
    ks = np.zeros((2, 1, 4, 1), np.float32)
    vs = np.zeros((2, 1, 4, 1), np.float32)
    k = rng.standard_normal((3, 1, 8))
    cases = [
        ({"slot_mapping": [0, 1, 8]}, ValueError, "slot_mapping: slot 8 of token 2"),
        ({"slot_mapping": [0, 1, 1]}, ValueError, "two tokens go to one slot"),
        ({"slot_mapping": [0, 1]}, ValueError, "slot_mapping: expected shape"),
        ({"key": np.full((3, 1, 8), np.nan)}, ValueError, "key: an int8 cache holds finite"),
        ({"value": k[:, :, :4]}, ValueError, "value: expected shape"),
        ({"key": k.astype(complex)}, TypeError, "key: dtype complex128 is not supported"),
        ({"key_scale": None}, ValueError, "key_scale, value_scale"),
    ]
    for change, error, match in cases:
        kw = dict({"key": k, "value": k, "slot_mapping": [0, 1, 2], "key_scale": ks, "value_scale": vs}, **change)
        with pytest.raises(error, match=match):
            sdpa.paged_write(kw.pop("key"), kw.pop("value"), kc, vc, kw.pop("slot_mapping"), **kw)
        assert not kc.any() and not vc.any() and not ks.any() and not vs.any()


def test_paged_cache_blocks(rng):
    cache = sdpa.PagedKVCache(num_blocks=6, block_size=4, num_kv_heads=1, head_dim=8)
    a = cache.add_sequence()
    cache.append(a, rng.standard_normal((1, 9, 8)), rng.standard_normal((1, 9, 8)))
    assert cache.seq_len(a) == 9 and len(cache.block_table(a)) == 3 and cache.free_blocks == 3
    b = cache.fork(a)  # shares 2 full blocks, copies the third
    assert cache.block_table(b)[:2] == cache.block_table(a)[:2]
    assert cache.block_table(b)[2] != cache.block_table(a)[2] and cache.free_blocks == 2
    np.testing.assert_array_equal(cache.key_cache[cache.block_table(b)[2]],
                                  cache.key_cache[cache.block_table(a)[2]])
    cache.append(b, np.ones((1, 3, 8)), np.ones((1, 3, 8)))  # fills b's own partial block
    assert cache.free_blocks == 2 and cache.seq_len(a) == 9
    state = (cache.free_blocks, cache.block_table(a), cache.key_cache.copy())
    with pytest.raises(MemoryError, match="more blocks are needed"):
        cache.append(a, np.ones((1, 20, 8)), np.ones((1, 20, 8)))
    with pytest.raises(ValueError, match="value"):
        cache.append(a, np.ones((1, 2, 8)), np.ones((1, 3, 8)))
    assert (cache.free_blocks, cache.block_table(a)) == state[:2] and cache.seq_len(a) == 9
    np.testing.assert_array_equal(cache.key_cache, state[2])
    cache.free(a)  # the shared blocks stay with b
    assert cache.free_blocks == 3
    cache.free(b)
    assert cache.free_blocks == 6
    with pytest.raises(KeyError):
        cache.seq_len(a)
    with pytest.raises(TypeError, match="a KV cache stores"):
        sdpa.PagedKVCache(4, 4, 1, 8, dtype="float8")


def test_paged_cache_attend_matches_the_kv_cache(rng):
    """A continuous-batching loop against one KVCache per sequence."""
    paged = sdpa.PagedKVCache(num_blocks=40, block_size=8, num_kv_heads=2, head_dim=16)
    plain = {}
    for step in range(12):
        if step % 4 == 0:
            s = paged.add_sequence()
            plain[s] = sdpa.KVCache(1, 2, 256, 16)
            n = int(rng.integers(1, 30))
            k, v = rng.standard_normal((2, n, 16)), rng.standard_normal((2, n, 16))
            paged.append(s, k, v)
            plain[s].append(k[None], v[None])
        if step == 7:
            gone = paged.sequences[0]
            paged.free(gone)
            del plain[gone]
        ids = paged.sequences
        for s in ids:
            k, v = rng.standard_normal((2, 1, 16)), rng.standard_normal((2, 1, 16))
            paged.append(s, k, v)
            plain[s].append(k[None], v[None])
        q = rng.standard_normal((len(ids), 4, 1, 16)).astype(np.float32)
        out = paged.attend(ids, q)
        for i, s in enumerate(ids):
            np.testing.assert_allclose(out[i], plain[s].attend(q[i : i + 1])[0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("fold", [1, 0])
@pytest.mark.parametrize("dtype", [np.float32, BF16, "int8"])
def test_large_groups_decode_as_one_query(isa, rng, fold, dtype):
    """Decoding whose GQA group (32 heads: the tiled path) runs as the rows of
    one query (MLA): forced on for every group (1) and off (0), against the
    reference, contiguous and paged, with what keeps it (lse, softcap, key
    lengths, bottom-right) and what stops it (top-left causality, a window,
    ALiBi, sinks)."""
    q, kc, vc, bt, lens = problem(rng, B=2, Hq=64, Hkv=2, L=1, bs=8, max_len=70, dtype=np.float32)
    if dtype == "int8":
        cache = sdpa.PagedKVCache(kc.shape[0], 8, 2, 32, dtype="int8")
        ids = [cache.add_sequence() for _ in range(2)]
        for s, n in zip(ids, lens):
            cache.append(s, rng.standard_normal((2, int(n), 32)), rng.standard_normal((2, int(n), 32)))
        bt, lens = cache.tables(ids)
        kc, vc = cache.key_cache, cache.value_cache
        kw0 = {"key_scale": cache.key_scale, "value_scale": cache.value_scale}
        kf, vf = dequantized(kc, cache.key_scale, 32), dequantized(vc, cache.value_scale, 32)
    else:
        kc, vc, q = kc.astype(dtype), vc.astype(dtype), q.astype(dtype)
        kw0, kf, vf = {}, kc, vc
    slopes = rng.uniform(0.1, 0.5, 64).astype(np.float32)
    _core.set_fold_group(fold)
    try:
        for kw in ({}, {"softcap": 2.0}, {"is_causal": False}, {"window": (9, 0)}, {"alibi_slopes": slopes},
                   {"sinks": np.ones(64, np.float32)}):
            out, lse = sdpa.paged_attention(q, kc, vc, bt, lens, return_lse=True, **kw0, **kw)
            ref, ref_lse = reference_of(q, kf, vf, bt, lens, **kw)
            tol = tolerance(q.dtype, 32)
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol, err_msg=str(kw))
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5, err_msg=str(kw))
        if dtype != "int8":  # contiguous: bottom-right sees every key, top-left the first
            k = np.stack([contiguous(kc, bt[b], int(lens.min())) for b in range(2)])
            v = np.stack([contiguous(vc, bt[b], int(lens.min())) for b in range(2)])
            for causal in ("bottom_right", "top_left", False):
                out = sdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                        key_lengths=np.array([lens.min(), 5]))
                ref = reference.scaled_dot_product_attention(
                    q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), is_causal=causal,
                    enable_gqa=True, key_lengths=np.array([lens.min(), 5]))
                tol = tolerance(q.dtype, 32)
                np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol, err_msg=causal)
    finally:
        _core.set_fold_group(None)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_example_paged_server_runs(dtype):
    """examples/paged_server.py at a small size: its own check passes and every
    block returns to the pool."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "paged_server.py"
    args = ["--requests", "6", "--blocks", "96", "--block-size", "8", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--system-prompt", "40", "--max-prompt", "30", "--max-new", "5",
            "--chunk", "16", "--max-batch", "3", "--dtype", dtype, "--threads", "2"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout and "all blocks back in the pool: True" in proc.stdout


@pytest.mark.parametrize("dtype", [np.float32, BF16, "int8"])
def test_latent_caches_store_and_read_the_latent_once(rng, dtype):
    """MLA: a latent PagedKVCache and KVCache keep one array; the values are
    the keys' first head_dim_v features, and attention over them matches the
    same call with the values copied out."""
    paged = sdpa.PagedKVCache(16, 8, 1, 48, head_dim_v=32, dtype=dtype, latent=True, group_size=16
                              if dtype == "int8" else None)
    plain = sdpa.KVCache(1, 1, 64, 48, head_dim_v=32, dtype=dtype, latent=True, group_size=16
                         if dtype == "int8" else None)
    assert np.shares_memory(paged.value_cache, paged.key_cache) and plain.latent
    # one array of (capacity 64) x 48 features, and int8's scales (3 groups of 16): no values of their own
    assert plain.nbytes == 64 * 48 * plain.key_data.dtype.itemsize + (64 * 3 * 4 if dtype == "int8" else 0)
    s = paged.add_sequence()
    for n in (30, 1, 9):
        lat = rng.standard_normal((1, n, 48))
        paged.append(s, lat)
        plain.append(lat[None])
    with pytest.raises(ValueError, match="latent cache takes the keys only"):
        paged.append(s, lat, lat[:, :, :32])
    with pytest.raises(ValueError, match="latent cache takes the keys only"):
        plain.append(lat[None], lat[None, :, :, :32])
    t = paged.fork(s)
    q = rng.standard_normal((2, 16, 1, 48)).astype(np.float32)
    out = paged.attend([s, t], q, scale=0.2)
    np.testing.assert_allclose(plain.values, plain.keys[..., :32])
    ref = reference.scaled_dot_product_attention(q.astype(np.float64), plain.keys.astype(np.float64),
                                                 plain.values.astype(np.float64), scale=0.2, enable_gqa=True)
    np.testing.assert_allclose(out, ref, rtol=3e-5, atol=3e-5)  # the fork holds the same positions
    np.testing.assert_allclose(plain.attend(q[:1], scale=0.2), ref[:1], rtol=3e-5, atol=3e-5)
    sc = None if dtype != "int8" else paged.key_scale
    before = paged.key_cache.copy()
    with pytest.raises(ValueError, match="value: None only for a latent cache"):
        sdpa.paged_write(np.ones((1, 1, 48)), None, paged.key_cache, paged.key_cache.copy()[..., :32], [0],
                         key_scale=sc, value_scale=None if sc is None else sc[..., :2].copy())
    np.testing.assert_array_equal(paged.key_cache, before)


def test_bfloat16_pairs_with_narrow_heads_over_short_blocks(isa, rng):
    """E = 8 (4 pairs, fewer than a tile's): paired keys packed for the call
    without the tiles' padding, which the query panels have no room for."""
    q, kc, vc, bt, lens = problem(rng, B=2, Hq=4, Hkv=2, L=32, E=8, bs=16, max_len=90, dtype=BF16)
    for mode in ("always", "never", "rule"):
        _core.set_packing(mode)
        try:
            out = sdpa.paged_attention(q, kc, vc, bt, lens)
        finally:
            _core.set_packing("rule")
        ref, _ = reference_of(q, kc, vc, bt, lens)
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=8e-3, atol=8e-3, err_msg=mode)


def test_int8_groups_as_wide_as_one_head_dim(rng):
    """group_size = head_dim_v < head_dim: one value scale a row, two key scales."""
    for e, ev in ((128, 64), (64, 128)):
        cache = sdpa.PagedKVCache(8, 16, 1, e, head_dim_v=ev, dtype="int8", group_size=64)
        s = cache.add_sequence()
        cache.append(s, rng.standard_normal((1, 20, e)), rng.standard_normal((1, 20, ev)))
        q = rng.standard_normal((1, 2, 1, e)).astype(np.float32)
        bt, lens = cache.tables([s])
        ref, _ = reference_of(q, dequantized(cache.key_cache, cache.key_scale, 64),
                              dequantized(cache.value_cache, cache.value_scale, 64), bt, lens)
        np.testing.assert_allclose(cache.attend([s], q), ref, rtol=2e-5, atol=2e-5)


def test_a_failed_append_leaves_the_pool_as_it_was(rng):
    cache = sdpa.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8, dtype="int8")
    s = cache.add_sequence()
    cache.append(s, rng.standard_normal((1, 5, 8)), rng.standard_normal((1, 5, 8)))
    free = list(cache._free)
    bad = rng.standard_normal((1, 9, 8))
    bad[0, 7, 3] = np.nan  # refused after the blocks were taken
    with pytest.raises(ValueError, match="finite"):
        cache.append(s, bad, bad)
    assert cache._free == free and cache.seq_len(s) == 5 and (cache._refs[free] == 0).all()
    t = cache.add_sequence()
    cache.append(t, rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 4, 8)))
    assert cache.block_table(t) == [free[-1]]


def test_tables_with_no_columns(rng):
    q = rng.standard_normal((2, 2, 1, 8)).astype(np.float32)
    kc = rng.standard_normal((3, 1, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="seq_lens: sequence 0 has 5 positions; its table holds 0 blocks"):
        sdpa.paged_attention(q, kc, kc, np.zeros((2, 0), np.int32), np.array([5, 5]))
    out = sdpa.paged_attention(q[:, :, :0], kc, kc, np.zeros((2, 0), np.int32), np.array([0, 0]))
    assert out.shape == (2, 2, 0, 8)


def test_paged_write_and_latent_caches(rng):
    kc = np.zeros((2, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="is a latent cache: pass value=None"):
        sdpa.paged_write(np.ones((1, 1, 8)), np.ones((1, 1, 4)), kc, kc[..., :4], [0])
    q8 = np.zeros((2, 1, 4, 8), np.int8)
    ks = np.zeros((2, 1, 4, 2), np.float32)
    with pytest.raises(ValueError, match="value_scale of key_scale"):
        sdpa.paged_write(np.ones((1, 1, 8)), None, q8, q8[..., :4], [0], key_scale=ks,
                         value_scale=ks[..., :1].copy())
    assert not kc.any() and not q8.any() and not ks.any()
    sdpa.paged_write(np.full((1, 1, 8), 2.0), None, q8, q8[..., :4], [5], key_scale=ks, value_scale=ks[..., :1])
    np.testing.assert_allclose(dequantized(q8, ks, 4)[1, 0, 1], 2.0)


def test_tree_masks_over_forks_of_one_prompt(rng):
    """Speculative verification of several forks at once: the shared prompt read
    once, the tree over each fork's last L positions, merged exactly."""
    cache = sdpa.PagedKVCache(64, 8, 2, 16)
    root = cache.add_sequence()
    cache.append(root, rng.standard_normal((2, 50, 16)), rng.standard_normal((2, 50, 16)))
    ids = [cache.fork(root) for _ in range(3)]
    L = 5
    for s in ids:
        cache.append(s, rng.standard_normal((2, 7, 16)), rng.standard_normal((2, 7, 16)))
    tree = np.tril(rng.random((3, L, L)) < 0.5)
    tree[:, np.arange(L), np.arange(L)] = True
    q = rng.standard_normal((3, 4, L, 16)).astype(np.float32)
    seen = []
    _core.set_observer(lambda arrays: seen.append(arrays["q"].shape))
    try:
        out = cache.attend(ids, q, tree_mask=tree, softcap=5.0)
    finally:
        _core.set_observer(None)
    assert seen == [(3, 4, L, 16)]  # one core call
    bt, lens = cache.tables(ids)
    plan = paged_plan(q, cache.key_cache, cache.value_cache, bt, lens, tree_mask=tree, softcap=5.0)
    shared = [p for p in plan["parts"] if p["members"]]
    assert len(shared) == 1 and shared[0]["members"] == 3 and shared[0]["rows"] == 3 * 2 * L
    assert sum(p["tree"] for p in plan["parts"]) == 3 and plan["merges"] == 3
    ref, _ = reference_of(q, cache.key_cache, cache.value_cache, bt, lens, tree=tree, softcap=5.0)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- promises on the edges

QUANTIZED = ["int8", "int4", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("name", QUANTIZED + ["float32"])
@pytest.mark.parametrize("latent", [False, True])
def test_writes_with_no_token_to_store_change_nothing(rng, name, latent):
    """An append of no positions, and paged_write with no token or with every
    slot negative, are accepted by every cache dtype and write nothing."""
    cache = sdpa.PagedKVCache(4, 4, 2, 8, dtype=name, latent=latent)
    s = cache.add_sequence()
    cache.append(s, rng.standard_normal((2, 3, 8)), None if latent else rng.standard_normal((2, 3, 8)))
    arrays = [a for a in (cache.key_cache, cache.value_cache, cache.key_scale, cache.value_scale) if a is not None]
    before = [a.copy() for a in arrays]
    cache.append(s, np.zeros((2, 0, 8), np.float32), None if latent else np.zeros((2, 0, 8), np.float32))
    assert cache.seq_len(s) == 3 and cache.block_table(s) == [0]
    store = dict(key_scale=cache.key_scale, value_scale=cache.value_scale, kv_dtype=cache.kv_dtype)
    for T, slots in ((0, np.zeros(0, np.int64)), (2, np.array([-1, -1])), (1, [-5])):
        k = rng.standard_normal((T, 2, 8))
        sdpa.paged_write(k, None if latent else k, cache.key_cache, cache.value_cache, slots, **store)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32, np.int64])
def test_a_slot_past_the_caches_is_refused_whatever_its_integer_type(rng, dtype):
    """A uint64 slot beyond int64 does not wrap to a negative (skipped) slot."""
    kc = np.zeros((4, 1, 16, 8), np.float32)
    vc = np.zeros((4, 1, 16, 8), np.float32)
    k = rng.standard_normal((2, 1, 8))
    big = {np.uint64: 2**63 + 5, np.uint32: 2**32 - 1, np.int64: 2**62}[dtype]
    with pytest.raises(ValueError, match=f"slot_mapping: slot {big} of token 0 is past the caches' 64 slots"):
        sdpa.paged_write(k, k, kc, vc, np.array([big, 1], dtype))
    assert not kc.any() and not vc.any()
    q = np.ones((1, 1, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"seq_lens: entry 0 is 9223372036854775813, beyond int64"):
        sdpa.paged_attention(q, kc, vc, [[0]], np.array([2**63 + 5], np.uint64))
    with pytest.raises(ValueError, match=r"cu_seqlens_q: entry 1 is 9223372036854775813, beyond int64"):
        sdpa.varlen_attention(np.ones((1, 1, 8), np.float32), k[:1], k[:1], np.array([0, 2**63 + 5], np.uint64),
                              [0, 1])


def test_ml_dtypes_int4_arrays_are_not_an_int4_cache(rng):
    """ml_dtypes.int4 holds one unscaled value a byte: refused by name, with a
    pointer to the packed layout, before anything is written."""
    kc = np.zeros((4, 1, 16, 4), ml_dtypes.int4)
    vc = np.zeros((4, 1, 16, 4), ml_dtypes.int4)
    k = np.array([[[10.0, 0.7, -3.2, 100.0]]], np.float32)
    with pytest.raises(TypeError, match="key_cache: an int4 cache is packed, two values a byte, in uint8"):
        sdpa.paged_write(k, k, kc, vc, np.array([0]))
    assert not kc.view(np.uint8).any()
    q = np.ones((1, 1, 1, 4), np.float32)
    with pytest.raises(TypeError, match="key_cache: an int4 cache is packed"):
        sdpa.paged_attention(q, kc, vc, [[0]], [1])
    with pytest.raises(TypeError, match="key_cache: an int4 cache is stored as uint8"):
        sdpa.paged_attention(q, kc, vc, [[0]], [1], kv_dtype="int4")
    u8 = np.zeros((4, 1, 16, 4), np.uint8)
    with pytest.raises(TypeError, match="key_cache: a uint8 cache holds float8 or int4 values: name which"):
        sdpa.paged_attention(q, u8, u8, [[0]], [1])


@pytest.mark.parametrize("store", [np.float32, np.float16, np.uint8])
def test_kv_dtype_int8_needs_int8_caches(rng, store):
    """kv_dtype names what the caches hold: "int8" over caches of another dtype
    is refused as "int4" and the float8 names are, not ignored."""
    kc = np.zeros((4, 1, 16, 8), store)
    q = np.ones((1, 1, 1, 8), np.float32)
    with pytest.raises(TypeError, match="key_cache: an int8 cache is stored as int8"):
        sdpa.paged_attention(q, kc, kc.copy(), [[0]], [1], kv_dtype="int8")
    with pytest.raises(TypeError, match="key_cache: an int8 cache is stored as int8"):
        sdpa.paged_write(np.ones((1, 1, 8)), np.ones((1, 1, 8)), kc, kc.copy(), [0], kv_dtype="int8")
    assert not kc.any()
    k8 = np.zeros((4, 1, 16, 8), np.int8)
    s8 = np.ones((4, 1, 16, 1), np.float32)
    out = sdpa.paged_attention(q, k8, k8.copy(), [[0]], [1], kv_dtype="int8", key_scale=s8, value_scale=s8.copy())
    assert out.shape == (1, 1, 1, 8)


def test_integer_pv_with_forks_is_each_sequence_alone_bit_for_bit(rng):
    """integer_pv rounds P in runs of a tile's keys: forks of one prompt are
    computed each on its own keys (shared blocks are not merged), so each
    gets the bits of its own call."""
    for name in ("int8", "int4"):
        cache = sdpa.PagedKVCache(64, 16, 1, 64, dtype=name)
        a = cache.add_sequence()
        cache.append(a, rng.standard_normal((1, 40, 64)), rng.standard_normal((1, 40, 64)))
        ids = [a, cache.fork(a), cache.fork(a)]
        cache.append(ids[1], rng.standard_normal((1, 3, 64)), rng.standard_normal((1, 3, 64)))
        q = rng.standard_normal((3, 8, 1, 64)).astype(np.float32)
        batched = cache.attend(ids, q, integer_pv=True)
        for i, s in enumerate(ids):
            np.testing.assert_array_equal(batched[i : i + 1], cache.attend([s], q[i : i + 1], integer_pv=True))


def test_byte_swapped_and_mixed_float8_caches_are_refused_by_name(rng):
    q = np.ones((1, 1, 1, 8), np.float32)
    swapped = np.zeros((4, 1, 16, 8), ">f4")
    with pytest.raises(TypeError, match="key_cache: expected native byte order"):
        sdpa.paged_attention(q, swapped, swapped.copy(), [[0]], [1])
    e4 = np.zeros((4, 1, 16, 8), ml_dtypes.float8_e4m3fn)
    e5 = np.zeros((4, 1, 16, 8), ml_dtypes.float8_e5m2)
    with pytest.raises(TypeError, match="value_cache: dtype float8_e5m2 differs from key_cache's float8_e4m3fn"):
        sdpa.paged_attention(q, e4, e5, [[0]], [1])


def test_flags_of_a_paged_call_are_bools(rng):
    """is_causal and return_lse of a paged call take bools (NumPy's too), not
    other truthy values: a paged row's position is its sequence's, and an lse
    asked for by accident would change the result's type."""
    q, kc, vc, bt, lens = problem(rng, L=1)
    for name in ("is_causal", "return_lse"):
        for bad in (1, "no", None):
            with pytest.raises(TypeError, match=f"^{name}: expected a bool"):
                sdpa.paged_attention(q, kc, vc, bt, lens, **{name: bad})
    out, lse = sdpa.paged_attention(q, kc, vc, bt, lens, return_lse=np.True_)
    np.testing.assert_array_equal(out, sdpa.paged_attention(q, kc, vc, bt, lens))
