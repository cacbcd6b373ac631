"""Randomized differential testing against the float64 reference.

Hypothesis draws whole calls (``sdpa.testing.attention_calls``): sizes including
0 (L, S, E, Ev, heads, batch), grouped-query and broadcast heads, 2-D problems,
batch dims that broadcast, bool and float masks of any broadcastable shape, every
causal mode, key lengths, dtypes (float32, float64, float16, non-native byte
order, integers, bool, mixed), memory layouts (transposed, reversed, strided,
zero-stride broadcast views, unaligned, read-only, a strided ``out=``), thread
counts, the model variants (sliding windows, softcaps, ALiBi slopes and
attention sinks), the weights and the log-sum-exp, and special values written
into the inputs, masks, slopes and sinks: NaN, +-inf, subnormals, signed zeros
and magnitudes large enough for the scores to overflow.

Each result is compared with ``sdpa.reference`` (float64) row by row by
``sdpa.testing.assert_matches_reference``, whose docstring says how: what each
query row can see, which rows the result dtype cannot be compared on, the NaN
rules (see also tests/test_nan_contract.py), and a tolerance that follows the
conditioning of the row.

Run longer with ``HYPOTHESIS_PROFILE=dev`` (see tests/conftest.py and
fuzz/README.md).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, strategies as st

import sdpa
from sdpa.testing import assert_matches_reference, attention_calls, describe_call

attention = sdpa.scaled_dot_product_attention


def snapshot(*arrays):
    return [None if a is None else np.array(a, copy=True) for a in arrays]


@pytest.mark.parametrize("specials", [False, True], ids=["finite", "specials"])
@pytest.mark.parametrize("regime", ["small", "decode", "tiled"])
@given(data=st.data())
def test_matches_reference(data, regime, specials):
    p = data.draw(attention_calls(regime, specials))
    note(describe_call(p))
    inputs = (p["q"], p["k"], p["v"], p["mask"], p["key_lengths"], p["alibi_slopes"], p["sinks"])
    before = snapshot(*inputs)
    variants = {name: p[name] for name in ("window", "softcap", "alibi_slopes", "sinks")}
    kwargs = dict(
        attn_mask=p["mask"], is_causal=p["causal"], scale=p["scale"], enable_gqa=p["gqa"],
        key_lengths=p["key_lengths"], return_weights=p["return_weights"], return_lse=p["return_lse"],
        out=p["out"], num_threads=p["num_threads"], **variants,
    )
    with np.errstate(all="ignore"):
        result = attention(p["q"], p["k"], p["v"], **kwargs)
    parts = list(result) if isinstance(result, tuple) else [result]
    out = parts.pop(0)
    weights = parts.pop(0) if p["return_weights"] else None
    lse = parts.pop(0) if p["return_lse"] else None
    assert not parts
    assert out.shape == p["out_shape"] and out.dtype == p["cdtype"]
    if p["out"] is not None:
        assert out is p["out"]
    cd = np.float64 if p["cdtype"] == np.float64 else np.float32
    if weights is not None:
        assert weights.shape == p["out_shape"][:-1] + (p["S"],) and weights.dtype == cd
    if lse is not None:
        assert lse.shape == p["out_shape"][:-1] and lse.dtype == cd

    # nothing written to the inputs
    for a, b in zip(inputs, before):
        if a is not None:
            assert np.array_equal(a, b, equal_nan=True)

    # the same bits for another thread count
    other = 3 if p["num_threads"] != 3 else 1
    with np.errstate(all="ignore"):
        again = attention(p["q"], p["k"], p["v"], **{**kwargs, "out": None, "num_threads": other})
    again = again if isinstance(again, tuple) else (again,)
    for a, b in zip(again, [x for x in (out, weights, lse) if x is not None]):
        assert np.array_equal(a, b, equal_nan=True)

    assert_matches_reference(
        out, weights, p["q"], p["k"], p["v"], p["mask"], p["causal"], p["scale"], p["gqa"], p["key_lengths"],
        lse=lse, **variants,
    )


@pytest.mark.parametrize("shape", [(2, 0), (3, 2, 0), (2, 0, 4)])
def test_empty_out_is_accepted(shape):
    """NumPy gives arrays without elements zero strides: no overlap for all that."""
    *lead, L, Ev = shape
    q = np.ones(tuple(lead) + (L, 4), np.float32)
    k = np.ones(tuple(lead) + (5, 4), np.float32)
    v = np.ones(tuple(lead) + (5, Ev), np.float32)
    out = np.empty(shape, np.float32)
    assert attention(q, k, v, out=out) is out


def test_fuzz_harness_smoke():
    """fuzz/fuzz_attention.py decodes random bytes and checks each call; a few
    hundred inputs here keep it working without atheris."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_attention.py"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    spec = importlib.util.spec_from_file_location("fuzz_attention", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    rng = np.random.default_rng(20241129)
    for _ in range(300):
        data = rng.integers(0, 256, size=int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
        try:
            harness.TestOneInput(data)
        except BaseException as exc:
            raise AssertionError(f"fuzz input {data.hex()} failed: {exc!r}") from exc
