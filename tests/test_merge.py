"""sdpa.merge_attention: results over chunks of the keys, combined exactly by
their log-sum-exp, against the whole and against the float64 reference."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import sdpa
from conftest import assert_close, seed_for
from sdpa.reference import causal_mask, key_length_mask
from sdpa.testing import make_qkv, randn

attention = sdpa.scaled_dot_product_attention

DTYPES = [np.float32, np.float64]


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
        allowed &= causal_mask(L, S, bottom_right=True)
    mask = None
    if variant in ("mask", "all"):
        mask = rng.random((B, hq, L, S)) < 0.5
        mask[0, 0, 0] = False  # no key anywhere for this row
        mask[1, :, -1, : S // 2] = False  # none in the first half
        allowed &= mask
    kl = None
    if variant in ("key_lengths", "all"):
        kl = np.array([int(rng.integers(0, S + 1)), S // 3])
        allowed &= key_length_mask(kl, S)

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
            chunk_mask = causal_mask(L, S, bottom_right=True)[:, a:b] if causal else True
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
    _, exp_lse = sdpa.reference.scaled_dot_product_attention(
        q, k, v, allowed, enable_gqa=gqa, return_lse=True
    )
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_an_infinite_sink_as_one_call_does(rng, dtype):
    """A sink of +inf given to one chunk: that chunk's lse is +inf, and the merge
    must give the single call's zeros and +inf lse, not NaN, without warnings."""
    q, k, v = make_qkv(rng, batch=(1,), hq=2, L=3, S=7, E=8, dtype=dtype)
    sinks = np.array([np.inf, 0.5], dtype)
    f = sdpa.scaled_dot_product_attention
    whole, whole_lse = f(q, k, v, sinks=sinks, return_lse=True)
    o1, l1 = f(q, k[..., :2, :], v[..., :2, :], sinks=sinks, return_lse=True)
    o2, l2 = f(q, k[..., 2:, :], v[..., 2:, :], return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = sdpa.merge_attention([o1, o2], [l1, l2])
    assert np.isposinf(whole_lse[:, 0]).all() and np.isposinf(lse[:, 0]).all()
    np.testing.assert_array_equal(out[:, 0], whole[:, 0])  # zeros
    assert_close(out[:, 1], whole[:, 1], dtype)
    assert_close(lse[:, 1], whole_lse[:, 1], dtype)


def test_merge_infinite_lses_share_the_weight():
    outs = [np.full((1, 2), 2.0), np.full((1, 2), 4.0), np.full((1, 2), 100.0)]
    out, lse = sdpa.merge_attention(outs, [np.array([np.inf]), np.array([np.inf]), np.array([3.0])])
    np.testing.assert_array_equal(out, 3.0)
    assert np.isposinf(lse).all()


def test_merge_takes_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    outs = [np.full((2, 3), 1.0, bf16), np.full((2, 3), 3.0, bf16)]
    out, lse = sdpa.merge_attention(outs, [np.zeros(2, np.float32)] * 2)
    assert out.dtype == lse.dtype == np.float32  # NumPy's promotion of bfloat16 and float32
    np.testing.assert_allclose(out, 2.0)
    out, lse = sdpa.merge_attention(outs, [np.zeros(2, bf16)] * 2)
    assert out.dtype == lse.dtype == bf16
    np.testing.assert_allclose(out.astype(np.float32), 2.0)
    np.testing.assert_allclose(lse.astype(np.float32), np.log(2.0), rtol=1e-2)
