"""The NaN contract: which non-finite inputs can reach which outputs.

What is promised (and checked below for every kernel set, float32 and float64,
in both the tiled path and the row path used for decoding):

1. NaN in a query row makes that output row, its weights and its log-sum-exp
   NaN, and changes nothing else (every other value is bitwise the same).
2. NaN in the K row of a key that a query row does not see -- masked by a bool
   ``attn_mask``, by causality, or at/past ``key_lengths`` -- has no effect on
   that row.  An additive mask does not hide a key this way: ``NaN + -inf`` is
   NaN, exactly as in the reference and in torch; use a bool mask (or
   ``key_lengths``) to exclude keys whose contents may be non-finite.
3. Keys at or past ``key_lengths`` are never read: NaN anywhere in their K and V
   rows (or in their ``attn_mask`` entries) has no effect, for prefill and
   decode shapes alike.
4. Keys that no query row can see under causality (top-left, ``s >= L``) are
   never read either.
5. A V row of a key masked by ``attn_mask`` is still multiplied by its zero
   weight, so NaN in it makes that column NaN for every row of the head that
   sees some key (``0 * NaN``), as in the reference and in torch.
6. A query row that sees no key gives zeros (weights 0, log-sum-exp -inf), even
   when the query row itself is NaN or a V row it reads holds NaN (the dense
   reference gives ``0 * NaN`` there).
7. Causality masks whatever a float ``attn_mask`` adds at a causally masked
   key, ``+inf`` and NaN included.

Not promised: whether NaN in the V row of a key *above the causal diagonal*
of a row (but within the causal reach of a later row) reaches that row.  Keys
are processed in blocks of query rows; a row sharing a block with a row that
sees the key multiplies the NaN by a zero weight, other rows never read it.
The reference (dense ``weights @ V``) gives NaN in every row.
"""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close, seed_for
from sdpa.testing import make_qkv

attention = sdpa.scaled_dot_product_attention
reference = sdpa.reference.scaled_dot_product_attention

DTYPES = [np.float32, np.float64]

# name: (batch, hq, hkv, L, S, E, Ev).  "prefill" runs the tiled path; "decode"
# and "few-rows" have at most 8 query rows per key/value head (or L <= 16): the
# row path, with keys in chunks of 1024.
SHAPES = {
    "prefill": ((2,), 4, 2, 70, 90, 16, 12),
    "decode": ((2,), 8, 2, 1, 1100, 32, 16),
    "few-rows": ((2,), 4, 1, 2, 300, 16, 8),
}


def problem(name, dtype, tag=""):
    batch, hq, hkv, L, S, E, Ev = SHAPES[name]
    rng = np.random.default_rng(seed_for(f"nan-{name}-{np.dtype(dtype).name}-{tag}"))
    q, k, v = make_qkv(rng, batch=batch, hq=hq, hkv=hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype)
    return rng, q, k, v, hq != hkv


def run(q, k, v, **kwargs):
    """out, weights, lse of one call."""
    return attention(q, k, v, return_weights=True, return_lse=True, **kwargs)


def assert_same_except(got, base, poisoned):
    """Where ``poisoned`` is False, ``got`` is bitwise ``base``."""
    poisoned = np.broadcast_to(poisoned, got.shape)
    np.testing.assert_array_equal(got[~poisoned], base[~poisoned])


# --------------------------------------------------------------------------- 1. query rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("masking", ["none", "bottom_right", "bool"])
def test_nan_query_row_poisons_only_its_row(isa, dtype, name, masking):
    rng, q, k, v, gqa = problem(name, dtype)
    kwargs = {"enable_gqa": gqa}
    if masking == "bottom_right":
        kwargs["is_causal"] = "bottom_right"
    elif masking == "bool":
        keep = rng.random(q.shape[:-1] + (k.shape[-2],)) < 0.6
        keep[..., 0] = True  # every row sees at least one key
        kwargs["attn_mask"] = keep
    base_out, base_w, base_lse = run(q, k, v, **kwargs)

    b, h, l = 1, q.shape[1] - 1, q.shape[2] // 2
    q_nan = q.copy()
    q_nan[b, h, l, 3] = np.nan
    out, w, lse = run(q_nan, k, v, **kwargs)

    assert np.isnan(out[b, h, l]).all()
    assert np.isnan(lse[b, h, l])
    S = k.shape[-2]
    L = q.shape[-2]
    visible = np.arange(S) <= l + (S - L) if masking == "bottom_right" else np.ones(S, bool)
    assert np.isnan(w[b, h, l, visible]).all()
    row = np.zeros(out.shape[:-1], dtype=bool)
    row[b, h, l] = True
    assert_same_except(out, base_out, row[..., None])
    assert_same_except(w, base_w, row[..., None])
    assert_same_except(lse, base_lse, row)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_nan_query_row_that_sees_no_key_gives_zeros(isa, dtype, name):
    rng, q, k, v, gqa = problem(name, dtype)
    q = q.copy()
    q[0, 0, 0, :] = np.nan
    keep = np.ones(q.shape[:-1] + (k.shape[-2],), dtype=bool)
    keep[0, 0, 0] = False
    out, w, lse = run(q, k, v, attn_mask=keep, enable_gqa=gqa)
    assert (out[0, 0, 0] == 0).all()
    assert (w[0, 0, 0] == 0).all()
    assert lse[0, 0, 0] == -np.inf
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_query_rows_outside_the_causal_reach_give_zeros(isa, dtype):
    # bottom-right with more query rows than keys: rows l < L - S see nothing
    rng = np.random.default_rng(seed_for(f"nan-blind-{np.dtype(dtype).name}"))
    for L, S in ((70, 20), (5, 2)):
        q, k, v = make_qkv(rng, batch=(2,), hq=2, L=L, S=S, E=8, dtype=dtype)
        q[:, :, : L - S] = np.nan
        out = attention(q, k, v, is_causal="bottom_right")
        assert (out[:, :, : L - S] == 0).all()
        assert np.isfinite(out[:, :, L - S :]).all()


# --------------------------------------------------------------------------- 2. keys not seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("hidden_by", ["bool", "causal", "key_lengths"])
def test_nan_key_has_no_effect_on_rows_that_do_not_see_it(isa, dtype, name, hidden_by):
    rng, q, k, v, gqa = problem(name, dtype)
    batch, hq, _, L, S = q.shape[0], q.shape[1], None, q.shape[2], k.shape[2]
    j = min(S - 1, 40)  # the poisoned key
    kwargs = {"enable_gqa": gqa}
    sees = np.ones((batch, hq, L), dtype=bool)  # which rows see key j
    if hidden_by == "bool":
        keep = rng.random((batch, hq, L, S)) < 0.8
        keep[..., 0] = True
        keep[..., j] = rng.random((batch, hq, L)) < 0.5
        sees = keep[..., j]
        kwargs["attn_mask"] = keep
    elif hidden_by == "causal":  # top-left: row l sees key j when j <= l
        kwargs["is_causal"] = True
        j = min(L - 1, 40) if L > 1 else 1
        sees = np.broadcast_to(np.arange(L) >= j, (batch, hq, L))
    else:  # the first batch entry stops right before key j
        kwargs["key_lengths"] = np.array([j, S])
        sees = np.zeros((batch, hq, L), dtype=bool)
        sees[1] = True
    base_out, base_w, base_lse = run(q, k, v, **kwargs)

    k_nan = k.copy()
    k_nan[:, :, j, :] = np.nan
    out, w, lse = run(q, k_nan, v, **kwargs)

    assert np.isnan(out[sees]).all()
    assert np.isnan(lse[sees]).all()
    assert_same_except(out, base_out, sees[..., None])
    assert_same_except(w, base_w, sees[..., None])
    assert_same_except(lse, base_lse, sees)
    assert (~sees).any(), "the case should hide the key from some rows"
    if hidden_by != "causal" or q.shape[2] > 1:
        assert sees.any(), "the case should show the key to some rows"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_additive_minus_inf_does_not_hide_a_nan_key(isa, dtype, name):
    """-inf + NaN is NaN: an additive mask cannot exclude a non-finite key.  Same
    NaN pattern as the reference (and torch)."""
    rng, q, k, v, gqa = problem(name, dtype)
    S = k.shape[-2]
    j = min(S - 1, 40)
    k = k.copy()
    k[:, :, j, :] = np.nan
    mask = np.zeros((S,), dtype=dtype)
    mask[j] = -np.inf
    out = attention(q, k, v, mask, enable_gqa=gqa)
    expected = reference(q, k, v, mask, enable_gqa=gqa)
    assert np.isnan(expected).all()
    assert np.isnan(out).all()


# --------------------------------------------------------------------------- 3. key lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        # (hq, hkv, L, S, lengths)
        (4, 2, 200, 300, (0, 1, 137, 299)),  # prefill: tiled path
        (8, 2, 1, 5000, (0, 1, 1024, 2500, 4999)),  # decode: row path, 1024-key chunks
        (2, 2, 3, 5000, (1023, 1025, 2049)),
    ],
    ids=["prefill-L200", "decode-L1-S5000", "rows-L3-S5000"],
)
@pytest.mark.parametrize("variant", ["plain", "bottom_right", "bool", "float"])
def test_keys_past_key_lengths_are_never_read(isa, dtype, shape, variant):
    hq, hkv, L, S, lengths = shape
    rng = np.random.default_rng(seed_for(f"tail-{hq}-{L}-{S}-{variant}-{np.dtype(dtype).name}"))
    B = len(lengths)
    q, k, v = make_qkv(rng, batch=(B,), hq=hq, hkv=hkv, L=L, S=S, E=16, Ev=8, dtype=dtype)
    mask = None
    if variant == "bool":
        mask = rng.random((B, hq, L, S)) < 0.7
    elif variant == "float":
        mask = np.where(rng.random((B, hq, L, S)) < 0.7, rng.standard_normal((B, hq, L, S)), -np.inf)
        mask = mask.astype(dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
        if mask is not None and mask.dtype != bool:
            mask[b, ..., n:] = np.nan
    tail = np.arange(S) >= np.array(lengths)[:, None]  # (B, S)
    kwargs = dict(attn_mask=mask, enable_gqa=hq != hkv, key_lengths=np.array(lengths))
    if variant == "bottom_right":
        kwargs["is_causal"] = "bottom_right"
    out, weights, lse = run(q, k, v, **kwargs)

    assert np.isfinite(out).all()
    assert np.isfinite(weights).all()
    assert not np.isnan(lse).any()
    assert (weights[np.broadcast_to(tail[:, None, None, :], weights.shape)] == 0).all()
    # the reference reads nothing past the lengths either (tests/test_reference.py)
    exp_out, exp_w = reference(q, k, v, return_weights=True, **kwargs)
    assert_close(out, exp_out, dtype)
    assert_close(weights, exp_w, dtype)


# --------------------------------------------------------------------------- 4. causal reach


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [70, 3, 1])
def test_keys_beyond_every_rows_causal_reach_are_never_read(isa, dtype, L):
    rng = np.random.default_rng(seed_for(f"reach-{L}-{np.dtype(dtype).name}"))
    S = 1500
    q, k, v = make_qkv(rng, batch=(2,), hq=4, hkv=2, L=L, S=S, E=16, Ev=8, dtype=dtype)
    k[:, :, L:] = np.nan  # top-left: row l sees keys 0..l, so no row sees s >= L
    v[:, :, L:] = np.nan
    out, weights, _ = run(q, k, v, is_causal=True, enable_gqa=True)
    assert np.isfinite(out).all()
    assert (weights[..., L:] == 0).all()
    expected = reference(q, k[:, :, :L], v[:, :, :L], is_causal=True, enable_gqa=True)
    assert_close(out, expected, dtype)


# --------------------------------------------------------------------------- 5. masked V rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_nan_value_row_of_a_masked_key_is_multiplied_by_zero(isa, dtype, name, mask_kind):
    rng, q, k, v, gqa = problem(name, dtype)
    batch, hq, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    j, c = min(S - 1, 40), 2
    keep = np.ones((batch, hq, L, S), dtype=bool)
    keep[..., j] = False  # no row sees key j
    mask = keep if mask_kind == "bool" else np.where(keep, 0.0, -np.inf).astype(dtype)
    base = attention(q, k, v, mask, enable_gqa=gqa)
    v_nan = v.copy()
    v_nan[0, 0, j, c] = np.nan  # batch 0, key/value head 0
    out = attention(q, k, v_nan, mask, enable_gqa=gqa)
    expected = reference(q, k, v_nan, mask, enable_gqa=gqa)

    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    group = hq // k.shape[1] if gqa else 1
    poisoned = np.zeros(out.shape, dtype=bool)
    poisoned[0, :group, :, c] = True  # every query head using key/value head 0
    assert np.isnan(out[poisoned]).all()
    assert_same_except(out, base, poisoned)


# --------------------------------------------------------------------------- 6. rows that see no key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 8, 9, 17, 40], ids=lambda L: f"L{L}")
def test_row_that_sees_no_key_gives_zeros_even_next_to_nan_values(isa, dtype, L):
    """Zeros, not 0 * NaN, in the row path (at most 8 query rows per key/value
    head, or L <= 16) and the tiled path (L 17 and 40) alike -- unlike the dense
    reference."""
    rng = np.random.default_rng(seed_for(f"blind-row-{L}-{np.dtype(dtype).name}"))
    S = 20
    q = rng.standard_normal((1, L, 8)).astype(dtype)
    k = rng.standard_normal((1, S, 8)).astype(dtype)
    v = rng.standard_normal((1, S, 4)).astype(dtype)
    v[0, 5, 1] = np.nan
    keep = np.ones((L, S), dtype=bool)
    keep[0] = False  # row 0 sees no key
    for mask in (keep, np.where(keep, 0.0, -np.inf).astype(dtype)):
        out, w, lse = run(q, k, v, attn_mask=mask)
        assert (out[0, 0] == 0).all()
        assert (w[0, 0] == 0).all() and lse[0, 0] == -np.inf
        assert np.isnan(out[0, 1:, 1]).all()  # the rows that see keys multiply it
    # the same when causality leaves the first rows no key (bottom-right, S < L)
    if L > 1:
        Sc = L // 2
        vc = v[:, :Sc].copy()
        vc[0, 0, 1] = np.nan  # key 0: seen by every row that sees a key
        out = attention(q, k[:, :Sc], vc, is_causal="bottom_right")
        assert (out[0, : L - Sc] == 0).all()  # rows l < L - S see no key
        assert np.isnan(out[0, L - Sc :, 1]).all()


# --------------------------------------------------------------------------- float masks and causality


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [40, 3], ids=["tiled", "rows"])
@pytest.mark.parametrize("value", [np.inf, np.nan, -np.inf, 1e4])
def test_float_mask_values_at_causally_masked_keys_have_no_effect(isa, dtype, L, value):
    """Causality masks whatever an additive mask put there, +inf and NaN included."""
    rng = np.random.default_rng(seed_for(f"causal-float-mask-{L}-{np.dtype(dtype).name}"))
    S = 40
    q, k, v = make_qkv(rng, hq=2, L=L, S=S, E=16, dtype=dtype)
    mask = rng.standard_normal((L, S)).astype(dtype)
    hidden = ~sdpa.reference.causal_mask(L, S)  # top-left: row l sees keys 0..l
    base_out, base_w, base_lse = run(q, k, v, attn_mask=mask, is_causal=True)
    mask[hidden] = value
    out, w, lse = run(q, k, v, attn_mask=mask, is_causal=True)
    np.testing.assert_array_equal(out, base_out)
    np.testing.assert_array_equal(w, base_w)
    np.testing.assert_array_equal(lse, base_lse)
    assert_close(out, reference(q, k, v, mask, is_causal=True), dtype)
