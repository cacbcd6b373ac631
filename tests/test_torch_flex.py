"""sdpa.torch.flex_attention against torch's own flex_attention on CPU."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
import sdpa.torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def torch_flex(q, k, v, bm, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(q, k, v, block_mask=bm, **kw)


def doc_causal(L, docs):
    ids = torch.arange(L) * docs // L
    return lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)


def sliding(w):
    return lambda b, h, q, kv: (q - kv).abs() <= w


@pytest.mark.parametrize("name, mask_mod, B, H", [
    ("doc-causal", doc_causal(384, 3), None, None),
    ("sliding", sliding(50), None, None),
    ("per-head", lambda b, h, q, kv: (q + h * 7) % 5 != kv % 3, None, 2),
    ("per-batch", lambda b, h, q, kv: (kv <= q + 64 * b), 2, None),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_flex_attention(isa, name, mask_mod, B, H, dtype):
    L = 384
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, L, 64, generator=g).to(dtype) for _ in range(3))
    bm = flex.create_block_mask(mask_mod, B, H, L, L, device="cpu", BLOCK_SIZE=64)
    out, lse = sdpa.torch.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    ref, ref_lse = torch_flex(q.float(), k.float(), v.float(), bm, return_lse=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)
    assert out.dtype == dtype and lse.dtype == torch.float32


def test_gqa_scale_and_no_block_mask(isa):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 100, 32, generator=g)
    k, v = (torch.randn(1, 2, 130, 32, generator=g) for _ in range(2))
    bm = flex.create_block_mask(lambda b, h, qi, kv: kv <= qi + 30, None, None, 100, 130, device="cpu",
                                BLOCK_SIZE=32)
    got = sdpa.torch.flex_attention(q, k, v, block_mask=bm, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, torch_flex(q, k, v, bm, scale=0.3, enable_gqa=True), rtol=1e-5, atol=1e-5)
    got = sdpa.torch.flex_attention(q, k, v, bm, enable_gqa=True)  # the map in sdpa's fourth place
    torch.testing.assert_close(got, torch_flex(q, k, v, bm, enable_gqa=True), rtol=1e-5, atol=1e-5)
    plain = sdpa.torch.flex_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(plain, torch_flex(q, k, v, None, enable_gqa=True), rtol=1e-5, atol=1e-5)


def test_the_mask_is_evaluated_once():
    calls = []

    def mask_mod(b, h, q, kv):
        calls.append(1)
        return q >= kv

    bm = flex.create_block_mask(mask_mod, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    q = torch.randn(1, 1, 128, 16)
    sdpa.torch.flex_attention(q, q, q, block_mask=bm)
    n = len(calls)
    sdpa.torch.flex_attention(q, q, q, block_mask=bm)
    assert len(calls) == n


def test_a_causal_document_mask_goes_with_is_causal_alone():
    """Where the mask is the causal one in every partial block (a causal
    document mask), is_causal alone masks them: no mask is kept."""
    L = 256
    doc = flex.create_block_mask(doc_causal(L, 2), None, None, L, L, device="cpu", BLOCK_SIZE=32)
    bm, mask, causal = sdpa.torch._flex_map(doc, L, L)
    assert causal and mask is None
    shifted = flex.create_block_mask(lambda b, h, q, kv: q >= kv + 1, None, None, L, L, device="cpu",
                                     BLOCK_SIZE=32)
    bm, mask, causal = sdpa.torch._flex_map(shifted, L, L)
    assert causal and mask is not None  # hides the diagonal too: kept
    q = torch.randn(1, 1, L, 16)
    torch.testing.assert_close(sdpa.torch.flex_attention(q, q, q, block_mask=shifted),
                               torch_flex(q, q, q, shifted), rtol=1e-5, atol=1e-5)


def test_score_mod_is_refused_naming_it():
    q = torch.randn(1, 1, 64, 16)
    with pytest.raises(TypeError, match="score_mod"):
        sdpa.torch.flex_attention(q, q, q, score_mod=lambda s, b, h, qi, kv: s)
    with pytest.raises(TypeError, match="score_mod"):
        sdpa.torch.flex_attention(q, q, q, lambda s, b, h, qi, kv: s)  # torch's positional place
    bm = flex.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="block_mask"):
        sdpa.torch.flex_attention(q[:, :, :32], q, q, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask"):
        sdpa.torch.flex_attention(q, q, q, block_mask=np.ones((2, 2)))
