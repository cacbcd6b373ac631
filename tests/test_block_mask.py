"""Block-sparse attention: sdpa.BlockMask and scaled_dot_product_attention(block_mask=).

Every result is checked against the float64 reference written from the
definition (``sdpa.reference.scaled_dot_product_attention(block_mask=)``: a
skipped block's keys left out, a partial block's under every rule of the
call, a full block's whatever causality, the window and a bool mask say), on
every kernel set.
"""
import numpy as np
import pytest

import sdpa
from conftest import assert_close
from sdpa import _core, reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def random_map(rng, lead, L, S, bq, bk, p=(0.4, 0.3, 0.3)):
    """A BlockMask of random states (skipped, partial, full) through its lists."""
    qb, kb = -(-L // bq), -(-S // bk)
    states = rng.choice(3, size=lead + (qb, kb), p=p)
    partial = states == 1
    full = states == 2

    def lists(sel):
        counts = sel.sum(-1)
        # the listed blocks first, in a random order, then junk past the count
        order = np.argsort(~sel + rng.random(sel.shape), axis=-1, kind="stable")
        junk = rng.integers(-5, 10**6, sel.shape)
        idx = np.where(np.arange(kb) < counts[..., None], order, junk)
        return counts.astype(np.int32), idx.astype(np.int32)

    c, i = lists(partial)
    fc, fi = lists(full)
    bm = sdpa.BlockMask(c, i, full_kv_num_blocks=fc, full_kv_indices=fi, block_size=(bq, bk), seq_lengths=(L, S))
    np.testing.assert_array_equal(bm.states, states)
    return bm


def check(q, k, v, bm, dtype, **kw):
    got = sdpa.scaled_dot_product_attention(q, k, v, block_mask=bm, return_lse=True, **kw)
    want = reference.scaled_dot_product_attention(q, k, v, block_mask=bm, return_lse=True, **kw)
    assert_close(got[0], want[0], dtype, head_dim=q.shape[-1])
    lse_want = want[1]
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(lse_want))
    fin = np.isfinite(lse_want)
    np.testing.assert_allclose(got[1][fin], lse_want[fin], rtol=1e-4 if dtype != np.float64 else 1e-10, atol=1e-4)
    return got


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16, np.float16])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_random_maps_against_the_reference(isa, rng, dtype, causal):
    for L, S, bq, bk in [(200, 300, 64, 48), (129, 257, 128, 128), (37, 91, 5, 7), (1, 40, 1, 16), (300, 77, 300, 1)]:
        B, H, E = 2, 3, 32
        q, k, v = (rng.standard_normal((B, H, n, E)).astype(dtype) for n in (L, S, S))
        bm = random_map(rng, (B, H), L, S, bq, bk)
        check(q, k, v, bm, dtype, is_causal=causal)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_masks_window_and_variants(isa, rng, dtype):
    B, Hq, Hkv, L, S, E = 2, 4, 2, 150, 170, 64
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, S, E)).astype(dtype) for _ in range(2))
    bm = random_map(rng, (1, Hq), L, S, 32, 40)  # the batch dim broadcast
    bool_mask = rng.random((B, 1, L, S)) < 0.8
    float_mask = rng.standard_normal((L, S)).astype(np.float32)
    for kw in [
        dict(attn_mask=bool_mask),
        dict(attn_mask=float_mask),
        dict(window=(30, 5), is_causal=True),
        dict(window=(-1, 20)),
        dict(key_lengths=np.array([170, 90])),
        dict(softcap=5.0, alibi_slopes=np.linspace(0.1, 0.5, Hq)),
        dict(sinks=np.linspace(-1, 1, Hq)),
        dict(attn_mask=bool_mask, is_causal=True, key_lengths=np.array([100, 170])),
    ]:
        check(q, k, v, bm, dtype, enable_gqa=True, **kw)


def test_broadcast_heads_and_all_states(isa, rng):
    L, S, E = 256, 256, 64
    q, k, v = (rng.standard_normal((1, 2, n, E)).astype(np.float32) for n in (L, S, S))
    for fill in (0, 1, 2):
        bm = sdpa.BlockMask.from_states(np.full((2, 2), fill), (128, 128))
        out = check(q, k, v, bm, np.float32, is_causal=True)
        if fill == 0:  # no key for any row: zeros, lse -inf
            assert not out[0].any() and np.isneginf(out[1]).all()
    # all full with no other rule: the dense call's result
    bm = sdpa.BlockMask.from_states(np.full((1, 1, 2, 2), 2), (128, 128))
    dense = sdpa.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(sdpa.scaled_dot_product_attention(q, k, v, block_mask=bm), dense, rtol=1e-6, atol=1e-6)


def test_causal_given_as_blocks_is_is_causal(isa, rng):
    """A causal map (full below the diagonal, partial on it) with is_causal."""
    L = S = 300
    q, k, v = (rng.standard_normal((1, 2, L, 64)).astype(np.float32) for _ in range(3))
    bm = sdpa.BlockMask.from_dense(np.tril(np.ones((L, S), bool)), (64, 64))
    assert set(np.unique(bm.states)) == {0, 1, 2}
    got = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, block_mask=bm)
    want = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_thread_count_changes_no_bit(isa, rng):
    L, S = 400, 500
    q, k, v = (rng.standard_normal((2, 3, n, 64)).astype(np.float32) for n in (L, S, S))
    bm = random_map(rng, (2, 3), L, S, 64, 64)
    one = sdpa.scaled_dot_product_attention(q, k, v, block_mask=bm, is_causal=True, num_threads=1)
    for t in (2, 3):
        two = sdpa.scaled_dot_product_attention(q, k, v, block_mask=bm, is_causal=True, num_threads=t)
        np.testing.assert_array_equal(one, two)


def test_from_dense_and_lists_agree():
    m = np.zeros((100, 90), bool)
    m[:40, :30] = True  # full block (0, 0) of 40 x 30
    m[50, 70] = True  # partial
    bm = sdpa.BlockMask.from_dense(m, (40, 30))
    np.testing.assert_array_equal(bm.states, [[2, 0, 0], [0, 0, 1], [0, 0, 0]])
    assert bm.shape == (3, 3) and 0 < bm.sparsity() < 1 and "BlockMask" in repr(bm)


def test_entries_past_a_count_are_never_read():
    idx = np.array([[0, 999], [1, -7]])
    bm = sdpa.BlockMask(np.array([1, 1]), idx, block_size=(4, 4))
    np.testing.assert_array_equal(bm.states, [[1, 0], [0, 1]])


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(kv_num_blocks=[1, 1], kv_indices=[[0, 1], [2, 0]]), "kv_indices"),  # block 2 of 2
        (dict(kv_num_blocks=[3, 1], kv_indices=[[0, 1], [1, 0]]), "kv_num_blocks"),  # past the width
        (dict(kv_num_blocks=[-1, 1], kv_indices=[[0, 1], [1, 0]]), "kv_num_blocks"),
        (dict(kv_num_blocks=[1, 1, 1], kv_indices=[[0, 1], [1, 0]]), "kv_num_blocks"),  # a wrong shape
        (dict(kv_num_blocks=[2, 1], kv_indices=[[1, 1], [1, 0]]), "kv_indices"),  # listed twice
        (dict(kv_num_blocks=[1, 1], kv_indices=[[0, 1], [1, 0]], full_kv_num_blocks=[1, 0],
              full_kv_indices=[[0, 1], [0, 0]]), "full_kv_indices"),  # partial and full
        (dict(kv_num_blocks=[1, 1], kv_indices=[[0, 1], [1, 0]], full_kv_num_blocks=[1, 0]), "full_kv_indices"),
        (dict(kv_num_blocks=[1, 1], kv_indices=[[0, 1], [1, 0]], block_size=0), "block_size"),
        (dict(kv_num_blocks=[1, 1], kv_indices=[[0, 1], [1, 0]], block_size=(4, 4), seq_lengths=(12, 8)),
         "kv_indices"),  # 3 query blocks, not 2
    ],
)
def test_bad_lists_are_refused_naming_the_argument(kw, name):
    kw = {n: np.asarray(x) if isinstance(x, list) else x for n, x in kw.items()}
    with pytest.raises(ValueError, match=name):
        sdpa.BlockMask(**kw)
    with pytest.raises(TypeError, match="kv_indices"):
        sdpa.BlockMask(np.array([1]), np.array([[0.5]]))


def test_bad_calls_are_refused_and_write_nothing(rng):
    q, k, v = (rng.standard_normal((1, 2, 64, 16)).astype(np.float32) for _ in range(3))
    out = np.full((1, 2, 64, 16), 7.0, np.float32)
    for bm, err in [
        (sdpa.BlockMask.from_states(np.ones((2, 2), int), (16, 16)), ValueError),  # 4 x 4 blocks needed
        (sdpa.BlockMask.from_states(np.ones((3, 4, 4), int), (16, 16)), ValueError),  # 3 heads
        (sdpa.BlockMask.from_states(np.ones((4, 4), int), (16, 16), seq_lengths=(64, 60)), ValueError),
        (np.ones((4, 4), np.int8), TypeError),
    ]:
        with pytest.raises(err, match="block_mask"):
            sdpa.scaled_dot_product_attention(q, k, v, block_mask=bm, out=out)
        assert (out == 7.0).all()
    with pytest.raises(ValueError, match="block_mask"):
        sdpa.scaled_dot_product_attention(
            q, k, v, block_mask=sdpa.BlockMask.from_states(np.ones((4, 4), int), (16, 16)), return_weights=True
        )
    with pytest.raises(ValueError, match="states"):
        sdpa.BlockMask.from_states(np.full((4, 4), 3), (16, 16))


def test_the_core_refuses_a_bad_state(rng):
    """A state the Python side would not make, through the prepared call: the
    core's own check, nothing written."""
    q, k, v = (rng.standard_normal((1, 1, 32, 16)).astype(np.float32) for _ in range(3))
    call = _core.plain().prepared(False, None, False, None, None, None, False, False)
    out = np.full((1, 1, 32, 16), 7.0, np.float32)
    states = np.array([[1, 5], [2, 0]], np.int8)
    with pytest.raises(ValueError, match="block_states"):
        call.run(q, k, v, None, None, None, None, out, (states, 16, 16))
    assert (out == 7.0).all()
