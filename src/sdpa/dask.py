"""Attention over keys and values spread across a Dask cluster, merged exactly.

Context parallelism: each worker keeps a contiguous range of the keys and
values; the query goes to every range, each range gives its partial output and
log-sum-exp (``return_lse=True``), and the partials are combined by
:func:`sdpa.merge_attention`, which is exact: the merged result is the
attention over all the keys, to float rounding.  Only the query and the
partial results travel, ``O(L * Ev)`` numbers per range; the keys and values
stay where they are.

* :func:`scaled_dot_product_attention` takes dask arrays chunked along the key
  axis (and optionally along batch, head and query axes) and returns dask
  arrays.  It runs on any dask scheduler; on ``distributed`` each key chunk's
  task runs on the worker that holds the chunk.
* :class:`ShardedKVCache` is a KV cache for decoding whose positions are split
  across workers, each range held by an actor on its worker.

Needs ``dask[array]`` (and ``distributed`` for :class:`ShardedKVCache`):
``pip install "sdpa[dask]"``.  Nothing else in sdpa imports dask.

    >>> from distributed import Client, LocalCluster        # doctest: +SKIP
    >>> client = Client(LocalCluster(n_workers=2))           # doctest: +SKIP
    >>> k = dask.array.random.standard_normal((1, 8, 1_000_000, 64), chunks=(1, 8, 250_000, 64))
    >>> out = sdpa.dask.scaled_dot_product_attention(q, k, k).compute()   # doctest: +SKIP
"""
from __future__ import annotations

import math
import operator
import threading
import time
from collections import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

try:
    import dask
    import dask.array as da
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        f"sdpa.dask needs dask[array] and distributed ({exc}); install them with: pip install 'sdpa[dask]'"
    ) from exc

from ._api import (
    _attention_general,
    _causal_offset,
    _is_bfloat16,
    compute_dtype,
    count,
    operand_dtypes,
    plan_shapes,
    scale_of,
    thread_count,
)
from .kvcache import KVCache, KVCacheFullError
from .merge import merge_attention

__all__ = ["scaled_dot_product_attention", "ShardedKVCache", "ShardLostError"]

Partial = Tuple[np.ndarray, np.ndarray]


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
    out, lse = _attention_general(
        _compute_query(q), k, v, mask, False, scale, gqa, False, True, lengths, None, num_threads,
        diagonal=diagonal,
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
    for a, name in ((q, "query"), (k, "key"), (v, "value")):
        if a.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., seq, features), got shape {a.shape}")
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
    hkv = k.shape[-3]
    group = heads // hkv if enable_gqa and hkv and heads % hkv == 0 and hkv != heads else 1
    kv_heads = heads // group if heads else hkv
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
        if m.dtype != np.bool_ and m.dtype.kind != "f" and m.dtype.name != "bfloat16":
            raise TypeError(
                f"attn_mask: expected a bool mask (True = takes part) or a float mask (added to "
                f"the scores), got dtype {m.dtype}"
            )
        full = plan.batch_shape + (heads, L, S)
        if m.ndim > len(full) or any(d not in (1, n) for d, n in zip(m.shape[::-1], full[::-1])):
            raise ValueError(
                f"attn_mask: shape {m.shape} does not broadcast to the scores' shape {full} "
                f"(..., heads, L, S)"
            )
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
        if kl.dtype.kind not in "iu":
            raise TypeError(f"key_lengths: expected integers, got dtype {kl.dtype}")
        try:
            lengths = np.broadcast_to(kl, plan.batch_shape).astype(np.int64)
        except ValueError:
            raise ValueError(
                f"key_lengths: shape {kl.shape} does not broadcast to the batch dims {plan.batch_shape}"
            ) from None
        if lengths.size and int(lengths.min()) < 0:
            raise ValueError(f"key_lengths: must be >= 0, got a minimum of {int(lengths.min())}")

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
                    diagonal = offset + l0 - s0 if causal else None
                    if causal and sc and L and l0 + lc - 1 + offset - s0 < 0:
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


# ---- a KV cache split across workers -------------------------------------------------------

class ShardLostError(RuntimeError):
    """A worker holding a shard of a :class:`ShardedKVCache` is gone, and with it
    that shard's keys and values: the cache cannot give a right answer any more."""


class _Shard:
    """One contiguous range of positions, held by an actor on its worker."""

    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 head_dim_v: int, dtype: Any, group_size: Optional[int]) -> None:
        self.cache = KVCache(batch, num_kv_heads, capacity, head_dim, head_dim_v,
                             dtype=dtype, group_size=group_size)

    def append(self, k: np.ndarray, v: np.ndarray) -> int:
        self.cache._append(k, v)
        return len(self.cache)

    def attend(self, query: np.ndarray, mask: Optional[np.ndarray], diagonal: Optional[int],
               scale: float, num_threads: Optional[int]) -> Partial:
        out, lse = self.cache._attend(
            _compute_query(query), mask, False, scale, True, None, num_threads, diagonal=diagonal
        )
        return out, lse

    def contents(self) -> Tuple[np.ndarray, np.ndarray]:
        return np.array(self.cache.keys), np.array(self.cache.values)

    def nbytes(self) -> int:
        return self.cache.nbytes

    def reset(self) -> None:
        self.cache.reset()


class ShardedKVCache:
    """A KV cache whose positions are split across the workers of a dask
    cluster, for decoding over sequences longer than one machine holds.

    Shard ``i`` lives on ``workers[i]`` (an actor holding a :class:`sdpa.KVCache`
    of ``ceil(capacity / shards)`` positions) and owns a contiguous range of
    positions: appends fill shard 0, then shard 1, and so on, each append going
    to the shard(s) that own the end of the sequence.  :meth:`attend` sends the
    query to every shard holding positions, each computes its partial output and
    log-sum-exp over its own keys and values, and the partials are merged here
    by :func:`sdpa.merge_attention` (exact).  Keys and values cross the network
    once, on append; a decode step moves the query to each shard and
    ``batch * heads * L * (Ev + 1)`` numbers back from each.

    Parameters
    ----------
    batch, num_kv_heads, capacity, head_dim, head_dim_v, dtype, group_size
        As for :class:`sdpa.KVCache`; ``capacity`` is the total over the shards
        (``dtype="int8"`` quantizes on the shard's worker).
    client : distributed.Client, optional
        Defaults to the current client (``distributed.get_client()``).
    workers : sequence of str, optional
        Worker addresses, one shard each (repeat an address for more shards on
        one worker).  Defaults to every worker of the cluster, sorted.

    Raises
    ------
    ShardLostError
        From any call once a shard's worker has died.  The first call after the
        death raises it once connecting to that worker has timed out
        (``distributed.comm.timeouts.connect``, 30 s by default, read when the
        client is made).
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        dtype: Any = np.float32,
        group_size: Optional[int] = None,
        *,
        client: Any = None,
        workers: Optional[Sequence[str]] = None,
    ) -> None:
        from distributed import get_client

        # checks every argument the shards will be built with, here, at no cost,
        # with KVCache's own errors (the capacity included, before it is split)
        self._spec = KVCache(batch, num_kv_heads, 0, head_dim, head_dim_v, dtype=dtype, group_size=group_size)
        self._capacity = count(capacity, "capacity", 0)
        if workers is not None:
            if isinstance(workers, (str, bytes)) or not isinstance(workers, abc.Sequence):
                raise TypeError(f"workers: expected a sequence of worker addresses, got {type(workers).__name__}")
            if not all(isinstance(w, str) for w in workers):
                raise TypeError("workers: expected worker addresses (str)")
            if not workers:
                raise ValueError("workers: expected at least one worker address, got none")
        self._client = client if client is not None else get_client()
        if workers is None:
            workers = sorted(self._client.scheduler_info(n_workers=-1)["workers"])
        self._workers = [str(w) for w in workers]
        if not self._workers:
            raise ValueError("workers: the cluster has no workers")
        per_shard = -(-self._capacity // len(self._workers))
        self._shard_capacity = per_shard
        s = self._spec
        futures = [
            self._client.submit(
                _Shard, s.batch, s.num_kv_heads, per_shard, s.head_dim, s.head_dim_v,
                s.dtype, s.group_size, workers=[w], actor=True, pure=False,
            )
            for w in self._workers
        ]
        self._futures = futures  # keep the actors alive
        with self._client.as_current():  # actor handles bind to the current client
            self._shards = [f.result() for f in futures]
        self._lengths = [0] * len(self._shards)
        self._lock = threading.Lock()
        self._lost: Optional[str] = None

    # ---- sizes ------------------------------------------------------------------------
    @property
    def workers(self) -> List[str]:
        """The worker address of each shard."""
        return list(self._workers)

    @property
    def shard_lengths(self) -> List[int]:
        """Positions held by each shard."""
        return list(self._lengths)

    @property
    def shard_capacity(self) -> int:
        """Positions each shard can hold."""
        return self._shard_capacity

    @property
    def capacity(self) -> int:
        """Positions all the shards together can hold."""
        return self._shard_capacity * len(self._shards)

    @property
    def length(self) -> int:
        return sum(self._lengths)

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes of keys, values and scales held by all the shards."""
        return sum(self._call(lambda sh, i: sh.nbytes(), range(len(self._shards))))

    # ---- the remote calls ---------------------------------------------------------------
    def _call(self, method: Any, shards: Sequence[int]) -> List[Any]:
        """method(actor, i) for each shard i of ``shards``, run concurrently on
        their workers; the results in order."""
        if self._lost:
            raise ShardLostError(self._lost)
        try:
            with self._client.as_current():
                pending = [method(self._shards[i], i) for i in shards]
                return [p.result() for p in pending]
        except Exception as exc:
            gone = self._gone(wait=isinstance(exc, (OSError, TimeoutError)))
            if not gone:
                raise
            i = gone[0]
            start = sum(self._lengths[:i])
            self._lost = (
                f"shard {i} on worker {self._workers[i]} is gone, and with it positions "
                f"{start}..{start + self._lengths[i]} of the cache; build the cache again "
                f"({type(exc).__name__}: {exc})"
            )
            raise ShardLostError(self._lost) from exc

    def _gone(self, wait: bool) -> List[int]:
        """The shards whose worker the scheduler no longer knows; after a
        connection error, waits a few seconds for the scheduler to notice."""
        deadline = time.monotonic() + (10.0 if wait else 0.0)
        while True:
            alive = set(self._client.scheduler_info(n_workers=-1)["workers"])
            gone = [i for i, w in enumerate(self._workers) if w not in alive]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.1)

    # ---- append, attend ----------------------------------------------------------------
    def append(self, k: Any, v: Any) -> None:
        """Append T positions, (batch, num_kv_heads, T, head_dim) keys and
        (..., head_dim_v) values, to the shard(s) owning the end of the sequence.
        Bad shapes or dtypes, values an int8 cache cannot hold (NaN, inf), or
        too many positions raise here and change nothing."""
        k = np.asarray(k)
        v = np.asarray(v)
        self._spec.check_fits(*_cache_dims(k, v))
        k, v = self._spec._checked(k, v)  # what one shard's append would refuse
        T = k.shape[2]
        with self._lock:
            if self.length + T > self.capacity:
                raise KVCacheFullError(
                    f"k: {T} more positions do not fit: the cache holds {self.length} of "
                    f"{self.capacity} ({len(self._shards)} shards of {self._shard_capacity})"
                )
            done = 0
            for i in range(len(self._shards)):
                room = self._shard_capacity - self._lengths[i]
                if done == T:
                    break
                if room <= 0:
                    continue
                n = min(room, T - done)
                piece = slice(done, done + n)
                kp, vp = k[:, :, piece], v[:, :, piece]
                self._lengths[i] = self._call(lambda sh, j, kp=kp, vp=vp: sh.append(kp, vp), [i])[0]
                done += n

    def attend(
        self,
        query: Any,
        attn_mask: Any = None,
        is_causal: Union[bool, str] = "bottom_right",
        scale: Optional[float] = None,
        *,
        return_lse: bool = False,
        num_threads: Optional[int] = None,
    ) -> Any:
        """Attention of ``query`` (batch, num_heads, L, head_dim) over every held
        position: :meth:`sdpa.KVCache.attend` over the whole sequence.

        ``attn_mask`` broadcasts to (batch, num_heads, L, len(self)); each shard
        gets its slice.  ``is_causal`` defaults to ``"bottom_right"`` (the L
        queries are the last L positions).  Returns the output (and with
        ``return_lse`` the log-sum-exp), NumPy arrays in the dtype
        :meth:`sdpa.KVCache.attend` gives.
        """
        q = np.asarray(query)
        s = self._spec
        if (q.ndim != 4 or q.shape[0] != s.batch or q.shape[1] % s.num_kv_heads
                or q.shape[3] != s.head_dim):
            raise ValueError(
                f"query: expected shape (batch={s.batch}, a multiple of num_kv_heads="
                f"{s.num_kv_heads}, L, head_dim={s.head_dim}), got {q.shape}"
            )
        B, H, L, _ = q.shape
        S = self.length
        scale_value = scale_of(scale, s.head_dim)
        causal, offset = _causal_offset(is_causal, L, S)
        threads = thread_count(num_threads)
        mask = None
        if attn_mask is not None:
            mask = np.asarray(attn_mask)
            try:
                ok = np.broadcast_shapes(mask.shape, (B, H, L, S)) == (B, H, L, S)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"attn_mask: shape {mask.shape} does not broadcast to (batch, heads, L, S) = "
                    f"{(B, H, L, S)}"
                )
        starts = _starts(self._lengths)
        shards, args = [], []
        for i, n in enumerate(self._lengths):
            s0 = starts[i]
            if n == 0 or (causal and L and L - 1 + offset - s0 < 0):
                continue  # holds nothing a row can see
            m = mask
            if mask is not None and mask.shape[-1] == S and S > 1:
                m = mask[..., s0:s0 + n]
            shards.append(i)
            args.append((m, offset - s0 if causal else None))
        dtype = s.result_dtype(q.dtype)
        cdtype = compute_dtype(dtype)
        if shards:
            by_shard = dict(zip(shards, args))
            parts = self._call(lambda sh, i: sh.attend(q, *by_shard[i], scale_value, threads), shards)
            out, lse = parts[0] if len(parts) == 1 else _merge(*parts)
            out = out.astype(dtype, copy=False)
            lse = lse.astype(cdtype, copy=False)
        else:
            out = np.zeros((B, H, L, s.head_dim_v), dtype=dtype)
            lse = np.full((B, H, L), -np.inf, dtype=cdtype)
        return (out, lse) if return_lse else out

    # ---- contents ----------------------------------------------------------------------
    def _contents(self) -> Tuple[np.ndarray, np.ndarray]:
        held = [i for i, n in enumerate(self._lengths) if n]
        parts = self._call(lambda sh, i: sh.contents(), held)
        s = self._spec
        dt = np.dtype(np.float32) if s.dtype == np.int8 else s.dtype
        if not parts:
            return (np.zeros((s.batch, s.num_kv_heads, 0, s.head_dim), dt),
                    np.zeros((s.batch, s.num_kv_heads, 0, s.head_dim_v), dt))
        return (np.concatenate([p[0] for p in parts], axis=2),
                np.concatenate([p[1] for p in parts], axis=2))

    @property
    def keys(self) -> np.ndarray:
        """Every held key, (batch, num_kv_heads, len(self), head_dim), gathered from
        the shards: a copy of the whole cache (an int8 cache's dequantized values),
        for checking; :meth:`attend` never builds it."""
        return self._contents()[0]

    @property
    def values(self) -> np.ndarray:
        """Every held value, gathered like :attr:`keys`."""
        return self._contents()[1]

    def reset(self) -> None:
        """Forget every position (the shards keep their storage)."""
        with self._lock:
            self._call(lambda sh, i: sh.reset(), range(len(self._shards)))
            self._lengths = [0] * len(self._shards)

    def close(self) -> None:
        """Release the shards' actors (and their memory on the workers)."""
        self._shards = []
        for f in self._futures:
            f.release()
        self._futures = []
        self._lengths = []
        self._lost = "the cache is closed"

    def __enter__(self) -> "ShardedKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._spec
        return (
            f"ShardedKVCache(batch={s.batch}, num_kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
            f"head_dim_v={s.head_dim_v}, dtype={s.dtype}, length={self.length}, "
            f"capacity={self.capacity}, shards={self._lengths} on {self._workers})"
        )


def _cache_dims(k: np.ndarray, v: np.ndarray) -> Tuple[int, int, int, int]:
    """(batch, heads, head_dim, head_dim_v) of an append's k and v, checked."""
    for a, name in ((k, "k"), (v, "v")):
        if a.ndim != 4:
            raise ValueError(f"{name}: expected shape (batch, num_kv_heads, T, head_dim), got {a.shape}")
    if k.shape[:3] != v.shape[:3] or k.shape[2] < 1:
        raise ValueError(
            f"k, v: expected the same (batch, num_kv_heads, T >= 1) dims, got {k.shape} and {v.shape}"
        )
    return k.shape[0], k.shape[1], k.shape[3], v.shape[3]
