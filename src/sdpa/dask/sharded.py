"""sdpa.dask.ShardedKVCache: a KV cache for decoding whose positions are split
across the workers of a distributed cluster, each range held by an actor."""
from __future__ import annotations

import threading
import time
from collections import abc
from typing import Any, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .._api import (
    _causal_offset,
    compute_dtype,
    count,
    scale_of,
    thread_count,
)
from ..kvcache import KVCache, KVCacheFullError
from .lazy import Partial, _chunk_diagonal, _compute_query, _merge, _sees_chunk, _starts

# ---- a KV cache split across workers -------------------------------------------------------

def _worker_addresses(client: Any) -> Set[str]:
    """The addresses of the cluster's workers, asked of the scheduler now.
    (``Client.scheduler_info()`` returns a cached identity that the client's
    periodic refresh replaces with one whose ``"workers"`` is empty, so that
    it may read as a cluster without workers.)"""
    return {str(w) for w in client.nthreads()}


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
        (``dtype="int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` or ``"int4"`` quantizes on the
        shard's worker).
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
            workers = sorted(_worker_addresses(self._client))
        self._workers = [str(w) for w in workers]
        if not self._workers:
            raise ValueError("workers: the cluster has no workers")
        per_shard = -(-self._capacity // len(self._workers))
        self._shard_capacity = per_shard
        s = self._spec
        futures = [
            self._client.submit(
                _Shard, s.batch, s.num_kv_heads, per_shard, s.head_dim, s.head_dim_v,
                s.quantization or s.dtype, s.group_size, workers=[w], actor=True, pure=False,
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
            alive = _worker_addresses(self._client)
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
            diagonal = _chunk_diagonal(causal, offset, 0, s0)
            if n == 0 or (L and not _sees_chunk(diagonal, L)):
                continue  # holds nothing a row can see
            m = mask
            if mask is not None and mask.shape[-1] == S and S > 1:
                m = mask[..., s0:s0 + n]
            shards.append(i)
            args.append((m, diagonal))
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
        dt = np.dtype(np.float32) if s.quantization else s.dtype
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
            f"head_dim_v={s.head_dim_v}, dtype={s.quantization or s.dtype}, length={self.length}, "
            f"capacity={self.capacity}, shards={self._lengths} on {self._workers})"
        )
