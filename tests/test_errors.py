"""Bad arguments raise ValueError / TypeError with a message that names the
argument and the shapes involved; ``out=`` writes into the given array."""
import numpy as np
import pytest

import sdpa
from sdpa.testing import make_qkv, randn

attention = sdpa.scaled_dot_product_attention


def shapes_in(message, *arrays):
    return all(str(tuple(np.shape(a))) in message for a in arrays)


@pytest.fixture
def qkv(rng):
    """float64 query (2, 3, 5, 8), key (2, 3, 7, 8), value (2, 3, 7, 4)."""
    return make_qkv(rng, batch=(2,), hq=3, L=5, S=7, E=8, Ev=4)


# --------------------------------------------------------------------------- shapes


def test_mismatched_feature_dim(rng):
    q = randn(rng, (2, 3, 5, 8))
    k = randn(rng, (2, 3, 7, 6))
    v = randn(rng, (2, 3, 7, 4))
    with pytest.raises(ValueError) as exc:
        attention(q, k, v)
    msg = str(exc.value)
    assert "query" in msg and "key" in msg
    assert shapes_in(msg, q, k)


def test_mismatched_sequence_length(rng):
    q = randn(rng, (2, 3, 5, 8))
    k = randn(rng, (2, 3, 7, 8))
    v = randn(rng, (2, 3, 6, 4))
    with pytest.raises(ValueError) as exc:
        attention(q, k, v)
    msg = str(exc.value)
    assert "key" in msg and "value" in msg
    assert shapes_in(msg, k, v)


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("shape", [(8,), ()], ids=["1d", "0d"])
def test_fewer_than_two_dims(rng, which, shape):
    args = {"query": randn(rng, (5, 8)), "key": randn(rng, (7, 8)), "value": randn(rng, (7, 4))}
    args[which] = randn(rng, shape)
    with pytest.raises(ValueError) as exc:
        attention(**args)
    msg = str(exc.value)
    assert which in msg
    assert str(shape) in msg


@pytest.mark.parametrize(
    "hq,hk,hv",
    [(3, 2, 2), (2, 3, 3), (4, 2, 2), (3, 3, 2), (3, 2, 3)],
)
def test_head_counts_that_do_not_match(rng, hq, hk, hv):
    q = randn(rng, (2, hq, 5, 8))
    k = randn(rng, (2, hk, 7, 8))
    v = randn(rng, (2, hv, 7, 4))
    with pytest.raises(ValueError) as exc:
        attention(q, k, v)
    msg = str(exc.value)
    assert "heads" in msg
    assert shapes_in(msg, q, k, v)


@pytest.mark.parametrize("hq,hkv", [(6, 4), (2, 4), (3, 2), (1, 3), (5, 3)])
def test_bad_gqa_grouping(rng, hq, hkv):
    q = randn(rng, (2, hq, 5, 8))
    k = randn(rng, (2, hkv, 7, 8))
    v = randn(rng, (2, hkv, 7, 4))
    with pytest.raises(ValueError) as exc:
        attention(q, k, v, enable_gqa=True)
    msg = str(exc.value)
    assert "enable_gqa" in msg
    assert shapes_in(msg, q, k, v)


def test_gqa_needs_the_flag(rng):
    q = randn(rng, (2, 8, 5, 8))
    k = randn(rng, (2, 2, 7, 8))
    v = randn(rng, (2, 2, 7, 4))
    with pytest.raises(ValueError, match="enable_gqa"):
        attention(q, k, v)
    assert attention(q, k, v, enable_gqa=True).shape == (2, 8, 5, 4)


def test_batch_dims_that_do_not_broadcast(rng):
    q = randn(rng, (2, 3, 5, 8))
    k = randn(rng, (4, 3, 7, 8))
    v = randn(rng, (4, 3, 7, 4))
    with pytest.raises(ValueError) as exc:
        attention(q, k, v)
    msg = str(exc.value)
    assert "query" in msg and "key" in msg
    assert "(2,)" in msg and "(4,)" in msg  # the batch dims


def test_too_many_batch_dims(rng):
    q = randn(rng, (1,) * 9 + (2, 5, 8))
    k = randn(rng, (2, 7, 8))
    v = randn(rng, (2, 7, 4))
    with pytest.raises(ValueError) as exc:
        attention(q, k, v)
    assert shapes_in(str(exc.value), q)
    # eight batch dims are fine
    assert attention(q[0], k, v).shape == (1,) * 8 + (2, 5, 4)


@pytest.mark.parametrize(
    "mask_shape",
    [(5, 8), (6, 7), (8,), (4, 5, 7), (3, 3, 5, 7), (2, 3, 1, 5, 7), (5, 7, 1)],
)
@pytest.mark.parametrize("kind", [np.bool_, np.float64])
def test_mask_that_does_not_broadcast(qkv, mask_shape, kind):
    q, k, v = qkv
    mask = np.zeros(mask_shape, dtype=kind)
    with pytest.raises(ValueError) as exc:
        attention(q, k, v, mask)
    msg = str(exc.value)
    assert "attn_mask" in msg
    assert str(mask_shape) in msg
    assert str((2, 3, 5, 7)) in msg  # the scores' shape


def test_mask_with_more_dims_than_a_two_dim_problem(rng):
    q, k, v = make_qkv(rng, hq=None, L=5, S=7, E=8)
    with pytest.raises(ValueError, match="attn_mask"):
        attention(q, k, v, np.ones((2, 5, 7), dtype=bool))


@pytest.mark.parametrize("value", ["causal", "TOP_LEFT", "bottom-right", "", "true"])
def test_bad_is_causal_string(qkv, value):
    with pytest.raises(ValueError) as exc:
        attention(*qkv, is_causal=value)
    assert "is_causal" in str(exc.value)
    assert repr(value) in str(exc.value)


@pytest.mark.parametrize("value", [None, 1.5, [True]])
def test_bad_is_causal_type(qkv, value):
    with pytest.raises(TypeError, match="is_causal"):
        attention(*qkv, is_causal=value)


@pytest.mark.parametrize("n", [0, -1, -100])
def test_num_threads_below_one(qkv, n):
    with pytest.raises(ValueError) as exc:
        attention(*qkv, num_threads=n)
    assert "num_threads" in str(exc.value)
    assert str(n) in str(exc.value)


# --------------------------------------------------------------------------- types


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_inputs(rng, which, dtype):
    args = {"query": randn(rng, (2, 5, 8)), "key": randn(rng, (2, 7, 8)), "value": randn(rng, (2, 7, 4))}
    args[which] = args[which].astype(dtype)
    with pytest.raises(TypeError) as exc:
        attention(**args)
    assert which in str(exc.value)
    assert np.dtype(dtype).name in str(exc.value)


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize(
    "bad",
    [
        np.array([["a", "b"], ["c", "d"]]),
        np.array([[b"a", b"b"], [b"c", b"d"]]),
        np.array([[None, None], [None, None]], dtype=object),
        np.array([["2020-01-01", "2020-01-02"]] * 2, dtype="datetime64[D]"),
    ],
    ids=["str", "bytes", "object", "datetime"],
)
def test_non_numeric_inputs(which, bad):
    args = {"query": np.ones((2, 2)), "key": np.ones((2, 2)), "value": np.ones((2, 2))}
    args[which] = bad
    with pytest.raises(TypeError) as exc:
        attention(**args)
    assert which in str(exc.value)


def test_string_lists():
    with pytest.raises(TypeError, match="query"):
        attention([["a", "b"]], [[1.0, 2.0]], [[1.0]])


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="long double is float64 here")
def test_long_double_input(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="query"):
        attention(q.astype(np.longdouble), k, v)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64, np.complex128])
def test_non_bool_non_float_masks(qkv, dtype):
    mask = np.ones((5, 7), dtype=dtype)
    with pytest.raises(TypeError) as exc:
        attention(*qkv, mask)
    assert "attn_mask" in str(exc.value)
    assert np.dtype(dtype).name in str(exc.value)


def test_int_list_mask(qkv):
    with pytest.raises(TypeError, match="attn_mask"):
        attention(*qkv, [[1] * 7] * 5)


@pytest.mark.parametrize(
    "scale",
    ["a", "0.5", b"1", [0.5], np.array([0.5, 0.5]), True, 1j, object()],
    ids=["str", "numeric-str", "bytes", "list", "array", "bool", "complex", "object"],
)
def test_bad_scale(qkv, scale):
    with pytest.raises(TypeError, match="scale"):
        attention(*qkv, scale=scale)


@pytest.mark.parametrize("n", [1.5, 2.0, "2", True, [2]], ids=repr)
def test_bad_num_threads_type(qkv, n):
    with pytest.raises(TypeError, match="num_threads"):
        attention(*qkv, num_threads=n)


def test_num_threads_numpy_int(qkv):
    np.testing.assert_array_equal(attention(*qkv, num_threads=np.int64(2)), attention(*qkv, num_threads=2))


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize(
    "inputs,bad_dtype",
    [("float64", np.float32), ("float32", np.float64), ("float16", np.float32), ("float64", np.int64),
     ("float32", np.complex64)],
)
def test_out_with_wrong_dtype(rng, inputs, bad_dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=5, S=7, E=8, Ev=4, dtype=inputs)
    out = np.empty((2, 3, 5, 4), dtype=bad_dtype)
    with pytest.raises(TypeError) as exc:
        attention(q, k, v, out=out)
    assert "out" in str(exc.value)
    assert np.dtype(bad_dtype).name in str(exc.value)


@pytest.mark.parametrize("out", [[[0.0]], np.zeros((2, 3, 5, 4)).tolist()], ids=["list", "nested-list"])
def test_out_that_is_not_an_array(qkv, out):
    with pytest.raises(TypeError, match="out"):
        attention(*qkv, out=out)


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (3, 5, 4), (1, 3, 5, 4), (2, 3, 5, 4, 1), (2, 3, 7, 4), (4,)])
def test_out_with_wrong_shape(qkv, shape):
    out = np.empty(shape)
    with pytest.raises(ValueError) as exc:
        attention(*qkv, out=out)
    msg = str(exc.value)
    assert "out" in msg
    assert str(shape) in msg and str((2, 3, 5, 4)) in msg


def test_read_only_out(qkv):
    out = np.zeros((2, 3, 5, 4))
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out"):
        attention(*qkv, out=out)
    assert np.all(out == 0)


def test_out_with_overlapping_elements(qkv):
    buf = np.zeros(64)
    out = np.lib.stride_tricks.as_strided(buf, shape=(2, 3, 5, 4), strides=(0, 8, 8, 8), writeable=True)
    with pytest.raises(ValueError, match="out"):
        attention(*qkv, out=out)


def test_unaligned_out(qkv):
    buf = np.zeros(2 * 3 * 5 * 4 * 8 + 1, dtype=np.uint8)
    out = buf[1:].view(np.float64).reshape(2, 3, 5, 4)
    assert not out.flags.aligned
    with pytest.raises(ValueError, match="out"):
        attention(*qkv, out=out)


def test_out_overlapping_query(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=5, S=7, E=4, Ev=4)
    with pytest.raises(ValueError) as exc:
        attention(q, k, v, out=q)
    assert "out" in str(exc.value) and "query" in str(exc.value)
    # a view sharing part of the memory counts too
    big = randn(rng, (2, 3, 5, 8))
    q2 = big[..., :4]
    with pytest.raises(ValueError, match="query"):
        attention(q2, k, v, out=big[..., 3:7])
    # interleaved views of one buffer do not overlap and are fine
    attention(big[..., ::2], k, v, out=big[..., 1::2])


@pytest.mark.parametrize("which", ["key", "value", "attn_mask"])
def test_out_overlapping_other_inputs(rng, which):
    q, k, v = make_qkv(rng, batch=(2,), hq=3, L=5, S=5, E=4, Ev=4)
    mask = randn(rng, (2, 3, 5, 5))
    out = {"key": k, "value": v, "attn_mask": mask[..., :4]}[which]
    with pytest.raises(ValueError) as exc:
        attention(q, k, v, mask, out=out)
    assert which in str(exc.value)


def test_out_overlapping_converted_inputs(rng):
    """The caller's own arrays count, not only the converted copies the core reads."""
    buf = np.zeros((2, 3, 5, 8), np.float32)
    q_swapped = buf.view(">f4")[..., :4]  # a big-endian query (converted) inside out's memory
    k, v = (randn(rng, (2, 3, 7, 4), np.float32) for _ in range(2))
    q_swapped[...] = randn(rng, q_swapped.shape)
    before = q_swapped.copy()
    with pytest.raises(ValueError, match="query"):
        attention(q_swapped, k, v, out=buf[..., :4])
    np.testing.assert_array_equal(q_swapped, before)
    q = randn(rng, (2, 3, 5, 4), np.float32)
    mask16 = buf.view(np.float16)[..., :7]  # converted to float32 for the core
    with pytest.raises(ValueError, match="attn_mask"):
        attention(q, k, v, mask16, out=buf[..., :4])


def test_out_overlapping_key_lengths(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=1, L=1, S=7, E=4, Ev=4, dtype=np.float64)
    out = np.zeros((2, 1, 1, 4))
    lengths = out.reshape(-1).view(np.int64)[:2]  # key_lengths stored inside out
    lengths[:] = [3, 5]
    with pytest.raises(ValueError, match="key_lengths"):
        attention(q, k, v, key_lengths=lengths, out=out)
    assert list(lengths) == [3, 5]


def test_int64_beyond_2_53_is_rejected_before_conversion():
    q = np.array([[2**53 + 1, 0]], np.int64)
    with pytest.raises(TypeError, match=r"query: .*2\*\*53"):
        attention(q, np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(TypeError, match=r"value: .*2\*\*53"):
        attention(np.ones((1, 2)), np.ones((1, 2)), np.array([[-(2**53) - 1, 0]], np.int64))
    attention(np.array([[2**53, -(2**53)]], np.int64), np.ones((1, 2)), np.ones((1, 2)))  # exact: fine
    with pytest.raises(TypeError, match="2\\*\\*53"):
        attention(np.array([[2**64 - 1, 0]], np.uint64), np.ones((1, 2)), np.ones((1, 2)))


@pytest.mark.parametrize("scale", [10**400, -(10**400)])
def test_scale_too_large_for_a_float_names_scale(qkv, scale):
    with pytest.raises(ValueError, match="scale"):
        attention(*qkv, scale=scale)


@pytest.mark.parametrize("scale", [float("nan"), np.float32("nan")])
def test_nan_scale_gives_nan(qkv, scale):
    assert np.all(np.isnan(attention(*qkv, scale=scale)))


def test_infinite_scale_gives_nan_or_blind_rows(qkv):
    """Scores become +-inf (or NaN for a zero product): a row with a +inf score
    is NaN, a row whose scores are all -inf sees no key and gives zeros."""
    for scale in (float("inf"), -float("inf")):
        out = attention(*qkv, scale=scale)
        nan_rows, zero_rows = np.all(np.isnan(out), axis=-1), np.all(out == 0, axis=-1)
        assert np.all(nan_rows | zero_rows)


def test_errors_leave_out_untouched(qkv):
    out = np.full((2, 3, 5, 4), 7.0)
    with pytest.raises(ValueError):
        attention(*qkv, attn_mask=np.ones((9, 9), dtype=bool), out=out)
    with pytest.raises(TypeError):
        attention(*qkv, scale="a", out=out)
    assert np.all(out == 7.0)


def test_weights_too_large_for_memory():
    # E = Ev = 0 keeps the inputs empty while L * S is enormous
    q = np.empty((10**7, 0))
    k = np.empty((10**7, 0))
    v = np.empty((10**7, 0))
    with pytest.raises(MemoryError, match="return_weights"):
        attention(q, k, v, return_weights=True)
    assert attention(q, k, v).shape == (10**7, 0)


# --------------------------------------------------------------------------- out= that works


def out_layout(shape, layout, dtype):
    if layout == "contiguous":
        return np.empty(shape, dtype)
    if layout == "fortran":
        return np.empty(shape, dtype, order="F")
    if layout == "every-other":
        return np.empty(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]
    if layout == "transposed":
        return np.swapaxes(np.empty(shape[:-3] + (shape[-2], shape[-3], shape[-1]), dtype), -3, -2)
    if layout == "reversed":
        return np.empty(shape, dtype)[(slice(None, None, -1),) * len(shape)]
    if layout == "feature-major":
        return np.swapaxes(np.empty(shape[:-2] + (shape[-1], shape[-2]), dtype), -1, -2)
    if layout == "slice-of-bigger":
        big = np.empty(tuple(n + 2 for n in shape), dtype)
        return big[(slice(1, -1),) * len(shape)]
    raise AssertionError(layout)


OUT_LAYOUTS = ["contiguous", "fortran", "every-other", "transposed", "reversed", "feature-major", "slice-of-bigger"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
def test_out_works(rng, layout, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=4, hkv=2, L=31, S=33, E=16, Ev=8, dtype=dtype)
    mask = rng.random((31, 33)) < 0.7
    args = (q, k, v, mask, True, None, True)
    expected = attention(*args)
    out = out_layout((2, 4, 31, 8), layout, dtype)
    out[...] = np.nan
    result = attention(*args, out=out)
    assert result is out
    np.testing.assert_array_equal(out, expected)

    out[...] = np.nan
    result, weights = attention(*args, out=out, return_weights=True)
    assert result is out
    expected_out, expected_weights = attention(*args, return_weights=True)
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(weights, expected_weights)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_out_gets_zeros_where_nothing_is_seen(rng, dtype):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=5, E=8, dtype=dtype)
    out = np.full((2, 2, 9, 8), np.nan, dtype)
    attention(q, k, v, is_causal="bottom_right", out=out)  # rows 0..3 see no key
    assert np.all(out[..., :4, :] == 0)
    np.testing.assert_array_equal(out, attention(q, k, v, is_causal="bottom_right"))

    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=0, E=8, dtype=dtype)
    out = np.full((2, 2, 9, 8), np.nan, dtype)
    assert attention(q, k, v, out=out) is out
    assert np.all(out == 0)


def test_out_for_float16_inputs(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=9, S=5, E=8, dtype=np.float16)
    out = np.empty((2, 2, 9, 8), np.float16)
    assert attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, attention(q, k, v))


def test_out_for_two_dim_problem(rng):
    q, k, v = make_qkv(rng, hq=None, L=9, S=5, E=8, Ev=3)
    out = np.empty((3, 9)).T
    assert attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, attention(q, k, v))


def test_out_with_broadcast_batch(rng):
    q = randn(rng, (2, 1, 3, 5, 8))
    k = randn(rng, (1, 4, 3, 7, 8))
    v = randn(rng, (4, 3, 7, 6))
    out = np.empty((2, 4, 3, 5, 6))
    assert attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, attention(q, k, v))


def test_out_can_be_reused(rng):
    out = np.empty((2, 3, 5, 4))
    for _ in range(3):
        q, k, v = make_qkv(rng, batch=(2,), hq=3, L=5, S=7, E=8, Ev=4)
        assert attention(q, k, v, out=out) is out
        np.testing.assert_array_equal(out, attention(q, k, v))
