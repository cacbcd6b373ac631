"""sdpa.reference: the float64 NumPy reference itself.

Its ``key_lengths`` and ``return_lse`` keywords are checked against computations
spelled out by hand (the keys before each length only; ``logaddexp`` over each
row's scores) and against sdpa, whose semantics they follow.
"""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close
from sdpa.testing import make_qkv

reference = sdpa.reference.scaled_dot_product_attention
attention = sdpa.scaled_dot_product_attention


def hand_scores(q, k, scale=None, gqa=False):
    """scale * q @ k.T in float64, key/value heads repeated for grouped queries."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return (q @ np.swapaxes(k, -1, -2)) * scale


def hand_lse(scores):
    """log(sum(exp(row))) of each row by logaddexp, an independent route; -inf
    entries are keys that take no part."""
    return np.logaddexp.reduce(scores, axis=-1, initial=-np.inf)


# --------------------------------------------------------------------------- masks


def test_causal_mask():
    np.testing.assert_array_equal(sdpa.reference.causal_mask(2, 3), [[1, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(
        sdpa.reference.causal_mask(2, 3, bottom_right=True), [[1, 1, 0], [1, 1, 1]]
    )
    np.testing.assert_array_equal(
        sdpa.reference.causal_mask(3, 2, bottom_right=True), [[0, 0], [1, 0], [1, 1]]
    )


def test_key_length_mask():
    m = sdpa.reference.key_length_mask(np.array([0, 2, 7, -1]), 3)
    assert m.shape == (4, 1, 1, 3) and m.dtype == bool
    np.testing.assert_array_equal(m[:, 0, 0], [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert sdpa.reference.key_length_mask(2, 3).shape == (1, 1, 3)


# --------------------------------------------------------------------------- key_lengths


@pytest.mark.parametrize("variant", ["plain", "bottom_right", "top_left", "bool", "float"])
@pytest.mark.parametrize("gqa", [False, True])
def test_key_lengths_equal_the_keys_before_each_length(rng, variant, gqa):
    """Batch entry ``b`` computed on keys ``0 .. lengths[b] - 1`` only, with NaN in
    every K, V and mask entry past the length: the reference never reads them."""
    B, L, S = 4, 5, 9
    lengths = np.array([0, 1, 6, 9])
    q, k, v = make_qkv(rng, batch=(B,), hq=4, hkv=2 if gqa else 4, L=L, S=S, E=8, Ev=6)
    kwargs = {"enable_gqa": gqa}
    mask = None
    if variant in ("bottom_right", "top_left"):
        kwargs["is_causal"] = variant
    elif variant == "bool":
        mask = rng.random((B, 4, L, S)) < 0.7
    elif variant == "float":
        mask = np.where(rng.random((B, 4, L, S)) < 0.7, rng.standard_normal((B, 4, L, S)), -np.inf)
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
        if variant == "float":
            mask[b, ..., n:] = np.nan
    out, weights, lse = reference(
        q, k, v, mask, key_lengths=lengths, return_weights=True, return_lse=True, **kwargs
    )
    assert np.isfinite(out).all() and np.isfinite(weights).all() and not np.isnan(lse).any()
    for b, n in enumerate(lengths):
        m = None if mask is None else mask[b, ..., :n]
        if variant in ("bottom_right", "top_left"):  # aligned to all S keys, then cut
            m = sdpa.reference.causal_mask(L, S, bottom_right=variant == "bottom_right")[:, :n]
        o, w, s = reference(
            q[b], k[b, :, :n], v[b, :, :n], m, enable_gqa=gqa, return_weights=True, return_lse=True
        )
        np.testing.assert_allclose(out[b], o, rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(weights[b, ..., :n], w, rtol=1e-14, atol=1e-14)
        assert (weights[b, ..., n:] == 0).all()
        np.testing.assert_allclose(lse[b], s, rtol=1e-14, atol=1e-14)  # -inf where s is
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()


@pytest.mark.parametrize(
    "batch,lengths",
    [
        ((3,), np.int64(4)),
        ((3,), np.array(9)),
        ((3,), [0, 5, 100]),
        ((3, 2), np.array([[2], [9], [0]])),
        ((3, 2), np.array([7, 3], dtype=np.int32)),
        ((3, 2), np.array([[1, 2], [3, 4], [9, 8]])),
    ],
    ids=["scalar", "0-d", "per-batch", "column", "row", "full"],
)
def test_key_lengths_broadcast_over_the_batch_dims(rng, batch, lengths):
    L, S = 3, 7
    q, k, v = make_qkv(rng, batch=batch, hq=2, L=L, S=S, E=4)
    allowed = np.arange(S) < np.broadcast_to(lengths, batch)[..., None, None, None]
    expected = reference(q, k, v, np.broadcast_to(allowed, batch + (2, L, S)), return_lse=True)
    got = reference(q, k, v, key_lengths=lengths, return_lse=True)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_key_lengths_are_clipped_and_checked(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=3, S=5, E=4)
    np.testing.assert_array_equal(reference(q, k, v, key_lengths=[5, 10**9]), reference(q, k, v))
    assert (reference(q, k, v, key_lengths=[-3, 5])[0] == 0).all()
    with pytest.raises(ValueError):
        reference(q, k, v, key_lengths=np.array([1, 2, 3]))  # batch is (2,)
    with pytest.raises(ValueError):
        reference(q[0], k[0], v[0], key_lengths=np.array([2]))  # no batch dims


def test_key_lengths_of_two_dim_inputs(rng):
    q, k, v = make_qkv(rng, hq=None, L=4, S=6, E=5, Ev=3)
    out, lse = reference(q, k, v, key_lengths=2, return_lse=True)
    o, s = reference(q, k[:2], v[:2], return_lse=True)
    assert out.shape == (4, 3) and lse.shape == (4,)
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse, s)


# --------------------------------------------------------------------------- return_lse


@pytest.mark.parametrize("masking", ["none", "bool", "float", "causal", "bottom_right+lengths"])
def test_lse_is_the_log_sum_exp_of_the_scores(rng, masking):
    B, H, L, S = 2, 3, 6, 8
    q, k, v = make_qkv(rng, batch=(B,), hq=H, L=L, S=S, E=8)
    scale = 0.7
    scores = hand_scores(q, k, scale)
    kwargs = {}
    if masking == "bool":
        keep = rng.random((B, H, L, S)) < 0.6
        keep[0, 0, 0] = False  # a row that sees no key
        kwargs["attn_mask"] = keep
        scores = np.where(keep, scores, -np.inf)
    elif masking == "float":
        add = np.where(rng.random((H, L, S)) < 0.7, 3.0 * rng.standard_normal((H, L, S)), -np.inf)
        add[1, 2] = -np.inf
        kwargs["attn_mask"] = add
        scores = scores + add
    elif masking == "causal":
        kwargs["is_causal"] = True
        scores = np.where(sdpa.reference.causal_mask(L, S), scores, -np.inf)
    else:
        kwargs["is_causal"] = "bottom_right"
        kwargs["key_lengths"] = np.array([0, 5])
        allowed = sdpa.reference.causal_mask(L, S, bottom_right=True) & (
            np.arange(S) < np.array([0, 5])[:, None, None, None]
        )
        scores = np.where(allowed, scores, -np.inf)
    out, weights, lse = reference(q, k, v, scale=scale, return_weights=True, return_lse=True, **kwargs)
    expected = hand_lse(scores)
    assert lse.shape == (B, H, L) and lse.dtype == np.float64
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected))
    seen = np.isfinite(expected)
    np.testing.assert_allclose(lse[seen], expected[seen], rtol=1e-14, atol=1e-14)
    # the weights are exp(score - lse)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(
            weights, np.where(seen[..., None], np.exp(scores - lse[..., None]), 0.0), rtol=1e-13, atol=1e-15
        )
    if masking != "none":
        assert (~seen).any() == (masking in ("bool", "float", "bottom_right+lengths"))


def test_lse_of_large_scores_does_not_overflow():
    q = np.array([[30.0, 0.0], [-30.0, 0.0]])
    k = np.array([[30.0, 0.0], [29.0, 0.0], [-5.0, 0.0]])
    v = np.eye(3)
    _, lse = reference(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(lse, hand_lse(q @ k.T), rtol=1e-15)
    assert lse[0] > 900 and np.isfinite(lse).all()


def test_lse_nan_propagates_row_by_row(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=4, S=5, E=3)
    q[1, 0, 2, 1] = np.nan  # one query row
    k[0, 1, 3, 0] = np.nan  # one key of one head: every row of that head sees it ...
    keep = np.ones((2, 2, 4, 5), dtype=bool)
    keep[0, 1, 0, 3] = False  # ... but this row
    _, lse = reference(q, k, v, keep, return_lse=True)
    nan = np.zeros((2, 2, 4), dtype=bool)
    nan[1, 0, 2] = True
    nan[0, 1, 1:] = True
    np.testing.assert_array_equal(np.isnan(lse), nan)
    # a NaN query row that sees no key: no score at all, -inf
    keep[1, 0, 2] = False
    _, lse = reference(q, k, v, keep, return_lse=True)
    assert np.isneginf(lse[1, 0, 2])


def test_lse_of_rows_without_keys():
    q = np.ones((2, 3, 4))
    out, lse = reference(q, np.ones((2, 0, 4)), np.ones((2, 0, 5)), return_lse=True)
    assert out.shape == (2, 3, 5) and not out.any()
    assert lse.shape == (2, 3) and np.isneginf(lse).all()
    # bottom-right causality with more queries than keys: the first rows see none
    ones = np.ones((5, 2))
    _, lse = reference(ones, ones[:2], ones[:2], is_causal="bottom_right", return_lse=True)
    assert np.isneginf(lse[:3]).all() and np.isfinite(lse[3:]).all()


def test_return_order_and_shapes(rng):
    # only the value has heads and a batch dim: everything takes the output's shape
    q, k = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((6, 8))
    v = rng.standard_normal((2, 1, 6, 5))
    out = reference(q, k, v)
    out_w, weights = reference(q, k, v, return_weights=True)
    out_l, lse = reference(q, k, v, return_lse=True)
    out_wl, weights_wl, lse_wl = reference(q, k, v, return_weights=True, return_lse=True)
    assert out.shape == (2, 3, 4, 5) and lse.shape == (2, 3, 4) and weights.shape == (2, 3, 4, 6)
    for o in (out_w, out_l, out_wl):
        np.testing.assert_array_equal(o, out)
    np.testing.assert_array_equal(weights_wl, weights)
    np.testing.assert_array_equal(lse_wl, lse)
    lse.flat[0] = 0.0  # a writable array of its own


# --------------------------------------------------------------------------- against sdpa


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_new_keywords_agree_with_sdpa(rng, dtype, causal, mask_kind):
    B, hq, hkv, L, S = 3, 4, 2, 6, 11
    q, k, v = make_qkv(rng, batch=(B,), hq=hq, hkv=hkv, L=L, S=S, E=16, Ev=8, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((hq, L, S)) < 0.7
    elif mask_kind == "float":
        keep = rng.random((B, 1, L, S)) < 0.7
        mask = np.where(keep, rng.standard_normal((B, 1, L, S)), -np.inf).astype(dtype)
    lengths = np.array([0, 4, 20])
    kwargs = dict(
        is_causal=causal, enable_gqa=True, key_lengths=lengths, return_weights=True, return_lse=True
    )
    got = attention(q, k, v, mask, **kwargs)
    expected = reference(q, k, v, mask, **kwargs)
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(e))
        finite = np.isfinite(e)
        assert_close(g[finite], e[finite], dtype, head_dim=16)
