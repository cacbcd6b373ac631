"""sdpa for PyTorch: CPU tensors in, CPU tensors out.

    >>> import torch, sdpa.torch
    >>> q = k = v = torch.randn(2, 8, 128, 64)
    >>> out = sdpa.torch.scaled_dot_product_attention(q, k, v, is_causal=True)

:func:`scaled_dot_product_attention` takes the arguments of
``torch.nn.functional.scaled_dot_product_attention`` and runs sdpa's C core on the
tensors' memory (no copies on the way in).  It is registered as the operator
``torch.ops.sdpa.attention`` (a ``torch.library.custom_op`` with a fake
implementation for shape inference: fake and meta tensors, ``torch.compile`` and
``torch.export``, symbolic sizes included), and :func:`patch` puts it in the place
of torch's own function, so that an eager model calling
``F.scaled_dot_product_attention`` runs on sdpa::

    with sdpa.torch.patch(), torch.inference_mode():
        y = model(x)

Training: a call whose inputs require grad (with grad mode on) runs
``torch.ops.sdpa.attention_fwd``, which keeps each row's lse, and its backward
``torch.ops.sdpa.attention_bwd`` (:func:`sdpa.attention_backward`);
``torch.ops.sdpa.attention`` has the same backward (its forward run again for
the lse).  ``dropout_p > 0`` drops weights with a mask drawn from a seed taken
from torch's default CPU generator (``torch.manual_seed`` makes it
reproducible) and kept for the backward.  The gradients of a float
``attn_mask`` and of ``alibi_slopes`` are not computed (a RuntimeError naming
them when they require grad).

Limits: CPU tensors of float32, float64, bfloat16 or float16 (bfloat16 needs
ml_dtypes, NumPy's bfloat16 dtype); no nested (jagged) tensors.
``patch(fallback=True)`` sends the calls beyond these limits to torch, warning
once for each reason (:class:`FallbackWarning`).  torch's ``CausalBias`` masks
(``torch.nn.attention.bias.causal_upper_left`` / ``causal_lower_right``) are
taken as sdpa's causal masks (``is_causal=True`` / ``"bottom_right"``).  A query
row that can see no key gives zeros, as torch >= 2.5 does.

Importing this module imports torch; ``import sdpa`` alone does not.
"""
import functools
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type, Union, cast

import numpy as np
import torch
from torch import Tensor

from . import _api, _core
from ._dtypes import NEEDS_ML_DTYPES
from ._tensors import DTYPES, SINGLE_OR_HALF, as_numpy, as_tensor, check_on_cpu, eager_numpy, numpy_bfloat16
from .layers import MultiHeadAttention
from .training import attention_backward as _api_backward

# the base of the prepared calls: float keys and values
_PLAIN = _core.plain()

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError(
        f"sdpa.torch needs PyTorch >= 2.4 (torch.library.custom_op); found {torch.__version__}"
    )

# torch.broadcast_shapes, which works on symbolic sizes, is not annotated
_broadcast_shapes: Callable[..., Any] = torch.broadcast_shapes

__all__ = [
    "scaled_dot_product_attention",
    "attention_op",
    "patch",
    "unpatch",
    "is_patched",
    "FallbackWarning",
    "layer_from_module",
    "sparse_attention",
    "index_topk",
    "flex_attention",
]

# what the eager call asks torch each time, bound once
_BF16 = torch.bfloat16
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_transforms = torch._C._are_functorch_transforms_active


def _check_nested(query: Any, key: Any, value: Any, attn_mask: Any) -> None:
    """TypeError for nested tensors, which torch's dispatcher would refuse with a
    bare NotImplementedError."""
    for t, name in ((query, "query"), (key, "key"), (value, "value"), (attn_mask, "attn_mask")):
        if isinstance(t, Tensor) and t.is_nested:
            raise TypeError(
                f"{name}: nested tensors are not supported by sdpa (it has no variable-length path); "
                "pad them into a dense tensor with a mask, or use sdpa.torch.patch(fallback=True) "
                "to let torch compute these calls"
            )


def _check_tensors(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], allow_meta: bool = False
) -> torch.dtype:
    """The dtype of the result; TypeError/ValueError for tensors sdpa cannot take.
    ``allow_meta``: tensors on the meta device too, all on it (shape inference)."""
    _check_nested(query, key, value, attn_mask)
    if _causal_bias_module(attn_mask) is not None:
        raise TypeError(
            "attn_mask: torch's CausalBias holds no mask in its memory; sdpa.torch.scaled_dot_product_attention "
            "(and F.scaled_dot_product_attention under sdpa.torch.patch()) take it, the operator does not: "
            "pass is_causal=True for causal_upper_left, or the bool mask causal_lower_right stands for"
        )
    for t, name in ((query, "query"), (key, "key"), (value, "value"), (attn_mask, "attn_mask")):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not (allow_meta and t.device.type == "meta"):
            check_on_cpu(t, name)
        if t.device != query.device:
            raise ValueError(f"{name}: expected a tensor on {query.device} like the query, got one on {t.device}")
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: expected float32, float64, bfloat16 or float16, got {t.dtype}")
    same = query.dtype == key.dtype == value.dtype
    # beyond torch: a float32 or 16-bit query may attend 16-bit or float32 keys and values
    mixed = key.dtype == value.dtype and all(t.dtype in SINGLE_OR_HALF for t in (query, key, value))
    if not (same or mixed):
        raise TypeError(
            "query, key and value must have the same dtype (or be float32/bfloat16/float16, key "
            f"and value alike); got {query.dtype}, {key.dtype} and {value.dtype}"
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool,) + DTYPES:
        raise TypeError(f"attn_mask: expected a bool mask or a float mask, got {attn_mask.dtype}")
    return query.dtype


@torch.library.custom_op("sdpa::attention", mutates_args=())
def attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[List[int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """The operator ``torch.ops.sdpa.attention``: attention without dropout,
    arguments as for :func:`scaled_dot_product_attention` (``window`` a list of
    two ints).  Its backward runs the forward again for the lse (the autograd
    of :func:`scaled_dot_product_attention` keeps it instead)."""
    return _attention_tensors(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, window, softcap, alibi_slopes, sinks,
    )


def _attention_tensors(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    window: Optional[List[int]],
    softcap: Optional[float],
    alibi_slopes: Optional[Tensor],
    sinks: Optional[Tensor],
    declined: bool = False,
) -> Tensor:
    """The operator's body: its checks, then sdpa on the tensors' memory.
    ``declined``: the core has already declined these arrays as they are (an
    eager call), so they go straight to the general path."""
    _check_tensors(query, key, value, attn_mask)
    _check_variants(query, window, alibi_slopes, sinks)
    call = _PLAIN.prepared(
        is_causal, scale, enable_gqa, None if window is None else (int(window[0]), int(window[1])), softcap,
        None, False, False,
    )
    q, k, v = as_numpy(query), as_numpy(key), as_numpy(value)
    m = None if attn_mask is None else as_numpy(attn_mask)
    slopes = None if alibi_slopes is None else _per_head_numpy(alibi_slopes)
    logits = None if sinks is None else _per_head_numpy(sinks)
    out = None if declined else call.run(q, k, v, m, None, slopes, logits)
    if out is None or isinstance(out, int):
        out = _api.general(call, q, k, v, attn_mask=m, alibi_slopes=slopes, sinks=logits)
    # no weights nor lse asked for: the output alone
    return as_tensor(cast(np.ndarray, out))


def _check_variants(
    query: Tensor, window: Optional[List[int]], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor]
) -> None:
    """The TypeError of :func:`sdpa._checks.window_sides` for a ``window``
    that is not a pair (its sides may be symbolic here), and TypeError /
    ValueError for ``alibi_slopes`` / ``sinks`` that are not float tensors on
    the query's device (their values and shapes are checked by
    :func:`sdpa.scaled_dot_product_attention`)."""
    if window is not None and len(window) != 2:
        _api.window_sides(window)
    for t, name in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != query.device:
            raise ValueError(f"{name}: expected a tensor on {query.device} like the query, got one on {t.device}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float tensor, got {t.dtype}")


def _per_head_numpy(t: Tensor) -> np.ndarray:
    """ALiBi slopes or sinks (a value per head, a few numbers) as float64."""
    return t.detach().to(torch.float64).numpy()


@attention_op.register_fake
def _attention_fake(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[List[int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    dtype = _check_tensors(query, key, value, attn_mask, allow_meta=True)
    _check_variants(query, window, alibi_slopes, sinks)
    plan = _api.plan_shapes(query.shape, key.shape, value.shape, enable_gqa, broadcast=_broadcast_shapes)
    return query.new_empty(plan.out_shape, dtype=dtype)


# ------------------------------------------------------------------ autograd


@torch.library.custom_op("sdpa::attention_fwd", mutates_args=())
def attention_fwd_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[List[int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """``torch.ops.sdpa.attention_fwd``: :func:`attention_op` with dropout
    (``seed`` an int64 tensor of one element, required with ``dropout_p >
    0``), and the lse of each row (float32, float64 for float64 inputs),
    which its backward (``torch.ops.sdpa.attention_bwd``) reuses; what the
    autograd of :func:`scaled_dot_product_attention` runs."""
    _check_tensors(query, key, value, attn_mask)
    _check_variants(query, window, alibi_slopes, sinks)
    call = _PLAIN.prepared(is_causal, scale, enable_gqa, _sides(window), softcap, None, False, True)
    q, k, v = as_numpy(query), as_numpy(key), as_numpy(value)
    m = None if attn_mask is None else as_numpy(attn_mask)
    slopes = None if alibi_slopes is None else _per_head_numpy(alibi_slopes)
    logits = None if sinks is None else _per_head_numpy(sinks)
    dropout = _dropout(dropout_p, seed)
    result = call.run(q, k, v, m, None, slopes, logits, dropout=dropout)
    if isinstance(result, int):
        result = _api.general(call, q, k, v, attn_mask=m, alibi_slopes=slopes, sinks=logits, dropout=dropout)
    out, lse = cast(Tuple[np.ndarray, np.ndarray], result)
    return as_tensor(out), as_tensor(lse)


def _sides(window: Optional[List[int]]) -> Optional[Tuple[int, int]]:
    return None if window is None else (int(window[0]), int(window[1]))


def _dropout(dropout_p: float, seed: Optional[Tensor]) -> Optional[Tuple[float, int]]:
    """The operators' dropout as the core takes it: None, or (p, the seed
    tensor's value as an unsigned 64-bit int)."""
    if dropout_p == 0.0:
        return None
    if seed is None:
        raise ValueError("seed: dropout_p > 0 needs a seed tensor")
    return _api.dropout_args(dropout_p, int(seed.reshape(()).item()) % 2**64)


def _draw_seed() -> Tensor:
    """A seed from torch's default CPU generator (torch.manual_seed makes it
    reproducible), as a tensor the operators take."""
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)


@attention_fwd_op.register_fake
def _attention_fwd_fake(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[List[int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    dtype = _check_tensors(query, key, value, attn_mask, allow_meta=True)
    _check_variants(query, window, alibi_slopes, sinks)
    plan = _api.plan_shapes(query.shape, key.shape, value.shape, enable_gqa, broadcast=_broadcast_shapes)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return query.new_empty(plan.out_shape, dtype=dtype), query.new_empty(plan.out_shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("sdpa::attention_bwd", mutates_args=())
def attention_bwd_op(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[List[int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``torch.ops.sdpa.attention_bwd``: :func:`sdpa.attention_backward` on
    tensors: (grad_query, grad_key, grad_value, grad_sinks), grad_sinks of
    shape (0,) without sinks."""
    grads = _api_backward(
        eager_numpy(grad_out.detach().contiguous()), as_numpy(query), as_numpy(key), as_numpy(value),
        as_numpy(out), as_numpy(lse), attn_mask=None if attn_mask is None else as_numpy(attn_mask),
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=_sides(window), softcap=softcap,
        alibi_slopes=None if alibi_slopes is None else _per_head_numpy(alibi_slopes),
        sinks=None if sinks is None else _per_head_numpy(sinks), **_dropout_kw(dropout_p, seed),
    )
    dq, dk, dv = (as_tensor(np.ascontiguousarray(g)) for g in grads[:3])
    if sinks is None:
        return dq, dk, dv, query.new_empty((0,))
    ds = np.ascontiguousarray(list(grads)[3])
    return dq, dk, dv, torch.from_numpy(ds).to(sinks.dtype).reshape(sinks.shape)


def _dropout_kw(dropout_p: float, seed: Optional[Tensor]) -> Dict[str, Any]:
    d = _dropout(dropout_p, seed)
    return {} if d is None else {"dropout_p": d[0], "seed": d[1]}


@attention_bwd_op.register_fake
def _attention_bwd_fake(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[List[int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    ds = query.new_empty((0,)) if sinks is None else torch.empty_like(sinks, memory_format=torch.contiguous_format)
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format), ds)


def _options(inputs: Tuple[Any, ...]) -> Dict[str, Any]:
    """The operators' arguments after query, key, value, by name."""
    names = ("attn_mask", "is_causal", "scale", "enable_gqa", "window", "softcap", "alibi_slopes", "sinks",
             "dropout_p", "seed")
    return dict(zip(names, inputs[3:]))


_TENSOR_OPTIONS = ("attn_mask", "alibi_slopes", "sinks", "seed")


def _refuse_grads(kw: Dict[str, Any]) -> None:
    """RuntimeError for inputs whose gradient sdpa does not compute."""
    for name in ("attn_mask", "alibi_slopes"):
        t = kw[name]
        if isinstance(t, Tensor) and t.requires_grad:
            raise RuntimeError(
                f"{name}: sdpa computes no gradient of {name}; detach it (a mask or slopes that are not "
                "trained), or use torch's scaled_dot_product_attention for this call"
            )


def _setup_fwd(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    query, key, value = inputs[:3]
    kw = _options(inputs)
    _refuse_grads(kw)
    ctx.inputs = len(inputs)
    ctx.kw = {n: x for n, x in kw.items() if n not in _TENSOR_OPTIONS}
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(query, key, value, output[0], output[1], kw["attn_mask"], kw["alibi_slopes"], kw["sinks"],
                          kw.get("seed"))


def _grads(ctx: Any, grad_out: Tensor, out: Optional[Tensor], lse: Optional[Tensor]) -> Tuple[Any, ...]:
    """The gradients of the operators' inputs (None for the options)."""
    query, key, value, out0, lse0, mask, slopes, sinks, seed = ctx.saved_tensors
    if out is None:
        out, lse = out0, lse0
    if out is None or lse is None:  # sdpa::attention saved no lse: the forward again
        out, lse = attention_fwd_op(query, key, value, mask, alibi_slopes=slopes, sinks=sinks, seed=seed, **ctx.kw)
    dq, dk, dv, ds = attention_bwd_op(grad_out, query, key, value, out, lse, mask, alibi_slopes=slopes,
                                      sinks=sinks, seed=seed, **ctx.kw)
    nones: Tuple[None, ...] = (None,) * (int(ctx.inputs) - 11)
    return (dq, dk, dv, None, None, None, None, None, None, None, ds if sinks is not None else None) + nones


def _backward_fwd(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> Tuple[Any, ...]:
    if grad_out is None:  # the lse is not differentiable (marked so)
        return (None,) * int(ctx.inputs)
    return _grads(ctx, grad_out, None, None)


def _setup_attention(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
    query, key, value = inputs[:3]
    kw = _options(inputs)
    _refuse_grads(kw)
    ctx.inputs = len(inputs)
    ctx.kw = {n: x for n, x in kw.items() if n not in _TENSOR_OPTIONS}
    ctx.save_for_backward(query, key, value, None, None, kw["attn_mask"], kw["alibi_slopes"], kw["sinks"], None)


torch.library.register_autograd("sdpa::attention_fwd", _backward_fwd, setup_context=_setup_fwd)
torch.library.register_autograd(
    "sdpa::attention", lambda ctx, grad_out: _grads(ctx, grad_out, None, None), setup_context=_setup_attention)


def _needs_grad(*tensors: Any) -> bool:
    """Whether autograd records a call on these tensors."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by sdpa.

    Parameters
    ----------
    query, key, value : torch.Tensor
        CPU tensors (..., Hq, L, E), (..., Hkv, S, E), (..., Hkv, S, Ev), all
        float64, or float32 / bfloat16 / float16 (key and value of one dtype,
        which may differ from the query's: a 16-bit cache); any strides.  Batch
        dims broadcast.  16-bit tensors are computed natively (float32
        arithmetic, the output rounded once).  Meta tensors give a meta result
        of the right shape and dtype.
    attn_mask : torch.Tensor, optional
        bool (True takes part) or float (added to the scores), broadcastable to
        (..., Hq, L, S); or torch's ``CausalBias`` of (L, S)
        (``torch.nn.attention.bias.causal_upper_left(L, S)``, the same as
        ``is_causal=True``, or ``causal_lower_right(L, S)``, the causal mask
        aligned to the last query row and key, ``tril(ones(L, S), S - L)``).
    dropout_p : float
        Dropout on the attention weights, as torch's (applied whenever it is
        > 0: models pass 0.0 in eval mode), with a mask drawn from a seed
        taken from torch's default CPU generator.
    is_causal : bool
        Mask with ``tril(ones(L, S))``; may be combined with ``attn_mask``
        (but not with a ``CausalBias``).
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool
        Grouped-query attention (Hq a multiple of Hkv).
    window, softcap : optional
        Sliding-window attention ``(left, right)`` and the cap of the scaled
        scores, as for :func:`sdpa.scaled_dot_product_attention` (the window of
        a row is aligned to the last keys unless ``is_causal`` is True, as for a
        ``causal_lower_right`` mask).
    alibi_slopes, sinks : torch.Tensor, optional
        Float tensors of shape (Hq,) or (..., Hq): ALiBi's slope and the
        attention sink's logit of each query head, as for
        :func:`sdpa.scaled_dot_product_attention`.  ``torch.nn.functional``'s
        function has none of these four keywords.

    Returns
    -------
    torch.Tensor, (..., Hq, L, Ev), of the query's dtype; a new, contiguous,
    plain tensor.

    Raises
    ------
    ValueError
        ``dropout_p`` not in [0, 1), a tensor is not on the CPU, shapes do
        not fit (those of a ``CausalBias`` included).
    TypeError
        Unsupported dtypes; nested tensors.
    RuntimeError
        ``attn_mask`` or ``alibi_slopes`` requires grad (sdpa computes no
        gradient of them).
    """
    declined = False  # the core has declined the arrays as they are
    mask: Any = attn_mask
    causal: Union[bool, str] = is_causal
    if attn_mask is not None and type(attn_mask) is not Tensor:
        mask, causal = _from_causal_bias(query, key, attn_mask, is_causal)
    # the common eager call, straight to the core (torch's dispatcher costs more
    # than the attention of a decoding step): plain CPU tensors of sdpa's dtypes,
    # none requiring grad, not traced or compiled, under no dispatch or function
    # mode and no functorch transform; written out here, as each function call
    # costs a tenth of a microsecond
    if (dropout_p == 0.0 and window is None and softcap is None and alibi_slopes is None and sinks is None
            and type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
            and not (query.requires_grad or key.requires_grad or value.requires_grad)
            and query.is_cpu and key.is_cpu and value.is_cpu
            and (qd := query.dtype) in DTYPES and (kd := key.dtype) in DTYPES and (vd := value.dtype) in DTYPES
            and (mask is None or (type(mask) is Tensor and mask.is_cpu and not mask.requires_grad))
            and not (torch.compiler.is_compiling() or _dispatch_modes() or _function_mode()
                     or _functorch_transforms())):
        try:
            q = query.numpy() if qd is not _BF16 else eager_numpy(query)
            k = key.numpy() if kd is not _BF16 else eager_numpy(key)
            v = value.numpy() if vd is not _BF16 else eager_numpy(value)
            m = None if mask is None else eager_numpy(mask)
        except RuntimeError:  # a tensor numpy() cannot expose (negative bit, no storage): the operator's body
            pass
        else:
            result = _PLAIN.prepared(causal, scale, enable_gqa, None, None, None, False, False).run(q, k, v, m)
            if type(result) is np.ndarray:
                return as_tensor(result)
            declined = True  # the operator's body explains, and the general path computes without a second try
    _api.dropout_args(dropout_p, 0)  # a TypeError or ValueError naming dropout_p
    # torch's dispatcher refuses nested tensors with a bare NotImplementedError
    _check_nested(query, key, value, mask)
    if causal == "bottom_right":  # the operator's is_causal is a bool: the mask itself
        mask, causal = _bottom_right_mask(query, key), False
    sides = None
    if window is not None:
        if not isinstance(window, (tuple, list, Tensor)):
            _api.window_sides(window)  # the TypeError of a window that is not a pair
        sides = list(window)
    if not (window is None and softcap is None and alibi_slopes is None and sinks is None) \
            and isinstance(query, Tensor):  # a TypeError naming the argument, not the dispatcher's RuntimeError
        _check_variants(query, sides, alibi_slopes, sinks)
    if sides is not None:  # ints (not floats or bools), sides past 2**61 taken as 2**61, as sdpa's own
        sides = list(_api.window_sides([s.item() if isinstance(s, Tensor) else s for s in sides]))
    if declined:  # plain eager tensors: the dispatcher would only call the body
        return _attention_tensors(
            query, key, value, mask, bool(causal), scale, enable_gqa, sides, softcap, alibi_slopes, sinks,
            declined=True,
        )
    if dropout_p != 0.0 or _needs_grad(query, key, value, mask, alibi_slopes, sinks):  # keeps the lse
        trained: Tensor = attention_fwd_op(
            query, key, value, mask, bool(causal), scale, enable_gqa, sides, softcap, alibi_slopes, sinks,
            float(dropout_p), _draw_seed() if dropout_p != 0.0 else None,
        )[0]
        return trained
    out: Tensor = attention_op(
        query, key, value, mask, bool(causal), scale, enable_gqa, sides, softcap, alibi_slopes, sinks,
    )
    return out


def _bottom_right_mask(query: Tensor, key: Tensor) -> Tensor:
    """The bool mask of ``is_causal="bottom_right"``, ``tril(ones(L, S), S - L)``."""
    L, S = query.shape[-2], key.shape[-2]
    return torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)


def _causal_bias_module(attn_mask: Any) -> Any:
    """``torch.nn.attention.bias`` when ``attn_mask`` is one of its ``CausalBias``
    masks, else None."""
    if attn_mask is None or type(attn_mask) is Tensor:
        return None
    # a CausalBias comes with its module; it is not imported here, as it imports torch._dynamo
    bias: Any = sys.modules.get("torch.nn.attention.bias")
    if bias is None or not isinstance(attn_mask, bias.CausalBias):
        return None
    return bias


def _from_causal_bias(
    query: Any, key: Any, attn_mask: Any, is_causal: bool
) -> Tuple[Any, Union[bool, str]]:
    """``(attn_mask, is_causal)`` for sdpa: torch's ``CausalBias`` (whose tensor
    memory holds nothing) becomes no mask and ``True`` (upper left) or
    ``"bottom_right"`` (lower right); anything else is returned as it is."""
    bias = _causal_bias_module(attn_mask)
    if bias is None:
        return attn_mask, is_causal
    CausalVariant = bias.CausalVariant
    variant = getattr(attn_mask, "variant", None)
    seq_len_q = getattr(attn_mask, "seq_len_q", None)
    seq_len_kv = getattr(attn_mask, "seq_len_kv", None)
    if variant not in (CausalVariant.UPPER_LEFT, CausalVariant.LOWER_RIGHT) or seq_len_q is None:
        raise ValueError(
            "attn_mask: a CausalBias without its variant and sizes (the result of a tensor "
            "operation on one?); make it with torch.nn.attention.bias.causal_upper_left or "
            "causal_lower_right"
        )
    if is_causal:
        raise ValueError("attn_mask: a CausalBias cannot be combined with is_causal=True (torch refuses it too)")
    L, S = query.shape[-2], key.shape[-2]
    if seq_len_q != L or seq_len_kv != S:
        raise ValueError(
            f"attn_mask: a CausalBias of seq_len_q={seq_len_q}, seq_len_kv={seq_len_kv} does not fit "
            f"a query of length L={L} and keys of length S={S}"
        )
    if variant == CausalVariant.UPPER_LEFT or L == S:
        return None, True
    return None, "bottom_right"


# ------------------------------------------------------------------ layers


def layer_from_module(module: Any, dtype: Any = None) -> MultiHeadAttention:
    """A :class:`sdpa.MultiHeadAttention` with the weights of a
    ``torch.nn.MultiheadAttention``: :meth:`sdpa.MultiHeadAttention.from_torch`,
    whose docstring says what it takes."""
    return MultiHeadAttention.from_torch(module, dtype)


# ------------------------------------------------------------------ patching

_TorchSDPA = Callable[..., Tensor]

# The functions patch() replaced, oldest first: _replaced[0] is torch's own.
_replaced: List[_TorchSDPA] = []


class FallbackWarning(UserWarning):
    """Warned by ``patch(fallback=True)`` the first time it sends a call to torch
    for a given reason (a device, dtypes, nested tensors, a mask that requires grad); once
    per reason and process.  Silence it with
    ``warnings.filterwarnings("ignore", category=sdpa.torch.FallbackWarning)``."""


# the reasons FallbackWarning has been given for
_fallback_warned: Set[str] = set()


def _fallback_reason(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float) -> Optional[str]:
    """Why sdpa cannot take this call (for ``patch(fallback=True)``), or None
    when it can.  ``attn_mask`` is after :func:`_from_causal_bias`."""
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if not all(isinstance(t, Tensor) for t in tensors):
        return "arguments that are not tensors"
    if any(t.is_nested for t in tensors):
        return "nested tensors (sdpa has no variable-length path)"
    for t in tensors:
        if t.device.type != "cpu":
            return f"tensors on {t.device.type} (sdpa computes on the CPU)"
    try:
        _check_tensors(query, key, value, attn_mask)
    except (TypeError, ValueError) as exc:
        return f"dtypes sdpa does not take ({exc})"
    if torch.bfloat16 in (query.dtype, key.dtype, value.dtype):
        try:
            numpy_bfloat16()
        except TypeError:
            return f"bfloat16 tensors ({NEEDS_ML_DTYPES})"
    if isinstance(attn_mask, Tensor) and attn_mask.requires_grad and torch.is_grad_enabled():
        return "masks that require grad (sdpa computes no gradient of attn_mask)"
    return None


def _warn_fallback(reason: str) -> None:
    """FallbackWarning, the first time for this reason."""
    if reason not in _fallback_warned:
        _fallback_warned.add(reason)
        # stacklevel: the caller of F.scaled_dot_product_attention
        warnings.warn(f"sdpa.torch: falling back to torch for {reason}", FallbackWarning, stacklevel=3)


def _with_fallback(previous: _TorchSDPA) -> _TorchSDPA:
    @functools.wraps(scaled_dot_product_attention)
    def sdpa_or_previous(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        # a CausalBias with the wrong sizes is an error here too, not a reason
        mask, causal = _from_causal_bias(query, key, attn_mask, is_causal)
        reason = _fallback_reason(query, key, value, mask, dropout_p)
        if reason is None:
            return scaled_dot_product_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
            )
        _warn_fallback(reason)
        if causal == "bottom_right":
            # a CausalBias is only recognised by torch when it comes through
            # F.scaled_dot_product_attention, which is now this function: torch's
            # own would take it as a plain tensor, so it gets the mask itself
            mask, causal = _bottom_right_mask(query, key), False
        kwargs: Dict[str, Any] = {}  # keywords older torch releases lack are passed only when set
        if scale is not None:
            kwargs["scale"] = scale
        if enable_gqa:
            kwargs["enable_gqa"] = enable_gqa
        return previous(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=bool(causal), **kwargs
        )

    return sdpa_or_previous


def _restore(depth: int) -> None:
    """Undo the patches above the first ``depth`` ones."""
    if len(_replaced) > depth:
        torch.nn.functional.scaled_dot_product_attention = _replaced[depth]
        del _replaced[depth:]


class _Patch:
    """Returned by :func:`patch`; as a context manager, its exit undoes the patch."""

    def __init__(self, depth: int) -> None:
        self._depth = depth

    def __enter__(self) -> "_Patch":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Any) -> None:
        _restore(self._depth)


def patch(fallback: bool = False) -> _Patch:
    """Make ``torch.nn.functional.scaled_dot_product_attention`` run on sdpa.

    Takes effect at once; use it as a context manager (``with sdpa.torch.patch():``)
    to undo it on leaving the block, or call :func:`unpatch`.  Code that calls
    ``F.scaled_dot_product_attention`` (``F`` being ``torch.nn.functional``) through
    the module attribute picks the replacement up; references taken before, such as
    ``from torch.nn.functional import scaled_dot_product_attention``, keep torch's.

    With ``fallback=False`` every call goes to :func:`scaled_dot_product_attention`,
    whose errors say what sdpa cannot do; calls that need gradients or have
    dropout (a model being trained) run on sdpa, backward included.
    With ``fallback=True`` the calls sdpa cannot take (other devices or dtypes,
    nested tensors, a mask that requires grad) go to the function that was
    there before, and a :class:`FallbackWarning` says so, once for each reason
    (``"sdpa.torch: falling back to torch for tensors on meta ..."``).

    Patching is process-wide, for every Python thread.
    """
    F = torch.nn.functional
    depth = len(_replaced)
    previous: _TorchSDPA = F.scaled_dot_product_attention
    _replaced.append(previous)
    F.scaled_dot_product_attention = _with_fallback(previous) if fallback else scaled_dot_product_attention
    return _Patch(depth)


def unpatch() -> None:
    """Put torch's own ``scaled_dot_product_attention`` back (undoing every
    :func:`patch`); does nothing when it is not patched."""
    _restore(0)


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_replaced)


# ---------------------------------------------------------------- sparse attention

_FLOAT8 = {getattr(torch, n): n for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def _sparse_numpy(t: Any, name: str) -> Any:
    """A tensor argument of the sparse functions as NumPy, over its memory;
    float8 tensors as ml_dtypes' float8 arrays.  No autograd: a tensor that
    requires grad is refused."""
    if not isinstance(t, Tensor):
        return t
    check_on_cpu(t, name)
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: sdpa's sparse attention has no backward; call it under torch.no_grad() "
                         "or on detached tensors")
    fp8 = _FLOAT8.get(t.dtype)
    if fp8 is not None:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(NEEDS_ML_DTYPES) from None
        return t.detach().view(torch.uint8).numpy().view(getattr(ml_dtypes, fp8))
    return as_numpy(t)


def sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    indices: Tensor,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    return_lse: bool = False,
    num_threads: Optional[int] = None,
    key_scale: Optional[Tensor] = None,
    value_scale: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`sdpa.sparse_attention` on CPU tensors: each query row attends the
    keys ``indices`` lists for it (top-k sparse attention).

    Shapes and rules are those of :func:`sdpa.sparse_attention`: query (...,
    Hq, L, E), key and value (..., Hkv, S, E / Ev) of a dtype a KV cache
    stores (float8 tensors need no ``kv_dtype``; int8 with ``key_scale`` and
    ``value_scale``), indices int32 or int64 (..., Hkv or 1, L, k), -1
    ignored.  Read in place, no copy of the keys.  Returns a tensor of the
    query's dtype (float32 against a quantized cache for a float64 query),
    and the lse with ``return_lse``.  Forward only: tensors that require grad
    are refused unless gradients are off.

    >>> import torch, sdpa.torch
    >>> q, k = torch.randn(4, 1, 16), torch.randn(1, 50, 16)
    >>> idx = torch.tensor([[[3, 7, 9, -1]]])
    >>> out = sdpa.torch.sparse_attention(q, k, k, idx)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k[:, [3, 7, 9]], k[:, [3, 7, 9]])
    >>> bool(torch.allclose(out, ref, atol=1e-6))
    True
    """
    from .sparse import sparse_attention as _sparse

    res = _sparse(
        _sparse_numpy(query, "query"), _sparse_numpy(key, "key"), _sparse_numpy(value, "value"),
        _sparse_numpy(indices, "indices"), scale=scale, softcap=softcap, sinks=_sparse_numpy(sinks, "sinks"),
        return_lse=return_lse, num_threads=num_threads, key_scale=_sparse_numpy(key_scale, "key_scale"),
        value_scale=_sparse_numpy(value_scale, "value_scale"))
    if return_lse:
        return as_tensor(res[0]), as_tensor(res[1])
    return as_tensor(cast(np.ndarray, res))


def index_topk(
    q_index: Tensor,
    k_index: Tensor,
    weights: Tensor,
    k: int,
    *,
    key_lengths: Optional[Tensor] = None,
    is_causal: bool = False,
    k_scale: Optional[Tensor] = None,
    num_threads: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`sdpa.index_topk` on CPU tensors: the indexer's k best positions
    of each row (int32) and their scores (float32); float8 index keys as
    torch's float8 tensors."""
    from .sparse import index_topk as _topk

    idx, sc = _topk(_sparse_numpy(q_index, "q_index"), _sparse_numpy(k_index, "k_index"),
                    _sparse_numpy(weights, "weights"), k, key_lengths=_sparse_numpy(key_lengths, "key_lengths"),
                    is_causal=is_causal, k_scale=_sparse_numpy(k_scale, "k_scale"), num_threads=num_threads)
    return as_tensor(idx), as_tensor(sc)


# torch BlockMasks already read: the sdpa map and the mask of the partial blocks
_flex_maps: "weakref.WeakKeyDictionary[Any, Tuple[Any, Optional[np.ndarray], bool]]" = weakref.WeakKeyDictionary()


def _flex_map(block_mask: Any, L: int, S: int) -> Tuple[Any, Optional[np.ndarray], bool]:
    """A torch BlockMask as sdpa's (:class:`sdpa.BlockMask`), its mask_mod
    evaluated once into a bool mask (B, H, L, S) that the partial blocks read
    (None when it is torch's noop_mask or no block is partial), and whether
    that mask hides every key above the diagonal; kept for the BlockMask's
    lifetime."""
    from torch.nn.attention import flex_attention as flex  # noqa: PLC0415

    from .blockmask import BlockMask  # noqa: PLC0415

    if not isinstance(block_mask, flex.BlockMask):
        raise TypeError(f"block_mask: expected torch's BlockMask (create_block_mask), got {type(block_mask).__name__}")
    cached = _flex_maps.get(block_mask)
    if cached is not None:
        return cached
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    lengths = tuple(int(x) for x in block_mask.seq_lengths)
    if lengths != (L, S):
        raise ValueError(f"block_mask: made for (L, S) = {lengths}, the call has ({L}, {S})")

    def lists(t: Optional[Tensor]) -> Any:
        return None if t is None else t.detach().to("cpu").numpy()

    full = block_mask.full_kv_num_blocks is not None
    bm = BlockMask(
        lists(block_mask.kv_num_blocks), lists(block_mask.kv_indices),
        full_kv_num_blocks=lists(block_mask.full_kv_num_blocks) if full else None,
        full_kv_indices=lists(block_mask.full_kv_indices) if full else None,
        block_size=(bq, bk), seq_lengths=(L, S),
    )
    mask, causal = None, False
    if (bm.states == 1).any() and block_mask.mask_mod is not flex.noop_mask:
        B, H = bm.states.shape[:2] if bm.states.ndim >= 4 else (1, 1)
        mask = flex.create_mask(block_mask.mask_mod, B, H, L, S, device="cpu").numpy()
        # a mask that shows no key above the diagonal (a causal document mask)
        # goes with is_causal, the same result: the partial blocks on the
        # diagonal then compute each panel's keys up to its last row only
        causal = L <= S and not np.triu(mask, 1).any()
        if causal and _causal_within(mask, bm.states, bq, bk):
            mask = None  # is_causal alone says what the mask says where it is read
    _flex_maps[block_mask] = (bm, mask, causal)
    return bm, mask, causal


# partial blocks beyond which the mask is kept without comparing it to causality
_MAX_COMPARED_BLOCKS = 4096


def _causal_within(mask: np.ndarray, states: np.ndarray, bq: int, bk: int) -> bool:
    """Whether a bool mask (..., L, S) is the causal one in every partial block
    of the states (a causal document mask: the diagonal blocks of each
    document), so that is_causal alone masks them (3% of a document mask's
    time on 8,192 tokens); False past _MAX_COMPARED_BLOCKS such blocks."""
    blocks = np.argwhere(states == 1)
    if len(blocks) > _MAX_COMPARED_BLOCKS:
        return False
    L, S = mask.shape[-2:]
    lead = mask.shape[:-2]
    for at in blocks:
        *heads, i, j = (int(x) for x in at)
        r0, c0 = i * bq, j * bk
        r1, c1 = min(r0 + bq, L), min(c0 + bk, S)
        index = tuple(h if n > 1 else 0 for h, n in zip(heads[-len(lead):], lead)) if lead else ()
        causal = np.arange(r0, r1)[:, None] >= np.arange(c0, c1)[None, :]
        if not np.array_equal(mask[index][r0:r1, c0:c1], causal):
            return False
    return True


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *args: Any,
    block_mask: Any = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    score_mod: Any = None,
    num_threads: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``torch.nn.attention.flex_attention.flex_attention`` with a mask, computed
    by sdpa's block-sparse attention on CPU tensors.

    ``block_mask`` is torch's own ``BlockMask`` (``create_block_mask``): only
    its listed blocks are read and computed; its ``mask_mod`` is evaluated once
    (``create_mask``, kept while the BlockMask lives) into a bool mask that the
    partial blocks read, and the full blocks skip.  query (B, Hq, L, E), key
    and value (B, Hkv, S, E / Ev), float32, float64, bfloat16 or float16;
    ``enable_gqa`` as torch's.  Returns the output, and with ``return_lse``
    the natural log-sum-exp of each row (float32; -inf for a row that sees no
    key), as torch's ``flex_attention`` does.  Forward only.

    ``score_mod`` (by keyword, or in torch's place, the fourth argument) is
    refused with a TypeError naming it: a score modification is Python code per
    score, which sdpa does not run (call torch's ``flex_attention`` for it).
    The block map may also be given fourth, where sdpa's signature puts it.

    >>> import torch, sdpa.torch
    >>> from torch.nn.attention.flex_attention import create_block_mask
    >>> causal = lambda b, h, q, kv: q >= kv
    >>> bm = create_block_mask(causal, None, None, 256, 256, device="cpu")
    >>> q = k = v = torch.randn(1, 2, 256, 64)
    >>> out = sdpa.torch.flex_attention(q, k, v, block_mask=bm)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
    """
    if len(args) > 1:
        raise TypeError(f"flex_attention: takes at most 4 positional arguments, got {len(args) + 3}")
    if args:
        from torch.nn.attention import flex_attention as flex  # noqa: PLC0415

        if isinstance(args[0], flex.BlockMask) and block_mask is None:
            block_mask = args[0]
        elif args[0] is not None:
            score_mod = args[0]
    if score_mod is not None:
        raise TypeError(
            "score_mod: sdpa.torch.flex_attention takes no score modification (Python code run per score); "
            "call torch.nn.attention.flex_attention.flex_attention for it"
        )
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        check_on_cpu(t, name)
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{name}: sdpa.torch.flex_attention has no backward; call it under torch.no_grad()")
    q, k, v = as_numpy(query), as_numpy(key), as_numpy(value)
    bm = mask = None
    causal = False
    if block_mask is not None:
        bm, mask, causal = _flex_map(block_mask, q.shape[-2], k.shape[-2])
    res = _api.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
        block_mask=bm,
        num_threads=num_threads,
    )
    if return_lse:
        out, lse = res
        return as_tensor(out), as_tensor(np.asarray(lse, dtype=np.float32))
    return as_tensor(cast(np.ndarray, res))

