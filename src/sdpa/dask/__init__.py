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

try:
    import dask  # noqa: F401
    import dask.array  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        f"sdpa.dask needs dask[array] and distributed ({exc}); install them with: pip install 'sdpa[dask]'"
    ) from exc

from .lazy import scaled_dot_product_attention
from .sharded import ShardedKVCache, ShardLostError

__all__ = ["scaled_dot_product_attention", "ShardedKVCache", "ShardLostError"]
