"""A plain NumPy float64 reference for scaled dot-product attention.

It follows the four steps of the textbook formulation literally -- scores = Q Kᵀ,
divide by √d_k, row-wise softmax, weighted sum of the rows of V -- and builds the
full (..., L, S) score matrix.  It is slow and memory hungry by design: it exists
to check the fused implementation, and for readers who want the maths in code.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import numpy as np

__all__ = ["scaled_dot_product_attention", "causal_mask", "multi_head_attention"]


def causal_mask(L: int, S: int, *, bottom_right: bool = False) -> np.ndarray:
    """The (L, S) bool mask of causal attention (True = takes part).

    Top-left aligned (the default) is ``tril(ones(L, S))``: query row ``l`` sees keys
    ``0..l``.  Bottom-right aligned is ``tril(ones(L, S), S - L)``: the last query row
    sees every key.
    """
    return np.tri(L, S, k=(S - L) if bottom_right else 0, dtype=bool)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Attention computed in float64 with NumPy, step by step.

    Shapes: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev);
    returns the output (..., Hq, L, Ev) as float64, and with ``return_weights`` also
    the weights (..., Hq, L, S).  ``attn_mask`` is bool (True = takes part) or float
    (added to the scaled scores).  A query row that can see no key gives zeros.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    L, E = q.shape[-2], q.shape[-1]
    S = k.shape[-2]
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3:
        group = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, group, axis=-3)
        v = np.repeat(v, group, axis=-3)

    # 1. similarity of every query with every key
    scores = q @ np.swapaxes(k, -1, -2)
    # 2. scale (by 1/sqrt(d_k) unless told otherwise)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    scores = scores * scale
    # masks: bool -> -inf where False; float -> added
    allowed = None
    if is_causal:
        bottom_right = is_causal == "bottom_right"
        allowed = causal_mask(L, S, bottom_right=bottom_right)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            allowed = m if allowed is None else (allowed & m)
        else:
            scores = scores + m.astype(np.float64)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    # 3. row-wise softmax, stable: subtract the row max; rows with no key give zeros
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    finite_max = np.where(np.isneginf(row_max), 0.0, row_max)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(scores - finite_max)
    denom = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        weights = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
    weights = np.where(np.isnan(denom), np.nan, weights)
    # 4. weighted sum of the values
    out = weights @ v
    if return_weights:
        return out, weights
    return out


def multi_head_attention(
    x,
    w_q,
    w_k,
    w_v,
    w_o,
    b_q=None,
    b_k=None,
    b_v=None,
    b_o=None,
    num_heads: int = 1,
    num_kv_heads: Optional[int] = None,
    causal: Union[bool, str] = False,
    scale: Optional[float] = None,
) -> np.ndarray:
    """A multi-head attention layer in float64, step by step.

    ``x`` is (..., T, embed_dim).  The projections are ``x @ w + b``: ``w_q`` is
    (embed_dim, num_heads * D), ``w_k`` and ``w_v`` are (embed_dim, num_kv_heads * D)
    and ``w_o`` is (num_heads * Dv, embed_dim); a bias of None is left out.  Query
    head ``h`` attends with key/value head ``h // (num_heads // num_kv_heads)``
    (``num_kv_heads`` defaults to ``num_heads``).  ``causal`` is passed on to
    :func:`scaled_dot_product_attention`.  Returns (..., T, embed_dim) as float64.
    """
    x = np.asarray(x, dtype=np.float64)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads

    def project(w, b, heads):
        y = x @ np.asarray(w, dtype=np.float64)
        if b is not None:
            y = y + np.asarray(b, dtype=np.float64)
        # (..., T, heads * D) -> (..., heads, T, D)
        y = y.reshape(y.shape[:-1] + (heads, y.shape[-1] // heads))
        return np.swapaxes(y, -2, -3)

    q = project(w_q, b_q, num_heads)
    k = project(w_k, b_k, num_kv_heads)
    v = project(w_v, b_v, num_kv_heads)
    o = scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=num_kv_heads != num_heads
    )
    # (..., heads, T, Dv) -> (..., T, heads * Dv)
    o = np.swapaxes(o, -2, -3)
    o = o.reshape(o.shape[:-2] + (o.shape[-2] * o.shape[-1],))
    y = o @ np.asarray(w_o, dtype=np.float64)
    if b_o is not None:
        y = y + np.asarray(b_o, dtype=np.float64)
    return y
