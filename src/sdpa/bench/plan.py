"""The balance report: ``python -m sdpa.bench --plan``.

A call's work list is fixed by its shape: the planner cuts it into tasks,
costliest parts first, and the threads of the call take the next task as they
come free.  Servers have 32-128 cores, more than any machine here, so the plan
is made for such thread counts (the planner's own tile choices included) and
its schedule simulated with the plan's cost model: the balance is the ideal
time (the sum of the costs over the threads) over the simulated makespan, 1.0
for a perfect split.  The same work as separate calls (one per sequence for
varlen, a decode call and one call per prefill chunk for the mixed batch; the
shared prefix has no such split) is simulated call after call, each call's
own plan on all the threads: the one call's makespan against their sum.

The serving shapes (:data:`PLAN_CASES`):

- varlen-short: 256 packed sequences of U[8, 64] tokens, Hq 16 / Hkv 4, E 128, causal;
- varlen-long: 64 sequences of U[32, 512] tokens, the same heads;
- mixed: a paged batch of 4 sequences prefilling 256-token chunks onto
  1,024-4,096-token contexts and 60 decoding one token at 512-4,096, Hq 32 /
  Hkv 8, E 128, blocks of 16, in one call (``query_start_loc``);
- shared: 16 forks of an 8,192-token prompt plus 128 tokens each, decoding.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np

from ..paged import paged_plan
from ..varlen import varlen_plan

__all__ = ["PLAN_CASES", "makespan", "balance", "plan_case", "separate_makespan", "iter_plan", "format_plan_table"]

#: (name, what) of each case.
PLAN_CASES: Tuple[Tuple[str, str], ...] = (
    ("varlen-short", "256 sequences of U[8, 64], Hq16/4 E128 causal"),
    ("varlen-long", "64 sequences of U[32, 512], Hq16/4 E128 causal"),
    ("mixed", "4 chunks of 256 onto 1-4K + 60 decodes at 512-4K, Hq32/8 E128, blocks of 16"),
    ("shared", "16 forks of an 8192 prompt + 128 each, decoding, Hq32/8 E128, blocks of 16"),
)


def makespan(costs: Iterable[float], threads: int) -> float:
    """When the last of `threads` threads finishes, each taking the next task
    of the list (in order) as soon as it is free."""
    free = [0.0] * max(int(threads), 1)
    for c in costs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + float(c))
    return max(free)


def balance(costs: Sequence[float], threads: int) -> float:
    """Ideal time over makespan: 1.0 when every thread is busy to the end."""
    total = float(np.sum(costs))
    span = makespan(costs, threads)
    return total / threads / span if span > 0 else 1.0


def _varlen(rng: np.random.Generator, n: int, lo: int, hi: int) -> Dict[str, Any]:
    lens = rng.integers(lo, hi + 1, n)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q = np.zeros((T, 16, 128), np.float32)
    kv = np.zeros((T, 4, 128), np.float32)
    return {"fn": varlen_plan, "args": (q, kv, kv, cu, cu), "kw": {"is_causal": True}}


def _pool(lens: Sequence[int], bs: int, hkv: int, e: int) -> Tuple[np.ndarray, np.ndarray]:
    """An (empty) pool holding sequences of these lengths, and their tables."""
    blocks = sum(-(-n // bs) for n in lens)
    cache = np.zeros((max(blocks, 1), hkv, bs, e), np.float32)
    table = np.full((len(lens), -(-max(lens) // bs)), -1, np.int32)
    at = 0
    for b, n in enumerate(lens):
        m = -(-n // bs)
        table[b, :m] = np.arange(at, at + m)
        at += m
    return cache, table


def mixed_batch(rng: np.random.Generator) -> Tuple[List[int], List[int]]:
    """The mixed batch's sequence lengths and query rows."""
    lens = [int(x) for x in rng.integers(1024, 4097, 4)] + [int(x) for x in rng.integers(512, 4097, 60)]
    return lens, [256] * 4 + [1] * 60


def _case_calls(name: str, seed: int) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Case `name`'s one call, and the same work as separate calls (each
    {"fn", "args", "kw"}; none for the shared prefix)."""
    rng = np.random.default_rng(seed)
    if name in ("varlen-short", "varlen-long"):
        n, lo, hi = (256, 8, 64) if name == "varlen-short" else (64, 32, 512)
        c = _varlen(rng, n, lo, hi)
        q, kv, _, cu, _ = c["args"]
        parts = []
        for i in range(n):
            a, z = int(cu[i]), int(cu[i + 1])
            one = np.array([0, z - a])
            parts.append({"fn": varlen_plan, "args": (q[a:z], kv[a:z], kv[a:z], one, one), "kw": c["kw"]})
        return c, parts
    if name == "mixed":
        lens, rows = mixed_batch(rng)
        cache, table = _pool(lens, 16, 8, 128)
        qsl = np.concatenate([[0], np.cumsum(rows)])
        q = np.zeros((int(qsl[-1]), 32, 128), np.float32)
        sl = np.array(lens)
        c = {"fn": paged_plan, "args": (q, cache, cache, table, sl), "kw": {"query_start_loc": qsl}}
        decode = {"fn": paged_plan, "args": (np.zeros((60, 32, 1, 128), np.float32), cache, cache, table[4:], sl[4:]),
                  "kw": {}}
        chunks = [{"fn": paged_plan, "args": (np.zeros((1, 32, 256, 128), np.float32), cache, cache, table[b : b + 1],
                                              sl[b : b + 1]), "kw": {}} for b in range(4)]
        return c, [decode] + chunks
    if name == "shared":
        prompt, own, n, bs = 8192, 128, 16, 16
        cache, table = _pool([prompt + own] * n, bs, 8, 128)
        table[1:, : prompt // bs] = table[0, : prompt // bs]  # every fork reads the prompt's blocks
        q = np.zeros((n, 32, 1, 128), np.float32)
        return {"fn": paged_plan, "args": (q, cache, cache, table, np.full(n, prompt + own)), "kw": {}}, []
    raise ValueError(f"plan case: unknown {name!r}; known: {', '.join(x for x, _ in PLAN_CASES)}")


def plan_case(name: str, threads: int, seed: int = 0) -> Dict[str, Any]:
    """The plan of case `name` made for `threads` threads."""
    c, _ = _case_calls(name, seed)
    plan: Dict[str, Any] = c["fn"](*c["args"], threads=threads, **c["kw"])
    return plan


def separate_makespan(name: str, threads: int, seed: int = 0) -> float:
    """The simulated time of case `name`'s work as separate calls, one after
    the other on `threads` threads (0.0 when the case has no such split)."""
    _, calls = _case_calls(name, seed)
    total = 0.0
    for c in calls:
        plan = c["fn"](*c["args"], threads=threads, **c["kw"])
        total += makespan(plan["costs"], min(threads, max(int(plan["threads"]), 1)))
    return total


def iter_plan(threads: Sequence[int] = (16, 64, 128), cases: Sequence[str] = ()) -> Iterable[Dict[str, Any]]:
    """A row per case and thread count: tasks, parts, the balance (ValueError
    for a case name that is not one of :data:`PLAN_CASES`)."""
    unknown = [c for c in cases if c not in dict(PLAN_CASES)]
    if unknown:
        raise ValueError(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(x for x, _ in PLAN_CASES)}")
    for name, what in PLAN_CASES:
        if cases and name not in cases:
            continue
        for n in threads:
            plan = plan_case(name, n)
            costs = plan["costs"]
            apart = separate_makespan(name, n)
            yield {"case": name, "what": what, "threads": n, "tasks": int(costs.size), "parts": len(plan["parts"]),
                   "merges": int(plan["merges"]), "balance": balance(costs, n),
                   "largest_share": float(costs.max() / (costs.sum() / n)) if costs.size else 0.0,
                   "vs_separate": apart / makespan(costs, n) if apart > 0 else None}


def format_plan_table(rows: Sequence[Dict[str, Any]]) -> str:
    header = ("case", "threads", "tasks", "parts", "merges", "balance", "largest task / ideal", "vs separate calls")
    lines = [(r["case"], str(r["threads"]), str(r["tasks"]), str(r["parts"]), str(r["merges"]),
              f"{r['balance']:.3f}", f"{r['largest_share']:.3f}",
              f"{r['vs_separate']:.2f}x" if r.get("vs_separate") else "-") for r in rows]
    widths = [max([len(h)] + [len(x[i]) for x in lines]) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out)
