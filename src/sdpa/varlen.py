"""Attention over packed variable-length sequences (the flash-attn "varlen" layout).

A batch of sequences of different lengths is stored without padding: the rows of
sequence ``i`` are ``cu_seqlens[i]:cu_seqlens[i + 1]`` of one (total, heads,
features) array.  Each sequence attends to its own keys only.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional, Tuple, Union, overload

import numpy as np

from ._api import (
    Array,
    ArrayInput,
    FloatArray,
    _as_operand,
    _causal_offset,
    _check_real,
    _to_array,
    call_core,
    compute_dtype,
    head_values,
    operand_dtypes,
    output_array,
    scale_of,
    softcap_value,
    thread_count,
    window_sides,
)

__all__ = ["varlen_attention"]


def _cu_seqlens(value: Any, name: str, total: int) -> np.ndarray:
    """Prefix sums of the lengths: 1-D ints from 0, non-decreasing, ending at ``total``."""
    a = _to_array(value, name)
    if a.dtype.kind not in "iu" or a.dtype == np.bool_:
        raise TypeError(f"{name}: expected int32 or int64 prefix sums, got dtype {a.dtype}")
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of (number of sequences + 1) prefix sums, got shape {a.shape}")
    c = a.astype(np.int64)
    if c[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(c[0])}")
    if np.any(np.diff(c) < 0):
        raise ValueError(f"{name}: must be non-decreasing (prefix sums of the lengths)")
    if c[-1] != total:
        raise ValueError(f"{name}: ends at {int(c[-1])}, but the packed array holds {total} rows")
    return c


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
        Threads for each sequence's call (see :func:`sdpa.set_num_threads`).

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
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the query heads must be a multiple of the key/value heads (dim 1); got {shapes}")
    cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k)
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

    scale_value = scale_of(scale, E)
    causal, _ = _causal_offset(is_causal, 0, 0)  # checked; the core aligns each sequence
    threads = thread_count(num_threads)

    kw: Dict[str, Any] = {"is_causal": "bottom_right" if is_causal == "bottom_right" else causal}
    if window is not None:
        kw["window"] = window_sides(window)
    if softcap is not None:
        kw["softcap"] = softcap_value(softcap)
    per_seq: Dict[str, Array] = {}
    for values, name in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")):
        if values is not None:
            original = _to_array(values, name)
            given.append((original, name))
            per_seq[name] = np.broadcast_to(head_values(original, name, (n,), Hq, cdtype), (n, Hq))

    operands = given + [(q, "query"), (k, "key"), (v, "value")]
    result = output_array(out, (total_q, Hq, Ev), dtype, operands, shapes)
    lse = np.empty((total_q, Hq), dtype=cdtype) if return_lse else None

    # one core call per sequence, on (heads, rows, features) views of the packed arrays
    for i in range(n):
        q0, q1, k0, k1 = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        if q1 == q0 or Hq == 0 or (Ev == 0 and lse is None):
            continue
        seq_kw: Dict[str, Any] = dict(kw)
        for name, values in per_seq.items():
            seq_kw[name] = values[i]
        part = call_core(
            q[q0:q1].transpose(1, 0, 2), k[k0:k1].transpose(1, 0, 2), v[k0:k1].transpose(1, 0, 2),
            out=result[q0:q1].transpose(1, 0, 2), return_lse=lse is not None,
            scale=scale_value, enable_gqa=True, num_threads=threads, **seq_kw,
        )
        if lse is not None:
            lse[q0:q1] = part[1].T
    return (result, lse) if lse is not None else result
