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

from typing import Any, List, Optional, Tuple, Union, cast

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import _core
from ._checks import broadcasts_to, count, declined, flag, grouped_heads, head_values, int_array, output_array
from ._dtypes import _to_array, compute_dtype, float_dtype, quantized_query_dtype, width_of
from .kvcache import base_call
from .paged import _cache_pair, _paged_call, _storage_code

__all__ = ["sparse_attention", "index_topk"]

Array = np.ndarray
_INT32_MAX = int(np.iinfo(np.int32).max)
# caches of these dtypes (native order) need no format check beyond their pairing
_PLAIN = frozenset(np.dtype(d) for d in ("float16", "float32", "float64"))


def _renamed(err: Exception, names: Tuple[Tuple[str, str], ...]) -> Exception:
    """``err`` with the paged call's argument names replaced by the caller's."""
    msg = str(err)
    for old, new in names:
        msg = msg.replace(old, new)
    return type(err)(msg)


_DENSE_NAMES = (("key_cache", "key"), ("value_cache", "value"))


def _lists(idx: Array) -> Array:
    """Top-k lists as the core reads them: native, aligned int32 (entries
    already checked to lie in [-1, 2^31)); a view where they are one."""
    if idx.dtype == np.int32 and idx.dtype.isnative and idx.flags.aligned:
        return idx
    return idx.astype(np.int32)


def _entries_checked(idx: Array, S: int) -> None:
    """A ValueError naming the first entry of ``indices`` that is neither -1
    nor a position in [0, S)."""
    bad = (idx < -1) | (idx >= S)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"indices: entry {at} is {int(idx[at])}, not a position in [0, {S}) or -1")


def _row_pool(arrays: Tuple[Optional[Array], ...]) -> Tuple[Tuple[Optional[Array], ...], int]:
    """Paged caches (num_blocks, Hkv, bs, C) viewed as one dense cache (1, Hkv,
    rows, C) of their positions, row ``block * m + i`` being row i of a block:
    without a copy when every block lies a whole number m of rows after the
    previous in each array, else over C-contiguous copies.  The views and m."""
    views: List[Optional[Array]] = []
    found = None
    for a in arrays:
        if a is None:
            views.append(None)
            continue
        N, H, bs, C = a.shape
        sb, sh, sr, sc = a.strides
        if bs == 1:  # a row a block: its stride is the blocks'
            sr = sb if N > 1 else a.itemsize
        m = sb // sr if sr > 0 and sb >= 0 and sb % sr == 0 else -1
        if N == 1:
            m = bs if found is None else found
        if m < 0 or (found is not None and m != found):
            found = None
            break
        found = m
        views.append(as_strided(a, (1, H, (N - 1) * m + bs, C), (0, sh, sr, sc), writeable=False))
    else:
        if found is not None:
            return tuple(views), found
    return _row_pool(tuple(None if a is None else np.ascontiguousarray(a) for a in arrays))


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
    scales: List[Optional[Array]] = []
    for a, name in ((key_scale, "key_scale"), (value_scale, "value_scale")):
        s = None if a is None else _to_array(a, name)
        if s is not None and (s.ndim < 3 or s.shape[:-1] != (kc if name == "key_scale" else vc).shape[:-1]):
            raise ValueError(f"{name}: expected shape {kc.shape[:-1] + ('features // group_size',)}, got {s.shape}")
        scales.append(s)

    def first(a: Optional[Array]) -> Optional[Array]:
        """The first slice (1, Hkv, S, C) of a cache array, a view (one zero
        position when there is none: every row is then empty)."""
        if a is None or (B and S):
            return None if a is None else a[(0,) * len(batch)][None]
        return np.zeros((1,) + a.shape[-3:-2] + (1,) + a.shape[-1:], a.dtype)

    if (kv_dtype is None and scales[0] is None and scales[1] is None and kc.dtype == vc.dtype and kc.dtype in _PLAIN
            and kc.flags.aligned and vc.flags.aligned):
        group, code = 0, 0  # a float cache as the core reads it: nothing more to check here
    else:
        try:  # the format's rules on the caches
            _, _, _, _, group, code = _cache_pair(first(kc), first(vc), first(scales[0]), first(scales[1]),
                                                  kv_dtype)
        except (TypeError, ValueError) as err:
            raise _renamed(err, _DENSE_NAMES) from None
    width = width_of(code)
    if kc.shape[-1] * width != E:
        raise ValueError(f"key: {kc.shape[-1] * width} features a key, the query has {E}")
    grouped_heads(Hq, Hkv, "key")
    if code:
        qdt = quantized_query_dtype(qdt)
    elif (qdt == np.float64) != (kc.dtype == np.float64):
        raise TypeError(f"key: a {qdt} query attends " + ("a float64 cache" if qdt == np.float64 else
                        "float16, bfloat16, float32 or quantized caches") + f", got {kc.dtype}")
    idx = int_array(indices, "indices")
    if idx.dtype not in (np.int32, np.int64):
        raise TypeError(f"indices: expected int32 or int64, got dtype {idx.dtype}")
    if idx.ndim < 3 or idx.shape[-3] not in (1, Hkv) or idx.shape[-2] != L:
        raise ValueError(f"indices: expected shape (..., {Hkv} or 1, {L}, k), got {idx.shape}")
    if idx.shape[:-3] != batch:
        if not broadcasts_to(idx.shape[:-3], batch):
            raise ValueError(f"indices: batch dims {idx.shape[:-3]} do not broadcast to the query's {batch}")
        idx = np.broadcast_to(idx, batch + idx.shape[-3:])
    # int32 lists of a call with rows are checked by the core (every entry, before
    # anything is written), and here only to name the entry when it refuses them
    lists = _lists(idx)
    core_checks = lists is idx and B * Hq * L > 0
    if not core_checks:
        _entries_checked(idx, S)
    flag(return_lse, "return_lse")
    cdt = compute_dtype(qdt)
    sink = None if sinks is None else head_values(sinks, "sinks", batch, Hq, cdt)
    Ev = vc.shape[-1] * width
    out_shape = batch + (Hq, L, Ev)
    if out is not None:
        operands = [(a, n) for a, n in ((q, "query"), (kc, "key"), (vc, "value")) if isinstance(a, np.ndarray)]
        output_array(out, out_shape, qdt, operands, f"query {q.shape}, value {vc.shape}")

    base = base_call(code, group, False, False)
    call = base.prepared(False, scale, True, None, softcap, num_threads, False, return_lse)
    ks, vs = scales
    kc, vc, _ = _storage_code(kc, vc, kv_dtype)  # the core's storage (float8 arrays of ml_dtypes as uint8)
    try:
        res = call.run_cache(np.require(q, qdt, ["A"]), kc, vc, ks, vs, out=out, extras=(None, sink, None),
                             indices=lists)
    except ValueError:
        if core_checks:
            _entries_checked(idx, S)
        raise
    if isinstance(res, int):
        raise declined(res)
    return cast(Union[Array, Tuple[Array, Array]], res)


def paged_topk(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, topk_indices: Any, *,
    is_causal: bool, scale: Optional[float], softcap: Optional[float], sinks: Any, return_lse: bool,
    out: Optional[Array], num_threads: Optional[int], key_scale: Any, value_scale: Any, kv_dtype: Optional[str],
    integer_qk: bool, integer_pv: bool, query_start_loc: Any,
) -> Union[Array, Tuple[Array, Array]]:
    """:func:`sdpa.paged_attention` with ``topk_indices`` (window, ALiBi and
    tree masks refused there): each row attends the positions of its
    sequence listed for it."""
    call, args, _ = _paged_call(
        query, key_cache, value_cache, block_tables, seq_lens, is_causal=is_causal, scale=scale, softcap=softcap,
        sinks=sinks, return_lse=return_lse, out=out, num_threads=num_threads, key_scale=key_scale,
        value_scale=value_scale, kv_dtype=kv_dtype, integer_qk=integer_qk, query_start_loc=query_start_loc,
        integer_pv=integer_pv)
    q, kc, vc, bt, sl, scales, extras, _ = args  # checked, in the core's forms
    packed = q.ndim == 3
    B = sl.shape[0]
    Hkv, bs = vc.shape[1], vc.shape[2]
    if packed:
        qsl = extras[2]
        rows_of = np.diff(qsl)
        seq = np.repeat(np.arange(B), rows_of)  # each row's sequence
        R = q.shape[0]
        own = sl[seq] - rows_of[seq] + (np.arange(R) - qsl[seq])  # each row's position
    else:
        L = q.shape[2]
        R = B * L
        seq = np.repeat(np.arange(B), L)
        own = (sl[:, None] - L + np.arange(L)[None, :]).reshape(R)
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
    # the caches as one dense cache of their positions, and each entry as its row there
    ks, vs = (None, None) if scales is None else scales
    (kp, vp, ksp, vsp), m = _row_pool((kc, vc, ks, vs))
    seen = (own + 1) if is_causal else limit  # a row ignores later positions when causal
    valid = (rows_idx >= 0) & (rows_idx < seen[:, None, None])
    pos = np.where(valid, rows_idx, 0)
    ids = bt[seq[:, None, None], pos // bs].astype(np.int64) * m + pos % bs
    if ids.size and int(ids.max(initial=0)) > _INT32_MAX:
        raise ValueError("key_cache: the pool holds more positions than the core's block numbers (2^31)")
    lists = np.where(valid, ids, -1).astype(np.int32)
    # a batch index a sequence (L rows: their groups share positions) or, packed, a row
    sink = None if extras is None else extras[1]
    if packed:
        q4, lists4 = q[:, :, None, :], lists[:, :, None, :]
        sink = None if sink is None else sink[seq]
        out4 = None if out is None else out[:, :, None, :]
    else:
        q4, lists4, out4 = q, lists.reshape(B, L, Hi, k).transpose(0, 2, 1, 3), out
    dense = call.prepared(False, scale, True, None, softcap, num_threads, False, return_lse)
    res = dense.run_cache(q4, kp, vp, ksp, vsp, out=out4, extras=(None, sink, None), indices=lists4)
    if isinstance(res, int):
        raise declined(res)
    o, lse = cast(Tuple[Array, Array], res) if return_lse else (cast(Array, res), None)
    if packed:
        o = out if out is not None else o.reshape(o.shape[0], o.shape[1], o.shape[3])
        lse = None if lse is None else lse.reshape(lse.shape[:2])
    return o if lse is None else (o, lse)


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
