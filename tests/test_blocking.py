"""The blocking (docs/blocking.md): the cache sizes it is chosen from, and
results under blockings forced far from the rule's (tiles of one key, tiles
that split every mask and causal block, chunks of a few keys) on every kernel
set, against the reference and bitwise across thread counts."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import check_against_reference
from sdpa import _core
from sdpa.testing import make_qkv


@pytest.fixture
def blocking():
    """Sets a blocking for the test; the rule again after."""
    try:
        yield _core.set_blocking
    finally:
        _core.set_blocking(0, 0, 0)


def test_cache_sizes_are_plausible():
    l1d, l2 = _core.cache_sizes()
    assert 8 << 10 <= l1d <= 1 << 20
    assert 128 << 10 <= l2 <= 256 << 20
    assert sdpa.config()["l1d_cache"] == l1d and sdpa.config()["l2_cache"] == l2


def test_set_blocking_rejects_out_of_range():
    with pytest.raises(ValueError, match="set_blocking"):
        _core.set_blocking(-1)
    with pytest.raises(ValueError, match="set_blocking"):
        _core.set_blocking(0, 5000)


PREFILL = [  # (tile_q, tile_k): one panel per task; tiles of 1, 7 and 33 keys; wide tiles
    (1, 1),
    (1, 7),
    (64, 33),
    (256, 16),
    (40, 200),
]


@pytest.mark.parametrize("tile_q,tile_k", PREFILL, ids=[f"q{a}-k{b}" for a, b in PREFILL])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forced_tiles_against_reference(isa, rng, blocking, dtype, tile_q, tile_k):
    blocking(tile_q, tile_k)
    q, k, v = make_qkv(rng, (2,), 4, 2, 70, 90, 24, 20, dtype)
    keep = rng.random((4, 70, 90)) < 0.6
    for mask, causal in ((None, True), (keep, False), (keep, "bottom_right")):
        out, _ = check_against_reference(q, k, v, mask, causal, None, True, num_threads=1)
        again = sdpa.scaled_dot_product_attention(q, k, v, mask, causal, None, True, num_threads=3)
        assert np.array_equal(again, out)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_query_rows_per_task_change_no_bit(rng, blocking, dtype):
    """tile_q only groups panels into tasks: any value gives the same bits."""
    q, k, v = make_qkv(rng, (3,), 2, 2, 300, 260, 32, 32, dtype)
    mask = rng.random((300, 260)) < 0.8
    runs = []
    for tile_q in (1, 64, 512, 0):
        blocking(tile_q, 48)
        runs.append(sdpa.scaled_dot_product_attention(q, k, v, mask, num_threads=2))
    assert all(np.array_equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=["mha", "gqa"])
def test_tail_panels_change_no_bit(isa, rng, dtype, heads):
    """A task's last panel runs at half or a quarter of the set's width when its
    rows fit (the tail of L; AVX-512 float: 16 or 8 rows on narrower vectors,
    and a tail of 17-24 rows as a half panel and a quarter one):
    a row gets the same bits in a short call, where it is in the tail, as in a
    longer one, where it fills a whole panel; with a mask, causality
    (top-left), softcap, GQA rows packed, the weights, and float16 rows
    widened into the panels and rounded out of them."""
    hq, hkv = heads
    q, k, v = make_qkv(rng, (1,), hq, hkv, 80, 75, 32, 24, np.float32)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    keep = rng.random((80, 75)) < 0.7
    cases = [dict(), dict(is_causal=True), dict(attn_mask=keep), dict(softcap=3.0, is_causal=True)]
    for kw in cases:
        gqa = dict(enable_gqa=hq != hkv)
        full, fw = sdpa.scaled_dot_product_attention(q, k, v, return_weights=True, **gqa, **kw)
        for L in (17, 20, 24, 33, 36, 40, 41, 48, 49, 56, 65, 70):  # the tiled path's (16 rows and fewer: the row path)
            part = dict(kw, attn_mask=keep[:L]) if "attn_mask" in kw else kw
            out, w = sdpa.scaled_dot_product_attention(q[:, :, :L], k, v, return_weights=True, **gqa, **part)
            assert np.array_equal(out, full[:, :, :L]), (kw, L)
            assert np.array_equal(w, fw[:, :, :L]), (kw, L)


@pytest.mark.parametrize("chunk,tile_k", [(1, 1), (3, 2), (100, 32), (5000, 64)])
@pytest.mark.parametrize("kv_dtype", [np.float32, "bfloat16"])
def test_forced_decode_chunks_against_reference(isa, rng, blocking, chunk, tile_k, kv_dtype):
    """Row mode (decoding), chunks of a few keys to more than the cache holds."""
    blocking(0, tile_k, chunk)
    q, k, v = make_qkv(rng, (2,), 8, 2, 1, 700, 64, 64, np.float32)
    if kv_dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        k, v = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    lengths = np.array([700, 333])
    out = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, key_lengths=lengths, num_threads=1)
    for b, n in enumerate(lengths):
        ref = sdpa.reference.scaled_dot_product_attention(
            q[b], k[b, :, :n].astype(np.float64), v[b, :, :n].astype(np.float64), enable_gqa=True
        )
        np.testing.assert_allclose(out[b], ref, rtol=3e-5, atol=3e-5)
    again = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, key_lengths=lengths, num_threads=3)
    assert np.array_equal(again, out)
