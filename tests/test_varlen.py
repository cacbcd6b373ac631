"""varlen_attention: packed sequences against the reference, sequence by sequence,
and against the padded batch with key lengths."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close

ref = sdpa.reference.scaled_dot_product_attention


def packed(rng, lens_q, lens_k, hq, hkv, E, Ev, dtype=np.float64):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rng.standard_normal((cq[-1], hq, E)).astype(dtype)
    k = rng.standard_normal((ck[-1], hkv, E)).astype(dtype)
    v = rng.standard_normal((ck[-1], hkv, Ev)).astype(dtype)
    return q, k, v, cq, ck


def expected(q, k, v, cq, ck, **kw):
    """The reference on each sequence, packed back."""
    hq, hkv = q.shape[1], k.shape[1]
    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.zeros(q.shape[:2])
    slopes, sinks = kw.pop("alibi_slopes", None), kw.pop("sinks", None)
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].transpose(1, 0, 2)
        ki = k[ck[i]:ck[i + 1]].transpose(1, 0, 2)
        vi = v[ck[i]:ck[i + 1]].transpose(1, 0, 2)
        extra = {}
        if slopes is not None:
            extra["alibi_slopes"] = np.broadcast_to(slopes, (len(cq) - 1, hq))[i]
        if sinks is not None:
            extra["sinks"] = np.broadcast_to(sinks, (len(cq) - 1, hq))[i]
        o, l_ = ref(qi, ki, vi, enable_gqa=hq != hkv, return_lse=True, **kw, **extra)
        out[cq[i]:cq[i + 1]] = o.transpose(1, 0, 2)
        lse[cq[i]:cq[i + 1]] = l_.T
    return out, lse


LENGTHS = [  # query and key lengths: prefill, chunked prefill, decode, empty sequences, no keys
    ([5, 17, 1, 33], [5, 17, 1, 33]),
    ([3, 0, 9, 1], [10, 4, 9, 70]),
    ([1, 1, 1], [40, 1, 100]),
    ([4, 2], [0, 6]),
]


@pytest.mark.parametrize("lens", LENGTHS, ids=["prefill", "chunked", "decode", "no-keys"])
@pytest.mark.parametrize("is_causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_reference_per_sequence(rng, lens, is_causal, dtype):
    q, k, v, cq, ck = packed(rng, *lens, 4, 2, 16, 12, dtype)
    variants = ({}, dict(window=(4, 0), softcap=3.0),
                dict(alibi_slopes=rng.random(4), sinks=rng.random((len(lens[0]), 4))))
    for kw in variants:
        out, lse = sdpa.varlen_attention(q, k, v, cq, ck, is_causal=is_causal, return_lse=True, **kw)
        want, want_lse = expected(q, k, v, cq, ck, is_causal=is_causal, **dict(kw))
        assert out.dtype == dtype and out.shape == (q.shape[0], 4, 12) and lse.shape == (q.shape[0], 4)
        assert_close(out, want, dtype, head_dim=16)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        seen = ~np.isneginf(want_lse)
        assert_close(lse[seen], want_lse[seen], dtype, head_dim=16)
        alone = sdpa.varlen_attention(q, k, v, cq, ck, is_causal=is_causal, **kw)
        assert np.array_equal(alone, out)


def test_equals_the_padded_batch(rng):
    """The packed call and the padded call with key_lengths agree on the real rows."""
    lens = [7, 30, 12]
    q, k, v, cq, ck = packed(rng, lens, lens, 2, 2, 16, 16, np.float32)
    Lmax = max(lens)

    def pad(a, c):
        rows = [np.pad(a[c[i]:c[i + 1]], ((0, Lmax - (c[i + 1] - c[i])), (0, 0), (0, 0))) for i in range(len(lens))]
        return np.stack(rows).transpose(0, 2, 1, 3)

    qp, kp, vp = pad(q, cq), pad(k, ck), pad(v, ck)
    padded = sdpa.scaled_dot_product_attention(qp, kp, vp, is_causal=True, key_lengths=lens)
    out = sdpa.varlen_attention(q, k, v, cq, ck, is_causal=True)
    for i, n in enumerate(lens):
        np.testing.assert_allclose(out[cq[i]:cq[i + 1]], padded[i, :, :n].transpose(1, 0, 2), rtol=2e-6, atol=2e-6)


def test_bitwise_across_threads_and_out(rng):
    q, k, v, cq, ck = packed(rng, [30, 1, 64], [30, 50, 64], 4, 1, 32, 32, np.float32)
    runs = [sdpa.varlen_attention(q, k, v, cq, ck, is_causal="bottom_right", num_threads=n) for n in (1, 2, 3)]
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    out = np.full((q.shape[0], 4, 32), np.nan, np.float32)
    assert sdpa.varlen_attention(q, k, v, cq, ck, is_causal="bottom_right", out=out) is out
    assert np.array_equal(out, runs[0])
    # a strided out
    big = np.zeros((q.shape[0], 4, 64), np.float32)
    sdpa.varlen_attention(q, k, v, cq, ck, is_causal="bottom_right", out=big[..., ::2])
    assert np.array_equal(big[..., ::2], runs[0])


def test_sixteen_bits(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        q, k, v, cq, ck = packed(rng, [9, 20], [15, 20], 4, 4, 32, 32, np.float32)
        q, k, v = (a.astype(dt) for a in (q, k, v))
        out = sdpa.varlen_attention(q, k, v, cq, ck, is_causal=True)
        assert out.dtype == dt
        want, _ = expected(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), cq, ck, is_causal=True)
        assert_close(out.astype(np.float64), want, dt, head_dim=32)


def test_inputs_are_not_written(rng):
    q, k, v, cq, ck = packed(rng, [3, 4], [5, 6], 2, 2, 8, 8)
    copies = [a.copy() for a in (q, k, v, cq, ck)]
    sdpa.varlen_attention(q, k, v, cq, ck, is_causal=True)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v, cq, ck), copies))


@pytest.mark.parametrize("cu,error,match", [
    ([1, 3, 7], ValueError, "cu_seqlens_q: must start at 0"),
    ([0, 5, 3, 7], ValueError, "non-decreasing"),
    ([0, 3, 6], ValueError, "ends at 6, but the packed query holds 7 rows"),
    ([[0, 7]], ValueError, "1-D"),
    ([0.0, 7.0], TypeError, "expected integers"),
    ([0, 3, 5, 7], ValueError, "as many sequences"),
])
def test_bad_prefix_sums(cu, error, match):
    q = np.zeros((7, 2, 4))
    with pytest.raises(error, match=match):
        sdpa.varlen_attention(q, q, q, cu, [0, 2, 7])


def test_bad_shapes_and_out():
    q = np.zeros((7, 4, 8))
    with pytest.raises(ValueError, match="query: expected 3 dims"):
        sdpa.varlen_attention(q[0], q, q, [0, 4], [0, 7])
    with pytest.raises(ValueError, match="query: 4 heads is not a multiple of the key's 3 key/value heads"):
        sdpa.varlen_attention(q, q[:, :3], q[:, :3], [0, 7], [0, 7])
    with pytest.raises(ValueError, match="same last dim"):
        sdpa.varlen_attention(q, q[..., :4], q, [0, 7], [0, 7])
    with pytest.raises(ValueError, match="out: expected shape"):
        sdpa.varlen_attention(q, q, q, [0, 7], [0, 7], out=np.zeros((7, 4, 7)))
    with pytest.raises(ValueError, match="out: overlaps the memory of query"):
        sdpa.varlen_attention(q, q.copy(), q.copy(), [0, 7], [0, 7], out=q)
    with pytest.raises(ValueError, match="window"):
        sdpa.varlen_attention(q, q, q, [0, 7], [0, 7], window=(-3, 0))
    with pytest.raises(ValueError, match="sinks"):
        sdpa.varlen_attention(q, q, q, [0, 7], [0, 7], sinks=np.zeros(3))


def test_the_core_declines_what_it_does_not_take_naming_the_argument(rng):
    """The prepared call's varlen run declines arrays not in its form with a
    reason code, as the dense run does, and options a packed call has no use
    for; nothing is written."""
    from sdpa import _core

    q, k, v, cq, ck = packed(rng, [3, 2], [4, 5], 4, 2, 8, 8, np.float32)
    cq = cq.astype(np.int64)
    call = _core.plain().prepared(True, None, False, None, None, None, False, False)
    out = np.full((5, 4, 8), 7.0, np.float32)
    cases = [
        ((q.astype(np.int32), k, v, cq, ck), "query has a dtype"),
        ((q, k.astype(np.float64), v, cq, ck), "key has a dtype"),
        ((q, k, v[:4], cq, ck), "value has a shape"),
        ((q, k, v, cq.astype(np.int32), ck), "cu_seqlens_q has a shape"),
        ((q, k, v, cq, ck[:-1]), "cu_seqlens_k has a shape"),
        ((q, k, v, cq, list(ck)), "cu_seqlens_k is not of a type"),
    ]
    for args, reason in cases:
        code = call.run_varlen(*args, None, out)
        assert isinstance(code, int) and _core.reason(code).startswith(reason), (reason, code)
    assert (out == 7.0).all()
    # a 0-d prefix sum, an output of another rank: declined, not a crash nor numpy's error
    assert _core.reason(call.run_varlen(q, k, v, np.array(0, np.int64), ck)).startswith("cu_seqlens_q has a shape")
    assert _core.reason(call.run_varlen(q, k, v, cq, ck, None, out[0])).startswith("out has a shape")
    weights = _core.plain().prepared(True, None, False, None, None, None, True, False)
    assert _core.reason(weights.run_varlen(q, k, v, cq, ck)).startswith("return_weights has a value")
    np.testing.assert_array_equal(call.run_varlen(q, k, v, cq, ck, None, out), sdpa.varlen_attention(
        q, k, v, cq, ck, is_causal=True))
