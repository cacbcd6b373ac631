"""Instructions per call of the small, hot calls, counted by callgrind.

    python benchmarks/call_icount.py [CASE ...] [--calls N]

Each case runs twice under ``valgrind --tool=callgrind`` (one thread,
``PYTHONHASHSEED=0``): once with N calls after a warm-up, once with none; the
difference over N is a call's count.  Counts repeat to a few hundred
instructions, so a change to the Python/Cython boundary shows where a timing on
a shared machine would not.  valgrind runs the avx2 kernels.  Without CASE,
every case; ``--list`` names them.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict

import numpy as np

CASES: Dict[str, str] = {
    "tiny": "(1, 8, 1, 16, 64) float32, the public function",
    "decode": "(1, 8, 1, 256, 64) float32, the public function",
    "causal-lse": "(1, 8, 4, 16, 64), bottom-right causal, scale, lse",
    "kvcache-f32": "KVCache.attend, float32 cache of 32 positions",
    "kvcache-int8": "KVCache.attend, int8 cache of 32 positions",
    "torch": "sdpa.torch, (1, 8, 1, 16, 64)",
    "paged": "paged_attention, 2 sequences of 40 / 33 positions",
    "varlen": "varlen_attention, 3 sequences",
}


def _setup(case: str) -> Callable[[], object]:
    """The call of ``case``, its arrays made."""
    import sdpa

    rng = np.random.default_rng(0)

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    if case in ("tiny", "decode"):
        S = 16 if case == "tiny" else 256
        q, k, v = r(1, 8, 1, 64), r(1, 8, S, 64), r(1, 8, S, 64)
        return lambda: sdpa.scaled_dot_product_attention(q, k, v)
    if case == "causal-lse":
        q, k, v = r(1, 8, 4, 64), r(1, 8, 16, 64), r(1, 8, 16, 64)
        return lambda: sdpa.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", scale=0.1,
                                                         return_lse=True)
    if case in ("kvcache-f32", "kvcache-int8"):
        cache = sdpa.KVCache(1, 8, 64, 64, dtype="float32" if case == "kvcache-f32" else "int8")
        cache.append(r(1, 8, 32, 64), r(1, 8, 32, 64))
        q = r(1, 8, 1, 64)
        return lambda: cache.attend(q)
    if case == "torch":
        import torch

        import sdpa.torch as st

        tq, tk, tv = (torch.from_numpy(a) for a in (r(1, 8, 1, 64), r(1, 8, 16, 64), r(1, 8, 16, 64)))
        torch.set_grad_enabled(False)
        return lambda: st.scaled_dot_product_attention(tq, tk, tv)
    if case == "paged":
        bs, nblocks = 16, 8
        kc, vc = r(nblocks, 8, bs, 64), r(nblocks, 8, bs, 64)
        tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=np.int32)
        lens = np.array([40, 33], dtype=np.int64)
        q = r(2, 8, 1, 64)
        return lambda: sdpa.paged_attention(q, kc, vc, tables, lens)
    if case == "varlen":
        cu = np.array([0, 5, 12, 20], dtype=np.int64)
        q, k, v = r(20, 8, 64), r(20, 8, 64), r(20, 8, 64)
        return lambda: sdpa.varlen_attention(q, k, v, cu, cu)
    raise SystemExit(f"unknown case {case!r}; --list names them")


def _run_calls(case: str, calls: int) -> None:
    """The process valgrind counts: a warm-up, then ``calls`` calls."""
    call = _setup(case)
    for _ in range(20):
        call()
    for _ in range(calls):
        call()


def _count(case: str, calls: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                        "--child", case, "--calls", str(calls)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            text = f.read()
    m = re.search(r"^summary:\s*(\d+)", text, re.M) or re.search(r"^totals:\s*(\d+)", text, re.M)
    if m is None:
        raise SystemExit("callgrind wrote no summary")
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="cases to count (default: all)")
    ap.add_argument("--calls", type=int, default=2000, help="calls counted (default 2000)")
    ap.add_argument("--list", action="store_true", help="name the cases and stop")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.list:
        for name, what in CASES.items():
            print(f"{name:14s} {what}")
        return
    if args.child:
        _run_calls(args.cases[0], args.calls)
        return
    cases = args.cases or list(CASES)
    for case in cases:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; --list names them")
    print(f"| call | instructions per call ({args.calls} calls) |")
    print("| --- | ---: |")
    for case in cases:
        n = (_count(case, args.calls) - _count(case, 0)) / args.calls
        print(f"| {CASES[case]} | {n:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
