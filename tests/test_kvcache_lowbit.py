"""float8 (e4m3fn, e5m2) and int4 KV caches, and integer_qk: the formats'
encodings (against ml_dtypes where installed, and written out for int4),
attention over each cache on every kernel set against the float64 reference
on the cache's own dequantized values, the accuracy against unquantized
attention (the bounds of the format), paged caches, and integer Q.K
(AVX512-VNNI against the portable kernel, thread-count independence, its
added error)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import sdpa
from conftest import assert_close, cache_reference as expected
from sdpa import _core, reference
from sdpa.kvcache import _fp8_table, dequantize

FP8 = ["float8_e4m3fn", "float8_e5m2"]
LOWBIT = FP8 + ["int4"]
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def filled(rng, dtype, batch=1, heads=2, capacity=160, e=32, ev=48, tokens=150, **kw):
    cache = sdpa.KVCache(batch, heads, capacity, e, ev, dtype=dtype, **kw)
    k = rng.standard_normal((batch, heads, tokens, e)).astype(np.float32)
    v = rng.standard_normal((batch, heads, tokens, ev)).astype(np.float32)
    cache.append(k, v)
    return cache, k, v


# ---------------------------------------------------------------- encodings

@pytest.mark.parametrize("name", FP8)
def test_fp8_decoding_table_is_ml_dtypes(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    code = _core.QUANTIZED[name]
    mine = _fp8_table(code)
    theirs = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))
    ok = ~np.isnan(theirs)
    np.testing.assert_array_equal(mine[ok], theirs[ok])
    np.testing.assert_array_equal(np.signbit(mine[ok]), np.signbit(theirs[ok]))


def test_quantized_maxima_are_the_formats():
    """sdpa.h names each format's largest stored magnitude (the one place it is
    written): float8's are ml_dtypes' finite maxima, int8's and int4's their
    symmetric ranges; a cache scales max|x| to it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    top = _core.QUANTIZED_MAX
    assert set(top) == set(_core.QUANTIZED)
    for name in FP8:
        assert top[name] == float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max)
    assert (top["int8"], top["int4"]) == (127.0, 7.0)
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(1, 1, 1, 32)
    for name in _core.QUANTIZED:
        cache = sdpa.KVCache(1, 1, 2, 32, dtype=name)
        cache.append(x, x)
        np.testing.assert_allclose(cache.key_scales.ravel(), np.float32(3) / np.float32(top[name]), rtol=1e-7)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("group", [None, 16])
def test_fp8_rounding_is_ml_dtypes(rng, name, group):
    """Each stored byte is ml_dtypes' rounding of x / scale (x times the
    scale's reciprocal in float32, as the quantizer computes it), the scale
    max|x| / the format's largest value; tiny and huge values included."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = rng.standard_normal((1, 2, 50, 32)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 4, size=x.shape).astype(np.float32)
    cache = sdpa.KVCache(1, 2, 50, 32, dtype=name, group_size=group)
    cache.append(x, x)
    g = group or 32
    scales = cache.key_scales
    top = np.float32(FP8_MAX[name])
    groups = np.abs(x).reshape(1, 2, 50, 32 // g, g).max(-1)
    np.testing.assert_array_equal(scales, (groups / top).astype(np.float32))
    inv = (np.float32(1) / scales).astype(np.float32)
    scaled = (x.reshape(1, 2, 50, 32 // g, g) * inv[..., None]).reshape(x.shape)
    want = scaled.astype(getattr(ml_dtypes, name)).view(np.uint8)
    np.testing.assert_array_equal(cache.key_data, want)


def test_fp8_without_scales_stores_the_values_and_refuses_beyond_range(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for name in FP8:
        cache = sdpa.KVCache(1, 1, 8, 4, dtype=name, scale=None)
        assert cache.key_scales is None and cache.group_size is None
        x = np.array([[[[0.1, -3.0, 200.0, 1e-3]]]], np.float32)
        cache.append(x, -x)
        np.testing.assert_array_equal(cache.key_data.view(getattr(ml_dtypes, name)).astype(np.float32),
                                      x.astype(getattr(ml_dtypes, name)).astype(np.float32))
        big = np.full((1, 1, 1, 4), FP8_MAX[name] * 1.01, np.float32)
        with pytest.raises(ValueError, match="without scales holds values up to"):
            cache.append(big, x)
        assert len(cache) == 1
        with pytest.raises(ValueError, match="group_size"):
            sdpa.KVCache(1, 1, 8, 4, dtype=name, scale=None, group_size=2)


def test_int4_layout_is_low_nibble_first_plus_8():
    """Value c of a row in byte c // 2, the low nibble for even c, each nibble
    the value plus 8; the scale max|x| / 7 per group."""
    cache = sdpa.KVCache(1, 1, 4, 8, dtype="int4", group_size=8)
    x = np.array([[[[7, -7, 1, 0, -3, 3, 6, -1]]]], np.float32)
    cache.append(x, x)
    assert cache.key_scales[0, 0, 0, 0] == 1.0
    assert cache.key_data.dtype == np.uint8 and cache.key_data.shape == (1, 1, 1, 4)
    want = [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | (8 << 4), (-3 + 8) | ((3 + 8) << 4), (6 + 8) | ((-1 + 8) << 4)]
    np.testing.assert_array_equal(cache.key_data[0, 0, 0], want)
    np.testing.assert_array_equal(cache.keys, x)


def test_int4_rounds_to_nearest_within_half_a_step(rng):
    cache, k, v = filled(rng, "int4", group_size=16)
    step = np.repeat(cache.key_scales, 16, axis=-1)
    assert (np.abs(cache.keys - k) <= 0.5 * step * (1 + 1e-6)).all()
    q = np.round(cache.keys / np.where(step > 0, step, 1))
    assert (np.abs(q) <= 7).all()


# Half of a row's largest value lies at a tie of round(x / scale) (63.5 or
# 3.5) up to the rounding of the scale: the quotient, computed once in float,
# says which side (m = 1.125: just below, 63; m = 3.75 and 2.875: on it, to
# the even 64 and 4); x times a rounded 1 / scale lands on the other side.
TIES = [("int8", 127, 1.125), ("int8", 127, 3.75), ("int4", 7, 2.875)]


@pytest.mark.parametrize("name,top,m", TIES)
def test_values_round_from_the_quotient(name, top, m):
    x = np.array([m, m / 2, -m / 2, 0], np.float32).reshape(1, 1, 1, 4)
    cache = sdpa.KVCache(1, 1, 4, 4, dtype=name)
    cache.append(x, x)
    scale = np.float32(m) / np.float32(top)
    assert cache.key_scales.ravel()[0] == scale
    codes = np.round(x / scale)  # float32 quotients, ties to even
    np.testing.assert_array_equal(cache.keys, codes * scale)


@pytest.mark.parametrize("name,top,m", TIES[:2])
def test_integer_qk_rounds_the_query_from_the_quotient(isa, name, top, m):
    """The query row [m, m/2, -m/2, 0] against the keys e_1 and 0: the score of
    e_1 is the rounded m/2 times the row's scale, whichever kernel computes it."""
    cache = sdpa.KVCache(1, 1, 4, 4, dtype=name)
    keys = np.zeros((1, 1, 2, 4), np.float32)
    keys[0, 0, 0, 1] = 1
    values = np.zeros((1, 1, 2, 4), np.float32)
    values[0, 0, 0, 0] = 1
    cache.append(keys, values)
    q = np.array([m, m / 2, -m / 2, 0], np.float32).reshape(1, 1, 1, 4)
    out = cache.attend(q, scale=1.0, integer_qk=True)
    qscale = np.float32(m) / np.float32(127)
    rounded = np.round(q / qscale) * np.float64(qscale)
    ref = reference.scaled_dot_product_attention(rounded.astype(np.float64), cache.keys.astype(np.float64),
                                                 cache.values.astype(np.float64), scale=1.0)
    assert_close(out, ref, np.float32)


def test_int4_default_groups_and_checks():
    assert sdpa.KVCache(1, 1, 4, 64, dtype="int4").group_size == 32
    assert sdpa.KVCache(1, 1, 4, 48, dtype="int4").group_size is None  # 32 does not divide 48
    with pytest.raises(ValueError, match="even"):
        sdpa.KVCache(1, 1, 4, 7, dtype="int4")
    with pytest.raises(ValueError, match="even"):
        sdpa.KVCache(1, 1, 4, 6, dtype="int4", group_size=3)
    with pytest.raises(ValueError, match="only a float8 cache may go without scales"):
        sdpa.KVCache(1, 1, 4, 8, dtype="int4", scale=None)
    with pytest.raises(ValueError, match="scale"):
        sdpa.KVCache(1, 1, 4, 8, dtype="float8_e5m2", scale="max")


@pytest.mark.parametrize("name", LOWBIT)
def test_appends_of_non_finite_values_write_nothing(rng, name):
    cache, _, _ = filled(rng, name, tokens=3)
    k = np.ones((1, 2, 2, 32), np.float32)
    v = np.ones((1, 2, 2, 48), np.float32)
    v[0, 1, 1, 5] = np.nan
    before = cache.key_data.copy()
    with pytest.raises(ValueError, match="finite values only"):
        cache.append(k, v)
    assert len(cache) == 3
    np.testing.assert_array_equal(cache.key_data, before)


# ---------------------------------------------------------------- attention

CASES = [(4, 4, 1), (8, 2, 1), (8, 2, 3), (4, 1, 2), (4, 2, 37), (2, 2, 70)]
CASE_IDS = ["mha-decode", "gqa-decode", "gqa-3", "mqa-2", "tiled-gqa", "tiled-prefill"]


@pytest.mark.parametrize("name,kw", [
    ("float8_e4m3fn", {}), ("float8_e4m3fn", {"group_size": 16}), ("float8_e4m3fn", {"scale": None}),
    ("float8_e5m2", {}), ("float8_e5m2", {"group_size": 16}), ("float8_e5m2", {"scale": None}),
    ("int4", {}), ("int4", {"group_size": 16}), ("int4", {"group_size": 8}),
], ids=["e4m3", "e4m3-g16", "e4m3-raw", "e5m2", "e5m2-g16", "e5m2-raw", "int4-row", "int4-g16", "int4-g8"])
@pytest.mark.parametrize("hq,hkv,L", CASES, ids=CASE_IDS)
def test_cache_matches_reference_on_its_values(isa, rng, name, kw, hq, hkv, L):
    cache, _, _ = filled(rng, name, batch=2, heads=hkv, **kw)
    q = rng.standard_normal((2, hq, L, 32)).astype(np.float32)
    out, lse = cache.attend(q, return_lse=True)
    exp_out, exp_lse = expected(q, cache, is_causal="bottom_right", return_lse=True)
    assert out.dtype == np.float32
    assert_close(out, exp_out, np.float32)
    assert_close(lse, exp_lse, np.float32)


@pytest.mark.parametrize("name", LOWBIT)
@pytest.mark.parametrize("L", [1, 40])
def test_cache_with_variants_and_mask(isa, rng, name, L):
    cache, _, _ = filled(rng, name, capacity=300, e=32, ev=32, tokens=260, group_size=16)
    q = rng.standard_normal((1, 4, L, 32)).astype(np.float32)
    mask = rng.random((1, 4, L, 260)) > 0.3
    kw = dict(window=(100, 0), softcap=5.0, alibi_slopes=np.array([0.01, 0.02, 0.03, 0.04]),
              sinks=np.array([0.5, -1.0, 0.0, 1.0]))
    out = cache.attend(q, attn_mask=mask, **kw)
    ref = reference.scaled_dot_product_attention(
        q.astype(np.float64), cache.keys.astype(np.float64), cache.values.astype(np.float64),
        attn_mask=mask, is_causal="bottom_right", enable_gqa=True, **kw)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("name", LOWBIT)
def test_16bit_query_and_latent_cache(isa, rng, name):
    cache = sdpa.KVCache(1, 1, 64, 64, 32, dtype=name, latent=True)
    k = rng.standard_normal((1, 1, 50, 64)).astype(np.float32)
    cache.append(k)
    np.testing.assert_array_equal(cache.values, cache.keys[..., :32])
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float16)
    out = cache.attend(q)
    assert out.dtype == np.float16
    ref = expected(q, cache, is_causal="bottom_right")
    assert_close(out, ref, np.float16)


@pytest.mark.parametrize("name", LOWBIT)
def test_results_do_not_depend_on_the_thread_count(rng, name):
    cache, _, _ = filled(rng, name, heads=2, capacity=3000, e=64, ev=64, tokens=2900)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    one = cache.attend(q, num_threads=1)
    for n in (2, 3):
        np.testing.assert_array_equal(cache.attend(q, num_threads=n), one)


def test_quantized_storage_through_the_public_function(rng):
    """scaled_dot_product_attention's general path over a cache's storage."""
    cache, _, _ = filled(rng, "int4", group_size=16)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    n = len(cache)
    out = sdpa._api._attention_general(
        q, cache._k[:, :, :n], cache._v[:, :, :n], is_causal="bottom_right", enable_gqa=True,
        key_scale=cache._ks[:, :, :n], value_scale=cache._vs[:, :, :n], group_size=16,
        kv_dtype=_core.QUANTIZED["int4"])
    np.testing.assert_array_equal(out, cache.attend(q))


# ---------------------------------------------------------------- accuracy

# max and mean |error| against float64 attention over the unquantized keys and
# values: E = 128, S = 4096, 8 heads, standard-normal data, decoding rows
BOUNDS = {"float8_e4m3fn": (7e-3, 1.2e-3), "float8_e5m2": (1.2e-2, 2.5e-3), "int4": (2e-2, 4e-3)}


def _simulated(name, x, group):
    """x stored in the format and read back, in float64: the format's own loss."""
    g = group or x.shape[-1]
    shaped = x.astype(np.float64).reshape(x.shape[:-1] + (x.shape[-1] // g, g))
    if name == "int4":
        scale = np.abs(shaped).max(-1, keepdims=True) / 7
        return (np.clip(np.round(shaped / np.where(scale > 0, scale, 1)), -7, 7) * scale).reshape(x.shape)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    scale = np.abs(shaped).max(-1, keepdims=True) / FP8_MAX[name]
    stored = (shaped / scale).astype(getattr(ml_dtypes, name)).astype(np.float64)
    return (stored * scale).reshape(x.shape)


@pytest.mark.parametrize("name", LOWBIT)
def test_accuracy_bounds_against_unquantized_attention(name):
    rng = np.random.default_rng(2026)
    group = 32 if name == "int4" else None
    k = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    v = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    q = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
    cache = sdpa.KVCache(1, 8, 4096, 128, dtype=name, group_size=group)
    cache.append(k, v)
    exact = reference.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    err = np.abs(cache.attend(q, is_causal=False) - exact)
    top, mean = BOUNDS[name]
    assert err.max() <= top and err.mean() <= mean, (err.max(), err.mean())
    # the format's own loss, simulated in float64: the kernels add nothing to it
    sim = reference.scaled_dot_product_attention(
        q.astype(np.float64), _simulated(name, k, group), _simulated(name, v, group))
    assert np.abs(np.abs(sim - exact).mean() - err.mean()) <= 0.05 * err.mean()


# ---------------------------------------------------------------- integer_qk

@pytest.fixture
def portable_dot_qi():
    _core.set_portable_dot_qi(True)
    try:
        yield
    finally:
        _core.set_portable_dot_qi(False)


@pytest.mark.parametrize("name,group", [("int8", None), ("int8", 16), ("int8", 64), ("int4", None),
                                        ("int4", 16), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("hq,L", [(8, 1), (4, 3), (2, 1)])
def test_integer_qk_matches_its_definition(isa, rng, name, group, hq, L):
    """The scores of integer_qk are those of the rounded query rows (int8, each
    with its scale) against the stored keys: the float64 reference on those."""
    e = 128
    cache = sdpa.KVCache(1, 2, 400, e, e, dtype=name, group_size=group)
    cache.append(rng.standard_normal((1, 2, 333, e)).astype(np.float32),
                 rng.standard_normal((1, 2, 333, e)).astype(np.float32))
    q = rng.standard_normal((1, hq, L, e)).astype(np.float32)
    out = cache.attend(q, integer_qk=True)
    scaled = q.astype(np.float32) * np.float32(1 / np.sqrt(e))
    qscale = np.abs(scaled).max(-1, keepdims=True) / np.float32(127)
    rounded = np.clip(np.round(scaled / qscale), -127, 127) * qscale.astype(np.float64)
    ref = reference.scaled_dot_product_attention(
        rounded, cache.keys.astype(np.float64), cache.values.astype(np.float64), scale=1.0,
        is_causal="bottom_right", enable_gqa=hq != 2)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("name,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 16), ("int8", 64)])
def test_integer_qk_portable_and_vnni_agree(isa, rng, name, group):
    """The VNNI kernel (where the CPU has it) against the portable one: the same
    integer sums; bit for bit with one scale a row."""
    cache, _, _ = filled(rng, name, heads=2, capacity=700, e=128, ev=128, tokens=650, group_size=group)
    q = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
    fast, fast_lse = cache.attend(q, integer_qk=True, return_lse=True)
    kernel = _core.dot_qi_kernel()
    _core.set_portable_dot_qi(True)
    try:
        assert _core.dot_qi_kernel() == "portable"
        slow, slow_lse = cache.attend(q, integer_qk=True, return_lse=True)
    finally:
        _core.set_portable_dot_qi(False)
    if group is None or kernel == "portable":  # 650 keys: whole blocks of 4 and a tail
        np.testing.assert_array_equal(fast_lse, slow_lse)
        np.testing.assert_array_equal(fast, slow)
    assert_close(fast, slow, np.float32)
    assert_close(fast_lse, slow_lse, np.float32)


def test_integer_qk_kernel_is_vnni_where_the_cpu_has_it(isa):
    """AVX512-VNNI for the sets with AVX-512, AVX-VNNI for avx2, SDOT for the
    neon sets, where the CPU has them (Linux: its flags; AArch64 says
    "asimddp"); the portable kernel elsewhere."""
    path = "/proc/cpuinfo"
    flags = set(open(path).read().split()) if os.path.exists(path) else set()
    if isa in ("avx512", "avx512_bf16", "amx") and "avx512_vnni" in flags:
        want = "avx512_vnni"
    elif isa in ("neon", "neon_bf16") and "asimddp" in flags:
        want = "neon_dotprod"
    elif isa != "scalar" and "avx_vnni" in flags:
        want = "avx_vnni"
    else:
        want = "portable"
    if not flags and want == "portable" and isa != "scalar":
        pytest.skip("no /proc/cpuinfo to say which VNNI this CPU has")
    assert _core.dot_qi_kernel() == want


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_integer_qk_results_do_not_depend_on_the_thread_count(rng, portable_dot_qi, name):
    cache, _, _ = filled(rng, name, heads=2, capacity=3000, e=64, ev=64, tokens=2900)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    one = cache.attend(q, integer_qk=True, num_threads=1)
    for n in (2, 3):
        np.testing.assert_array_equal(cache.attend(q, integer_qk=True, num_threads=n), one)


def test_integer_qk_error_is_within_twice_the_int8_caches_own():
    rng = np.random.default_rng(7)
    k = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    v = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    cache = sdpa.KVCache(1, 8, 4096, 128, dtype="int8")
    cache.append(k, v)
    exact = reference.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), enable_gqa=True)
    own = np.abs(cache.attend(q, is_causal=False) - exact)
    integer = np.abs(cache.attend(q, is_causal=False, integer_qk=True) - exact)
    assert integer.max() <= 2 * own.max() and integer.mean() <= 2 * own.mean()


def test_integer_qk_nan_query_gives_nan_rows(rng):
    cache, _, _ = filled(rng, "int8", e=64, ev=64)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    q[0, 1, 0, 3] = np.nan
    out = cache.attend(q, integer_qk=True)
    assert np.isnan(out[0, 1]).all() and np.isfinite(np.delete(out, 1, axis=1)).all()


def test_integer_qk_checks():
    rng = np.random.default_rng(0)
    for name in ("float32", "float8_e4m3fn"):
        cache, _, _ = filled(rng, name, tokens=4)
        with pytest.raises(ValueError, match="integer_qk: only int8 and int4 caches"):
            cache.attend(np.ones((1, 2, 1, 32), np.float32), integer_qk=True)
    cache, _, _ = filled(rng, "int8", tokens=4)
    with pytest.raises(TypeError, match="integer_qk: expected a bool"):
        cache.attend(np.ones((1, 2, 1, 32), np.float32), integer_qk=1)


def test_integer_qk_on_the_tiled_path_computes_in_float(rng):
    """Long queries (the tiled path) ignore integer_qk, as documented."""
    cache, _, _ = filled(rng, "int8", tokens=150)
    q = rng.standard_normal((1, 2, 70, 32)).astype(np.float32)
    np.testing.assert_array_equal(cache.attend(q, integer_qk=True), cache.attend(q))


# ---------------------------------------------------------------- paged

@pytest.mark.parametrize("name,kw", [("float8_e4m3fn", {}), ("float8_e5m2", {"scale": None}), ("int4", {}),
                                     ("int4", {"group_size": 16}), ("int8", {})])
@pytest.mark.parametrize("block", [5, 16, 64])
@pytest.mark.parametrize("L", [1, 3, 40])
def test_paged_cache_matches_the_contiguous_one(isa, rng, name, kw, block, L):
    paged = sdpa.PagedKVCache(100, block, 2, 64, dtype=name, **kw)
    flat = sdpa.KVCache(1, 2, 400, 64, dtype=name, **kw)
    other = paged.add_sequence()
    seq = paged.add_sequence()
    k = rng.standard_normal((2, 300, 64)).astype(np.float32)
    v = rng.standard_normal((2, 300, 64)).astype(np.float32)
    paged.append(other, k[:, :9], v[:, :9])  # the sequence's blocks are not the first
    paged.append(seq, k, v)
    flat.append(k[None], v[None])
    q = rng.standard_normal((1, 4, L, 64)).astype(np.float32)
    assert_close(paged.attend([seq], q), expected(q, flat, is_causal="bottom_right"), np.float32)
    if name in ("int8", "int4"):
        out = paged.attend([seq], q, integer_qk=True)
        assert_close(out, flat.attend(q, integer_qk=True), np.float32)


def test_paged_functions_take_the_storage_by_name_and_ml_dtypes_arrays(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kc = np.zeros((4, 1, 8, 16), np.uint8)
    vc = np.zeros((4, 1, 8, 16), np.uint8)
    k = rng.standard_normal((10, 1, 16)).astype(np.float32)
    sdpa.paged_write(k, k, kc, vc, np.arange(10) + 8, kv_dtype="float8_e4m3fn")
    np.testing.assert_array_equal(kc[1:3].reshape(16, 16)[:10],
                                  k[:, 0].astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    by_name = sdpa.paged_attention(q, kc, vc, [[1, 2]], [10], kv_dtype="float8_e4m3fn")
    typed = sdpa.paged_attention(q, kc.view(ml_dtypes.float8_e4m3fn), vc.view(ml_dtypes.float8_e4m3fn),
                                 [[1, 2]], [10])
    np.testing.assert_array_equal(by_name, typed)
    ref = reference.scaled_dot_product_attention(
        q.astype(np.float64), dequantize(5, kc[1:3].reshape(1, 1, 16, 16)[:, :, :10], None).astype(np.float64),
        dequantize(5, vc[1:3].reshape(1, 1, 16, 16)[:, :, :10], None).astype(np.float64), enable_gqa=True)
    assert_close(by_name, ref, np.float32)
    with pytest.raises(ValueError, match="kv_dtype"):
        sdpa.paged_attention(q, kc, vc, [[1, 2]], [10], kv_dtype="float4")
    with pytest.raises(TypeError, match="stored as uint8"):
        sdpa.paged_attention(q, kc.astype(np.int8), vc.astype(np.int8), [[1, 2]], [10], kv_dtype="int4")
    with pytest.raises(ValueError, match="without scales holds values up to"):
        sdpa.paged_write(k * 1000, k, kc, vc, np.arange(10), kv_dtype="float8_e4m3fn")


@pytest.mark.parametrize("name", FP8)
def test_every_fp8_byte_widens_exactly_in_the_kernels(isa, name):
    """One position, so that the output is its value row and the lse its score:
    every byte but NaN, as a value and as a key feature (a one-hot query row per
    feature), exactly; then a NaN byte in a key makes the rows that see it NaN."""
    code = _core.QUANTIZED[name]
    table = _fp8_table(code)
    finite = np.flatnonzero(np.isfinite(table)).astype(np.uint8)
    cache = sdpa.KVCache(1, 1, 1, 32, dtype=name, scale=None)
    cache.append(np.zeros((1, 1, 1, 32), np.float32), np.zeros((1, 1, 1, 32), np.float32))
    for start in range(0, finite.size, 32):
        row = np.resize(finite[start:start + 32], 32)
        cache._k[0, 0, 0] = row
        cache._v[0, 0, 0] = row
        for c0 in range(0, 32, 8):
            q = np.zeros((1, 8, 1, 32), np.float32)
            q[0, np.arange(8), 0, c0 + np.arange(8)] = 1
            out, lse = cache.attend(q, is_causal=False, scale=1.0, return_lse=True)
            np.testing.assert_array_equal(out[0, :, 0], np.broadcast_to(table[row], (8, 32)))
            np.testing.assert_array_equal(lse[0, :, 0], table[row[c0:c0 + 8]])
    nan = 0x7F if name == "float8_e4m3fn" else 0x7E
    cache._k[0, 0, 0, 5] = nan
    assert np.isnan(cache.attend(np.ones((1, 2, 1, 32), np.float32), is_causal=False)).all()


def test_every_int4_byte_widens_exactly_in_the_kernels(isa):
    """Every byte (both nibbles, -8 included) as values and key features, one
    position with a scale of 1: the output is the row, the lse the score."""
    cache = sdpa.KVCache(1, 1, 1, 32, dtype="int4", group_size=32)
    cache.append(np.full((1, 1, 1, 32), 7, np.float32), np.full((1, 1, 1, 32), 7, np.float32))
    assert cache.key_scales[0, 0, 0, 0] == 1 and cache.value_scales[0, 0, 0, 0] == 1
    for start in range(0, 256, 16):
        row = np.arange(start, start + 16, dtype=np.uint8)
        cache._k[0, 0, 0] = row
        cache._v[0, 0, 0] = row
        values = np.stack([(row & 15).astype(np.float32) - 8, (row >> 4).astype(np.float32) - 8], axis=1).ravel()
        for c0 in range(0, 32, 8):
            q = np.zeros((1, 8, 1, 32), np.float32)
            q[0, np.arange(8), 0, c0 + np.arange(8)] = 1
            out, lse = cache.attend(q, is_causal=False, scale=1.0, return_lse=True)
            np.testing.assert_array_equal(out[0, :, 0], np.broadcast_to(values, (8, 32)))
            np.testing.assert_array_equal(lse[0, :, 0], values[c0:c0 + 8])
