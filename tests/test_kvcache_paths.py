"""KVCache.attend runs the common calls straight from a prepared call of the
core (sdpa._core.Call), int8 caches included: results bit for bit those
of the general path (sdpa._api._attention_general) over the same storage, and
every call the fast path declines still converted, or refused with the same
error naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from sdpa import _api

CACHES = {
    "int8": dict(dtype="int8"),
    "int8-groups": dict(dtype="int8", group_size=16),
    "float32": dict(dtype=np.float32),
    "float16": dict(dtype=np.float16),
}


def filled(rng, kind, batch=2, hkv=2, length=40, e=32, ev=48, capacity=64):
    cache = sdpa.KVCache(batch, hkv, capacity, e, ev, **CACHES[kind])
    cache.append(rng.standard_normal((batch, hkv, length, e)), rng.standard_normal((batch, hkv, length, ev)))
    return cache


GENERAL = _api._attention_general


def general(cache, query, attn_mask=None, is_causal="bottom_right", scale=None, return_lse=False,
            out=None, num_threads=None, diagonal=None):
    """The general path over the cache's storage, as KVCache._attend hands it."""
    n = len(cache)
    k, v = cache._k[:, :, :n], cache._v[:, :, :n]
    scales = {}
    if cache.dtype == np.int8:
        scales = dict(key_scale=cache._ks[:, :, :n], value_scale=cache._vs[:, :, :n], group_size=cache._group)
    heads = np.shape(query)[-3] if np.ndim(query) >= 3 else 1
    return GENERAL(
        query, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=heads != cache.num_kv_heads, return_lse=return_lse, out=out, num_threads=num_threads,
        diagonal=diagonal, **scales,
    )


@pytest.fixture
def fast_only(monkeypatch):
    """Makes KVCache fail if a call reaches the general path."""
    def refuse(*args, **kwargs):
        raise AssertionError("the call took the general path")

    monkeypatch.setattr(sdpa.kvcache, "general", refuse)


def assert_same(got, want):
    got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def query_dtypes():
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    return [np.float32, np.float16, bf16]


KWARGS = {
    "decode": {},
    "top-left": {"is_causal": "top_left"},
    "not-causal": {"is_causal": False},
    "lse": {"return_lse": True},
    "scale-threads": {"scale": 0.25, "num_threads": 2},
}


@pytest.mark.parametrize("kwargs", KWARGS.values(), ids=KWARGS.keys())
@pytest.mark.parametrize("hq,L", [(2, 1), (8, 1), (8, 5), (4, 40)], ids=["mha", "gqa", "gqa-5", "prefill"])
@pytest.mark.parametrize("kind", CACHES)
def test_fast_path_equals_general_path(rng, kind, hq, L, kwargs, fast_only):
    cache = filled(rng, kind)
    for qdtype in query_dtypes():
        q = rng.standard_normal((2, hq, L, 32)).astype(qdtype)
        got = cache.attend(q, **kwargs)
        assert_same(got, general(cache, q, **kwargs))
        assert (got[0] if isinstance(got, tuple) else got).dtype == q.dtype


@pytest.mark.parametrize("kind", CACHES)
def test_fast_path_masks_and_out(rng, kind, fast_only):
    cache = filled(rng, kind, batch=1)
    q = rng.standard_normal((1, 8, 3, 32)).astype(np.float32)
    bool_mask = rng.random((8, 3, 40)) < 0.7
    float_mask = rng.standard_normal((1, 1, 3, 40)).astype(np.float32)
    for kw in ({"attn_mask": bool_mask}, {"attn_mask": float_mask}, {"attn_mask": bool_mask, "return_lse": True}):
        assert_same(cache._attend(q, kw["attn_mask"], "bottom_right", None, kw.get("return_lse", False),
                                  None, None), general(cache, q, **kw))
    out = np.empty((1, 3, 8, 48), np.float32).transpose(0, 2, 1, 3)  # any strides
    got = cache.attend(q, out=out, return_lse=True)
    assert got[0] is out
    assert_same(got, general(cache, q, out=np.empty_like(out), return_lse=True))


@pytest.mark.parametrize("kind", CACHES)
def test_diagonal_on_the_fast_path(rng, kind, fast_only):
    cache = filled(rng, kind, batch=1)
    q = rng.standard_normal((1, 4, 3, 32)).astype(np.float32)
    mask = rng.random((1, 4, 3, 40)) < 0.8
    for diagonal in (-5, 0, 12, 100, 2**62):
        for m in (None, mask):
            got = cache._attend(q, m, False, 0.2, True, None, None, diagonal=diagonal)
            assert_same(got, general(cache, q, m, False, 0.2, True, diagonal=diagonal))


def test_empty_cache(rng, fast_only):
    for kind in CACHES:
        cache = sdpa.KVCache(1, 2, 8, 32, 48, **CACHES[kind])
        q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
        out, lse = cache.attend(q, return_lse=True)
        assert not out.any() and np.isneginf(lse).all()
        assert_same((out, lse), general(cache, q, return_lse=True))


def swapped(q):
    return q.astype(q.dtype.newbyteorder())


DECLINED = {
    "float64 query": (lambda q: q.astype(np.float64), {}),
    "int query": (lambda q: np.round(q * 4).astype(np.int32), {}),
    "list query": (lambda q: q.tolist(), {}),
    "byte-swapped query": (swapped, {}),
    "numpy bool causal": (lambda q: q, {"is_causal": np.bool_(True)}),
    "int scale": (lambda q: q, {"scale": 1}),
    "numpy diagonal": (lambda q: q, {"diagonal": np.int64(3)}),
    "float16 mask": (lambda q: q, {"attn_mask": np.zeros((3, 40), np.float16)}),
}


@pytest.mark.parametrize("change, kwargs", DECLINED.values(), ids=DECLINED.keys())
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "float32"])
def test_declined_calls_take_the_general_path(rng, kind, change, kwargs):
    cache = filled(rng, kind, batch=1)
    q = change(rng.standard_normal((1, 4, 3, 32)).astype(np.float32))
    kw = dict(kwargs)
    diagonal = kw.pop("diagonal", None)
    args = (kw.get("attn_mask"), kw.get("is_causal", "bottom_right"), kw.get("scale"), True, None, None)
    got = cache._attend(q, *args, diagonal=diagonal)
    assert_same(got, general(cache, q, *args[:4], diagonal=diagonal))


BAD = {
    "head_dim": (lambda q: q[..., :16], {}, ValueError, "query"),
    "1-d query": (lambda q: q[0, 0, 0], {}, ValueError, "query"),
    "heads": (lambda q: q[:, :3], {}, ValueError, "enable_gqa"),
    "complex query": (lambda q: q.astype(np.complex64), {}, TypeError, "query"),
    "string query": (lambda q: "query", {}, TypeError, "query"),
    "causal": (lambda q: q, {"is_causal": "diagonal"}, ValueError, "is_causal"),
    "causal type": (lambda q: q, {"is_causal": 1.5}, TypeError, "is_causal"),
    "scale": (lambda q: q, {"scale": "1"}, TypeError, "scale"),
    "threads": (lambda q: q, {"num_threads": 0}, ValueError, "num_threads"),
    "threads type": (lambda q: q, {"num_threads": 2.0}, TypeError, "num_threads"),
    "mask shape": (lambda q: q, {"attn_mask": np.ones((3, 41), bool)}, ValueError, "attn_mask"),
    "mask dtype": (lambda q: q, {"attn_mask": np.ones((3, 40), np.int8)}, TypeError, "attn_mask"),
    "out shape": (lambda q: q, {"out": np.empty((1, 4, 3, 16), np.float32)}, ValueError, "out"),
    "out dtype": (lambda q: q, {"out": np.empty((1, 4, 3, 32), np.float64)}, TypeError, "out"),
    "out read-only": (lambda q: q, {"out": np.broadcast_to(np.float32(0), (1, 4, 3, 32))}, ValueError,
                      "out"),
    "out type": (lambda q: q, {"out": [0.0]}, TypeError, "out"),
    "out overlaps query": (lambda q: q, {"out": "query"}, ValueError, "out"),
}


@pytest.mark.parametrize("change, kwargs, error, name", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "float32"])
def test_bad_calls_raise_the_general_paths_errors(rng, kind, change, kwargs, error, name):
    cache = filled(rng, kind, batch=1, e=32, ev=32)
    q = change(rng.standard_normal((1, 4, 3, 32)).astype(np.float32))
    kw = dict(kwargs)
    if isinstance(kw.get("out"), str):
        kw["out"] = q
    with pytest.raises(error, match=name) as raised:
        cache.attend(q, **kw)
    with pytest.raises(error) as want:
        general(cache, q, **kw)
    assert str(raised.value) == str(want.value)

