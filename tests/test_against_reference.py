"""sdpa against the float64 NumPy reference over grids of shapes, masks, causal
modes, key lengths, layouts and dtypes.

Each case is checked twice, once without and once with ``return_weights`` (the two
take different paths through the core), and the weights are compared as well
(``check_against_reference``).  Causality and key lengths are also checked with
``check_against_mask``: outputs, weights and log-sum-exp against the reference
given one explicit mask that spells out what the keywords mean.
"""
import itertools

import numpy as np
import pytest

import sdpa
from conftest import assert_close, check_against_mask, check_against_reference
from sdpa.reference import causal_mask, key_length_mask
from sdpa.testing import compute_dtype, make_qkv, randn, random_mask, result_dtype

attention = sdpa.scaled_dot_product_attention

SIZES = (1, 7, 8, 9, 31, 33, 63, 64, 65, 127, 267)
HEAD_DIMS = (1, 8, 16, 31, 64, 80, 128, 256)
DTYPES = (np.float32, np.float64)
CAUSAL_MODES = (True, "top_left", "bottom_right")

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])


# --------------------------------------------------------------------------- shapes


@dtypes
@pytest.mark.parametrize("S", SIZES)
@pytest.mark.parametrize("L", SIZES)
def test_sequence_lengths(rng, L, S, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=L, S=S, E=16, Ev=8, dtype=dtype)
    check_against_reference(q, k, v)


@dtypes
@pytest.mark.parametrize("Ev", HEAD_DIMS)
@pytest.mark.parametrize("E", HEAD_DIMS)
def test_head_dims(rng, E, Ev, dtype):
    q, k, v = make_qkv(rng, hq=2, L=9, S=33, E=E, Ev=Ev, dtype=dtype)
    check_against_reference(q, k, v)


@dtypes
@pytest.mark.parametrize("E", HEAD_DIMS)
def test_head_dims_long_sequences(rng, E, dtype):
    q, k, v = make_qkv(rng, hq=1, L=65, S=267, E=E, Ev=E, dtype=dtype)
    check_against_reference(q, k, v)


@dtypes
@pytest.mark.parametrize("heads", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)], ids=["nobatch", "b2", "b2x3"])
def test_batch_and_heads(rng, batch, heads, dtype):
    q, k, v = make_qkv(rng, batch=batch, hq=heads, L=8, S=9, E=16, Ev=31, dtype=dtype)
    out, weights = check_against_reference(q, k, v)
    assert out.shape == batch + (heads, 8, 31)
    assert weights.shape == batch + (heads, 8, 9)


@dtypes
def test_two_dim_inputs(rng, dtype):
    q, k, v = make_qkv(rng, hq=None, L=7, S=31, E=8, Ev=5, dtype=dtype)
    out, weights = check_against_reference(q, k, v)
    assert out.shape == (7, 5)
    assert weights.shape == (7, 31)


BROADCAST_SHAPES = {
    # name: (query shape, key shape, value shape) with L=5, S=9, E=4, Ev=3
    "batch-2x1-vs-1x3": ((2, 1, 2, 5, 4), (1, 3, 2, 9, 4), (3, 2, 9, 3)),
    "query-2d": ((5, 4), (2, 3, 9, 4), (2, 3, 9, 3)),
    "query-3d-kv-5d": ((3, 5, 4), (2, 2, 3, 9, 4), (3, 9, 3)),
    "kv-2d": ((2, 3, 5, 4), (9, 4), (9, 3)),
    "value-heads-only": ((5, 4), (9, 4), (3, 9, 3)),
    "query-batch-only": ((4, 1, 5, 4), (1, 9, 4), (1, 9, 3)),
    "eight-batch-dims": ((2, 1, 1, 1, 1, 1, 1, 2, 2, 5, 4), (1, 1, 1, 1, 1, 1, 1, 2, 2, 9, 4), (2, 9, 3)),
}


@dtypes
@pytest.mark.parametrize("name", sorted(BROADCAST_SHAPES))
def test_broadcast_batch_dims(rng, name, dtype):
    qs, ks, vs = BROADCAST_SHAPES[name]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    out, weights = check_against_reference(q, k, v)
    expected_shape = np.broadcast_shapes(qs[:-2] + (1, 1), ks[:-2] + (1, 1), vs[:-2] + (1, 1))
    assert out.shape == expected_shape[:-2] + (5, 3)
    assert weights.shape == expected_shape[:-2] + (5, 9)


@dtypes
@pytest.mark.parametrize(
    "hq,hk,hv", [(1, 3, 3), (3, 1, 1), (1, 1, 3), (1, 3, 1), (3, 3, 1), (3, 1, 3)]
)
def test_broadcast_heads_without_gqa(rng, hq, hk, hv, dtype):
    q = randn(rng, (2, hq, 7, 8), dtype)
    k = randn(rng, (2, hk, 31, 8), dtype)
    v = randn(rng, (2, hv, 31, 5), dtype)
    out, _ = check_against_reference(q, k, v)
    assert out.shape == (2, 3, 7, 5)


# --------------------------------------------------------------------------- masks


def mask_shape(name, B, H, L, S):
    return {
        "LS": (L, S),
        "1S": (1, S),
        "S": (S,),
        "L1": (L, 1),
        "HLS": (H, L, S),
        "B1LS": (B, 1, L, S),
        "11LS": (1, 1, L, S),
        "full": (B, H, L, S),
        "scalar": (),
    }[name]


MASK_SHAPES = ("LS", "1S", "S", "L1", "HLS", "B1LS", "11LS", "full", "scalar")


@dtypes
@pytest.mark.parametrize("L,S", [(9, 33), (33, 9)])
@pytest.mark.parametrize("shape_name", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_shapes(rng, kind, shape_name, L, S, dtype):
    B, H = 2, 3
    q, k, v = make_qkv(rng, batch=(B,), hq=H, L=L, S=S, E=16, Ev=8, dtype=dtype)
    mask = random_mask(rng, mask_shape(shape_name, B, H, L, S), kind, dtype)
    check_against_reference(q, k, v, mask)


@dtypes
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_on_two_dim_inputs(rng, kind, dtype):
    q, k, v = make_qkv(rng, hq=None, L=9, S=31, E=8, dtype=dtype)
    check_against_reference(q, k, v, random_mask(rng, (9, 31), kind, dtype))
    check_against_reference(q, k, v, random_mask(rng, (31,), kind, dtype))


@dtypes
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_with_broadcast_batch(rng, kind, dtype):
    # batch and heads both broadcast between the inputs; the mask has the full shape
    q = randn(rng, (1, 2, 7, 8), dtype)
    k = randn(rng, (3, 1, 9, 8), dtype)
    v = randn(rng, (1, 1, 9, 4), dtype)
    mask = random_mask(rng, (3, 2, 7, 9), kind, dtype)
    out, _ = check_against_reference(q, k, v, mask)
    assert out.shape == (3, 2, 7, 4)


@dtypes
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zeros(rng, kind, dtype):
    B, H, L, S = 2, 3, 9, 31
    q, k, v = make_qkv(rng, batch=(B,), hq=H, L=L, S=S, E=16, Ev=8, dtype=dtype)
    keep = rng.random((B, H, L, S)) < 0.7
    keep[:, :, [0, 4, 8], :] = False  # whole rows, every head
    keep[1, 2, 5, :] = False  # one row of one head
    keep[:, :, 2, :] = False
    keep[:, :, 2, 17] = True  # a row that sees one key
    mask = keep if kind == "bool" else np.where(keep, 0.5, -np.inf).astype(dtype)
    out, weights = check_against_reference(q, k, v, mask)
    for rows in (np.s_[:, :, [0, 4, 8]], np.s_[1, 2, 5]):
        assert np.all(out[rows] == 0)
        assert np.all(weights[rows] == 0)
    assert np.all(np.isfinite(out))
    # the row that sees a single key copies that key's value
    assert_close(weights[:, :, 2, 17], np.ones((B, H)), dtype)
    assert_close(out[:, :, 2], v[:, :, 17], dtype)


@dtypes
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_everything_masked(rng, kind, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=7, S=9, E=8, dtype=dtype)
    mask = np.zeros((7, 9), dtype=bool) if kind == "bool" else np.full((7, 9), -np.inf, dtype)
    out, weights = sdpa.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    assert out.shape == (2, 2, 7, 8) and out.dtype == dtype
    assert np.all(out == 0) and np.all(weights == 0)
    assert np.all(sdpa.scaled_dot_product_attention(q, k, v, mask) == 0)


@dtypes
def test_bool_mask_all_true_is_no_mask(rng, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=33, E=16, dtype=dtype)
    plain = sdpa.scaled_dot_product_attention(q, k, v)
    masked = sdpa.scaled_dot_product_attention(q, k, v, np.ones((9, 33), dtype=bool))
    assert_close(masked, plain, dtype)
    zero = sdpa.scaled_dot_product_attention(q, k, v, np.zeros((9, 33), dtype=dtype))
    assert_close(zero, plain, dtype)


@dtypes
def test_large_float_mask_values(rng, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=33, E=16, dtype=dtype)
    mask = rng.choice([-1e4, -30.0, 0.0, 30.0], size=(9, 33)).astype(dtype)
    check_against_reference(q, k, v, mask)


# --------------------------------------------------------------------------- causal

CAUSAL_SIZES = (
    [(l, s) for l, s in zip(SIZES, SIZES[3:] + SIZES[:3])]  # L < S and, wrapping round, L > S
    + [(s, s) for s in (1, 8, 33, 64, 127)]
    + [(267, 9), (9, 267), (64, 65), (65, 64)]
)


@dtypes
@pytest.mark.parametrize("L,S", CAUSAL_SIZES)
@pytest.mark.parametrize("mode", CAUSAL_MODES, ids=["true", "top_left", "bottom_right"])
def test_causal(rng, mode, L, S, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=L, S=S, E=16, Ev=8, dtype=dtype)
    out, weights = check_against_reference(q, k, v, is_causal=mode)
    allowed = sdpa.reference.causal_mask(L, S, bottom_right=(mode == "bottom_right"))
    assert np.all(weights[..., ~allowed] == 0)
    blind_rows = ~allowed.any(axis=-1)  # only bottom-right with L > S has them
    assert np.all(out[..., blind_rows, :] == 0)
    assert blind_rows.any() == (mode == "bottom_right" and L > S)


@dtypes
@pytest.mark.parametrize("mode", CAUSAL_MODES, ids=["true", "top_left", "bottom_right"])
def test_causal_equals_explicit_mask(rng, mode, dtype):
    L, S = 31, 65
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=L, S=S, E=16, dtype=dtype)
    mask = sdpa.reference.causal_mask(L, S, bottom_right=(mode == "bottom_right"))
    causal = sdpa.scaled_dot_product_attention(q, k, v, is_causal=mode)
    masked = sdpa.scaled_dot_product_attention(q, k, v, mask)
    assert_close(causal, masked, dtype)


@dtypes
def test_causal_false_is_no_causal(rng, dtype):
    q, k, v = make_qkv(rng, hq=2, L=9, S=9, E=8, dtype=dtype)
    np.testing.assert_array_equal(
        sdpa.scaled_dot_product_attention(q, k, v, is_causal=False),
        sdpa.scaled_dot_product_attention(q, k, v),
    )
    check_against_reference(q, k, v, is_causal=np.bool_(True))


@dtypes
@pytest.mark.parametrize("L,S", [(7, 31), (31, 7), (33, 33)])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mode", CAUSAL_MODES, ids=["true", "top_left", "bottom_right"])
def test_causal_with_mask(rng, mode, kind, L, S, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=L, S=S, E=16, Ev=8, dtype=dtype)
    mask = random_mask(rng, (2, 3, L, S), kind, dtype, p_keep=0.6)
    check_against_reference(q, k, v, mask, is_causal=mode)


LS_PAIRS = [(3, 7), (7, 7), (9, 4), (1, 5), (1, 1), (5, 1), (8, 1030), (2, 1100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("L,S", LS_PAIRS)
def test_bottom_right_is_the_shifted_tril(rng, dtype, heads, L, S):
    hq, hkv = heads
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=16, Ev=12, dtype=dtype)
    tril = causal_mask(L, S, bottom_right=True)
    out, weights, lse = check_against_mask(q, k, v, {"is_causal": "bottom_right"}, tril, gqa=hq != hkv)
    explicit = attention(q, k, v, tril, enable_gqa=hq != hkv)
    assert_close(out, explicit, dtype, scale=2)
    # rows before L - S see no key: zeros, -inf, zero weights
    hidden = max(L - S, 0)
    assert not out[..., :hidden, :].any() and not weights[..., :hidden, :].any()
    assert np.isneginf(lse[..., :hidden]).all()
    assert np.isfinite(lse[..., hidden:]).all()


# --------------------------------------------------------------------------- key lengths

KEY_LENGTH_CASES = {
    # name: (batch shape, key_lengths)
    "scalar": ((3,), np.int64(4)),
    "0-d array": ((3,), np.array(9)),
    "per-batch": ((3,), np.array([0, 5, 100])),
    "per-batch-int32": ((3,), np.array([9, 1, 3], dtype=np.int32)),
    "column": ((3, 2), np.array([[2], [9], [0]])),
    "row": ((3, 2), np.array([7, 3])),
    "full": ((3, 2), np.array([[1, 2], [3, 4], [9, 8]])),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(KEY_LENGTH_CASES))
@pytest.mark.parametrize("extra", ["none", "causal", "bottom_right", "mask", "causal+mask"])
def test_key_lengths_are_a_mask(rng, dtype, case, extra):
    batch, kl = KEY_LENGTH_CASES[case]
    L, S = 5, 9
    q, k, v = make_qkv(rng, batch=batch, hq=4, hkv=2, L=L, S=S, E=8, Ev=6, dtype=dtype)
    allowed = np.broadcast_to(key_length_mask(kl, S), batch + (4, L, S))
    kwargs = {"key_lengths": kl}
    if "causal" in extra:
        kwargs["is_causal"] = True
        allowed = allowed & causal_mask(L, S)
    if extra == "bottom_right":
        kwargs["is_causal"] = "bottom_right"
        allowed = allowed & causal_mask(L, S, bottom_right=True)
    if "mask" in extra:
        keep = rng.random((4, L, S)) < 0.7
        kwargs["attn_mask"] = keep
        allowed = allowed & keep
    out, weights, lse = check_against_mask(q, k, v, kwargs, allowed, gqa=True)
    beyond = ~key_length_mask(kl, S)
    assert not np.where(beyond, weights, 0).any(), "weights beyond the key length"


def test_key_lengths_past_the_keys_are_clamped(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=3, S=6, E=8)
    np.testing.assert_array_equal(
        attention(q, k, v, key_lengths=np.array([6, 10**9])), attention(q, k, v)
    )


# --------------------------------------------------------------------------- log-sum-exp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "float+causal"])
@pytest.mark.parametrize("L,S,hq,hkv", [(6, 11, 3, 3), (1, 300, 8, 2), (4, 2, 4, 1), (40, 70, 2, 1)])
def test_lse_matches_numpy(rng, dtype, mask_kind, L, S, hq, hkv):
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=16, dtype=dtype)
    allowed, additive, kwargs = None, None, {}
    if mask_kind == "bool":
        allowed = rng.random((2, hq, L, S)) < 0.6
        allowed[0, 0, 0] = False  # a row that sees no key
        kwargs["attn_mask"] = allowed
    elif mask_kind.startswith("float"):
        additive = (3.0 * rng.standard_normal((hq, L, S))).astype(dtype)
        additive[0, -1] = -np.inf  # a row that sees no key
        kwargs["attn_mask"] = additive
        if "causal" in mask_kind:
            kwargs["is_causal"] = True
            allowed = causal_mask(L, S)
    for scale in (None, 0.3):
        _, _, lse = check_against_mask(
            q, k, v, kwargs, allowed, additive=additive, scale=scale, gqa=hq != hkv
        )
        if mask_kind == "bool":
            assert np.isneginf(lse[0, 0, 0])
        elif additive is not None:
            assert np.isneginf(lse[:, 0, -1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_of_no_keys(dtype):
    q = np.ones((2, 3, 4), dtype=dtype)
    k = np.ones((2, 0, 4), dtype=dtype)
    v = np.ones((2, 0, 5), dtype=dtype)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 5) and not out.any()
    assert lse.shape == (2, 3) and lse.dtype == dtype and np.isneginf(lse).all()


def test_lse_with_weights_order(rng):
    q, k, v = make_qkv(rng, hq=2, L=3, S=4, E=8)
    res = attention(q, k, v, return_weights=True, return_lse=True)
    assert len(res) == 3
    assert res[1].shape == (2, 3, 4) and res[2].shape == (2, 3)
    out, lse = attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, res[0])
    np.testing.assert_array_equal(lse, res[2])


# --------------------------------------------------------------------------- GQA


@dtypes
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1), (6, 3), (4, 4), (3, 1), (8, 8)])
def test_gqa(rng, hq, hkv, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=9, S=31, E=16, Ev=8, dtype=dtype)
    out, weights = check_against_reference(q, k, v, enable_gqa=True)
    assert out.shape == (2, hq, 9, 8)
    assert weights.shape == (2, hq, 9, 31)


@dtypes
def test_gqa_head_mapping(rng, dtype):
    # query head h reads key/value head h // (Hq // Hkv)
    hq, hkv = 8, 2
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=9, S=31, E=16, Ev=8, dtype=dtype)
    out = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for h in range(hq):
        single = sdpa.scaled_dot_product_attention(q[:, h], k[:, h // 4], v[:, h // 4])
        assert_close(out[:, h], single, dtype)


@dtypes
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1)])
@pytest.mark.parametrize("mode", [False, True, "bottom_right"], ids=["nocausal", "causal", "bottom_right"])
@pytest.mark.parametrize("kind", [None, "bool", "float"])
def test_gqa_with_mask_and_causal(rng, kind, mode, hq, hkv, dtype):
    L, S = 33, 9
    q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=16, Ev=8, dtype=dtype)
    mask = None if kind is None else random_mask(rng, (hq, L, S), kind, dtype)
    check_against_reference(q, k, v, mask, is_causal=mode, enable_gqa=True)


@dtypes
def test_gqa_flag_without_grouping_changes_nothing(rng, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=9, S=31, E=16, dtype=dtype)
    with_flag = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    without = sdpa.scaled_dot_product_attention(q, k, v)
    assert_close(with_flag, without, dtype)


# --------------------------------------------------------------------------- scale


@dtypes
@pytest.mark.parametrize("scale", [None, 0.0, -0.0, -0.5, -1.0, 1e-3, 0.125, 1.0, 3.0])
def test_scale(rng, scale, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=33, E=16, Ev=8, dtype=dtype)
    check_against_reference(q, k, v, scale=scale)


@dtypes
def test_scale_zero_is_uniform(rng, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=33, E=16, Ev=8, dtype=dtype)
    out, weights = sdpa.scaled_dot_product_attention(q, k, v, scale=0.0, return_weights=True)
    assert_close(weights, np.full(weights.shape, 1 / 33), dtype)
    assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True), out.shape), dtype)
    # with causal masking each row averages the keys it sees
    out = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.0)
    v64 = v.astype(np.float64)
    expected = np.cumsum(v64, axis=-2)[..., :9, :] / np.arange(1, 10)[:, None]
    assert_close(out, expected, dtype)


@dtypes
@pytest.mark.parametrize("scale", [2, np.float32(0.25), np.float64(-0.75), np.int64(1)], ids=repr)
def test_scale_types(rng, scale, dtype):
    q, k, v = make_qkv(rng, hq=2, L=7, S=9, E=8, dtype=dtype)
    check_against_reference(q, k, v, scale=float(scale))
    np.testing.assert_array_equal(
        sdpa.scaled_dot_product_attention(q, k, v, scale=scale),
        sdpa.scaled_dot_product_attention(q, k, v, scale=float(scale)),
    )


@dtypes
@pytest.mark.parametrize("mode", [False, True])
def test_scale_with_mask_and_gqa(rng, mode, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=4, hkv=2, L=31, S=33, E=16, Ev=8, dtype=dtype)
    mask = random_mask(rng, (31, 33), "float", dtype)
    check_against_reference(q, k, v, mask, is_causal=mode, scale=-0.3, enable_gqa=True)


# --------------------------------------------------------------------------- layouts


def make_layout(rng, shape, layout, dtype, values=None):
    """An array of ``shape`` and ``dtype`` with random contents in the memory layout
    ``layout``.  ``values(shape)`` makes the contiguous contents (default N(0, 1))."""
    shape = tuple(shape)
    if values is None:
        def values(s):
            return randn(rng, s, dtype)

    if layout == "contiguous":
        return values(shape)
    if layout == "transposed":  # (..., L, H, E) in memory, viewed as (..., H, L, E)
        return np.swapaxes(values(shape[:-3] + (shape[-2], shape[-3], shape[-1])), -3, -2)
    if layout == "rows-reversed":
        return values(shape)[..., ::-1, :]
    if layout == "all-reversed":
        return values(shape)[(slice(None, None, -1),) * len(shape)]
    if layout == "broadcast-rows":  # zero stride along the sequence
        return np.broadcast_to(values(shape[:-2] + (1, shape[-1])), shape)
    if layout == "broadcast-heads":  # zero stride along heads and batch
        return np.broadcast_to(values((1, 1) + shape[-2:]), shape)
    if layout == "broadcast-features":  # zero stride along the last dim
        return np.broadcast_to(values(shape[:-1] + (1,)), shape)
    if layout == "fortran":
        return np.asfortranarray(values(shape))
    if layout == "feature-major":  # last two dims swapped in memory
        return np.swapaxes(values(shape[:-2] + (shape[-1], shape[-2])), -1, -2)
    if layout == "every-other-feature":
        return values(shape[:-1] + (2 * shape[-1],))[..., ::2]
    if layout == "every-third-row":
        return values(shape[:-2] + (3 * shape[-2], shape[-1]))[..., ::3, :]
    if layout == "every-other-head":
        return values(shape[:-3] + (2 * shape[-3],) + shape[-2:])[..., ::2, :, :]
    if layout == "readonly":
        a = values(shape)
        a.setflags(write=False)
        return a
    if layout == "unaligned":
        contents = values(shape)
        buf = np.zeros(contents.nbytes + 1, dtype=np.uint8)
        a = buf[1:].view(contents.dtype).reshape(shape)
        a[...] = contents
        assert not a.flags.aligned
        return a
    raise AssertionError(layout)


def float_mask_values(rng, dtype):
    return lambda shape: random_mask(rng, shape, "float", dtype, p_keep=0.75)


def bool_mask_values(rng):
    return lambda shape: random_mask(rng, shape, "bool", p_keep=0.75)


LAYOUTS = (
    "contiguous",
    "transposed",
    "rows-reversed",
    "all-reversed",
    "broadcast-rows",
    "broadcast-heads",
    "broadcast-features",
    "fortran",
    "feature-major",
    "every-other-feature",
    "every-third-row",
    "every-other-head",
    "readonly",
    "unaligned",
)


@dtypes
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(rng, layout, dtype):
    B, H, L, S, E, Ev = 2, 3, 9, 33, 16, 8
    q = make_layout(rng, (B, H, L, E), layout, dtype)
    k = make_layout(rng, (B, H, S, E), layout, dtype)
    v = make_layout(rng, (B, H, S, Ev), layout, dtype)
    check_against_reference(q, k, v)
    check_against_reference(q, k, v, is_causal="bottom_right")


@dtypes
@pytest.mark.parametrize("seed", range(6))
def test_mixed_layouts(seed, dtype):
    rng = np.random.default_rng(1000 + seed)
    B, H, L, S, E, Ev = 2, 4, 31, 65, 16, 31
    lq, lk, lv, lm = rng.choice(LAYOUTS, size=4)
    q = make_layout(rng, (B, H, L, E), lq, dtype)
    k = make_layout(rng, (B, H // 2, S, E), lk, dtype)
    v = make_layout(rng, (B, H // 2, S, Ev), lv, dtype)
    mask = make_layout(rng, (B, H, L, S), lm, dtype, float_mask_values(rng, dtype))
    check_against_reference(q, k, v, mask, is_causal=bool(seed % 2), enable_gqa=True)


# one-byte bool elements are always aligned, so bool masks skip "unaligned"
MASK_LAYOUTS = [("bool", name) for name in LAYOUTS if name not in ("contiguous", "unaligned")] + [
    ("float", name) for name in LAYOUTS if name != "contiguous"
]


@dtypes
@pytest.mark.parametrize("kind,layout", MASK_LAYOUTS)
def test_mask_layouts(rng, kind, layout, dtype):
    B, H, L, S = 2, 3, 9, 33
    q, k, v = make_qkv(rng, batch=(B,), hq=H, L=L, S=S, E=16, Ev=8, dtype=dtype)
    if kind == "bool":
        mask = make_layout(rng, (B, H, L, S), layout, np.bool_, bool_mask_values(rng))
    else:
        mask = make_layout(rng, (B, H, L, S), layout, dtype, float_mask_values(rng, dtype))
    check_against_reference(q, k, v, mask)


@dtypes
def test_mask_zero_strides(rng, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=9, S=33, E=16, dtype=dtype)
    row = np.where(rng.random(33) < 0.7, rng.standard_normal(33), -np.inf).astype(dtype)
    check_against_reference(q, k, v, np.broadcast_to(row, (2, 3, 9, 33)))
    check_against_reference(q, k, v, np.broadcast_to(row > -np.inf, (2, 3, 9, 33)))
    col = rng.standard_normal((9, 1)).astype(dtype)
    check_against_reference(q, k, v, np.broadcast_to(col, (9, 33)))


@dtypes
def test_self_attention_same_array(rng, dtype):
    x = randn(rng, (2, 3, 31, 16), dtype)
    check_against_reference(x, x, x)
    check_against_reference(x, x, x, is_causal=True)


@dtypes
def test_views_into_one_buffer(rng, dtype):
    # a packed (B, L, 3, H, E) projection, split into q, k, v views as models do
    packed = randn(rng, (2, 31, 3, 4, 16), dtype)
    q, k, v = (np.moveaxis(packed[:, :, i], 1, 2) for i in range(3))
    assert q.shape == (2, 4, 31, 16)
    check_against_reference(q, k, v, is_causal=True)


@dtypes
def test_transposed_views_large(rng, dtype):
    B, L, H, E = 2, 127, 4, 64
    q = randn(rng, (B, L, H, E), dtype).transpose(0, 2, 1, 3)
    k = randn(rng, (B, 267, H, E), dtype).transpose(0, 2, 1, 3)
    v = randn(rng, (B, 267, H, E), dtype).transpose(0, 2, 1, 3)
    check_against_reference(q, k, v, is_causal="bottom_right")


# --------------------------------------------------------------------------- dtypes

DTYPE_COMBOS = {
    "f16": ("float16", "float16", "float16"),
    "f16-f32": ("float16", "float32", "float32"),
    "f32-f64": ("float32", "float32", "float64"),
    "f16-f64": ("float16", "float64", "float16"),
    "i32": ("int32", "int32", "int32"),
    "i64": ("int64", "int64", "int64"),
    "i8-u8-i16": ("int8", "uint8", "int16"),
    "u32-u64": ("uint32", "uint64", "uint32"),
    "bool": ("bool", "bool", "bool"),
    "f32-i32": ("float32", "int32", "float32"),
    "f32-bool": ("float32", "float32", "bool"),
    ">f8": (">f8", ">f8", ">f8"),
    ">f8-<f8": (">f8", "<f8", ">f8"),
    ">f4": (">f4", ">f4", ">f4"),
    ">f4-<f4": (">f4", "<f4", ">f4"),
    ">f2-f32": (">f2", "float32", "float32"),
    ">i4": (">i4", ">i4", ">i4"),
}
EXPECTED_RESULT_DTYPE = {  # the query's dtype when all are float32/float16/bfloat16, else float64
    "f16": np.float16,
    "f16-f32": np.float16,
    ">f4": np.float32,
    ">f4-<f4": np.float32,
    ">f2-f32": np.float16,
}


def random_of_dtype(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind == "u":
        return rng.integers(0, 4, size=shape).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("name", list(DTYPE_COMBOS))
def test_input_dtypes(rng, name):
    dq, dk, dv = DTYPE_COMBOS[name]
    q = random_of_dtype(rng, (2, 3, 9, 8), dq)
    k = random_of_dtype(rng, (2, 3, 31, 8), dk)
    v = random_of_dtype(rng, (2, 3, 31, 5), dv)
    expected = np.dtype(EXPECTED_RESULT_DTYPE.get(name, np.float64))
    assert result_dtype(q, k, v) == expected
    out, weights = check_against_reference(q, k, v)
    assert out.dtype == expected and weights.dtype == compute_dtype(expected)
    assert out.dtype.isnative
    check_against_reference(q, k, v, is_causal=True)


@pytest.mark.parametrize("L", [9, 1], ids=["tiled", "row-mode"])
def test_float16_is_float32_arithmetic_rounded_once(rng, L):
    """float16 inputs give the float32 result of the same values, rounded to float16."""
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=L, S=33, E=16, dtype=np.float16)
    out16 = sdpa.scaled_dot_product_attention(q, k, v)
    out32 = sdpa.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert out16.dtype == np.float16
    np.testing.assert_array_equal(out16, out32.astype(np.float16))


def test_python_lists(rng):
    q, k, v = make_qkv(rng, hq=2, L=3, S=4, E=5, dtype=np.float64)
    mask = rng.random((3, 4)) < 0.8
    out, weights = check_against_reference(q.tolist(), k.tolist(), v.tolist(), mask.tolist())
    assert out.dtype == np.float64
    int_out = sdpa.scaled_dot_product_attention([[1, 2], [3, 4]], [[1, 0], [0, 1], [1, 1]], [[1], [2], [3]])
    assert int_out.dtype == np.float64
    assert_close(
        int_out,
        sdpa.reference.scaled_dot_product_attention([[1, 2], [3, 4]], [[1, 0], [0, 1], [1, 1]], [[1], [2], [3]]),
        np.float64,
    )


@pytest.mark.parametrize(
    "problem_dtype,mask_dtype",
    [
        ("float32", "float16"),
        ("float32", "float64"),
        ("float32", ">f4"),
        ("float64", "float32"),
        ("float64", "float16"),
        ("float64", ">f8"),
    ],
)
def test_float_mask_dtypes(rng, problem_dtype, mask_dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=33, E=16, dtype=problem_dtype)
    mask = random_mask(rng, (9, 33), "float", np.float64).astype(mask_dtype)
    out, _ = check_against_reference(q, k, v, mask)
    assert out.dtype == np.dtype(problem_dtype)


@dtypes
def test_mask_as_list(rng, dtype):
    q, k, v = make_qkv(rng, hq=2, L=4, S=5, E=8, dtype=dtype)
    keep = rng.random((4, 5)) < 0.7
    keep[:, 0] = True
    check_against_reference(q, k, v, keep.tolist())
    check_against_reference(q, k, v, np.where(keep, 0.25, -np.inf).tolist())


# --------------------------------------------------------------------------- empty sizes


@dtypes
@pytest.mark.parametrize("mode", [False, True, "bottom_right"], ids=["nocausal", "causal", "bottom_right"])
def test_no_keys_gives_zeros(rng, mode, dtype):
    q = randn(rng, (2, 3, 5, 4), dtype)
    k = randn(rng, (2, 3, 0, 4), dtype)
    v = randn(rng, (2, 3, 0, 6), dtype)
    out, weights = check_against_reference(q, k, v, is_causal=mode)
    assert out.shape == (2, 3, 5, 6)
    assert weights.shape == (2, 3, 5, 0)
    assert np.all(out == 0)
    assert np.all(sdpa.scaled_dot_product_attention(q, k, v, is_causal=mode) == 0)
    masked = sdpa.scaled_dot_product_attention(q, k, v, np.ones((5, 0), dtype=bool))
    assert masked.shape == (2, 3, 5, 6) and np.all(masked == 0)


@dtypes
def test_no_keys_two_dim(dtype):
    out = sdpa.scaled_dot_product_attention(np.ones((3, 2), dtype), np.ones((0, 2), dtype), np.ones((0, 7), dtype))
    assert out.shape == (3, 7) and out.dtype == dtype
    assert np.all(out == 0)


@dtypes
def test_no_queries(rng, dtype):
    q = randn(rng, (2, 3, 0, 4), dtype)
    k = randn(rng, (2, 3, 7, 4), dtype)
    v = randn(rng, (2, 3, 7, 6), dtype)
    out, weights = check_against_reference(q, k, v, is_causal=True)
    assert out.shape == (2, 3, 0, 6)
    assert weights.shape == (2, 3, 0, 7)


@dtypes
@pytest.mark.parametrize("scale", [None, 2.0])
def test_zero_head_dim(rng, scale, dtype):
    # E == 0: every score is 0, so each row is the plain mean of the visible values
    q = randn(rng, (2, 3, 5, 0), dtype)
    k = randn(rng, (2, 3, 7, 0), dtype)
    v = randn(rng, (2, 3, 7, 6), dtype)
    out, weights = check_against_reference(q, k, v, scale=scale)
    assert_close(weights, np.full((2, 3, 5, 7), 1 / 7), dtype)
    out, _ = check_against_reference(q, k, v, is_causal=True, scale=scale)
    expected = np.cumsum(v.astype(np.float64), axis=-2)[..., :5, :] / np.arange(1, 6)[:, None]
    assert_close(out, expected, dtype)


@dtypes
def test_zero_value_dim(rng, dtype):
    q = randn(rng, (2, 3, 5, 4), dtype)
    k = randn(rng, (2, 3, 7, 4), dtype)
    v = randn(rng, (2, 3, 7, 0), dtype)
    out, weights = check_against_reference(q, k, v)
    assert out.shape == (2, 3, 5, 0)
    assert weights.shape == (2, 3, 5, 7)


@dtypes
@pytest.mark.parametrize(
    "qs,ks,vs,out_shape",
    [
        ((0, 3, 5, 4), (0, 3, 7, 4), (0, 3, 7, 6), (0, 3, 5, 6)),
        ((2, 0, 5, 4), (2, 0, 7, 4), (2, 0, 7, 6), (2, 0, 5, 6)),
        ((0, 5, 4), (1, 7, 4), (1, 7, 6), (0, 5, 6)),
        ((1, 1, 5, 4), (0, 1, 7, 4), (1, 1, 7, 6), (0, 1, 5, 6)),
        ((2, 3, 0, 0), (2, 3, 0, 0), (2, 3, 0, 0), (2, 3, 0, 0)),
    ],
)
def test_empty_batch_or_heads(rng, qs, ks, vs, out_shape, dtype):
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    out, weights = check_against_reference(q, k, v)
    assert out.shape == out_shape
    assert weights.shape == out_shape[:-1] + (ks[-2],)


@dtypes
def test_single_key(rng, dtype):
    # one key: every weight is 1 and every output row is that key's value
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=9, S=1, E=16, Ev=8, dtype=dtype)
    out, weights = check_against_reference(q, k, v)
    assert_close(weights, np.ones(weights.shape), dtype)
    assert_close(out, np.broadcast_to(v, out.shape).astype(np.float64), dtype)


@pytest.mark.parametrize("combo", list(itertools.product(["bool", "float"], [True, "bottom_right"])))
def test_float16_everything(rng, combo):
    kind, mode = combo
    q, k, v = make_qkv(rng, batch=(2,), hq=4, hkv=2, L=31, S=33, E=16, Ev=8, dtype=np.float16)
    mask = random_mask(rng, (4, 31, 33), kind, np.float16)
    out, weights = check_against_reference(q, k, v, mask, is_causal=mode, scale=0.3, enable_gqa=True)
    assert out.dtype == np.float16 and weights.dtype == np.float32
