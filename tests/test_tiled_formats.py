"""The tiled path's storage formats, one loop for all: float32 K/V read in place,
16-bit and int8 K/V widened (once per call, or a tile at a time), and bfloat16
pairs on the sets with bfloat16 products (avx512_bf16, amx, amx_emulated).

Checked here: every variant (window, softcap, ALiBi, sinks, masks, weights, any
scale) runs on the bfloat16 products and matches the reference; K/V packed once
per call give the same bits as tile by tile; the phase profile of the tiled path
counts what it computed.
"""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import tolerance
from sdpa import _core
from sdpa.testing import make_qkv, random_mask

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
BF16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes else None
needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
attention = sdpa.scaled_dot_product_attention
ref = sdpa.reference.scaled_dot_product_attention


def pair_sets():
    """The kernel sets with bfloat16 products, each skipped with its reason where it cannot run."""
    out = []
    for name in ("avx512_bf16", "amx_emulated", "amx"):
        runs = _core.isa_supported("avx512_bf16") if name != "amx" else _core.isa_supported("amx")
        out.append(pytest.param(name, marks=pytest.mark.skipif(not runs, reason=f"this CPU cannot run {name}")))
    return out


@pytest.fixture(params=pair_sets())
def pairs_set(request):
    if request.param == "amx" and not _core.ask_for_tiles():
        pytest.skip("the OS refuses this process the AMX tile state")
    named = _core.isa_named()
    _core.use_kernels(request.param)
    try:
        yield request.param
    finally:
        _core.set_isa(named)


@pytest.fixture
def packing():
    """_core.set_packing, restored to the rule after the test."""
    try:
        yield _core.set_packing
    finally:
        _core.set_packing("rule")


def as64(*arrays):
    return [np.asarray(a).astype(np.float64) for a in arrays]


def bf16_qkv(rng, **shape):
    return tuple(a.astype(BF16) for a in make_qkv(rng, dtype=np.float32, **shape))


VARIANTS = {
    "window": dict(window=(20, 3)),
    "window-left": dict(window=(7, -1)),
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32)),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, -np.inf], np.float32)),
    "all": dict(window=(30, 0), softcap=9.0, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05], np.float32),
                sinks=np.array([1.0, 0.0, -2.0, 3.0], np.float32)),
}


@needs_bf16
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
def test_every_variant_runs_on_bfloat16_products(pairs_set, rng, variant, causal):
    """Windows, softcap, ALiBi and sinks on the tiled loop's bfloat16 format:
    the products ran (amx_emulated counts its own), and the result matches the
    reference as the plain bfloat16 problem does."""
    q, k, v = bf16_qkv(rng, batch=(2,), hq=4, hkv=2, L=70, S=90, E=64)
    kw = VARIANTS[variant]
    calls = _core.amx_emulated_calls()
    out, lse = attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True, **kw)
    if pairs_set == "amx_emulated":
        assert _core.amx_emulated_calls() > calls
    want, want_lse = ref(*as64(q, k, v), is_causal=causal, enable_gqa=True, return_lse=True,
                         **{key: (np.asarray(val, np.float64) if isinstance(val, np.ndarray) else val)
                            for key, val in kw.items()})
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tolerance(BF16), atol=tolerance(BF16))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)


@needs_bf16
@pytest.mark.parametrize("scale", [0.3, -0.7, 0.0, 1e-30])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_any_scale_and_mask_with_bfloat16_products(pairs_set, rng, scale, mask_kind):
    """The scale folded into the softmax (scale > 0 with no additive term) or
    applied to the scores first (otherwise): both match the reference."""
    q, k, v = bf16_qkv(rng, batch=(1,), hq=2, L=45, S=77, E=32)
    mask = None if mask_kind == "none" else random_mask(rng, (2, 45, 77), mask_kind, np.float32)
    out = attention(q, k, v, mask, scale=scale)
    want = ref(*as64(q, k, v), None if mask is None else np.asarray(mask), scale=scale)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tolerance(BF16), atol=tolerance(BF16))


@needs_bf16
def test_weights_with_bfloat16_products(pairs_set, rng):
    q, k, v = bf16_qkv(rng, batch=(1,), hq=2, L=40, S=66, E=64)
    out, w = attention(q, k, v, is_causal=True, return_weights=True, window=(9, 0))
    want_out, want_w = ref(*as64(q, k, v), is_causal=True, return_weights=True, window=(9, 0))
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.astype(np.float64), want_out, rtol=tolerance(BF16), atol=tolerance(BF16))


def _calls(q, k, v, **kw):
    return attention(q, k, v, **kw)


def _kv_formats():
    """(name, q dtype, k/v dtype): the formats the tiled loop packs."""
    out = [("float16", np.float16, np.float16), ("float32-over-float16", np.float32, np.float16)]
    if ml_dtypes is not None:
        out += [("bfloat16", BF16, BF16), ("float32-over-bfloat16", np.float32, BF16),
                ("float16-over-bfloat16", np.float16, BF16)]
    return out


@pytest.mark.parametrize("name, qdt, kvdt", _kv_formats(), ids=[f[0] for f in _kv_formats()])
@pytest.mark.parametrize("shape", [dict(batch=(2,), hq=4, hkv=2, L=130, S=301, E=64, Ev=48),
                                   dict(batch=(1,), hq=3, hkv=1, L=64, S=1100, E=34, Ev=80),
                                   dict(batch=(1,), hq=2, hkv=2, L=33, S=40, E=17, Ev=16)])
def test_packed_once_is_bitwise_the_tile_by_tile_result(isa, rng, packing, name, qdt, kvdt, shape):
    """K and V packed once per call (shared by every query block and GQA head)
    hold the same values as the tiles packed in each task: the same bits, on
    every kernel set, with causality, a mask, key lengths and a window."""
    q, k, v = make_qkv(rng, dtype=np.float32, **shape)
    q, k, v = q.astype(qdt), k.astype(kvdt), v.astype(kvdt)
    L, S = shape["L"], shape["S"]
    mask = rng.random((L, S)) < 0.8
    lengths = np.array([S - 3, S // 2][: len(shape["batch"])])
    _core.set_blocking(32, 0, 0)  # several query blocks: the packing pays
    try:
        for kw in (dict(is_causal=True, enable_gqa=True), dict(attn_mask=mask, enable_gqa=True),
                   dict(key_lengths=lengths, enable_gqa=True, window=(50, 10))):
            packing("never")
            tiles = attention(q, k, v, **kw)
            packing("always")
            once = attention(q, k, v, **kw)
            np.testing.assert_array_equal(np.asarray(once).view(np.uint8), np.asarray(tiles).view(np.uint8))
    finally:
        _core.set_blocking(0, 0, 0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_packed_once_is_the_same_for_every_thread_count(rng, packing, threads):
    q, k, v = make_qkv(rng, (2,), 8, 2, 200, 333, 64, dtype=np.float32)
    q, k, v = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
    packing("always")
    one = attention(q, k, v, is_causal=True, enable_gqa=True, num_threads=1)
    got = attention(q, k, v, is_causal=True, enable_gqa=True, num_threads=threads)
    np.testing.assert_array_equal(got.view(np.uint16), one.view(np.uint16))


def test_set_packing_rejects_unknown_modes():
    with pytest.raises(ValueError, match="set_packing"):
        _core.set_packing("sometimes")


# ---- the phase profile ----

@pytest.fixture
def profiled():
    try:
        yield
    finally:
        _core.profile_stop()


def test_profile_counts_the_scores_and_times_every_phase(profiled, rng):
    """Between profile_start and profile_read, the tiled calls add the scores
    they computed (here every pair, twice) and a time to each phase they ran."""
    q, k, v = make_qkv(rng, (2,), 3, 3, 100, 150, 32, dtype=np.float32)
    attention(q, k, v)
    _core.profile_start()
    attention(q, k, v)
    attention(q, k, v, num_threads=2)
    prof = _core.profile_read()
    assert set(prof) == set(_core.PROFILE_PHASES) | {"scores"}
    assert prof["scores"] == 2 * 2 * 3 * 100 * 150
    for phase in ("pack", "qk", "softmax", "pv", "epilogue"):
        assert prof[phase] > 0, phase
    assert all(prof[ph] >= 0 for ph in _core.PROFILE_PHASES)


def test_profile_skips_what_causality_hides_and_stops(profiled, rng):
    q, k, v = make_qkv(rng, (), 1, 1, 256, 256, 16, dtype=np.float32)
    _core.profile_start()
    attention(q, k, v, is_causal=True)
    scores = _core.profile_read()["scores"]
    assert 256 * 257 / 2 <= scores < 256 * 256  # the diagonal tiles in full, nothing above them
    _core.profile_stop()
    attention(q, k, v)
    assert _core.profile_read()["scores"] == scores  # stopped: nothing added


def test_profile_does_not_count_the_row_path(profiled, rng):
    q, k, v = make_qkv(rng, (), 4, 4, 1, 500, 64, dtype=np.float32)  # decoding: the row path
    _core.profile_start()
    attention(q, k, v)
    assert _core.profile_read()["scores"] == 0


@needs_bf16
@pytest.mark.parametrize("E", [80, 34, 17, 8])
def test_key_pairs_padded_to_whole_tiles(pairs_set, rng, packing, E):
    """Where a key row ends in part of a tile (E/2 not a multiple of 16), the
    amx sets pack K once with zero pairs up to whole tiles (and the query panels
    alike): the same bits as K read a tile at a time, and the reference's values."""
    q, k, v = bf16_qkv(rng, batch=(1,), hq=4, hkv=2, L=100, S=150, E=E, Ev=24)
    _core.set_blocking(32, 0, 0)
    try:
        packing("never")
        tiles = attention(q, k, v, is_causal=True, enable_gqa=True)
        packing("always")
        once = attention(q, k, v, is_causal=True, enable_gqa=True)
    finally:
        _core.set_blocking(0, 0, 0)
    np.testing.assert_array_equal(once.view(np.uint16), tiles.view(np.uint16))
    want = ref(*as64(q, k, v), is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(once.astype(np.float64), want, rtol=tolerance(BF16), atol=tolerance(BF16))


# ---- regressions ----

def test_a_tiny_rescale_in_one_row_leaves_the_others_finite(isa):
    """One row's max jumps by 50 (its accumulator rescaled by e^-50 < 2^-60, the
    careful product), while the other rows of the panel keep large accumulators
    (V = 1e20): theirs are rescaled as usual, not through the careful product,
    which would overflow them."""
    L, S, E = 32, 64, 16
    q = np.zeros((1, L, E), np.float32)
    q[0, 0, 0] = 1.0
    k = np.zeros((1, S, E), np.float32)
    k[0, 32:, 0] = 50.0 * 4  # the scale is 1/4
    v = np.full((1, S, E), 1e20, np.float32)
    _core.set_blocking(0, 32, 0)
    try:
        out = attention(q, k, v)
    finally:
        _core.set_blocking(0, 0, 0)
    np.testing.assert_allclose(out, 1e20, rtol=1e-5)


@needs_bf16
@pytest.mark.parametrize("mode", ["never", "always"])
def test_an_odd_key_count_does_not_read_the_next_value(pairs_set, rng, packing, mode):
    """With an odd number of visible keys, the last pair's second key is one no
    row sees; its V (here NaN, as in a cache's unwritten slots) must not reach
    the output through 0 x NaN."""
    q, k, v = bf16_qkv(rng, batch=(1,), hq=2, hkv=1, L=31, S=64, E=32)
    v[..., 31:, :] = np.nan
    k[..., 31:, :] = np.nan
    packing(mode)
    out = attention(q, k, v, is_causal=True, enable_gqa=True)
    assert np.isfinite(out.astype(np.float32)).all()
    want = ref(*as64(q[..., :31, :], k[..., :31, :], v[..., :31, :]), is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tolerance(BF16), atol=tolerance(BF16))


@needs_bf16
@pytest.mark.parametrize("tile_k", [7, 33])
def test_an_odd_forced_key_tile_keeps_whole_pairs(pairs_set, rng, packing, tile_k):
    q, k, v = bf16_qkv(rng, batch=(1,), hq=2, hkv=1, L=64, S=100, E=32)
    _core.set_blocking(32, tile_k, 0)
    try:
        packing("never")
        tiles = attention(q, k, v, enable_gqa=True)
        packing("always")
        once = attention(q, k, v, enable_gqa=True)
    finally:
        _core.set_blocking(0, 0, 0)
    np.testing.assert_array_equal(once.view(np.uint16), tiles.view(np.uint16))
    want = ref(*as64(q, k, v), enable_gqa=True)
    np.testing.assert_allclose(once.astype(np.float64), want, rtol=tolerance(BF16), atol=tolerance(BF16))


@needs_bf16
def test_huge_scores_with_bfloat16_products(pairs_set):
    """Scaled scores near float32's largest (1e38 and more): the base-2 exponent
    s (scale log2 e) - m log2 e would overflow; the softmax still picks the
    largest, as the float path does."""
    q = np.array([[[1.0]], [[1.0]]], np.float32).astype(BF16)  # (2, 1, 1)
    k = np.array([[[3e38], [1e38], [2e38]]] * 2, np.float32).astype(BF16)
    v = np.array([[[1.0], [2.0], [3.0]]] * 2, np.float32).astype(BF16)
    q = np.repeat(q, 40, axis=1)  # 40 query rows: the tiled path
    out = attention(q, k, v, scale=1.0).astype(np.float32)
    np.testing.assert_array_equal(out, 1.0)


@needs_bf16
@pytest.mark.parametrize("shift", [-2.0**21, 2.0**21, -3000.0])
def test_large_scores_keep_their_weights_with_bfloat16_products(pairs_set, rng, shift):
    """Scores around +-2^21 whose differences are small integers (exact in
    float32): the softmax is that of the differences.  The one-FMA base-2
    exponent, s log2 e - m log2 e, erred by 0.1 there (weights 8% off, a lone
    key's weight 1.06); large maxima take (s - m) log2 e, as the float path."""
    L, S = 40, 7  # 40 rows: the tiled path
    q = np.ones((2, L, 1), np.float32).astype(BF16)
    k = rng.integers(0, 4, (2, S, 1)).astype(np.float32).astype(BF16)
    v = rng.standard_normal((2, S, 3)).astype(np.float32).astype(BF16)
    mask = np.full((L, S), shift, np.float32)
    mask[np.arange(L) % 5 == 0, 1:] = -np.inf  # rows that see one key: weight exactly 1, output exactly v
    want_out, want_w = attention(q, k, v, attn_mask=np.where(np.isinf(mask), mask, 0), scale=1.0,
                                 return_weights=True)
    out, w = attention(q, k, v, attn_mask=mask, scale=1.0, return_weights=True)
    assert (w <= 1 + 1e-5).all()
    np.testing.assert_allclose(w, want_w, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(out.astype(np.float32), want_out.astype(np.float32), rtol=2**-7, atol=1e-6)
    lone = np.arange(L) % 5 == 0
    np.testing.assert_array_equal(out[:, lone].astype(np.float32), np.broadcast_to(v[:, :1], (2, lone.sum(), 3)))


@pytest.fixture
def pack_groups():
    """Packing of GQA groups forced by the test (set_pack_group), the rule after."""
    yield _core.set_pack_group
    _core.set_pack_group("rule")


PACK_DTYPES = [(np.float32, np.float32), (np.float64, np.float64), (np.float16, np.float16), (np.float32, "bf16"),
               ("bf16", "bf16")]


@pytest.mark.parametrize("qdt, kvdt", PACK_DTYPES, ids=["f32", "f64", "f16", "f32-bf16", "bf16"])
@pytest.mark.parametrize("kw", [{"is_causal": True}, {"is_causal": "bottom_right", "window": (9, 0)},
                                {"softcap": 3.0, "window": (5, 7)}, {"sinks": "per-head"}, {}],
                         ids=["causal", "window", "softcap", "sinks", "plain"])
@pytest.mark.parametrize("G, L, S", [(4, 20, 40), (3, 33, 70), (7, 17, 200)])  # tiled either way (L > 16)
def test_packed_gqa_groups_give_the_same_bits(isa, rng, pack_groups, qdt, kvdt, kw, G, L, S):
    """A GQA group's heads packed into the tiled path's rows (position-major,
    a panel spanning heads and positions) change no row's sums: the same bits
    as one head's rows a task, on every kernel set and dtype, with causality
    from either corner, windows, softcaps and sinks, and the lse; and the
    float64 reference agrees."""
    if "bf16" in (qdt, kvdt) and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    qd = BF16 if qdt == "bf16" else np.dtype(qdt)
    kd = BF16 if kvdt == "bf16" else np.dtype(kvdt)
    q = rng.standard_normal((2, 2 * G, L, 24)).astype(qd)
    k, v = (rng.standard_normal((2, 2, S, 24)).astype(kd) for _ in range(2))
    kw = dict(kw)
    if kw.get("sinks") == "per-head":
        kw["sinks"] = rng.standard_normal(2 * G).astype(np.float64 if qd == np.float64 else np.float32)
    results = {}
    for mode in ("never", "always"):
        pack_groups(mode)
        results[mode] = attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
    for a, b in zip(results["never"], results["always"]):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    out, lse = results["always"]
    # the weights are written row by row: asking for them changes no path and no bit
    # (but with bfloat16 pairs, whose softmax takes the scale folded in only without them)
    with_weights, weights = attention(q, k, v, enable_gqa=True, return_weights=True, **kw)
    if not (qd == BF16 and kd == BF16):
        assert np.array_equal(with_weights.view(np.uint8), out.view(np.uint8))
    expected, expected_lse = ref(*(x.astype(np.float64) for x in (q, k, v)), enable_gqa=True, return_lse=True, **kw)
    expected_w = ref(*(x.astype(np.float64) for x in (q, k, v)), enable_gqa=True, return_weights=True, **kw)[1]
    np.testing.assert_allclose(weights, expected_w, rtol=1e-3, atol=1e-3)
    tol = tolerance(qd if qd != BF16 or kd == BF16 else np.float32, 24) * (8 if BF16 in (qd, kd) else 1)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)
