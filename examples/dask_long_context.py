"""Decoding over a long context whose KV cache is spread across a dask cluster.

Builds a cluster (a LocalCluster of worker processes on this machine, or joins
one with --scheduler), fills an sdpa.dask.ShardedKVCache with a few million
keys spread over the workers, then decodes: each step appends one position to
the shard owning the end of the sequence and attends to every position, each
worker computing over its own keys and values and sdpa merging the partial
results exactly.

    python examples/dask_long_context.py                       # 2 workers, 2M keys, bfloat16
    python examples/dask_long_context.py --workers 1 --keys 500000 --dtype int8 --check
    python examples/dask_long_context.py --scheduler tcp://10.0.0.1:8786   # an existing cluster

Needs ``pip install "sdpa[dask]"`` (bfloat16 also needs ml_dtypes; tqdm, if
installed, draws the progress bar).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import numpy as np

import sdpa
import sdpa.dask


def progress(total: int, desc: str):
    """A tqdm bar when tqdm is there, else a plain one on stderr."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="key", unit_scale=True)
    except ModuleNotFoundError:
        class Bar:
            def __init__(self) -> None:
                self.n = 0

            def update(self, n: int) -> None:
                self.n += n
                done = int(40 * self.n / max(total, 1))
                print(f"\r{desc} [{'#' * done}{'.' * (40 - done)}] {self.n}/{total}", end="", file=sys.stderr)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                print(file=sys.stderr)

        return Bar()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes of the LocalCluster (default 2)")
    p.add_argument("--scheduler", help="address of an existing cluster's scheduler, instead of a LocalCluster")
    p.add_argument("--keys", type=int, default=2_000_000, help="positions to fill the cache with (default 2M)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="features per head (default 64)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "int8"],
                   help="the cache's storage (default bfloat16)")
    p.add_argument("--steps", type=int, default=32, help="decode steps (default 32)")
    p.add_argument("--threads", type=int, default=1, help="threads per worker (default 1)")
    p.add_argument("--check", action="store_true",
                   help="gather the whole cache here at the end and check the last step against one process")
    args = p.parse_args(argv)

    from distributed import Client, LocalCluster

    dtype = args.dtype
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    if args.scheduler:
        client = Client(args.scheduler)
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=args.threads,
                               silence_logs=logging.ERROR)
        client = Client(cluster)
    print(f"dashboard: {client.dashboard_link}")
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    print(f"{len(workers)} workers: {', '.join(workers)}")

    B, H, Hkv, E = 1, args.heads, args.kv_heads, args.head_dim
    capacity = args.keys + args.steps
    cache = sdpa.dask.ShardedKVCache(B, Hkv, capacity, E, dtype=dtype, client=client)
    per_position = sdpa.KVCache(B, Hkv, 1, E, dtype=dtype).nbytes
    print(f"cache: {args.keys:,} keys of {Hkv} heads x {E} ({args.dtype}), "
          f"{per_position * capacity / 2**30:.2f} GiB in all, "
          f"{per_position * cache.shard_capacity / 2**30:.2f} GiB per shard ({len(workers)} shards)")

    rng = np.random.default_rng(0)
    block = 1 << 16
    start = time.perf_counter()
    with progress(args.keys, "fill") as bar:
        for s0 in range(0, args.keys, block):
            n = min(block, args.keys - s0)
            k = rng.standard_normal((B, Hkv, n, E), dtype=np.float32)
            v = rng.standard_normal((B, Hkv, n, E), dtype=np.float32)
            cache.append(k, v)
            bar.update(n)
    fill = time.perf_counter() - start
    print(f"filled in {fill:.1f} s ({args.keys / fill / 1e6:.2f} M keys/s); shards hold {cache.shard_lengths}")

    times = []
    q = None
    for _ in range(args.steps):
        q = rng.standard_normal((B, H, 1, E), dtype=np.float32)
        k = rng.standard_normal((B, Hkv, 1, E), dtype=np.float32)
        t = time.perf_counter()
        cache.append(k, k)
        out = cache.attend(q, num_threads=args.threads)
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    shards = sum(1 for n in cache.shard_lengths if n)
    network = shards * B * H * (E + 1) * 4 + shards * q.nbytes
    print(f"decode: {step * 1e3:.2f} ms per step (median of {args.steps}), {1 / step:.1f} tokens/s, "
          f"over {len(cache):,} positions; {network / 1e3:.1f} kB on the network per step")

    if args.check:
        keys, values = cache.keys, cache.values
        want = sdpa.scaled_dot_product_attention(q.astype(keys.dtype), keys, values, enable_gqa=H != Hkv)
        err = float(np.max(np.abs(out.astype(np.float64) - want.astype(np.float64))))
        print(f"check: max |sharded - one process| = {err:.2e}")
        if err > (1e-2 if keys.dtype.itemsize == 2 else 1e-4):
            print("check failed", file=sys.stderr)
            return 1
    cache.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
