"""The model variants: sliding windows, softcap, ALiBi and attention sinks.

The reference is checked against what each variant amounts to in plain terms
(a bool mask, an additive mask, an extra key of value zero); the kernels are
checked against the reference on every kernel set, combined with each other and
with masks, causality, GQA, key lengths, weights and the log-sum-exp, in the
tiled and the row (decode) path, under forced blockings, and bitwise across
thread counts.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import sdpa
from conftest import assert_close
from sdpa import _core
from sdpa.testing import make_qkv

ref = sdpa.reference.scaled_dot_product_attention


def offset(is_causal, L, S):
    return 0 if (bool(is_causal) and is_causal != "bottom_right") else S - L


def window_mask(L, S, left, right, o):
    i = np.arange(L)[:, None] + o
    j = np.arange(S)[None, :]
    keep = np.ones((L, S), dtype=bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


# ---- the reference against the plain meaning of each variant ----

@pytest.mark.parametrize("is_causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("window", [(3, 0), (0, 0), (2, 5), (-1, 1), (4, -1), (-1, -1)])
def test_reference_window_is_a_bool_mask(rng, is_causal, window):
    q, k, v = make_qkv(rng, (2,), 3, 3, 9, 13, 8)
    keep = window_mask(9, 13, *window, offset(is_causal, 9, 13))
    got, lse = ref(q, k, v, is_causal=is_causal, window=window, return_lse=True)
    want, want_lse = ref(q, k, v, keep, is_causal=is_causal, return_lse=True)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("is_causal", [False, True, "bottom_right"])
def test_reference_alibi_is_an_additive_mask(rng, is_causal):
    q, k, v = make_qkv(rng, (2,), 4, 4, 7, 11, 8)
    slopes = rng.random(4)
    o = offset(is_causal, 7, 11)
    distance = np.abs(np.arange(7)[:, None] + o - np.arange(11)[None, :])
    bias = -slopes[:, None, None] * distance
    np.testing.assert_allclose(
        ref(q, k, v, is_causal=is_causal, alibi_slopes=slopes),
        ref(q, k, v, bias, is_causal=is_causal), rtol=1e-14, atol=1e-14,
    )


def test_reference_softcap_caps_the_scaled_scores(rng):
    q, k, v = make_qkv(rng, (), 2, 2, 5, 6, 4)
    q *= 10
    cap, scale = 3.0, 0.7
    mask = rng.standard_normal((5, 6))
    s = cap * np.tanh(q @ np.swapaxes(k, -1, -2) * scale / cap) + mask
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(ref(q, k, v, mask, scale=scale, softcap=cap), w @ v, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_sink_is_a_key_with_value_zero(rng, is_causal):
    """A sink is a key that every row sees, whose score is the sink logit and
    whose value is zero: computed with that extra key in front."""
    q, k, v = make_qkv(rng, (2,), 3, 3, 6, 8, 4, 5)
    sinks = rng.standard_normal((2, 3)) * 2
    out, w, lse = ref(q, k, v, is_causal=is_causal and "bottom_right", sinks=sinks,
                      return_weights=True, return_lse=True)
    scale = 0.5
    qs = q * scale  # scores q.k * scale; the extra key gives the sink itself
    k2 = np.concatenate([np.zeros((2, 3, 1, 4)), k], axis=-2)
    v2 = np.concatenate([np.zeros((2, 3, 1, 5)), v], axis=-2)
    s = qs @ np.swapaxes(k2, -1, -2)
    s[..., 0] = sinks[..., None]
    if is_causal:
        s[..., 1:] = np.where(window_mask(6, 8, -1, 0, 2), s[..., 1:], -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    want_w = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(ref(q, k, v, is_causal=is_causal and "bottom_right", scale=scale, sinks=sinks),
                               want_w @ v2, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(w.sum(-1), 1 - np.exp(sinks[..., None] - lse), rtol=1e-12)
    np.testing.assert_allclose(out, np.einsum("bhls,bhsv->bhlv", w, v), rtol=1e-12, atol=1e-13)


def test_reference_sink_of_a_row_that_sees_nothing():
    q, k, v = make_qkv(np.random.default_rng(0), (), 2, 2, 3, 4, 4)
    keep = np.zeros((3, 4), dtype=bool)
    out, lse = ref(q, k, v, keep, sinks=[0.5, -1.0], return_lse=True)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, [[0.5] * 3, [-1.0] * 3])


# ---- the kernels against the reference ----

SHAPES = {  # L, S, Hq, Hkv: tiled prefill, a long row-mode decode, GQA decode, tiles of many rows
    "prefill": (70, 90, 4, 4),
    "decode": (1, 300, 4, 4),
    "gqa-decode": (2, 130, 4, 1),
    "gqa-prefill": (150, 200, 4, 2),
}
WINDOWS = [None, (5, 0), (17, 3), (-1, 7), (0, -1), (40, 40)]


def call_both(q, k, v, **kw):
    got = sdpa.scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True, **kw)
    want = ref(q, k, v, return_weights=True, return_lse=True, **kw)
    return got, want


def assert_triple(got, want, dtype, E):
    out, w, lse = got
    eo, ew, el = want
    cdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    assert out.dtype == dtype and w.dtype == cdt and lse.dtype == cdt
    assert_close(out, eo, dtype, head_dim=E)
    assert_close(w, np.broadcast_to(ew, w.shape), cdt, head_dim=E)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(el))
    seen = ~np.isneginf(el)
    assert_close(lse[seen], el[seen], cdt, head_dim=E)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_set_variants_against_reference(isa, rng, dtype, shape):
    L, S, hq, hkv = SHAPES[shape]
    combos = itertools.product([False, True, "bottom_right"], WINDOWS, [None, 2.5], [False, True], [False, True])
    for causal, window, cap, alibi, sinks in combos:
        if rng.random() > 0.35:  # a third of the grid per kernel set and shape, a different third each
            continue
        q, k, v = make_qkv(rng, (2,), hq, hkv, L, S, 24, 20, dtype)
        kw = dict(
            is_causal=causal, enable_gqa=hq != hkv, window=window, softcap=cap,
            alibi_slopes=rng.random(hq) / 4 if alibi else None,
            sinks=rng.standard_normal((2, hq)) if sinks else None,
        )
        assert_triple(*call_both(q, k, v, **kw), dtype, 24)
        plain = sdpa.scaled_dot_product_attention(q, k, v, **kw)
        assert_close(plain, ref(q, k, v, **kw), dtype, head_dim=24)


@pytest.mark.parametrize("mask_kind", ["bool", "float", "padding"])
@pytest.mark.parametrize("shape", ["prefill", "gqa-decode"])
def test_kernel_set_variants_with_masks_and_key_lengths(isa, rng, mask_kind, shape):
    L, S, hq, hkv = SHAPES[shape]
    q, k, v = make_qkv(rng, (3,), hq, hkv, L, S, 16, 16, np.float32)
    if mask_kind == "bool":
        mask = rng.random((hq, L, S)) < 0.7
    elif mask_kind == "float":
        mask = np.where(rng.random((hq, L, S)) < 0.2, -np.inf, rng.standard_normal((hq, L, S))).astype(np.float32)
    else:
        mask = np.arange(S) < rng.integers(S // 3, S, (3, 1, 1, 1))
    lengths = rng.integers(S // 2, S + 1, 3)
    for window, causal in (((9, 2), True), ((-1, 20), "bottom_right"), ((30, -1), False)):
        kw = dict(attn_mask=mask, key_lengths=lengths, window=window, is_causal=causal, enable_gqa=hq != hkv,
                  softcap=4.0, alibi_slopes=rng.random((3, hq)) / 8, sinks=rng.standard_normal(hq))
        assert_triple(*call_both(q, k, v, **kw), np.float32, 16)


@pytest.mark.parametrize("dtype", ["bfloat16", np.float16])
def test_kernel_set_variants_in_16_bits(isa, rng, dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for L, S, hq, hkv in (SHAPES["prefill"], SHAPES["gqa-decode"]):
        q, k, v = (a.astype(dt) for a in make_qkv(rng, (2,), hq, hkv, L, S, 32, 32, np.float32))
        kw = dict(is_causal=True, enable_gqa=hq != hkv, window=(12, 0), softcap=3.0,
                  alibi_slopes=rng.random(hq) / 4, sinks=rng.standard_normal(hq))
        out, lse = sdpa.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        want, want_lse = ref(q, k, v, return_lse=True, **kw)
        assert out.dtype == dt and lse.dtype == np.float32
        assert_close(out.astype(np.float64), want, dt, head_dim=32)
        assert_close(lse, want_lse, dt, head_dim=32)
        # a float32 query over a 16-bit cache
        out32 = sdpa.scaled_dot_product_attention(q.astype(np.float32), k, v, **kw)
        assert_close(out32, ref(q.astype(np.float32), k, v, **kw), np.float32, head_dim=32, scale=4)


def test_kernel_set_variants_bitwise_across_threads(isa, rng):
    for L, S, hq, hkv in SHAPES.values():
        q, k, v = make_qkv(rng, (3,), hq, hkv, L, S, 16, 16, np.float32)
        kw = dict(is_causal="bottom_right", enable_gqa=hq != hkv, window=(20, 0), softcap=5.0,
                  alibi_slopes=rng.random(hq), sinks=rng.standard_normal(hq), return_lse=True)
        runs = [sdpa.scaled_dot_product_attention(q, k, v, num_threads=n, **kw) for n in (1, 2, 3, 1)]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert np.array_equal(a, b)


@pytest.fixture
def blocking():
    try:
        yield _core.set_blocking
    finally:
        _core.set_blocking(0, 0, 0)


@pytest.mark.parametrize("tiles", [(1, 1, 0), (1, 7, 0), (64, 33, 0), (40, 200, 0), (0, 16, 32), (0, 5, 7)],
                         ids=lambda t: "q%d-k%d-c%d" % t)
def test_windows_under_forced_blockings(isa, rng, blocking, tiles):
    """Tiles that start and end inside the window, panels at its edges, chunks of a few keys."""
    blocking(*tiles)
    for L, S, hq, hkv in (SHAPES["prefill"], SHAPES["gqa-decode"]):
        q, k, v = make_qkv(rng, (2,), hq, hkv, L, S, 16, 12, np.float64)
        for window, causal in (((6, 0), True), ((3, 11), "bottom_right"), ((-1, 2), False), ((25, -1), True)):
            kw = dict(is_causal=causal, enable_gqa=hq != hkv, window=window, sinks=rng.standard_normal(hq),
                      alibi_slopes=rng.random(hq) / 4)
            assert_triple(*call_both(q, k, v, **kw), np.float64, 16)
            again = sdpa.scaled_dot_product_attention(q, k, v, num_threads=3, return_weights=True,
                                                      return_lse=True, **kw)
            for a, b in zip(call_both(q, k, v, **kw)[0], again):
                assert np.array_equal(a, b)


@pytest.mark.parametrize("L", [1, 16, 200])
def test_keys_outside_every_window_are_never_read(isa, rng, L):
    """NaN in the keys and values that no row's window reaches has no effect:
    those key blocks are skipped (rows aligned to the last keys, a window of 64)."""
    S = 1024
    q, k, v = make_qkv(rng, (1,), 2, 2, L, S, 16, 16, np.float32)
    first = S - L - 63  # the first key of the first row's window
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[..., : first - 520, :] = np.nan  # past the tile grid's reach for tiles of up to 512 keys
    v_nan[..., : first - 520, :] = np.nan
    kw = dict(is_causal="bottom_right", window=(63, 0))
    out = sdpa.scaled_dot_product_attention(q, k_nan, v_nan, **kw)
    assert np.isfinite(out).all()
    assert np.array_equal(out, sdpa.scaled_dot_product_attention(q, k, v, **kw))
    assert_close(out, ref(q, k, v, **kw), np.float32, head_dim=16)


def test_neutral_variants_change_no_bit(rng):
    """An unbounded window, slopes of zero and sinks of -inf are the plain call."""
    for L, S, hq, hkv in SHAPES.values():
        q, k, v = make_qkv(rng, (2,), hq, hkv, L, S, 16, 16, np.float32)
        kw = dict(is_causal=True, enable_gqa=hq != hkv, return_lse=True)
        plain = sdpa.scaled_dot_product_attention(q, k, v, **kw)
        for extra in (dict(window=(-1, -1)), dict(alibi_slopes=np.zeros(hq)), dict(sinks=np.full(hq, -np.inf)),
                      dict(window=(10**30, 10**30))):
            got = sdpa.scaled_dot_product_attention(q, k, v, **kw, **extra)
            for a, b in zip(plain, got):
                assert np.array_equal(a, b), extra


def test_window_of_nothing_gives_zeros(rng):
    """A window that shows a row no key: zeros, -inf lse (the sink's value with a sink)."""
    # top-left aligned, right side 0 and left 0: row l sees key l only; rows past S see nothing
    q, k, v = make_qkv(rng, (), 2, 2, 8, 6, 8)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, window=(0, 0), return_lse=True)
    assert np.array_equal(out[:, 6:], np.zeros((2, 2, 8))) and np.isneginf(lse[:, 6:]).all()
    np.testing.assert_allclose(out[:, :6], v[:, :6], rtol=1e-6)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, window=(0, 0), sinks=[1.0, 2.0],
                                                 return_lse=True)
    assert np.array_equal(out[:, 6:], np.zeros((2, 2, 8)))
    np.testing.assert_array_equal(lse[:, 6:], [[1.0, 1.0], [2.0, 2.0]])


def test_two_dim_inputs_and_broadcast_values(rng):
    q, k, v = make_qkv(rng, (), None, None, 5, 9, 8)
    kw = dict(window=(2, 2), softcap=1.5, alibi_slopes=0.25, sinks=[0.3])
    assert_close(sdpa.scaled_dot_product_attention(q, k, v, **kw), ref(q, k, v, **kw), np.float64)
    q, k, v = make_qkv(rng, (2, 3), 4, 4, 5, 9, 8)
    kw = dict(alibi_slopes=rng.random((3, 1)), sinks=rng.random((2, 1, 4)))  # broadcast over heads / batch
    assert_close(sdpa.scaled_dot_product_attention(q, k, v, **kw), ref(q, k, v, **kw), np.float64)


def test_merge_of_windowed_chunks(rng):
    """The lse of windowed calls over key chunks merges into the whole call."""
    q, k, v = make_qkv(rng, (1,), 2, 2, 8, 40, 8)
    kw = dict(window=(10, 0), alibi_slopes=[0.1, 0.3], softcap=3.0)
    whole = sdpa.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", **kw)
    parts = []
    for lo, hi in ((0, 25), (25, 40)):
        # the chunk keeps its keys' positions through the mask: keys outside the window masked there
        keep = window_mask(8, 40, 10, 0, 32)[:, lo:hi] & window_mask(8, 40, -1, 0, 32)[:, lo:hi]
        dist = np.abs(np.arange(8)[:, None] + 32 - np.arange(lo, hi)[None, :])
        bias = np.where(keep, -np.array([0.1, 0.3])[:, None, None] * dist, -np.inf)
        parts.append(sdpa.scaled_dot_product_attention(q, k[..., lo:hi, :], v[..., lo:hi, :], bias, softcap=3.0,
                                                       return_lse=True))
    merged, _ = sdpa.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(merged, whole, rtol=1e-12, atol=1e-12)


# ---- arguments ----

@pytest.mark.parametrize("window,error,match", [
    ((1,), TypeError, "pair"),
    (5, TypeError, "pair"),
    ((1.5, 0), TypeError, "left side must be an int"),
    ((0, True), TypeError, "right side must be an int"),
    ((-2, 0), ValueError, "left side must be >= 0"),
    ((0, -5), ValueError, "right side"),
])
def test_bad_window(window, error, match):
    q = np.ones((1, 2, 4), np.float32)
    with pytest.raises(error, match=match):
        sdpa.scaled_dot_product_attention(q, q, q, window=window)


@pytest.mark.parametrize("cap,error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), (10**400, ValueError), (True, TypeError),
                                       ("1", TypeError)])
def test_bad_softcap(cap, error):
    q = np.ones((1, 2, 4), np.float32)
    with pytest.raises(error, match="softcap"):
        sdpa.scaled_dot_product_attention(q, q, q, softcap=cap)


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
def test_bad_head_values(name):
    q = np.ones((2, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match=name + r".*\(batch..., query heads\) \(2, 3\)"):
        sdpa.scaled_dot_product_attention(q, q, q, **{name: np.ones(4)})
    with pytest.raises(ValueError, match=name):
        sdpa.scaled_dot_product_attention(q, q, q, **{name: np.ones((3, 3))})
    with pytest.raises(TypeError, match=name):
        sdpa.scaled_dot_product_attention(q, q, q, **{name: np.ones(3, bool)})
    with pytest.raises(TypeError, match=name):
        sdpa.scaled_dot_product_attention(q, q, q, **{name: np.ones(3, complex)})
    with pytest.raises(TypeError, match=name):
        sdpa.scaled_dot_product_attention(q, q, q, **{name: "abc"})


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
def test_out_may_not_overlap_head_values(name):
    q = np.ones((1, 3, 4, 8), np.float32)
    out = np.zeros((1, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match="out: overlaps the memory of " + name):
        sdpa.scaled_dot_product_attention(q, q, q, out=out, **{name: out[0, :, 0, 0]})
    # converted first (float64 given), the caller's array still counts
    out64 = np.zeros((1, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match="out: overlaps the memory of " + name):
        sdpa.scaled_dot_product_attention(q, q, q, out=out64, **{name: out64.view(np.float64)[0, :, 0, :3][0]})


def test_head_values_are_not_written(rng):
    q, k, v = make_qkv(rng, (1,), 3, 3, 4, 8, 8, dtype=np.float32)
    slopes, sinks = rng.random(3), rng.random(3).astype(np.float32)
    s0, k0 = slopes.copy(), sinks.copy()
    sdpa.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, sinks=sinks)
    assert np.array_equal(slopes, s0) and np.array_equal(sinks, k0)


# ---- layers and caches ----

def test_rolling_cache_keeps_what_the_window_needs(rng):
    cache = sdpa.KVCache(1, 2, capacity=10, head_dim=4, window=4)
    seen = []
    for T in [3, 1, 1, 5, 1, 1, 1, 2]:
        k = rng.standard_normal((1, 2, T, 4)).astype(np.float32)
        seen.append(k)
        keys, _ = cache.append(k, k)
        everything = np.concatenate(seen, axis=2)
        assert cache.start + len(cache) == everything.shape[2]
        assert len(cache) >= min(everything.shape[2], 3 + T)  # window - 1 before the new ones
        assert np.array_equal(keys, everything[:, :, cache.start:])
    assert cache.start > 0 and cache.capacity == 10
    before = (cache.start, cache.keys.copy())
    with pytest.raises(sdpa.KVCacheFullError):  # 3 kept + 8 new > 10
        cache.append(np.zeros((1, 2, 8, 4)), np.zeros((1, 2, 8, 4)))
    assert cache.start == before[0] and np.array_equal(cache.keys, before[1])  # nothing dropped
    cache.reset()
    assert cache.start == 0 and len(cache) == 0
    assert "window=4" in repr(cache)
    with pytest.raises(ValueError, match="window"):
        sdpa.KVCache(1, 2, 10, 4, window=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_windowed_layer_decodes_as_it_prefills(rng, dtype):
    """Prefill then single steps over a rolling cache give the one-call result,
    long after the cache has dropped positions."""
    sinks = rng.standard_normal(4)
    layer = sdpa.MultiHeadAttention(32, num_heads=4, num_kv_heads=2, dtype=dtype, window=6, sinks=sinks, rng=1)
    x = rng.standard_normal((2, 30, 32)).astype(dtype)
    full = layer(x)
    cache = layer.new_cache(batch=2, capacity=9)
    assert cache.window == 6
    steps = [layer(x[:, :3], cache)] + [layer(x[:, t:t + 1], cache) for t in range(3, 30)]
    assert cache.start > 15 and cache.capacity == 9  # bounded memory
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=tol, atol=tol)
    # the window and the sinks are what the layer computes with
    q = layer._project(x, layer.w_q, layer.b_q, 4)
    k = layer._project(x, layer.w_k, layer.b_k, 2)
    v = layer._project(x, layer.w_v, layer.b_v, 2)
    o = ref(q, k, v, is_causal=True, enable_gqa=True, window=(5, 0), sinks=sinks)
    want = o.transpose(0, 2, 1, 3).reshape(2, 30, 32) @ layer.w_o + layer.b_o
    np.testing.assert_allclose(full, want, rtol=tol * 10, atol=tol * 10)
    assert "window=6" in repr(layer)


def test_layer_rejects_bad_window_and_sinks():
    with pytest.raises(ValueError, match="window"):
        sdpa.MultiHeadAttention(16, 2, window=0)
    with pytest.raises(ValueError, match="sinks"):
        sdpa.MultiHeadAttention(16, 2, sinks=[1.0, 2.0, 3.0])
    w = np.eye(16)
    layer = sdpa.MultiHeadAttention.from_weights(w, w, w, w, num_heads=2, window=3, sinks=[0.5, -0.5])
    assert layer.window == 3 and layer.sinks.dtype == np.float64


def test_layer_refuses_a_cache_that_rolls_away_what_it_sees(rng):
    """A rolling cache narrower than the layer's window (or under a layer without
    one) would drop keys the queries still see: refused, not wrong results."""
    x = rng.standard_normal((1, 12, 16)).astype(np.float32)
    for layer, window in ((sdpa.MultiHeadAttention(16, 2), 3), (sdpa.MultiHeadAttention(16, 2, window=5), 4)):
        cache = sdpa.KVCache(1, 2, capacity=6, head_dim=8, window=window)
        with pytest.raises(ValueError, match="cache: rolls with window"):
            layer(x[:, :1], cache)
        assert len(cache) == 0  # nothing appended
    # a wider window than the layer's holds more than it needs: the one-call result
    layer = sdpa.MultiHeadAttention(16, 2, window=3)
    cache = sdpa.KVCache(1, 2, capacity=6, head_dim=8, window=4)
    steps = [layer(x[:, t:t + 1], cache) for t in range(12)]
    assert cache.start > 0
    np.testing.assert_allclose(np.concatenate(steps, axis=1), layer(x), rtol=1e-5, atol=1e-5)


def test_merge_with_the_sink_in_one_chunk(rng):
    q, k, v = make_qkv(rng, (2,), 3, 3, 4, 30, 8)
    sinks = rng.standard_normal(3)
    whole, whole_lse = sdpa.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    a = sdpa.scaled_dot_product_attention(q, k[..., :12, :], v[..., :12, :], sinks=sinks, return_lse=True)
    b = sdpa.scaled_dot_product_attention(q, k[..., 12:, :], v[..., 12:, :], return_lse=True)
    merged, lse = sdpa.merge_attention([a[0], b[0]], [a[1], b[1]])
    np.testing.assert_allclose(merged, whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)
