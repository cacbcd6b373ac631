"""Does importing sdpa change the speed of other libraries?

Runs fresh Python processes, alternately with and without ``import sdpa`` before
torch is imported, and times in each a few of torch's own small operations
(a decode-sized ``scaled_dot_product_attention``, a 64 x 768 x 768 matmul) and
NumPy's matmul.  Reports the median over processes of each median time, and the
ratio with / without sdpa.  A library that sets process-wide OpenMP variables at
import (as sdpa 0.1.0 set OMP_WAIT_POLICY=PASSIVE) shows up here as a ratio
well above 1.

    python benchmarks/import_side_effects.py --processes 7 --threads 2
    # what sdpa 0.1.0's import did, for comparison:
    python benchmarks/import_side_effects.py --with-env OMP_WAIT_POLICY=PASSIVE
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

CHILD = r"""
import os, sys, time, json
if os.environ["WITH_SDPA"] == "1":
    import sdpa  # noqa: F401  (the import under test)
import numpy as np
import torch
import torch.nn.functional as F

threads = int(os.environ["THREADS"])
torch.set_num_threads(threads)

def median_us(fn, inner, repeats=7):
    for _ in range(inner):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    times.sort()
    return times[len(times) // 2] * 1e6

gen = torch.Generator().manual_seed(0)
q = torch.randn(1, 8, 1, 64, generator=gen)
k = torch.randn(1, 8, 256, 64, generator=gen)
v = torch.randn(1, 8, 256, 64, generator=gen)
a = torch.randn(64, 768, generator=gen)
b = torch.randn(768, 768, generator=gen)
na, nb = a.numpy().copy(), b.numpy().copy()
out = {}
with torch.no_grad():
    out["torch sdpa decode (1, 8, 1/256, 64)"] = median_us(lambda: F.scaled_dot_product_attention(q, k, v), 2000)
    out["torch matmul 64x768x768"] = median_us(lambda: a @ b, 500)
out["numpy matmul 64x768x768"] = median_us(lambda: na @ nb, 500)
print(json.dumps(out))
"""


def run(processes: int, threads: int, with_env: Dict[str, str]) -> Dict[str, Dict[str, List[float]]]:
    results: Dict[str, Dict[str, List[float]]] = {"without": {}, "with": {}}
    for i in range(2 * processes):
        which = "with" if i % 2 else "without"  # interleaved, so drift hits both
        env = dict(os.environ, WITH_SDPA="1" if which == "with" else "0", THREADS=str(threads))
        if which == "with":
            env.update(with_env)
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                              timeout=600, check=True)
        for name, us in json.loads(proc.stdout).items():
            results[which].setdefault(name, []).append(us)
        print(f"\r{i + 1}/{2 * processes} processes", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return results


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=7, help="fresh processes of each kind")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    ap.add_argument("--with-env", action="append", default=[], metavar="KEY=VALUE",
                    help="also set this in the processes that import sdpa (e.g. to mimic an import "
                         "that sets it)")
    args = ap.parse_args(argv)
    with_env = dict(item.split("=", 1) for item in args.with_env)
    results = run(args.processes, args.threads, with_env)
    print(f"{'operation':40} {'without sdpa':>14} {'with sdpa':>12} {'ratio':>7}")
    for name in results["without"]:
        a = statistics.median(results["without"][name])
        b = statistics.median(results["with"][name])
        print(f"{name:40} {a:11.1f} us {b:9.1f} us {b / a:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "processes": args.processes, "with_env": with_env,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
