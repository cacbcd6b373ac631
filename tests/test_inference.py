"""The inference pipeline: bottom-right causality, key lengths, log-sum-exp,
merging results over chunks of the keys, the KV cache, the attention layer,
decode shapes (row mode) and the example decoder.

Expected values come from float64 NumPy: ``sdpa.reference`` for outputs and
weights, :func:`reference_lse` below for the log-sum-exp, always with one
explicit bool mask that spells out what causality and key lengths mean.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import sdpa
from conftest import assert_close, seed_for
from sdpa.testing import make_qkv, randn

attention = sdpa.scaled_dot_product_attention

DTYPES = [np.float32, np.float64]


# --------------------------------------------------------------------------- helpers


def reference_lse(q, k, allowed=None, additive=None, scale=None, gqa=False) -> np.ndarray:
    """log(sum(exp(scores))) over the keys each row sees, in float64; -inf for a
    row that sees none.  Shapes as for sdpa; ``allowed`` is a bool mask."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if additive is not None:
        s = s + np.asarray(additive, dtype=np.float64)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, initial=-np.inf)
    finite = np.where(np.isneginf(m), 0.0, m)
    total = np.sum(np.exp(s - finite[..., None]), axis=-1)
    with np.errstate(divide="ignore"):
        return np.where(total > 0, finite + np.log(total), -np.inf)


def length_mask(key_lengths, batch_shape, S) -> np.ndarray:
    """The bool mask (*batch, 1, 1, S) that key_lengths stands for."""
    kl = np.broadcast_to(np.asarray(key_lengths), batch_shape)
    return np.arange(S) < kl[..., None, None, None]


def check_full(q, k, v, sdpa_kwargs, allowed, *, gqa=False, additive=None, scale=None, threads=None):
    """sdpa with weights and lse against the float64 reference with one bool mask."""
    dtype = q.dtype
    out, weights, lse = attention(
        q, k, v, scale=scale, enable_gqa=gqa, return_weights=True, return_lse=True,
        num_threads=threads, **sdpa_kwargs,
    )
    mask = allowed
    if additive is not None:
        mask = np.where(allowed, additive, -np.inf) if allowed is not None else additive
    exp_out, exp_w = sdpa.reference.scaled_dot_product_attention(
        q, k, v, mask, scale=scale, enable_gqa=gqa, return_weights=True
    )
    exp_lse = reference_lse(q, k, allowed, additive, scale, gqa)
    assert out.dtype == weights.dtype == lse.dtype == dtype
    assert lse.shape == out.shape[:-1]
    E = q.shape[-1]
    assert_close(out, exp_out, dtype, head_dim=E)
    assert_close(weights, np.broadcast_to(exp_w, weights.shape), dtype, head_dim=E)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exp_lse))
    seen = ~np.isneginf(exp_lse)
    assert_close(lse[seen], exp_lse[seen], dtype, head_dim=E)
    # the plain call (no weights, no lse) takes other code paths
    plain = attention(q, k, v, scale=scale, enable_gqa=gqa, num_threads=threads, **sdpa_kwargs)
    assert_close(plain, exp_out, dtype, head_dim=E)
    return out, weights, lse


# --------------------------------------------------------------------------- bottom-right causal

LS_PAIRS = [(3, 7), (7, 7), (9, 4), (1, 5), (1, 1), (5, 1), (8, 1030), (2, 1100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("L,S", LS_PAIRS)
def test_bottom_right_is_the_shifted_tril(rng, dtype, heads, L, S):
    hq, hkv = heads
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=16, Ev=12, dtype=dtype)
    tril = np.tri(L, S, S - L, dtype=bool)
    out, weights, lse = check_full(q, k, v, {"is_causal": "bottom_right"}, tril, gqa=hq != hkv)
    explicit = attention(q, k, v, tril, enable_gqa=hq != hkv)
    assert_close(out, explicit, dtype, scale=2)
    # rows before L - S see no key: zeros, -inf, zero weights
    hidden = max(L - S, 0)
    assert not out[..., :hidden, :].any() and not weights[..., :hidden, :].any()
    assert np.isneginf(lse[..., :hidden]).all()
    assert np.isfinite(lse[..., hidden:]).all()


# --------------------------------------------------------------------------- key lengths

KEY_LENGTH_CASES = {
    # name: (batch shape, key_lengths)
    "scalar": ((3,), np.int64(4)),
    "0-d array": ((3,), np.array(9)),
    "per-batch": ((3,), np.array([0, 5, 100])),
    "per-batch-int32": ((3,), np.array([9, 1, 3], dtype=np.int32)),
    "column": ((3, 2), np.array([[2], [9], [0]])),
    "row": ((3, 2), np.array([7, 3])),
    "full": ((3, 2), np.array([[1, 2], [3, 4], [9, 8]])),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(KEY_LENGTH_CASES))
@pytest.mark.parametrize("extra", ["none", "causal", "bottom_right", "mask", "causal+mask"])
def test_key_lengths_are_a_mask(rng, dtype, case, extra):
    batch, kl = KEY_LENGTH_CASES[case]
    L, S = 5, 9
    q, k, v = make_qkv(rng, batch=batch, hq=4, hkv=2, L=L, S=S, E=8, Ev=6, dtype=dtype)
    allowed = np.broadcast_to(length_mask(kl, batch, S), batch + (4, L, S))
    kwargs = {"key_lengths": kl}
    if "causal" in extra:
        kwargs["is_causal"] = True
        allowed = allowed & np.tri(L, S, dtype=bool)
    if extra == "bottom_right":
        kwargs["is_causal"] = "bottom_right"
        allowed = allowed & np.tri(L, S, S - L, dtype=bool)
    if "mask" in extra:
        keep = rng.random((4, L, S)) < 0.7
        kwargs["attn_mask"] = keep
        allowed = allowed & keep
    out, weights, lse = check_full(q, k, v, kwargs, allowed, gqa=True)
    beyond = ~length_mask(kl, batch, S)
    assert not np.where(beyond, weights, 0).any(), "weights beyond the key length"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,hq,hkv", [(1, 8, 2), (2, 4, 1), (1, 4, 4), (3, 4, 1), (16, 2, 2)])
def test_key_lengths_long_keys(rng, dtype, L, hq, hkv):
    """Lengths inside, at and past the 1024-key chunks of row mode."""
    S = 2500
    batch = (5,)
    kl = np.array([0, 1, 1024, 2049, 2500])
    q, k, v = make_qkv(rng, batch=batch, hq=hq, hkv=hkv, L=L, S=S, E=32, dtype=dtype)
    allowed = np.broadcast_to(length_mask(kl, batch, S), batch + (hq, L, S))
    allowed = allowed & np.tri(L, S, S - L, dtype=bool)
    check_full(q, k, v, {"key_lengths": kl, "is_causal": "bottom_right"}, allowed, gqa=hq != hkv)


def test_key_lengths_past_the_keys_are_clamped(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=3, S=6, E=8)
    np.testing.assert_array_equal(
        attention(q, k, v, key_lengths=np.array([6, 10**9])), attention(q, k, v)
    )


# --------------------------------------------------------------------------- log-sum-exp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "float+causal"])
@pytest.mark.parametrize("L,S,hq,hkv", [(6, 11, 3, 3), (1, 300, 8, 2), (4, 2, 4, 1), (40, 70, 2, 1)])
def test_lse_matches_numpy(rng, dtype, mask_kind, L, S, hq, hkv):
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=16, dtype=dtype)
    allowed, additive, kwargs = None, None, {}
    if mask_kind == "bool":
        allowed = rng.random((2, hq, L, S)) < 0.6
        allowed[0, 0, 0] = False  # a row that sees no key
        kwargs["attn_mask"] = allowed
    elif mask_kind.startswith("float"):
        additive = (3.0 * rng.standard_normal((hq, L, S))).astype(dtype)
        additive[0, -1] = -np.inf  # a row that sees no key
        kwargs["attn_mask"] = additive
        if "causal" in mask_kind:
            kwargs["is_causal"] = True
            allowed = np.tri(L, S, dtype=bool)
    for scale in (None, 0.3):
        _, _, lse = check_full(q, k, v, kwargs, allowed, additive=additive, scale=scale, gqa=hq != hkv)
        if mask_kind == "bool":
            assert np.isneginf(lse[0, 0, 0])
        elif additive is not None:
            assert np.isneginf(lse[:, 0, -1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_of_no_keys(dtype):
    q = np.ones((2, 3, 4), dtype=dtype)
    k = np.ones((2, 0, 4), dtype=dtype)
    v = np.ones((2, 0, 5), dtype=dtype)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 5) and not out.any()
    assert lse.shape == (2, 3) and lse.dtype == dtype and np.isneginf(lse).all()


def test_lse_with_weights_order(rng):
    q, k, v = make_qkv(rng, hq=2, L=3, S=4, E=8)
    res = attention(q, k, v, return_weights=True, return_lse=True)
    assert len(res) == 3
    assert res[1].shape == (2, 3, 4) and res[2].shape == (2, 3)
    out, lse = attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, res[0])
    np.testing.assert_array_equal(lse, res[2])


# --------------------------------------------------------------------------- merge_attention


def split_points(rng, S, n):
    inner = np.sort(rng.choice(np.arange(1, S), size=n - 1, replace=False)) if n > 1 else []
    return [0, *map(int, inner), S]


MERGE_VARIANTS = ["plain", "bottom_right", "mask", "key_lengths", "all"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", MERGE_VARIANTS)
@pytest.mark.parametrize("trial", range(4))
def test_merge_over_any_split_equals_the_whole(dtype, variant, trial):
    rng = np.random.default_rng(seed_for(f"merge-{dtype.__name__}-{variant}-{trial}"))
    hkv = int(rng.choice([1, 2, 4]))
    hq = 4
    L = int(rng.choice([1, 2, 5, 12]))
    S = int(rng.choice([6, 40, 1500]))
    B = 2
    q, k, v = make_qkv(rng, batch=(B,), hq=hq, hkv=hkv, L=L, S=S, E=16, Ev=8, dtype=dtype)
    gqa = hq != hkv
    causal = variant in ("bottom_right", "all")
    allowed = np.ones((B, hq, L, S), dtype=bool)
    if causal:
        allowed &= np.tri(L, S, S - L, dtype=bool)
    mask = None
    if variant in ("mask", "all"):
        mask = rng.random((B, hq, L, S)) < 0.5
        mask[0, 0, 0] = False  # no key anywhere for this row
        mask[1, :, -1, : S // 2] = False  # none in the first half
        allowed &= mask
    kl = None
    if variant in ("key_lengths", "all"):
        kl = np.array([int(rng.integers(0, S + 1)), S // 3])
        allowed &= length_mask(kl, (B,), S)

    full_kwargs = {"is_causal": "bottom_right" if causal else False, "attn_mask": mask, "key_lengths": kl}
    full, full_lse = attention(q, k, v, enable_gqa=gqa, return_lse=True, **full_kwargs)

    n = int(rng.integers(1, 6))
    bounds = split_points(rng, S, min(n, S))
    outs, lses = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        kw = {}
        last = i == len(bounds) - 2
        if causal and last:
            # the last chunk ends where the keys end: its own bottom-right alignment is right
            kw["is_causal"] = "bottom_right"
            if mask is not None:
                kw["attn_mask"] = mask[..., a:b]
        elif causal or mask is not None:
            chunk_mask = np.tri(L, S, S - L, dtype=bool)[:, a:b] if causal else True
            if mask is not None:
                chunk_mask = chunk_mask & mask[..., a:b]
            kw["attn_mask"] = np.broadcast_to(chunk_mask, (B, hq, L, b - a))
        if kl is not None:
            kw["key_lengths"] = np.clip(kl - a, 0, b - a)
        o, s = attention(q, k[:, :, a:b], v[:, :, a:b], enable_gqa=gqa, return_lse=True, **kw)
        outs.append(o)
        lses.append(s)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = sdpa.merge_attention(outs, lses)
        out_stacked, lse_stacked = sdpa.merge_attention(np.stack(outs), np.stack(lses))
    np.testing.assert_array_equal(out, out_stacked)
    np.testing.assert_array_equal(lse, lse_stacked)
    assert out.dtype == lse.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, full, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full_lse))
    finite = np.isfinite(full_lse)
    np.testing.assert_allclose(lse[finite], full_lse[finite], rtol=tol, atol=tol)
    # and against float64 NumPy
    hidden = ~allowed.any(axis=-1)
    assert not out[hidden].any()
    exp_lse = reference_lse(q, k, allowed, gqa=gqa)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exp_lse))
    np.testing.assert_array_equal(np.isneginf(exp_lse), hidden)
    assert_close(lse[~hidden], exp_lse[~hidden], dtype)


def test_merge_rows_without_keys_give_zeros_quietly():
    outs = [np.full((2, 3), 5.0), np.ones((2, 3)), np.zeros((2, 3))]
    lses = [np.array([-np.inf, 0.0]), np.array([-np.inf, np.log(3.0)]), np.array([-np.inf, -np.inf])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = sdpa.merge_attention(outs, lses)
    np.testing.assert_array_equal(out[0], 0.0)
    assert np.isneginf(lse[0])
    np.testing.assert_allclose(out[1], (5.0 * 1 + 1.0 * 3) / 4)
    np.testing.assert_allclose(lse[1], np.log(4.0))


def test_merge_single_chunk_is_identity(rng):
    o = randn(rng, (3, 4, 5))
    s = randn(rng, (3, 4))
    out, lse = sdpa.merge_attention([o], [s])
    np.testing.assert_allclose(out, o, rtol=1e-15)
    np.testing.assert_allclose(lse, s, rtol=1e-15)


def test_merge_large_lses_do_not_overflow():
    outs = [np.ones((1, 2)), 3 * np.ones((1, 2))]
    lses = [np.array([1000.0]), np.array([1000.0])]
    out, lse = sdpa.merge_attention(outs, lses)
    np.testing.assert_allclose(out, 2.0)
    np.testing.assert_allclose(lse, 1000.0 + np.log(2.0))


@pytest.mark.parametrize(
    "dtypes,expected",
    [
        ((np.float32, np.float32), np.float32),
        ((np.float32, np.float64), np.float64),
        ((np.float64, np.float32), np.float64),
        ((np.float16, np.float16), np.float16),
        ((np.int64, np.int64), np.float64),
    ],
)
def test_merge_result_dtype(dtypes, expected):
    o_dtype, s_dtype = dtypes
    out, lse = sdpa.merge_attention(
        [np.ones((2, 3), o_dtype)] * 2, [np.zeros(2, s_dtype)] * 2
    )
    assert out.dtype == lse.dtype == expected
    np.testing.assert_allclose(out, 1.0)
    np.testing.assert_allclose(lse.astype(np.float64), np.log(2.0), rtol=1e-3)


@pytest.mark.parametrize(
    "outputs,lses,match",
    [
        ([], [], "at least one chunk"),
        ([np.zeros((2, 3))], [np.zeros(2), np.zeros(2)], "one lse per output"),
        ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2, r"outputs\[1\] has shape \(2, 4\)"),
        ([np.zeros((2, 3))] * 2, [np.zeros(2), np.zeros(3)], r"lses\[1\]: expected shape \(2,\).*\(3,\)"),
        ([np.zeros((2, 3))], [np.zeros((2, 1))], r"lses\[0\]"),
        ([np.zeros(3)], [np.zeros(())], "at least 2 dims"),
    ],
)
def test_merge_rejects_bad_shapes(outputs, lses, match):
    with pytest.raises(ValueError, match=match):
        sdpa.merge_attention(outputs, lses)


def test_merge_rejects_complex():
    with pytest.raises(TypeError, match="outputs"):
        sdpa.merge_attention([np.zeros((2, 3), complex)], [np.zeros(2)])


# --------------------------------------------------------------------------- KVCache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("prefill", [1, 7])
def test_cache_prefill_then_decode_equals_full(rng, dtype, hq, hkv, prefill):
    B, N, E, Ev = 2, 20, 16, 8
    q, k, v = make_qkv(rng, batch=(B,), hq=hq, hkv=hkv, L=N, S=N, E=E, Ev=Ev, dtype=dtype)
    gqa = hq != hkv
    cache = sdpa.KVCache(B, hkv, 12, E, Ev, dtype=dtype, grow=True)
    bounds = [0, prefill] + list(range(prefill + 1, 12)) + [15] + list(range(16, N + 1))
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        keys, values = cache.append(k[:, :, a:b], v[:, :, a:b])
        assert keys.shape == (B, hkv, b, E) and values.shape == (B, hkv, b, Ev)
        pieces.append(attention(q[:, :, a:b], keys, values, is_causal="bottom_right", enable_gqa=gqa))
    assert len(cache) == cache.length == N and cache.capacity >= N
    got = np.concatenate(pieces, axis=-2)
    expected = sdpa.reference.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    assert_close(got, expected, dtype)
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)


def test_cache_overflow_raises_and_writes_nothing():
    cache = sdpa.KVCache(1, 2, 4, 3)
    cache.append(np.ones((1, 2, 3, 3)), np.ones((1, 2, 3, 3)))
    with pytest.raises(sdpa.KVCacheFullError, match=r"3 of 4 positions.*2 more"):
        cache.append(np.full((1, 2, 2, 3), 7.0), np.full((1, 2, 2, 3), 7.0))
    assert issubclass(sdpa.KVCacheFullError, ValueError)
    assert len(cache) == 3 and cache.capacity == 4
    assert (cache.keys == 1).all()
    cache.append(np.zeros((1, 2, 1, 3)), np.zeros((1, 2, 1, 3)))
    assert len(cache) == 4
    with pytest.raises(ValueError):
        cache.append(np.zeros((1, 2, 1, 3)), np.zeros((1, 2, 1, 3)))


def test_cache_grows_and_keeps_its_contents(rng):
    cache = sdpa.KVCache(2, 1, 2, 4, 5, dtype=np.float64, grow=True)
    k, v = randn(rng, (2, 1, 100, 4)), randn(rng, (2, 1, 100, 5))
    capacities = []
    for t in range(100):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        capacities.append(cache.capacity)
    assert len(set(capacities)) <= 8, "growth is not geometric"
    assert 100 <= cache.capacity <= 200
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)
    cache.append(k, v)  # one append bigger than doubling
    assert len(cache) == 200 and cache.capacity >= 200
    np.testing.assert_array_equal(cache.keys[:, :, 100:], k)


def test_cache_views_are_read_only():
    cache = sdpa.KVCache(1, 1, 8, 2)
    keys, values = cache.append(np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2)))
    for view in (keys, values, cache.keys, cache.values):
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0, 0, 0, 0] = 5.0
    # the storage itself is still written by append
    cache.append(np.full((1, 1, 1, 2), 2.0), np.full((1, 1, 1, 2), 2.0))
    assert cache.keys[0, 0, 3, 0] == 2.0


def test_cache_reset_dtype_and_repr():
    cache = sdpa.KVCache(1, 2, 4, 3)
    assert cache.dtype == np.float32 and cache.keys.dtype == np.float32
    assert cache.head_dim_v == 3 and cache.keys.shape == (1, 2, 0, 3)
    cache.append(np.arange(6.0).reshape(1, 2, 1, 3), np.zeros((1, 2, 1, 3), dtype=np.int32))
    assert cache.keys.dtype == np.float32 and cache.keys[0, 1, 0, 2] == 5.0
    cache.reset()
    assert len(cache) == 0 and cache.capacity == 4 and cache.keys.shape == (1, 2, 0, 3)
    assert "KVCache(" in repr(cache) and cache.nbytes == 2 * 1 * 2 * 4 * 3 * 4


@pytest.mark.parametrize(
    "k_shape,v_shape,match",
    [
        ((2, 3, 4), (2, 3, 4), r"k: expected shape \(1, 2, T, 4\)"),
        ((1, 3, 1, 4), (1, 2, 1, 4), r"k: .*got shape \(1, 3, 1, 4\)"),
        ((1, 2, 1, 4), (1, 2, 1, 5), r"v: expected shape \(1, 2, T, 4\)"),
        ((1, 2, 2, 4), (1, 2, 1, 4), "same number of tokens"),
        ((1, 2, 0, 4), (1, 2, 0, 4), "at least one token"),
    ],
)
def test_cache_rejects_bad_shapes(k_shape, v_shape, match):
    cache = sdpa.KVCache(1, 2, 8, 4)
    with pytest.raises(ValueError, match=match):
        cache.append(np.zeros(k_shape), np.zeros(v_shape))
    assert len(cache) == 0


@pytest.mark.parametrize(
    "args,kwargs,exc",
    [
        ((0, 1, 4, 2), {}, ValueError),
        ((1, 1, -1, 2), {}, ValueError),
        ((1, 1.5, 4, 2), {}, TypeError),
        ((1, 1, 4, 2), {"dtype": np.int32}, TypeError),
    ],
)
def test_cache_rejects_bad_arguments(args, kwargs, exc):
    with pytest.raises(exc):
        sdpa.KVCache(*args, **kwargs)


# --------------------------------------------------------------------------- MultiHeadAttention


def reference_layer(layer, x, causal):
    return sdpa.reference.multi_head_attention(
        x, layer.w_q, layer.w_k, layer.w_v, layer.w_o, layer.b_q, layer.b_k, layer.b_v, layer.b_o,
        layer.num_heads, layer.num_kv_heads, causal,
    )


LAYER_HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", list(LAYER_HEADS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_against_reference(rng, dtype, heads, bias, causal):
    hq, hkv = LAYER_HEADS[heads]
    layer = sdpa.MultiHeadAttention(32, hq, hkv, bias=bias, dtype=dtype, rng=rng)
    assert layer.w_q.shape == (32, 32) and layer.w_k.shape == (32, 8 * hkv)
    assert layer.w_o.shape == (32, 32) and (layer.b_q is None) == (not bias)
    x = randn(rng, (3, 9, 32), dtype)
    y = layer(x, causal=causal)
    assert y.shape == x.shape and y.dtype == dtype
    expected = reference_layer(layer, x, causal)
    tol = 1e-12 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)
    # a 2-D input is one sequence
    y2 = layer(x[1], causal=causal)
    assert y2.shape == (9, 32)
    np.testing.assert_allclose(y2, y[1], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", list(LAYER_HEADS))
def test_layer_cached_decode_equals_full(rng, dtype, heads):
    hq, hkv = LAYER_HEADS[heads]
    layer = sdpa.MultiHeadAttention(48, hq, hkv, head_dim=16, dtype=dtype, rng=rng)
    x = randn(rng, (2, 14, 48), dtype)
    cache = layer.new_cache(batch=2, capacity=14)
    assert cache.keys.shape == (2, hkv, 0, 16) and cache.dtype == dtype
    steps = [layer(x[:, :6], cache)] + [layer(x[:, t : t + 1], cache) for t in range(6, 12)]
    steps.append(layer(x[:, 12:], cache))  # two tokens at once
    assert len(cache) == 14
    got = np.concatenate(steps, axis=1)
    expected = reference_layer(layer, x, True)
    tol = 1e-12 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    with pytest.raises(sdpa.KVCacheFullError):
        layer(x[:, :1], cache)


def test_layer_without_causality_in_the_cache(rng):
    layer = sdpa.MultiHeadAttention(16, 2, dtype=np.float64, rng=rng)
    x = randn(rng, (1, 5, 16))
    cache = layer.new_cache(1, 8)
    layer(x[:, :3], cache, causal=False)
    y = layer(x[:, 3:], cache, causal=False)  # the last two see all five keys
    expected = reference_layer(layer, x, False)[:, 3:]
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def test_layer_seeded_and_from_weights(rng):
    a = sdpa.MultiHeadAttention(16, 4, 2, rng=7)
    b = sdpa.MultiHeadAttention(16, 4, 2, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a.w_q, b.w_q)
    np.testing.assert_array_equal(a.b_o, b.b_o)
    assert not np.array_equal(a.w_q, sdpa.MultiHeadAttention(16, 4, 2, rng=8).w_q)
    c = sdpa.MultiHeadAttention.from_weights(
        a.w_q, a.w_k, a.w_v, a.w_o, a.b_q, a.b_k, a.b_v, a.b_o, num_heads=4, num_kv_heads=2
    )
    assert c.dtype == np.float32 and c.head_dim == 4
    x = randn(rng, (2, 5, 16), np.float32)
    np.testing.assert_array_equal(a(x), c(x))
    assert "num_kv_heads=2" in repr(c)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((16, 4, 3), {}, "num_kv_heads: must divide"),
        ((10, 4), {}, "embed_dim: must be a multiple"),
        ((16, 0), {}, "num_heads"),
    ],
)
def test_layer_rejects_bad_sizes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sdpa.MultiHeadAttention(*args, **kwargs)


def test_layer_rejects_bad_inputs(rng):
    layer = sdpa.MultiHeadAttention(16, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \(batch, T, 16\)"):
        layer(np.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match="x: expected"):
        layer(np.zeros((1, 2, 3, 16)))
    with pytest.raises(ValueError, match="cache: holds"):
        layer(np.zeros((2, 3, 16)), sdpa.KVCache(2, 4, 8, 4))
    with pytest.raises(ValueError, match="cache: holds"):
        layer(np.zeros((1, 3, 16)), layer.new_cache(2, 8))
    with pytest.raises(TypeError, match="cache"):
        layer(np.zeros((1, 3, 16)), cache={})


# --------------------------------------------------------------------------- from_torch


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_torch_matches_torch(rng, batch_first, bias, dtype):
    torch = pytest.importorskip("torch")
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    torch.manual_seed(seed_for(f"torch-{batch_first}-{bias}-{dtype.__name__}"))
    module = torch.nn.MultiheadAttention(32, 4, bias=bias, batch_first=batch_first, dtype=tdtype).eval()
    layer = sdpa.MultiHeadAttention.from_torch(module)
    assert layer.dtype == dtype and layer.num_heads == 4 and layer.num_kv_heads == 4
    assert (layer.b_q is None) == (not bias) and (layer.b_o is None) == (not bias)
    x = randn(rng, (3, 7, 32), dtype)  # (batch, T, E)
    tx = torch.from_numpy(x if batch_first else np.ascontiguousarray(x.transpose(1, 0, 2)))
    with torch.no_grad():
        expected = module(tx, tx, tx, need_weights=False)[0].numpy()
        # torch's bool attn_mask: True = may NOT attend
        causal_mask = torch.from_numpy(~np.tri(7, 7, dtype=bool))
        expected_causal = module(tx, tx, tx, attn_mask=causal_mask, need_weights=False)[0].numpy()
    if not batch_first:
        expected = expected.transpose(1, 0, 2)
        expected_causal = expected_causal.transpose(1, 0, 2)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(layer(x, causal=False), expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(layer(x, causal=True), expected_causal, rtol=tol, atol=tol)


def test_from_torch_rejects_unsupported_modules():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    with pytest.raises(ValueError, match="add_bias_kv"):
        sdpa.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        sdpa.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="kdim"):
        sdpa.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))


# --------------------------------------------------------------------------- decode shapes


DECODE_SHAPES = {
    # name: (B, Hq, Hkv, L, S, E)
    "gqa-8-2": (2, 8, 2, 1, 3000, 64),
    "mha-4": (1, 4, 4, 1, 5000, 32),
    "gqa-4-1-two-rows": (2, 4, 1, 2, 2100, 16),
    "gqa-8-1-one-row": (1, 8, 1, 1, 1025, 48),
    "gqa-4-1-three-rows": (1, 4, 1, 3, 2049, 16),
}


def decode_problem(name, dtype):
    B, hq, hkv, L, S, E = DECODE_SHAPES[name]
    rng = np.random.default_rng(seed_for(f"decode-{name}-{np.dtype(dtype).name}"))
    q, k, v = make_qkv(rng, batch=(B,), hq=hq, hkv=hkv, L=L, S=S, E=E, dtype=dtype)
    kl = np.minimum(np.array([S - 1, S // 2 + 3])[:B], S)
    return q, k, v, kl, hq != hkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_decode_bitwise_identical_for_any_thread_count(dtype, name):
    q, k, v, kl, gqa = decode_problem(name, dtype)
    for kwargs in ({}, {"is_causal": "bottom_right", "key_lengths": kl}):
        results = [
            attention(q, k, v, enable_gqa=gqa, return_lse=True, num_threads=n, **kwargs)
            for n in (1, 2, 3)
        ]
        for out, lse in results[1:]:
            np.testing.assert_array_equal(out, results[0][0])
            np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_long_decode_against_reference(isa, dtype, name):
    q, k, v, kl, gqa = decode_problem(name, dtype)
    B, hq, _, L, S, _ = DECODE_SHAPES[name]
    allowed = np.broadcast_to(length_mask(kl, (B,), S), (B, hq, L, S)) & np.tri(L, S, S - L, dtype=bool)
    check_full(q, k, v, {"is_causal": "bottom_right", "key_lengths": kl}, allowed, gqa=gqa, threads=2)
    check_full(q, k, v, {}, None, gqa=gqa, threads=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,hq,hkv", [(1, 8, 2), (2, 4, 1), (4, 2, 2), (8, 1, 1), (3, 2, 1)])
def test_row_mode_masks_and_top_left(isa, rng, dtype, L, hq, hkv):
    """Few query rows per kv head, with masks and top-left causality (where rows
    past the keys see nothing)."""
    S = 1100
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=24, Ev=20, dtype=dtype)
    gqa = hq != hkv
    keep = rng.random((2, hq, L, S)) < 0.5
    keep[0, 0, 0] = False
    check_full(q, k, v, {"attn_mask": keep}, keep, gqa=gqa)
    additive = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(dtype)
    check_full(q, k, v, {"attn_mask": additive}, None, additive=additive, gqa=gqa)
    tl = np.tri(L, S, dtype=bool)
    lengths = np.array([0, 700])
    allowed = tl & length_mask(lengths, (2,), S)
    check_full(q, k, v, {"is_causal": True, "key_lengths": lengths}, allowed, gqa=gqa)
    # fewer keys than rows: the first rows of a bottom-right alignment see nothing
    qs, ks, vs = q, k[:, :, : max(L - 2, 1)], v[:, :, : max(L - 2, 1)]
    Ss = ks.shape[-2]
    check_full(qs, ks, vs, {"is_causal": "bottom_right"}, np.tri(L, Ss, Ss - L, dtype=bool), gqa=gqa)


def test_decode_from_a_cache_view(rng):
    """Keys and values as the cache hands them out: strided views into a larger buffer."""
    cache = sdpa.KVCache(2, 2, 4096, 64, grow=False)
    k, v = randn(rng, (2, 2, 3000, 64), np.float32), randn(rng, (2, 2, 3000, 64), np.float32)
    keys, values = cache.append(k, v)
    q = randn(rng, (2, 8, 1, 64), np.float32)
    got = [
        attention(q, keys, values, enable_gqa=True, is_causal="bottom_right", num_threads=n)
        for n in (1, 2, 3)
    ]
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])
    expected = sdpa.reference.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_close(got[0], expected, np.float32)


# --------------------------------------------------------------------------- example


def test_example_decoder_runs():
    script = Path(__file__).parents[1] / "examples" / "decoder.py"
    if not script.exists():
        pytest.skip(f"{script} is missing")
    args = [
        "--layers", "2", "--tokens", "4", "--prompt", "6", "--embed", "32",
        "--heads", "4", "--kv-heads", "2", "--vocab", "50", "--threads", "2",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout and "OK" in proc.stdout


def test_public_names():
    for name in ("merge_attention", "KVCache", "KVCacheFullError", "MultiHeadAttention"):
        assert name in sdpa.__all__ and hasattr(sdpa, name)
    assert "multi_head_attention" in sdpa.reference.__all__
