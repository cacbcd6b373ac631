"""Properties that hold for every input: invariances, determinism across thread
counts, no writes to the inputs, and thread safety.

Shapes and seeds are drawn by Hypothesis (``sdpa.testing.qkv_problems``); the
array contents come from a NumPy Generator seeded with the drawn seed, which keeps
the search fast and each example reproducible.
"""
import threading

import numpy as np
import pytest
from hypothesis import given, strategies as st

import sdpa
from conftest import assert_close, check_against_reference
from sdpa.testing import make_qkv, qkv_problems, randn, random_mask, result_dtype

attention = sdpa.scaled_dot_product_attention

CAUSAL = st.sampled_from([False, True, "top_left", "bottom_right"])


# --------------------------------------------------------------------------- reference


@given(qkv_problems(), CAUSAL, st.sampled_from([None, "bool", "float"]), st.sampled_from([None, 0.0, -0.7, 0.3]))
def test_matches_reference(p, is_causal, mask_kind, scale):
    rng = p["rng"]
    shape = (p["hq"], p["L"], p["S"])
    mask = None
    if mask_kind == "bool":
        mask = rng.random(shape) < 0.7
    elif mask_kind == "float":
        mask = random_mask(rng, shape, "float", p["dtype"], p_keep=0.8)
    check_against_reference(p["q"], p["k"], p["v"], mask, is_causal, scale, p["gqa"])


# --------------------------------------------------------------------------- invariances


@given(qkv_problems(gqa=False), st.sampled_from([None, "bool", "float"]))
def test_permuting_keys_and_values_together(p, mask_kind):
    rng, dtype = p["rng"], p["dtype"]
    q, k, v = p["q"], p["k"], p["v"]
    mask = None
    if mask_kind == "bool":
        mask = rng.random((p["L"], p["S"])) < 0.7
    elif mask_kind == "float":
        mask = random_mask(rng, (p["L"], p["S"]), "float", dtype, p_keep=0.8)
    perm = rng.permutation(p["S"])
    out, weights = attention(q, k, v, mask, return_weights=True)
    pmask = None if mask is None else mask[:, perm]
    out_p, weights_p = attention(q, k[..., perm, :], v[..., perm, :], pmask, return_weights=True)
    assert_close(out_p, out, dtype, scale=2)
    assert_close(weights_p, weights[..., perm], dtype, scale=2)


@given(qkv_problems(gqa=False))
def test_permuting_queries_permutes_rows(p):
    perm = p["rng"].permutation(p["L"])
    out = attention(p["q"], p["k"], p["v"])
    out_p = attention(p["q"][..., perm, :], p["k"], p["v"])
    assert_close(out_p, out[..., perm, :], p["dtype"], scale=2)


@given(qkv_problems(), CAUSAL, st.booleans())
def test_values_of_ones_give_ones(p, is_causal, with_mask):
    rng, dtype = p["rng"], p["dtype"]
    v = np.ones_like(p["v"])
    mask = rng.random((p["hq"], p["L"], p["S"])) < 0.5 if with_mask else None
    out = attention(p["q"], p["k"], v, mask, is_causal, enable_gqa=p["gqa"])
    # rows that see at least one key average ones; rows that see none are zeros
    seen = np.ones((p["hq"], p["L"], p["S"]), dtype=bool)
    if is_causal:
        seen &= sdpa.reference.causal_mask(p["L"], p["S"], bottom_right=is_causal == "bottom_right")
    if mask is not None:
        seen &= mask
    expected = np.broadcast_to(seen.any(axis=-1)[..., None], out.shape).astype(np.float64)
    assert_close(out, expected, dtype)
    assert np.all(out[..., ~seen.any(axis=-1), :] == 0)


@given(qkv_problems(), st.floats(-30, 30), st.booleans())
def test_constant_added_to_a_mask_row_changes_nothing(p, magnitude, per_head):
    rng, dtype = p["rng"], p["dtype"]
    shape = (p["hq"], p["L"], p["S"]) if per_head else (p["L"], p["S"])
    mask = random_mask(rng, shape, "float", dtype, p_keep=0.8)
    shift = (magnitude * rng.random(shape[:-1] + (1,))).astype(dtype)
    args = dict(enable_gqa=p["gqa"], return_weights=True)
    out, weights = attention(p["q"], p["k"], p["v"], mask, **args)
    out_s, weights_s = attention(p["q"], p["k"], p["v"], mask + shift, **args)
    assert_close(out_s, out, dtype, scale=2)
    assert_close(weights_s, weights, dtype, scale=2)


@given(qkv_problems(), st.floats(0.125, 8.0), st.floats(-2.0, 2.0))
def test_scaling_query_trades_with_scale(p, factor, scale):
    # (c q) kᵀ * (s / c) == q kᵀ * s; powers of two keep the products exact
    factor = float(2.0 ** np.round(np.log2(factor)))
    out = attention(p["q"], p["k"], p["v"], scale=scale, enable_gqa=p["gqa"])
    out_c = attention(p["q"] * factor, p["k"], p["v"], scale=scale / factor, enable_gqa=p["gqa"])
    assert_close(out_c, out, p["dtype"], scale=2)


@given(qkv_problems(), CAUSAL)
def test_weights_are_a_distribution(p, is_causal):
    out, weights = attention(p["q"], p["k"], p["v"], None, is_causal, enable_gqa=p["gqa"], return_weights=True)
    assert np.all(weights >= 0)
    sums = weights.astype(np.float64).sum(axis=-1)
    blind = np.zeros(p["L"], dtype=bool)
    if is_causal == "bottom_right":
        blind = ~sdpa.reference.causal_mask(p["L"], p["S"], bottom_right=True).any(axis=-1)
    assert_close(sums, np.broadcast_to(np.where(blind, 0.0, 1.0), sums.shape), p["dtype"], scale=4)


@given(qkv_problems(), CAUSAL)
def test_batch_entries_are_independent(p, is_causal):
    q, k, v = p["q"], p["k"], p["v"]
    if not p["batch"]:
        q, k, v = q[None], k[None], v[None]
    out = attention(q, k, v, None, is_causal, enable_gqa=p["gqa"])
    for b in range(q.shape[0]):
        single = attention(q[b], k[b], v[b], None, is_causal, enable_gqa=p["gqa"])
        assert_close(out[b], single, p["dtype"], scale=2)


# --------------------------------------------------------------------------- thread counts

THREAD_COUNTS = (1, 2, 3, 4, 7, None)

DETERMINISM_CASES = {
    # name: (batch, hq, hkv, L, S, E, Ev, is_causal, mask kind)
    "small": ((2,), 2, 2, 9, 33, 16, 8, False, None),
    "long": ((), 2, 2, 267, 267, 64, 64, False, None),
    "one-query-long-keys": ((2,), 3, 3, 1, 267, 32, 32, False, None),
    "causal": ((2,), 3, 3, 127, 127, 32, 16, True, None),
    "bottom-right": ((2,), 2, 2, 65, 267, 16, 16, "bottom_right", None),
    "gqa": ((2,), 8, 2, 63, 65, 16, 31, False, None),
    "gqa-causal-mask": ((2,), 4, 1, 127, 64, 32, 32, True, "float"),
    "bool-mask": ((2, 3), 2, 2, 31, 65, 8, 8, False, "bool"),
    "wide-heads": ((), 1, 1, 64, 64, 256, 256, False, None),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(DETERMINISM_CASES))
def test_bitwise_identical_across_thread_counts(rng, case, dtype):
    batch, hq, hkv, L, S, E, Ev, is_causal, mask_kind = DETERMINISM_CASES[case]
    q, k, v = make_qkv(rng, batch=batch, hq=hq, hkv=hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((hq, L, S)) < 0.7
    elif mask_kind == "float":
        mask = random_mask(rng, (hq, L, S), "float", dtype, p_keep=0.8)
    args = (q, k, v, mask, is_causal, None, hq != hkv)
    first = attention(*args, num_threads=1)
    first_out, first_weights = attention(*args, return_weights=True, num_threads=1)
    for n in THREAD_COUNTS:
        out = attention(*args, num_threads=n)
        assert np.array_equal(out, first), f"num_threads={n}: output differs from num_threads=1"
        out_w, weights = attention(*args, return_weights=True, num_threads=n)
        assert np.array_equal(out_w, first_out), f"num_threads={n}: output differs (with weights)"
        assert np.array_equal(weights, first_weights), f"num_threads={n}: weights differ"


@given(qkv_problems(max_len=70), CAUSAL, st.sampled_from([1, 2, 3]))
def test_bitwise_identical_across_thread_counts_random(p, is_causal, n):
    args = (p["q"], p["k"], p["v"], None, is_causal, None, p["gqa"])
    base_out, base_weights = attention(*args, return_weights=True, num_threads=1)
    out, weights = attention(*args, return_weights=True, num_threads=n)
    assert np.array_equal(out, base_out)
    assert np.array_equal(weights, base_weights)
    assert np.array_equal(attention(*args, num_threads=n), attention(*args, num_threads=1))


def test_repeated_calls_are_bitwise_identical(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=4, L=127, S=267, E=64, dtype=np.float32)
    first = attention(q, k, v, is_causal=True)
    for _ in range(5):
        assert np.array_equal(attention(q, k, v, is_causal=True), first)


# --------------------------------------------------------------------------- inputs untouched


def snapshot(*arrays):
    return [None if a is None else (np.array(a, copy=True), a.dtype, a.shape, a.strides) for a in arrays]


def assert_unchanged(arrays, snapshots):
    for a, snap in zip(arrays, snapshots):
        if a is None:
            continue
        copy, dtype, shape, strides = snap
        assert a.dtype == dtype and a.shape == shape and a.strides == strides
        assert np.array_equal(a, copy, equal_nan=True)


@given(qkv_problems(), CAUSAL, st.sampled_from([None, "bool", "float"]), st.booleans(), st.booleans())
def test_inputs_are_not_modified(p, is_causal, mask_kind, weights, with_out):
    rng, dtype = p["rng"], p["dtype"]
    q, k, v = p["q"], p["k"], p["v"]
    mask = None
    if mask_kind == "bool":
        mask = rng.random((p["hq"], p["L"], p["S"])) < 0.7
    elif mask_kind == "float":
        mask = random_mask(rng, (p["hq"], p["L"], p["S"]), "float", dtype, p_keep=0.8)
    before = snapshot(q, k, v, mask)
    out = None
    if with_out:
        out = np.empty(p["batch"] + (p["hq"], p["L"], p["Ev"]), dtype)
    result = attention(q, k, v, mask, is_causal, None, p["gqa"], return_weights=weights, out=out)
    assert_unchanged((q, k, v, mask), before)
    if with_out:
        assert (result[0] if weights else result) is out


@pytest.mark.parametrize(
    "dtypes",
    [("float32",) * 3, ("float64",) * 3, ("float16",) * 3, (">f8",) * 3, ("float32", "float64", "int32")],
    ids=lambda d: "-".join(d),
)
def test_strided_and_converted_inputs_are_not_modified(rng, dtypes):
    base = [randn(rng, (2, 9, 3, 16), np.float64).astype(d) for d in dtypes]
    q, k, v = (np.swapaxes(b, 1, 2)[..., ::-1, :] for b in base)  # transposed, reversed views
    mask = np.where(rng.random((9, 9)) < 0.2, -np.inf, rng.standard_normal((9, 9)))
    mask = np.asfortranarray(mask).astype(">f8")
    bases = snapshot(*base)
    before = snapshot(q, k, v, mask)
    attention(q, k, v, mask, is_causal=True, return_weights=True)
    out = np.empty((2, 3, 9, 16), dtype=result_dtype(q, k, v))
    attention(q, k, v, mask, is_causal=True, out=out)
    assert_unchanged((q, k, v, mask), before)
    assert_unchanged(base, bases)


# --------------------------------------------------------------------------- Python threads


def test_concurrent_calls_from_python_threads(rng):
    n_threads, rounds = 8, 4
    cases = []
    for i in range(n_threads):
        dtype = np.float32 if i % 2 else np.float64
        hq, hkv = (4, 2) if i % 3 == 0 else (2, 2)
        L, S = 31 + 17 * i, 65 + 23 * i
        q, k, v = make_qkv(rng, batch=(2,), hq=hq, hkv=hkv, L=L, S=S, E=32, Ev=16, dtype=dtype)
        mask = random_mask(rng, (L, S), "float", dtype, p_keep=0.8) if i % 4 == 1 else None
        is_causal = (False, True, "bottom_right")[i % 3]
        cases.append((q, k, v, mask, is_causal, None, hq != hkv))
    expected = [attention(*args, return_weights=True, num_threads=1) for args in cases]

    barrier = threading.Barrier(n_threads)
    results = [None] * n_threads
    errors = []

    def work(i):
        try:
            barrier.wait()
            got = []
            for r in range(rounds):
                threads = (None, 1, 2, 3)[r % 4]
                got.append(attention(*cases[i], return_weights=bool(r % 2), num_threads=threads))
            results[i] = got
        except BaseException as exc:  # noqa: BLE001 - reported in the main thread
            errors.append((i, exc))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a worker thread did not finish"
    assert not errors, errors
    for i, got in enumerate(results):
        exp_out, exp_weights = expected[i]
        for r, res in enumerate(got):
            if r % 2:
                out, weights = res
                assert np.array_equal(weights, exp_weights), f"thread {i}, round {r}: weights differ"
            else:
                out = res
            assert np.array_equal(out, exp_out), f"thread {i}, round {r}: output differs"
