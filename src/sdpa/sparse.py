"""Sparse attention: each query row attends to the keys listed for it.

:func:`sparse_attention` takes, for each query row, the positions of the keys
it attends (top-k attention as in DeepSeek's sparse attention, or any other
selection), and reads those keys and values where they lie, in any cache
format :class:`~sdpa.KVCache` stores.  :func:`sdpa.paged_attention` takes the
same lists over paged caches (``topk_indices=``).

How it is computed: the keys of a cache, viewed (without a copy) as a pool of
one-position blocks, and each row's listed positions as its block table; one
:func:`sdpa.paged_attention`-style call then plans and computes every row, in
parallel, bit for bit the same on any thread count.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, Union

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import _core
from ._checks import broadcasts_to, count, declined, flag, grouped_heads, head_values, int_array, output_array
from ._dtypes import _to_array, compute_dtype, float_dtype, quantized_query_dtype, width_of
from .paged import _cache_pair, _paged_call

__all__ = ["sparse_attention", "index_topk"]

Array = np.ndarray
_INT32_MAX = int(np.iinfo(np.int32).max)


def _renamed(err: Exception, names: Tuple[Tuple[str, str], ...]) -> Exception:
    """``err`` with the paged call's argument names replaced by the caller's."""
    msg = str(err)
    for old, new in names:
        msg = msg.replace(old, new)
    return type(err)(msg)


_DENSE_NAMES = (("key_cache", "key"), ("value_cache", "value"))


def _slice_strides(a: Array) -> Optional[Tuple[int, int, int, int]]:
    """The element strides of a 4-dim (slices, heads, rows, columns) array, or
    None when they are not whole elements, or a stride that takes part is
    negative."""
    st = []
    for n, s in zip(a.shape, a.strides):
        if s % a.itemsize or (s < 0 and n > 1):
            return None
        st.append(s // a.itemsize if n > 1 else 0)
    return st[0], st[1], st[2], st[3]


def _multipliers(a: Array, fold_heads: bool) -> Optional[Tuple[int, int, int]]:
    """Row stride, and the rows a slice and (folded) a head are apart, of a
    4-dim array; None when those are not whole rows."""
    st = _slice_strides(a)
    if st is None:
        return None
    sx, sh, sr, _ = st
    if not fold_heads:
        sh = 0
    if sr == 0:
        if a.shape[2] > 1:  # rows broadcast along the positions: not a pool of rows
            return None
        sr = math.gcd(sx, sh) or 1  # one row a slice: any stride that divides the others serves
    if sx % sr or sh % sr:
        return None
    return sr, sx // sr, sh // sr


Pools = Tuple[Tuple[Optional[Array], ...], int, int]


def _pools(arrays: Tuple[Optional[Array], ...], fold_heads: bool) -> Optional[Pools]:
    """4-dim (slices, heads, rows, columns) arrays viewed, without a copy, as
    pools of one-row blocks: block ``x * mx + h * mh + r`` (heads folded) or
    ``x * mx + r`` (heads kept) is row r of slice x (and head h); the views and
    (mx, mh).  None when the arrays' strides do not allow it."""
    found = None
    views: List[Optional[Array]] = []
    for a in arrays:
        if a is None:
            views.append(None)
            continue
        m = _multipliers(a, fold_heads)
        if m is None or (found is not None and m[1:] != found):
            return None
        found = m[1:]
        sr = m[0]
        X, H, R, C = a.shape
        n = (X - 1) * m[1] + (H - 1) * m[2] + R if X and H and R else 0
        it = a.itemsize
        if fold_heads:
            views.append(as_strided(a, (n, 1, 1, C), (sr * it, sr * it, sr * it, a.strides[3]), writeable=False))
        else:
            views.append(as_strided(a, (n, H, 1, C), (sr * it, a.strides[1], sr * it, a.strides[3]),
                                    writeable=False))
    assert found is not None
    return tuple(views), found[0], found[1]


def _sorted_lists(idx: Array, limit: Array) -> Tuple[Array, Array]:
    """Each row's listed positions, ascending, the entries it ignores (-1,
    and those at or past ``limit``, which broadcasts against the rows) last;
    and the count of the others."""
    ignored = (idx < 0) | (idx >= limit[..., None])
    key = np.where(ignored, np.iinfo(np.int64).max, idx.astype(np.int64, copy=False))
    key.sort(axis=-1)
    return key, (~ignored).sum(axis=-1)


# Rows of one sequence are put in groups of this many (aligned), whose common
# positions are listed first, in one order, by each of them.
_SHARE_ROWS = 64


def _shared_first(lists: Array, counts: Array, group: Array) -> Array:
    """Each row's valid entries (``lists`` (R, Hi, k), the first ``counts``
    (R, Hi), ascending) reordered: those every row of its group (``group`` (R,)) lists
    first, ascending, then the others, ascending.  Rows of a group then share
    the leading entries of their tables, and the planner reads those keys
    once for all of them (a shared prefix, as the shared blocks of paged
    sequences)."""
    k = lists.shape[-1]
    valid = np.arange(k) < counts[..., None]
    if not valid.any():
        return lists
    big = np.iinfo(np.int64).max
    v = np.where(valid, lists, big)  # each row's valid entries first, ascending (as _sorted_lists gives them)
    n = int(lists[valid].max()) + 1
    first = valid.copy()
    first[..., 1:] &= v[..., 1:] != v[..., :-1]  # a position listed twice counts once
    members = np.bincount(group)
    pair = group.astype(np.int64)[:, None, None] * n + np.where(valid, v, 0)  # (group, position)
    if members.size * n <= 4 * pair.size + 1024:
        listed = np.bincount(pair[first], minlength=members.size * n)[pair]
    else:
        uniq, cnt = np.unique(pair[first], return_counts=True)
        at = np.minimum(np.searchsorted(uniq, pair), uniq.size - 1)
        listed = np.where(uniq[at] == pair, cnt[at], 0)
    common = first & (listed == members[group][:, None, None])
    key = np.where(valid, np.where(common, v, v + n), big)
    key.sort(axis=-1)
    return np.where(key < n, key, np.where(valid, key - n, 0))


def _attend_lists(
    rows_q: Array, pools: Tuple[Optional[Array], ...], fold: bool, lists: Array, counts: Array, Ev: int,
    heads_kv: int, *, scale: Optional[float], softcap: Optional[float], sinks: Optional[Array], return_lse: bool,
    num_threads: Optional[int], kv_dtype: Optional[str], group: Array, integer_qk: bool = False,
    integer_pv: bool = False,
) -> Tuple[Array, Optional[Array]]:
    """The attention of R query rows (``rows_q`` (R, Hq, E), of the dtype the
    call computes in) over the positions listed for them: ``lists`` (R, Hi, k)
    block numbers of the one-row ``pools`` (key, value and their scales; heads
    folded into the block numbers when ``fold``, Hi = Hkv then, else Hi = 1),
    the first ``counts`` (R, Hi) of each list read; ``Ev`` the values'
    features; ``group`` (R,) the rows' groups (:func:`_shared_first`).  ``sinks``: (R, Hq) or
    None.  Returns (R, Hq, Ev) and the lse (R, Hq), or None; a row that lists
    nothing gives 0 and -inf (its sink, with sinks)."""
    R, Hq, E = rows_q.shape
    G = Hq // heads_kv
    k = lists.shape[-1]
    if R > 1:
        lists = _shared_first(lists, counts, group)
    if fold:  # a sequence per (row, key/value head): its G query heads
        q_seq = rows_q.reshape(R * heads_kv, G, E)
        tables = np.broadcast_to(lists, (R, heads_kv, k)).reshape(R * heads_kv, k)
        lens = np.broadcast_to(counts, (R, heads_kv)).reshape(R * heads_kv)
        sink_seq = None if sinks is None else sinks.reshape(R * heads_kv, G)
    else:  # a sequence per row: all its heads
        q_seq, tables, lens, sink_seq = rows_q, lists.reshape(R, k), counts.reshape(R), sinks
    n, heads = q_seq.shape[:2]
    cdt = compute_dtype(rows_q.dtype)
    out = np.zeros((n, heads, Ev), rows_q.dtype)
    lse = np.full((n, heads), -np.inf, cdt) if return_lse else None
    live = lens > 0
    if lse is not None and sink_seq is not None:
        lse[~live] = sink_seq[~live]
    n_live = int(np.count_nonzero(live))
    if n_live:
        every = n_live == n
        qs, bt, sl = (q_seq, tables, lens) if every else (q_seq[live], tables[live], lens[live])
        sk = sink_seq if every or sink_seq is None else sink_seq[live]
        kp, vp, ksp, vsp = pools
        call, args, _ = _paged_call(
            np.ascontiguousarray(qs), kp, vp, np.ascontiguousarray(bt, dtype=np.int32),
            np.ascontiguousarray(sl, dtype=np.int64), is_causal=False, scale=scale, softcap=softcap, sinks=sk,
            return_lse=return_lse, num_threads=num_threads, key_scale=ksp, value_scale=vsp, kv_dtype=kv_dtype,
            query_start_loc=np.arange(qs.shape[0] + 1, dtype=np.int64), integer_qk=integer_qk,
            integer_pv=integer_pv)
        res = call.run_paged(*args)
        if isinstance(res, int):
            raise declined(res)
        o, ls = res if return_lse else (res, None)
        if every:
            out = o.reshape(out.shape)
            lse = ls
        else:
            out[live] = o
            if lse is not None:
                lse[live] = ls
    return out.reshape(R, Hq, Ev), None if lse is None else lse.reshape(R, Hq)


def _pools_of(arrays: Tuple[Optional[Array], ...], fold: bool) -> Pools:
    """:func:`_pools`, or those of C-contiguous copies when the strides do not
    allow views (then the lists index the copies alike)."""
    found = _pools(arrays, fold)
    if found is None:
        found = _pools(tuple(None if a is None else np.ascontiguousarray(a) for a in arrays), fold)
        assert found is not None
    return found


def sparse_attention(
    query: Any,
    key: Any,
    value: Any,
    indices: Any,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Any = None,
    return_lse: bool = False,
    out: Optional[Array] = None,
    num_threads: Optional[int] = None,
    key_scale: Any = None,
    value_scale: Any = None,
    kv_dtype: Optional[str] = None,
) -> Union[Array, Tuple[Array, Array]]:
    """Attention of each query row over the keys listed for it (top-k sparse attention).

    The result equals :func:`sdpa.scaled_dot_product_attention` of each row
    over the gathered keys and values ``key[..., indices[..., l, :], :]``, but
    the keys and values are read where they lie, never gathered into a copy.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, E)
        float16, bfloat16, float32 or float64 (against a quantized cache a
        float64 query is read as float32, and the output is float32).
    key, value : ndarray, shapes (..., Hkv, S, E) and (..., Hkv, S, Ev)
        Any cache :class:`~sdpa.KVCache` stores: float16, bfloat16, float32,
        float64 (with a float64 query), int8 with ``key_scale`` and
        ``value_scale``, or the uint8 storage of a float8 or int4 cache named
        by ``kv_dtype`` (int4: (..., E // 2), two values a byte); ml_dtypes'
        float8 arrays need no ``kv_dtype``.  Hq must be a multiple of Hkv
        (grouped heads).  ``value`` may be a column view of ``key`` (MLA's
        latent cache, ``key[..., :Ev]``).  The batch dims are the query's.
        Read where they lie when the slices' rows lie at whole multiples of
        the row stride (C-ordered caches, positions before or after the
        heads); other layouts (positions broadcast, strides that are not
        whole rows apart) are read from a contiguous copy.
    indices : array_like of int32 or int64, shape (..., Hkv or 1, L, k)
        The positions row ``l`` attends, shared by the query heads of a
        key/value head, or by every head when that dim is 1; batch dims
        broadcast to the query's.  -1 is ignored; a position listed twice
        counts twice; a row with no valid entry gives 0 and lse -inf (with
        sinks: 0 and lse the sink), as a row that sees no key does in
        :func:`sdpa.scaled_dot_product_attention`.
    scale, softcap, sinks
        As in :func:`sdpa.scaled_dot_product_attention`; sinks (Hq,) or
        (..., Hq).
    return_lse : bool
        Also return each row's log-sum-exp, (..., Hq, L), float32 (float64
        for a float64 query).
    out : ndarray, optional
        (..., Hq, L, Ev), of the output's dtype, written with the result.
    num_threads : int, optional
        Threads for this call (default: :func:`sdpa.get_num_threads`); the
        result is the same, bit for bit, on any count.
    key_scale, value_scale : ndarray, optional
        Scales of an int8, int4 or float8 cache, (..., Hkv, S, E // G) and
        (..., Hkv, S, Ev // G), as :class:`~sdpa.KVCache` keeps them.
    kv_dtype : str, optional
        ``"int4"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``: what uint8
        caches hold (as :func:`sdpa.paged_attention` takes it).

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev)
    lse : ndarray, shape (..., Hq, L), with ``return_lse``

    Raises
    ------
    ValueError, TypeError
        Naming the argument, before anything is written: an entry of
        ``indices`` below -1 or at or past S, shapes or dtypes that do not
        match.

    Examples
    --------
    >>> import numpy as np, sdpa
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 1, 8)).astype(np.float32)      # 2 heads, 1 row
    >>> k = rng.standard_normal((1, 100, 8)).astype(np.float32)    # 1 key/value head, 100 keys
    >>> v = rng.standard_normal((1, 100, 8)).astype(np.float32)
    >>> idx = np.array([[[7, 42, 3, -1]]])                         # (1, L, k): keys 7, 42 and 3
    >>> o = sdpa.sparse_attention(q, k, v, idx)
    >>> ref = sdpa.scaled_dot_product_attention(q, k[:, [7, 42, 3]], v[:, [7, 42, 3]], enable_gqa=True)
    >>> bool(np.allclose(o, ref, atol=1e-6))
    True
    """
    q = _to_array(query, "query")
    kc = _to_array(key, "key")
    vc = _to_array(value, "value")
    for a, name, what in ((q, "query", "(..., Hq, L, E)"), (kc, "key", "(..., Hkv, S, E)"),
                          (vc, "value", "(..., Hkv, S, Ev)")):
        if a.ndim < 3:
            raise ValueError(f"{name}: expected shape {what}, got {a.shape}")
    batch = q.shape[:-3]
    for a, name in ((kc, "key"), (vc, "value")):
        if a.shape[:-3] != batch:
            raise ValueError(f"{name}: batch dims {a.shape[:-3]} differ from the query's {batch}")
    if vc.shape[-3:-1] != kc.shape[-3:-1]:
        raise ValueError(f"value: shape {vc.shape} does not match key {kc.shape} in (heads, positions)")
    try:
        qdt = float_dtype(q.dtype, "query")
    except TypeError:
        raise TypeError(f"query: expected float16, bfloat16, float32 or float64, got dtype {q.dtype}") from None
    B = int(np.prod(batch, dtype=np.int64))
    Hq, L, E = q.shape[-3:]
    Hkv, S = kc.shape[-3:-1]
    k4, v4 = kc.reshape((B,) + kc.shape[-3:]), vc.reshape((B,) + vc.shape[-3:])
    scales: List[Optional[Array]] = []
    for a, name in ((key_scale, "key_scale"), (value_scale, "value_scale")):
        if a is None:
            scales.append(None)
            continue
        s = _to_array(a, name)
        if s.ndim < 3 or s.shape[:-1] != (kc if name == "key_scale" else vc).shape[:-1]:
            raise ValueError(f"{name}: expected shape {kc.shape[:-1] + ('features // group_size',)}, got {s.shape}")
        scales.append(s.reshape((B,) + s.shape[-3:]))
    # the format's rules on the caches (on one zero position when they hold none: every row is then empty)
    shown = [a if a is None or S else np.zeros(a.shape[:2] + (1,) + a.shape[3:], a.dtype)
             for a in (k4, v4, scales[0], scales[1])]
    try:
        _, _, _, _, _, code = _cache_pair(shown[0], shown[1], shown[2], shown[3], kv_dtype)
    except (TypeError, ValueError) as err:
        raise _renamed(err, _DENSE_NAMES) from None
    width = width_of(code)
    if kc.shape[-1] * width != E:
        raise ValueError(f"key: {kc.shape[-1] * width} features a key, the query has {E}")
    grouped_heads(Hq, Hkv, "key")
    if code:
        qdt = quantized_query_dtype(qdt)
    elif (qdt == np.float64) != (k4.dtype == np.float64):
        raise TypeError(f"key: a {qdt} query attends " + ("a float64 cache" if qdt == np.float64 else
                        "float16, bfloat16, float32 or quantized caches") + f", got {k4.dtype}")
    idx = int_array(indices, "indices")
    if idx.dtype not in (np.int32, np.int64):
        raise TypeError(f"indices: expected int32 or int64, got dtype {idx.dtype}")
    if idx.ndim < 3 or idx.shape[-3] not in (1, Hkv) or idx.shape[-2] != L:
        raise ValueError(f"indices: expected shape (..., {Hkv} or 1, {L}, k), got {idx.shape}")
    try:
        idx = np.broadcast_to(idx, batch + idx.shape[-3:])
    except ValueError:
        raise ValueError(f"indices: batch dims {idx.shape[:-3]} do not broadcast to the query's {batch}") from None
    bad = (idx < -1) | (idx >= S)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"indices: entry {at} is {int(idx[at])}, not a position in [0, {S}) or -1")
    flag(return_lse, "return_lse")
    cdt = compute_dtype(qdt)
    sink = None if sinks is None else head_values(sinks, "sinks", batch, Hq, cdt)
    Ev = vc.shape[-1] * width
    out_shape = batch + (Hq, L, Ev)
    if out is not None:
        operands = [(a, n) for a, n in ((q, "query"), (kc, "key"), (vc, "value")) if isinstance(a, np.ndarray)]
        output_array(out, out_shape, qdt, operands, f"query {q.shape}, value {vc.shape}")

    fold = idx.shape[-3] > 1
    if fold and _pools((k4, v4, scales[0], scales[1]), True) is None:
        # key/value heads that are no whole number of rows apart (positions before
        # heads in memory): a call per key/value head, each over its own pool
        G = Hq // Hkv
        result = np.empty(out_shape, qdt) if out is None else out
        lses = []
        for h in range(Hkv):
            hs, one = slice(h * G, (h + 1) * G), slice(h, h + 1)
            part = sparse_attention(
                q[..., hs, :, :], kc[..., one, :, :], vc[..., one, :, :], idx[..., one, :, :], scale=scale,
                softcap=softcap, sinks=None if sink is None else sink[..., hs], return_lse=return_lse,
                out=result[..., hs, :, :], num_threads=num_threads,
                key_scale=None if key_scale is None else _to_array(key_scale, "key_scale")[..., one, :, :],
                value_scale=None if value_scale is None else _to_array(value_scale, "value_scale")[..., one, :, :],
                kv_dtype=kv_dtype)
            if return_lse:
                lses.append(part[1])
        return (result, np.concatenate(lses, axis=-2)) if return_lse else result
    pools, mx, mh = _pools_of((k4, v4, scales[0], scales[1]), fold)
    Hi, k = idx.shape[-3:-1][0], idx.shape[-1]
    lists, counts = _sorted_lists(idx.reshape(B, Hi, L, k), np.asarray(S))
    first = np.arange(B, dtype=np.int64)[:, None] * mx + (np.arange(Hi, dtype=np.int64) * mh)[None, :]
    if lists.size and int(first.max(initial=0)) + S > _INT32_MAX:
        raise ValueError(f"key: {S} positions in {B} x {Hkv} slices are beyond the core's block numbers (2^31)")
    lists = np.where(np.arange(k) < counts[..., None], lists + first[:, :, None, None], 0)
    # rows (b, l): their lists (R, Hi, k), counts (R, Hi) and query rows (R, Hq, E)
    lists = lists.transpose(0, 2, 1, 3).reshape(B * L, Hi, k)
    counts = counts.transpose(0, 2, 1).reshape(B * L, Hi)
    rows_q = np.require(q.reshape(B, Hq, L, E), qdt, ["A"]).transpose(0, 2, 1, 3).reshape(B * L, Hq, E)
    sink_rows = None if sink is None else np.broadcast_to(
        np.broadcast_to(sink, batch + (Hq,)).reshape(B, 1, Hq), (B, L, Hq)).reshape(B * L, Hq)
    group = (np.arange(B)[:, None] * -(-L // _SHARE_ROWS) + np.arange(L)[None, :] // _SHARE_ROWS).reshape(B * L)
    o, lse = _attend_lists(rows_q, pools, fold, lists, counts, Ev, Hkv, scale=scale, softcap=softcap,
                           sinks=sink_rows, return_lse=return_lse, num_threads=num_threads, kv_dtype=kv_dtype,
                           group=group)
    result = o.reshape(B, L, Hq, Ev).transpose(0, 2, 1, 3).reshape(out_shape)
    if out is not None:
        np.copyto(out, result)
        result = out
    if lse is None:
        return result
    return result, lse.reshape(B, L, Hq).transpose(0, 2, 1).reshape(batch + (Hq, L))


def paged_topk(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, topk_indices: Any, *,
    is_causal: bool, scale: Optional[float], softcap: Optional[float], sinks: Any, return_lse: bool,
    out: Optional[Array], num_threads: Optional[int], key_scale: Any, value_scale: Any, kv_dtype: Optional[str],
    integer_qk: bool, integer_pv: bool, query_start_loc: Any,
) -> Union[Array, Tuple[Array, Array]]:
    """:func:`sdpa.paged_attention` with ``topk_indices`` (window, ALiBi and
    tree masks refused there): each row attends the positions of its
    sequence listed for it."""
    _, args, _ = _paged_call(
        query, key_cache, value_cache, block_tables, seq_lens, is_causal=is_causal, scale=scale, softcap=softcap,
        sinks=sinks, return_lse=return_lse, out=out, num_threads=num_threads, key_scale=key_scale,
        value_scale=value_scale, kv_dtype=kv_dtype, integer_qk=integer_qk, query_start_loc=query_start_loc,
        integer_pv=integer_pv)
    q, _, vc, bt, sl, scales, extras, _ = args  # checked, in the core's forms
    Ev = vc.shape[3] * width_of(_core.QUANTIZED.get(kv_dtype or "", 0))  # int4: two values a byte
    packed = q.ndim == 3
    B = sl.shape[0]
    Hkv, bs = vc.shape[1], vc.shape[2]
    Hq = q.shape[-3] if not packed else q.shape[1]
    if packed:
        qsl = extras[2]
        rows_of = np.diff(qsl)
        seq = np.repeat(np.arange(B), rows_of)  # each row's sequence
        R = q.shape[0]
        own = sl[seq] - rows_of[seq] + (np.arange(R) - qsl[seq])  # each row's position
        rows_q = q
        L = 0
    else:
        L = q.shape[2]
        R = B * L
        qsl = None
        seq = np.repeat(np.arange(B), L)
        own = (sl[:, None] - L + np.arange(L)[None, :]).reshape(R)
        rows_q = q.transpose(0, 2, 1, 3).reshape(R, Hq, q.shape[3])
    idx = int_array(topk_indices, "topk_indices")
    if idx.dtype not in (np.int32, np.int64):
        raise TypeError(f"topk_indices: expected int32 or int64, got dtype {idx.dtype}")
    want = "(T, Hkv or 1, k)" if packed else f"(B, Hkv or 1, {L}, k)"
    if (idx.ndim != (3 if packed else 4) or idx.shape[0] != (R if packed else B) or idx.shape[1] not in (1, Hkv)
            or (not packed and idx.shape[2] != L)):
        raise ValueError(f"topk_indices: expected shape {want} with Hkv {Hkv}, got {idx.shape}")
    Hi, k = idx.shape[1], idx.shape[-1]
    rows_idx = idx if packed else idx.transpose(0, 2, 1, 3).reshape(R, Hi, k)  # (R, Hi, k)
    limit = sl[seq]
    bad = (rows_idx < -1) | (rows_idx >= limit[:, None, None])
    if bad.any():
        r, h, j = (int(i) for i in np.argwhere(bad)[0])
        at = (r, h, j) if packed else (r // L, h, r % L, j)
        raise ValueError(f"topk_indices: entry {at} is {int(rows_idx[r, h, j])}, not a position of its sequence "
                         f"in [0, {int(limit[r])}) or -1")
    flat = _to_array(value_cache, "value_cache")  # pools of the caller's arrays (a float8 cache's own dtype)
    kc0 = _to_array(key_cache, "key_cache")
    ks, vs = (None, None) if scales is None else scales
    fold = Hi > 1
    pools, mx, mh = _pools_of((kc0, flat, ks, vs), fold)
    lists, counts = _sorted_lists(rows_idx, ((own + 1) if is_causal else limit)[:, None])
    valid = np.arange(k) < counts[..., None]
    pos = np.where(valid, lists, 0)
    blocks = bt[seq[:, None, None], pos // bs].astype(np.int64)
    first = (np.arange(Hi, dtype=np.int64) * mh)[None, :, None]
    vids = np.where(valid, blocks * mx + first + pos % bs, np.iinfo(np.int64).max)
    vids.sort(axis=-1)  # by block number: the pool's order, as _shared_first takes them
    vids = np.where(valid, vids, 0)
    if vids.size and int(vids.max()) > _INT32_MAX:
        raise ValueError("key_cache: the pool holds more positions than the core's block numbers (2^31)")
    sink_rows = None if extras is None or extras[1] is None else extras[1][seq]
    # groups of _SHARE_ROWS rows of a sequence
    row_in_seq = np.arange(R) - (qsl[seq] if packed else seq * L)
    group = np.unique(seq * (R + 1) + row_in_seq // _SHARE_ROWS, return_inverse=True)[1].reshape(R)
    o, lse = _attend_lists(rows_q, pools, fold, vids, counts, Ev, Hkv, scale=scale, softcap=softcap,
                           sinks=sink_rows, return_lse=return_lse, num_threads=num_threads, kv_dtype=kv_dtype,
                           group=group, integer_qk=integer_qk, integer_pv=integer_pv)
    result = o if packed else o.reshape(B, L, Hq, Ev).transpose(0, 2, 1, 3)
    if out is not None:
        np.copyto(out, result)
        result = out
    elif not packed:
        result = np.ascontiguousarray(result)
    if lse is None:
        return result
    return result, (lse if packed else np.ascontiguousarray(lse.reshape(B, L, Hq).transpose(0, 2, 1)))


def _batched(a: Array, batch: Tuple[int, ...], name: str) -> Array:
    """``a`` (batch'..., X, Y) broadcast to ``batch`` and viewed as (B, X, Y):
    a view where the batch dims allow one (a copy otherwise)."""
    tail = a.shape[-2:]
    if not broadcasts_to(a.shape[:-2], batch):
        raise ValueError(f"{name}: batch dims {a.shape[:-2]} do not broadcast to the query's {batch}")
    a = np.broadcast_to(a, batch + tail)
    B = int(np.prod(batch, dtype=np.int64))
    used = [(n, st) for n, st in zip(a.shape[:-2], a.strides[:-2]) if n > 1]
    if len(used) <= 1:  # one batch stride (or none): a view
        st = used[0][1] if used else 0
        return as_strided(a, (B,) + tail, (st,) + a.strides[-2:], writeable=False)
    return np.ascontiguousarray(a).reshape((B,) + tail)


def index_topk(
    q_index: Any,
    k_index: Any,
    weights: Any,
    k: int,
    *,
    key_lengths: Any = None,
    is_causal: bool = False,
    k_scale: Any = None,
    num_threads: Optional[int] = None,
) -> Tuple[Array, Array]:
    """The k best keys of each query row by an indexer's scores (DeepSeek's sparse attention).

    ``score[l, s] = sum_h weights[l, h] * max(q_index[h, l] . k_index[s], 0)``,
    summed over the index heads in order, for every position ``s`` the row
    sees; the k highest, in a single pass over the keys that never stores a
    row's scores.  Feed the indices to :func:`sparse_attention` or
    :func:`sdpa.paged_attention` (``topk_indices=``): index, select, attend.

    Parameters
    ----------
    q_index : array_like, shape (..., Hi, L, Ei)
        The index heads' queries: float16, bfloat16, float32 or float64
        (computed in float32).
    k_index : ndarray, shape (..., S, Ei)
        One index head of keys: float32, bfloat16, float16, or ml_dtypes'
        float8_e4m3fn or float8_e5m2 (with or without ``k_scale``), or int8
        (with ``k_scale``); read where it lies.  Batch dims broadcast to the
        query's.  A paged cache's positions can be indexed through a
        contiguous index-key cache of each sequence (DeepSeek keeps the
        indexer's keys apart, 132 bytes a position in float8), whose positions
        then go to ``paged_attention(topk_indices=)``.
    weights : array_like, shape (..., L, Hi)
        Each row's weight of each index head (float32).
    k : int
        Positions a row keeps.
    key_lengths : array_like of int, optional
        The batch dims' shape: sequence b's keys are its first
        ``key_lengths[b]`` (clipped to [0, S]).
    is_causal : bool
        Row l sees positions up to ``n - L + l`` (n its key length or S):
        bottom-right aligned, as in decoding.
    k_scale : array_like, shape (..., S), optional
        float32, each key's scale (``k_index`` dequantized as value x scale).
    num_threads : int, optional
        Threads for this call (default: :func:`sdpa.get_num_threads`); the
        result is the same, bit for bit, on any count.

    Returns
    -------
    indices : ndarray of int32, shape (..., L, k)
        Each row's positions by score, highest first, ties to the lower
        position, NaN scores last; -1 past the positions a row sees.
    scores : ndarray of float32, shape (..., L, k)
        Their scores; -inf where the index is -1.

    Examples
    --------
    >>> import numpy as np, sdpa
    >>> rng = np.random.default_rng(0)
    >>> qi = rng.standard_normal((4, 1, 16)).astype(np.float32)   # 4 index heads, 1 row
    >>> ki = rng.standard_normal((1000, 16)).astype(np.float32)
    >>> w = np.ones((1, 4), np.float32)
    >>> idx, sc = sdpa.index_topk(qi, ki, w, 8)
    >>> full = (np.maximum(qi[:, 0] @ ki.T, 0) * w[0, :, None]).sum(0)
    >>> bool(np.array_equal(np.sort(idx[0]), np.sort(np.argsort(-full)[:8])))
    True
    """
    q = _to_array(q_index, "q_index")
    kx = _to_array(k_index, "k_index")
    w = _to_array(weights, "weights")
    if q.ndim < 3:
        raise ValueError(f"q_index: expected shape (..., Hi, L, Ei), got {q.shape}")
    if kx.ndim < 2:
        raise ValueError(f"k_index: expected shape (..., S, Ei), got {kx.shape}")
    batch = q.shape[:-3]
    Hi, L, Ei = q.shape[-3:]
    S = kx.shape[-2]
    if kx.shape[-1] != Ei:
        raise ValueError(f"k_index: {kx.shape[-1]} features a key, q_index has {Ei}")
    if w.ndim < 2 or w.shape[-2:] != (L, Hi):
        raise ValueError(f"weights: expected shape (..., {L}, {Hi}), got {w.shape}")
    kk = count(k, "k")
    try:
        float_dtype(q.dtype, "q_index")
    except TypeError:
        raise TypeError(f"q_index: expected float16, bfloat16, float32 or float64, got dtype {q.dtype}") from None
    if w.dtype.kind not in "fiu" and w.dtype.name != "bfloat16":
        raise TypeError(f"weights: expected real numbers, got dtype {w.dtype}")
    name = kx.dtype.name
    if name in _core.FLOATS and name != "float64":
        code = _core.FLOATS[name]
        store = kx if name == "float32" else kx.view(np.uint16)
    elif name in ("int8", "float8_e4m3fn", "float8_e5m2"):
        code = _core.QUANTIZED[name]
        store = kx if name == "int8" else kx.view(np.uint8)
    else:
        raise TypeError(f"k_index: expected float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 or int8 "
                        f"(with k_scale), got dtype {kx.dtype}")
    if not store.dtype.isnative or not store.flags.aligned:
        raise TypeError("k_index: expected native byte order and aligned elements")
    ks = None
    if k_scale is not None:
        if name not in ("int8", "float8_e4m3fn", "float8_e5m2"):
            raise ValueError(f"k_scale: only quantized keys (int8, float8) have scales; k_index is {kx.dtype}")
        ks0 = _to_array(k_scale, "k_scale")
        if ks0.ndim < 1 or ks0.shape[-1] != S:
            raise ValueError(f"k_scale: expected shape (..., {S}), one scale a position, got {ks0.shape}")
        if ks0.dtype != np.float32:
            raise TypeError(f"k_scale: expected float32, got dtype {ks0.dtype}")
        ks = _batched(np.require(ks0[..., None], requirements=["A"]), batch, "k_scale")[..., 0]
    elif name == "int8":
        raise ValueError("k_scale: int8 keys need a scale a position (float32, shape (..., S))")
    flag(is_causal, "is_causal")
    kl = None
    if key_lengths is not None:
        kl0 = int_array(key_lengths, "key_lengths")
        if not broadcasts_to(kl0.shape, batch):
            raise ValueError(f"key_lengths: shape {kl0.shape} does not broadcast to the batch dims {batch}")
        kl = np.ascontiguousarray(np.broadcast_to(kl0, batch).reshape(-1), dtype=np.int64)
    threads = 0 if num_threads is None else count(num_threads, "num_threads", 1)
    if store.strides[-1] != store.itemsize:
        store = np.ascontiguousarray(store)
    key3 = _batched(store, batch, "k_index")
    B = key3.shape[0]
    q4 = np.ascontiguousarray(q.reshape((B, Hi, L, Ei)), dtype=np.float32)
    if not broadcasts_to(w.shape[:-2], batch):
        raise ValueError(f"weights: batch dims {w.shape[:-2]} do not broadcast to the query's {batch}")
    w3 = np.ascontiguousarray(np.broadcast_to(w, batch + (L, Hi)).reshape(B, L, Hi), dtype=np.float32)
    indices, scores = _core.index_topk(q4, key3, code, ks, w3, kk, kl, bool(is_causal), threads)
    return indices.reshape(batch + (L, kk)), scores.reshape(batch + (L, kk))
