"""The backward pass of attention: the gradients of query, key and value (and
of attention sinks) from the gradient of the output.

    >>> import numpy as np, sdpa
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 16, 8)).astype(np.float32)
    >>> out, lse = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    >>> dq, dk, dv = sdpa.attention_backward(np.ones_like(out), q, k, v, out, lse, is_causal=True)

The probabilities are recomputed a tile at a time from the forward's lse
(FlashAttention-2), so no (L, S) array is ever made.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import numpy as np

from . import _core
from ._checks import (
    _causal_offset,
    call_constants,
    dropout_args,
    head_values,
    key_lengths_checked,
    mask_checked,
    plan_shapes,
    scale_of,
)
from ._dtypes import Array, ArrayInput, FloatArray, _as_operand, _check_real, _to_array, compute_dtype, operand_dtypes

__all__ = ["attention_backward"]

Grads = Union[Tuple[FloatArray, FloatArray, FloatArray], Tuple[FloatArray, FloatArray, FloatArray, FloatArray]]


def _canonical(a: Array, dims: int) -> Array:
    """``a`` with leading dims of 1 up to ``dims`` dims (a view)."""
    return a.reshape((1,) * (dims - a.ndim) + a.shape) if a.ndim < dims else a


def _summed(grad: Array, shape: Tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """``grad`` (the full, broadcast shape) summed over the dims its operand
    of ``shape`` broadcast along, as that operand's ``dtype``."""
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    if axes:
        acc = np.float64 if grad.dtype == np.float64 else np.float32
        grad = grad.sum(axis=axes, dtype=acc, keepdims=True).reshape(shape)
    return np.asarray(grad.astype(dtype, copy=False))


def attention_backward(
    grad_out: ArrayInput,
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    out: ArrayInput,
    lse: ArrayInput,
    *,
    attn_mask: Optional[ArrayInput] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    key_lengths: Optional[ArrayInput] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayInput] = None,
    sinks: Optional[ArrayInput] = None,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    num_threads: Optional[int] = None,
) -> Grads:
    """The gradients of :func:`sdpa.scaled_dot_product_attention`.

    Parameters
    ----------
    grad_out : array_like, shape (..., Hq, L, Ev)
        The gradient of the loss with respect to the forward's output.
    query, key, value : array_like
        The forward's inputs, (..., Hq, L, E), (..., Hkv, S, E), (..., Hkv, S, Ev).
    out, lse : array_like
        The forward's output (..., Hq, L, Ev) and log-sum-exp (..., Hq, L), as
        ``scaled_dot_product_attention(..., return_lse=True)`` returned them
        for the same arguments.
    attn_mask, is_causal, scale, enable_gqa, key_lengths, window, softcap, alibi_slopes, sinks
        The forward's arguments, with the same meaning.  A float ``attn_mask``
        gets no gradient.
    dropout_p, seed
        The forward's dropout: the same mask is drawn again from ``seed``.
    num_threads : int, optional
        As for the forward.  The gradients are bitwise the same for every
        thread count.

    Returns
    -------
    (grad_query, grad_key, grad_value), each of its input's shape and dtype
    (float32 for integer or bool inputs computed as the forward computes
    them), and ``grad_sinks`` of the sinks' shape last when ``sinks`` is given.
    Where an input broadcast (a batch dim of 1, a shared key/value head), its
    gradient is summed over the dims it broadcast along; under GQA each
    key/value head's gradient sums over its query heads.

    Raises
    ------
    ValueError
        Shapes that do not fit (naming the argument); ``dropout_p > 0``
        without a ``seed``.
    TypeError
        Unsupported dtypes or argument types.
    """
    causal_given, scale_given, gqa, sides, cap, threads = call_constants(
        is_causal, scale, enable_gqa, window, softcap, num_threads
    )[:6]
    dropout = dropout_args(dropout_p, seed)
    given = {name: _to_array(x, name) for x, name in (
        (grad_out, "grad_out"), (query, "query"), (key, "key"), (value, "value"), (out, "out"), (lse, "lse"))}
    for name, a in given.items():
        _check_real(a, name)
    q0, k0, v0 = given["query"], given["key"], given["value"]
    dtype, kv_dtype = operand_dtypes(q0.dtype, k0.dtype, v0.dtype)
    plan = plan_shapes(q0.shape, k0.shape, v0.shape, gqa)
    shapes = f"query {q0.shape}, key {k0.shape}, value {v0.shape}"
    batch, heads, group, L, S, E = plan.batch_shape, plan.heads, plan.group, plan.L, plan.S, plan.E
    nd = len(batch) + 3
    for name in ("grad_out", "out"):
        if given[name].shape != plan.out_shape:
            raise ValueError(f"{name}: expected the output's shape {plan.out_shape}, got {given[name].shape}")
    if given["lse"].shape != plan.out_shape[:-1]:
        raise ValueError(f"lse: expected the shape {plan.out_shape[:-1]} (the output's without Ev), "
                         f"got {given['lse'].shape}")
    # broadcast inputs whose gradients are summed in 16 bits would round twice: float32 then
    hkv = heads // group if group else 0
    full_k = batch + (hkv, S, E)
    needs_sum = any(
        _canonical(a, nd).shape != full
        for a, full in ((q0, batch + (heads, L, E)), (k0, full_k), (v0, full_k[:-1] + (plan.Ev,)))
    )
    core_dtype = np.dtype(np.float32) if needs_sum and dtype.itemsize == 2 else dtype
    cdtype = compute_dtype(core_dtype)
    q, k, v, o, do = (_canonical(_as_operand(given[n], core_dtype), nd)
                      for n in ("query", "key", "value", "out", "grad_out"))
    lse_c = _canonical(_as_operand(given["lse"], cdtype), nd - 1)

    m: Optional[Array] = None
    if attn_mask is not None:
        m = _to_array(attn_mask, "attn_mask")
        mask_checked(m.dtype, m.shape, plan.weights_shape, shapes)
        m = np.array(m, order="C") if m.dtype == np.bool_ and not m.flags.aligned else (
            m if m.dtype == np.bool_ else _as_operand(m, cdtype))
        m = _canonical(m, nd)
    lengths: Optional[Array] = None
    if key_lengths is not None:
        kl = _to_array(key_lengths, "key_lengths")
        key_lengths_checked(kl, batch, shapes)
        lengths = np.array(np.minimum(kl, S), dtype=np.int64, order="C")
    per_head = {
        name: _canonical(head_values(x, name, batch, heads, cdtype), len(batch) + 1)
        for x, name in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")) if x is not None
    }
    causal, offset = _causal_offset(causal_given, L, S)
    top_left = causal_given is True or causal_given == "top_left"
    align = 0 if top_left else S - L

    dq = np.empty(batch + (heads, L, E), core_dtype)
    dk = np.empty(full_k, core_dtype)
    dv = np.empty(full_k[:-1] + (plan.Ev,), core_dtype)
    dsinks = np.empty(batch + (heads,), cdtype) if sinks is not None else None
    left, right = sides if sides is not None else (-1, -1)
    _core.backward(
        q, k, v, o, lse_c, do, dq, dk, dv, m, lengths, per_head.get("alibi_slopes"), per_head.get("sinks"),
        dsinks, gqa_group=max(group, 1), scale=scale_of(scale_given, E), causal=causal, causal_offset=offset,
        align_offset=align, window_left=left, window_right=right, softcap=cap or 0.0,
        num_threads=threads or 0, dropout_p=dropout[0] if dropout else 0.0, seed=dropout[1] if dropout else 0,
    )
    result: List[FloatArray] = [
        _summed(dq, q0.shape, dtype), _summed(dk, k0.shape, kv_dtype), _summed(dv, v0.shape, kv_dtype)]
    if dsinks is not None:
        s0 = _to_array(sinks, "sinks")
        result.append(_summed(dsinks, s0.shape, s0.dtype if s0.dtype.kind == "f" else cdtype))
    return tuple(result)  # type: ignore[return-value]
