"""The int8 KVCache: quantization on append (symmetric, per position and head
or per group of features), attention that dequantizes inside the kernels
(row and tiled paths, every kernel set) against the float64 reference on the
cache's own dequantized values, the accuracy against unquantized attention,
bad input, growth and rolling, and merging results of quantized shards."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close, cache_reference as expected
from sdpa import reference

GROUPS = [None, 8, 16]


def filled(rng, batch, heads, capacity, e, ev, tokens, group=None, **kw):
    cache = sdpa.KVCache(batch, heads, capacity, e, ev, dtype="int8", group_size=group, **kw)
    k = rng.standard_normal((batch, heads, tokens, e)).astype(np.float32)
    v = rng.standard_normal((batch, heads, tokens, ev)).astype(np.float32)
    cache.append(k, v)
    return cache, k, v


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("hq,hkv,L", [(4, 4, 1), (8, 2, 1), (8, 2, 3), (4, 1, 2), (4, 2, 37), (2, 2, 70)],
                         ids=["mha-decode", "gqa-decode", "gqa-3", "mqa-2", "tiled-gqa", "tiled-prefill"])
def test_int8_cache_matches_reference_on_its_values(isa, rng, group, hq, hkv, L):
    cache, _, _ = filled(rng, 2, hkv, 160, 32, 48, 150, group)
    q = rng.standard_normal((2, hq, L, 32)).astype(np.float32)
    out, lse = cache.attend(q, return_lse=True)
    exp_out, exp_lse = expected(q, cache, is_causal="bottom_right", return_lse=True)
    assert out.dtype == np.float32
    assert_close(out, exp_out, np.float32)
    assert_close(lse, exp_lse, np.float32)


@pytest.mark.parametrize("L", [1, 40])
def test_int8_cache_with_variants_and_mask(isa, rng, L):
    cache, _, _ = filled(rng, 1, 2, 300, 32, 32, 260, 16)
    q = rng.standard_normal((1, 4, L, 32)).astype(np.float32)
    mask = rng.random((1, 4, L, 260)) > 0.3
    kw = dict(window=(100, 0), softcap=5.0, alibi_slopes=np.array([0.01, 0.02, 0.03, 0.04]),
              sinks=np.array([0.5, -1.0, 0.0, 1.0]))
    out = cache.attend(q, attn_mask=mask, **kw)
    ref = reference.scaled_dot_product_attention(
        q.astype(np.float64), cache.keys.astype(np.float64), cache.values.astype(np.float64),
        attn_mask=mask, is_causal="bottom_right", enable_gqa=True, **kw)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("qdtype", [np.float16, "bfloat16", np.float64])
def test_int8_cache_query_dtypes(rng, qdtype):
    if qdtype == "bfloat16":
        qdtype = pytest.importorskip("ml_dtypes").bfloat16
    cache, _, _ = filled(rng, 1, 2, 64, 16, 16, 50)
    q = rng.standard_normal((1, 4, 2, 16)).astype(qdtype)
    out = cache.attend(q)
    assert out.dtype == (np.float32 if qdtype == np.float64 else qdtype)
    tol = 2e-2 if qdtype != np.float64 else 2e-5
    np.testing.assert_allclose(out.astype(np.float64), expected(q, cache, is_causal="bottom_right"),
                               atol=tol, rtol=tol)


def test_int8_cache_takes_a_swapped_or_misaligned_query(rng):
    """Made native and aligned: the output is native float32, as for a plain query."""
    cache, _, _ = filled(rng, 1, 2, 16, 8, 8, 10)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    buf = np.zeros(q.nbytes + 1, np.uint8)[1:]
    misaligned = buf.view(np.float32).reshape(q.shape)
    misaligned[...] = q
    plain = cache.attend(q, return_lse=True)
    for odd in (q.astype(q.dtype.newbyteorder()), misaligned):
        got = cache.attend(odd, return_lse=True)
        for a, b in zip(got, plain):
            assert a.dtype == b.dtype and a.dtype.isnative
            np.testing.assert_array_equal(a, b)


def test_int8_out_must_not_overlap_the_scales(rng):
    cache, _, _ = filled(rng, 1, 2, 64, 32, 32, 40)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    out = np.lib.stride_tricks.as_strided(cache._ks, (1, 4, 1, 32), (0, 128, 0, 4))  # all the key scales
    with pytest.raises(ValueError, match="out: overlaps the memory of the key scales"):
        cache.attend(q, out=out)


def test_int8_accuracy_against_unquantized(rng):
    """Standard-normal Q, K, V, E = 128, S = 4096: max abs error <= 1e-2 and
    mean abs error <= 1e-3 against attention over the float32 keys and values."""
    cache, k, v = filled(rng, 1, 2, 4096, 128, 128, 4096)
    q = rng.standard_normal((1, 8, 4, 128)).astype(np.float32)
    out = cache.attend(q, is_causal=False)
    ref = reference.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), enable_gqa=True)
    err = np.abs(out - ref)
    assert err.max() <= 1e-2 and err.mean() <= 1e-3, (err.max(), err.mean())


@pytest.mark.parametrize("group", GROUPS)
def test_int8_quantization_layout(rng, group):
    cache, k, _ = filled(rng, 2, 3, 8, 32, 32, 5, group)
    data, scales = cache.key_data, cache.key_scales
    assert data.dtype == np.int8 and scales.dtype == np.float32
    g = group or 32
    assert scales.shape == (2, 3, 5, 32 // g)
    amax = np.abs(k.reshape(2, 3, 5, 32 // g, g)).max(axis=-1)
    np.testing.assert_allclose(scales, amax / 127, rtol=1e-6)
    assert np.abs(data.astype(np.int32)).max() <= 127
    deq = cache.keys
    assert deq.dtype == np.float32
    np.testing.assert_array_equal(deq, data.astype(np.float32) * np.repeat(scales, g, axis=-1))
    assert np.all(np.abs(deq - k) <= np.repeat(scales, g, axis=-1) * (0.5 + 1e-5))
    assert cache.nbytes == 2 * 2 * 3 * 8 * 32 + 2 * 2 * 3 * 8 * (32 // g) * 4


def test_int8_zeros_and_tiny_values_quantize_to_zero():
    cache = sdpa.KVCache(1, 1, 4, 8, dtype=np.int8)
    z = np.zeros((1, 1, 1, 8), np.float32)
    cache.append(z, np.full_like(z, 1e-40))
    assert not cache.keys.any() and not cache.values.any()
    assert not cache.key_scales.any()


@pytest.mark.parametrize("group", [None, 4])
def test_int8_float32_maximum_stays_finite(isa, group):
    """max|x| / 127 rounds up at the float32 maximum; 127 x that scale was inf."""
    big = np.finfo(np.float32).max
    cache = sdpa.KVCache(1, 1, 1, 8, dtype="int8", group_size=group)
    x = np.zeros((1, 1, 1, 8), np.float32)
    x[..., 0], x[..., 5] = big, -big
    cache.append(x, x)
    keys = cache.keys
    assert np.isfinite(keys).all() and keys[0, 0, 0, 0] >= big * (1 - 1e-6) and keys[0, 0, 0, 5] == -keys[0, 0, 0, 0]
    out = cache.attend(np.ones((1, 1, 1, 8), np.float32))
    np.testing.assert_array_equal(out, keys)  # one key: the output is its value


def test_int8_append_takes_misaligned_and_swapped_input(rng):
    """A misaligned buffer (as unpickled from a network message) and a
    byte-swapped one quantize like a plain float32 array."""
    k = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    buf = np.zeros(k.nbytes + 1, np.uint8)[1:]
    misaligned = buf.view(np.float32).reshape(k.shape)
    misaligned[...] = k
    assert not misaligned.flags.aligned
    plain = sdpa.KVCache(1, 2, 8, 16, dtype="int8")
    plain.append(k, k)
    for odd in (misaligned, k.astype(">f4")):
        cache = sdpa.KVCache(1, 2, 8, 16, dtype="int8")
        cache.append(odd, odd)
        np.testing.assert_array_equal(cache.key_data, plain.key_data)
        np.testing.assert_array_equal(cache.value_scales, plain.value_scales)


def test_int8_bad_input_writes_nothing(rng):
    cache, _, _ = filled(rng, 1, 2, 10, 8, 8, 3)
    before = (cache.key_data.copy(), cache.key_scales.copy(), len(cache))
    k = np.ones((1, 2, 2, 8), np.float32)
    bad = k.copy()
    bad[0, 1, 1, 3] = np.nan
    with pytest.raises(ValueError, match="^k: .*finite"):
        cache.append(bad, k)
    bad[0, 1, 1, 3] = np.inf
    with pytest.raises(ValueError, match="^v: .*finite"):
        cache.append(k, bad)
    with pytest.raises(ValueError, match="^k: expected shape"):
        cache.append(np.ones((1, 3, 2, 8), np.float32), k)
    with pytest.raises(sdpa.KVCacheFullError):
        cache.append(np.ones((1, 2, 8, 8), np.float32), np.ones((1, 2, 8, 8), np.float32))
    assert len(cache) == before[2]
    np.testing.assert_array_equal(cache.key_data, before[0])
    np.testing.assert_array_equal(cache.key_scales, before[1])


@pytest.mark.parametrize("args,kwargs,match", [
    ((1, 1, 4, 8), {"dtype": "int8", "group_size": 3}, "group_size: 3 must divide"),
    ((1, 1, 4, 8, 12), {"dtype": "int8", "group_size": 8}, "group_size: 8 must divide"),
    ((1, 1, 4, 8), {"group_size": 4}, "group_size: only a quantized cache"),
    ((1, 1, 4, 8), {"dtype": "int8", "group_size": 0}, "group_size"),
])
def test_int8_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sdpa.KVCache(*args, **kwargs)


def test_int8_grows_and_rolls(rng):
    cache, _, _ = filled(rng, 1, 2, 4, 16, 16, 3, 8, grow=True)
    keys = cache.keys
    cache.append(np.ones((1, 2, 5, 16)), np.ones((1, 2, 5, 16)))
    assert cache.capacity >= 8 and len(cache) == 8
    np.testing.assert_array_equal(cache.keys[:, :, :3], keys)
    assert repr(cache).endswith("group_size=8)")

    rolling, _, _ = filled(rng, 1, 2, 6, 16, 16, 5, None, window=3)
    last = rolling.keys[:, :, -2:]
    rolling.append(np.ones((1, 2, 2, 16)), np.ones((1, 2, 2, 16)))
    assert len(rolling) == 4 and rolling.start == 3
    np.testing.assert_array_equal(rolling.keys[:, :, :2], last)
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    assert_close(rolling.attend(q), expected(q, rolling, is_causal="bottom_right", window=(2, 0)), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_attend_on_float_caches(rng, dtype):
    cache = sdpa.KVCache(1, 2, 40, 16, dtype=dtype)
    cache.append(rng.standard_normal((1, 2, 30, 16)), rng.standard_normal((1, 2, 30, 16)))
    q = rng.standard_normal((1, 4, 3, 16)).astype(dtype)
    out = cache.attend(q)
    ref = sdpa.scaled_dot_product_attention(q, cache.keys, cache.values, is_causal="bottom_right",
                                            enable_gqa=True)
    np.testing.assert_array_equal(out, ref)


def test_merge_attention_over_quantized_shards(rng):
    """Per-position scales: two shards quantize their keys as one cache does, so
    merging their partial results gives the whole cache's result."""
    k = rng.standard_normal((1, 2, 300, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 300, 32)).astype(np.float32)
    whole = sdpa.KVCache(1, 2, 300, 32, dtype="int8")
    whole.append(k, v)
    shards = []
    for part in (slice(0, 170), slice(170, 300)):
        shard = sdpa.KVCache(1, 2, 300, 32, dtype="int8")
        shard.append(k[:, :, part], v[:, :, part])
        shards.append(shard)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    parts = [s.attend(q, is_causal=False, return_lse=True) for s in shards]
    out, lse = sdpa.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    exp_out, exp_lse = whole.attend(q, is_causal=False, return_lse=True)
    assert_close(out, exp_out, np.float32)
    assert_close(lse, exp_lse, np.float32)


def test_layer_with_an_int8_cache(rng):
    layer = sdpa.MultiHeadAttention(64, num_heads=8, num_kv_heads=2, kv_cache_dtype="int8")
    cache = layer.new_cache(batch=1, capacity=32)
    assert cache.dtype == np.int8 and layer.new_cache(1, 4, dtype=np.float32).dtype == np.float32
    x = rng.standard_normal((1, 20, 64)).astype(np.float32)
    full = layer(x)
    steps = [layer(x[:, :12], cache)] + [layer(x[:, t:t + 1], cache) for t in range(12, 20)]
    got = np.concatenate(steps, axis=1)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, full, atol=2e-2)
    with pytest.raises(TypeError, match="dtype"):
        sdpa.MultiHeadAttention(64, num_heads=8, kv_cache_dtype=np.int32)
