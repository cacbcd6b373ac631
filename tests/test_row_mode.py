"""The row path: few query rows per key/value head (decoding), keys processed in
chunks of 1024 and merged.  Checked against the float64 reference with one
explicit mask (outputs, weights and log-sum-exp), for every kernel set, with
key lengths inside, at and past the chunk boundaries, and bitwise across
thread counts."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import check_against_mask, seed_for
from sdpa.reference import causal_mask, key_length_mask
from sdpa.testing import make_qkv

attention = sdpa.scaled_dot_product_attention

DTYPES = [np.float32, np.float64]


DECODE_SHAPES = {
    # name: (B, Hq, Hkv, L, S, E)
    "gqa-8-2": (2, 8, 2, 1, 3000, 64),
    "mha-4": (1, 4, 4, 1, 5000, 32),
    "gqa-4-1-two-rows": (2, 4, 1, 2, 2100, 16),
    "gqa-8-1-one-row": (1, 8, 1, 1, 1025, 48),
    "gqa-4-1-three-rows": (1, 4, 1, 3, 2049, 16),
}


def decode_problem(name, dtype):
    B, hq, hkv, L, S, E = DECODE_SHAPES[name]
    rng = np.random.default_rng(seed_for(f"decode-{name}-{np.dtype(dtype).name}"))
    q, k, v = make_qkv(rng, batch=(B,), hq=hq, hkv=hkv, L=L, S=S, E=E, dtype=dtype)
    kl = np.minimum(np.array([S - 1, S // 2 + 3])[:B], S)
    return q, k, v, kl, hq != hkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_decode_bitwise_identical_for_any_thread_count(dtype, name):
    q, k, v, kl, gqa = decode_problem(name, dtype)
    for kwargs in ({}, {"is_causal": "bottom_right", "key_lengths": kl}):
        results = [
            attention(q, k, v, enable_gqa=gqa, return_lse=True, num_threads=n, **kwargs)
            for n in (1, 2, 3)
        ]
        for out, lse in results[1:]:
            np.testing.assert_array_equal(out, results[0][0])
            np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_long_decode_against_reference(isa, dtype, name):
    q, k, v, kl, gqa = decode_problem(name, dtype)
    B, hq, _, L, S, _ = DECODE_SHAPES[name]
    allowed = np.broadcast_to(key_length_mask(kl, S), (B, hq, L, S)) & causal_mask(L, S, bottom_right=True)
    check_against_mask(q, k, v, {"is_causal": "bottom_right", "key_lengths": kl}, allowed, gqa=gqa, threads=2)
    check_against_mask(q, k, v, {}, None, gqa=gqa, threads=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,hq,hkv", [(1, 8, 2), (2, 4, 1), (4, 2, 2), (8, 1, 1), (3, 2, 1)])
def test_row_mode_masks_and_top_left(isa, rng, dtype, L, hq, hkv):
    """Few query rows per kv head, with masks and top-left causality (where rows
    past the keys see nothing)."""
    S = 1100
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=24, Ev=20, dtype=dtype)
    gqa = hq != hkv
    keep = rng.random((2, hq, L, S)) < 0.5
    keep[0, 0, 0] = False
    check_against_mask(q, k, v, {"attn_mask": keep}, keep, gqa=gqa)
    additive = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(dtype)
    check_against_mask(q, k, v, {"attn_mask": additive}, None, additive=additive, gqa=gqa)
    tl = causal_mask(L, S)
    lengths = np.array([0, 700])
    allowed = tl & key_length_mask(lengths, S)
    check_against_mask(q, k, v, {"is_causal": True, "key_lengths": lengths}, allowed, gqa=gqa)
    # fewer keys than rows: the first rows of a bottom-right alignment see nothing
    qs, ks, vs = q, k[:, :, : max(L - 2, 1)], v[:, :, : max(L - 2, 1)]
    Ss = ks.shape[-2]
    tril = causal_mask(L, Ss, bottom_right=True)
    check_against_mask(qs, ks, vs, {"is_causal": "bottom_right"}, tril, gqa=gqa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,hq,hkv", [(1, 8, 2), (2, 4, 1), (1, 4, 4), (3, 4, 1), (16, 2, 2)])
def test_key_lengths_long_keys(rng, dtype, L, hq, hkv):
    """Lengths inside, at and past the 1024-key chunks of row mode."""
    S = 2500
    batch = (5,)
    kl = np.array([0, 1, 1024, 2049, 2500])
    q, k, v = make_qkv(rng, batch=batch, hq=hq, hkv=hkv, L=L, S=S, E=32, dtype=dtype)
    allowed = np.broadcast_to(key_length_mask(kl, S), batch + (hq, L, S))
    allowed = allowed & causal_mask(L, S, bottom_right=True)
    check_against_mask(q, k, v, {"key_lengths": kl, "is_causal": "bottom_right"}, allowed, gqa=hq != hkv)


@pytest.mark.parametrize("E", [16, 37, 128])
def test_contiguous_rows_take_the_same_arithmetic_as_strided_ones(isa, rng, E):
    """A contiguous query row is scaled, and a finished row divided, by the kernel
    set's vector copies; strided ones by the driver's loops: the same bits."""
    q, k, v = make_qkv(rng, batch=(2,), hq=8, hkv=2, L=3, S=40, E=E, dtype=np.float32)
    for chunks in (False, True):
        kk, vv = (np.concatenate([a] * 40, axis=-2) if chunks else a for a in (k, v))  # 1600 keys: 2 chunks
        contiguous = attention(q, kk, vv, is_causal="bottom_right", enable_gqa=True)
        q_strided = np.asfortranarray(q)  # the same values, column stride != 1
        out_strided = np.empty(q.shape[:-1] + (2 * E,), np.float32)[..., ::2]
        strided = attention(q_strided, kk, vv, is_causal="bottom_right", enable_gqa=True, out=out_strided)
        np.testing.assert_array_equal(contiguous.view(np.uint32), strided.view(np.uint32))
