"""The SIMD kernel sets: each one this CPU supports is checked against the
float64 reference (over shapes at the edges of its blocks and head dims, every
mask and causal kind, strided inputs, and bitwise across thread counts), and its
exp against libm (NumPy's exp in long double)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import sdpa
from conftest import check_against_reference, supported_isas
from sdpa import _core
from sdpa.testing import make_qkv

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
attention = sdpa.scaled_dot_product_attention

SUPPORTED = supported_isas()


def test_scalar_always_supported():
    assert "scalar" in SUPPORTED
    assert sdpa.config()["isa"] in SUPPORTED
    assert sdpa.config()["isas_supported"] == SUPPORTED


def test_every_kernel_table_is_complete():
    """Every table a call runs with has every kernel the driver may call (what a
    set does not have comes from the portable kernels), the bfloat16 products of
    the sets that declare them included: the driver tests no kernel for NULL."""
    names = list(SUPPORTED) + (["amx_emulated"] if "avx512_bf16" in SUPPORTED else [])
    for name in names:
        assert _core.table_complete(name) is True, name
    assert _core.table_complete("sse9") is None
    # the check sees a hole: the SIMD sets declare no float64 row kernels over
    # 16-bit or int8 storage (float64 problems have none), the scalar set all
    assert _core.table_complete("scalar", declared=True) is True
    for name in set(names) - {"scalar"}:
        assert _core.table_complete(name, declared=True) is False, name


def test_set_isa_rejects_unknown():
    with pytest.raises(ValueError, match="not supported"):
        _core.set_isa("sse9")


@pytest.mark.parametrize("name", ["scalar", "avx2"])
def test_environment_forces_a_lower_level(name):
    if name not in SUPPORTED:
        pytest.skip(f"{name} not supported here")
    env = dict(os.environ, SDPA_ISA=name)
    out = subprocess.run(
        [sys.executable, "-c", "import sdpa; print(sdpa.config()['isa'])"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == name


# --- exp: the polynomial against libm ----------------------------------------

EXP_RANGES = {np.float32: (-103.9, 88.72), np.float64: (-745.0, 709.78)}
# below these every kernel's exp is exactly 0 (internal.h: SDPA_EXP_CUT_F32/F64)
EXP_CUT = {np.float32: np.float32(-87.33), np.float64: np.float64(-708.39)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_accuracy(isa, dtype):
    """Relative error at most 1 eps from the cut up, where e^x is normal
    (measured: 0.65 eps); exactly 0 below the cut, never a subnormal number."""
    lo, hi = EXP_RANGES[dtype]
    x = np.concatenate([np.linspace(lo, hi, 400_001), np.linspace(-1, 0, 100_001),
                        EXP_CUT[dtype] + np.arange(-3, 4) * np.spacing(EXP_CUT[dtype])]).astype(dtype)
    y = x.copy()
    _core.kernel_exp(isa, y)
    exact = np.exp(x.astype(np.longdouble))
    fi = np.finfo(dtype)
    kept = x >= EXP_CUT[dtype]
    assert (exact[kept] >= fi.tiny).all()
    rel = np.abs((y.astype(np.longdouble) - exact) / exact)[kept]
    assert rel.max() <= fi.eps, f"max relative error {float(rel.max()):.3g} > eps {fi.eps:.3g}"
    assert (y[kept] >= fi.tiny).all(), "a subnormal result from the cut up"
    assert (y[~kept] == 0).all(), "not exactly 0 below the cut"


def _is_subnormal(a):
    a = np.abs(a)
    return (a > 0) & (a < np.finfo(a.dtype).tiny)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("row", [False, True], ids=["panel", "row"])
def test_softmax_writes_no_subnormal(isa, dtype, row):
    """The online softmax step of every set, fed scores at -inf and at 1000,
    100, 88, 87.3, 87 below the row's max (and 740, 709 for float64), on a
    fresh row and on one whose max grows by as much (the rescale of the sum
    and the accumulator): P, the row sums and the accumulators hold no
    subnormal value, and the terms past the cut are exactly 0."""
    nr = 1 if row else _core.panel_rows(isa, "float64" if dtype == np.float64 else "float32")
    gaps = [np.inf, 1000, 100, 88, 87.34, 87.3, 87, 0.5, 0]
    if dtype == np.float64:
        gaps += [740, 709, 708.3]
    cut = -float(EXP_CUT[dtype])
    n, ev = 2 * len(gaps) + 3, 19
    for fresh in (True, False):
        for shift in gaps[1:]:
            s = np.empty((n, nr), dtype)
            for x in range(nr):  # each row its own rotation of the gaps
                g = np.roll(np.array(gaps + gaps + [0, 0, 0], dtype), x)
                s[:, x] = 3.0 - g
            old_max = np.full(nr, -np.inf if fresh else 3.0 - shift, dtype)
            row_sum = np.full(nr, 0 if fresh else 1.5, dtype)
            acc = np.full((ev, nr), 0 if fresh else 0.75, dtype)
            s0 = s.copy()
            shape = (lambda a: a.reshape(-1)) if row else (lambda a: a)
            m, l, a = old_max.copy(), row_sum.copy(), shape(acc)
            p = s.reshape(-1) if row else s
            _core.kernel_softmax(isa, row, p, m, l, a)
            for name, arr in (("p", p), ("row_max", m), ("row_sum", l), ("acc", a)):
                assert not _is_subnormal(arr).any(), f"subnormal in {name}, shift {shift}, fresh {fresh}"
            assert (p.reshape(n, nr)[(s0 - 3.0) < -cut] == 0).all()
            assert np.allclose(l, np.exp((s0 - 3.0).astype(np.longdouble)).sum(0)
                               + (0 if fresh else 1.5 * np.exp(-np.longdouble(shift)) * (shift < cut)), rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L", [1, 40], ids=["row", "tiled"])
def test_weights_are_never_subnormal_nor_above_one(isa, dtype, L):
    """return_weights: e^(s - m) / l with a term just above the exponential's
    cut and l = 4 was a subnormal weight; it is 0 now, and a lone key's weight
    is exactly 1 (on the bfloat16 products' path too)."""
    cut = float(EXP_CUT[dtype])
    near = cut + (0.1 if dtype == np.float32 else 0.5)  # e^near is normal, e^near / 4 is not
    # E = 1, q = 1, scale 1: the scores are the keys
    k = np.array([0.0, 0.0, 0.0, 0.0, near, near - 0.05, -3.0])[None, :, None].astype(dtype)
    q = np.ones((1, L, 1), dtype)
    v = np.arange(7, dtype=dtype)[None, :, None]
    for qkv in ((q, k, v), (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))):
        _, w = attention(*qkv, scale=1.0, return_weights=True)
        assert not _is_subnormal(w).any()
        assert (w[..., 4:6] == 0).all() and (w[..., :4] > 0.24).all()
    if ml_dtypes is not None and dtype == np.float32:
        bf = np.dtype(ml_dtypes.bfloat16)
        lone = np.zeros((L, 7), bool)
        lone[:, 2] = True  # one visible key: weight 1, not 1 + the polynomial's error
        _, w = attention(q.astype(bf), k.astype(bf), v.astype(bf), attn_mask=lone, scale=1.0, return_weights=True)
        assert (w[..., 2] == 1).all() and (w <= 1).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_special_values(isa, dtype):
    x = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -1e30, 1e30, -1000.0, 1000.0, 1.0], dtype=dtype)
    y = x.copy()
    _core.kernel_exp(isa, y)
    assert y[0] == 0 and y[1] == np.inf and np.isnan(y[2])
    assert y[3] == 1 and y[4] == 1
    assert y[5] == 0 and y[6] == np.inf and y[7] == 0 and y[8] == np.inf
    assert abs(y[9] - np.e) <= 2 * np.finfo(dtype).eps * np.e


# --- every kernel set against the reference ----------------------------------

DTYPES = [np.float32, np.float64]

SHAPES = [
    # (batch, hq, hkv, L, S, E, Ev): each with every kind of KINDS
    ((), 1, 1, 1, 1, 1, 1),
    ((2,), 3, 3, 7, 9, 8, 16),
    ((), 2, 2, 33, 65, 31, 80),
    ((), 1, 1, 129, 127, 64, 64),
    ((), 2, 2, 130, 267, 128, 96),
    ((2,), 4, 2, 65, 257, 16, 8),
    ((), 1, 1, 300, 40, 256, 33),
]
KINDS = {
    # kind: (is_causal, mask)
    "plain": (False, None),
    "causal": (True, None),
    "bottom_right": ("bottom_right", None),
    "bool": (False, "bool-LS"),
    "float": (False, "float-HLS"),
}
# A sweep over the edges of the query and key blocks (L, S) and head dims E, with
# grouped-query heads and strided inputs; causal modes and masks taken in turn.
SWEEP_LS = [(1, 267), (7, 8), (33, 31), (65, 64), (127, 9), (267, 267)]
SWEEP_E = [1, 16, 31, 64, 80, 128, 256]


def kernel_cases():
    for dtype in DTYPES:
        for shape in SHAPES:
            for kind, (is_causal, mask) in KINDS.items():
                sizes = "x".join(map(str, shape[1:]))
                case_id = f"{kind}-{sizes}-{dtype.__name__}"
                yield pytest.param(dtype, shape, is_causal, mask, False, id=case_id)
    i = 0
    for dtype in DTYPES:
        for L, S in SWEEP_LS:
            for E in SWEEP_E:
                is_causal = (False, True, "bottom_right")[i % 3]
                mask = (None, "bool-HLS", None, "float-HLS-inf")[i % 4]
                kind = {False: "plain", True: "causal", "bottom_right": "bottom_right"}[is_causal]
                kind += f"+{mask}" if mask else ""
                shape = ((2,), 4, 2, L, S, E, E % 48 + 1)
                case_id = f"sweep-{kind}-{L}x{S}xE{E}-{dtype.__name__}"
                yield pytest.param(dtype, shape, is_causal, mask, True, id=case_id)
                i += 1


def kernel_mask(rng, kind, hq, L, S, dtype):
    if kind is None:
        return None
    if kind == "bool-LS":
        return rng.random((L, S)) < 0.7
    if kind == "float-HLS":
        return rng.standard_normal((hq, L, S)).astype(dtype)
    keep = rng.random((hq, L, S)) < 0.7
    if kind == "bool-HLS":
        return keep
    return np.where(keep, rng.standard_normal((hq, L, S)), -np.inf).astype(dtype)  # float-HLS-inf


@pytest.mark.parametrize("dtype,shape,is_causal,mask_kind,strided", list(kernel_cases()))
def test_kernel_set_against_reference(isa, rng, dtype, shape, is_causal, mask_kind, strided):
    """Output and weights against the reference, and the same bits for 1, 2 and 3
    threads.  The sweep reads the query rows backwards and a key stored
    feature-major."""
    assert sdpa.config()["isa"] == isa
    batch, hq, hkv, L, S, E, Ev = shape
    q, k, v = make_qkv(rng, batch, hq, hkv, L, S, E, Ev, dtype)
    if strided:
        q = q[..., ::-1, :]
        k = np.swapaxes(np.swapaxes(k, -1, -2).copy(), -1, -2)
    args = (q, k, v, kernel_mask(rng, mask_kind, hq, L, S, dtype), is_causal, None, hq != hkv)
    out, weights = check_against_reference(*args, num_threads=1)
    for n in (2, 3):
        out_n, weights_n = sdpa.scaled_dot_product_attention(*args, return_weights=True, num_threads=n)
        assert np.array_equal(out_n, out) and np.array_equal(weights_n, weights), f"num_threads={n}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_set_strided_inputs(isa, rng, dtype):
    # (B, L, H, E) memory order seen as (B, H, L, E); V read backwards; K broadcast over heads
    q = rng.standard_normal((2, 70, 3, 24)).astype(dtype).transpose(0, 2, 1, 3)
    k = np.broadcast_to(rng.standard_normal((1, 1, 90, 24)).astype(dtype), (2, 3, 90, 24))
    v = rng.standard_normal((2, 3, 90, 40)).astype(dtype)[..., ::-1, ::2]
    check_against_reference(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_sets_bitwise_across_threads(isa, rng, dtype):
    q, k, v = make_qkv(rng, (2,), 4, 2, 200, 300, 64, 64, dtype)
    runs = [
        sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, num_threads=n)
        for n in (1, 2, 3)
    ]
    assert all(np.array_equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("E,Ev", [(16, 8), (64, 48)])
def test_kernel_set_nan_and_masked_rows(isa, rng, dtype, E, Ev):
    """A NaN query row gives a NaN output row, a row with no visible key zeros,
    also where rows are stored a vector block at a time (Ev = 48) and into an
    out= view whose rows are wider than Ev."""
    q, k, v = make_qkv(rng, (), 1, 1, 40, 50, E, Ev, dtype)
    q[0, 3, 5] = np.nan
    mask = np.ones((40, 50), dtype=bool)
    mask[7] = False
    out = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.isnan(out[0, 3]).all()
    assert (out[0, 7] == 0).all()
    rest = np.delete(out[0], [3, 7], axis=0)
    assert np.isfinite(rest).all()
    wide = np.full((1, 40, Ev + 5), 7.0, dtype=dtype)
    sdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask, out=wide[..., :Ev])
    assert np.array_equal(wide[..., :Ev], out, equal_nan=True)
    assert (wide[..., Ev:] == 7.0).all()


def _pair_sets():
    out = []
    for name in ("avx512_bf16", "amx_emulated"):
        runs = _core.isa_supported("avx512_bf16")
        out.append(pytest.param(name, marks=pytest.mark.skipif(not runs, reason="this CPU has no AVX512-BF16")))
    return out


@pytest.mark.parametrize("name", _pair_sets())
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "running"])
def test_softmax_pairs_writes_no_subnormal(name, fresh):
    """The bfloat16 sets' fused softmax (softmax_pairs), fed the same gaps below
    the max as above, on a fresh panel and on one with a running max (its
    single pass against it, and the second pass when the max jumps): its P
    pairs, row sums and accumulators hold no subnormal, the terms past the cut
    are exactly 0, and the sums are the exponentials' (to 1e-5)."""
    nr = _core.panel_rows(name, "float32")
    gaps = [np.inf, 1000, 100, 88, 87.34, 87.3, 87, 0.5, 0]
    n, ev = 2 * len(gaps) + 3, 19
    for shift in [0.0, 3.0, 87.3, 100.0]:
        s = np.empty((n, nr), np.float32)
        for x in range(nr):
            s[:, x] = 3.0 - np.roll(np.array(gaps + gaps + [0, 0, 0], np.float32), x)
        m = np.full(nr, -np.inf if fresh else 3.0 - shift, np.float32)
        l = np.full(nr, 0 if fresh else 1.5, np.float32)
        acc = np.full((ev, nr), 0 if fresh else 0.75, np.float32)
        s0 = s.copy()
        _core.kernel_softmax(name, 2, s, m, l, acc)
        pairs = s.view(np.uint32)[: (n + 1) // 2]
        lo = (pairs & 0xFFFF).astype(np.uint32) << 16
        hi = pairs & 0xFFFF0000
        p = np.empty((2 * pairs.shape[0], nr), np.float32)
        p[0::2], p[1::2] = lo.view(np.float32), hi.view(np.float32)
        p = p[:n]
        for what, arr in (("p", p), ("row_sum", l), ("acc", acc)):
            assert not _is_subnormal(arr).any(), f"subnormal in {what}, shift {shift}"
        assert (p[(s0 - m.max(initial=3.0)) < -87.33 - 11.1] == 0).all()
        # the terms are taken against the returned max: they sum to the row sum
        new = np.exp((s0.astype(np.float64) - m.astype(np.float64))).sum(0)
        old = 0 if fresh else 1.5 * np.exp((3.0 - shift) - m.astype(np.float64))
        np.testing.assert_allclose(l, new + old, rtol=1e-5)
