"""Masks on every kernel set: every layout and broadcast the tiled masking
handles (contiguous keys a block at a time, strided keys per element, rows
broadcast, heads broadcast), tiles a bool mask hides entirely (skipped), and
padding masks (turned into key limits), against the reference."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close, check_against_reference
from sdpa.testing import make_qkv

attention = sdpa.scaled_dot_product_attention
B, H, L, S, E = 2, 3, 70, 300, 16  # 70 rows: full and partial panels; 300 keys: tiles and a remainder


def layout(m, how):
    if how == "contiguous":
        return m
    if how == "keys-strided":  # the keys not contiguous: per element
        return np.ascontiguousarray(np.swapaxes(m, -1, -2)).swapaxes(-1, -2)
    if how == "reversed-rows":
        return m[..., ::-1, :].copy()[..., ::-1, :]
    raise AssertionError(how)


def make_mask(rng, shape, kind, density=0.7):
    keep = rng.random(shape) < density
    return keep if kind == "bool" else np.where(keep, rng.standard_normal(shape), -np.inf).astype(np.float32)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("how", ["contiguous", "keys-strided", "reversed-rows"])
@pytest.mark.parametrize(
    "mshape",
    [(B, H, L, S), (L, S), (B, 1, 1, S), (1, H, 1, S), (B, 1, L, S), (L, 1)],
    ids=["full", "rows-keys", "padding-like", "per-head-keys", "per-batch", "per-row"],
)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_mask_layouts_on_every_kernel_set(isa, rng, kind, how, mshape, causal):
    q, k, v = make_qkv(rng, batch=(B,), hq=H, L=L, S=S, E=E, dtype=np.float32)
    mask = layout(make_mask(rng, mshape, kind), how)
    check_against_reference(q, k, v, mask, is_causal=causal)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tiles_hidden_entirely_are_skipped_correctly(isa, rng, dtype):
    """Blocks of keys hidden from every row of a panel, with weights and lse."""
    q, k, v = make_qkv(rng, batch=(B,), hq=H, L=L, S=S, E=E, dtype=dtype)
    keep = rng.random((B, H, L, S)) < 0.8
    keep[:, :, :, 64:200] = False  # whole tiles hidden
    keep[:, :, :40, :] = False     # rows that see nothing at all
    keep[:, :, 50, 5] = True
    out, weights = check_against_reference(q, k, v, keep)
    _, lse = attention(q, k, v, keep, return_lse=True)
    assert np.all(weights[:, :, :, 64:200] == 0) and np.all(out[:, :, :40] == 0)
    assert np.all(np.isneginf(lse[:, :, :40]))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_padding_masks(isa, rng, kind):
    """A mask the same for every head and row, a prefix of keys per batch index."""
    q, k, v = make_qkv(rng, batch=(4,), hq=H, L=33, S=S, E=E, dtype=np.float32)
    lengths = np.array([S, 170, 1, 0])
    keep = np.arange(S)[None, :] < lengths[:, None]
    mask = keep[:, None, None, :]
    if kind == "float":
        mask = np.where(mask, 0.0, -np.inf).astype(np.float32)
    out, weights = check_against_reference(q, k, v, mask)
    assert np.all(out[3] == 0) and np.all(weights[:, :, :, 170:][1] == 0)
    # the same as key_lengths, bit for bit
    np.testing.assert_array_equal(out, attention(q, k, v, key_lengths=lengths))


def test_padding_mask_keys_are_never_read(rng):
    """A bool padding mask is turned into key limits: NaN past the prefix has no
    effect, also in V (where a mask alone would give 0 * NaN)."""
    q, k, v = make_qkv(rng, batch=(2,), hq=H, L=9, S=S, E=E, dtype=np.float32)
    keep = np.arange(S)[None, None, None, :] < np.array([200, 90])[:, None, None, None]
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 200:] = np.nan
    v2[1, :, 90:] = np.nan
    assert_close(attention(q, k2, v2, keep), attention(q, k, v, keep), np.float32)
    assert np.isfinite(attention(q, k2, v2, keep)).all()


def test_not_quite_padding(rng):
    """A broadcast mask with a hole is not a prefix: it stays a mask."""
    q, k, v = make_qkv(rng, batch=(2,), hq=H, L=9, S=S, E=E, dtype=np.float32)
    keep = np.arange(S)[None, None, None, :] < np.array([200, 90])[:, None, None, None]
    keep[0, 0, 0, 250] = True  # one visible key after the gap
    check_against_reference(q, k, v, keep)
