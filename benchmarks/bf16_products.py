"""The bfloat16 product kernel of each kernel set on its own: GFLOP/s of
``gemm_bf16`` on the two products of a tile of the bfloat16 path, one thread.

    Q Kᵀ:  m keys x 32 query rows, E/2 pairs, K read in place (a_ks = 1)
    P V:   Ev features x 32 query rows, keys/2 pairs, V packed the set's way

so that the kernels can be compared apart from the softmax and the packing
around them (``python -m sdpa.bench --impls sdpa,sdpa@avx512_bf16`` times the
whole call).  On an AMX CPU this is ``amx`` (tiles) against ``avx512_bf16``
(VDPBF16PS); ``amx_emulated`` is the amx code over a software model of the
tiles, far slower, listed only with ``--emulated``.  Rounds alternate between
the sets; medians are reported.

    python benchmarks/bf16_products.py                 # every set this CPU runs
    python benchmarks/bf16_products.py --json out.json --rounds 9
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from sdpa import _core
from sdpa.bench.machine import machine_info

NR = 32  # query rows of a panel: the columns of every product


def aligned(n: int, dtype: Any) -> np.ndarray:
    """n zeros of dtype, 64-byte aligned (the kernels' b and c rows)."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(n * itemsize + 64, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n * itemsize].view(dtype)


def random_pairs(rng: np.random.Generator, n: int) -> np.ndarray:
    """n pairs of bfloat16 (normal values, truncated) as uint32."""
    bits = rng.standard_normal(2 * n).astype(np.float32).view(np.uint32) >> 16
    return (bits[0::2] | (bits[1::2] << 16)).astype(np.uint32)


def cases(quick: bool) -> List[Dict[str, Any]]:
    """(name, m, kpairs, layout): the products of one key tile against one panel."""
    if quick:
        return [dict(name="qk-64x64", m=64, kpairs=32, by_feature=False)]
    out = []
    for tile_k, E in ((128, 64), (512, 64), (256, 128), (128, 128)):
        out.append(dict(name=f"qk-{tile_k}x{E}", m=tile_k, kpairs=E // 2, by_feature=False))
        out.append(dict(name=f"pv-{E}x{tile_k}", m=E, kpairs=tile_k // 2, by_feature=True))
    return out


def product(name: str, case: Dict[str, Any], a: np.ndarray, b: np.ndarray, c: np.ndarray, repeat: int = 1) -> None:
    """``repeat`` calls of the set's kernel on the case in a C loop, with the tile
    state set up once around them as a task does; its a laid out as the set's
    driver lays it."""
    m, kp = case["m"], case["kpairs"]
    acc = case["by_feature"]  # P V adds into the accumulators; Q K^T writes fresh scores
    if case["by_feature"] and name == "avx512_bf16":  # V pairs as it packs them: [pairs][Ev]
        _core.gemm_bf16(name, m, kp, a, 1, m, b, NR, c, NR, acc, repeat)
    else:  # K rows in place, or V pairs feature by feature (the amx sets): [Ev][pairs]
        _core.gemm_bf16(name, m, kp, a, kp, 1, b, NR, c, NR, acc, repeat)


def run(sets: List[str], quick: bool, rounds: int, min_time: float) -> List[Dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for case in cases(quick):
        m, kp = case["m"], case["kpairs"]
        a = random_pairs(rng, m * kp)
        b = aligned(kp * NR, np.uint32)
        b[:] = random_pairs(rng, kp * NR)
        c = aligned(m * NR, np.float32)
        times: Dict[str, List[float]] = {s: [] for s in sets}

        call = functools.partial(product, case=case, a=a, b=b, c=c)
        inner: Dict[str, int] = {}
        for s in sets:  # calls per timing, so that each lasts about min_time
            call(s)
            t0 = time.perf_counter()
            call(s)
            one = max(time.perf_counter() - t0, 1e-7)
            inner[s] = max(1, int(min_time / one))
        for r in range(rounds):
            for s in sets if r % 2 == 0 else reversed(sets):
                t0 = time.perf_counter()
                call(s, repeat=inner[s])
                times[s].append((time.perf_counter() - t0) / inner[s])
        flops = 4.0 * m * kp * NR  # two products of a pair a column
        for s in sets:
            med = statistics.median(times[s])
            rows.append(dict(case=case["name"], set=s, m=m, kpairs=kp, seconds=med, gflops=flops / med / 1e9))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds a timing lasts (default 0.05)")
    ap.add_argument("--quick", action="store_true", help="one small case (a smoke run)")
    ap.add_argument("--emulated", action="store_true", help="also amx_emulated (slow)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    sets = [s for s in ("avx512_bf16", "amx") if _core.isa_supported(s)]
    if "amx" in sets and not _core.ask_for_tiles():
        print("amx: the OS refuses this process the AMX tile state; left out")
        sets.remove("amx")
    if args.emulated and _core.isa_supported("avx512_bf16"):
        sets.append("amx_emulated")
    if not sets:
        print("no kernel set with bfloat16 products runs on this CPU (they need AVX512-BF16)")
        return 0
    rows = run(sets, args.quick, args.rounds, args.min_time)
    print(f"{'case':14s} " + " ".join(f"{s + ' GFLOP/s':>22s}" for s in sets))
    for name in dict.fromkeys(r["case"] for r in rows):
        g = {r["set"]: r["gflops"] for r in rows if r["case"] == name}
        print(f"{name:14s} " + " ".join(f"{g[s]:22.1f}" for s in sets))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "sets": sets, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
