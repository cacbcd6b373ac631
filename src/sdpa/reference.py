"""A plain NumPy float64 reference for scaled dot-product attention.

It follows the four steps of the textbook formulation literally -- scores = Q Kᵀ,
divide by √d_k, row-wise softmax, weighted sum of the rows of V -- and builds the
full (..., L, S) score matrix.  It is slow and memory hungry by design: it exists
to check the fused implementation, and for readers who want the maths in code.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, Union, cast

import numpy as np
import numpy.typing as npt

__all__ = ["scaled_dot_product_attention", "causal_mask", "key_length_mask", "multi_head_attention"]


def causal_mask(L: int, S: int, *, bottom_right: bool = False) -> np.ndarray:
    """The (L, S) bool mask of causal attention (True = takes part).

    Top-left aligned (the default) is ``tril(ones(L, S))``: query row ``l`` sees keys
    ``0..l``.  Bottom-right aligned is ``tril(ones(L, S), S - L)``: the last query row
    sees every key.
    """
    return np.tri(L, S, k=(S - L) if bottom_right else 0, dtype=bool)


def block_elements(states: npt.ArrayLike, block_size: Tuple[int, int], L: int, S: int) -> np.ndarray:
    """The state of each (row, key) of block states (..., QB, KB) of blocks of
    ``block_size`` (rows, keys): (..., L, S)."""
    bq, bk = block_size
    st = np.asarray(states)
    return np.repeat(np.repeat(st, bq, axis=-2), bk, axis=-1)[..., :L, :S]


def key_length_mask(key_lengths: npt.ArrayLike, S: int) -> np.ndarray:
    """The bool mask (True = takes part) that ``key_lengths`` stands for.

    Key ``s`` takes part for batch index ``b`` when ``s < key_lengths[b]``, so
    lengths below 0 act as 0 and lengths above ``S`` as ``S``.  The shape is
    ``key_lengths.shape + (1, 1, S)``: it broadcasts against scores of shape
    (..., H, L, S) when ``key_lengths`` broadcasts against the batch dims (...).
    """
    return np.arange(S) < np.asarray(key_lengths)[..., None, None, None]


def dropout_threshold(dropout_p: float) -> int:
    """The 16-bit threshold of dropout (sdpa.h): a weight is kept when its
    number is at least ``ceil(dropout_p * 65536)`` (at most 65535), so with
    probability ``1 - threshold / 65536``, and then divided by that."""
    return min(math.ceil(dropout_p * 65536.0), 65535)


def dropout_keep(
    seed: int, batch_shape: Tuple[int, ...], heads: int, L: int, S: int, dropout_p: float
) -> np.ndarray:
    """The keep mask of dropout, bool (batch..., heads, L, S), as sdpa's core
    draws it (sdpa.h, ``dropout_p``): Philox-4x32-10 under the key (seed's
    low 32 bits, its high 32 bits xor s >> 32) on the counter (s, l // 8, h,
    b) for key s, row l, head h and batch index b (the batch dims flattened
    in C order); row l's number is the 16-bit half l % 2 (the low one first)
    of word (l % 8) // 2, kept when it is >= :func:`dropout_threshold`."""
    M = np.uint64(0xFFFFFFFF)
    nb = int(np.prod(batch_shape)) if batch_shape else 1
    b = np.arange(nb, dtype=np.uint64)[:, None, None, None]
    h = np.arange(heads, dtype=np.uint64)[None, :, None, None]
    g = (np.arange(L, dtype=np.uint64) // np.uint64(8))[None, None, :, None]
    s = np.arange(S, dtype=np.uint64)[None, None, None, :]
    shape = (nb, heads, L, S)
    x0, x1, x2, x3 = (np.broadcast_to(a, shape) & M for a in (s, g, h, b))
    k0 = np.uint64(seed) & M
    k1 = (np.uint64(seed) >> np.uint64(32)) ^ (s >> np.uint64(32))
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * x0
        p1 = np.uint64(0xCD9E8D57) * x2
        x0, x1, x2, x3 = (p1 >> np.uint64(32)) ^ x1 ^ k0, p1 & M, (p0 >> np.uint64(32)) ^ x3 ^ k1, p0 & M
        k0 = (k0 + np.uint64(0x9E3779B9)) & M
        k1 = (k1 + np.uint64(0xBB67AE85)) & M
    words = np.stack([x0, x1, x2, x3])
    rows = np.arange(L)
    word = np.take_along_axis(words, np.broadcast_to(((rows % 8) // 2)[None, None, None, :, None], (1,) + shape),
                              axis=0)[0]
    u = (word >> (np.uint64(16) * (rows % 2).astype(np.uint64))[:, None]) & np.uint64(0xFFFF)
    keep: np.ndarray = (u >= np.uint64(dropout_threshold(dropout_p))).reshape(tuple(batch_shape) + (heads, L, S))
    return keep


def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: Optional[npt.ArrayLike] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    return_lse: bool = False,
    key_lengths: Optional[npt.ArrayLike] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[npt.ArrayLike] = None,
    sinks: Optional[npt.ArrayLike] = None,
    block_mask: Any = None,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
) -> Union[np.ndarray, Tuple[np.ndarray, ...]]:
    """Attention computed in float64 with NumPy, step by step.

    Shapes: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev);
    returns the output (..., Hq, L, Ev) as float64.  ``attn_mask`` is bool (True =
    takes part) or float (added to the scaled scores).  ``is_causal`` is False,
    True or ``"top_left"`` (:func:`causal_mask`), or ``"bottom_right"``.
    ``key_lengths`` (ints broadcastable to the batch dims, the dims before the head
    dim -3) leaves out the keys at or past ``key_lengths[b]`` for batch index
    ``b`` (:func:`key_length_mask`; values are clipped to [0, S]): they take no
    part, and their values are not read.  A query row that can see no key gives
    zeros.

    The model variants, as :func:`sdpa.scaled_dot_product_attention` defines
    them: ``window=(left, right)`` leaves out key ``j`` for row ``i`` unless
    ``i + o - left <= j <= i + o + right`` (-1: that side unbounded), where
    ``o`` is 0 for ``is_causal`` True or ``"top_left"`` and ``S - L`` otherwise;
    ``softcap`` replaces each scaled score ``x`` by ``softcap * tanh(x /
    softcap)`` before the mask and ALiBi are added; ``alibi_slopes`` ((Hq,) or
    (batch..., Hq)) adds ``-slope * |i + o - j|``; ``sinks`` (same shapes) adds
    ``exp(sink)`` to each row's softmax denominator (and to the lse), and no
    value.  A row that sees no key gives zeros whatever the sink, and its lse
    is the sink.  ``block_mask`` (an :class:`sdpa.BlockMask`, states (...,
    Hq, QB, KB) of blocks of ``block_size``): a key of a skipped block (0) is
    left out, one of a partial block (1) follows the rules above, one of a
    full block (2) takes part whatever causality, the window and a bool mask
    say (a float mask is still added; key_lengths still leave it out).
    ``dropout_p`` > 0 with ``seed``: the weights of the output's sum are
    those :func:`dropout_keep` keeps, divided by the probability of keeping
    one, ``1 - dropout_threshold(dropout_p) / 65536`` (the returned weights and
    lse are those before dropout).

    With ``return_weights`` the weights (..., Hq, L, S) are returned too, and with
    ``return_lse`` the natural log-sum-exp of each row's scaled, masked scores,
    (..., Hq, L): ``-inf`` for a row that sees no key, NaN for a row that sees a NaN
    score.  With either, the result is the tuple ``(output, weights, lse)`` holding those
    asked for, in that order, as :func:`sdpa.scaled_dot_product_attention` returns.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    L, E = q.shape[-2], q.shape[-1]
    S = k.shape[-2]
    has_heads = max(q.ndim, k.ndim, v.ndim) >= 3
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
    # the variants: the cap first, then (with the mask below) ALiBi's distances
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    o = 0 if (bool(is_causal) and is_causal != "bottom_right") else S - L
    distance = np.arange(L)[:, None] + o - np.arange(S)[None, :]  # i + o - j
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)[..., None, None]
        if not has_heads:
            slopes = slopes.reshape(())
        scores = scores - slopes * np.abs(distance)
    # masks: bool -> -inf where False; float -> added
    allowed = None
    if is_causal:
        bottom_right = is_causal == "bottom_right"
        allowed = causal_mask(L, S, bottom_right=bottom_right)
    if window is not None:
        left, right = window
        inside = np.ones((L, S), dtype=bool)
        if left >= 0:
            inside &= distance <= left  # j >= i + o - left
        if right >= 0:
            inside &= -distance <= right  # j <= i + o + right
        allowed = inside if allowed is None else (allowed & inside)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            allowed = m if allowed is None else (allowed & m)
        else:
            scores = scores + m.astype(np.float64)
    if block_mask is not None:
        state = block_elements(block_mask.states, block_mask.block_size, L, S)
        base = True if allowed is None else allowed
        allowed = np.where(state == 2, True, np.where(state == 1, base, False))
    if key_lengths is not None:
        batch_shape = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        present = key_length_mask(np.broadcast_to(key_lengths, batch_shape), S)
        if not has_heads:  # 2-D inputs: no batch dims, no head dim
            present = present.reshape(1, S)
        allowed = present if allowed is None else (allowed & present)
        # the values of those keys are not read (0 * NaN would be NaN)
        v = np.where(np.swapaxes(present, -1, -2), v, 0.0)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    # 3. row-wise softmax, stable: subtract the row max; rows with no key give zeros
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[..., None, None]
        if not has_heads:
            sink = sink.reshape(())
        sink = np.broadcast_to(sink, row_max.shape)
        seen = ~np.isneginf(row_max)  # rows that see a key: the sink joins their max
        row_max = np.where(seen, np.maximum(row_max, sink), row_max)
        row_max = np.where(seen & (np.isnan(row_max) | np.isnan(sink)), np.nan, row_max)
    finite_max = np.where(np.isneginf(row_max), 0.0, row_max)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(scores - finite_max)
    denom = np.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            denom = np.where(denom > 0, denom + np.exp(sink - finite_max), denom)
    with np.errstate(invalid="ignore", divide="ignore"):
        weights = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
    weights = np.where(np.isnan(denom), np.nan, weights)
    # 4. weighted sum of the values (those dropout keeps, scaled up)
    if dropout_p > 0:
        batch_shape = weights.shape[:-3] if weights.ndim >= 3 else ()
        keep = dropout_keep(int(cast(int, seed)), batch_shape, weights.shape[-3] if weights.ndim >= 3 else 1, L, S,
                            dropout_p).reshape(weights.shape)
        out = np.where(keep, weights, 0.0) @ v / (1.0 - dropout_threshold(dropout_p) / 65536.0)
    else:
        out = weights @ v

    extra: List[np.ndarray] = []
    if return_weights:
        extra.append(weights)
    if return_lse:
        # log(sum(exp(scores))) = row max + log(denom): -inf where denom is 0, NaN
        # where it is NaN; broadcast to the output's rows, like sdpa's
        with np.errstate(divide="ignore"):
            lse_rows = finite_max + np.log(denom)
        if sink is not None:  # a row that sees no key: the sink alone
            lse_rows = np.where(denom == 0, sink, lse_rows)
        lse = lse_rows[..., 0]
        extra.append(np.broadcast_to(lse, out.shape[:-1]).copy())
    return (out, *extra) if extra else out


def sparse_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    indices: npt.ArrayLike,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[npt.ArrayLike] = None,
    return_lse: bool = False,
) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Each query row's attention over the keys listed for it, in float64.

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev) (Hq a
    multiple of Hkv), indices (..., Hkv or 1, L, k): row ``l`` of head ``h``
    attends keys ``indices[..., h // (Hq // Hkv), l, :]`` (or ``[..., 0, l,
    :]``), each as often as it is listed; -1 entries are left out.  The
    gathered keys of each row go through :func:`scaled_dot_product_attention`
    (``scale``, ``softcap`` and ``sinks`` as there).  Returns (..., Hq, L, Ev),
    and the lse (..., Hq, L) with ``return_lse``."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    idx = np.asarray(indices)
    Hq, L, E = q.shape[-3:]
    Hkv = k.shape[-3]
    G = Hq // Hkv
    batch = q.shape[:-3]
    idx = np.broadcast_to(idx, batch + idx.shape[-3:])
    heads = np.arange(Hq) // G if idx.shape[-3] > 1 else np.zeros(Hq, dtype=np.int64)
    lists = idx[..., heads, :, :]  # (..., Hq, L, k)
    valid = lists >= 0
    pos = np.where(valid, lists, 0)
    kv_heads = np.arange(Hq) // G
    kh = k[..., kv_heads, :, :]  # (..., Hq, S, E)
    vh = v[..., kv_heads, :, :]
    kg = np.stack([np.take_along_axis(kh, pos[..., l, :, None], axis=-2) for l in range(L)], axis=-3)
    vg = np.stack([np.take_along_axis(vh, pos[..., l, :, None], axis=-2) for l in range(L)], axis=-3)
    sink = None
    if sinks is not None:  # each row is a batch of its own: its head's sink
        sink = np.broadcast_to(np.broadcast_to(np.asarray(sinks, dtype=np.float64), batch + (Hq,))[..., None],
                               batch + (Hq, L))
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    res = scaled_dot_product_attention(q[..., None, :], kg, vg, attn_mask=valid[..., None, :], scale=scale,
                                       softcap=softcap, sinks=sink, return_lse=return_lse)
    if not return_lse:
        return np.asarray(res)[..., 0, :]
    out, lse = res
    return out[..., 0, :], lse[..., 0]


def index_topk(
    q_index: npt.ArrayLike,
    k_index: npt.ArrayLike,
    weights: npt.ArrayLike,
    k: int,
    *,
    key_lengths: Optional[npt.ArrayLike] = None,
    is_causal: bool = False,
    k_scale: Optional[npt.ArrayLike] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """The indexer's top k, in float64: ``score[l, s] = sum_h weights[l, h] *
    max(q_index[h, l] . k_index[s] * k_scale[s], 0)`` for the positions row l
    sees (below ``key_lengths[b]`` or S; with ``is_causal`` up to ``n - L +
    l``); the k best by score descending, ties to the lower position, NaN last,
    padded with -1 and -inf.  Shapes as :func:`sdpa.index_topk`'s."""
    q = np.asarray(q_index, dtype=np.float64)
    kx = np.asarray(k_index).astype(np.float64)
    w = np.asarray(weights, dtype=np.float64)
    batch = q.shape[:-3]
    Hi, L, Ei = q.shape[-3:]
    S = kx.shape[-2]
    kx = np.broadcast_to(kx, batch + (S, Ei))
    if k_scale is not None:
        kx = kx * np.broadcast_to(np.asarray(k_scale, dtype=np.float64), batch + (S,))[..., None]
    dots = q @ np.swapaxes(kx, -1, -2)[..., None, :, :]  # (..., Hi, L, S)
    score = (np.broadcast_to(w, batch + (L, Hi)).swapaxes(-1, -2)[..., None] * np.maximum(dots, 0)).sum(-3)
    n = np.broadcast_to(np.asarray(S if key_lengths is None else key_lengths), batch)
    n = np.clip(n, 0, S)[..., None]  # (..., 1)
    lim = n - L + np.arange(L) + 1 if is_causal else np.broadcast_to(n, batch + (L,))
    seen = np.arange(S) < np.clip(lim, 0, S)[..., None]  # (..., L, S)
    flat_s = score.reshape(-1, S)
    flat_seen = seen.reshape(-1, S)
    idx = np.full(flat_s.shape[:1] + (k,), -1, np.int32)
    out = np.full(flat_s.shape[:1] + (k,), -np.inf, np.float64)
    for r in range(flat_s.shape[0]):
        pos = np.nonzero(flat_seen[r])[0]
        vals = flat_s[r, pos]
        order = np.lexsort((pos, np.where(np.isnan(vals), np.inf, -vals), np.isnan(vals)))[:k]
        idx[r, : order.size] = pos[order]
        out[r, : order.size] = vals[order]
    return idx.reshape(batch + (L, k)), out.reshape(batch + (L, k))


def multi_head_attention(
    x: npt.ArrayLike,
    w_q: npt.ArrayLike,
    w_k: npt.ArrayLike,
    w_v: npt.ArrayLike,
    w_o: npt.ArrayLike,
    b_q: Optional[npt.ArrayLike] = None,
    b_k: Optional[npt.ArrayLike] = None,
    b_v: Optional[npt.ArrayLike] = None,
    b_o: Optional[npt.ArrayLike] = None,
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

    def project(w: npt.ArrayLike, b: Optional[npt.ArrayLike], heads: int) -> np.ndarray:
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
