"""The amx kernel set: bfloat16 products on AMX tiles (TDPBF16PS).

Its kernel is compiled twice, once with the tile instructions ("amx", chosen
only on a CPU with AMX-TILE and AMX-BF16 whose OS grants the tile state) and
once over a software model of the tiles ("amx_emulated", any CPU with
AVX512-BF16).  The emulated one runs the same tile configuration, blocking,
zero padding and strides, so the tests below check that code on every
AVX512-BF16 CPU; on an AMX CPU they run the real instructions too.  Also: the
set's selection, and that the OS is asked for the tile state only when the
set is used, never at import.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import sdpa
from conftest import tolerance
from sdpa import _core
from sdpa.testing import make_qkv, random_mask

try:
    import ml_dtypes
except ImportError:  # the kernel's own tests need no bfloat16 dtype
    ml_dtypes = None
BF16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes else None
needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
attention = sdpa.scaled_dot_product_attention


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def tile_sets():
    """The amx kernel in both forms, each skipped with the reason when it cannot run here."""
    emulated = pytest.param("amx_emulated", marks=pytest.mark.skipif(
        not _core.isa_supported("avx512_bf16"), reason="the emulated tiles run with the avx512_bf16 set's "
        "other kernels: this CPU has no AVX512-BF16"))
    real = pytest.param("amx", marks=pytest.mark.skipif(
        not _core.isa_supported("amx"), reason="this CPU (or its OS, or this build) cannot run AMX tiles"))
    return [emulated, real]


@pytest.fixture(params=tile_sets())
def tiles(request):
    if request.param == "amx" and not _core.ask_for_tiles():
        pytest.skip("the OS refuses this process the AMX tile state")
    named = _core.isa_named()
    _core.use_kernels(request.param)
    try:
        assert _core.isa() == request.param
        yield request.param
    finally:
        _core.set_isa(named)


def reference(q, k, v, *args, **kwargs):
    as64 = [np.asarray(a).astype(np.float64) for a in (q, k, v)]
    return sdpa.reference.scaled_dot_product_attention(*as64, *args, **kwargs)


def half_qkv(rng, **shape):
    return tuple(a.astype(BF16) for a in make_qkv(rng, dtype=np.float32, **shape))


# --------------------------------------------------------------------------- the kernel on its own

def aligned(n, dtype, fill):
    """n elements of dtype, 64-byte aligned, set to fill."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 64, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64
    out = raw[off:off + n * itemsize].view(dtype)
    out[...] = fill
    return out


def to_bf16_bits(x):
    """float32 values rounded to bfloat16 (to nearest even; NaN kept), as uint32 bits."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(x, np.float32))
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint32)


def pairs(lo, hi):
    """uint32 pairs of bfloat16 (lo in the low half) from two float arrays."""
    return to_bf16_bits(lo) | (to_bf16_bits(hi) << 16)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("kpairs", [0, 1, 16, 17, 40])
@pytest.mark.parametrize("a_layout", ["rows", "columns"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_bf16_contract(tiles, m, kpairs, a_layout, accumulate):
    """Small integers, so every sum is exact in float32 and the result is known
    to the bit; c's rows past m and columns past 32 are never written."""
    rng = np.random.default_rng(m * 1000 + kpairs)
    A = rng.integers(-8, 9, size=(m, kpairs, 2)).astype(np.float32)   # row r, pair p, half
    B = rng.integers(-8, 9, size=(kpairs, 32, 2)).astype(np.float32)  # pair p, column x, half
    a_pairs = pairs(A[..., 0], A[..., 1])
    # padding: NaN pairs, which would turn any result they reached into NaN
    if a_layout == "rows":  # a[r * a_rs + p], rows padded
        a_rs, a_ks = kpairs + 3, 1
        a = np.full(max(m * a_rs, 1), 0xFFFFFFFF, np.uint32)
        a.reshape(-1)[: m * a_rs].reshape(m, a_rs)[:, :kpairs] = a_pairs
    else:  # a[p * a_ks + r]: the pairs of a row are strided
        a_rs, a_ks = 1, m + 5
        a = np.full(max(kpairs * a_ks, 1), 0xFFFFFFFF, np.uint32)
        a[: kpairs * a_ks].reshape(kpairs, a_ks)[:, :m] = a_pairs.T
    ldb, ldc = 48, 64
    b = aligned(max(kpairs * ldb, 32), np.uint32, 0xFFFFFFFF)
    b[: kpairs * ldb].reshape(kpairs, ldb)[:, :32] = pairs(B[..., 0], B[..., 1])
    c = aligned((m + 2) * ldc, np.float32, 7.0)
    c0 = rng.integers(-50, 51, size=(m, 32)).astype(np.float32)
    c.reshape(m + 2, ldc)[:m, :32] = c0
    _core.gemm_bf16(tiles, m, kpairs, a, a_rs, a_ks, b, ldb, c, ldc, accumulate)
    want = np.einsum("rph,pxh->rx", A.astype(np.float64), B.astype(np.float64))
    if accumulate:
        want += c0
    got = c.reshape(m + 2, ldc)
    np.testing.assert_array_equal(got[:m, :32], want.astype(np.float32))
    assert (got[:m, 32:] == 7).all() and (got[m:] == 7).all()


def test_gemm_bf16_rounding_and_special_values(tiles):
    """Against the avx512_bf16 kernel on random values: the same products, summed
    in another order, so equal to float32 rounding; NaN and inf propagate."""
    rng = np.random.default_rng(5)
    m, kpairs = 40, 36
    a = pairs(rng.standard_normal((m, kpairs)), rng.standard_normal((m, kpairs))).reshape(-1)
    b = aligned(kpairs * 32, np.uint32, 0)
    b[:] = pairs(rng.standard_normal(kpairs * 32), rng.standard_normal(kpairs * 32))
    a[3 * kpairs + 5] = pairs(np.nan, 1.0)
    a[7 * kpairs + 2] = pairs(np.inf, 0.0)
    outs = {}
    for name in (tiles, "avx512_bf16"):
        c = aligned(m * 32, np.float32, 0)
        _core.gemm_bf16(name, m, kpairs, a, kpairs, 1, b, 32, c, 32, False)
        outs[name] = c.reshape(m, 32)
    ours, theirs = outs[tiles], outs["avx512_bf16"]
    assert np.isnan(ours[3]).all()
    assert (np.isnan(ours[7]) == np.isnan(theirs[7])).all() and np.isinf(ours[7][~np.isnan(ours[7])]).all()
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- attention through it

@needs_bf16
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_masks_and_causality(tiles, rng, mask_kind, causal):
    q, k, v = half_qkv(rng, batch=(2,), hq=4, hkv=2, L=37, S=45, E=64)
    mask = None if mask_kind == "none" else random_mask(rng, (4, 37, 45), mask_kind, np.float32)
    calls = _core.amx_emulated_calls()
    out, lse = attention(q, k, v, mask, causal, enable_gqa=True, return_lse=True)
    exp = reference(q, k, v, mask, causal, enable_gqa=True)
    assert out.dtype == BF16
    assert (_core.amx_emulated_calls() > calls) == (tiles == "amx_emulated")  # the kernel under test ran
    np.testing.assert_allclose(out.astype(np.float64), exp, rtol=tolerance(BF16), atol=tolerance(BF16))


@needs_bf16
@pytest.mark.parametrize("E", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("L, S", [(33, 65), (130, 129), (20, 300)])
def test_head_dims_and_odd_sizes(tiles, rng, E, L, S):
    q, k, v = half_qkv(rng, batch=(1,), hq=2, L=L, S=S, E=E)
    out = attention(q, k, v, is_causal="bottom_right")
    exp = reference(q, k, v, is_causal="bottom_right")
    np.testing.assert_allclose(out.astype(np.float64), exp, rtol=tolerance(BF16), atol=tolerance(BF16))
@needs_bf16
def test_keys_not_in_place_and_odd_head_dims(tiles, rng):
    """Keys whose pairs cannot be read in place (transposed, odd E) are packed."""
    q, k, v = half_qkv(rng, batch=(1,), hq=2, L=40, S=70, E=33, Ev=17)
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    k_view = np.swapaxes(kt, -1, -2)  # same values, column stride != 1
    out = attention(q, k_view, v)
    np.testing.assert_allclose(out.astype(np.float64), reference(q, k, v), rtol=tolerance(BF16),
                               atol=tolerance(BF16))
@needs_bf16
def test_weights_and_lse(tiles, rng):
    q, k, v = half_qkv(rng, batch=(2,), hq=2, L=48, S=50, E=64)
    out, w, lse = attention(q, k, v, is_causal=True, return_weights=True, return_lse=True)
    exp_out, exp_w = reference(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_allclose(w, exp_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.astype(np.float64), exp_out, rtol=tolerance(BF16), atol=tolerance(BF16))
    assert np.isfinite(lse).all()
@needs_bf16
def test_close_to_the_avx512_bf16_set(tiles, rng):
    """The same bfloat16 rounding of P, only the order of the sums differs."""
    q, k, v = half_qkv(rng, batch=(1,), hq=4, L=100, S=200, E=128)
    ours = attention(q, k, v, is_causal=True).astype(np.float64)
    _core.set_isa("avx512_bf16")
    theirs = attention(q, k, v, is_causal=True).astype(np.float64)
    _core.use_kernels(tiles)
    np.testing.assert_allclose(ours, theirs, rtol=2**-7, atol=2**-7)
@needs_bf16
def test_special_values(tiles, rng):
    q, k, v = half_qkv(rng, batch=(1,), hq=2, L=40, S=50, E=16)
    q[0, 0, 1, 2] = np.nan
    k[0, 1, 3, 0] = np.inf
    out = attention(q, k, v).astype(np.float32)
    assert np.isnan(out[0, 0, 1]).all() and np.isfinite(np.delete(out[0, 0], 1, axis=0)).all()
    assert np.isnan(out[0, 1]).any()
@needs_bf16
def test_bitwise_identical_across_thread_counts(tiles, rng):
    q, k, v = half_qkv(rng, batch=(2,), hq=2, L=70, S=150, E=64)
    first = attention(q, k, v, is_causal=True, num_threads=1)
    for n in (2, 3):
        np.testing.assert_array_equal(attention(q, k, v, is_causal=True, num_threads=n).view(np.uint16),
                                      first.view(np.uint16))
@needs_bf16
def test_inputs_unchanged(tiles, rng):
    q, k, v = half_qkv(rng, batch=(1,), hq=2, L=40, S=60, E=80)
    copies = [a.copy() for a in (q, k, v)]
    attention(q, k, v, is_causal=True)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a.view(np.uint16), c.view(np.uint16))


# --------------------------------------------------------------------------- selection

def test_amx_is_offered_only_where_the_cpu_has_it():
    flags = cpu_flags()
    assert "amx" in _core.ISAS
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        assert not _core.isa_supported("amx")
        assert "amx" not in sdpa.config()["isas_supported"]
        with pytest.raises(ValueError):
            _core.set_isa("amx")
        with pytest.raises(ValueError):
            _core.use_kernels("amx")


def test_asking_for_tiles_answers_like_the_cpu():
    """The arch_prctl request runs: refused cleanly without AMX; with it, granted
    unless the OS says no (then the set must not be offered once a call asked)."""
    granted = _core.ask_for_tiles()
    on_linux_x86 = sys.platform.startswith("linux") and os.uname().machine == "x86_64"
    if not (on_linux_x86 and _core.HAVE_AMX_KERNELS and {"amx_tile", "amx_bf16"} <= cpu_flags()):
        assert not granted and not _core.isa_supported("amx")
    elif granted:
        assert _core.isa_supported("amx")
    else:
        pytest.skip("this CPU has AMX, and the OS refuses this process the tile state")


CHILD = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def tiles_granted():
    bits = ctypes.c_ulong(0)
    # SYS_arch_prctl = 158, ARCH_GET_XCOMP_PERM = 0x1022; bit 18 = XTILEDATA
    if libc.syscall(158, 0x1022, ctypes.byref(bits)) != 0:
        return None
    return bool(bits.value >> 18 & 1)
before = tiles_granted()
import sdpa
sdpa.config()
after_import = tiles_granted()
import numpy as np, ml_dtypes
q = np.ones((1, 1, 64, 64), np.float32)
sdpa.scaled_dot_product_attention(q, q, q)
after_f32 = tiles_granted()
q = q.astype(ml_dtypes.bfloat16)
sdpa.scaled_dot_product_attention(q, q, q)
after_bf16 = tiles_granted()
print(before, after_import, after_f32, after_bf16, sdpa.config()["isa"])
"""

STAND_IN = r"""
import numpy as np, ml_dtypes, sdpa
from sdpa import _core
_core.stand_in(1, as_default=True)  # amx_emulated asks the OS as amx would
counts = []
sdpa.config()
counts.append(_core.tile_requests())
q = np.ones((1, 2, 64, 64), np.float32)
sdpa.scaled_dot_product_attention(q, q, q)
counts.append(_core.tile_requests())
q = q.astype(ml_dtypes.bfloat16)
sdpa.scaled_dot_product_attention(q[:, :, :1], q, q)  # row mode: no tiles
counts.append(_core.tile_requests())
sdpa.scaled_dot_product_attention(q, q, q)  # tiled: asks
counts.append(_core.tile_requests())
sdpa.scaled_dot_product_attention(q, q, q)  # asked once
counts.append(_core.tile_requests())
print(*counts)
"""


def _child(code):
    env = {k: v for k, v in os.environ.items() if k != "SDPA_ISA"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@needs_bf16
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="arch_prctl is x86-64 Linux")
def test_only_a_call_that_needs_tiles_asks_for_them():
    before, after_import, after_f32, after_bf16, isa = _child(CHILD)
    # neither the import, nor config(), nor a float32 call asked anything of the OS
    assert after_import == after_f32 == before
    if isa == "amx":
        assert after_bf16 == "True"


@needs_bf16
def test_the_tile_state_is_asked_for_once_by_the_first_call_that_needs_it():
    """With amx_emulated standing in for amx (any AVX512-BF16 CPU): nothing is
    asked by config(), a float32 call or a row-mode bfloat16 call; the first
    tiled bfloat16 call asks; the answer is kept."""
    if not _core.isa_supported("avx512_bf16"):
        pytest.skip("amx_emulated needs AVX512-BF16")
    assert _child(STAND_IN) == ["0", "0", "0", "1", "1"]


def test_forcing_amx_where_it_cannot_run_is_an_error():
    if {"amx_tile", "amx_bf16"} <= cpu_flags():
        pytest.skip("this CPU has AMX")
    env = dict(os.environ, SDPA_ISA="amx")
    code = ("import warnings, numpy as np\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import sdpa\n"
            "print(len(w), str(w[0].message) if w else '')\n"
            "try:\n"
            "    sdpa.scaled_dot_product_attention(*(np.ones((1, 1, 2, 4), np.float32),) * 3)\n"
            "except ValueError as e:\n"
            "    print('ValueError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cannot run" in out.stdout and "ValueError" in out.stdout



@pytest.fixture
def stand_in():
    """amx_emulated standing in for amx towards the OS; ended, and the choice
    before restored, after."""
    if not _core.isa_supported("avx512_bf16"):
        pytest.skip("amx_emulated needs AVX512-BF16")
    named = _core.isa_named()
    try:
        yield
    finally:
        _core.stand_in(0)
        _core.set_isa(named)


@needs_bf16
def test_refused_tiles_fall_back_to_avx512_bf16_by_default(stand_in, rng):
    q, k, v = half_qkv(rng, batch=(1,), hq=2, L=40, S=60, E=64)
    _core.stand_in(-1, as_default=True)
    assert _core.isa() == "avx512_bf16" and sdpa.config()["isa"] == "avx512_bf16"
    calls = _core.amx_emulated_calls()
    ours = attention(q, k, v, is_causal=True)
    assert _core.amx_emulated_calls() == calls  # the tile kernel did not run
    _core.stand_in(0)
    _core.set_isa("avx512_bf16")
    theirs = attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(ours.view(np.uint16), theirs.view(np.uint16))


@needs_bf16
def test_refused_tiles_are_an_error_when_the_set_was_named(stand_in, rng):
    q, k, v = half_qkv(rng, batch=(1,), hq=2, L=40, S=60, E=64)
    _core.stand_in(-1, as_default=False)
    assert _core.isa() == "amx_emulated"
    calls = _core.amx_emulated_calls()
    with pytest.raises(ValueError, match="refused") as err:
        attention(q, k, v)
    assert "SDPA_ISA" not in str(err.value) or os.environ.get("SDPA_ISA")
    # calls that need no tiles still run: float32, and bfloat16 in row mode
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    np.testing.assert_allclose(attention(q32, k32, v32), reference(q32, k32, v32), rtol=1e-5, atol=1e-5)
    out = attention(q[:, :, :1], k, v)
    np.testing.assert_allclose(out.astype(np.float64), reference(q[:, :, :1], k, v), rtol=tolerance(BF16),
                               atol=tolerance(BF16))
    assert _core.amx_emulated_calls() == calls


def test_set_isa_none_returns_to_the_default_choice():
    named = _core.isa_named()
    try:
        _core.set_isa("scalar")
        assert _core.isa_named() == "scalar" and _core.isa() == "scalar"
        _core.set_isa(None)
        forced = os.environ.get("SDPA_ISA") or None
        assert _core.isa_named() == forced
        assert _core.isa() == (forced or sdpa.config()["isas_supported"][-1])
    finally:
        _core.set_isa(named)


def test_the_real_kernel_encodes_the_tiles_as_the_emulated_one_uses_them():
    """The tile numbers and operand order of the real kernel, read back from the
    built module (the instructions cannot run here, but they can be read):
    C tiles 0-3 += A tiles 4-5 times B tiles 6-7, configured, then released."""
    import shutil

    if not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"):
        pytest.skip("the amx set is built on x86-64 Linux only")
    if not _core.HAVE_AMX_KERNELS:
        pytest.skip("this build has no amx kernel (GCC 11 or clang 12 needed)")
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed")
    version = subprocess.run(["objdump", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    numbers = [int(x) for x in version.split()[-1].split(".")[:2] if x.isdigit()]
    if numbers < [2, 36]:
        pytest.skip(f"{version}: binutils before 2.36 cannot decode AMX instructions")
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _core.__file__], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    products = {" ".join(line.split()[1:]) for line in out.stdout.splitlines() if "tdpbf16ps" in line}
    assert products == {"tdpbf16ps %tmm6,%tmm4,%tmm0", "tdpbf16ps %tmm7,%tmm4,%tmm1",
                        "tdpbf16ps %tmm6,%tmm5,%tmm2", "tdpbf16ps %tmm7,%tmm5,%tmm3"}
    assert "ldtilecfg" in out.stdout and "tilerelease" in out.stdout
