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
* ``paged_calls``: ``PagedKVCache.attend`` over pools with a random history
  (appends, empty ones too, forks, new sequences, writes that skip every
  token), every cache dtype, latent views, tree masks, ``integer_qk`` and
  ``integer_pv``: each sequence gets what a call on it alone gives (bit for
  bit unless blocks are shared), that matches the reference over the values
  the pool holds (``integer_qk``: over the query rows rounded to int8), the
  thread count changes no bit, and neither the query nor the pool is written.

Run longer with ``HYPOTHESIS_PROFILE=dev``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings, strategies as st

import sdpa
from sdpa import _core, reference
from sdpa.kvcache import dequantize
from sdpa.testing import (
    assert_matches_reference,
    attention_calls,
    cache_calls,
    describe_call,
    paged_calls,
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



def _pool(cache):
    """Copies of everything a paged cache stores."""
    return [None if a is None else a.copy()
            for a in (cache.key_cache, cache.value_cache, cache.key_scale, cache.value_scale)]


def _same_pool(cache, before):
    now = _pool(cache)
    return all((a is None and b is None) or np.array_equal(a.view(np.uint8), b.view(np.uint8))
               for a, b in zip(now, before))


def _stored(cache, data, scales, table, n, storage):
    """Positions [0, n) of one sequence as float64, (Hkv, n, C): the values the pool holds."""
    bs = cache.block_size
    blocks = [table[j] for j in range(-(-n // bs))]
    d = np.concatenate([data[b] for b in blocks], axis=1)[:, :n]
    if storage not in _core.QUANTIZED:
        return d.astype(np.float64)
    sc = None if scales is None else np.concatenate([scales[b] for b in blocks], axis=1)[:, :n]
    return dequantize(int(_core.QUANTIZED[storage]), d, sc).astype(np.float64)


@PER_SET
@given(data=st.data())
def test_paged_calls_keep_their_promises(isa, data):
    p = data.draw(paged_calls())
    cache, q, ids, L, tree = p["cache"], p["q"], p["ids"], p["L"], p["tree"]
    note(f"{cache!r} ops={p['ops']} ids={ids} q={q.dtype}{q.shape} tree={tree is not None} "
         f"causal={p['is_causal']} scale={p['scale']} integer_qk={p['integer_qk']} "
         f"integer_pv={p['integer_pv']} threads={p['num_threads']}")
    before = _pool(cache)
    for T in p["skipped"]:  # a write whose every slot is -1 (or that has no token) writes nothing
        k = np.ones((T, p["hkv"], p["E"]), np.float32)
        v = None if p["latent"] else np.ones((T, p["hkv"], p["Ev"]), np.float32)
        sdpa.paged_write(k, v, cache.key_cache, cache.value_cache, np.full(T, -1), key_scale=cache.key_scale,
                         value_scale=cache.value_scale, kv_dtype=cache.kv_dtype)
    assert _same_pool(cache, before), "a write that skips every token changed the pool"
    q_before = q.copy()
    kw = dict(is_causal=p["is_causal"], scale=p["scale"], tree_mask=tree, integer_qk=p["integer_qk"],
              integer_pv=p["integer_pv"], return_lse=True)
    with np.errstate(all="ignore"):
        out, lse = cache.attend(ids, q, num_threads=p["num_threads"], **kw)
        again, again_lse = cache.attend(ids, q, num_threads=1 if p["num_threads"] != 1 else 3, **kw)
    assert np.array_equal(out, again, equal_nan=True) and np.array_equal(lse, again_lse, equal_nan=True), \
        "the thread count changed the result"
    assert np.array_equal(q.view(np.uint8), q_before.view(np.uint8)), "the query was written"
    assert _same_pool(cache, before), "attend wrote the pool"

    bt, lens = cache.tables(ids)
    used = [set(bt[i, : -(-int(n) // p["bs"])].tolist()) for i, n in enumerate(lens)]
    # a sequence's blocks read once for others too (integer_pv never merges them)
    shared = [not p["integer_pv"] and any(used[i] & used[j] for j in range(len(ids)) if j != i)
              for i in range(len(ids))]
    scale = 1 / np.sqrt(p["E"]) if p["scale"] is None else p["scale"]
    for i, s in enumerate(ids):
        t = None if tree is None else (tree[i : i + 1] if tree.ndim == 3 else tree)
        alone, alone_lse = cache.attend([s], q[i : i + 1], **dict(kw, tree_mask=t))
        if shared[i]:  # shared blocks are read once and merged: float32 rounding apart, which the exponentials
            # of large scores and cancelling values amplify (the reference check below holds each to its row's
            # conditioning)
            tol = {"float16": 2e-3, "bfloat16": 1.6e-2}.get(out.dtype.name, 2e-4)
            np.testing.assert_allclose(out[i].astype(np.float64), alone[0].astype(np.float64), rtol=tol, atol=tol)
            np.testing.assert_allclose(lse[i], alone_lse[0], rtol=1e-5, atol=1e-5)
        else:
            assert np.array_equal(out[i], alone[0], equal_nan=True), f"sequence {s}: not its own call's bits"
            assert np.array_equal(lse[i], alone_lse[0], equal_nan=True), f"sequence {s}"
        n = int(lens[i])
        k = _stored(cache, cache.key_cache, cache.key_scale, bt[i], n, p["storage"])
        v = _stored(cache, cache.value_cache, cache.value_scale, bt[i], n, p["storage"])
        mask, causal = None, "bottom_right" if p["is_causal"] else False
        if t is not None:
            mask = np.ones((L, n), bool)
            mask[:, n - L :] = t.reshape(L, L)
            causal = False
        qi = q[i : i + 1]
        scaled = qi.astype(np.float32) * np.float32(scale)
        qscale = np.abs(scaled).max(-1, keepdims=True) / np.float32(127)
        with np.errstate(all="ignore"):  # integer_qk's query rows: rounded to int8, each with its scale
            rounded = np.where(qscale > 0, np.clip(np.round(scaled / qscale), -127, 127) * qscale, 0.0)
        if p["integer_pv"]:  # P rounded to bytes a run of 64 keys: within 64 half steps of the values
            bound = 64 * 0.5 / 255 * np.abs(v).max() + 1e-2
            queries = [(qi, scale)]
            if p["integer_qk"]:  # over the rounded rows (always for one row a head; longer ones may be float)
                queries = [(rounded, 1.0)] + (queries if L > 1 else [])
            errors = [np.abs(out[i] - reference.scaled_dot_product_attention(
                x.astype(np.float64), k[None], v[None], attn_mask=mask, is_causal=causal, scale=c,
                enable_gqa=True)[0]).max() for x, c in queries]
            assert min(errors) <= bound, f"sequence {s}: integer_pv beyond its bound ({errors} > {bound})"
            continue
        args = (None, qi, k[None], v[None], mask, causal, p["scale"], True)
        if p["integer_qk"]:  # the rounded query rows (decoding sizes)
            try:
                assert_matches_reference(out[i : i + 1], None, rounded.astype(np.float64), k[None], v[None], mask,
                                         causal, 1.0, True, lse=lse[i : i + 1])
                continue
            except AssertionError:
                if L == 1:  # one row a head always computes in integers
                    raise
            # longer queries may take the tiled path, which computes in float (documented)
        assert_matches_reference(out[i : i + 1], *args, lse=lse[i : i + 1])
