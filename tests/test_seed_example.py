"""The worked example: two queries, two keys, two-dimensional values.

    Q = K = [[1, 0],      V = [[2, 3],
             [0, 1]]           [4, 5]]

scores = Q Kᵀ = I; scaled by 1/√2 the diagonal is 0.707; the row softmax of
[0.707, 0] is [0.67, 0.33]; the output rows are 0.67·[2, 3] + 0.33·[4, 5] = [2.66, 3.66]
and 0.33·[2, 3] + 0.67·[4, 5] = [3.34, 4.34].
"""
import math

import numpy as np
import pytest

import sdpa

Q = [[1, 0], [0, 1]]
K = [[1, 0], [0, 1]]
V = [[2, 3], [4, 5]]

EXPECTED_OUT = np.array([[2.66, 3.66], [3.34, 4.34]])
EXPECTED_WEIGHTS = np.array([[0.67, 0.33], [0.33, 0.67]])
EXPECTED_SCALED_SCORES = np.array([[0.707, 0.0], [0.0, 0.707]])
# Rounded float32 results are compared with these values rounded to float32
# (np.float32(2.66) != 2.66 in float64).


def as_input(x, kind):
    if kind == "list":
        return [list(map(float, row)) for row in x]
    if kind == "int-list":
        return x
    return np.array(x, dtype=kind)


INPUT_KINDS = ["list", "int-list", "float16", "float32", "float64"]
RESULT_DTYPE = {
    "list": np.float64,
    "int-list": np.float64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
}


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_output(kind):
    out = sdpa.scaled_dot_product_attention(as_input(Q, kind), as_input(K, kind), as_input(V, kind))
    assert isinstance(out, np.ndarray)
    assert out.shape == (2, 2)
    assert out.dtype == RESULT_DTYPE[kind]
    np.testing.assert_array_equal(np.round(out, 2), EXPECTED_OUT.astype(out.dtype))


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_output_and_weights(kind):
    result = sdpa.scaled_dot_product_attention(
        as_input(Q, kind), as_input(K, kind), as_input(V, kind), return_weights=True
    )
    assert isinstance(result, tuple) and len(result) == 2
    out, weights = result
    assert out.dtype == RESULT_DTYPE[kind]
    assert weights.dtype == (np.float64 if RESULT_DTYPE[kind] == np.float64 else np.float32)  # the compute type
    assert weights.shape == (2, 2)
    np.testing.assert_array_equal(np.round(out, 2), EXPECTED_OUT.astype(out.dtype))
    np.testing.assert_array_equal(np.round(weights, 2), EXPECTED_WEIGHTS.astype(weights.dtype))
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("kind", ["float32", "float64"])
def test_scaled_scores(kind):
    # Within a row the softmax keeps score differences: log(w0 / w1) = s0 - s1.
    _, weights = sdpa.scaled_dot_product_attention(
        as_input(Q, kind), as_input(K, kind), as_input(V, kind), return_weights=True
    )
    weights = weights.astype(np.float64)
    diff = np.log(weights[0, 0] / weights[0, 1])
    assert round(diff, 3) == 0.707
    assert abs(diff - 1 / math.sqrt(2)) < 1e-6
    diff = np.log(weights[1, 1] / weights[1, 0])
    assert round(diff, 3) == 0.707


def test_scaled_scores_of_the_reference_steps():
    q = np.array(Q, dtype=np.float64)
    k = np.array(K, dtype=np.float64)
    scores = q @ k.T / math.sqrt(q.shape[-1])
    np.testing.assert_array_equal(np.round(scores, 3), EXPECTED_SCALED_SCORES)
    out, weights = sdpa.reference.scaled_dot_product_attention(Q, K, V, return_weights=True)
    np.testing.assert_array_equal(np.round(out, 2), EXPECTED_OUT.astype(out.dtype))
    np.testing.assert_array_equal(np.round(weights, 2), EXPECTED_WEIGHTS.astype(weights.dtype))


def test_default_scale_is_one_over_sqrt_e():
    q, k, v = (np.array(x, dtype=np.float64) for x in (Q, K, V))
    default = sdpa.scaled_dot_product_attention(q, k, v)
    explicit = sdpa.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(2))
    np.testing.assert_array_equal(default, explicit)
    unscaled = sdpa.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert not np.array_equal(np.round(unscaled, 2), EXPECTED_OUT)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_with_batch_and_head_dims(dtype):
    q, k, v = (np.array(x, dtype=dtype)[None, None] for x in (Q, K, V))
    out, weights = sdpa.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert out.shape == (1, 1, 2, 2)
    assert weights.shape == (1, 1, 2, 2)
    np.testing.assert_array_equal(np.round(out[0, 0], 2), EXPECTED_OUT.astype(dtype))
    np.testing.assert_array_equal(np.round(weights[0, 0], 2), EXPECTED_WEIGHTS.astype(dtype))


def test_matches_reference():
    out = sdpa.scaled_dot_product_attention(Q, K, V)
    expected = sdpa.reference.scaled_dot_product_attention(Q, K, V)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
