"""sdpa.MultiHeadAttention against sdpa.reference.multi_head_attention, cached
decoding with it, its constructors and errors, and the example decoder built
from it (examples/decoder.py).  The torch conversions are in test_torch.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sdpa
from sdpa.testing import randn

DTYPES = [np.float32, np.float64]


def reference_layer(layer, x, causal):
    return sdpa.reference.multi_head_attention(
        x, layer.w_q, layer.w_k, layer.w_v, layer.w_o, layer.b_q, layer.b_k, layer.b_v, layer.b_o,
        layer.num_heads, layer.num_kv_heads, causal,
    )


LAYER_HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", list(LAYER_HEADS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_against_reference(rng, dtype, heads, bias, causal):
    hq, hkv = LAYER_HEADS[heads]
    layer = sdpa.MultiHeadAttention(32, hq, hkv, bias=bias, dtype=dtype, rng=rng)
    assert layer.w_q.shape == (32, 32) and layer.w_k.shape == (32, 8 * hkv)
    assert layer.w_o.shape == (32, 32) and (layer.b_q is None) == (not bias)
    x = randn(rng, (3, 9, 32), dtype)
    y = layer(x, causal=causal)
    assert y.shape == x.shape and y.dtype == dtype
    expected = reference_layer(layer, x, causal)
    tol = 1e-12 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)
    # a 2-D input is one sequence
    y2 = layer(x[1], causal=causal)
    assert y2.shape == (9, 32)
    np.testing.assert_allclose(y2, y[1], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", list(LAYER_HEADS))
def test_layer_cached_decode_equals_full(rng, dtype, heads):
    hq, hkv = LAYER_HEADS[heads]
    layer = sdpa.MultiHeadAttention(48, hq, hkv, head_dim=16, dtype=dtype, rng=rng)
    x = randn(rng, (2, 14, 48), dtype)
    cache = layer.new_cache(batch=2, capacity=14)
    assert cache.keys.shape == (2, hkv, 0, 16) and cache.dtype == dtype
    steps = [layer(x[:, :6], cache)] + [layer(x[:, t : t + 1], cache) for t in range(6, 12)]
    steps.append(layer(x[:, 12:], cache))  # two tokens at once
    assert len(cache) == 14
    got = np.concatenate(steps, axis=1)
    expected = reference_layer(layer, x, True)
    tol = 1e-12 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    with pytest.raises(sdpa.KVCacheFullError):
        layer(x[:, :1], cache)


def test_layer_without_causality_in_the_cache(rng):
    layer = sdpa.MultiHeadAttention(16, 2, dtype=np.float64, rng=rng)
    x = randn(rng, (1, 5, 16))
    cache = layer.new_cache(1, 8)
    layer(x[:, :3], cache, causal=False)
    y = layer(x[:, 3:], cache, causal=False)  # the last two see all five keys
    expected = reference_layer(layer, x, False)[:, 3:]
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def test_layer_seeded_and_from_weights(rng):
    a = sdpa.MultiHeadAttention(16, 4, 2, rng=7)
    b = sdpa.MultiHeadAttention(16, 4, 2, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a.w_q, b.w_q)
    np.testing.assert_array_equal(a.b_o, b.b_o)
    assert not np.array_equal(a.w_q, sdpa.MultiHeadAttention(16, 4, 2, rng=8).w_q)
    c = sdpa.MultiHeadAttention.from_weights(
        a.w_q, a.w_k, a.w_v, a.w_o, a.b_q, a.b_k, a.b_v, a.b_o, num_heads=4, num_kv_heads=2
    )
    assert c.dtype == np.float32 and c.head_dim == 4
    x = randn(rng, (2, 5, 16), np.float32)
    np.testing.assert_array_equal(a(x), c(x))
    assert "num_kv_heads=2" in repr(c)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((16, 4, 3), {}, "num_kv_heads: must divide"),
        ((10, 4), {}, "embed_dim: must be a multiple"),
        ((16, 0), {}, "num_heads"),
    ],
)
def test_layer_rejects_bad_sizes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sdpa.MultiHeadAttention(*args, **kwargs)


def test_layer_rejects_bad_inputs(rng):
    layer = sdpa.MultiHeadAttention(16, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \(batch, T, 16\)"):
        layer(np.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match="x: expected"):
        layer(np.zeros((1, 2, 3, 16)))
    with pytest.raises(ValueError, match="cache: holds"):
        layer(np.zeros((2, 3, 16)), sdpa.KVCache(2, 4, 8, 4))
    with pytest.raises(ValueError, match="cache: holds"):
        layer(np.zeros((1, 3, 16)), layer.new_cache(2, 8))
    with pytest.raises(TypeError, match="cache"):
        layer(np.zeros((1, 3, 16)), cache={})
    with pytest.raises(TypeError, match=r"kv_cache_dtype: a KV cache stores .* or the quantized .*; got .float8."):
        sdpa.MultiHeadAttention(64, 8, kv_cache_dtype="float8")


# --------------------------------------------------------------------------- example


def test_example_decoder_runs():
    script = Path(__file__).parents[1] / "examples" / "decoder.py"
    if not script.exists():
        pytest.skip(f"{script} is missing")
    args = [
        "--layers", "2", "--tokens", "4", "--prompt", "6", "--embed", "32",
        "--heads", "4", "--kv-heads", "2", "--vocab", "50", "--threads", "2",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout and "OK" in proc.stdout


def test_example_decoder_low_bit_caches():
    script = Path(__file__).parents[1] / "examples" / "decoder.py"
    if not script.exists():
        pytest.skip(f"{script} is missing")
    args = [
        "--layers", "2", "--tokens", "4", "--prompt", "6", "--embed", "64", "--heads", "2", "--kv-heads", "1",
        "--vocab", "50", "--threads", "1", "--kv-cache", "float8_e4m3fn,float8_e5m2,int4,int8+iqk,int4+iqk",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("-> OK") == 5 and "[int4+iqk cache" in proc.stdout


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_layer_decodes_with_integer_qk(rng, kv):
    """The same decode as with float Q.K over the same cache dtype, to the query's rounding."""
    layer = sdpa.MultiHeadAttention(64, 4, 2, kv_cache_dtype=kv, integer_qk=True, rng=rng)
    x = rng.standard_normal((1, 9, 64)).astype(np.float32)

    def decode():
        cache = layer.new_cache(1, 16)
        return np.concatenate([layer(x[:, :5], cache)] + [layer(x[:, t:t + 1], cache) for t in range(5, 9)], axis=1)

    integer = decode()
    layer.integer_qk = False
    floating = decode()
    assert not np.array_equal(integer[:, 5:], floating[:, 5:])  # the decoding steps took the integer path
    np.testing.assert_allclose(integer, floating, atol=2e-2 * np.abs(floating).max())
    layer.integer_qk = True
    with pytest.raises(ValueError, match="integer_qk"):
        layer(x[:, :1], layer.new_cache(1, 4, dtype=np.float32))
    with pytest.raises(TypeError, match="integer_qk"):
        sdpa.MultiHeadAttention(64, 4, integer_qk="yes")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_layer_end_to_end(rng, dtype):
    """Weights, activations, attention and cache in 16 bits; the cached decode
    agrees with one pass, and both with the float64 layer on the same weights."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    layer = sdpa.MultiHeadAttention(64, 8, 2, dtype=dtype, rng=rng)
    assert layer.w_q.dtype == np.dtype(dtype)
    x = rng.standard_normal((2, 12, 64)).astype(np.float32)
    full = layer(x)
    cache = layer.new_cache(batch=2, capacity=12)
    assert cache.dtype == np.dtype(dtype)
    steps = np.concatenate([layer(x[:, :5], cache)] + [layer(x[:, t : t + 1], cache) for t in range(5, 12)], axis=1)
    assert full.dtype == steps.dtype == np.dtype(dtype)
    tol = 2e-3 if np.dtype(dtype) == np.float16 else 2e-2
    np.testing.assert_allclose(steps.astype(np.float64), full.astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_allclose(full.astype(np.float64), reference_layer(layer, x, True), rtol=tol, atol=tol)


def test_bfloat16_weights_and_sinks_make_a_bfloat16_layer():
    """from_weights keeps bfloat16 weights in bfloat16 (a float dtype, not one to
    promote to float64), and bfloat16 sinks, as checkpoints store them, are taken."""
    bf16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    w = np.eye(16, dtype=bf16)
    sinks = np.array([0.5, -1.5], dtype=bf16)
    layer = sdpa.MultiHeadAttention.from_weights(w, w, w, w, num_heads=2, window=4, sinks=sinks)
    assert layer.dtype == bf16 and layer.w_q.dtype == bf16
    assert layer.sinks.dtype == np.float32 and layer.sinks.tolist() == [0.5, -1.5]
    assert sdpa.MultiHeadAttention(16, 2, dtype=bf16, sinks=sinks).sinks.tolist() == [0.5, -1.5]
