"""Randomized hunts over the newer surfaces, on every kernel set: 16-bit inputs,
int8 and 16-bit KV caches, the model variants and packed (varlen) sequences,
drawn together by ``sdpa.testing``'s Hypothesis strategies.

* ``attention_calls`` restricted to float16 / bfloat16 operands: the result is
  the float32 result of the same values rounded once (bit for bit; bfloat16 on
  the sets without bfloat16 products), on every set.
* ``cache_calls``: ``KVCache.attend`` against the float64 reference on the
  values the cache holds (``keys`` / ``values``), with the same bits for
  another thread count and the query left as it was.
* ``varlen_calls``: ``varlen_attention`` gives, bit for bit, the calls of
  ``scaled_dot_product_attention`` over each sequence, which match the
  reference.

Run longer with ``HYPOTHESIS_PROFILE=dev``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings, strategies as st

import sdpa
from sdpa.testing import (
    assert_matches_reference,
    attention_calls,
    cache_calls,
    describe_call,
    varlen_calls,
)

attention = sdpa.scaled_dot_product_attention
# every example runs on each kernel set: a quarter of the profile's examples per set
PER_SET = settings(max_examples=max(8, settings.default.max_examples // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                          HealthCheck.filter_too_much])
BF16_PRODUCTS = ("avx512_bf16", "amx")


def _half(dt) -> bool:
    return np.dtype(dt).name in ("float16", "bfloat16")


@PER_SET
@given(data=st.data())
@pytest.mark.parametrize("regime", ["small", "decode", "tiled"])
def test_16bit_is_float32_rounded_once(isa, data, regime):
    p = data.draw(attention_calls(regime, specials=False).filter(
        lambda p: _half(p["q"].dtype) and p["q"].dtype == p["k"].dtype == p["v"].dtype))
    note(describe_call(p))
    dt = p["q"].dtype
    kwargs = dict(attn_mask=p["mask"], is_causal=p["causal"], scale=p["scale"], enable_gqa=p["gqa"],
                  key_lengths=p["key_lengths"], return_lse=True, num_threads=p["num_threads"],
                  window=p["window"], softcap=p["softcap"], alibi_slopes=p["alibi_slopes"], sinks=p["sinks"])
    with np.errstate(all="ignore"):
        out, lse = attention(p["q"], p["k"], p["v"], **kwargs)
        out32, lse32 = attention(*(np.asarray(p[n], np.float32) for n in "qkv"), **kwargs)
    assert out.dtype == dt and lse.dtype == np.float32
    if dt.name == "bfloat16" and isa in BF16_PRODUCTS:
        # P rounded to bfloat16 before P V (documented); the reference decides
        assert_matches_reference(out, None, p["q"], p["k"], p["v"], p["mask"], p["causal"], p["scale"], p["gqa"],
                                 p["key_lengths"], lse=lse, window=p["window"], softcap=p["softcap"],
                                 alibi_slopes=p["alibi_slopes"], sinks=p["sinks"])
        return
    with np.errstate(all="ignore"):
        rounded = out32.astype(dt)
    assert np.array_equal(out.view(np.uint16), rounded.view(np.uint16)), "not float32 rounded once"
    assert np.array_equal(lse, lse32, equal_nan=True)


@PER_SET
@given(data=st.data())
def test_cache_attend_matches_reference(isa, data):
    p = data.draw(cache_calls())
    cache = p["cache"]
    note(f"{cache!r} appends={p['appends']} q={p['q'].dtype}{p['q'].shape} mask={p['mask'] is not None} "
         f"causal={p['causal']!r} scale={p['scale']} window={p['window']} softcap={p['softcap']} "
         f"alibi={p['alibi_slopes']!r} sinks={p['sinks']!r} threads={p['num_threads']}")
    keys, values = cache.keys, cache.values
    assert np.isfinite(keys).all() and np.isfinite(values).all()  # finite appends stay finite
    q_before = p["q"].copy()
    kwargs = dict(is_causal=p["causal"], scale=p["scale"], window=p["window"], softcap=p["softcap"],
                  alibi_slopes=p["alibi_slopes"], sinks=p["sinks"], return_lse=True)
    with np.errstate(all="ignore"):
        out, lse = cache.attend(p["q"], p["mask"], num_threads=p["num_threads"], **kwargs)
        again = cache.attend(p["q"], p["mask"], num_threads=3 if p["num_threads"] != 3 else 1, **kwargs)
    assert np.array_equal(p["q"], q_before)
    if p["storage"] == "int8":  # the query computed in float32, a 16-bit one kept for the output
        want_dtype = p["q"].dtype if _half(p["q"].dtype) else np.dtype(np.float32)
    else:
        want_dtype = sdpa.testing.result_dtype(p["q"], keys, values)
    assert out.dtype == want_dtype
    assert np.array_equal(out, again[0], equal_nan=True) and np.array_equal(lse, again[1], equal_nan=True)
    assert_matches_reference(out, None, p["q"], keys, values, p["mask"], p["causal"], p["scale"], True,
                             lse=lse, window=p["window"], softcap=p["softcap"],
                             alibi_slopes=p["alibi_slopes"], sinks=p["sinks"])


@PER_SET
@given(data=st.data())
def test_varlen_is_one_call_per_sequence(isa, data):
    p = data.draw(varlen_calls())
    note(f"q {p['q'].dtype}{p['q'].shape} k {p['k'].shape} v {p['v'].shape} lq={p['lq']} lk={p['lk']} "
         f"causal={p['causal']!r} scale={p['scale']} window={p['window']} softcap={p['softcap']} "
         f"alibi={p['alibi_slopes']!r} sinks={p['sinks']!r}")
    common = dict(is_causal=p["causal"], scale=p["scale"], window=p["window"], softcap=p["softcap"])
    with np.errstate(all="ignore"):
        out, lse = sdpa.varlen_attention(p["q"], p["k"], p["v"], p["cu_q"], p["cu_k"], return_lse=True,
                                         alibi_slopes=p["alibi_slopes"], sinks=p["sinks"],
                                         num_threads=p["num_threads"], **common)
    n = len(p["lq"])

    def per_seq(x, i):
        if x is None:
            return None
        a = np.asarray(x)  # (hq,), (n, hq) or any shape that broadcasts to it
        return np.broadcast_to(a, (n, p["hq"]))[i] if a.ndim == 2 else a

    for i in range(n):
        q0, q1, k0, k1 = p["cu_q"][i], p["cu_q"][i + 1], p["cu_k"][i], p["cu_k"][i + 1]
        if q1 == q0:
            continue
        q, k, v = (x.transpose(1, 0, 2) for x in (p["q"][q0:q1], p["k"][k0:k1], p["v"][k0:k1]))
        seq = dict(common, alibi_slopes=per_seq(p["alibi_slopes"], i), sinks=per_seq(p["sinks"], i))
        with np.errstate(all="ignore"):
            o, s = attention(q, k, v, enable_gqa=True, return_lse=True, **seq)
        assert np.array_equal(out[q0:q1].transpose(1, 0, 2), o, equal_nan=True), f"sequence {i}"
        assert np.array_equal(lse[q0:q1].T, s, equal_nan=True), f"sequence {i}"
        assert_matches_reference(o, None, q, k, v, None, p["causal"], p["scale"], True, lse=s,
                                 window=p["window"], softcap=p["softcap"], alibi_slopes=seq["alibi_slopes"],
                                 sinks=seq["sinks"])

