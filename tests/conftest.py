"""Shared fixtures and helpers for the sdpa test suite.

Tolerances used when comparing against the float64 NumPy reference
(``sdpa.reference``), elementwise ``|actual - expected| <= atol + rtol * |expected|``:

    float32 results:  rtol = atol = 2e-5   (5e-5 when the head dim E >= 128)
    float64 results:  rtol = atol = 1e-12
    float16 results:  rtol = atol = 1e-3   (float32 arithmetic, then one rounding
                                            to float16: 2**-11 relative)
    bfloat16 results: rtol = atol = 8e-3   (the same, 2**-8 relative)

Weights and lse of 16-bit results are float32, the compute type.

Every random input comes from a NumPy Generator seeded from the test's node id
(the ``rng`` fixture), so each test sees the same data on every run; the
generators themselves (``make_qkv``, ``random_mask``, special values, Hypothesis
strategies) are in ``sdpa.testing``.  Hypothesis runs under the "ci"
profile by default (no deadline, a modest, derandomized number of examples);
set HYPOTHESIS_PROFILE=dev for a longer search.
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The generators live in sdpa.testing; tests import them from there (these names
# stay importable from conftest as well).
from sdpa.testing import compute_dtype, make_qkv, randn, result_dtype  # noqa: F401

F16_TOL = 1e-3
BF16_TOL = 8e-3
F32_TOL = 2e-5
F32_TOL_WIDE_E = 5e-5  # E >= 128: longer dot products accumulate more rounding
F64_TOL = 1e-12

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=50,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def seed_for(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A Generator seeded from the test id: deterministic, but different per test."""
    return np.random.default_rng(seed_for(request.node.nodeid))


def tolerance(dtype, head_dim=None) -> float:
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return F64_TOL
    if dtype == np.float32:
        return F32_TOL_WIDE_E if head_dim is not None and head_dim >= 128 else F32_TOL
    if dtype == np.float16:
        return F16_TOL
    if dtype.name == "bfloat16":
        return BF16_TOL
    raise AssertionError(f"no tolerance defined for {dtype}")


def assert_close(actual, expected, dtype, *, head_dim=None, scale=1.0) -> None:
    """Compare a result with the reference at the tolerance of ``dtype``.

    ``scale`` widens both tolerances (used when two low-precision results are
    compared with each other rather than with the float64 reference).
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    tol = tolerance(dtype, head_dim) * scale
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, equal_nan=False)


def cache_reference(q, cache, **kw):
    """The float64 reference over a KVCache's held keys and values as it
    computes with them (a quantized cache's dequantized copies); GQA inferred."""
    from sdpa import reference

    hq, hkv = q.shape[-3], cache.num_kv_heads
    return reference.scaled_dot_product_attention(
        np.asarray(q, np.float64), cache.keys.astype(np.float64), cache.values.astype(np.float64),
        enable_gqa=hq != hkv, **kw)


def check_against_reference(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    num_threads=None,
):
    """Run sdpa with and without weights and compare both with the reference.

    Returns ``(out, weights)`` of the call that asked for the weights.
    """
    import sdpa

    dtype = result_dtype(query, key, value)
    head_dim = np.shape(query)[-1]
    expected_out, expected_weights = sdpa.reference.scaled_dot_product_attention(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, return_weights=True
    )
    # The weights have one (L, S) matrix per output head.  When only the value has
    # heads (or batch dims) the reference's weights lack them, so broadcast.
    expected_weights = np.broadcast_to(
        expected_weights, expected_out.shape[:-1] + expected_weights.shape[-1:]
    )

    out = sdpa.scaled_dot_product_attention(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, num_threads=num_threads
    )
    assert isinstance(out, np.ndarray)
    assert out.dtype == dtype, f"result dtype {out.dtype}, expected {dtype}"
    assert_close(out, expected_out, dtype, head_dim=head_dim)

    out_w, weights = sdpa.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        return_weights=True,
        num_threads=num_threads,
    )
    assert out_w.dtype == dtype and weights.dtype == compute_dtype(dtype)
    assert_close(out_w, expected_out, dtype, head_dim=head_dim)
    assert_close(weights, expected_weights, compute_dtype(dtype), head_dim=head_dim)
    return out_w, weights


def check_against_mask(q, k, v, sdpa_kwargs, allowed, *, gqa=False, additive=None, scale=None, threads=None):
    """Run sdpa with ``sdpa_kwargs`` (causality, key lengths, a mask, ...) and
    compare it with the float64 reference given one explicit bool mask,
    ``allowed``, that spells out what those keywords mean (None: every key), plus
    an additive float mask.

    Checks the output, the weights and the log-sum-exp of one call, then the
    output of a plain call (no weights, no lse: other code paths).  Returns
    ``(out, weights, lse)``.
    """
    import sdpa

    dtype = q.dtype
    out, weights, lse = sdpa.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=gqa, return_weights=True, return_lse=True,
        num_threads=threads, **sdpa_kwargs,
    )
    mask = allowed
    if additive is not None:
        mask = np.where(allowed, additive, -np.inf) if allowed is not None else additive
    exp_out, exp_w, exp_lse = sdpa.reference.scaled_dot_product_attention(
        q, k, v, mask, scale=scale, enable_gqa=gqa, return_weights=True, return_lse=True
    )
    assert out.dtype == weights.dtype == lse.dtype == dtype
    assert lse.shape == out.shape[:-1]
    E = q.shape[-1]
    assert_close(out, exp_out, dtype, head_dim=E)
    assert_close(weights, np.broadcast_to(exp_w, weights.shape), dtype, head_dim=E)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exp_lse))
    seen = ~np.isneginf(exp_lse)
    assert_close(lse[seen], exp_lse[seen], dtype, head_dim=E)
    plain = sdpa.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=gqa, num_threads=threads, **sdpa_kwargs
    )
    assert_close(plain, exp_out, dtype, head_dim=E)
    return out, weights, lse


def under_sanitizer() -> bool:
    """Whether a sanitizer runtime is preloaded (.ci/sanitize.sh, .ci/tsan.sh): they
    reserve terabytes of address space, so address-space limits cannot be tested."""
    return any(name in os.environ.get("LD_PRELOAD", "") for name in ("asan", "tsan", "ubsan"))


def supported_isas():
    """The kernel sets this CPU can run ("scalar" always)."""
    from sdpa import _core

    return [name for name in _core.ISAS if _core.isa_supported(name)]


def fixture_isas():
    """The kernel sets the ``isa`` fixture runs: every one the CPU supports, or,
    when SDPA_ISA forces one (the sanitizer runs of CI go through each set that
    way, one run per set), that one alone."""
    sets = supported_isas()
    forced = os.environ.get("SDPA_ISA", "").strip()
    return [forced] if forced in sets else sets


@pytest.fixture(params=fixture_isas())
def isa(request):
    """Runs the test once per kernel set (:func:`fixture_isas`), restoring the
    choice in use after: the named set, or the default one (``set_isa(None)``),
    so that a later test sees "default" where it was."""
    from sdpa import _core

    named = _core.isa_named()
    _core.set_isa(request.param)
    try:
        yield request.param
    finally:
        _core.set_isa(named)
