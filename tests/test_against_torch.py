"""sdpa against torch.nn.functional.scaled_dot_product_attention, and torch CPU
tensors passed straight to sdpa.  Skipped when torch is not installed."""
import numpy as np
import pytest

import sdpa
from conftest import assert_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

attention = sdpa.scaled_dot_product_attention

DTYPES = {"f32": (np.float32, torch.float32), "f64": (np.float64, torch.float64)}

SHAPES = {
    # name: (batch, Hq, Hkv, L, S, E, Ev)
    "small": ((2,), 4, 4, 31, 33, 16, 16),
    "long-keys": ((1,), 8, 8, 127, 267, 64, 64),
    "single-query": ((3,), 2, 2, 1, 65, 80, 31),
    "wide-head": ((2,), 1, 1, 64, 64, 128, 128),
    "no-batch": ((), 3, 3, 9, 8, 8, 8),
    "two-batch-dims": ((2, 3), 2, 2, 7, 9, 31, 16),
    "gqa-8-2": ((2,), 8, 2, 33, 63, 32, 32),
    "gqa-4-1": ((2,), 4, 1, 65, 31, 16, 8),
}

VARIANTS = [
    "plain", "causal", "bottom-right", "bool-mask", "float-mask", "causal+bool-mask", "scale",
    "causal+float-mask+scale",
]


def make(rng, name, np_dtype):
    batch, hq, hkv, L, S, E, Ev = SHAPES[name]
    q = rng.standard_normal(batch + (hq, L, E)).astype(np_dtype)
    k = rng.standard_normal(batch + (hkv, S, E)).astype(np_dtype)
    v = rng.standard_normal(batch + (hkv, S, Ev)).astype(np_dtype)
    return q, k, v


def build_variant(rng, variant, L, S, hq, np_dtype):
    """(sdpa kwargs, torch kwargs) for one variant; torch gets one combined mask
    where it cannot take a mask and is_causal together."""
    keep = rng.random((hq, L, S)) < 0.7
    keep[..., 0] = True  # torch < 2.5 gives NaN for rows that see nothing (>= 2.5: zeros, as sdpa)
    top_left = sdpa.reference.causal_mask(L, S)
    bottom_right = sdpa.reference.causal_mask(L, S, bottom_right=True)
    fmask = np.where(keep, rng.standard_normal((hq, L, S)), -np.inf).astype(np_dtype)
    if variant == "plain":
        return {}, {}
    if variant == "causal":
        return {"is_causal": True}, {"is_causal": True}
    if variant == "bottom-right":
        if L > S:  # rows that see no key: torch < 2.5 gives NaN there, so use top-left
            return {"is_causal": "top_left"}, {"is_causal": True}
        return {"is_causal": "bottom_right"}, {"attn_mask": torch.from_numpy(bottom_right)}
    if variant == "bool-mask":
        return {"attn_mask": keep}, {"attn_mask": torch.from_numpy(keep)}
    if variant == "float-mask":
        return {"attn_mask": fmask}, {"attn_mask": torch.from_numpy(fmask)}
    if variant == "causal+bool-mask":
        both = keep & top_left
        return {"attn_mask": keep, "is_causal": True}, {"attn_mask": torch.from_numpy(both)}
    if variant == "scale":
        return {"scale": 0.37}, {"scale": 0.37}
    if variant == "causal+float-mask+scale":
        both = np.where(top_left, fmask, -np.inf).astype(np_dtype)
        return (
            {"attn_mask": fmask, "is_causal": True, "scale": -0.2},
            {"attn_mask": torch.from_numpy(both), "scale": -0.2},
        )
    raise AssertionError(variant)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_torch(rng, name, variant, dtype):
    np_dtype, torch_dtype = DTYPES[dtype]
    batch, hq, hkv, L, S, E, Ev = SHAPES[name]
    q, k, v = make(rng, name, np_dtype)
    ours_kw, torch_kw = build_variant(rng, variant, L, S, hq, np_dtype)
    gqa = hq != hkv
    ours = attention(q, k, v, enable_gqa=gqa, **ours_kw)
    with torch.no_grad():
        theirs = F.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), enable_gqa=gqa, **torch_kw
        ).numpy()
    assert theirs.dtype == ours.dtype
    # two float32 results, each within tolerance of the exact one
    assert_close(ours, theirs, np_dtype, head_dim=E, scale=2)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_weights_match_torch_softmax(rng, dtype):
    np_dtype, _ = DTYPES[dtype]
    q, k, v = make(rng, "gqa-8-2", np_dtype)
    mask = rng.random((8, 33, 63)) < 0.8
    mask[..., 0] = True
    out, weights = attention(q, k, v, mask, is_causal=True, enable_gqa=True, return_weights=True)
    tq, tk = torch.from_numpy(q), torch.from_numpy(k).repeat_interleave(4, dim=-3)
    scores = tq @ tk.transpose(-1, -2) / np.sqrt(32)
    allowed = torch.from_numpy(mask & sdpa.reference.causal_mask(33, 63))
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).numpy()
    assert_close(weights, expected, np_dtype, scale=2)


# --------------------------------------------------------------------------- tensors as inputs


@pytest.mark.parametrize("torch_dtype", [torch.float32, torch.float64, torch.float16], ids=["f32", "f64", "f16"])
def test_torch_tensors_as_inputs(torch_dtype):
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn(2, 4, 31, 16, generator=gen, dtype=torch.float64).to(torch_dtype)
    k = torch.randn(2, 4, 33, 16, generator=gen, dtype=torch.float64).to(torch_dtype)
    v = torch.randn(2, 4, 33, 8, generator=gen, dtype=torch.float64).to(torch_dtype)
    mask = torch.rand(4, 31, 33, generator=gen) < 0.7
    mask[..., 0] = True

    out = attention(q, k, v, mask, is_causal=True)
    assert isinstance(out, np.ndarray)
    assert out.dtype == q.numpy().dtype  # the query's dtype
    same = attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy(), is_causal=True)
    np.testing.assert_array_equal(out, same)

    fmask = torch.where(mask, 0.5, float("-inf")).to(torch.float64 if torch_dtype == torch.float64 else torch.float32)
    out_f, weights = attention(q, k, v, fmask, return_weights=True)
    same_f, same_w = attention(q.numpy(), k.numpy(), v.numpy(), fmask.numpy(), return_weights=True)
    np.testing.assert_array_equal(out_f, same_f)
    np.testing.assert_array_equal(weights, same_w)

    if torch_dtype != torch.float16:
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & torch.ones(31, 33, dtype=torch.bool).tril())
        np_dtype = np.float64 if torch_dtype == torch.float64 else np.float32
        assert_close(out, theirs.numpy(), np_dtype, scale=2)


def test_non_contiguous_torch_tensors():
    gen = torch.Generator().manual_seed(99)
    # (B, L, H, E) as models lay them out, viewed as (B, H, L, E)
    q = torch.randn(2, 31, 4, 16, generator=gen).transpose(1, 2)
    k = torch.randn(2, 65, 2, 16, generator=gen).transpose(1, 2)
    v = torch.randn(2, 65, 2, 24, generator=gen).transpose(1, 2)[..., :12]
    assert not q.is_contiguous() and not v.is_contiguous()
    ours = attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).numpy()
    assert ours.shape == (2, 4, 31, 12)
    assert_close(ours, theirs, np.float32, scale=2)
    np.testing.assert_array_equal(
        ours, attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True, enable_gqa=True)
    )


def test_torch_tensor_inputs_are_not_modified():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen) for _ in range(3))
    before = [t.clone() for t in (q, k, v)]
    attention(q, k, v, is_causal=True, return_weights=True)
    for t, b in zip((q, k, v), before):
        assert torch.equal(t, b)


def test_bfloat16_tensors_are_read_in_place():
    """torch's bfloat16 memory, seen as ml_dtypes' bfloat16 (NumPy has none of its own)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 9, 8, generator=gen).bfloat16()
    k = torch.randn(2, 4, 11, 8, generator=gen).bfloat16()
    out = attention(q, k, k)
    assert out.dtype == ml_dtypes.bfloat16
    as_np = [t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for t in (q, k)]
    np.testing.assert_array_equal(out.view(np.int16), attention(as_np[0], as_np[1], as_np[1]).view(np.int16))
    mixed = attention(q.float(), k, k)  # a float32 query against bfloat16 keys and values
    assert mixed.dtype == np.float32


def test_torch_tensor_is_not_an_out():
    q = torch.ones(2, 4, 8)
    with pytest.raises(TypeError, match="out"):
        attention(q, q, q, out=torch.empty(2, 4, 8))
