"""integer_pv: the weighted sum of an int8 or int4 cache's values in integers
(sdpa.h): its definition on rows whose weights are known exactly, the
AVX512-VNNI kernel against the portable one bit for bit, every kernel set,
paged against contiguous bit for bit, thread-count independence, the added
error against unquantized attention, NaN rows, and the checks."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from sdpa import _core, reference

RUN = 64  # SDPA_PV_KEYS: the keys whose weights share a scale


@pytest.fixture
def portable():
    _core.set_portable_dot_qi(True)
    try:
        yield
    finally:
        _core.set_portable_dot_qi(False)


def filled(rng, name, *, heads=2, tokens=300, e=64, ev=64, group=None, capacity=None):
    cache = sdpa.KVCache(1, heads, capacity or tokens, e, ev, dtype=name, group_size=group)
    k = rng.standard_normal((1, heads, tokens, e)).astype(np.float32)
    v = rng.standard_normal((1, heads, tokens, ev)).astype(np.float32)
    cache.append(k, v)
    return cache, k, v


def stored_values(cache):
    """The stored integers (int4 unpacked) and the value scales, per group."""
    data = cache.value_data[:, :, : len(cache)]
    if data.dtype == np.uint8:  # int4: low nibble first, plus 8
        ints = np.stack([(data & 15).astype(np.int64) - 8, (data >> 4).astype(np.int64) - 8], -1)
        ints = ints.reshape(data.shape[:-1] + (-1,))
    else:
        ints = data.astype(np.int64)
    return ints, cache.value_scales[:, :, : len(cache)]


@pytest.mark.parametrize("name,group", [("int8", None), ("int8", 16), ("int8", 32), ("int4", 32), ("int4", 16),
                                        ("int4", None), ("int8", 64)])
@pytest.mark.parametrize("tokens", [1, 7, 40, 64])
def test_definition_with_equal_scores(isa, rng, name, group, tokens):
    """Keys of zeros give every key the weight 1 exactly: each value's weight
    is then its scale, rounded to a byte against the run's largest, and the
    output the integer sums scaled, over the row's count of keys."""
    ev = 128
    cache = sdpa.KVCache(1, 2, 64, 64, ev, dtype=name, group_size=group)
    v = rng.standard_normal((1, 2, tokens, ev)).astype(np.float32) * rng.uniform(0.1, 3, (1, 2, tokens, 1))
    cache.append(np.zeros((1, 2, tokens, 64), np.float32), v.astype(np.float32))
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    out = cache.attend(q, integer_pv=True)
    ints, scales = stored_values(cache)
    g = ev // scales.shape[-1]
    f32 = np.float32
    expect = np.zeros((1, 2, ev), np.float64)
    for i in range(scales.shape[-1]):
        w = scales[..., i]  # (1, 2, tokens): the weight 1 times the scale
        top = w.max(-1, keepdims=True)
        scale = (top / f32(255)).astype(f32)
        inv = (f32(1) / scale).astype(f32)
        u = np.floor(np.minimum(w * inv + f32(0.5), f32(255))).astype(np.int64)
        sums = np.einsum("bhs,bhsc->bhc", u, ints[..., i * g:(i + 1) * g])
        expect[..., i * g:(i + 1) * g] = sums.astype(f32) * scale
    expect = np.repeat(expect / tokens, 2, axis=1)[:, :, None]
    np.testing.assert_allclose(out, expect, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 16), ("int8", 64),
                                        ("int4", 128)])
@pytest.mark.parametrize("tokens", [650, 67])
def test_vnni_and_portable_agree_bit_for_bit(isa, rng, name, group, tokens):
    cache, _, _ = filled(rng, name, tokens=tokens, e=128, ev=128, group=group)
    q = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
    fast = cache.attend(q, integer_pv=True)
    both = cache.attend(q, integer_pv=True, integer_qk=True)
    _core.set_portable_dot_qi(True)
    try:
        slow = cache.attend(q, integer_pv=True)
    finally:
        _core.set_portable_dot_qi(False)
    np.testing.assert_array_equal(fast, slow)
    assert np.isfinite(both).all()


@pytest.mark.parametrize("name,kw", [("int8", {}), ("int4", {}), ("int4", {"group_size": 16}),
                                     ("int8", {"group_size": 32})])
@pytest.mark.parametrize("block", [5, 16, 64])
@pytest.mark.parametrize("L", [1, 3])
def test_paged_is_the_contiguous_call_bit_for_bit(isa, rng, name, kw, block, L):
    """Runs of 64 keys count from the start of each key tile, whatever the
    blocks: the same integer sums, the same bits (blocks of 5 change the
    scores' kernel blocking, and so their last bits, as in float)."""
    paged = sdpa.PagedKVCache(100, block, 2, 64, dtype=name, **kw)
    flat = sdpa.KVCache(1, 2, 400, 64, dtype=name, **kw)
    other = paged.add_sequence()
    seq = paged.add_sequence()
    k = rng.standard_normal((2, 300, 64)).astype(np.float32)
    v = rng.standard_normal((2, 300, 64)).astype(np.float32)
    paged.append(other, k[:, :9], v[:, :9])
    paged.append(seq, k, v)
    flat.append(k[None], v[None])
    q = rng.standard_normal((1, 4, L, 64)).astype(np.float32)
    for extra in ({}, {"integer_qk": True}):
        out = paged.attend([seq], q, integer_pv=True, **extra)
        if block % 4:
            np.testing.assert_allclose(out, flat.attend(q, integer_pv=True, **extra), rtol=1e-4, atol=1e-6)
        else:
            np.testing.assert_array_equal(out, flat.attend(q, integer_pv=True, **extra))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_results_do_not_depend_on_the_thread_count(rng, name):
    cache, _, _ = filled(rng, name, tokens=2900, e=64, ev=64)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    one = cache.attend(q, integer_pv=True, num_threads=1)
    for n in (2, 3):
        np.testing.assert_array_equal(cache.attend(q, integer_pv=True, num_threads=n), one)


@pytest.mark.parametrize("name,group", [("int8", None), ("int4", 32)])
@pytest.mark.parametrize("integer_qk", [False, True])
def test_error_is_within_twice_the_caches_own(name, group, integer_qk):
    """Against float64 attention over the unquantized values: the max and mean
    errors at most twice those of the same cache computed in float."""
    rng = np.random.default_rng(11)
    k = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    v = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    cache = sdpa.KVCache(1, 8, 4096, 128, dtype=name, group_size=group)
    cache.append(k, v)
    exact = reference.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), enable_gqa=True)
    own = np.abs(cache.attend(q, is_causal=False) - exact)
    integer = np.abs(cache.attend(q, is_causal=False, integer_pv=True, integer_qk=integer_qk) - exact)
    assert integer.max() <= 2 * own.max() and integer.mean() <= 2 * own.mean()


def test_masks_windows_and_sinks(isa, rng):
    """The weights are the float path's, whatever decides them: only their
    rounding differs."""
    cache, _, _ = filled(rng, "int8", tokens=300, e=64, ev=64)
    q = rng.standard_normal((1, 4, 2, 64)).astype(np.float32)
    mask = rng.random((1, 1, 2, 300)) > 0.3
    for kw in ({"attn_mask": mask}, {"window": (100, 0)}, {"softcap": 5.0}, {"sinks": np.ones(4, np.float32)}):
        got = cache.attend(q, integer_pv=True, **kw)
        want = cache.attend(q, **kw)
        np.testing.assert_allclose(got, want, atol=2e-2)
        assert not np.array_equal(got, want)


def test_nan_query_gives_nan_rows(rng):
    cache, _, _ = filled(rng, "int8")
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    q[0, 1, 0, 3] = np.nan
    out = cache.attend(q, integer_pv=True)
    assert np.isnan(out[0, 1]).all() and np.isfinite(np.delete(out, 1, axis=1)).all()


def test_checks(rng):
    for name in ("float32", "float8_e4m3fn", "float8_e5m2"):
        cache, _, _ = filled(rng, name, tokens=4)
        with pytest.raises(ValueError, match="integer_pv: only int8 and int4 caches"):
            cache.attend(np.ones((1, 2, 1, 64), np.float32), integer_pv=True)
    cache, _, _ = filled(rng, "int8", tokens=4)
    with pytest.raises(TypeError, match="integer_pv: expected a bool"):
        cache.attend(np.ones((1, 2, 1, 64), np.float32), integer_pv=1)
    kc = np.zeros((4, 1, 8, 16), np.float32)
    with pytest.raises(ValueError, match="integer_pv: only int8 and int4"):
        sdpa.paged_attention(np.ones((1, 1, 1, 16), np.float32), kc, kc, [[0]], [3], integer_pv=True)
    with pytest.raises(TypeError, match="integer_pv: expected a bool"):
        sdpa.paged_attention(np.ones((1, 1, 1, 16), np.float32), kc, kc, [[0]], [3], integer_pv="yes")


def test_the_tiled_path_computes_in_float(rng):
    """Long queries (the tiled path) ignore integer_pv, as documented."""
    cache, _, _ = filled(rng, "int8", tokens=150)
    q = rng.standard_normal((1, 2, 70, 64)).astype(np.float32)
    np.testing.assert_array_equal(cache.attend(q, integer_pv=True), cache.attend(q))


def test_16bit_query(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cache, _, _ = filled(rng, "int4", tokens=200)
    q = rng.standard_normal((1, 4, 1, 64)).astype(ml_dtypes.bfloat16)
    got = cache.attend(q, integer_pv=True)
    assert got.dtype == q.dtype
    np.testing.assert_allclose(got.astype(np.float32), cache.attend(q).astype(np.float32), atol=3e-2)
