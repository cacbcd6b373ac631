"""Key scores: return_key_scores= on scaled_dot_product_attention,
KVCache.attend and paged_attention.

The expected scores come from the float64 reference's weights, written from
the definition: for each key, the sum over the rows counted (the last
``key_scores_window``, or all) and over the query heads of its key/value
head's group of the softmax weight it received.
"""
import numpy as np
import pytest

import sdpa
from conftest import assert_close
from sdpa import reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def expected_scores(q, k, v, rows_counted=None, **kw):
    """(..., Hkv, S) from the reference's weights."""
    gqa = q.shape[-3] != k.shape[-3]
    _, w = reference.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, return_weights=True, **kw)
    L = q.shape[-2]
    rows = L if rows_counted is None else min(rows_counted, L)
    w = np.nan_to_num(w[..., L - rows:, :])
    hkv = k.shape[-3]
    w = w.reshape(w.shape[:-3] + (hkv, w.shape[-3] // hkv * rows, w.shape[-1]))
    return w.sum(-2)


def tol(dtype):
    # the scores are float32 whatever the dtype
    return {np.dtype(np.float64): 1e-6, np.dtype(np.float32): 2e-5}.get(np.dtype(dtype), 2e-3)


def qkv(rng, shape_q, shape_kv, dtype):
    q = rng.standard_normal(shape_q).astype(dtype)
    k, v = (rng.standard_normal(shape_kv).astype(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16, np.float16])
@pytest.mark.parametrize("L, S, G, window", [
    (1, 3000, 4, None),       # decoding, GQA, several key chunks
    (5, 700, 2, 2),           # a short query, the last 2 rows
    (150, 300, 1, 64),        # prefill: the rows before the window on their own path
    (150, 300, 4, None),      # every row of a prefill, in calls of rows
    (40, 90, 2, 1000),        # a window longer than the query: every row
])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_against_the_reference(isa, rng, dtype, L, S, G, window, causal):
    q, k, v = qkv(rng, (2, 2 * G, L, 32), (2, 2, S, 32), dtype)
    out, lse, scores = sdpa.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=G > 1, return_lse=True, return_key_scores=True,
        key_scores_window=window)
    assert scores.shape == (2, 2, S) and scores.dtype == np.float32
    want = expected_scores(q, k, v, window, is_causal=causal)
    np.testing.assert_allclose(scores, want, rtol=tol(dtype), atol=tol(dtype))
    # the output is the call's own, to rounding, and each counted row adds 1
    plain = sdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=G > 1)
    assert_close(out, plain, dtype)
    rows = L if window is None else min(window, L)
    np.testing.assert_allclose(scores.sum(-1), G * rows, rtol=1e-4)


@pytest.mark.parametrize("kw", [
    dict(attn_mask="bool"), dict(attn_mask="float"), dict(is_causal=True), dict(window=(20, 3)),
    dict(key_lengths=np.array([300, 111])), dict(softcap=3.0, alibi_slopes=np.linspace(0.1, 0.4, 4)),
    dict(sinks=np.linspace(-1, 2, 4)),
])
def test_masks_and_variants(isa, rng, kw):
    q, k, v = qkv(rng, (2, 4, 70, 32), (2, 2, 300, 32), np.float32)
    if kw.get("attn_mask") == "bool":
        kw = dict(attn_mask=rng.random((2, 4, 70, 300)) < 0.6)
    elif kw.get("attn_mask") == "float":
        kw = dict(attn_mask=rng.standard_normal((70, 300)).astype(np.float32))
    for window in (None, 7):
        _, scores = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_key_scores=True,
                                                      key_scores_window=window, **kw)
        want = expected_scores(q, k, v, window, **kw)
        np.testing.assert_allclose(scores, want, rtol=2e-5, atol=2e-5)
        if "attn_mask" in kw and kw["attn_mask"].dtype == np.bool_:  # masked keys of every row score 0
            never = ~kw["attn_mask"][..., 70 - (window or 70):, :].any(axis=(1, 2))
            assert (scores[never[:, None, :].repeat(2, 1)] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16])
@pytest.mark.parametrize("L, window", [(1, None), (3, 2)])
def test_many_groups_each_kept_by_its_task(isa, rng, dtype, L, window):
    """With 8 or more key/value groups a group's keys are one task, which keeps
    its p in the thread's scratch and reduces them itself."""
    q, k, v = qkv(rng, (4, 16, L, 32), (4, 4, 2500, 32), dtype)
    for threads in (1, 3):
        out, scores = sdpa.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, is_causal="bottom_right", return_key_scores=True, key_scores_window=window,
            num_threads=threads)
        np.testing.assert_allclose(scores, expected_scores(q, k, v, window, is_causal="bottom_right"),
                                   rtol=tol(dtype), atol=tol(dtype))
        if threads == 1:
            first = scores
        else:
            np.testing.assert_array_equal(scores, first)
    assert_close(out, sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal="bottom_right"), dtype)


def test_thread_count_changes_no_bit(isa, rng):
    q, k, v = qkv(rng, (1, 8, 1, 64), (1, 2, 5000, 64), np.float32)
    got = [sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_key_scores=True, num_threads=t)[1]
           for t in (1, 2, 3)]
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])


def test_batch_dims_and_a_row_with_no_key(rng):
    q, k, v = qkv(rng, (2, 3, 4, 3, 16), (2, 3, 2, 20, 16), np.float32)
    mask = np.ones((3, 20), bool)
    mask[1] = False  # row 1 sees nothing: adds nothing
    _, scores = sdpa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, return_key_scores=True)
    assert scores.shape == (2, 3, 2, 20)
    np.testing.assert_allclose(scores, expected_scores(q, k, v, attn_mask=mask), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(scores.sum(-1), 2 * 2, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3fn"])
def test_kvcache_attend_and_keep(isa, rng, dtype):
    cache = sdpa.KVCache(2, 2, 256, 32, dtype=dtype)
    k = rng.standard_normal((2, 2, 200, 32)).astype(np.float32)
    cache.append(k, -k)
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    out, scores = cache.attend(q, return_key_scores=True)
    want = expected_scores(q, cache.keys.astype(np.float64), cache.values.astype(np.float64))
    np.testing.assert_allclose(scores, want, rtol=1e-3 if dtype != "float32" else 2e-5, atol=1e-5)
    # evict to the 50 best keys of each head: what remains is those keys
    top = np.sort(np.argsort(scores, axis=-1)[..., -50:], axis=-1)
    keys_before = cache.keys.copy()
    cache.keep(top)
    assert len(cache) == 50
    np.testing.assert_array_equal(cache.keys, np.take_along_axis(keys_before, top[..., None], axis=2))
    _, after = cache.attend(q, return_key_scores=True)
    assert after.shape == (2, 2, 50)


def test_keep_refuses_bad_positions():
    cache = sdpa.KVCache(1, 2, 16, 8)
    cache.append(np.ones((1, 2, 10, 8), np.float32), np.ones((1, 2, 10, 8), np.float32))
    for bad, err in [(np.array([[[0, 10]]]), ValueError), (np.array([[[1, 1]]]), ValueError),
                     (np.zeros((1, 3, 2), int), ValueError), (np.array([0.5]), TypeError)]:
        with pytest.raises(err, match="positions"):
            cache.keep(bad)
    assert len(cache) == 10
    rolling = sdpa.KVCache(1, 2, 16, 8, window=8)
    with pytest.raises(ValueError, match="positions"):
        rolling.keep(np.zeros((1, 2, 1), int))


@pytest.mark.parametrize("L, window", [(1, None), (4, 2)])
def test_paged_scores_by_position(isa, rng, L, window):
    kc, vc = (rng.standard_normal((12, 2, 16, 32)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((3, 4, L, 32)).astype(np.float32)
    tables = np.array([[3, 1, 7, 0], [5, 2, -1, -1], [3, 1, 8, 9]], np.int32)  # 0 and 2 share two blocks
    lens = np.array([60, 20, 50])
    out, scores = sdpa.paged_attention(q, kc, vc, tables, lens, return_key_scores=True, key_scores_window=window)
    assert scores.shape == (3, 2, 60)
    for b in range(3):
        k = np.concatenate([kc[i] for i in tables[b] if i >= 0], axis=1)[None, :, :lens[b]]
        v = np.concatenate([vc[i] for i in tables[b] if i >= 0], axis=1)[None, :, :lens[b]]
        want = expected_scores(q[b:b + 1], k, v, window, is_causal="bottom_right")
        np.testing.assert_allclose(scores[b, :, :lens[b]], want[0], rtol=2e-5, atol=2e-5)
        assert not scores[b, :, lens[b]:].any()
    plain = sdpa.paged_attention(q, kc, vc, tables, lens)
    assert_close(out, plain, np.float32)


def test_bad_arguments_are_refused(rng):
    q, k, v = qkv(rng, (1, 2, 4, 16), (1, 2, 10, 16), np.float32)
    f = sdpa.scaled_dot_product_attention
    for kw, err, name in [
        (dict(return_key_scores=True, key_scores_window=0), ValueError, "key_scores_window"),
        (dict(return_key_scores=True, key_scores_window=2.5), TypeError, "key_scores_window"),
        (dict(return_key_scores=True, key_scores_window=True), TypeError, "key_scores_window"),
        (dict(key_scores_window=2), ValueError, "key_scores_window"),
        (dict(return_key_scores="yes"), TypeError, "return_key_scores"),
        (dict(return_key_scores=True, block_mask=sdpa.BlockMask.from_states(np.ones((1, 1), int), 16)),
         ValueError, "block_mask"),
    ]:
        with pytest.raises(err, match=name):
            f(q, k, v, **kw)
    kc = np.ones((2, 2, 4, 16), np.float32)
    with pytest.raises(ValueError, match="return_key_scores"):
        sdpa.paged_attention(q[0].transpose(1, 0, 2), kc, kc, [[0, 1]], [8], query_start_loc=[0, 4],
                             return_key_scores=True)


@pytest.mark.parametrize("heading", ["### Block-sparse attention", "### Key scores"])
def test_the_readme_examples_run(heading, capsys):
    """The README's XAttention-style prefill and H2O-style eviction loop run and
    print what their comments say."""
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    at = readme.index(heading)
    start = readme.index("```python", at) + len("```python")
    code = readme[start:readme.index("```", start)]
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert ("BlockMask(shape=(1, 4, 16, 16)" in printed) if "Block" in heading else printed.strip() == "256"
