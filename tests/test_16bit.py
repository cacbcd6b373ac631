"""16-bit attention: float16 and bfloat16 (ml_dtypes) queries, keys and values.

The promotion table, accuracy against the float64 reference on the same rounded
inputs (every mask kind, both causal alignments, GQA, odd sizes, E from 64 to
256, on every kernel set), the error compared with torch's own in the same
dtype, and a float32 query reading a 16-bit cache in place.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import sdpa
from conftest import tolerance
from sdpa import _core
from sdpa.testing import compute_dtype, make_qkv, random_mask

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALF = {"f16": F16, "bf16": BF16}
attention = sdpa.scaled_dot_product_attention


def reference(q, k, v, *args, **kwargs):
    """The float64 reference on the values as stored (already rounded)."""
    as64 = [np.asarray(a).astype(np.float64) for a in (q, k, v)]
    return sdpa.reference.scaled_dot_product_attention(*as64, *args, **kwargs)


# --------------------------------------------------------------------------- promotion

NAMES = {"f32": np.dtype(np.float32), "f64": np.dtype(np.float64), "f16": F16, "bf16": BF16,
         "i32": np.dtype(np.int32)}
# (query, key, value) -> output dtype: the query's when all three are float32,
# float16 or bfloat16; float64 as soon as one is anything else.
PROMOTION = {
    ("bf16", "bf16", "bf16"): "bf16",
    ("f16", "f16", "f16"): "f16",
    ("f32", "bf16", "bf16"): "f32",
    ("f32", "f16", "f16"): "f32",
    ("bf16", "f32", "f32"): "bf16",
    ("f16", "bf16", "bf16"): "f16",
    ("bf16", "f16", "f16"): "bf16",
    ("bf16", "bf16", "f16"): "bf16",
    ("f32", "bf16", "f32"): "f32",
    ("bf16", "f64", "f64"): "f64",
    ("f16", "f16", "f64"): "f64",
    ("bf16", "i32", "i32"): "f64",
}


@pytest.mark.parametrize("dtypes, expected", PROMOTION.items(), ids=["-".join(d) for d in PROMOTION])
def test_promotion_table(rng, dtypes, expected):
    q, k, v = (rng.standard_normal(s).astype(NAMES[d])
               for s, d in zip([(2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5)], dtypes))
    out, weights, lse = attention(q, k, v, return_weights=True, return_lse=True)
    want = NAMES[expected]
    assert out.dtype == want
    assert weights.dtype == lse.dtype == compute_dtype(want)
    ref = reference(q, k, v)
    tol = tolerance(want) if want != np.float64 else 1e-12
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- accuracy grids

MASKS = ["none", "bool", "float"]
CAUSAL = [False, True, "bottom_right"]


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("mask_kind, causal", list(itertools.product(MASKS, CAUSAL)))
def test_masks_and_causality_on_every_kernel_set(isa, rng, half, mask_kind, causal):
    dt = HALF[half]
    q, k, v = make_qkv(rng, batch=(2,), hq=4, hkv=2, L=37, S=45, E=64, dtype=np.float32)
    q, k, v = (a.astype(dt) for a in (q, k, v))
    mask = None if mask_kind == "none" else random_mask(rng, (4, 37, 45), mask_kind, np.float32)
    out, lse = attention(q, k, v, mask, causal, enable_gqa=True, return_lse=True)
    exp_out, exp_w = reference(q, k, v, mask, causal, enable_gqa=True, return_weights=True)
    assert out.dtype == dt and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float64), exp_out, rtol=tolerance(dt), atol=tolerance(dt))


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("E", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("L, S", [(1, 300), (4, 1100), (33, 65), (130, 129)])
def test_head_dims_and_odd_sizes(rng, half, E, L, S):
    """Row mode (L = 1, and 4 rows x group 2 = 8) and tiled mode, several key chunks."""
    dt = HALF[half]
    q, k, v = make_qkv(rng, batch=(1,), hq=4, hkv=2, L=L, S=S, E=E, Ev=E, dtype=np.float32)
    q, k, v = (a.astype(dt) for a in (q, k, v))
    out = attention(q, k, v, is_causal="bottom_right", enable_gqa=True)
    exp = reference(q, k, v, is_causal="bottom_right", enable_gqa=True)
    np.testing.assert_allclose(out.astype(np.float64), exp, rtol=tolerance(dt), atol=tolerance(dt))


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("L", [9, 1], ids=["tiled", "row-mode"])
def test_16bit_is_float32_arithmetic_rounded_once(isa, rng, half, L):
    """float32 arithmetic on the same values, the output rounded once -- except
    for bfloat16 products (the avx512_bf16 and amx sets, tiled), which round P to
    bfloat16 before P V as torch and FlashAttention do."""
    dt = HALF[half]
    q, k, v = (a.astype(dt) for a in make_qkv(rng, batch=(2,), hq=2, L=L, S=70, E=32, dtype=np.float32))
    out = attention(q, k, v, is_causal=True)
    out32 = attention(*(a.astype(np.float32) for a in (q, k, v)), is_causal=True)
    if half == "bf16" and L > 1 and isa in ("avx512_bf16", "amx"):
        np.testing.assert_allclose(out.astype(np.float64), out32, rtol=tolerance(dt), atol=tolerance(dt))
    else:
        np.testing.assert_array_equal(out.view(np.uint16), out32.astype(dt).view(np.uint16))


@pytest.mark.parametrize("half", HALF)
def test_16bit_row_mode_with_several_rows_per_kv_head_is_float32_rounded_once(isa, half):
    """GQA decoding (and small L): a key/value head serves 2-16 query rows on
    the row path (from 24 rows a GQA group packs into the tiled path's rows).
    The 16-bit keys' several-rows dot kernel must sum each score as the float32
    one does; it used to differ for the keys past the last whole vector of keys
    and when E is not a whole number of vectors."""
    dt = HALF[half]
    bad = []
    for g, L, S, E in itertools.product([2, 4, 8], [1, 2], [17, 300], [20, 64, 72]):
        rng = np.random.default_rng(1000 * g + 100 * L + S + E)
        q = rng.standard_normal((1, 2 * g, L, E)).astype(dt)
        k, v = (rng.standard_normal((1, 2, S, E)).astype(dt) for _ in range(2))
        out = attention(q, k, v, enable_gqa=True, is_causal="bottom_right")
        out32 = attention(*(a.astype(np.float32) for a in (q, k, v)), enable_gqa=True, is_causal="bottom_right")
        if not np.array_equal(out.view(np.uint16), out32.astype(dt).view(np.uint16)):
            bad.append((g, L, S, E))
    assert not bad, f"differ from float32 rounded once: (group, L, S, E) = {bad}"


@pytest.mark.parametrize("half", HALF)
def test_bitwise_identical_across_thread_counts(rng, half):
    dt = HALF[half]
    q, k, v = (a.astype(dt) for a in make_qkv(rng, batch=(2,), hq=4, L=70, S=300, E=64, dtype=np.float32))
    first = attention(q, k, v, is_causal=True, num_threads=1)
    for n in (2, 3):
        np.testing.assert_array_equal(attention(q, k, v, is_causal=True, num_threads=n).view(np.uint16),
                                      first.view(np.uint16))


def test_special_values_in_bfloat16(rng):
    q, k, v = (a.astype(BF16) for a in make_qkv(rng, batch=(1,), hq=2, L=5, S=9, E=8, dtype=np.float32))
    q[0, 0, 1, 2] = np.nan
    k[0, 1, 3, 0] = np.inf
    out = attention(q, k, v).astype(np.float32)
    assert np.isnan(out[0, 0, 1]).all() and np.isfinite(out[0, 0, [0, 2, 3, 4]]).all()
    assert np.isnan(out[0, 1]).any()  # an inf key score: NaN rows, as the reference


# --------------------------------------------------------------------------- a 16-bit cache


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("L", [1, 4, 40], ids=["decode", "gqa-rows", "chunked-prefill"])
def test_float32_query_reads_a_16bit_cache_in_place(rng, half, L):
    dt = HALF[half]
    q = rng.standard_normal((2, 8, L, 64)).astype(np.float32)
    cache = rng.standard_normal((2, 2, 2, 600, 64)).astype(dt)  # (k/v, B, Hkv, S, E)
    k, v = cache[0], cache[1]
    seen = []
    _core.set_observer(lambda handed: seen.append(handed))
    try:
        out, lse = attention(q, k, v, is_causal="bottom_right", enable_gqa=True, return_lse=True)
    finally:
        _core.set_observer(None)
    assert out.dtype == lse.dtype == np.float32
    assert seen and seen[0]["k"] is k and seen[0]["v"] is v  # no converted copy of the cache
    exp = reference(q, k, v, is_causal="bottom_right", enable_gqa=True)
    np.testing.assert_allclose(out, exp, rtol=tolerance(np.float32), atol=tolerance(np.float32))


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("group,L", [(2, 1), (3, 1), (5, 1), (8, 1), (3, 2)])
@pytest.mark.parametrize("E", [8, 72, 128])
def test_decode_groups_over_a_16bit_cache(isa, rng, half, group, L, E):
    """Every group size and head dim the row kernels block differently (rows in
    blocks of LANES / 4, keys in fours, the head dim's tail), on every kernel set."""
    dt = HALF[half]
    q = rng.standard_normal((1, 2 * group, L, E)).astype(np.float32)
    k = rng.standard_normal((1, 2, 203, E)).astype(dt)
    v = rng.standard_normal((1, 2, 203, E)).astype(dt)
    out = attention(q, k, v, enable_gqa=True, is_causal="bottom_right")
    exp = reference(q, k, v, enable_gqa=True, is_causal="bottom_right")
    np.testing.assert_allclose(out, exp, rtol=tolerance(np.float32), atol=tolerance(np.float32))


# --------------------------------------------------------------------------- against torch's own error


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize(
    "case",
    [
        dict(L=128, S=128, E=64, causal=False, mask=None),
        dict(L=77, S=301, E=80, causal=True, mask=None),
        dict(L=64, S=64, E=128, causal=False, mask="bool"),
        dict(L=33, S=65, E=96, causal=False, mask="float"),
        dict(L=1, S=700, E=128, causal=False, mask=None),
        dict(L=16, S=16, E=256, causal=True, mask=None),
    ],
    ids=["prefill", "causal-e80", "bool-e128", "float-e96", "decode", "e256"],
)
def test_error_at_most_1_5x_torchs(rng, half, case):
    torch = pytest.importorskip("torch")
    dt = HALF[half]
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16}[half]
    q, k, v = (a.astype(dt) for a in make_qkv(rng, batch=(2,), hq=4, L=case["L"], S=case["S"], E=case["E"],
                                              dtype=np.float32))
    mask = None
    if case["mask"]:
        mask = random_mask(rng, (4, case["L"], case["S"]), case["mask"], np.float32)
    ours = attention(q, k, v, mask, case["causal"]).astype(np.float64)
    exp = reference(q, k, v, mask, case["causal"])

    def t(a):
        return torch.from_numpy(np.asarray(a).astype(np.float32)).to(tdt)

    tmask = None if mask is None else (torch.from_numpy(mask) if mask.dtype == bool else t(mask))
    with torch.no_grad():
        theirs = torch.nn.functional.scaled_dot_product_attention(
            t(q), t(k), t(v), attn_mask=tmask, is_causal=bool(case["causal"])).float().numpy().astype(np.float64)
    ours_err, their_err = np.abs(ours - exp).max(), np.abs(theirs - exp).max()
    # at least half an ulp of the output is unavoidable for both
    floor = {"f16": 2.0**-11, "bf16": 2.0**-8}[half] * np.abs(exp).max()
    assert ours_err <= 1.5 * max(their_err, floor), (ours_err, their_err)
