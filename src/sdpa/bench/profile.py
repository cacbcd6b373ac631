"""``python -m sdpa.bench --profile``: where the time of sdpa's tiled path goes.

Each call of the tiled path can time its phases (the C core's phase timers,
``sdpa._core.profile_start``): packing (the query panels, K and V tiles or the
once-per-call packing of K and V), Q Kᵀ, the scale, variants and masks, the
online softmax (with P's rounding to bfloat16 pairs on the bfloat16 path), P V
and the epilogue (output rows, log-sum-exp, weights).  Times are summed over
the threads and divided by the scores computed, so each figure is nanoseconds
per score per core; the products are Q Kᵀ and P V, the rest is the work around
them, which is the same code on every CPU of a kernel set family (AMX or not).
Decoding shapes run the row path, which has no phase timers: they are reported
as such.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .. import _core
from .._api import scaled_dot_product_attention
from .peers import kernel_set, kernel_set_of
from .shapes import Shape, make_inputs, make_mask
from .suite import suite_dtypes
from .threads import threads_text
from .timing import Progress

__all__ = ["PHASES", "PRODUCTS", "iter_profile", "format_profile_table"]

#: the phases, in the order of a tile
PHASES = tuple(_core.PROFILE_PHASES)
#: the phases that are products (the rest is "around" them)
PRODUCTS = ("qk", "pv")


def profile_call(call: Any, threads: int, repeat: int) -> Dict[str, Any]:
    """ns per score per core of each phase of ``repeat`` calls of ``call`` (after one
    untimed call), the wall time, and the scores; None figures when the calls ran
    no tiled task (the row path)."""
    call()
    _core.profile_start()
    try:
        t0 = time.perf_counter()
        for _ in range(repeat):
            call()
        wall = time.perf_counter() - t0
        prof = _core.profile_read()
    finally:
        _core.profile_stop()
    scores = prof["scores"]
    out: Dict[str, Any] = {"scores_per_call": scores / repeat, "wall_s": wall / repeat}
    if scores <= 0:
        out["status"] = "row path (no phase timers)"
        return out
    per = {ph: prof[ph] / scores for ph in PHASES}
    out.update(status="ok", phases=per, total=sum(per.values()),
               products=sum(per[ph] for ph in PRODUCTS),
               wall=wall * 1e9 * threads / scores)
    out["around"] = out["total"] - out["products"]
    return out


def iter_profile(
    shapes: Sequence[Shape],
    threads: Sequence[int],
    impls: Sequence[str] = ("sdpa",),
    dtype: str = "float32",
    *,
    kv_dtype: Optional[str] = None,
    repeat: int = 5,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> Iterator[Dict[str, Any]]:
    """One row per (shape, threads, impl): sdpa on this CPU's kernel set, or ``sdpa@SET``."""
    dt, kv_dt = suite_dtypes(dtype, kv_dtype)
    for shape in shapes:
        q, k, v = make_inputs(shape, dt, seed, kv_dt)
        mask = make_mask(shape, dt, seed)
        for n in threads:
            for impl in impls:
                if progress:
                    progress.show(f"{shape.name}, {threads_text(n)}: {impl}")
                isa = kernel_set_of(impl)
                call = functools.partial(scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                         is_causal=shape.causal, enable_gqa=shape.gqa, num_threads=n)

                row: Dict[str, Any] = {"shape": shape.name, "threads": n, "impl": impl, "dtype": dt.name}
                try:
                    if isa is None:
                        row["isa"] = _core.isa()
                        row.update(profile_call(call, n, repeat))
                    else:
                        with kernel_set(isa):
                            row["isa"] = _core.isa()
                            row.update(profile_call(call, n, repeat))
                except ValueError as exc:  # a kernel set this CPU cannot run
                    row.update(status=f"skipped: {exc}")
                if progress:
                    progress.advance()
                yield row


def format_profile_table(rows: List[Dict[str, Any]]) -> str:
    """The rows as a text table: ns per score per core of each phase."""
    head = ["shape", "impl", "isa", "threads"] + list(PHASES) + ["around", "products", "all", "wall"]
    lines = [head]
    for r in rows:
        cells = [r["shape"], r["impl"], r.get("isa", ""), str(r["threads"])]
        if r.get("status") != "ok":
            lines.append(cells + [r.get("status", "")])
            continue
        cells += [f"{r['phases'][ph]:.3f}" for ph in PHASES]
        cells += [f"{r['around']:.3f}", f"{r['products']:.3f}", f"{r['total']:.3f}", f"{r['wall']:.3f}"]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(c.rjust(widths[j]) if j >= 3 else c.ljust(widths[j]) for j, c in enumerate(line)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def profile_notes() -> List[str]:
    """What the columns of the profile table mean."""
    return [
        "ns per score per core: each phase's time summed over the threads, over the scores computed "
        "(tiles a mask hides, and keys past causality or a window, are not computed)",
        "phases: pack (query panels, K/V tiles or their once-per-call packing), qk (Q K^T), mask "
        "(scale, softcap, ALiBi, masks), softmax (online softmax; bfloat16: with P's pairs), pv (P V), "
        "epilogue (output rows, lse, weights)",
        "around: every phase but the products (qk, pv); all: their sum; wall: the calls' time x threads "
        "over the scores (the timers' own cost and the threads' waits included)",
    ]

