"""Decode steps over a KV cache sharded across dask worker processes, against one
process holding the same cache.

For each worker count it builds a LocalCluster of that many single-threaded
worker processes, fills an sdpa.dask.ShardedKVCache, and times decode steps
(``cache.attend`` of one query position) in alternating rounds; the baseline is
``sdpa.KVCache.attend`` in this process with 1 thread and with as many threads as
the largest cluster has workers.  Prints a table (ms per step, GB/s of K/V read,
bytes on the network per step) and writes JSON with ``--json``.

    python benchmarks/dask_decode.py --keys 2000000 --json benchmarks/dask-decode.json
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

import sdpa
import sdpa.dask


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fill(cache, keys: int, shape, rng) -> None:
    B, Hkv, E = shape
    block = 1 << 16
    for s0 in range(0, keys, block):
        n = min(block, keys - s0)
        k = rng.standard_normal((B, Hkv, n, E), dtype=np.float32)
        cache.append(k, k)


def time_steps(attend, q, rounds: int) -> float:
    attend(q)  # warm
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        attend(q)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=2_000_000)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    p.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    p.add_argument("--rounds", type=int, default=15, help="timed steps per configuration and pass")
    p.add_argument("--passes", type=int, default=3, help="alternating passes over the configurations")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from distributed import Client, LocalCluster

    dtype = args.dtype
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    counts = [int(c) for c in args.workers.split(",")]
    B, H, Hkv, E = 1, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, 1, E), dtype=np.float32)

    local = sdpa.KVCache(B, Hkv, args.keys, E, dtype=dtype)
    fill(local, args.keys, (B, Hkv, E), np.random.default_rng(1))
    kv_bytes = local.nbytes
    configs = {}
    clusters = []
    for n in counts:
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0",
                               silence_logs=logging.ERROR)
        client = Client(cluster, set_as_default=False)
        cache = sdpa.dask.ShardedKVCache(B, Hkv, args.keys, E, dtype=dtype, client=client)
        fill(cache, args.keys, (B, Hkv, E), np.random.default_rng(1))
        clusters.append((cluster, client, cache))
        configs[f"{n} worker process{'es' if n > 1 else ''}"] = cache.attend
    for t in sorted({1, max(counts)}):
        configs[f"one process, {t} thread{'s' if t > 1 else ''}"] = (
            lambda query, t=t: local.attend(query, num_threads=t)
        )

    samples = {name: [] for name in configs}
    for _ in range(args.passes):
        for name, attend in configs.items():
            samples[name].append(time_steps(attend, q, args.rounds))
    check = max(float(np.max(np.abs(c.attend(q) - local.attend(q)))) for _, _, c in clusters)
    for cluster, client, cache in clusters:
        cache.close()
        client.close()
        cluster.close()

    rows = []
    for name, ts in samples.items():
        t = statistics.median(ts)
        shards = int(name.split()[0]) if "worker" in name else 0
        rows.append({
            "config": name, "ms_per_step": t * 1e3, "kv_gb_per_s": kv_bytes / t / 1e9,
            "network_bytes_per_step": shards * B * H * (E + 1) * 4 + shards * q.nbytes,
        })
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    result = {
        "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "shape": {"batch": B, "heads": H, "kv_heads": Hkv, "head_dim": E, "keys": args.keys},
        "dtype": args.dtype, "kv_bytes": kv_bytes, "max_abs_diff_sharded_vs_one": check, "rows": rows,
    }
    print(f"{result['cpu']}, {args.keys:,} keys, {Hkv} kv heads x {E}, {H} query heads, {args.dtype} "
          f"({kv_bytes / 2**20:.0f} MiB of K/V); max |sharded - one process| = {check:.1e}")
    print(f"{'configuration':<28} {'ms/step':>9} {'GB/s K/V':>9} {'network B/step':>15}")
    for r in rows:
        print(f"{r['config']:<28} {r['ms_per_step']:>9.2f} {r['kv_gb_per_s']:>9.1f} "
              f"{r['network_bytes_per_step']:>15,}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
