"""sdpa.torch: the torch operator sdpa::attention, its drop-in function, patch(),
and layer_from_module (also reached as sdpa.MultiHeadAttention.from_torch)."""
import contextlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import sdpa
from conftest import assert_close, seed_for
from sdpa.reference import causal_mask
from sdpa.testing import randn

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("sdpa.torch needs torch >= 2.4", allow_module_level=True)

import sdpa.torch as st  # noqa: E402
from sdpa import _core  # noqa: E402

F = torch.nn.functional
TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, taken before any patch

SHAPES = {
    # name: (batch, Hq, Hkv, L, S, E, Ev)
    "small": ((2,), 4, 4, 31, 33, 16, 16),
    "single-query": ((3,), 2, 2, 1, 65, 80, 31),
    "no-batch": ((), 3, 3, 9, 8, 8, 8),
    "two-batch-dims": ((2, 3), 2, 2, 7, 9, 31, 16),
    "gqa-8-2": ((2,), 8, 2, 33, 63, 32, 32),
    "gqa-4-1": ((1,), 4, 1, 65, 31, 16, 8),
}
VARIANTS = ["plain", "causal", "bool-mask", "float-mask", "scale", "causal+scale"]
DTYPES = {"f32": (torch.float32, np.float32), "f64": (torch.float64, np.float64)}


@pytest.fixture(autouse=True)
def no_patch_left_behind():
    st._fallback_warned.clear()  # each test sees the first FallbackWarning of each reason
    yield
    st.unpatch()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def make(name, torch_dtype, seed=0):
    batch, hq, hkv, L, S, E, Ev = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, hq, L, E, generator=gen, dtype=torch_dtype)
    k = torch.randn(*batch, hkv, S, E, generator=gen, dtype=torch_dtype)
    v = torch.randn(*batch, hkv, S, Ev, generator=gen, dtype=torch_dtype)
    return q, k, v


def variant_kwargs(variant, L, S, hq, torch_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    keep = torch.rand(hq, L, S, generator=gen) < 0.7
    keep[..., 0] = True  # every row sees a key (rows that see none: test_rows_that_see_no_key_match_torch)
    if variant == "plain":
        return {}
    if variant == "causal":
        return {"is_causal": True}
    if variant == "bool-mask":
        return {"attn_mask": keep}
    if variant == "float-mask":
        noise = torch.randn(hq, L, S, generator=gen, dtype=torch_dtype)
        return {"attn_mask": torch.where(keep, noise, torch.tensor(float("-inf"), dtype=torch_dtype))}
    if variant == "scale":
        return {"scale": 0.37}
    if variant == "causal+scale":
        return {"is_causal": True, "scale": 1.3}
    raise AssertionError(variant)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_torch(name, variant, dtype):
    torch_dtype, np_dtype = DTYPES[dtype]
    batch, hq, hkv, L, S, E, Ev = SHAPES[name]
    q, k, v = make(name, torch_dtype)
    kwargs = variant_kwargs(variant, L, S, hq, torch_dtype)
    gqa = hq != hkv
    ours = st.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)
    theirs = TORCH_SDPA(q, k, v, enable_gqa=gqa, **kwargs)
    assert isinstance(ours, torch.Tensor)
    assert ours.dtype == torch_dtype and ours.device.type == "cpu"
    assert ours.shape == theirs.shape
    assert_close(ours.numpy(), theirs.numpy(), np_dtype, head_dim=E, scale=2)
    # the operator itself gives the same
    op = torch.ops.sdpa.attention(q, k, v, kwargs.get("attn_mask"), kwargs.get("is_causal", False),
                                  kwargs.get("scale"), gqa)
    assert torch.equal(op, ours)


def test_mask_and_causal_together():
    q, k, v = make("small", torch.float32)
    keep = torch.rand(4, 31, 33, generator=torch.Generator().manual_seed(2)) < 0.7
    keep[..., 0] = True
    ours = st.scaled_dot_product_attention(q, k, v, keep, is_causal=True)
    both = keep & torch.ones(31, 33, dtype=torch.bool).tril()
    assert_close(ours.numpy(), TORCH_SDPA(q, k, v, both).numpy(), np.float32, scale=2)


def test_strided_inputs():
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 31, 4, 16, generator=gen).transpose(1, 2)
    k = torch.randn(2, 65, 2, 16, generator=gen).transpose(1, 2)
    v = torch.randn(2, 65, 2, 24, generator=gen).transpose(1, 2)[..., :12]
    ours = st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True)
    assert ours.is_contiguous()
    assert_close(ours.numpy(), theirs.numpy(), np.float32, scale=2)


def test_grad_mode_tensors_without_grad_are_fine():
    q, k, v = make("small", torch.float32)
    with torch.enable_grad():
        out = st.scaled_dot_product_attention(q, k, v)
    assert not out.requires_grad


def test_inference_mode():
    q, k, v = make("small", torch.float32)
    with torch.inference_mode():
        qi, ki, vi = q.clone(), k.clone(), v.clone()
        out = st.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
    assert_close(out.numpy(), TORCH_SDPA(q, k, v, is_causal=True).numpy(), np.float32, scale=2)


# --------------------------------------------------------------------------- errors


def test_dropout_p_is_checked():
    q, k, v = make("small", torch.float32)
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            st.scaled_dot_product_attention(q, k, v, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout_p"):
        st.scaled_dot_product_attention(q, k, v, dropout_p="0.1")


def test_requires_grad_runs_sdpas_backward():
    """Grad mode on and an input that requires grad: sdpa's forward that keeps
    the lse, and sdpa's backward (tests/test_training.py checks the values)."""
    q, k, v = make("small", torch.float32)
    q.requires_grad_(True)
    out = st.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn is not None and "sdpa" in type(out.grad_fn).__name__.lower()
    assert_close(out.detach().numpy(), TORCH_SDPA(q.detach(), k, v).numpy(), np.float32, scale=2)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.uint8])
def test_other_dtypes_are_refused(dtype):
    q = torch.ones(2, 4, 8, dtype=dtype)
    with pytest.raises(TypeError, match="query: expected float32, float64, bfloat16 or float16"):
        st.scaled_dot_product_attention(q, q, q)


def test_mixed_dtypes_are_refused():
    q = torch.ones(2, 4, 8)
    with pytest.raises(TypeError, match="same dtype"):
        st.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(TypeError, match="same dtype"):
        st.scaled_dot_product_attention(q, q.half(), q.bfloat16())  # key and value differ
    with pytest.raises(TypeError, match="attn_mask"):
        st.scaled_dot_product_attention(q, q, q, torch.zeros(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("path", ["eager", "op"])
def test_16bit_tensors_are_computed_natively(dtype, path):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 33, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, 70, 64, generator=gen).to(dtype)
    v = torch.randn(2, 2, 70, 64, generator=gen).to(dtype)
    mask = torch.rand(8, 33, 70, generator=gen) < 0.8
    mask[..., 0] = True
    run = st.scaled_dot_product_attention if path == "eager" else st.attention_op
    with torch.no_grad():
        out = run(q, k, v, mask, 0.0, False, None, True) if path == "eager" else run(q, k, v, mask, False, None, True)
        theirs = TORCH_SDPA(q, k, v, attn_mask=mask, enable_gqa=True)
        exact = TORCH_SDPA(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    assert out.dtype == dtype and out.shape == theirs.shape
    ours_err = (out.double() - exact).abs().max().item()
    their_err = (theirs.double() - exact).abs().max().item()
    assert ours_err <= 1.5 * their_err + 1e-6
    # the same bits as the NumPy function on the same memory
    np.testing.assert_array_equal(
        out.view(torch.int16).numpy(),
        np.asarray(sdpa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)).view(np.int16),
    )


def test_float32_query_against_a_bfloat16_cache():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 8, 1, 64, generator=gen)
    k, v = (torch.randn(1, 2, 300, 64, generator=gen).bfloat16() for _ in range(2))
    with torch.no_grad():
        out = st.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        exact = TORCH_SDPA(q.double(), k.double(), v.double(), enable_gqa=True)
    assert out.dtype == torch.float32
    assert (out.double() - exact).abs().max().item() < 1e-5


def test_non_tensor_is_refused():
    q = torch.ones(2, 4, 8)
    with pytest.raises((TypeError, RuntimeError)):
        st.scaled_dot_product_attention(q.numpy(), q, q)


def test_shape_errors():
    q = torch.ones(2, 4, 8)
    with pytest.raises(ValueError, match="same last dim"):
        st.scaled_dot_product_attention(q, torch.ones(2, 4, 7), q)


# --------------------------------------------------------------------------- the operator


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 33, 32)
        k = torch.empty(2, 2, 63, 32)
        v = torch.empty(2, 2, 63, 16)
        out = torch.ops.sdpa.attention(q, k, v, None, True, None, True)
        assert out.shape == (2, 8, 33, 16) and out.dtype == torch.float32
        out = torch.ops.sdpa.attention(q[0, 0].double(), k[0, 0].double(), v[0, 0].double())
        assert out.shape == (33, 16) and out.dtype == torch.float64
        with pytest.raises(ValueError, match="enable_gqa"):
            torch.ops.sdpa.attention(q, k, v)


@pytest.mark.parametrize("dtypes", [("f32",) * 2, ("f64",) * 2, ("bf16",) * 2, ("f16",) * 2, ("f32", "bf16"),
                                    ("f32", "f16"), ("bf16", "f32")], ids="-".join)
@pytest.mark.parametrize("how", ["meta", "fake"])
def test_shape_inference(how, dtypes):
    """The fake implementation: meta tensors (also through the drop-in function)
    and FakeTensorMode give the output's shape and the query's dtype, 16-bit
    tensors and a 16-bit cache under a float32 query included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}
    qdt, kvdt = (names[d] for d in dtypes)
    device = "meta" if how == "meta" else "cpu"
    mode = FakeTensorMode() if how == "fake" else contextlib.nullcontext()
    with mode:
        q = torch.empty(3, 8, 5, 32, dtype=qdt, device=device)
        k = torch.empty(3, 2, 7, 32, dtype=kvdt, device=device)
        v = torch.empty(1, 2, 7, 16, dtype=kvdt, device=device)
        mask = torch.empty(5, 7, dtype=torch.bool, device=device)
        results = [
            torch.ops.sdpa.attention(q, k, v, mask, True, None, True),
            st.scaled_dot_product_attention(q, k, v, mask, is_causal=True, enable_gqa=True),
            torch.ops.sdpa.attention(q[0], k[0, :1], v[0, :1]),  # heads broadcast
            torch.ops.sdpa.attention(q[0, 0], k[0, 0], v[0, 0]),  # no head dim
        ]
        shapes = [(3, 8, 5, 16), (3, 8, 5, 16), (8, 5, 16), (5, 16)]
        for out, shape in zip(results, shapes):
            assert out.shape == shape and out.dtype == qdt and out.device.type == device
        with pytest.raises(ValueError, match="enable_gqa"):
            torch.ops.sdpa.attention(q, k, v)
        if how == "meta":
            with pytest.raises(ValueError, match="expected a tensor on meta like the query"):
                torch.ops.sdpa.attention(q, torch.empty_like(k, device="cpu"), v)


def test_torch_compile_keeps_sizes_dynamic():
    """Under torch.compile(dynamic=True) the fake implementation keeps batch and
    sequence sizes symbolic: one graph for every size."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def attend(q, k, v):
        return st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(attend, backend=counter, dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(14)
    for batch, L, S in ((3, 5, 7), (4, 9, 11), (6, 13, 29)):  # no two sizes alike (duck sizing)
        q = torch.randn(batch, 8, L, 16, generator=gen)
        k = torch.randn(batch, 2, S, 16, generator=gen)
        v = torch.randn(batch, 2, S, 12, generator=gen)
        out = compiled(q, k, v)
        assert_close(out.numpy(), TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True).numpy(), np.float32, scale=2)
    assert counter.frame_count == 1


def test_torch_export_with_dynamic_shapes():
    from torch.export import Dim

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)

    B, L, S = Dim("B", min=2, max=64), Dim("L", min=2, max=512), Dim("S", min=2, max=512)
    gen = torch.Generator().manual_seed(15)

    def inputs(batch, l, s):
        return (torch.randn(batch, 8, l, 16, generator=gen), torch.randn(batch, 2, s, 16, generator=gen),
                torch.randn(batch, 2, s, 12, generator=gen), torch.rand(l, s, generator=gen) < 0.8)

    with st.patch():
        program = torch.export.export(
            Attention(), inputs(3, 5, 7),
            dynamic_shapes=({0: B, 2: L}, {0: B, 2: S}, {0: B, 2: S}, {0: L, 1: S}),
        )
    assert "torch.ops.sdpa.attention" in program.graph_module.code
    args = inputs(4, 33, 70)
    args[3][..., 0] = True
    out = program.module()(*args)
    assert out.shape == (4, 8, 33, 12)
    assert_close(out.numpy(), TORCH_SDPA(*args, enable_gqa=True).numpy(), np.float32, scale=2)


SYMBOLIC_CASES = {
    # (query, key, value shapes), enable_gqa
    "gqa": (((3, 8, 5, 16), (3, 2, 7, 16), (3, 2, 7, 12)), True),
    "query-heads-broadcast": (((3, 1, 5, 16), (3, 4, 7, 16), (3, 4, 7, 12)), False),
    "kv-heads-broadcast": (((3, 4, 5, 16), (3, 1, 7, 16), (3, 4, 7, 12)), False),
    "batch-broadcast": (((3, 4, 5, 16), (4, 7, 16), (4, 7, 12)), False),
    "two-batch-dims": (((2, 3, 4, 5, 16), (3, 4, 7, 16), (3, 4, 7, 12)), False),
    "no-heads": (((5, 16), (7, 16), (7, 12)), False),
}


@pytest.mark.parametrize("case", list(SYMBOLIC_CASES))
def test_symbolic_shapes_follow_plan_shapes(case):
    """With symbolic sizes the fake implementation gives the shapes (and errors)
    sdpa._api.plan_shapes gives with ints."""
    from sdpa import _api

    shapes, gqa = SYMBOLIC_CASES[case]
    tensors = [torch.randn(*s) for s in shapes]
    expected = _api.plan_shapes(*shapes, enable_gqa=gqa).out_shape
    compiled = torch.compile(lambda q, k, v: torch.ops.sdpa.attention(q, k, v, None, False, None, gqa),
                             backend="eager", dynamic=True, fullgraph=True)
    assert compiled(*tensors).shape == expected
    with pytest.raises(Exception, match="same last dim"):
        compiled(tensors[0], tensors[1][..., :-1], tensors[2])


@pytest.mark.parametrize("with_mask", [False, True])
def test_opcheck(with_mask):
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck is not available")
    q, k, v = make("gqa-8-2", torch.float32)
    mask = (torch.rand(8, 33, 63, generator=torch.Generator().manual_seed(4)) < 0.7) if with_mask else None
    if mask is not None:
        mask[..., 0] = True
    torch.library.opcheck(torch.ops.sdpa.attention.default, (q, k, v, mask, True, 0.3, True))
    q.requires_grad_(True)
    torch.library.opcheck(torch.ops.sdpa.attention.default, (q, k, v, mask, True, 0.3, True))
    torch.library.opcheck(torch.ops.sdpa.attention_fwd.default, (q, k, v, mask, True, 0.3, True))


# --------------------------------------------------------------------------- window, softcap, ALiBi, sinks

VARIANT_KWARGS = {
    "window": {"window": (3, 0)},
    "window-both-sides": {"window": (2, 4)},
    "softcap": {"softcap": 2.5},
    "alibi": {"alibi_slopes": "per-head"},
    "sinks": {"sinks": "per-head"},
    "all": {"window": (5, 1), "softcap": 4.0, "alibi_slopes": "per-head", "sinks": "per-head"},
}


def variant_inputs(name, dtype, seed):
    """q, k, v with GQA (L < S), and the keywords of one variant, per-head values
    as float32 tensors of shape (Hq,) or (batch, Hq)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, 16, generator=gen).to(dtype)
    k = torch.randn(2, 2, 12, 16, generator=gen).to(dtype)
    v = torch.randn(2, 2, 12, 8, generator=gen).to(dtype)
    kwargs = dict(VARIANT_KWARGS[name])
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = torch.rand(4, generator=gen) / 2
    if "sinks" in kwargs:
        kwargs["sinks"] = torch.randn(2, 4, generator=gen)
    return q, k, v, kwargs


def reference_of(q, k, v, **kwargs):
    as_numpy = {n: (a.double().numpy() if isinstance(a, torch.Tensor) else a) for n, a in kwargs.items()}
    return sdpa.reference.scaled_dot_product_attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), enable_gqa=True, **as_numpy
    )


@pytest.mark.parametrize("causal", ["none", "upper-left", "lower-right"])
@pytest.mark.parametrize("name", list(VARIANT_KWARGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
def test_variant_keywords_match_reference(dtype, name, causal):
    """window=, softcap=, alibi_slopes= and sinks= are passed to sdpa's core as
    sdpa.scaled_dot_product_attention takes them; is_causal=True and a
    causal_lower_right mask set the rows' alignment as "top_left" and
    "bottom_right" do."""
    q, k, v, kwargs = variant_inputs(name, dtype, seed=21)
    mask, ref_causal = None, False
    if causal == "upper-left":
        ours_causal = {"is_causal": True}
        ref_causal = True
    elif causal == "lower-right":
        mask = causal_bias("causal_lower_right", 7, 12)
        ours_causal, ref_causal = {}, "bottom_right"
    else:
        ours_causal = {}
    with torch.no_grad():
        out = st.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, **ours_causal, **kwargs)
    expected = reference_of(q, k, v, is_causal=ref_causal, **kwargs)
    assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == (2, 4, 7, 8)
    tol_dtype = {torch.float32: np.float32, torch.float64: np.float64}.get(dtype) or st.numpy_bfloat16()
    assert_close(out.double().numpy(), expected, tol_dtype)


def test_variant_keywords_through_the_operator():
    """Traced (symbolic sizes) and checked by opcheck, the keywords reach the
    operator; meta tensors get the output's shape."""
    q, k, v, kwargs = variant_inputs("all", torch.float32, seed=22)
    expected = reference_of(q, k, v, is_causal=True, **kwargs)
    compiled = torch.compile(lambda *a: st.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True, **kwargs),
                             backend="eager", dynamic=True, fullgraph=True)
    assert_close(compiled(q, k, v).numpy(), expected, np.float32)
    args = (q, k, v, None, True, None, True, [5, 1], 4.0, kwargs["alibi_slopes"], kwargs["sinks"])
    if hasattr(torch.library, "opcheck"):
        torch.library.opcheck(torch.ops.sdpa.attention.default, args)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.ops.sdpa.attention(*meta)
    assert out.device.type == "meta" and out.shape == (2, 4, 7, 8) and out.dtype == torch.float32


def test_variant_keywords_are_checked():
    q, k, v, kwargs = variant_inputs("all", torch.float32, seed=23)
    slopes = kwargs["alibi_slopes"]
    with torch.no_grad():
        with pytest.raises(TypeError, match="alibi_slopes: expected a float tensor, got torch.int64"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, alibi_slopes=torch.ones(4, dtype=torch.long))
        with pytest.raises(TypeError, match="sinks: expected a torch.Tensor, got list"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=[0.0] * 4)
        with pytest.raises(TypeError, match="window: expected a pair"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=(1, 2, 3))
        # each side as sdpa's own checks it, before the dispatcher's RuntimeError
        with pytest.raises(TypeError, match="window: the left side must be an int, got float"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=(1.5, 0))
        with pytest.raises(TypeError, match="window: the right side must be an int, got bool"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=(1, True))
        with pytest.raises(ValueError, match="window: the left side must be >= 0"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=(-2, 0))
        with pytest.raises(TypeError, match="window: expected a pair"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=3)
        # a side beyond int64 shows every key, as it does for sdpa.scaled_dot_product_attention
        wide = st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=(10**20, 0))
        plain = st.scaled_dot_product_attention(q, k, v, enable_gqa=True, window=(-1, 0))
        assert torch.equal(wide, plain)
        with pytest.raises(ValueError, match="softcap"):
            st.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=-1.0)
    with pytest.raises(RuntimeError, match="alibi_slopes: sdpa computes no gradient"):
        st.scaled_dot_product_attention(q, k, v, enable_gqa=True, alibi_slopes=slopes.requires_grad_())


def test_import_sdpa_does_not_import_torch():
    code = ("import sys, sdpa; sdpa.scaled_dot_product_attention([[1.0]], [[1.0]], [[1.0]]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- patch()


class TinyAttention(torch.nn.Module):
    """A self-attention block calling F.scaled_dot_product_attention, as models do."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(TinyAttention(), torch.nn.GELU(), TinyAttention()).eval()
    x = torch.randn(3, 17, 32)
    return model, x


def test_patch_as_context_manager(model_and_input):
    model, x = model_and_input
    calls = []

    with torch.no_grad():
        expected = model(x)
        with st.patch():
            assert st.is_patched()
            assert F.scaled_dot_product_attention is st.scaled_dot_product_attention
            _core.set_observer(lambda handed: calls.append(1))
            try:
                got = model(x)
            finally:
                _core.set_observer(None)
        assert not st.is_patched()
        assert F.scaled_dot_product_attention is TORCH_SDPA
    assert len(calls) == 2  # both blocks ran on sdpa's core
    assert_close(got.numpy(), expected.numpy(), np.float32, scale=5)


def test_patch_with_masks(model_and_input):
    model, x = model_and_input
    mask = torch.rand(17, 17, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[:, 0] = True
    with torch.inference_mode():
        expected = model[0](x, mask)
        with st.patch():
            got = model[0](x, mask)
    assert_close(got.numpy(), expected.numpy(), np.float32, scale=5)


def test_patch_and_unpatch_as_functions(model_and_input):
    model, x = model_and_input
    st.patch()
    try:
        assert F.scaled_dot_product_attention is st.scaled_dot_product_attention
        with torch.no_grad():
            got = model(x)
    finally:
        st.unpatch()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    st.unpatch()  # a second time does nothing
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with torch.no_grad():
        assert_close(got.numpy(), model(x).numpy(), np.float32, scale=5)


def test_nested_patches():
    with st.patch():
        with st.patch(fallback=True):
            assert F.scaled_dot_product_attention is not st.scaled_dot_product_attention
            assert st.is_patched()
        assert F.scaled_dot_product_attention is st.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with st.patch():
        st.patch()
        st.unpatch()  # undoes both
        assert F.scaled_dot_product_attention is TORCH_SDPA
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_patch_is_undone_on_errors():
    with pytest.raises(ZeroDivisionError), st.patch():
        raise ZeroDivisionError
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_patched_model_trains_on_sdpa(model_and_input):
    """A plain model(x) whose parameters require grad: sdpa's forward and
    backward, the gradients of torch's own."""
    model, x = model_and_input
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with st.patch():
        got = model(x)
    got.sum().backward()
    assert_close(got.detach().numpy(), expected.detach().numpy(), np.float32, scale=4)
    for p, g in zip(model.parameters(), grads):
        assert_close(p.grad.numpy(), g.numpy(), np.float32, scale=16)


def test_fallback(model_and_input, monkeypatch):
    model, x = model_and_input
    calls = []
    real = st.scaled_dot_product_attention
    monkeypatch.setattr(st, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with st.patch(fallback=True):
        y = model(x)  # grad required: sdpa's backward
        y.sum().backward()
        assert len(calls) == 2
        q = torch.randn(2, 4, 8, dtype=torch.float16)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # dropout: sdpa's too
        assert out.dtype == torch.float16 and len(calls) == 3
        mask = torch.zeros(4, 4, requires_grad=True)
        with pytest.warns(st.FallbackWarning, match="masks that require grad"):
            F.scaled_dot_product_attention(q.float(), q.float(), q.float(), attn_mask=mask)  # torch's own
        assert len(calls) == 3


def test_fallback_warns_once_per_reason_and_matches_torch():
    """Repeated calls sdpa cannot take (a trained mask): one FallbackWarning,
    pointing at the caller; torch's results and gradients."""
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    mask = torch.zeros(8, 8, requires_grad=True)
    expected = TORCH_SDPA(q, q, q, attn_mask=mask)
    with warnings.catch_warnings(record=True) as caught, st.patch(fallback=True):
        warnings.simplefilter("always")
        for _ in range(3):
            got = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    ours = [w for w in caught if issubclass(w.category, st.FallbackWarning)]
    assert [str(w.message) for w in ours] == [
        "sdpa.torch: falling back to torch for masks that require grad (sdpa computes no gradient of attn_mask)",
    ]
    assert ours[0].filename == __file__  # the caller of F.scaled_dot_product_attention
    assert torch.equal(got, expected)


def test_fallback_for_other_devices():
    """Meta tensors (what sdpa cannot compute on, like CUDA): torch's own, with a warning."""
    q = torch.empty(2, 4, 5, 8, device="meta")
    with st.patch(fallback=True), pytest.warns(st.FallbackWarning, match="tensors on meta"):
        out = F.scaled_dot_product_attention(q, q, q)
    assert out.device.type == "meta" and out.shape == (2, 4, 5, 8)


def test_fallback_for_bfloat16_without_ml_dtypes(monkeypatch):
    def missing():
        raise TypeError("no ml_dtypes")

    monkeypatch.setattr(st, "numpy_bfloat16", missing)
    q = torch.randn(2, 4, 5, 8, dtype=torch.bfloat16)
    with torch.no_grad(), st.patch(fallback=True), pytest.warns(st.FallbackWarning, match="ml_dtypes"):
        out = F.scaled_dot_product_attention(q, q, q)
    assert torch.equal(out, TORCH_SDPA(q, q, q))


def test_fallback_does_not_warn_for_calls_sdpa_takes(model_and_input):
    model, x = model_and_input
    with warnings.catch_warnings(), st.patch(fallback=True), torch.no_grad():
        warnings.simplefilter("error")
        model(x)


# --------------------------------------------------------------------------- torch's CausalBias masks


def causal_bias(variant, L, S):
    from torch.nn.attention import bias

    with warnings.catch_warnings():  # lower right with L > S: torch warns of NaN, but gives zeros
        warnings.simplefilter("ignore")
        return getattr(bias, variant)(L, S)


@pytest.mark.parametrize("how", ["direct", "patch", "fallback"])
@pytest.mark.parametrize("L,S", [(3, 5), (5, 3), (4, 4), (1, 7), (37, 70)])
@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
def test_causal_bias_matches_torch(variant, L, S, how):
    """torch's CausalBias holds no mask in its memory: sdpa takes it as its causal
    flag (upper left: is_causal=True; lower right: "bottom_right"), builds no mask,
    and returns a plain tensor."""
    gen = torch.Generator().manual_seed(L * 100 + S)
    q = torch.randn(2, 4, L, 16, generator=gen)
    k = torch.randn(2, 4, S, 16, generator=gen)
    v = torch.randn(2, 4, S, 8, generator=gen)
    mask = causal_bias(variant, L, S)
    expected = TORCH_SDPA(q, k, v, attn_mask=mask)
    reference = TORCH_SDPA(q, k, v, attn_mask=mask._materialize())
    assert torch.allclose(expected, reference, atol=1e-6)  # torch's own is right
    seen = []
    _core.set_observer(lambda handed: seen.append(handed["mask"]))
    try:
        with torch.no_grad():
            if how == "direct":
                out = st.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                with st.patch(fallback=how == "fallback"):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    finally:
        _core.set_observer(None)
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == (2, 4, L, 8)
    assert seen == [None]  # on sdpa's core, with no mask
    assert_close(out.numpy(), expected.numpy(), np.float32, scale=2)


@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_causal_bias_with_gqa_and_16bit(variant, dtype):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 9, 32, generator=gen).to(dtype)
    k = torch.randn(2, 2, 21, 32, generator=gen).to(dtype)
    v = torch.randn(2, 2, 21, 32, generator=gen).to(dtype)
    mask = causal_bias(variant, 9, 21)  # a float32 tensor, whatever the query's dtype
    with torch.no_grad():
        out = st.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        exact = TORCH_SDPA(q.double(), k.double(), v.double(), attn_mask=mask._materialize(), enable_gqa=True)
        theirs = TORCH_SDPA(q, k, v, attn_mask=mask, enable_gqa=True)
    assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == (2, 8, 9, 32)
    ours_err = (out.double() - exact).abs().max().item()
    their_err = (theirs.double() - exact).abs().max().item()
    assert ours_err <= 1.5 * their_err + 1e-6


@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
def test_causal_bias_through_the_operator(variant):
    """Traced by torch.compile, the call goes through torch.ops.sdpa.attention
    (lower right as the mask it stands for)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8)
    mask = causal_bias(variant, 3, 5)
    compiled = torch.compile(st.scaled_dot_product_attention, backend="eager", fullgraph=True)
    out = compiled(q, k, v, mask)
    assert type(out) is torch.Tensor
    assert_close(out.numpy(), TORCH_SDPA(q, k, v, attn_mask=mask).numpy(), np.float32, scale=2)


@pytest.mark.parametrize("L,S", [(3, 5), (5, 3)])
@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
def test_causal_bias_with_gradients(variant, L, S):
    """A call that needs gradients under the patch runs on sdpa, the bias
    taken as its causal flag: torch's results and gradients."""
    gen = torch.Generator().manual_seed(L * 10 + S)
    q = torch.randn(2, 4, L, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 4, S, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 4, S, 8, generator=gen)
    mask = causal_bias(variant, L, S)
    expected = TORCH_SDPA(q, k, v, attn_mask=mask)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k))
    with warnings.catch_warnings(), st.patch(fallback=True):
        warnings.simplefilter("error", st.FallbackWarning)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert type(got) is torch.Tensor
    assert torch.allclose(got, expected, atol=1e-6)
    for g, e in zip(torch.autograd.grad(got.sum(), (q, k)), expected_grads):
        assert torch.allclose(g, e, atol=1e-6)


def test_causal_bias_is_refused_by_the_operator():
    """The operator gets the bias's (empty) memory, so it says what to pass instead."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    for variant in ("causal_upper_left", "causal_lower_right"):
        with pytest.raises(TypeError, match="CausalBias holds no mask.*the operator does not"):
            torch.ops.sdpa.attention(q, k, k, causal_bias(variant, 3, 5))


@pytest.mark.parametrize("fallback", [None, False, True])
def test_causal_bias_of_other_sizes_is_refused(fallback):
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)

    def call(mask, **kw):
        if fallback is None:
            return st.scaled_dot_product_attention(q, k, k, attn_mask=mask, **kw)
        with st.patch(fallback=fallback):
            return F.scaled_dot_product_attention(q, k, k, attn_mask=mask, **kw)

    with torch.no_grad():
        for mask in (causal_bias("causal_upper_left", 4, 5), causal_bias("causal_lower_right", 3, 6)):
            with pytest.raises(ValueError, match="CausalBias of seq_len_q=.* does not fit a query of length L=3"):
                call(mask)
        with pytest.raises(ValueError, match="CausalBias cannot be combined with is_causal=True"):
            call(causal_bias("causal_lower_right", 3, 5), is_causal=True)


# --------------------------------------------------------------------------- nested tensors


def jagged(lengths, heads=2, dim=8, seed=0):
    """A nested (jagged) tensor (B, heads, j, dim), laid out as torch's docs show."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, heads, dim, generator=gen) for n in lengths]
    with warnings.catch_warnings():  # the jagged layout is a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_fall_back_to_torch():
    q, k, v = jagged([3, 5], seed=1), jagged([3, 5], seed=2), jagged([3, 5], seed=3)
    with torch.no_grad():
        expected = TORCH_SDPA(q, k, v)
        with st.patch(fallback=True), pytest.warns(st.FallbackWarning, match="nested tensors"):
            got = F.scaled_dot_product_attention(q, k, v)
    assert got.is_nested
    for a, b in zip(got.unbind(), expected.unbind()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused_without_fallback():
    q = jagged([3, 5])
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])
    message = r"query: nested tensors are not supported by sdpa.*sdpa\.torch\.patch\(fallback=True\)"
    with torch.no_grad():
        for t in (q, strided):
            with pytest.raises(TypeError, match=message):
                st.scaled_dot_product_attention(t, t, t)
        with st.patch(), pytest.raises(TypeError, match=message):
            F.scaled_dot_product_attention(q, q, q)


# --------------------------------------------------------------------------- rows that see no key


@pytest.mark.skipif(torch.__version__ < "2.5", reason="torch < 2.5 gives NaN for rows that see no key")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
def test_rows_that_see_no_key_match_torch(dtype):
    """Such rows give zeros, in sdpa and in torch >= 2.5 alike."""
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 3, 6, 16, generator=gen).to(dtype)
    k = torch.randn(2, 3, 9, 16, generator=gen).to(dtype)
    v = torch.randn(2, 3, 9, 16, generator=gen).to(dtype)
    keep = torch.rand(3, 6, 9, generator=gen) < 0.6
    keep[:, 2] = False
    additive = torch.zeros(3, 6, 9, dtype=dtype).masked_fill(~keep, float("-inf"))
    with torch.no_grad():
        for mask in (keep, additive):
            out = st.scaled_dot_product_attention(q, k, v, mask)
            theirs = TORCH_SDPA(q, k, v, mask)
            assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
            assert torch.equal(theirs[..., 2, :], torch.zeros_like(theirs[..., 2, :]))


# --------------------------------------------------------------------------- layers from modules

# sdpa.MultiHeadAttention.from_torch hands over to sdpa.torch.layer_from_module
CONVERTERS = {
    "from_torch": lambda module: sdpa.MultiHeadAttention.from_torch(module),
    "layer_from_module": lambda module: st.layer_from_module(module),
}


@pytest.mark.parametrize("convert", list(CONVERTERS))
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_from_module_matches_torch(rng, batch_first, bias, dtype, convert):
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    torch.manual_seed(seed_for(f"torch-{batch_first}-{bias}-{dtype.__name__}"))
    module = torch.nn.MultiheadAttention(32, 4, bias=bias, batch_first=batch_first, dtype=tdtype).eval()
    layer = CONVERTERS[convert](module)
    assert isinstance(layer, sdpa.MultiHeadAttention)
    assert layer.dtype == dtype and layer.num_heads == 4 and layer.num_kv_heads == 4
    assert (layer.b_q is None) == (not bias) and (layer.b_o is None) == (not bias)
    x = randn(rng, (3, 7, 32), dtype)  # (batch, T, E)
    tx = torch.from_numpy(x if batch_first else np.ascontiguousarray(x.transpose(1, 0, 2)))
    with torch.no_grad():
        expected = module(tx, tx, tx, need_weights=False)[0].numpy()
        # torch's bool attn_mask: True = may NOT attend
        blocked = torch.from_numpy(~causal_mask(7, 7))
        expected_causal = module(tx, tx, tx, attn_mask=blocked, need_weights=False)[0].numpy()
    if not batch_first:
        expected = expected.transpose(1, 0, 2)
        expected_causal = expected_causal.transpose(1, 0, 2)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(layer(x, causal=False), expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(layer(x, causal=True), expected_causal, rtol=tol, atol=tol)


@pytest.mark.parametrize("convert", list(CONVERTERS))
@pytest.mark.parametrize("tdtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_layer_from_a_16bit_module(rng, tdtype, convert):
    """A 16-bit module's weights are read as they are (bfloat16 as ml_dtypes'
    bfloat16: Tensor.numpy() refuses bfloat16), and the layer keeps the dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    torch.manual_seed(3)
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True).to(tdtype).eval()
    layer = CONVERTERS[convert](module)
    want = np.dtype(ml_dtypes.bfloat16) if tdtype == torch.bfloat16 else np.dtype(np.float16)
    assert layer.dtype == want and layer.w_q.dtype == want and layer.b_o.dtype == want
    w = module.in_proj_weight.detach().float().numpy()
    np.testing.assert_array_equal(layer.w_k.astype(np.float32), w[32:64].T)
    np.testing.assert_array_equal(layer.b_o.astype(np.float32), module.out_proj.bias.detach().float().numpy())
    x = randn(rng, (2, 5, 32), np.float32)
    with torch.no_grad():
        expected = module(*(torch.from_numpy(x).to(tdtype),) * 3, need_weights=False)[0].float().numpy()
    got = layer(x.astype(want), causal=False).astype(np.float32)
    tol = 0.05 if tdtype == torch.bfloat16 else 0.01
    assert np.abs(got - expected).max() < tol * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("convert", list(CONVERTERS))
def test_layer_from_module_rejects_unsupported_modules(convert):
    nn = torch.nn
    with pytest.raises(ValueError, match="add_bias_kv"):
        CONVERTERS[convert](nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        CONVERTERS[convert](nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="kdim"):
        CONVERTERS[convert](nn.MultiheadAttention(8, 2, kdim=4, vdim=4))


# --------------------------------------------------------------------------- a 16-bit model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16bit_transformers_model_runs_on_sdpa(dtype):
    """A bfloat16 / float16 Llama under patch() (no fallback): every attention call
    reaches sdpa's core in the model's dtype, and the logits match torch's own."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits.float()
    seen = []
    _core.set_observer(lambda handed: seen.append(handed["q"].dtype))
    try:
        with torch.no_grad(), st.patch():
            got = model(ids).logits.float()
            generated = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    finally:
        _core.set_observer(None)
    assert seen and all(d.itemsize == 2 for d in seen)  # 16-bit all the way
    assert generated.shape == (1, 16)
    tol = 0.05 if dtype == torch.bfloat16 else 0.01
    assert (got - expected).abs().max().item() < tol * max(1.0, expected.abs().max().item())


def test_an_eager_call_the_core_declines_is_tried_once(monkeypatch):
    """A plain eager call goes to the core's prepared call; one it declines (here a
    float16 mask under a float32 query, which converts) goes to the general
    path without a second try through the operator: two entries in all, the
    decline and the general path's call with converted operands."""
    codes = []

    class Counting:
        """A prepared call whose runs are counted."""

        def __init__(self, call):
            self.call = call

        def __getattr__(self, name):
            return getattr(self.call, name)

        def prepared(self, *options):
            return Counting(self.call.prepared(*options))

        def counted(self, result):
            codes.append(result if isinstance(result, int) else "computed")
            return result

        def run(self, *args, **kw):
            return self.counted(self.call.run(*args, **kw))

        def run_cache(self, *args, **kw):
            return self.counted(self.call.run_cache(*args, **kw))

    monkeypatch.setattr(st, "_PLAIN", Counting(st._PLAIN))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (3, 5, 5))
    mask = torch.randn(3, 5, generator=gen).half()
    with torch.no_grad():
        got = st.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(codes) == 2 and isinstance(codes[0], int) and codes[1] == "computed", codes
    assert _core.reason(codes[0]).startswith("attn_mask has a dtype")
    want = sdpa.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=mask.numpy())
    np.testing.assert_array_equal(got.numpy(), want)
    codes.clear()
    with torch.no_grad():
        st.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
    assert codes == ["computed"]
