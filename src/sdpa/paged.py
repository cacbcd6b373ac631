"""Attention over paged KV caches: fixed-size blocks indexed by block tables.

A paged cache keeps the keys of many sequences in one pool of blocks,
``key_cache`` (num_blocks, Hkv, block_size, E) and ``value_cache`` (num_blocks,
Hkv, block_size, Ev).  Sequence ``b``'s position ``s`` lives in block
``block_tables[b, s // block_size]`` at row ``s % block_size``, so sequences
grow, share and free blocks without copying.  :func:`paged_attention` reads the
blocks in place; :func:`paged_write` stores new tokens into slots;
:class:`PagedKVCache` manages the blocks (add, append, fork, free, attend).
"""
from __future__ import annotations

import numbers
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

from . import _core
from ._checks import (
    count,
    declined,
    flag,
    grouped_heads,
    int64_copy,
    int_array,
    key_score_rows,
    output_array,
    per_sequence,
    prefix_sums,
)
from ._dtypes import (
    _FLOAT64,
    FP8_NAMES,
    INT8,
    QUANTIZED_NAMES,
    _check_real,
    _to_array,
    compute_dtype,
    float_dtype,
    needs_scales,
    quantized_query_dtype,
    width_of,
)
from .kvcache import CacheFormat, article, base_call, cache_dtype, check_storable

__all__ = ["paged_attention", "paged_write", "PagedKVCache"]

Array = np.ndarray

_STORED = frozenset(np.dtype(d) for d in ("float16", "float32", "float64", "int8"))


def _storage_code(kc: Array, vc: Array, kv_dtype: Optional[str]) -> Tuple[Array, Array, int]:
    """The caches as the core reads them (float8 arrays of ml_dtypes as uint8)
    and the core's code of their quantized format (0 for float caches), as
    CacheFormat.code has it."""
    name = kc.dtype.name
    if kv_dtype is None:
        if name in FP8_NAMES and vc.dtype == kc.dtype:  # ml_dtypes' float8 arrays say their format
            return kc.view(np.uint8), vc.view(np.uint8), int(_core.QUANTIZED[name])
        return kc, vc, INT8 if kc.dtype == np.int8 and vc.dtype == np.int8 else 0
    if kv_dtype not in _core.QUANTIZED:
        raise ValueError(f"kv_dtype: expected one of {', '.join(map(repr, _core.QUANTIZED))}, got {kv_dtype!r}")
    if name in FP8_NAMES and name == kv_dtype and vc.dtype == kc.dtype:
        kc, vc = kc.view(np.uint8), vc.view(np.uint8)
    storage = cache_dtype(kv_dtype)
    for a, arg in ((kc, "key_cache"), (vc, "value_cache")):
        if a.dtype != storage:
            raise TypeError(f"{arg}: {article(kv_dtype)} {kv_dtype} cache is stored as {storage}, got dtype {a.dtype}")
    return kc, vc, int(_core.QUANTIZED[kv_dtype])


def _cache_pair(
    key_cache: Any, value_cache: Any, key_scale: Any, value_scale: Any, kv_dtype: Optional[str] = None,
) -> Tuple[Array, Array, Optional[Array], Optional[Array], int, int]:
    """The caches (and scales, group size, and the core's code of a quantized
    cache, else 0) checked: 4-dim, one dtype that a KV cache stores, matching
    blocks, heads and block size."""
    kc = _to_array(key_cache, "key_cache")
    vc = _to_array(value_cache, "value_cache")
    for a, name in ((kc, "key_cache"), (vc, "value_cache")):
        if a.ndim != 4:
            raise ValueError(
                f"{name}: expected shape (num_blocks, num_kv_heads, block_size, features), got {a.shape}"
            )
    kc, vc, code = _storage_code(kc, vc, kv_dtype)
    for a, name in ((kc, "key_cache"), (vc, "value_cache")):
        if a.dtype not in _STORED and not code:
            if a.dtype == np.uint8:
                raise TypeError(f"{name}: a uint8 cache holds float8 or int4 values: name which with kv_dtype "
                                "('float8_e4m3fn', 'float8_e5m2' or 'int4')")
            if a.dtype.name == "int4":  # ml_dtypes' int4: one unscaled value a byte
                raise TypeError(f"{name}: an int4 cache is packed, two values a byte, in uint8 with "
                                f"kv_dtype='int4' and scales (as PagedKVCache(dtype='int4') keeps it); "
                                f"got dtype {a.dtype}")
            cache_dtype(a.dtype, name)
            if not a.dtype.isnative:
                raise TypeError(f"{name}: expected native byte order, got dtype {a.dtype}")
        if not a.flags.aligned:  # elements and strides
            raise ValueError(f"{name}: the cache is read in place and must be aligned")
    if kc.dtype != vc.dtype:
        raise TypeError(f"value_cache: dtype {vc.dtype} differs from key_cache's {kc.dtype}")
    if vc.shape[:3] != kc.shape[:3]:
        raise ValueError(
            f"value_cache: shape {vc.shape} does not match key_cache {kc.shape} in "
            "(num_blocks, num_kv_heads, block_size)"
        )
    if kc.shape[1] < 1 or kc.shape[2] < 1:
        raise ValueError(f"key_cache: needs at least one head and a block size >= 1, got shape {kc.shape}")
    kind = QUANTIZED_NAMES.get(code, "")
    if not code or (not needs_scales(code) and key_scale is None and value_scale is None):
        if key_scale is not None or value_scale is not None:
            raise ValueError(f"key_scale, value_scale: only a quantized cache has scales; this one is {kc.dtype}")
        return kc, vc, None, None, 0, code  # float, or float8 without scales
    if key_scale is None or value_scale is None:
        raise ValueError(f"key_scale, value_scale: {article(kind)} {kind} cache needs both (float32, one per group "
                         "of features)")
    ks = np.asarray(key_scale)
    vs = np.asarray(value_scale)
    width = width_of(code)
    E, Ev = kc.shape[3] * width, vc.shape[3] * width
    group = 0
    for a, name, cols in ((ks, "key_scale", E), (vs, "value_scale", Ev)):
        if a.dtype != np.float32 or not a.dtype.isnative or not a.flags.aligned:
            raise TypeError(f"{name}: expected native, aligned float32, got dtype {a.dtype}")
        if a.ndim != 4 or a.shape[:3] != kc.shape[:3] or a.shape[3] < 1 or cols % a.shape[3]:
            raise ValueError(
                f"{name}: expected shape {kc.shape[:3] + ('features // group_size',)}, got {a.shape}"
            )
    gk, gv = ks.shape[3], vs.shape[3]
    if gk == 1 and gv == 1:  # one scale a row (or one group as wide as both)
        return kc, vc, ks, vs, 0, code
    group = E // gk if gk > 1 else Ev // gv
    if E // group != gk or Ev // group != gv or E % group or Ev % group or group % width:
        raise ValueError(f"key_scale, value_scale: the groups differ ({E}/{gk} and {Ev}/{gv} features a scale)")
    return kc, vc, ks, vs, group, code


def _tables(
    block_tables: Any, seq_lens: Any, B: int, rows: Any, num_blocks: int, block_size: int,
    rows_name: str = "query",
) -> Tuple[Array, Array]:
    """block_tables as C-contiguous int32 and seq_lens as int64, checked: every
    entry a sequence reads is a block id, every length fits its table and
    holds the sequence's query rows (`rows`: one count for all, or one per
    sequence, given by `rows_name`)."""
    bt = int_array(block_tables, "block_tables", 2)
    sl = int_array(seq_lens, "seq_lens", 1)
    if bt.shape[0] != B:
        raise ValueError(f"block_tables: expected one row per sequence ({B}), got shape {bt.shape}")
    if sl.shape != (B,):
        raise ValueError(f"seq_lens: expected shape ({B},), one length per sequence, got {sl.shape}")
    sl = int64_copy(sl, "seq_lens")
    cap = bt.shape[1] * block_size
    need = np.broadcast_to(np.asarray(rows, np.int64), (B,))
    short = sl < need
    if short.any():
        b = int(np.argmax(short))
        if rows_name == "query_start_loc":
            raise ValueError(
                f"query_start_loc: sequence {b} has {int(need[b])} query rows, more than its {int(sl[b])} "
                "positions (seq_lens)"
            )
        raise ValueError(
            f"seq_lens: sequence {b} has {int(sl[b])} positions, fewer than the {int(need[b])} query rows it must hold"
        )
    long = sl > cap
    if long.any():
        b = int(np.argmax(long))
        raise ValueError(
            f"seq_lens: sequence {b} has {int(sl[b])} positions; its table holds {bt.shape[1]} blocks of "
            f"{block_size} ({cap} positions)"
        )
    # the entries each sequence reads: its first ceil(seq_len / block_size)
    read = np.arange(bt.shape[1]) < (-(-sl // block_size))[:, None]
    bad = read & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables: entry ({b}, {j}) is {int(bt[b, j])}, not a block id in [0, {num_blocks})"
        )
    if bt.dtype != np.int32 or not bt.flags.c_contiguous:
        lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        if bt.size and (int(bt.min()) < lo or int(bt.max()) > hi):  # unread entries beyond int32
            bt = np.clip(bt, -1, hi)
        bt = np.ascontiguousarray(bt, dtype=np.int32)
    return bt, np.ascontiguousarray(sl)


def _tables_fast(
    block_tables: Any, seq_lens: Any, B: int, L: int, num_blocks: int, block_size: int
) -> Tuple[Array, Array]:
    """block_tables and seq_lens in the core's form (copies of the caller's),
    with the checks that are cheap; the core checks every block id a sequence
    reads and every length against its table before it computes, and
    :func:`_tables` explains what it refuses.  Tables that are not int32 take
    the full check here."""
    bt, sl = block_tables, seq_lens
    if not (type(bt) is np.ndarray and bt.dtype == np.int32 and bt.ndim == 2 and bt.shape[0] == B
            and bt.flags.c_contiguous and type(sl) is np.ndarray and sl.dtype == np.int64 and sl.shape == (B,)
            and sl.flags.c_contiguous):
        return _tables(block_tables, seq_lens, B, L, num_blocks, block_size)
    if B and int(sl.min()) < L:
        return _tables(block_tables, seq_lens, B, L, num_blocks, block_size)
    return bt.copy(), sl.copy()  # the core reads them without the GIL: another thread may write the caller's


def _query_start_loc(value: Any, T: int) -> Array:
    """vLLM's query_start_loc: B + 1 int prefix sums from 0, never decreasing, ending at T."""
    return prefix_sums(value, "query_start_loc", T, "the packed query")


def _paged_call(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, *,
    is_causal: bool = True, scale: Optional[float] = None, window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None, alibi_slopes: Any = None, sinks: Any = None, tree_mask: Any = None,
    return_lse: bool = False, out: Optional[Array] = None, num_threads: Optional[int] = None,
    key_scale: Any = None, value_scale: Any = None, kv_dtype: Optional[str] = None, integer_qk: bool = False,
    query_start_loc: Any = None, integer_pv: bool = False,
) -> Tuple[_core.Call, Tuple[Any, ...], Tuple[Any, ...]]:
    """:func:`paged_attention`'s arguments checked: the prepared call of its
    options and cache format, the arrays of its ``run_paged``, and what
    explains a table the core refuses (the arguments of :func:`_tables`)."""
    q = _to_array(query, "query")
    packed = query_start_loc is not None
    if q.ndim != (3 if packed else 4):
        raise ValueError("query: expected shape (T, Hq, E), packed by query_start_loc, got " + str(q.shape)
                         if packed else f"query: expected shape (B, Hq, L, E), got {q.shape}")
    try:
        qdt = float_dtype(q.dtype, "query")
    except TypeError:
        raise TypeError(f"query: expected float16, bfloat16, float32 or float64, got dtype {q.dtype}") from None
    kc, vc, ks, vs, group, code = _cache_pair(key_cache, value_cache, key_scale, value_scale, kv_dtype)
    if code:
        qdt = quantized_query_dtype(qdt)
    bt0 = _to_array(block_tables, "block_tables")
    if packed:
        T, Hq, E = q.shape
        B = bt0.shape[0] if bt0.ndim == 2 else 0
        qsl = _query_start_loc(query_start_loc, T)
        if qsl.shape[0] != B + 1:
            raise ValueError(f"query_start_loc: expected {B + 1} prefix sums, one more than the block tables' "
                             f"{B} rows, got {qsl.shape[0]}")
        rows: Any = np.diff(qsl)
        L = int(rows.max()) if B else 0
        out_shape: Tuple[int, ...] = (T, Hq)
    else:
        B, Hq, L, E = q.shape
        qsl = None
        rows = L
        out_shape = (B, Hq, L)
    num_blocks, Hkv, bs, Ek = kc.shape
    width = width_of(code)
    Ek, Ev = Ek * width, vc.shape[3] * width
    if Ek != E:
        raise ValueError(f"key_cache: {Ek} features a key, the query has {E}")
    grouped_heads(Hq, Hkv, "the caches")
    if not code and (qdt == _FLOAT64) != (kc.dtype == _FLOAT64):
        raise TypeError(
            f"key_cache: a {qdt} query attends " + ("a float64 cache" if qdt == _FLOAT64 else
                                                    "float16, bfloat16, float32 or quantized caches")
            + f", got {kc.dtype}"
        )
    flag(is_causal, "is_causal")  # no "bottom_right": a paged row's position is its sequence's
    base = base_call(code, group, integer_qk, integer_pv)
    if packed:
        bt, sl = _tables(block_tables, seq_lens, B, rows, num_blocks, bs, "query_start_loc")
    else:
        bt, sl = _tables_fast(block_tables, seq_lens, B, L, num_blocks, bs)
    cdt = compute_dtype(qdt)
    alibi = None if alibi_slopes is None else per_sequence(alibi_slopes, "alibi_slopes", B, Hq, cdt)
    sink = None if sinks is None else per_sequence(sinks, "sinks", B, Hq, cdt)
    tree = None
    if tree_mask is not None:
        if packed:
            raise ValueError("tree_mask: not with query_start_loc (a tree needs the same L rows in every sequence)")
        tree = _to_array(tree_mask, "tree_mask")
        if tree.dtype != np.bool_:
            raise TypeError(f"tree_mask: expected bool, got dtype {tree.dtype}")
        if tree.shape not in ((L, L), (B, L, L)):
            raise ValueError(f"tree_mask: expected shape ({L}, {L}) or ({B}, {L}, {L}), got {tree.shape}")
        tree = np.ascontiguousarray(tree.reshape((-1, L, L)))  # a copy the caller cannot change mid-call
    flag(return_lse, "return_lse")  # stricter than the dense call: a paged call's own rule
    causal = bool(is_causal) and tree is None  # under a tree, the tree decides the last L positions
    call = base.prepared(causal, scale, False, window, softcap, num_threads, False, return_lse)
    if out is not None:
        operands = [(a, name) for a, name in (
            (q, "query"), (kc, "key_cache"), (vc, "value_cache"), (ks, "key_scale"), (vs, "value_scale"),
            (block_tables, "block_tables"), (seq_lens, "seq_lens"), (alibi_slopes, "alibi_slopes"),
            (sinks, "sinks"), (tree_mask, "tree_mask"), (query_start_loc, "query_start_loc"))
            if isinstance(a, np.ndarray)]
        output_array(out, out_shape + (Ev,), qdt, operands, f"query {q.shape}, key_cache {kc.shape}")
    if q.dtype != qdt or not q.flags.aligned:
        q = np.require(q, qdt, ["A"])
    scales = None if ks is None else (ks, vs)
    extras = None if alibi is None and sink is None and qsl is None and tree is None else (alibi, sink, qsl, tree)
    tables = (block_tables, seq_lens, B, rows, num_blocks, bs, "query_start_loc" if packed else "query")
    return call, (q, kc, vc, bt, sl, scales, extras, out), tables


def paged_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    is_causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    tree_mask: Any = None,
    return_lse: bool = False,
    out: Optional[Array] = None,
    num_threads: Optional[int] = None,
    key_scale: Any = None,
    value_scale: Any = None,
    kv_dtype: Optional[str] = None,
    integer_qk: bool = False,
    query_start_loc: Any = None,
    integer_pv: bool = False,
    topk_indices: Any = None,
    return_key_scores: bool = False,
    key_scores_window: Optional[int] = None,
) -> Union[Array, Tuple[Array, ...]]:
    """Attention of each sequence's last positions over its paged keys and values.

    One call serves a whole batch: decoding steps, chunked prefills, speculative
    trees, and (with ``query_start_loc``) a mixed batch of them, planned together
    and computed in one parallel region.

    Parameters
    ----------
    query : array_like, shape (B, Hq, L, E), or (T, Hq, E) with ``query_start_loc``
        float16, bfloat16, float32 or float64 (against a quantized cache a
        float64 query is read as float32, as :meth:`sdpa.KVCache.attend` reads
        it, and the output is float32).  Row ``i`` of sequence ``b`` is
        position ``seq_lens[b] - L + i``.  L = 1 is decoding; L > 1 chunked
        prefill or speculative verification.
    key_cache, value_cache : ndarray, shapes (num_blocks, Hkv, block_size, E) and (..., Ev)
        One dtype a :class:`~sdpa.KVCache` stores (float16, bfloat16, float32,
        float64, or int8 with ``key_scale``/``value_scale``), read in place;
        or the uint8 storage of a float8 or int4 cache, named by ``kv_dtype``
        (int4 caches hold two values a byte: (..., E // 2) and (..., Ev // 2)).
        ml_dtypes' float8 arrays need no ``kv_dtype``.
        Hq must be a multiple of Hkv (grouped-query attention is always on).
        ``value_cache`` may be a column view of ``key_cache`` (MLA's latent
        cache, ``key_cache[..., :Ev]``).
    block_tables : array_like of int, shape (B, max_blocks)
        Entry ``j`` of row ``b`` is the block holding positions
        ``[j * block_size, (j + 1) * block_size)`` of sequence ``b``.  Entries
        past the blocks ``seq_lens[b]`` needs are never read (they may be -1).
    seq_lens : array_like of int, shape (B,)
        Each sequence's length, its queries' positions included.
    is_causal : bool
        True: row ``i`` sees positions up to its own.  False: all ``seq_lens[b]``.
    scale, window, softcap, alibi_slopes, sinks
        As in :func:`sdpa.scaled_dot_product_attention`, with the positions
        above (the window and ALiBi bottom-right aligned to each sequence).
        Slopes and sinks are (Hq,) or (B, Hq).
    tree_mask : array_like of bool, shape (L, L) or (B, L, L), optional
        Speculative tree verification: among the last L positions, row ``i``
        sees position ``seq_lens[b] - L + j`` only where ``tree_mask[..., i, j]``
        (``is_causal`` does not apply there); it sees every earlier position.
    return_lse : bool
        Also return the log-sum-exp of each row, (B, Hq, L) or (T, Hq),
        float32 (float64 for a float64 query).
    out : ndarray, optional
        (B, Hq, L, Ev), or (T, Hq, Ev), of the query's dtype, written with the result.
    num_threads : int, optional
        Threads for this call (default: :func:`sdpa.get_num_threads`).
    key_scale, value_scale : ndarray, optional
        An int8 cache's float32 scales, (num_blocks, Hkv, block_size, E // G)
        and (..., Ev // G), G features a scale (1 column: one scale a row), as
        :class:`PagedKVCache` keeps them.  float8 caches may go without.
    kv_dtype : str, optional
        ``"float8_e4m3fn"``, ``"float8_e5m2"`` or ``"int4"``: what uint8 caches
        hold (the layouts of :class:`~sdpa.KVCache`); ``"int8"`` for int8
        caches.  A name the caches' dtype does not store is a TypeError
        (``ml_dtypes.int4`` arrays, one unscaled value a byte, are not an int4
        cache).
    integer_qk : bool
        int8 and int4 caches: the scores of decoding-size calls in integers,
        as :meth:`sdpa.KVCache.attend` computes them.
    integer_pv : bool
        int8 and int4 caches: the weighted sum of the values of decoding-size
        calls in integers, as :meth:`sdpa.KVCache.attend` computes it.  Blocks
        shared between sequences are then read once per sequence (each gets
        the bits of its own call).
    query_start_loc : array_like of int, shape (B + 1,), optional
        A mixed batch (vLLM's layout): the query is packed, sequence ``b``'s
        rows are ``query[query_start_loc[b]:query_start_loc[b + 1]]``, its last
        ``L_b`` positions (``L_b`` may be 0, and differs between sequences:
        chunks of prefill beside single-token decodes).  The output is packed
        the same way, (T, Hq, Ev), and the lse is (T, Hq).  Not with
        ``tree_mask``.

    topk_indices : array_like of int32 or int64, shape (B, Hkv or 1, L, k), or (T, Hkv or 1, k), optional
        Sparse attention (:func:`sdpa.sparse_attention`'s lists): each row
        attends only the positions of its sequence listed for it, shared by
        the query heads of a key/value head (or by all heads when that dim is
        1).  -1 is ignored, a repeated position counts as often as it is
        listed, and with ``is_causal`` a position after the row's own is
        ignored too; a row left with none gives 0 and lse -inf (its sink,
        with sinks).  An entry below -1 or at or past ``seq_lens[b]`` is a
        ValueError.  Not with ``window``, ``alibi_slopes`` or ``tree_mask``.
    return_key_scores : bool, default False
        Also return, last, each key's attention mass by position, float32 (B,
        Hkv, max(seq_lens)): the sum over the rows counted and the query heads
        of a key/value head of the softmax weight the key at that position of
        the sequence received (0 past ``seq_lens[b]``), as
        :func:`sdpa.scaled_dot_product_attention` computes it;
        ``key_scores_window`` counts the last rows only.  Shared blocks are then
        read by each sequence.  Not with ``query_start_loc``, ``tree_mask`` or
        ``topk_indices``.

    Returns
    -------
    out : ndarray, shape (B, Hq, L, Ev), or (T, Hq, Ev), of the query's dtype
    lse : ndarray, shape (B, Hq, L), or (T, Hq), with ``return_lse``
    key_scores : ndarray, shape (B, Hkv, max(seq_lens)), float32, with ``return_key_scores``

    Sequences that share leading blocks (the same block ids at the same table
    positions: forks of one prompt, a common system prompt) have those blocks
    read once for the rows of all of them, at each level of sharing (a system
    prompt, then the forks of each conversation); the parts are merged exactly
    in the same call.  That needs no window nor ALiBi, whose terms depend on
    each row's position.

    Raises
    ------
    ValueError, TypeError
        Naming the argument, before anything is computed or written: a block id
        outside [0, num_blocks) where it would be read, a ``seq_lens[b]`` above
        ``max_blocks * block_size`` or below its query rows (with
        ``query_start_loc``, named there), prefix sums that do not start at 0,
        decrease or miss the query's rows, shapes or dtypes that do not match.

    Examples
    --------
    >>> import numpy as np, sdpa
    >>> rng = np.random.default_rng(0)
    >>> kc = rng.standard_normal((4, 2, 16, 8)).astype(np.float32)   # 4 blocks of 16
    >>> vc = rng.standard_normal((4, 2, 16, 8)).astype(np.float32)
    >>> q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)     # decoding, 4 query heads
    >>> out = sdpa.paged_attention(q, kc, vc, [[2, 0]], [20])        # blocks 2 then 0
    >>> k = np.concatenate([kc[2], kc[0]], axis=1)[None, :, :20]
    >>> v = np.concatenate([vc[2], vc[0]], axis=1)[None, :, :20]
    >>> ref = sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    >>> bool(np.allclose(out, ref, atol=1e-6))
    True

    A mixed batch: sequence 0 prefills 3 rows at positions 5-7, sequence 1
    decodes its position 9.

    >>> qp = rng.standard_normal((4, 4, 8)).astype(np.float32)       # (T, Hq, E)
    >>> out = sdpa.paged_attention(qp, kc, vc, [[0], [1]], [8, 10], query_start_loc=[0, 3, 4])
    >>> out.shape
    (4, 4, 8)
    """
    rows = key_score_rows(return_key_scores, key_scores_window)
    if rows is not None:
        for value, name in ((query_start_loc, "query_start_loc"), (tree_mask, "tree_mask"),
                            (topk_indices, "topk_indices")):
            if value is not None:
                raise ValueError(f"return_key_scores: not with {name}")
    if topk_indices is not None:
        for value, name in ((window, "window"), (alibi_slopes, "alibi_slopes"), (tree_mask, "tree_mask")):
            if value is not None:
                raise ValueError(f"topk_indices: not with {name} (the lists choose the keys)")
        from .sparse import paged_topk

        return paged_topk(
            query, key_cache, value_cache, block_tables, seq_lens, topk_indices, is_causal=is_causal, scale=scale,
            softcap=softcap, sinks=sinks, return_lse=return_lse, out=out, num_threads=num_threads,
            key_scale=key_scale, value_scale=value_scale, kv_dtype=kv_dtype, integer_qk=integer_qk,
            integer_pv=integer_pv, query_start_loc=query_start_loc)
    call, args, tables = _paged_call(
        query, key_cache, value_cache, block_tables, seq_lens, is_causal=is_causal, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, tree_mask=tree_mask, return_lse=return_lse,
        out=out, num_threads=num_threads, key_scale=key_scale, value_scale=value_scale, kv_dtype=kv_dtype,
        integer_qk=integer_qk, query_start_loc=query_start_loc, integer_pv=integer_pv)
    try:
        result = call.run_paged(*args, key_scores=rows)
    except ValueError:  # the core checked the table (nothing written): say where it is wrong
        _tables(*tables)
        raise
    if isinstance(result, int):
        raise declined(result)
    if rows is not None:  # the scores up to the longest sequence
        longest = int(np.max(args[4])) if len(args[4]) else 0
        return (*result[:-1], result[-1][..., :longest])
    return result


def paged_plan(query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, *,
               threads: int = 0, **kw: Any) -> Dict[str, Any]:
    """What the planner makes of a :func:`paged_attention` call (same arguments)
    for ``threads`` threads (0: as the call would run here), computing nothing:
    ``{"threads", "merges", "parts": [...], "costs": array}``, the parts in the
    order their tasks run (a shared prefix's has ``members`` > 0) and each work
    item's estimated cost (ns on one core).  For the tests and
    ``python -m sdpa.bench --plan``."""
    call, args, _ = _paged_call(query, key_cache, value_cache, block_tables, seq_lens, **kw)
    plan = call.run_paged(*args, plan_threads=count(threads, "threads"))
    if isinstance(plan, int):
        raise declined(plan)
    return cast(Dict[str, Any], plan)


def paged_write(
    key: Any,
    value: Optional[Any],
    key_cache: Array,
    value_cache: Array,
    slot_mapping: Any,
    *,
    key_scale: Optional[Array] = None,
    value_scale: Optional[Array] = None,
    kv_dtype: Optional[str] = None,
) -> None:
    """Store T tokens' keys and values into slots of paged caches.

    Parameters
    ----------
    key : array_like, shape (T, Hkv, E)
    value : array_like, shape (T, Hkv, Ev), or None
        Real numbers, converted to the caches' dtype (int8, int4 and float8
        with scales: quantized symmetrically, a float32 scale per group,
        written to ``key_scale`` / ``value_scale``; float8 without scales:
        rounded to the format, and refused beyond its range).  None for a latent cache (MLA), whose
        ``value_cache`` is a view of ``key_cache[..., :Ev]`` (and
        ``value_scale`` of ``key_scale``): the keys alone are written.
    key_cache, value_cache : ndarray, shapes (num_blocks, Hkv, block_size, E) and (..., Ev)
        Written in place.  ``kv_dtype`` names what uint8 caches hold, as for
        :func:`paged_attention`.
    slot_mapping : array_like of int, shape (T,)
        Token ``t`` goes to block ``slot // block_size``, row ``slot % block_size``;
        a negative slot skips the token (no token, or none kept, writes
        nothing).

    Raises
    ------
    ValueError, TypeError
        Naming the argument, before anything is written: shapes or dtypes that
        do not fit, a slot past the caches, two tokens for one slot, or (int8)
        values that are NaN or infinite.
    """
    kc, vc, ks, vs, group, code = _cache_pair(key_cache, value_cache, key_scale, value_scale, kv_dtype)
    for a, name in ((kc, "key_cache"), (vc, "value_cache"), (ks, "key_scale"), (vs, "value_scale")):
        if a is not None and not a.flags.writeable:
            raise ValueError(f"{name}: is read-only")
    num_blocks, Hkv, bs, E = kc.shape
    width = width_of(code)
    E, Ev = E * width, vc.shape[3] * width
    latent = value is None
    if latent and not (np.shares_memory(vc, kc) and (ks is None or vs is None or np.shares_memory(vs, ks))):
        raise ValueError("value: None only for a latent cache, whose value_cache is a view of key_cache "
                         "(and value_scale of key_scale)")
    if not latent and np.shares_memory(vc, kc):
        raise ValueError("value: a value_cache that shares key_cache's memory is a latent cache: pass value=None")
    k = _to_array(key, "key")
    v = k[..., :Ev] if latent else _to_array(value, "value")
    for a, name, cols in ((k, "key", E), (v, "value", Ev)):
        _check_real(a, name)
        if a.ndim != 3 or a.shape[1:] != (Hkv, cols):
            raise ValueError(f"{name}: expected shape (T, {Hkv}, {cols}), got {a.shape}")
    T = k.shape[0]
    if v.shape[0] != T:
        raise ValueError(f"value: {v.shape[0]} tokens, key has {T}")
    slots = int_array(slot_mapping, "slot_mapping", 1)
    if slots.shape != (T,):
        raise ValueError(f"slot_mapping: expected shape ({T},), one slot a token, got {slots.shape}")
    past = slots >= num_blocks * bs  # before any cast: a uint64 slot must not wrap to a skipped one
    if past.any():
        t = int(np.argmax(past))
        raise ValueError(f"slot_mapping: slot {int(slots[t])} of token {t} is past the caches' "
                         f"{num_blocks * bs} slots")
    slots = slots.astype(np.int64)
    keep = slots >= 0
    used = slots[keep]
    if np.unique(used).size != used.size:
        raise ValueError("slot_mapping: two tokens go to one slot")
    blocks, rows = used // bs, used % bs
    if code:
        kf = np.require(k[keep], np.float32, ["C", "A"])
        vf = np.require(v[keep], np.float32, ["C", "A"])
        for a, name in ((kf, "key"), (vf, "value")):
            check_storable(a, name, code, ks is not None)
        n = kf.shape[0]
        qk = np.empty((1, n, Hkv, E // width), kc.dtype)
        qv = np.empty((1, n, Hkv, Ev // width), kc.dtype)
        sk = None if ks is None else np.empty((1, n, Hkv, ks.shape[3]), np.float32)
        sv = None if vs is None else np.empty((1, n, Hkv, vs.shape[3]), np.float32)
        _core.quantize(code, kf[None], qk, sk, group)
        if not latent:
            _core.quantize(code, vf[None], qv, sv, group)
        kc[blocks, :, rows, :] = qk[0]
        if ks is not None and sk is not None:
            ks[blocks, :, rows, :] = sk[0]
        if not latent:
            vc[blocks, :, rows, :] = qv[0]
            if vs is not None and sv is not None:
                vs[blocks, :, rows, :] = sv[0]
        return
    kc[blocks, :, rows, :] = k[keep].astype(kc.dtype, copy=False)
    if not latent:
        vc[blocks, :, rows, :] = v[keep].astype(vc.dtype, copy=False)


class PagedKVCache:
    """A pool of KV-cache blocks shared by many sequences.

    ``key_cache`` (num_blocks, num_kv_heads, block_size, head_dim) and
    ``value_cache`` (..., head_dim_v) hold every sequence's keys and values;
    each sequence owns a list of blocks (its block table).  Full blocks may be
    shared between sequences (:meth:`fork`); a block returns to the pool when
    no sequence holds it.  For the quantized dtypes of :class:`~sdpa.KVCache`
    (``"int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"int4"``, with the
    same storage) the float32 scales are ``key_scale`` / ``value_scale`` (one
    per ``group_size`` features, default one per row, and 32 for int4 where
    it divides both head dims; a float8 cache with ``scale=None`` has none).
    ``latent=True`` keeps MLA's latent cache: ``value_cache`` is
    ``key_cache[..., :head_dim_v]``, stored and read once, and :meth:`append`
    takes the keys only.

    >>> import numpy as np, sdpa
    >>> cache = sdpa.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)
    >>> a = cache.add_sequence()
    >>> cache.append(a, np.ones((1, 6, 8)), np.ones((1, 6, 8)))
    >>> b = cache.fork(a)                    # shares the full block, copies the partial one
    >>> cache.seq_len(b), cache.free_blocks
    (6, 5)
    >>> cache.attend([a, b], np.ones((2, 2, 1, 8), np.float32)).shape
    (2, 2, 1, 8)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        dtype: Any = np.float32,
        group_size: Optional[int] = None,
        latent: bool = False,
        scale: Optional[str] = "absmax",
    ) -> None:
        n = count(num_blocks, "num_blocks", 1)
        self._bs = count(block_size, "block_size", 1)
        heads = count(num_kv_heads, "num_kv_heads", 1)
        fmt = self._format = CacheFormat.make(dtype, head_dim, head_dim_v, group_size=group_size, latent=latent,
                                              scale=scale)
        self.kv_dtype: Optional[str] = fmt.kv_dtype
        self.key_cache, self.value_cache, ks, vs = fmt.allocate((n, heads, self._bs))
        # float32 scales of a quantized pool, (num_blocks, Hkv, block_size, groups); None without
        self.key_scale: Optional[Array] = ks if fmt.scaled else None
        self.value_scale: Optional[Array] = vs if fmt.scaled else None
        self._free: List[int] = list(range(n - 1, -1, -1))  # popped from the end: block 0 first
        self._refs = np.zeros(n, np.int64)
        self._blocks: Dict[int, List[int]] = {}
        self._lens: Dict[int, int] = {}
        self._next = 0
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def format(self) -> CacheFormat:
        """What the pool stores and how (dtype, scales, groups, latent), as :attr:`sdpa.KVCache.format`."""
        return self._format

    @property
    def num_blocks(self) -> int:
        return int(self.key_cache.shape[0])

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> List[int]:
        return list(self._blocks)

    def _seq(self, seq_id: Any) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, numbers.Integral) or int(seq_id) not in self._blocks:
            raise KeyError(f"seq_id: {seq_id!r} is not a sequence of this cache")
        return int(seq_id)

    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        with self._lock:
            sid = self._next
            self._next += 1
            self._blocks[sid] = []
            self._lens[sid] = 0
            return sid

    def seq_len(self, seq_id: int) -> int:
        """Positions held by the sequence."""
        with self._lock:
            return self._lens[self._seq(seq_id)]

    def block_table(self, seq_id: int) -> List[int]:
        """The sequence's block ids, in order."""
        with self._lock:
            return list(self._blocks[self._seq(seq_id)])

    def _take(self, n: int) -> List[int]:
        if n > len(self._free):
            raise MemoryError(
                f"PagedKVCache: {n} more blocks are needed and {len(self._free)} of {self.num_blocks} are free"
            )
        taken = [self._free.pop() for _ in range(n)]
        self._refs[taken] = 1
        return taken

    def append(self, seq_id: int, key: Any, value: Any = None) -> None:
        """Append T positions, key (Hkv, T, E) and value (Hkv, T, Ev), converted
        (or quantized) to the cache's dtype; a latent cache takes the keys only
        (value None).  MemoryError when the blocks they need are not free; a
        failed call changes nothing."""
        latent, e, ev = self._format.latent, self._format.head_dim, self._format.head_dim_v
        if latent != (value is None):
            raise ValueError("value: a latent cache takes the keys only" if latent
                             else "value: expected the values (only a latent cache takes None)")
        k = _to_array(key, "key")
        v = k[..., :ev] if value is None else _to_array(value, "value")
        heads = self.key_cache.shape[1]
        for a, name, cols in ((k, "key", e), (v, "value", ev)):
            if a.ndim != 3 or a.shape[0] != heads or a.shape[2] != cols:
                raise ValueError(f"{name}: expected shape ({heads}, T, {cols}), got {a.shape}")
        T = k.shape[1]
        if v.shape[1] != T:
            raise ValueError(f"value: {v.shape[1]} positions, key has {T}")
        with self._lock:
            sid = self._seq(seq_id)
            start = self._lens[sid]
            blocks = self._blocks[sid]
            need = -(-(start + T) // self._bs) - len(blocks)
            new = self._take(max(need, 0))
            try:
                table = np.array(blocks + new, np.int64)
                pos = np.arange(start, start + T)
                slots = table[pos // self._bs] * self._bs + pos % self._bs
                paged_write(k.transpose(1, 0, 2), None if latent else v.transpose(1, 0, 2), self.key_cache,
                            self.value_cache, slots, key_scale=self.key_scale, value_scale=self.value_scale,
                            kv_dtype=self.kv_dtype)
            except BaseException:
                self._refs[new] = 0
                self._free.extend(reversed(new))  # as they were: the next blocks taken are the same
                raise
            blocks.extend(new)
            self._lens[sid] = start + T

    def _release(self, blocks: Sequence[int]) -> None:
        for blk in blocks:
            self._refs[blk] -= 1
            if self._refs[blk] == 0:
                self._free.append(blk)

    def fork(self, seq_id: int) -> int:
        """A new sequence with the same positions: it shares every full block and
        gets a copy of the partial last one.  Returns its id."""
        with self._lock:
            sid = self._seq(seq_id)
            blocks, n = self._blocks[sid], self._lens[sid]
            full = n // self._bs
            copy = self._take(1 if n % self._bs else 0)
            for src, dst in zip(blocks[full:], copy):
                kept = (self.key_cache, self.key_scale) if self._format.latent else (
                    self.key_cache, self.value_cache, self.key_scale, self.value_scale)
                for a in kept:
                    if a is not None:
                        a[dst] = a[src]
            self._refs[blocks[:full]] += 1
            new = self._next
            self._next += 1
            self._blocks[new] = blocks[:full] + copy
            self._lens[new] = n
            return new

    def free(self, seq_id: int) -> None:
        """Drop the sequence; blocks no other sequence holds return to the pool."""
        with self._lock:
            sid = self._seq(seq_id)
            self._release(self._blocks.pop(sid))
            del self._lens[sid]

    def tables(self, seq_ids: Sequence[int]) -> Tuple[Array, Array]:
        """The block tables (padded with -1) and lengths of these sequences."""
        with self._lock:
            return self._tables(seq_ids)

    def _tables(self, seq_ids: Sequence[int]) -> Tuple[Array, Array]:  # with the lock held
        ids = [self._seq(s) for s in seq_ids]
        width = max([len(self._blocks[s]) for s in ids] + [1])
        bt = np.full((len(ids), width), -1, np.int32)
        for i, s in enumerate(ids):
            bt[i, : len(self._blocks[s])] = self._blocks[s]
        return bt, np.array([self._lens[s] for s in ids], np.int64)

    def attend(self, seq_ids: Sequence[int], query: Any, **kw: Any) -> Union[Array, Tuple[Array, ...]]:
        """:func:`paged_attention` of query (len(seq_ids), Hq, L, E) over these
        sequences; keywords as there.  Holds the cache's lock, so that no other
        thread's free or append reuses a block while it is read."""
        with self._lock:
            bt, sl = self._tables(seq_ids)
            return paged_attention(query, self.key_cache, self.value_cache, bt, sl, key_scale=self.key_scale,
                                   value_scale=self.value_scale, kv_dtype=self.kv_dtype, **kw)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self._bs}, "
            f"num_kv_heads={self.key_cache.shape[1]}, head_dim={self._format.head_dim}, "
            f"head_dim_v={self._format.head_dim_v}, dtype={self._format.name}, sequences={len(self._blocks)}, "
            f"free_blocks={self.free_blocks})"
        )
