"""Attention over packed variable-length sequences (the flash-attn "varlen" layout).

A batch of sequences of different lengths is stored without padding: the rows of
sequence ``i`` are ``cu_seqlens[i]:cu_seqlens[i + 1]`` of one (total, heads,
features) array.  Each sequence attends to its own keys only.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional, Tuple, Union, cast, overload

import numpy as np

from . import _core
from ._api import (
    Array,
    ArrayInput,
    FloatArray,
    _as_operand,
    _check_real,
    _to_array,
    compute_dtype,
    operand_dtypes,
    output_array,
)
from ._checks import count, declined, grouped_heads, per_sequence, prefix_sums

__all__ = ["varlen_attention", "varlen_plan"]


@overload
def varlen_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    cu_seqlens_q: ArrayInput,
    cu_seqlens_k: ArrayInput,
    *,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    return_lse: Literal[False] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> FloatArray: ...
@overload
def varlen_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    cu_seqlens_q: ArrayInput,
    cu_seqlens_k: ArrayInput,
    *,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    return_lse: Literal[True],
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray]: ...
def varlen_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    cu_seqlens_q: ArrayInput,
    cu_seqlens_k: ArrayInput,
    *,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayInput] = None,
    sinks: Optional[ArrayInput] = None,
    return_lse: bool = False,
    out: Optional[Array] = None,
    num_threads: Optional[int] = None,
) -> Union[FloatArray, Tuple[FloatArray, FloatArray]]:
    """Attention over packed sequences of different lengths, without padding.

    Parameters
    ----------
    query : array_like, shape (total_q, Hq, E)
    key : array_like, shape (total_k, Hkv, E)
    value : array_like, shape (total_k, Hkv, Ev)
        The sequences one after the other along dim 0.  Hq must be a multiple
        of Hkv (grouped-query attention follows from the head counts).  Dtypes
        as for :func:`sdpa.scaled_dot_product_attention`: the output has the
        query's (float32, float64, float16 or bfloat16; anything else float64).
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (n + 1,)
        Prefix sums of the n sequences' query and key lengths: sequence ``i``
        is query rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` and keys
        ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``.  They start at 0, never
        decrease, and end at total_q and total_k.
    is_causal, scale, window, softcap : optional
        As for :func:`sdpa.scaled_dot_product_attention`, per sequence:
        ``"bottom_right"`` and the window's alignment use each sequence's own
        query and key lengths.
    alibi_slopes, sinks : array_like, shape (Hq,) or (n, Hq), optional
        Per query head, or per sequence and query head.
    return_lse : bool, default False
        Also return each row's log-sum-exp, shape (total_q, Hq).
    out : numpy.ndarray, shape (total_q, Hq, Ev), optional
        Written in place; must not overlap the inputs.
    num_threads : int, optional
        Threads for the call (see :func:`sdpa.set_num_threads`).  The
        sequences are planned together and computed in one parallel region,
        each row exactly as a call of its sequence alone computes it.

    Returns
    -------
    output : numpy.ndarray, shape (total_q, Hq, Ev)
        And the log-sum-exp, (total_q, Hq) in the compute dtype (float64 for
        float64, else float32), with ``return_lse``.  A row that sees no key
        gives zeros (and ``-inf``, or its sink).

    Raises
    ------
    ValueError
        Shapes, prefix sums or keyword values that do not fit (named).
    TypeError
        Unsupported dtypes or argument types.
    """
    call, args, no_heads = _varlen_call(
        query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse, out=out,
        num_threads=num_threads)
    result = args[-1]
    if no_heads:
        return (result, np.empty((result.shape[0], 0), dtype=compute_dtype(result.dtype))) if return_lse else result
    # one core call: the sequences are planned and computed together
    got = call.run_varlen(*args)
    if isinstance(got, int):
        raise declined(got)
    return got if return_lse else result


def varlen_plan(query: ArrayInput, key: ArrayInput, value: ArrayInput, cu_seqlens_q: ArrayInput,
                cu_seqlens_k: ArrayInput, *, threads: int = 0, **kw: Any) -> Dict[str, Any]:
    """What the planner makes of a :func:`varlen_attention` call (same
    arguments) for ``threads`` threads (0: as the call would run here),
    computing nothing: ``{"threads", "merges", "parts": [...], "costs":
    array}``, one part per sequence in the order their tasks run, and each work
    item's estimated cost (ns on one core).  For the tests and
    ``python -m sdpa.bench --plan``."""
    call, args, _ = _varlen_call(query, key, value, cu_seqlens_q, cu_seqlens_k, **kw)
    plan = call.run_varlen(*args, plan_threads=count(threads, "threads"))
    if isinstance(plan, int):
        raise declined(plan)
    return cast(Dict[str, Any], plan)


def _varlen_call(
    query: ArrayInput, key: ArrayInput, value: ArrayInput, cu_seqlens_q: ArrayInput, cu_seqlens_k: ArrayInput, *,
    is_causal: Union[bool, str] = False, scale: Optional[float] = None, window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayInput] = None, sinks: Optional[ArrayInput] = None,
    return_lse: bool = False, out: Optional[Array] = None, num_threads: Optional[int] = None,
) -> Tuple[_core.Call, Tuple[Any, ...], bool]:
    """:func:`varlen_attention`'s arguments checked: the prepared call of its
    options, the arrays of its ``run_varlen`` (the output last), and whether
    there are no query heads (no call then)."""
    # the options, checked first and once
    call = _core.plain().prepared(is_causal, scale, False, window, softcap, num_threads, False, return_lse)
    q = _to_array(query, "query")
    k = _to_array(key, "key")
    v = _to_array(value, "value")
    given = [(q, "query"), (k, "key"), (v, "value")]
    for a, name in given:
        _check_real(a, name)
        if a.ndim != 3:
            raise ValueError(f"{name}: expected 3 dims (total, heads, features), got shape {a.shape}")
    shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"
    total_q, Hq, E = q.shape
    total_k, Hkv, Ek = k.shape
    if Ek != E:
        raise ValueError(f"query and key must have the same last dim (E); got {shapes}")
    if v.shape[:2] != (total_k, Hkv):
        raise ValueError(f"key and value must have the same rows and heads (dims 0 and 1); got {shapes}")
    Ev = v.shape[2]
    grouped_heads(Hq, Hkv, "the key")
    cq = prefix_sums(cu_seqlens_q, "cu_seqlens_q", total_q, "the packed query")
    ck = prefix_sums(cu_seqlens_k, "cu_seqlens_k", total_k, "the packed key")
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; got {cq.shape[0] - 1} "
            f"and {ck.shape[0] - 1}"
        )
    n = cq.shape[0] - 1

    dtype, kv_dtype = operand_dtypes(q.dtype, k.dtype, v.dtype)
    cdtype = compute_dtype(dtype)
    q = _as_operand(q, dtype)
    k, v = (_as_operand(a, kv_dtype) for a in (k, v))

    per_seq: Dict[str, Optional[Array]] = {"alibi_slopes": None, "sinks": None}
    for values, name in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")):
        if values is not None:
            original = _to_array(values, name)
            given.append((original, name))
            per_seq[name] = per_sequence(original, name, n, Hq, cdtype)

    operands = given + [(q, "query"), (k, "key"), (v, "value")]
    result = output_array(out, (total_q, Hq, Ev), dtype, operands, shapes)
    extras = None if alibi_slopes is None and sinks is None else (per_seq["alibi_slopes"], per_seq["sinks"])
    return call, (q, k, v, cq, ck, extras, result), Hq == 0
