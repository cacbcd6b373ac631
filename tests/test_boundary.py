"""The boundary between Python and the C core: the fast path (sdpa._core.try_attention)
and the general path (sdpa._api) agree bit for bit, the fast path takes the common
calls, and sdpa._core.run refuses operands that do not fit the problem."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import sdpa
from conftest import make_qkv
from sdpa import _api, _core

ARGS = ("attn_mask", "is_causal", "scale", "enable_gqa", "return_weights", "return_lse", "key_lengths",
        "out", "num_threads")


def both_paths(q, k, v, **kw):
    """(fast, general) results of one call; fast is None when the fast path declines."""
    full = {name: kw.get(name, default) for name, default in zip(
        ARGS, (None, False, None, False, False, False, None, None, None))}
    fast = _core.try_attention(q, k, v, *full.values())
    if full["out"] is not None:
        full["out"] = np.empty_like(full["out"])
    general = _api._attention_general(q, k, v, *full.values())
    return fast, general


CASES = {
    "decode": dict(batch=(1,), hq=8, L=1, S=256, E=64),
    "prefill": dict(batch=(2,), hq=3, L=37, S=41, E=16),
    "gqa": dict(batch=(2,), hq=8, hkv=2, L=5, S=19, E=8),
    "2-d": dict(batch=(), hq=None, L=6, S=7, E=5),
    "3-d": dict(batch=(), hq=3, L=6, S=7, E=5),
    "two-batch-dims": dict(batch=(2, 3), hq=2, L=4, S=9, E=8, Ev=3),
    "empty-keys": dict(batch=(2,), hq=2, L=3, S=0, E=4),
}
KWARGS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bottom-right": {"is_causal": "bottom_right"},
    "scale": {"scale": 0.3},
    "lse": {"return_lse": True},
    "threads": {"num_threads": 2},
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kwargs", KWARGS.values(), ids=KWARGS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fast_path_equals_general_path(rng, case, kwargs, dtype):
    q, k, v = make_qkv(rng, dtype=dtype, **case)
    kw = dict(kwargs)
    if case.get("hkv"):
        kw["enable_gqa"] = True
    fast, general = both_paths(q, k, v, **kw)
    assert fast is not None, "the fast path declined a call in native form"
    fast, general = (x if isinstance(x, tuple) else (x,) for x in (fast, general))
    for a, b in zip(fast, general):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_fast_path_masks_lengths_and_out(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=4, L=9, S=13, E=8, dtype=np.float32)
    bool_mask = rng.random((4, 9, 13)) < 0.7
    float_mask = rng.standard_normal((2, 1, 9, 13)).astype(np.float32)
    lengths = np.array([13, 5])
    out = np.empty((2, 9, 4, 8), np.float32).transpose(0, 2, 1, 3)
    for kw in ({"attn_mask": bool_mask}, {"attn_mask": float_mask}, {"key_lengths": lengths},
               {"out": out, "attn_mask": bool_mask, "is_causal": True}):
        fast, general = both_paths(q, k, v, **kw)
        assert fast is not None, kw
        np.testing.assert_array_equal(fast, general)
        if "out" in kw:
            assert fast is out


@pytest.mark.parametrize(
    "why, change",
    [
        ("int32 converts", lambda a: dict(q=a["q"].astype(np.int32))),
        ("mixed key and value", lambda a: dict(v=a["v"].astype(np.float16))),
        ("mixed dtypes", lambda a: dict(k=a["k"].astype(np.float64))),
        ("a list", lambda a: dict(q=a["q"].tolist())),
        ("byte-swapped", lambda a: dict(v=a["v"].astype(a["v"].dtype.newbyteorder()))),
        ("weights", lambda a: dict(return_weights=True)),
        ("numpy bool causal", lambda a: dict(is_causal=np.bool_(True))),
        ("int scale", lambda a: dict(scale=1)),
        ("float16 mask", lambda a: dict(attn_mask=np.zeros((5, 7), np.float16))),
        ("int32 lengths", lambda a: dict(key_lengths=np.array([3], np.int32))),
        ("negative lengths", lambda a: dict(key_lengths=np.array([-1]))),
        ("out overlaps q", lambda a: dict(out=a["q"])),
        ("bad shapes", lambda a: dict(k=a["k"][..., :3])),
        ("bad threads", lambda a: dict(num_threads=0)),
        ("unknown causal", lambda a: dict(is_causal="diagonal")),
    ],
)
def test_fast_path_declines_what_needs_the_general_path(rng, why, change):
    q, k, v = make_qkv(rng, batch=(1,), hq=2, L=5, S=7, E=4, dtype=np.float32)
    args = dict(q=q, k=k, v=v)
    kw = change(args)
    for name in "qkv":
        args[name] = kw.pop(name, args[name])
    full = {name: kw.get(name, default) for name, default in zip(
        ARGS, (None, False, None, False, False, False, None, None, None))}
    assert _core.try_attention(args["q"], args["k"], args["v"], *full.values()) is None, why


def test_run_refuses_operands_that_do_not_fit(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=3, S=4, E=5, dtype=np.float32)
    out = np.empty((2, 2, 3, 5), np.float32)
    _core.run(q, k, v, out, scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        _core.run(q, k[..., :3, :], v, out)  # S of key and value differ
    with pytest.raises(ValueError, match="does not fit"):
        _core.run(q, k, v, np.empty((2, 1, 3, 5), np.float32))  # an output must not broadcast
    with pytest.raises(ValueError, match="does not fit"):
        _core.run(q, k, v, out, lse=np.empty((2, 2, 4), np.float32))
    with pytest.raises(TypeError, match="dtypes"):
        _core.run(q, k.astype(np.float64), v, out)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.empty_like(out)
        ro.flags.writeable = False
        _core.run(q, k, v, ro)


def run_python(code, **env):
    import os

    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["avx9000", "neon" if sys.platform != "darwin" else "avx512"])
def test_unknown_or_unsupported_sdpa_isa_is_an_error(value):
    if value in sdpa.config()["isas_supported"]:
        pytest.skip(f"{value} is supported here")
    code = (
        "import warnings, numpy as np\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import sdpa\n"
        "print(len(w), w[0].category.__name__ if w else '')\n"
        "print(sdpa.config()['isa'])\n"
        "try:\n"
        "    sdpa.scaled_dot_product_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)))\n"
        "except ValueError as exc:\n"
        "    print('ValueError', exc)\n"
    )
    proc = run_python(code, SDPA_ISA=value)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "1 RuntimeWarning"
    assert lines[1] == "none"
    assert lines[2].startswith("ValueError") and "SDPA_ISA" in lines[2] and value in lines[2]


def test_supported_sdpa_isa_is_used():
    for name in sdpa.config()["isas_supported"]:
        proc = run_python("import sdpa; print(sdpa.config()['isa'])", SDPA_ISA=name)
        assert proc.stdout.strip() == name, proc.stderr
