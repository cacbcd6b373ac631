"""The oracle of the fuzz and hunt tests, ``sdpa.testing.assert_matches_reference``,
rejects wrong answers: a corrupted row, NaN where the reference is finite and a
number where it is NaN, nonzero output for a row that sees no key, a wrong
weight, an lse off by more than its tolerance; and accepts the right ones,
including what its tolerances allow on purpose."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from sdpa.testing import assert_matches_reference, make_qkv

attention = sdpa.scaled_dot_product_attention


@pytest.fixture
def call(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=13, E=8, dtype=np.float32)
    out, w, lse = attention(q, k, v, is_causal=True, return_weights=True, return_lse=True)
    assert_matches_reference(out, w, q, k, v, is_causal=True, lse=lse)  # the right answer passes
    return q, k, v, out, w, lse


def test_a_corrupted_row_is_rejected(call):
    q, k, v, out, w, lse = call
    bad = out.copy()
    bad[1, 0, 4, 2] *= 1 + 1e-3
    with pytest.raises(AssertionError, match="query 4"):
        assert_matches_reference(bad, w, q, k, v, is_causal=True, lse=lse)


def test_nan_in_the_wrong_place_is_rejected(call):
    q, k, v, out, w, lse = call
    bad = out.copy()
    bad[0, 1, 3, 0] = np.nan
    with pytest.raises(AssertionError, match="query 3"):
        assert_matches_reference(bad, w, q, k, v, is_causal=True, lse=lse)
    # and a number where the reference is NaN: a NaN in row 5's query
    qn = q.copy()
    qn[0, 0, 5, 1] = np.nan
    with np.errstate(invalid="ignore"):
        good = attention(qn, k, v, is_causal=True)
    assert np.isnan(good[0, 0, 5]).all()
    assert_matches_reference(good, None, qn, k, v, is_causal=True)
    with pytest.raises(AssertionError, match="query 5"):
        assert_matches_reference(np.nan_to_num(good), None, qn, k, v, is_causal=True)


def test_a_row_that_sees_no_key_must_be_zeros(call):
    q, k, v, out, w, lse = call
    lengths = np.array([0, 13])  # batch 0 sees no key
    got = attention(q, k, v, key_lengths=lengths)
    assert not got[0].any()
    assert_matches_reference(got, None, q, k, v, key_lengths=lengths)
    bad = got.copy()
    bad[0, 1, 2, 3] = 1e-30
    with pytest.raises(AssertionError, match="sees no key"):
        assert_matches_reference(bad, None, q, k, v, key_lengths=lengths)


def test_a_wrong_weight_is_rejected(call):
    q, k, v, out, w, lse = call
    bad = w.copy()
    bad[1, 1, 8, 3] *= 1.001
    with pytest.raises(AssertionError, match="weights"):
        assert_matches_reference(out, bad, q, k, v, is_causal=True, lse=lse)
    bad = w.copy()
    bad[1, 1, 2, 7] = 1e-9  # a weight past the causal limit
    with pytest.raises(AssertionError, match="weights"):
        assert_matches_reference(out, bad, q, k, v, is_causal=True, lse=lse)


def test_an_lse_off_by_more_than_its_tolerance_is_rejected(call):
    """The lse may differ by the scores' rounding, d + 16 eps (S + E + 8) + 8 eps
    |lse| (an error of an ulp or a few is the float32 computation's own); past
    that it is wrong."""
    q, k, v, out, w, lse = call
    one_ulp = np.nextafter(lse, np.float32(np.inf))
    assert_matches_reference(out, w, q, k, v, is_causal=True, lse=one_ulp)
    bad = lse.copy()
    bad[0, 0, 6] += 1e-4
    with pytest.raises(AssertionError, match="lse"):
        assert_matches_reference(out, w, q, k, v, is_causal=True, lse=bad)
    bad = lse.copy()
    bad[0, 0, 6] = -np.inf
    with pytest.raises(AssertionError, match="lse"):
        assert_matches_reference(out, w, q, k, v, is_causal=True, lse=bad)


def test_the_cut_and_a_16bit_overflow_are_allowed_but_not_more():
    """What the hunts found the oracle too strict about, and that it still
    rejects a wrong answer next to each allowance."""
    # a weight just above float32's smallest normal number, left 0 by the exponential's cut
    k = np.array([[0.0], [-87.332]], np.float32)
    q = np.ones((1, 1), np.float32)
    v = np.array([[1.0], [2.0]], np.float32)
    out, w = attention(q, k, v, scale=1.0, return_weights=True)
    assert w[0, 1] == 0 and sdpa.reference.scaled_dot_product_attention(
        q, k, v, scale=1.0, return_weights=True)[1][0, 1] > np.finfo(np.float32).tiny
    assert_matches_reference(out, w, q, k, v, scale=1.0)
    with pytest.raises(AssertionError, match="weights"):
        assert_matches_reference(out, w * np.float32(1.001), q, k, v, scale=1.0)
    # a float16 output of float32 values beyond float16's range: inf is the rounding
    q16 = np.ones((1, 1), np.float16)
    big = np.array([[1e30], [1e30]], np.float32)
    out16 = attention(q16, k, big, scale=1.0)
    assert out16.dtype == np.float16 and np.isposinf(out16).all()
    assert_matches_reference(out16, None, q16, k, big, scale=1.0)
    with pytest.raises(AssertionError):
        assert_matches_reference(np.full_like(out16, 3), None, q16, k, v, scale=1.0)
