"""The backward pass and dropout: sdpa.attention_backward against directional
differences of the float64 reference and against torch (autograd over its
math backend, gradcheck), on every kernel set; dropout's mask against the
reference's Philox, its keep rate, the forward and backward drawing the same
mask; results that do not depend on the thread count; bad input; training
through sdpa.torch and a transformers model."""
from __future__ import annotations

import numpy as np
import pytest

import sdpa
from conftest import assert_close
from sdpa import reference

# (B, Hq, Hkv, L, S, E, Ev) of the variant tests: GQA groups of two, L != S
SIZES = (2, 4, 2, 19, 27, 8, 6)


def variant_kwargs(name, rng, B, Hq, L, S):
    """The forward's keyword arguments of a named variant."""
    if name == "plain":
        return {}
    if name == "bool-mask":
        m = rng.random((B, 1, L, S)) < 0.7
        m[..., 0] = True
        return {"attn_mask": m}
    if name == "bool-mask-empty-rows":
        m = rng.random((L, S)) < 0.5
        m[3] = False  # a row that sees nothing: zeros, no gradient
        return {"attn_mask": m}
    if name == "float-mask":
        return {"attn_mask": rng.standard_normal((Hq, L, S))}
    if name == "causal":
        return {"is_causal": True}
    if name == "causal-bottom-right":
        return {"is_causal": "bottom_right"}
    if name == "key-lengths":
        return {"key_lengths": np.array([S - 9, S])}
    if name == "window":
        return {"window": (4, 2)}
    if name == "window-causal":
        return {"window": (5, 0), "is_causal": True}
    if name == "softcap":
        return {"softcap": 1.5}
    if name == "alibi":
        return {"alibi_slopes": rng.random(Hq)}
    if name == "sinks":
        return {"sinks": rng.standard_normal(Hq)}
    if name == "everything":
        m = rng.random((B, Hq, L, S)) < 0.8
        return {"attn_mask": m, "is_causal": "bottom_right", "key_lengths": np.array([S, S - 5]),
                "window": (9, 3), "softcap": 2.0, "alibi_slopes": rng.random(Hq), "sinks": rng.standard_normal(Hq)}
    raise KeyError(name)


VARIANTS = ["plain", "bool-mask", "bool-mask-empty-rows", "float-mask", "causal", "causal-bottom-right",
            "key-lengths", "window", "window-causal", "softcap", "alibi", "sinks", "everything"]


def problem(rng, dtype=np.float64, sizes=SIZES):
    B, Hq, Hkv, L, S, E, Ev = sizes
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    g = rng.standard_normal((B, Hq, L, Ev)).astype(dtype)
    return q, k, v, g


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_are_the_references_derivatives(variant, isa, rng):
    """Float64: each gradient's inner product with random directions equals the
    central difference of <grad_out, reference(...)> along them (the reference
    is the definition, computed independently in NumPy)."""
    B, Hq, Hkv, L, S, E, Ev = SIZES
    q, k, v, g = problem(rng)
    kw = variant_kwargs(variant, rng, B, Hq, L, S)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
    grads = sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, **kw)
    assert len(grads) == (4 if "sinks" in kw else 3)
    names = ["q", "k", "v"] + (["sinks"] if "sinks" in kw else [])
    inputs = {"q": q, "k": k, "v": v, "sinks": kw.get("sinks")}

    def loss(**moved):
        a = {**inputs, **moved}
        rkw = {**kw, "sinks": a["sinks"]} if "sinks" in kw else kw
        return float(np.sum(g * reference.scaled_dot_product_attention(a["q"], a["k"], a["v"], enable_gqa=True,
                                                                           **rkw)))

    eps = 1e-6
    for name, grad in zip(names, grads):
        x = inputs[name]
        assert grad.shape == x.shape and grad.dtype == np.float64
        for _ in range(2):
            d = rng.standard_normal(x.shape)
            numeric = (loss(**{name: x + eps * d}) - loss(**{name: x - eps * d})) / (2 * eps)
            analytic = float(np.sum(grad * d))
            assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (name, numeric, analytic)


def _torch():
    return pytest.importorskip("torch")


def _torch_math_reference(torch, q, k, v, g, kw, Hq, Hkv):
    """Gradients of torch's math backend, float64, the variants it has none of
    written as its masks (key_lengths, the window, bottom-right causality and
    ALiBi as bool or float masks)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    L, S = q.shape[-2], k.shape[-2]
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    allowed = torch.ones(q.shape[0], Hq, L, S, dtype=torch.bool)
    bias = torch.zeros(q.shape[0], Hq, L, S, dtype=torch.float64)
    o = 0 if kw.get("is_causal") is True else S - L
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    if kw.get("is_causal"):
        allowed &= j <= i + (0 if kw["is_causal"] is True else S - L)
    if "window" in kw:
        left, right = kw["window"]
        allowed &= (j >= i + o - left) & (j <= i + o + right)
    if "key_lengths" in kw:
        allowed &= j[None, None] < torch.tensor(kw["key_lengths"])[:, None, None, None]
    m = kw.get("attn_mask")
    if m is not None and m.dtype == np.bool_:
        allowed &= torch.tensor(m)
    elif m is not None:
        bias += torch.tensor(m)
    if "alibi_slopes" in kw:
        bias -= torch.tensor(kw["alibi_slopes"])[:, None, None] * (i + o - j).abs()
    mask = torch.where(allowed, bias, torch.tensor(-float("inf"), dtype=torch.float64))
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=Hq != Hkv)
    # rows that see nothing: torch's math backend gives NaN there, sdpa zeros (no gradient)
    seen = allowed.any(-1, keepdim=True)
    out = torch.where(seen, out, torch.zeros((), dtype=out.dtype))
    out.backward(torch.tensor(g, dtype=torch.float64))
    return [t.grad.numpy() for t in (tq, tk, tv)]


TORCH_VARIANTS = ["plain", "bool-mask", "bool-mask-empty-rows", "float-mask", "causal", "causal-bottom-right",
                  "key-lengths", "window", "window-causal", "alibi"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", TORCH_VARIANTS)
def test_gradients_match_torchs_math_backend(variant, dtype, isa, rng):
    torch = _torch()
    B, Hq, Hkv, L, S, E, Ev = SIZES
    q, k, v, g = problem(rng, dtype)
    kw = variant_kwargs(variant, rng, B, Hq, L, S)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
    grads = sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, **kw)
    expected = _torch_math_reference(torch, q, k, v, g, kw, Hq, Hkv)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    for got, want in zip(grads, expected):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


GRADCHECK_VARIANTS = ["plain", "bool-mask", "float-mask", "causal", "causal-bottom-right", "key-lengths",
                      "window-causal", "softcap", "alibi", "sinks", "everything"]


@pytest.mark.parametrize("variant", GRADCHECK_VARIANTS)
def test_gradcheck_through_sdpa_torch(variant, isa, rng):
    """torch.autograd.gradcheck (float64 finite differences) of
    sdpa.torch.scaled_dot_product_attention, the sinks' gradient included."""
    torch = _torch()
    import sdpa.torch as st

    B, Hq, Hkv, L, S, E, Ev = 2, 2, 1, 5, 7, 4, 3
    q, k, v, _ = problem(rng, sizes=(B, Hq, Hkv, L, S, E, Ev))
    kw = variant_kwargs(variant, rng, B, Hq, L, S)
    if "key_lengths" in kw:  # sdpa.torch has no key_lengths: the mask it stands for
        kw["attn_mask"] = np.arange(S) < kw.pop("key_lengths")[:, None, None, None]
    tensors = {n: torch.tensor(x) for n, x in kw.items() if isinstance(x, np.ndarray)}
    sinks = tensors.pop("sinks", None)
    other = {n: x for n, x in kw.items() if not isinstance(x, np.ndarray)}
    args = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    if sinks is not None:
        args.append(sinks.requires_grad_())

    def f(*a):
        extra = {"sinks": a[3]} if len(a) > 3 else {}
        return st.scaled_dot_product_attention(*a[:3], enable_gqa=True, **tensors, **other, **extra)

    assert torch.autograd.gradcheck(f, tuple(args))


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_16_bit_gradients_are_close(dtype_name, isa, rng):
    """16-bit operands: the gradients of their own dtype, within a few of its
    ulp of the float64 ones (accumulated in float32)."""
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = sdpa._dtypes.float_dtype(dtype_name)
    q, k, v, g = problem(rng)
    q, k, v, g = (x.astype(dtype) for x in (q, k, v, g))
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True, return_lse=True)
    assert lse.dtype == np.float32
    grads = sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, is_causal=True)
    wide = [x.astype(np.float64) for x in (q, k, v, g)]
    o64, l64 = sdpa.scaled_dot_product_attention(*wide[:3], enable_gqa=True, is_causal=True, return_lse=True)
    expected = sdpa.attention_backward(wide[3], *wide[:3], o64, l64, enable_gqa=True, is_causal=True)
    tol = {"bfloat16": 3e-2, "float16": 4e-3, "float32": 2e-5}[dtype_name]
    for got, want in zip(grads, expected):
        assert got.dtype == dtype
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < tol, err


def test_broadcast_inputs_get_summed_gradients(rng):
    """A key/value shared by the batch (a dim of 1) and a query broadcast over
    heads: their gradients sum over what they broadcast along."""
    q = rng.standard_normal((1, 9, 8))  # broadcast over the 3 heads
    k = rng.standard_normal((1, 3, 11, 8))  # shared by the batch of 2
    v = rng.standard_normal((2, 3, 11, 5))
    g = rng.standard_normal((2, 3, 9, 5))
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, return_lse=True)
    dq, dk, dv = sdpa.attention_backward(g, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qf, kf = np.broadcast_to(q, (2, 3, 9, 8)).copy(), np.broadcast_to(k, (2, 3, 11, 8)).copy()
    dqf, dkf, dvf = sdpa.attention_backward(g, qf, kf, v, out, lse)
    np.testing.assert_allclose(dq, dqf.sum(axis=(0, 1))[None], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk, dkf.sum(axis=0, keepdims=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, dvf, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 2, 1, 300, 260, 64, 64), (3, 8, 8, 70, 90, 32, 16)])
def test_gradients_do_not_depend_on_the_thread_count(shape, rng):
    """Bitwise the same for 1, 2 and 3 threads: dK and dV each summed by one
    task, dQ's key splits (the first shape has them) added in order."""
    q, k, v, g = problem(rng, np.float32, shape)
    kw = {"is_causal": True, "enable_gqa": True}
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    runs = [sdpa.attention_backward(g, q, k, v, out, lse, num_threads=t, dropout_p=0.0, **kw) for t in (1, 2, 3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)


def test_inputs_are_not_written(rng):
    q, k, v, g = problem(rng, np.float32)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True)
    before = [x.copy() for x in (q, k, v, g, out, lse)]
    sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, dropout_p=0.1, seed=3)
    for a, b in zip((q, k, v, g, out, lse), before):
        assert np.array_equal(a, b)


def test_bad_input_names_the_argument(rng):
    q, k, v, g = problem(rng, np.float32)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True)
    with pytest.raises(ValueError, match="grad_out: expected the output's shape"):
        sdpa.attention_backward(g[:, :, :-1], q, k, v, out, lse, enable_gqa=True)
    with pytest.raises(ValueError, match="out: expected the output's shape"):
        sdpa.attention_backward(g, q, k, v, out[..., :-1], lse, enable_gqa=True)
    with pytest.raises(ValueError, match="lse: expected the shape"):
        sdpa.attention_backward(g, q, k, v, out, lse[..., None], enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa.attention_backward(g, q, k, v, out, lse)
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.1)
    for bad in (1.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=bad, seed=1)
    with pytest.raises(TypeError, match="dropout_p"):
        sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, dropout_p=True, seed=1)
    with pytest.raises(ValueError, match="seed"):
        sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.1, seed=-1)
    with pytest.raises(TypeError, match="seed"):
        sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.1, seed=1.5)
    with pytest.raises(ValueError, match="dropout_p: not with return_weights"):
        sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.1, seed=1, return_weights=True)
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, attn_mask=np.zeros((19, 27), np.int32))
    with pytest.raises(ValueError, match="window"):
        sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, window=(-2, 0))


# --------------------------------------------------------------------------- dropout


def core_keep_mask(batch_shape, heads, L, S, p, seed):
    """The core's keep mask, read from a forward whose weights are uniform (q =
    k = 0) over values that are the identity: out[l, s] = keep(l, s) / S / (1 - d),
    d = p rounded up to 2^-16."""
    q = np.zeros(batch_shape + (heads, L, 4))
    k = np.zeros(batch_shape + (heads, S, 4))
    v = np.broadcast_to(np.eye(S), batch_shape + (heads, S, S))
    out = sdpa.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=seed)
    scaled = out * S * (1 - reference.dropout_threshold(p) / 65536)
    assert np.allclose(scaled, np.round(scaled), atol=1e-9)
    return np.round(scaled).astype(bool)


def test_dropout_mask_is_the_references_philox(isa):
    for seed in (0, 12345, 2**64 - 1):
        got = core_keep_mask((2,), 3, 9, 70, 0.3, seed)
        assert np.array_equal(got, reference.dropout_keep(seed, (2,), 3, 9, 70, 0.3))
    a, b = core_keep_mask((), 2, 8, 40, 0.3, 1), core_keep_mask((), 2, 8, 40, 0.3, 2)
    assert not np.array_equal(a, b)  # another seed, another mask


def test_dropout_keep_rate(rng):
    """Each row keeps Binomial(S, 1 - p) keys: the chi-square statistic of the
    rows' counts (and of the keys' counts over the rows) within 6 standard
    deviations of its mean, and the overall rate within 6 of its own."""
    p, L, S = 0.2, 256, 2048
    keep = reference.dropout_keep(7, (), 2, L, S, p)
    assert np.array_equal(keep[:, :32, :256], core_keep_mask((), 2, 32, 256, p, 7))
    for axis, n in ((-1, S), (-2, L)):
        counts = keep.sum(axis=axis)
        chi2 = np.sum((counts - n * (1 - p)) ** 2 / (n * p * (1 - p)))
        dof = counts.size
        assert abs(chi2 - dof) < 6 * np.sqrt(2 * dof), (axis, chi2, dof)
    rate = keep.mean()
    assert abs(rate - (1 - p)) < 6 * np.sqrt(p * (1 - p) / keep.size)


@pytest.mark.parametrize("variant", ["plain", "causal", "sinks", "everything"])
def test_dropout_forward_is_the_reference(variant, isa, rng):
    B, Hq, Hkv, L, S, E, Ev = SIZES
    q, k, v, _ = problem(rng)
    kw = variant_kwargs(variant, rng, B, Hq, L, S)
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.25, seed=99,
                                                 return_lse=True, **kw)
    want, want_lse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.25, seed=99,
                                                            return_lse=True, **kw)
    assert_close(out, want, np.float64)
    assert_close(lse, want_lse, np.float64)  # the lse before dropout
    plain_lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)[1]
    assert_close(lse, plain_lse, np.float64)


@pytest.mark.parametrize("variant", ["plain", "causal", "everything"])
def test_dropout_backward_draws_the_forwards_mask(variant, isa, rng):
    """The gradients of the forward with dropout, checked by directional
    differences of the forward itself (same seed): the backward drops what the
    forward dropped."""
    B, Hq, Hkv, L, S, E, Ev = SIZES
    q, k, v, g = problem(rng)
    kw = variant_kwargs(variant, rng, B, Hq, L, S)
    kw.pop("sinks", None)
    drop = {"dropout_p": 0.3, "seed": 2024}
    out, lse = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw, **drop)
    grads = sdpa.attention_backward(g, q, k, v, out, lse, enable_gqa=True, **kw, **drop)

    def loss(q, k, v):
        return float(np.sum(g * reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw, **drop)))

    eps = 1e-6
    for i, grad in enumerate(grads):
        d = rng.standard_normal(grad.shape)
        plus = [x + eps * d if j == i else x for j, x in enumerate((q, k, v))]
        minus = [x - eps * d if j == i else x for j, x in enumerate((q, k, v))]
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(numeric - float(np.sum(grad * d))) <= 1e-6 * (1 + abs(numeric))


def test_dropout_is_reproducible_and_thread_independent(rng):
    q, k, v, g = problem(rng, np.float32, (2, 4, 2, 130, 150, 32, 32))
    kw = {"enable_gqa": True, "is_causal": True, "dropout_p": 0.1, "seed": 5}
    outs = [sdpa.scaled_dot_product_attention(q, k, v, return_lse=True, num_threads=t, **kw) for t in (1, 2, 3)]
    for o in outs[1:]:
        assert np.array_equal(o[0], outs[0][0]) and np.array_equal(o[1], outs[0][1])
    out, lse = outs[0]
    grads = [sdpa.attention_backward(g, q, k, v, out, lse, num_threads=t, **kw) for t in (1, 2, 3)]
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert np.array_equal(a, b)


def test_dropout_zero_is_the_usual_path(rng):
    q, k, v, _ = problem(rng, np.float32)
    a = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    b = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True, dropout_p=0.0, seed=3)
    assert np.array_equal(a, b)


# --------------------------------------------------------------------------- torch and transformers


def test_sdpa_torch_dropout_follows_torch_manual_seed():
    torch = _torch()
    import sdpa.torch as st

    q = torch.randn(2, 4, 33, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    a = st.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    torch.manual_seed(5)
    b = st.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    c = st.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)

    def f(q, k, v):
        torch.manual_seed(3)
        return st.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)

    small = [torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    assert torch.autograd.gradcheck(f, tuple(small))


def test_torch_compile_trains_through_sdpa():
    torch = _torch()
    import sdpa.torch as st

    q, k, v = (torch.randn(2, 4, 17, 8, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda q, k, v: st.scaled_dot_product_attention(q, k, v, is_causal=True), fullgraph=True)
    out = f(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    eager = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = torch.autograd.grad(eager.sum(), (q, k, v))
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, atol=1e-5)


def _tiny(transformers, torch, kind, **extra):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       **extra)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, **extra)
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_transformers_fine_tuning_step(kind):
    """One training step of a tiny model with sdpa's registered attention: the
    loss and every parameter's gradient those of transformers' "eager"
    attention over a right-padded batch, and of its torch "sdpa" attention
    over a left-padded one (where "eager" gives no key-less rows zeros), without
    dropout; with the module's attention dropout, the step runs on sdpa and is
    reproducible under torch.manual_seed."""
    torch = _torch()
    transformers = pytest.importorskip("transformers")
    import copy

    import sdpa.transformers

    name = sdpa.transformers.register()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    right, left = torch.ones(2, 12, dtype=torch.long), torch.ones(2, 12, dtype=torch.long)
    right[1, 9:] = 0
    left[1, :3] = 0
    for reference_impl, mask in (("eager", right), ("sdpa", left)):
        theirs = _tiny(transformers, torch, kind)
        theirs.set_attn_implementation(reference_impl)
        ours = copy.deepcopy(theirs)
        ours.set_attn_implementation(name)
        losses = []
        for model in (theirs, ours):
            model.train()
            if kind == "bert":  # the hidden dropout of BERT: off, so that the two steps compare
                for module in model.modules():
                    if isinstance(module, torch.nn.Dropout):
                        module.p = 0.0
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, reference_impl
        for (n, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), (reference_impl, n)
    mask = left

    dropout = {"attention_dropout": 0.2} if kind == "llama" else {"attention_probs_dropout_prob": 0.2}
    model = _tiny(transformers, torch, kind, **dropout)
    model.set_attn_implementation(name)
    model.train()
    steps = []
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(11)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        steps.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert steps[0][0] == steps[1][0]
    assert all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1]))


def test_the_readme_example_runs():
    """The README's Training example runs, and its gradients are those of the
    float64 computation of the same call."""
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    at = readme.index("## Training: gradients and dropout")
    start = readme.index("```python", at) + len("```python")
    scope: dict = {}
    exec(compile(readme[start:readme.index("```", start)], "README.md", "exec"), scope)
    q, k, v, kw = (scope[n] for n in ("q", "k", "v", "kw"))
    wide = [x.astype(np.float64) for x in (q, k, v)]
    out, lse = sdpa.scaled_dot_product_attention(*wide, return_lse=True, **kw)
    expected = sdpa.attention_backward(np.ones_like(out), *wide, out, lse, **kw)
    for got, want in zip((scope["dq"], scope["dk"], scope["dv"]), expected):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
