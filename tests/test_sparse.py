"""Sparse attention: sparse_attention and paged_attention(topk_indices=).

Every result is checked against the float64 reference written from the
definition (``sdpa.reference.sparse_attention``: each row's listed keys
gathered, then plain attention), over the values a cache computes with (a
quantized cache's dequantized copies), on every kernel set and cache dtype.
"""
import numpy as np
import pytest

import sdpa
from sdpa import reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

CACHE_DTYPES = ["float32", "float16", "bfloat16", "float64", "int8", "int4", "float8_e4m3fn", "float8_e5m2"]


def cache_of(rng, dtype, B, Hkv, S, E, Ev=None, latent=False):
    """A filled KVCache of ``dtype`` and the arrays sparse_attention takes from
    it: key, value, their scales and kv_dtype."""
    Ev = E if Ev is None else Ev
    cache = sdpa.KVCache(B, Hkv, S, E, None if latent else Ev, dtype=BF16 if dtype == "bfloat16" else dtype,
                         latent=latent)
    k = rng.standard_normal((B, Hkv, S, E)).astype(np.float64 if dtype == "float64" else np.float32)
    cache.append(k, None if latent else rng.standard_normal((B, Hkv, S, Ev)).astype(k.dtype))
    key, value = cache.key_data, cache.value_data
    if latent:
        value = key[..., : Ev // (2 if dtype == "int4" else 1)]
    return cache, dict(key=key, value=value, key_scale=cache.key_scales,
                       value_scale=cache.key_scales if latent else cache.value_scales, kv_dtype=cache.format.kv_dtype)


def run(q, cache_kw, idx, **kw):
    c = dict(cache_kw)
    return sdpa.sparse_attention(q, c.pop("key"), c.pop("value"), idx, **c, **kw)


def tol(dtype, qdtype=np.float32):
    if dtype == "float64":
        return 1e-12
    if dtype in ("float16", "bfloat16") or qdtype == BF16:
        return 2e-2
    return 2e-5


def random_indices(rng, shape, S, invalid=0.2):
    idx = rng.integers(0, S, shape)
    idx[rng.random(shape) < invalid] = -1
    return idx


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("shared", [True, False])
def test_every_cache_dtype_against_the_reference(isa, rng, dtype, shared):
    """GQA (8 query heads over 2), L = 3 rows each with its own list, -1
    entries, a repeated position, an empty row; lists shared by all heads or
    one per key/value head."""
    B, Hq, Hkv, L, S, E, k = 2, 8, 2, 3, 40, 16, 9
    cache, kw = cache_of(rng, dtype, B, Hkv, S, E)
    qdt = np.float64 if dtype == "float64" else np.float32
    q = rng.standard_normal((B, Hq, L, E)).astype(qdt)
    idx = random_indices(rng, (B, 1 if shared else Hkv, L, k), S)
    idx[0, 0, 1, :4] = 7  # a position listed four times counts four times
    idx[1, -1, 2, :] = -1  # a row (of some heads) with nothing to see
    out, lse = run(q, kw, idx, return_lse=True)
    ref, ref_lse = reference.sparse_attention(q, cache.keys, cache.values, idx, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    np.testing.assert_allclose(out, ref, rtol=tol(dtype), atol=tol(dtype))
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol(dtype), atol=tol(dtype))
    empty = (idx < 0).all(-1)  # (B, Hi, L)
    heads = np.repeat(empty, Hq // idx.shape[1], axis=1)
    assert heads.any() and not out[heads].any() and np.isneginf(lse[heads]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4", "float8_e4m3fn"])
def test_latent_value_view_of_the_key(isa, rng, dtype):
    """MLA: one latent head, the value a column view of the key; 16 query heads."""
    B, Hq, L, S, E, Ev, k = 1, 16, 2, 30, 24, 16, 12
    cache, kw = cache_of(rng, dtype, B, 1, S, E, Ev, latent=True)
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    idx = random_indices(rng, (B, 1, L, k), S)
    out = run(q, kw, idx, scale=0.3)
    ref = reference.sparse_attention(q, cache.keys, cache.keys[..., :Ev], idx, scale=0.3)
    np.testing.assert_allclose(out, ref, rtol=tol(dtype), atol=tol(dtype))


def test_equals_dense_attention_over_the_gathered_keys(rng):
    """With distinct valid entries, the dense call over the gathered keys."""
    q = rng.standard_normal((3, 4, 1, 32)).astype(np.float32)
    key = rng.standard_normal((3, 4, 100, 32)).astype(np.float32)
    value = rng.standard_normal((3, 4, 100, 32)).astype(np.float32)
    idx = np.stack([rng.permutation(100)[:20] for _ in range(3)])[:, None, None, :]
    out = sdpa.sparse_attention(q, key, value, idx, softcap=4.0)
    for b in range(3):
        dense = sdpa.scaled_dot_product_attention(q[b], key[b][:, idx[b, 0, 0]], value[b][:, idx[b, 0, 0]],
                                                  softcap=4.0)
        np.testing.assert_allclose(out[b], dense, rtol=1e-6, atol=1e-6)


def test_sinks_and_rows_that_see_nothing(rng):
    """A row with no valid entry gives 0 and the sink as its lse, as the
    dense call gives a row that sees no key; other rows count the sink."""
    B, Hq, Hkv, L, S, E = 2, 4, 2, 2, 10, 8
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    key = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    value = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    sinks = rng.standard_normal((B, Hq)).astype(np.float32)
    idx = rng.integers(0, S, (B, Hkv, L, 5))
    idx[1, 0, 0] = -1
    out, lse = sdpa.sparse_attention(q, key, value, idx, sinks=sinks, return_lse=True)
    ref, ref_lse = reference.sparse_attention(q, key, value, idx, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    assert not out[1, :2, 0].any()
    np.testing.assert_array_equal(lse[1, :2, 0], sinks[1, :2])
    dense = sdpa.scaled_dot_product_attention(q[1:, :1, :1], key[1:, :1], value[1:, :1], sinks=sinks[1:, :1],
                                              attn_mask=np.zeros((1, S), bool), return_lse=True)
    np.testing.assert_array_equal(dense[1][0, 0, 0], lse[1, 0, 0])


def test_batch_dims_broadcast_indices_and_out(rng):
    """Two batch dims; the indices broadcast over the first; out= is written
    and returned."""
    q = rng.standard_normal((2, 3, 4, 2, 16)).astype(np.float32)
    key = rng.standard_normal((2, 3, 2, 50, 16)).astype(np.float32)
    value = rng.standard_normal((2, 3, 2, 50, 8)).astype(np.float32)
    idx = random_indices(rng, (3, 1, 2, 6), 50).astype(np.int32)
    out = np.full((2, 3, 4, 2, 8), np.nan, np.float32)
    got, lse = sdpa.sparse_attention(q, key, value, idx, out=out, return_lse=True)
    assert got is out and lse.shape == (2, 3, 4, 2)
    ref = reference.sparse_attention(q, key, value, idx)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_strided_caches_are_read_as_they_lie(rng):
    """A cache that is a slice of a longer one, heads before positions or
    not, a layout whose slices are no whole number of rows apart, reversed
    positions and heads, lists read backwards, one cache broadcast over the
    batch: all read where they lie, the same results."""
    big = rng.standard_normal((2, 64, 3, 16)).astype(np.float32)  # (B, S, H, E): positions before heads
    key = big[:, :50].transpose(0, 2, 1, 3)  # (B, H, S, E), row stride 3 * 16
    value = rng.standard_normal((2, 3, 60, 8)).astype(np.float32)[:, :, :50]
    q = rng.standard_normal((2, 6, 1, 16)).astype(np.float32)
    idx = random_indices(rng, (2, 3, 1, 7), 50)
    ref = reference.sparse_attention(q, key, value, idx)
    np.testing.assert_allclose(sdpa.sparse_attention(q, key, value, idx), ref, rtol=2e-5, atol=2e-5)
    odd = np.lib.stride_tricks.as_strided(big, (2, 3, 10, 16), (big.strides[0] + 4, 64, 3 * 64, 4))
    q1 = rng.standard_normal((2, 3, 1, 16)).astype(np.float32)
    i1 = random_indices(rng, (2, 1, 1, 4), 10)
    np.testing.assert_allclose(sdpa.sparse_attention(q1, odd, odd, i1),
                               reference.sparse_attention(q1, odd, odd, i1), rtol=2e-5, atol=2e-5)
    rk, rv = key[:, ::-1, ::-1], value[:, :, ::-1]  # negative head and position strides
    ri = idx[..., ::-1]
    np.testing.assert_allclose(sdpa.sparse_attention(q, rk, rv, ri), reference.sparse_attention(q, rk, rv, ri),
                               rtol=2e-5, atol=2e-5)
    one_k, one_v = np.broadcast_to(key[:1], key.shape), np.broadcast_to(value[:1], value.shape)  # batch stride 0
    np.testing.assert_allclose(sdpa.sparse_attention(q, one_k, one_v, idx),
                               reference.sparse_attention(q, one_k, one_v, idx), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_rows_that_share_positions(rng, shared):
    """Prefill rows whose lists share most positions within groups of rows
    (read once for the group, as a shared prefix) and add their own, one
    row listing a shared position twice: the reference's result, on 1 and 3
    threads alike."""
    B, Hq, Hkv, L, S, E = 1, 4, 2, 150, 400, 16
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    key = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    value = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    idx = np.empty((B, 1 if shared else Hkv, L, 40), np.int64)
    for l0 in range(0, L, 50):
        common = rng.choice(S, 30, replace=False)
        for l in range(l0, min(l0 + 50, L)):
            idx[0, :, l] = np.concatenate([common, rng.choice(S, 10)])
    idx[0, 0, 3, 5] = idx[0, 0, 3, 6]
    idx[0, 0, 7, :4] = -1
    ref, ref_lse = reference.sparse_attention(q, key, value, idx, return_lse=True)
    outs = [sdpa.sparse_attention(q, key, value, idx, return_lse=True, num_threads=t) for t in (1, 3)]
    np.testing.assert_allclose(outs[0][0], ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(outs[0][1], ref_lse, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_result_does_not_depend_on_the_thread_count(rng, dtype):
    """Bit for bit on 1, 2, 3 and 8 threads, lists long enough to be split."""
    B, Hq, Hkv, L, S, E, k = 2, 8, 2, 2, 3000, 32, 1500
    cache, kw = cache_of(rng, dtype, B, Hkv, S, E)
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    idx = random_indices(rng, (B, 1, L, k), S)
    outs = [run(q, kw, idx, num_threads=t, return_lse=True) for t in (1, 2, 3, 8)]
    for o, lse in outs[1:]:
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(lse, outs[0][1])


def test_bad_input_is_refused_by_name_and_nothing_is_written(rng):
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    key = rng.standard_normal((1, 2, 10, 8)).astype(np.float32)
    value = rng.standard_normal((1, 2, 10, 8)).astype(np.float32)
    out = np.full((1, 4, 2, 8), 7.0, np.float32)
    before = [a.copy() for a in (q, key, value)]
    good = np.zeros((1, 1, 2, 3), np.int64)
    cases = [
        (dict(indices=np.full((1, 1, 2, 3), -2)), ValueError, r"indices: entry \(0, 0, 0, 0\) is -2, not a position"),
        (dict(indices=np.full((1, 1, 2, 3), 10)), ValueError, r"indices: entry .* is 10, not a position in \[0, 10\)"),
        (dict(indices=good.astype(np.float32)), TypeError, "indices: expected integers"),
        (dict(indices=good.astype(np.int16)), TypeError, "indices: expected int32 or int64"),
        (dict(indices=np.zeros((1, 3, 2, 3), np.int64)), ValueError,
         r"indices: expected shape \(\.\.\., 2 or 1, 2, k\)"),
        (dict(indices=np.zeros((1, 1, 5, 3), np.int64)), ValueError, "indices: expected shape"),
        (dict(indices=np.zeros((3, 1, 2, 3), np.int64)), ValueError, "indices: batch dims"),
        (dict(key=key[:, :, :, :4]), ValueError, "key: 4 features a key, the query has 8"),
        (dict(key=key.astype(np.float64), value=value.astype(np.float64)), TypeError, "key: a float32 query attends"),
        (dict(key=key.astype(np.float64)), TypeError, "value: dtype float32 differs from key.s float64"),
        (dict(value=value[:, :, :5]), ValueError, "value: shape"),
        (dict(key=key.astype(np.int8)), ValueError, "key_scale, value_scale"),
        (dict(query=q[:, :3]), ValueError, "query: 3 heads is not a multiple of key's 2"),
        (dict(sinks=np.zeros(3)), ValueError, "sinks"),
        (dict(return_lse=1), TypeError, "return_lse: expected a bool"),
        (dict(out=out[..., :4]), ValueError, "out: expected shape"),
    ]
    for change, exc, msg in cases:
        kw = dict(query=q, key=key, value=value, indices=good, out=out)
        kw.update(change)
        if "int8" in str(kw["key"].dtype):
            kw["value"] = value.astype(np.int8)
        with pytest.raises(exc, match=msg):
            sdpa.sparse_attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), kw.pop("indices"), **kw)
        assert (out == 7.0).all()
    for a, b in zip((q, key, value), before):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_never_written(rng):
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    key = rng.standard_normal((1, 2, 20, 8)).astype(np.float32)
    idx = random_indices(rng, (1, 2, 3, 5), 20)
    copies = [a.copy() for a in (q, key, idx)]
    sdpa.sparse_attention(q, key, key, idx)
    for a, b in zip((q, key, idx), copies):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- paged_attention(topk_indices=)


def paged_problem(rng, dtype, lens, Hkv=2, E=16, bs=4, latent=False):
    """A PagedKVCache of ``dtype`` holding sequences of these lengths, and the
    float values each sequence computes with, (Hkv, n, E) and (Hkv, n, Ev)."""
    from sdpa.kvcache import dequantize

    cache = sdpa.PagedKVCache(sum(-(-n // bs) for n in lens) + 3, bs, Hkv, E, dtype=BF16 if dtype == "bfloat16"
                              else dtype, latent=latent)
    ids = [cache.add_sequence() for _ in lens]
    for s, n in zip(ids, lens):
        cache.append(s, rng.standard_normal((Hkv, n, E)), None if latent else rng.standard_normal((Hkv, n, E)))
    bt, sl = cache.tables(ids)
    code = cache.format.code

    def values(pool, scales):
        if code:
            return dequantize(code, pool, scales)
        return pool.astype(np.float64)

    kf, vf = values(cache.key_cache, cache.key_scale), values(cache.value_cache, cache.value_scale)
    seqs = []
    for b, n in enumerate(lens):
        blocks = [bt[b, j] for j in range(-(-n // bs))]
        seqs.append((np.concatenate([kf[x] for x in blocks], axis=1)[:, :n],
                     np.concatenate([vf[x] for x in blocks], axis=1)[:, :n]))
    return cache, bt, sl, seqs


def paged_expected(q_rows, seqs, seq_of_row, own, idx_rows, causal, **kw):
    """Each row's reference over its sequence, later positions dropped when causal."""
    outs, lses = [], []
    for r in range(q_rows.shape[0]):
        k, v = seqs[seq_of_row[r]]
        ix = idx_rows[r].copy()
        if causal:
            ix[ix > own[r]] = -1
        sinks = kw.get("sinks")
        o, lse = reference.sparse_attention(q_rows[r][None, :, None], k[None], v[None], ix[None, :, None],
                                            return_lse=True, scale=kw.get("scale"), softcap=kw.get("softcap"),
                                            sinks=None if sinks is None else sinks[seq_of_row[r]])
        outs.append(o[0, :, 0])
        lses.append(lse[0, :, 0])
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("dtype", CACHE_DTYPES[:3] + CACHE_DTYPES[4:])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_topk_against_the_reference(isa, rng, dtype, causal):
    """Three sequences, two rows each (chunked prefill), lists per key/value
    head with -1s, repeats and positions after the row's own."""
    lens = [9, 17, 6]
    cache, bt, sl, seqs = paged_problem(rng, dtype, lens)
    B, Hq, Hkv, L, k = 3, 4, 2, 2, 8
    q = rng.standard_normal((B, Hq, L, 16)).astype(np.float32)
    idx = np.stack([random_indices(rng, (Hkv, L, k), n) for n in lens])
    idx[0, 0, 0, :3] = 2
    sinks = rng.standard_normal((B, Hq)).astype(np.float32)
    out, lse = sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, topk_indices=idx,
                                    is_causal=causal, key_scale=cache.key_scale, value_scale=cache.value_scale,
                                    kv_dtype=cache.kv_dtype, return_lse=True, sinks=sinks, softcap=3.0)
    rows_q = q.transpose(0, 2, 1, 3).reshape(B * L, Hq, 16)
    own = (np.asarray(lens)[:, None] - L + np.arange(L)).reshape(-1)
    ref, ref_lse = paged_expected(rows_q, seqs, np.repeat(np.arange(B), L), own,
                                  idx.transpose(0, 2, 1, 3).reshape(B * L, Hkv, k), causal, sinks=sinks, softcap=3.0)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3).reshape(B * L, Hq, 16), ref, rtol=tol(dtype),
                               atol=tol(dtype))
    np.testing.assert_allclose(lse.transpose(0, 2, 1).reshape(B * L, Hq), ref_lse, rtol=tol(dtype),
                               atol=tol(dtype))


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_paged_topk_mixed_batch_and_latent(rng, dtype):
    """query_start_loc: a prefill chunk of 3 rows beside a decode, one list
    for all heads; MLA's latent cache."""
    lens = [10, 14]
    cache, bt, sl, seqs = paged_problem(rng, dtype, lens, Hkv=1, E=16, latent=True)
    Ev = cache.value_cache.shape[-1] * (2 if dtype == "int4" else 1)
    seqs = [(k, k[..., :Ev]) for k, _ in seqs]
    qsl = np.array([0, 3, 4])
    q = rng.standard_normal((4, 8, 16)).astype(np.float32)
    idx = np.stack([random_indices(rng, (1, 6), n) for n in (10, 10, 10, 14)])
    out = sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, topk_indices=idx, query_start_loc=qsl,
                               key_scale=cache.key_scale, value_scale=cache.value_scale, kv_dtype=cache.kv_dtype)
    ref, _ = paged_expected(q, seqs, [0, 0, 0, 1], [7, 8, 9, 13], idx, True)
    assert out.shape == (4, 8, Ev)
    np.testing.assert_allclose(out, ref, rtol=tol(dtype), atol=tol(dtype))


def test_paged_topk_threads_and_refusals(rng):
    cache, bt, sl, _ = paged_problem(rng, "float32", [300, 200], bs=16)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    idx = np.stack([random_indices(rng, (1, 1, 150), n) for n in (300, 200)])
    args = (q, cache.key_cache, cache.value_cache, bt, sl)
    outs = [sdpa.paged_attention(*args, topk_indices=idx, num_threads=t) for t in (1, 2, 5)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    bad = idx.copy()
    bad[1, 0, 0, 3] = 200  # past sequence 1's positions
    out = np.full((2, 4, 1, 16), 5.0, np.float32)
    with pytest.raises(ValueError, match=r"topk_indices: entry \(1, 0, 0, 3\) is 200, not a position of its "
                                         r"sequence in \[0, 200\)"):
        sdpa.paged_attention(*args, topk_indices=bad, out=out)
    with pytest.raises(ValueError, match="topk_indices: not with window"):
        sdpa.paged_attention(*args, topk_indices=idx, window=(4, 0))
    with pytest.raises(ValueError, match="topk_indices: expected shape"):
        sdpa.paged_attention(*args, topk_indices=idx[:, :, 0])
    with pytest.raises(TypeError, match="topk_indices: expected int32 or int64"):
        sdpa.paged_attention(*args, topk_indices=idx.astype(np.uint8))
    assert (out == 5.0).all()


# ---------------------------------------------------------------- index_topk


def small_ints(rng, shape, lo=-2, hi=3):
    return rng.integers(lo, hi, shape).astype(np.float32)


def as_keys(k, name):
    if name == "bfloat16":
        return k.astype(BF16)
    if name.startswith("float8"):
        return k.astype(getattr(ml_dtypes, name))
    return k.astype(name)


@pytest.mark.parametrize("name, scaled", [("float32", False), ("bfloat16", False), ("float16", False),
                                          ("float8_e4m3fn", False), ("float8_e4m3fn", True), ("float8_e5m2", False),
                                          ("float8_e5m2", True), ("int8", True)])
def test_index_topk_is_exact_on_exact_scores(isa, rng, name, scaled):
    """Small integer queries, keys and weights (and scales of powers of two):
    every score is exact in float32, so the positions, their order (ties to
    the lower position: there are many) and the scores are the reference's,
    bit for bit; two batch dims, L = 3, causal rows and key lengths."""
    B, Hi, L, S, E, k = (2, 1), 4, 3, 300, 32, 20
    q = small_ints(rng, B + (Hi, L, E))
    kx = small_ints(rng, B + (S, E))
    w = small_ints(rng, B + (L, Hi), 0, 3)
    ks = (2.0 ** rng.integers(-2, 2, B + (S,))).astype(np.float32) if scaled else None
    lens = np.array([[300], [250]])
    for causal in (False, True):
        idx, sc = sdpa.index_topk(q, as_keys(kx, name), w, k, k_scale=ks, key_lengths=lens, is_causal=causal)
        ridx, rsc = reference.index_topk(q, kx, w, k, k_scale=ks, key_lengths=lens, is_causal=causal)
        assert idx.dtype == np.int32 and sc.dtype == np.float32 and idx.shape == B + (L, k)
        np.testing.assert_array_equal(idx, ridx)
        np.testing.assert_array_equal(sc, rsc.astype(np.float32))


def test_index_topk_on_random_scores(rng):
    """Random float32 data: the chosen positions' scores are the reference's
    to float32 accuracy, descending, and no position left out scores above
    the last one kept."""
    q = rng.standard_normal((8, 2, 64)).astype(np.float32)
    kx = rng.standard_normal((5000, 64)).astype(np.float32)
    w = rng.random((2, 8)).astype(np.float32)
    idx, sc = sdpa.index_topk(q, kx, w, 64)
    _, full = reference.index_topk(q, kx, w, 5000)
    ridx, rsc = reference.index_topk(q, kx, w, 64)
    for l in range(2):
        ref_of = dict(zip(ridx[l].tolist(), rsc[l].tolist()))
        exact = (np.maximum(q[:, l].astype(np.float64) @ kx.T.astype(np.float64), 0) * w[l][:, None]).sum(0)
        np.testing.assert_allclose(sc[l], exact[idx[l]], rtol=1e-5, atol=1e-5)
        assert np.all(np.diff(sc[l]) <= 0)
        assert exact[idx[l]].min() >= rsc[l, -1] - 1e-4
        assert len(set(idx[l].tolist()) & set(ref_of)) >= 62
    assert np.isfinite(full).all()


def test_index_topk_padding_nan_and_empty(rng):
    """k beyond the positions a row sees: -1 and -inf; NaN scores come after
    every number; k = 0 and S = 0 give empty or padded results."""
    q = np.ones((1, 2, 4), np.float32)
    kx = np.ones((6, 4), np.float32)
    kx[1] = np.nan
    w = np.ones((2, 1), np.float32)
    idx, sc = sdpa.index_topk(q, kx, w, 8, is_causal=True)
    # row 0 sees positions 0..4 (S - L + 0), row 1 all six
    np.testing.assert_array_equal(idx[0], [0, 2, 3, 4, 1, -1, -1, -1])
    np.testing.assert_array_equal(idx[1], [0, 2, 3, 4, 5, 1, -1, -1])
    assert np.isnan(sc[0, 4]) and np.isneginf(sc[0, 5:]).all() and (sc[0, :4] == 4).all()
    assert sdpa.index_topk(q, kx, w, 0)[0].shape == (2, 0)
    idx, sc = sdpa.index_topk(q, kx, w, 200_000)  # k far past S: padded, no buffer of that size
    assert idx.shape == (2, 200_000) and (idx[:, 6:] == -1).all() and np.isneginf(sc[:, 6:]).all()
    np.testing.assert_array_equal(idx[1, :6], [0, 2, 3, 4, 5, 1])
    idx, sc = sdpa.index_topk(q, kx[:0], w, 3)
    assert (idx == -1).all() and np.isneginf(sc).all()


@pytest.mark.parametrize("name", ["float32", "float8_e4m3fn"])
def test_index_topk_does_not_depend_on_the_thread_count(rng, name):
    """Long rows cut into chunks differently on each count: the same bits."""
    q = rng.standard_normal((16, 1, 64)).astype(np.float32)
    kx = as_keys(rng.standard_normal((20000, 64)).astype(np.float32), name)
    w = rng.random((1, 16)).astype(np.float32)
    ks = rng.random(20000).astype(np.float32) if name != "float32" else None
    outs = [sdpa.index_topk(q, kx, w, 500, k_scale=ks, num_threads=t) for t in (1, 2, 3, 8)]
    for idx, sc in outs[1:]:
        np.testing.assert_array_equal(idx, outs[0][0])
        np.testing.assert_array_equal(sc, outs[0][1])


def test_index_topk_refusals(rng):
    q = np.ones((2, 1, 4), np.float32)
    kx = np.ones((6, 4), np.float32)
    w = np.ones((1, 2), np.float32)
    cases = [
        (dict(k_index=np.ones((6, 5), np.float32)), ValueError, "k_index: 5 features a key, q_index has 4"),
        (dict(k_index=kx.astype(np.float64)), TypeError, "k_index: expected float32"),
        (dict(k_index=kx.astype(np.int8)), ValueError, "k_scale: int8 keys need a scale"),
        (dict(k_scale=np.ones(6, np.float32)), ValueError, "k_scale: only quantized keys"),
        (dict(k_index=kx.astype(np.int8), k_scale=np.ones(5, np.float32)), ValueError, "k_scale: expected shape"),
        (dict(weights=np.ones((2, 1), np.float32)), ValueError, r"weights: expected shape \(\.\.\., 1, 2\)"),
        (dict(k=-1), ValueError, "k"),
        (dict(is_causal=1), TypeError, "is_causal: expected a bool"),
        (dict(q_index=q.astype(np.int32)), TypeError, "q_index: expected float16"),
        (dict(key_lengths=[1, 2, 3]), ValueError, "key_lengths"),
    ]
    for change, exc, msg in cases:
        kw = dict(q_index=q, k_index=kx, weights=w, k=3)
        kw.update(change)
        with pytest.raises(exc, match=msg):
            sdpa.index_topk(kw.pop("q_index"), kw.pop("k_index"), kw.pop("weights"), kw.pop("k"), **kw)


def test_index_select_attend_loop(rng):
    """The README's loop: index, select, attend, one decoding step at a time,
    against dense attention over the selected keys."""
    Hq, Hkv, E, Hi, Ei, S, k = 8, 1, 32, 4, 16, 200, 24
    key = rng.standard_normal((Hkv, S, E)).astype(np.float32)
    value = rng.standard_normal((Hkv, S, E)).astype(np.float32)
    k_index = rng.standard_normal((S, Ei)).astype(np.float32)
    q = rng.standard_normal((Hq, 1, E)).astype(np.float32)
    qi = rng.standard_normal((Hi, 1, Ei)).astype(np.float32)
    w = rng.random((1, Hi)).astype(np.float32)
    idx, _ = sdpa.index_topk(qi, k_index, w, k)
    out = sdpa.sparse_attention(q, key, value, idx[None])
    sel = idx[0]
    dense = sdpa.scaled_dot_product_attention(q, key[:, sel], value[:, sel], enable_gqa=True)
    np.testing.assert_allclose(out, dense, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- torch


def test_torch_sparse_attention_and_indexer(rng):
    torch = pytest.importorskip("torch")
    import sdpa.torch as st

    q = rng.standard_normal((2, 8, 3, 16)).astype(np.float32)
    key = rng.standard_normal((2, 2, 40, 16)).astype(np.float32)
    idx = random_indices(rng, (2, 2, 3, 9), 40)
    want, want_lse = sdpa.sparse_attention(q, key, key, idx, return_lse=True)
    out, lse = st.sparse_attention(torch.from_numpy(q), torch.from_numpy(key), torch.from_numpy(key),
                                   torch.from_numpy(idx), return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    bf = st.sparse_attention(torch.from_numpy(q).bfloat16(), torch.from_numpy(key).bfloat16(),
                             torch.from_numpy(key).bfloat16(), torch.from_numpy(idx))
    assert bf.dtype == torch.bfloat16
    np.testing.assert_allclose(bf.float().numpy(), want, atol=3e-2)
    with pytest.raises(ValueError, match="query: sdpa's sparse attention has no backward"):
        st.sparse_attention(torch.from_numpy(q).requires_grad_(), torch.from_numpy(key), torch.from_numpy(key),
                            torch.from_numpy(idx))
    if hasattr(torch, "float8_e4m3fn"):
        qi = rng.standard_normal((4, 2, 16)).astype(np.float32)
        ki = torch.from_numpy(small_ints(rng, (60, 16))).to(torch.float8_e4m3fn)
        w = np.ones((2, 4), np.float32)
        scale = torch.full((60,), 0.5)
        got = st.index_topk(torch.from_numpy(qi), ki, torch.from_numpy(w), 5, k_scale=scale)
        ref = sdpa.index_topk(qi, ki.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), w, 5,
                              k_scale=scale.numpy())
        assert got[0].dtype == torch.int32
        np.testing.assert_array_equal(got[0].numpy(), ref[0])
        np.testing.assert_array_equal(got[1].numpy(), ref[1])


def test_the_docstring_examples():
    import doctest

    import sdpa.sparse

    assert doctest.testmod(sdpa.sparse).failed == 0


@pytest.mark.parametrize("bs", [1, 3])
def test_bfloat16_pairs_over_blocks_of_an_odd_size(isa, rng, bs):
    """The tiled path's bfloat16 pairs of values straddle blocks of an odd
    size (one-position blocks: sparse lists): paged prefill rows and a sparse
    MLA-like call with 32 query heads over one head, against the reference."""
    from sdpa.paged import paged_plan

    lens = [37, 20]
    cache, bt, sl, seqs = paged_problem(rng, "bfloat16", lens, Hkv=1, E=16, bs=bs)
    L = 20
    q = rng.standard_normal((2, 4, L, 16)).astype(BF16)
    plan = paged_plan(q, cache.key_cache, cache.value_cache, bt, sl)
    assert not any(p["row_mode"] for p in plan["parts"])
    out = sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl)
    for b, (k, v) in enumerate(seqs):
        ref = reference.scaled_dot_product_attention(q[b].astype(np.float64), k, v, is_causal="bottom_right",
                                                     enable_gqa=True)
        np.testing.assert_allclose(out[b].astype(np.float64), ref, rtol=2e-2, atol=2e-2)
    lat = rng.standard_normal((1, 1, 300, 24)).astype(BF16)
    qm = rng.standard_normal((1, 32, 1, 24)).astype(BF16)
    idx = np.sort(rng.choice(300, 61, replace=False))[None, None, None, :]
    got = sdpa.sparse_attention(qm, lat, lat[..., :16], idx)
    ref = reference.sparse_attention(qm.astype(np.float32), lat.astype(np.float32), lat[..., :16].astype(np.float32),
                                     idx)
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=2e-2, atol=2e-2)


def test_paged_topk_rows_that_share_positions(rng):
    """A paged prefill chunk of 70 rows whose lists share 20 positions
    (scattered over the pool's blocks) and add 6 of their own: the shared
    ones are read once for a group of rows; the reference's result."""
    cache, bt, sl, seqs = paged_problem(rng, "float32", [120], Hkv=2, E=16, bs=4)
    L = 70
    q = rng.standard_normal((1, 4, L, 16)).astype(np.float32)
    common = rng.choice(120, 20, replace=False)
    idx = np.stack([np.concatenate([common, rng.choice(120, 6)]) for _ in range(L)])[None, None]
    out = sdpa.paged_attention(q, cache.key_cache, cache.value_cache, bt, sl, topk_indices=idx, is_causal=False)
    rows_q = q.transpose(0, 2, 1, 3).reshape(L, 4, 16)
    ref, _ = paged_expected(rows_q, seqs, [0] * L, [119] * L, idx[0, 0][:, None, :], False)
    np.testing.assert_allclose(out[0].transpose(1, 0, 2), ref, rtol=2e-5, atol=2e-5)


def test_index_topk_infinite_keys_and_few_heads(isa):
    """A key with an infinity scores +inf (first), whatever the head count
    (the heads padded to whole panels take no part in the sum)."""
    kx = np.array([[1, 0], [np.inf, 0], [2, 0], [-np.inf, 0]], np.float32)
    for heads in (1, 3, 8, 17):
        q = np.ones((heads, 1, 2), np.float32)
        w = np.ones((1, heads), np.float32)
        idx, sc = sdpa.index_topk(q, kx, w, 4)
        ridx, rsc = reference.index_topk(q, kx, w, 4)
        np.testing.assert_array_equal(idx, ridx)
        np.testing.assert_array_equal(sc, rsc.astype(np.float32))
        assert idx[0, 0] == 1 and np.isposinf(sc[0, 0])


def test_a_cache_broadcast_along_its_positions(rng):
    """Keys broadcast from one row along S (stride 0): read as what they are
    (a copy), not as a pool of rows."""
    row = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    key = np.broadcast_to(row, (1, 2, 6, 4))
    value = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    idx = np.array([[[[0, 3, 5]]]])
    np.testing.assert_allclose(sdpa.sparse_attention(q, key, value, idx),
                               reference.sparse_attention(q, key, value, idx), rtol=2e-5, atol=2e-5)


def test_positions_before_heads_with_lists_per_head(rng):
    """A cache laid out (B, S, Hkv, E) in memory (heads no whole number of rows
    apart) with a list per key/value head: the core reads each slice from its
    own first row; out= and the lse as usual."""
    B, S, Hkv, E, G, L = 2, 50, 3, 8, 2, 3
    key = rng.standard_normal((B, S, Hkv, E)).astype(np.float32).transpose(0, 2, 1, 3)
    value = rng.standard_normal((B, S, Hkv, E)).astype(np.float32).transpose(0, 2, 1, 3)
    q = rng.standard_normal((B, Hkv * G, L, E)).astype(np.float32)
    idx = random_indices(rng, (B, Hkv, L, 7), S)
    sinks = rng.standard_normal(Hkv * G).astype(np.float32)
    out = np.empty((B, Hkv * G, L, E), np.float32)
    got, lse = sdpa.sparse_attention(q, key, value, idx, return_lse=True, sinks=sinks, out=out)
    ref, ref_lse = reference.sparse_attention(q, key, value, idx, return_lse=True, sinks=sinks)
    assert got is out
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)


def test_a_cache_with_no_position(rng):
    """S = 0: every entry must be -1, every row gives 0 and lse -inf (the
    sink with sinks)."""
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    key = np.zeros((1, 1, 0, 4), np.float32)
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse = sdpa.sparse_attention(q, key, key, np.full((1, 1, 3, 2), -1), sinks=sinks, return_lse=True)
    assert not out.any() and out.shape == (1, 2, 3, 4)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], (1, 2, 3)))
    with pytest.raises(ValueError, match=r"indices: entry \(0, 0, 0, 0\) is 0, not a position in \[0, 0\)"):
        sdpa.sparse_attention(q, key, key, np.zeros((1, 1, 3, 2), np.int64))


@pytest.mark.parametrize("layout", ["blocks, heads, positions", "blocks, positions, heads"])
def test_paged_topk_pools_are_views_of_the_caches(rng, layout):
    """Paged caches seen as one cache of their positions without a copy, in
    either layout (vLLM's puts positions before heads); per-head lists over
    them against the reference."""
    from sdpa import sparse

    N, Hkv, bs, E, G, B, L = 6, 2, 4, 8, 2, 2, 3
    shape = (N, Hkv, bs, E) if layout.endswith("positions") else (N, bs, Hkv, E)
    key = rng.standard_normal(shape).astype(np.float32)
    value = rng.standard_normal(shape).astype(np.float32)
    if not layout.endswith("positions"):
        key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
    (kp, vp, _, _), m = sparse._row_pool((key, value, None, None))
    assert np.shares_memory(kp, key) and np.shares_memory(vp, value)
    for n in range(N):
        np.testing.assert_array_equal(kp[0, :, n * m:n * m + bs], key[n])
    tables = np.array([[5, 0, 3], [2, 4, 1]], np.int32)
    seq_lens = np.array([11, 9])
    q = rng.standard_normal((B, Hkv * G, L, E)).astype(np.float32)
    idx = np.stack([random_indices(rng, (Hkv, L, 5), int(n)) for n in seq_lens])
    got = sdpa.paged_attention(q, key, value, tables, seq_lens, topk_indices=idx, is_causal=False)
    for b in range(B):  # the sequence's cache laid out flat, then the dense form
        flat_k = np.concatenate([key[t] for t in tables[b]], axis=1)[:, :seq_lens[b]]
        flat_v = np.concatenate([value[t] for t in tables[b]], axis=1)[:, :seq_lens[b]]
        ref = reference.sparse_attention(q[b], flat_k, flat_v, idx[b])
        np.testing.assert_allclose(got[b], ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("E, Ev", [(128, 64), (576, 512), (64, 32)])
def test_latent_values_over_runs_of_positions(rng, E, Ev):
    """MLA-style values (a column view of the keys) over lists mixing scattered
    positions with runs of 20 and 40 that follow each other: the rows the
    kernels gather for the keys and read in place for the values, or the other
    way round, give the reference's result whatever the head dims."""
    S, Hq, L = 300, 4, 3
    lat = rng.standard_normal((1, 1, S, E)).astype(np.float32)
    q = rng.standard_normal((1, Hq, L, E)).astype(np.float32)
    runs = np.concatenate([np.arange(10, 30), np.arange(100, 140), [5, 77, 200, 201, 250]])
    idx = np.stack([np.roll(runs, r) for r in range(L)])[None, None].astype(np.int32)
    got = sdpa.sparse_attention(q, lat, lat[..., :Ev], idx)
    ref = reference.sparse_attention(q, lat, lat[..., :Ev], idx)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
