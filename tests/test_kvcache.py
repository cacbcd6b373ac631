"""sdpa.KVCache: appending, growing, read-only views, errors; prefill then
decode from the cache equals one causal pass; attention reads the cache's
strided views in place."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close
from sdpa.testing import make_qkv, randn

attention = sdpa.scaled_dot_product_attention

DTYPES = [np.float32, np.float64]


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


@pytest.mark.parametrize("grow", [False, True])
def test_concurrent_appends_keep_every_token(grow):
    """Two Python threads appending to one cache: every token lands, whole (each
    append's keys stay next to its values), and growth loses nothing."""
    import threading

    n, per_thread, E = 2, 300, 64
    cache = sdpa.KVCache(1, 1, 0 if grow else n * per_thread, E, grow=grow)
    barrier = threading.Barrier(n)

    def work(tid):
        barrier.wait()
        for i in range(per_thread):
            token = np.full((1, 1, 1, E), tid * 10_000 + i, np.float32)
            cache.append(token, token)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == n * per_thread
    keys, values = cache.keys[0, 0], cache.values[0, 0]
    np.testing.assert_array_equal(keys, values)
    assert np.all(keys == keys[:, :1])  # no token torn between two appends
    assert sorted(keys[:, 0].tolist()) == sorted(t * 10_000 + i for t in range(n) for i in range(per_thread))


def test_check_fits_names_the_mismatch():
    cache = sdpa.KVCache(2, 4, 8, 16, head_dim_v=8)
    cache.check_fits(2, 4, 16, 8)
    with pytest.raises(ValueError, match=r"holds \(batch=2, num_kv_heads=4, head_dim=16, head_dim_v=8\)"):
        cache.check_fits(2, 4, 16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_cache_stores_16_bits_and_is_read_in_place(rng, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    cache = sdpa.KVCache(1, 2, 64, 32, dtype=dtype)
    assert cache.dtype == np.dtype(dtype) and cache.nbytes == 2 * 2 * 64 * 32 * 2
    k = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)  # converted on append
    v = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    keys, values = cache.append(k, v)
    assert keys.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(keys.astype(np.float32), k.astype(dtype).astype(np.float32))
    q = rng.standard_normal((1, 8, 1, 32)).astype(np.float32)
    out = sdpa.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    assert out.dtype == np.float32  # a float32 query against the 16-bit cache
    exp = sdpa.reference.scaled_dot_product_attention(
        q, keys.astype(np.float64), values.astype(np.float64), enable_gqa=True)
    assert_close(out, exp, np.float32)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_cache_and_layer_dtypes_by_name(name):
    """Each storage dtype the error message lists is taken by that name too
    (NumPy alone does not know "bfloat16": it is ml_dtypes' type)."""
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        expected = np.dtype(ml_dtypes.bfloat16)
    else:
        expected = np.dtype(name)
    cache = sdpa.KVCache(1, 2, 8, 4, dtype=name)
    k = np.ones((1, 2, 3, 4), np.float32)
    cache.append(k, k)
    assert cache.keys.dtype == expected
    assert sdpa.MultiHeadAttention(16, 4, dtype=name, kv_cache_dtype=name).dtype == expected


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, "U3", "float8", "float128"])
def test_cache_dtype_must_be_a_float(dtype):
    with pytest.raises(TypeError, match=r"dtype: a KV cache stores float16, bfloat16, float32, float64, or the "
                                        r"quantized 'int8', 'float8_e4m3fn', 'float8_e5m2', 'int4'; got"):
        sdpa.KVCache(1, 1, 4, 4, dtype=dtype)


@pytest.mark.parametrize("name", ["uint4", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz"])
def test_cache_refuses_the_8_and_4_bit_types_it_does_not_implement(name):
    """ml_dtypes' other 8- and 4-bit types are of kind "f" or "i": they would be
    stored raw, without scales, taking NaN, and decoded by the slow paths."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, name):
        pytest.skip(f"this ml_dtypes has no {name}")
    for dtype in (getattr(ml_dtypes, name), name):
        with pytest.raises(TypeError, match=r"dtype: a KV cache stores .* or the quantized .*; got"):
            sdpa.KVCache(1, 1, 4, 4, dtype=dtype)
        with pytest.raises(TypeError, match=r"kv_cache_dtype: a KV cache stores"):
            sdpa.MultiHeadAttention(16, 4, kv_cache_dtype=dtype)
        with pytest.raises(TypeError, match=r"dtype: expected float16, bfloat16, float32 or float64"):
            sdpa.MultiHeadAttention(16, 4, dtype=dtype)


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e4m3fn", "int4"])
def test_cache_takes_ml_dtypes_low_bit_types_by_type_or_name(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (getattr(ml_dtypes, name), name):
        cache = sdpa.KVCache(1, 1, 4, 4, dtype=dtype)
        assert cache.quantization == name and cache.dtype == np.uint8


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "int4", "float8_e4m3fn"])
@pytest.mark.parametrize("latent", [False, True])
def test_storage_starts_on_a_cache_line(dtype, latent):
    """Keys, values and scales begin on a 64-byte boundary (NumPy's own
    allocations begin 16 bytes past one, and every vector load of a row would
    straddle two lines), for KVCache and PagedKVCache alike."""
    cache = sdpa.KVCache(2, 3, 50, 64, dtype=dtype, latent=latent)
    paged = sdpa.PagedKVCache(7, 16, 3, 64, dtype=dtype, latent=latent)
    arrays = [cache.key_data, cache.value_data, cache.key_scales, cache.value_scales,
              paged.key_cache, paged.value_cache, paged.key_scale, paged.value_scale]
    for a in arrays:
        if a is not None and a.size:
            assert a.ctypes.data % 64 == 0


FORMAT_CASES = [
    dict(dtype="int4", head_dim=64), dict(dtype="int8", head_dim=48, head_dim_v=32, group_size=16),
    dict(dtype="float8_e5m2", head_dim=16, scale=None), dict(dtype="float32", head_dim=40, latent=True, head_dim_v=8),
    # refused, each naming its argument
    dict(dtype="int4", head_dim=7), dict(dtype="int8", head_dim=48, group_size=5),
    dict(dtype="float32", head_dim=8, group_size=4), dict(dtype="int8", head_dim=8, scale=None),
    dict(dtype="float32", head_dim=8, scale="minmax"), dict(dtype="float32", head_dim=8, head_dim_v=9, latent=True),
    dict(dtype="float32", head_dim=8, latent=1), dict(dtype="int4", head_dim=8, group_size=3),
    dict(dtype="complex64", head_dim=8), dict(dtype="int8", head_dim=0),
]


@pytest.mark.parametrize("kw", FORMAT_CASES)
def test_kv_and_paged_caches_share_one_format(kw):
    """KVCache and PagedKVCache take their format from one CacheFormat: the
    same format for the same arguments, and the same refusal, word for word."""
    kw = dict(kw)
    e = kw.pop("head_dim")
    results = []
    for make in (lambda: sdpa.KVCache(1, 2, 16, e, **kw), lambda: sdpa.PagedKVCache(4, 8, 2, e, **kw)):
        try:
            results.append(make().format)
        except (ValueError, TypeError) as exc:
            results.append((type(exc), str(exc)))
    assert results[0] == results[1]
