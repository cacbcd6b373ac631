"""sdpa.dask.scaled_dot_product_attention: a lazy call over dask arrays
chunked along the keys, one task per key chunk and a tree of exact merges;
and the tasks (partial attention, merge) that ShardedKVCache shares."""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import dask
import dask.array as da
import numpy as np

from .._api import (
    _causal_offset,
    _is_bfloat16,
    attend,
    compute_dtype,
    key_lengths_checked,
    mask_checked,
    operand_dtypes,
    plan_shapes,
    scale_of,
    thread_count,
)
from ..merge import merge_attention

Partial = Tuple[np.ndarray, np.ndarray]


# ---- the chunks ------------------------------------------------------------------------


def _chunk_diagonal(causal: bool, offset: int, l0: int, s0: int) -> Optional[int]:
    """The diagonal of query rows from ``l0`` over the keys of a chunk from
    ``s0``, in the chunk's own positions (row i sees key j <= i + diagonal),
    for a call causal with ``offset``; None when it is not causal."""
    return offset + l0 - s0 if causal else None


def _sees_chunk(diagonal: Optional[int], rows: int) -> bool:
    """Whether any of ``rows`` query rows with ``diagonal`` sees a key of its chunk."""
    return diagonal is None or (rows > 0 and rows - 1 + diagonal >= 0)


# ---- the tasks -------------------------------------------------------------------------

def _compute_query(q: np.ndarray) -> np.ndarray:
    """A 16-bit query is computed in float32 for the partials (its values are
    exact in float32), so that the partials merge without a 16-bit rounding
    each; the merged result is rounded once at the end."""
    return q.astype(np.float32) if q.dtype == np.float16 or _is_bfloat16(q.dtype) else q


def _partial(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: Optional[np.ndarray],
    lengths: Optional[np.ndarray],
    scale: float,
    diagonal: Optional[int],
    gqa: bool,
    num_threads: Optional[int],
) -> Partial:
    """Output and log-sum-exp of one query block over one key chunk."""
    out, lse = attend(
        _compute_query(q), k, v, attn_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True,
        key_lengths=lengths, num_threads=num_threads, diagonal=diagonal,
    )
    return out, lse


def _merge(*parts: Partial) -> Partial:
    outs, lses = zip(*parts)
    out, lse = merge_attention(list(outs), list(lses))
    return out, lse


def _output(part: Partial, dtype: np.dtype) -> np.ndarray:
    return part[0].astype(dtype, copy=False)


# ---- scaled_dot_product_attention ---------------------------------------------------------

def _as_dask(x: Any, name: str) -> Any:
    if not isinstance(x, da.Array):
        x = da.from_array(np.asarray(x), chunks=-1, name=False)
    if any(isinstance(n, float) and math.isnan(n) for n in x.shape):
        raise ValueError(f"{name}: unknown chunk sizes {x.chunks}; call {name}.compute_chunk_sizes() first")
    return x


def _lift(x: Any, ndim: int) -> Any:
    """x with leading size-1 axes up to ndim dims."""
    return x[(None,) * (ndim - x.ndim)] if x.ndim < ndim else x


def _nest(blocks: Dict[Tuple[int, ...], Any], numblocks: Sequence[int]) -> Any:
    """The nested lists of blocks that ``da.block`` takes."""
    def level(prefix: Tuple[int, ...]) -> Any:
        if len(prefix) == len(numblocks):
            return blocks[prefix]
        return [level(prefix + (i,)) for i in range(numblocks[len(prefix)])]
    return level(())


def _starts(chunks: Sequence[int]) -> List[int]:
    return [0, *np.cumsum(chunks).tolist()]


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    key_lengths: Any = None,
    return_lse: bool = False,
    split_every: int = 8,
    num_threads: Optional[int] = None,
) -> Any:
    """:func:`sdpa.scaled_dot_product_attention` over dask arrays: one task per
    key chunk, on the worker holding it, and a tree of exact merges.

    Parameters
    ----------
    query : dask or NumPy array, shape (..., Hq, L, E)
    key : dask array, shape (..., Hkv, S, E)
    value : dask array, shape (..., Hkv, S, Ev)
        ``key`` is chunked along the keys (axis -2), and may be along the batch
        and head axes too; each key chunk is one task.  ``value`` should have
        the same chunks on those axes (it is rechunked to ``key``'s otherwise,
        which moves data).  E and Ev are taken whole (rechunked if split).  The
        query is rechunked to match the key's batch and head chunks (its query
        axis L may stay chunked); it is small and goes to every key chunk.
    attn_mask : dask or NumPy array, optional, broadcastable to (..., Hq, L, S)
        bool (True takes part) or float (added); a mask with the full key axis
        is chunked like ``key`` along it, so each task gets its own slice.
    is_causal : bool or str
        True / ``"top_left"`` or ``"bottom_right"``, as in the single call; each
        chunk is given its shifted diagonal, and a chunk that no query row can
        see is not computed at all.
    scale, enable_gqa : as in :func:`sdpa.scaled_dot_product_attention`
    key_lengths : array_like of int, optional, broadcastable to the batch dims
        Keys at or past ``key_lengths[b]`` are ignored; translated per chunk (a
        small NumPy array; a dask array is computed first).
    return_lse : bool
        Also return the log-sum-exp, shape (..., Hq, L).
    split_every : int, default 8
        How many partial results one merge task combines (the tree's fan-in).
    num_threads : int, optional
        Threads each task uses (``None``: the worker's default; distributed's
        nanny sets ``OMP_NUM_THREADS=1`` in its workers).

    Returns
    -------
    dask array (..., Hq, L, Ev) of the single call's dtype, and with
    ``return_lse`` the log-sum-exp too (a tuple).  Equal to the single call on
    the whole arrays up to float rounding (the merge regroups the sums).  A
    16-bit query's partials are computed and merged in float32 and rounded once.
    """
    # a NumPy query is sliced here and its blocks go into the tasks as values, so
    # that a chunk's task has no input but the chunk's own (keys, values, mask):
    # the scheduler then runs it where they are, whatever the workers' load
    local_query = not isinstance(query, da.Array)
    q = _as_dask(query, "query")
    k = _as_dask(key, "key")
    v = _as_dask(value, "value")
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        raise ValueError(f"split_every: expected an int >= 2, got {split_every!r}")
    threads = thread_count(num_threads)
    dtype, _ = operand_dtypes(q.dtype, k.dtype, v.dtype)
    cdtype = compute_dtype(dtype)
    plan = plan_shapes(q.shape, k.shape, v.shape, enable_gqa)
    L, S, E, Ev = plan.L, plan.S, plan.E, plan.Ev
    scale_value = scale_of(scale, E)
    causal, offset = _causal_offset(is_causal, L, S)

    # every operand as (*batch, heads, seq, features), batch dims broadcast
    nb = len(plan.batch_shape)
    q, k, v = (_lift(a, nb + 3) for a in (q, k, v))
    heads = plan.heads
    group = plan.group
    kv_heads = heads // group if heads else (v.shape[-3] if k.shape[-3] == 1 else k.shape[-3])
    q = da.broadcast_to(q, plan.batch_shape + (heads, L, E))
    k = da.broadcast_to(k, plan.batch_shape + (kv_heads, S, E))
    v = da.broadcast_to(v, plan.batch_shape + (kv_heads, S, Ev))

    # chunks: the key's on batch, heads and keys; E and Ev whole
    k = k.rechunk(k.chunks[:-1] + ((E,),))
    batch_chunks, kv_head_chunks, s_chunks = k.chunks[:nb], k.chunks[nb], k.chunks[nb + 1]
    v = v.rechunk(k.chunks[:-1] + ((Ev,),))
    head_chunks = tuple(c * group for c in kv_head_chunks)
    q = q.rechunk(batch_chunks + (head_chunks, q.chunks[nb + 1], (E,)))
    l_chunks = q.chunks[nb + 1]
    head_starts, l_starts = _starts(head_chunks), _starts(l_chunks)
    if local_query:
        qn = np.broadcast_to(_lift(np.asarray(query), nb + 3), q.shape)

        def q_block(bi: Tuple[int, ...], bslice: Tuple[slice, ...], hi: int, li: int) -> Any:
            return np.ascontiguousarray(
                qn[bslice + (slice(head_starts[hi], head_starts[hi + 1]), slice(l_starts[li], l_starts[li + 1]))]
            )
    else:
        qd = q.to_delayed(optimize_graph=False)

        def q_block(bi: Tuple[int, ...], bslice: Tuple[slice, ...], hi: int, li: int) -> Any:
            return qd[bi + (hi, li, 0)]

    m = None
    mask_block = None
    if attn_mask is not None:
        m = attn_mask if isinstance(attn_mask, da.Array) else np.asarray(attn_mask)
        full = plan.batch_shape + (heads, L, S)
        mask_checked(m.dtype, m.shape, full, f"query {q.shape}, key {k.shape}, value {v.shape}")
        m = _lift(m, len(full))
        target = batch_chunks + (head_chunks, l_chunks, s_chunks)
        if isinstance(m, da.Array):  # its chunks: the target's along the axes it does not broadcast
            m = m.rechunk(tuple(t if d != 1 or n == 1 else -1 for d, n, t in zip(m.shape, full, target)))
            md = m.to_delayed(optimize_graph=False)

            def mask_block(index: Tuple[int, ...]) -> Any:
                return md[tuple(0 if md.shape[d] == 1 else i for d, i in enumerate(index))]
        else:  # sliced here, like a NumPy query
            bounds = [_starts(t) for t in target]
            mn = m

            def mask_block(index: Tuple[int, ...]) -> Any:
                return np.ascontiguousarray(mn[tuple(
                    slice(None) if mn.shape[d] == 1 else slice(bounds[d][i], bounds[d][i + 1])
                    for d, i in enumerate(index)
                )])

    lengths = None
    if key_lengths is not None:
        kl = np.asarray(key_lengths.compute() if isinstance(key_lengths, da.Array) else key_lengths)
        key_lengths_checked(kl, plan.batch_shape, f"query {q.shape}, key {k.shape}, value {v.shape}")
        lengths = np.broadcast_to(kl, plan.batch_shape).astype(np.int64)

    kd = k.to_delayed(optimize_graph=False)
    vd = v.to_delayed(optimize_graph=False)
    partial = dask.delayed(_partial, pure=True)
    merge = dask.delayed(_merge, pure=True)
    s_starts = _starts(s_chunks)
    batch_starts = [_starts(c) for c in batch_chunks]

    out_blocks: Dict[Tuple[int, ...], Any] = {}
    lse_blocks: Dict[Tuple[int, ...], Any] = {}
    for bi in np.ndindex(*(len(c) for c in batch_chunks)):
        bsizes = tuple(batch_chunks[d][i] for d, i in enumerate(bi))
        bslice = tuple(slice(batch_starts[d][i], batch_starts[d][i + 1]) for d, i in enumerate(bi))
        for hi, hq in enumerate(head_chunks):
            for li, lc in enumerate(l_chunks):
                l0 = l_starts[li]
                parts = []
                for si, sc in enumerate(s_chunks):
                    s0 = s_starts[si]
                    diagonal = _chunk_diagonal(causal, offset, l0, s0)
                    if sc and L and not _sees_chunk(diagonal, lc):
                        continue  # no row of this block sees a key of this chunk
                    chunk_lengths = None
                    if lengths is not None:
                        chunk_lengths = np.clip(lengths[bslice] - s0, 0, sc)
                        if sc and not chunk_lengths.any():
                            continue  # every key of this chunk is past its batch's length
                    mblock = mask_block(bi + (hi, li, si)) if mask_block is not None else None
                    kidx = bi + (hi, si, 0)
                    parts.append(partial(
                        q_block(bi, bslice, hi, li), kd[kidx], vd[kidx], mblock, chunk_lengths,
                        scale_value, diagonal, group > 1, threads,
                    ))
                while len(parts) > 1:
                    parts = [
                        merge(*parts[i:i + split_every]) if len(parts[i:i + split_every]) > 1 else parts[i]
                        for i in range(0, len(parts), split_every)
                    ]
                shape = bsizes + (hq, lc)
                if parts:
                    out_blocks[bi + (hi, li, 0)] = da.from_delayed(
                        dask.delayed(_output, pure=True)(parts[0], dtype), shape + (Ev,), dtype=dtype,
                        meta=np.empty((0,) * (nb + 3), dtype),
                    )
                    lse_blocks[bi + (hi, li)] = da.from_delayed(
                        dask.delayed(operator.getitem, pure=True)(parts[0], 1), shape, dtype=cdtype,
                        meta=np.empty((0,) * (nb + 2), cdtype),
                    )
                else:  # no key visible to any row of this block
                    out_blocks[bi + (hi, li, 0)] = da.zeros(shape + (Ev,), dtype=dtype, chunks=-1)
                    lse_blocks[bi + (hi, li)] = da.full(shape, -np.inf, dtype=cdtype, chunks=-1)
    grid = tuple(len(c) for c in batch_chunks) + (len(head_chunks), len(l_chunks))
    out = da.block(_nest(out_blocks, grid + (1,))).reshape(plan.out_shape)
    if not return_lse:
        return out
    lse = da.block(_nest(lse_blocks, grid)).reshape(plan.out_shape[:-1])
    return out, lse
