"""The latency mode: microseconds per call on small problems, where fixed costs weigh most.

sdpa on NumPy arrays, ``sdpa.torch`` on CPU tensors, torch's own function and ONNX
Runtime's Attention operator run in one process on the same inputs, each timed as
tight loops of back-to-back calls (:func:`~sdpa.bench.timing.loop_times`).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np

from .peers import LATENCY_IMPLEMENTATIONS, latency_absent_reason, latency_scope, make_latency_runner
from .shapes import LATENCY_SHAPES, Shape, ShapeLike, make_inputs, parse_shape
from .suite import ratio
from .threads import threads_text
from .timing import Progress, loop_times

__all__ = ["LATENCY_THREADS", "iter_latency", "run_latency"]

#: Thread count of the latency mode unless told otherwise.
LATENCY_THREADS = [2]


def iter_latency(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    impls: Sequence[str] = LATENCY_IMPLEMENTATIONS,
    dtype: Union[str, np.dtype] = "float32",
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> Iterator[Dict[str, Any]]:
    """Like :func:`run_latency`, yielding each (shape, threads) row as soon as it is measured."""
    shape_list = [parse_shape(s) for s in (LATENCY_SHAPES if shapes is None else shapes)]
    thread_list = list(threads) if threads is not None else list(LATENCY_THREADS)
    impl_list = list(impls)
    for impl in impl_list:
        if impl not in LATENCY_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown implementation {impl!r}; choose from {', '.join(LATENCY_IMPLEMENTATIONS)}"
            )
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    for shape in shape_list:
        q, k, v = make_inputs(shape, dt, seed)
        for n in thread_list:
            row: Dict[str, Any] = {"shape": shape.name}
            row.update((field, value) for field, value in asdict(shape).items() if field != "name")
            row.update(decode=shape.decode, dtype=dt.name, threads=n, impls={})
            for impl in impl_list:
                if progress:
                    progress.show(f"latency {shape.name}, {threads_text(n)}: {impl}")
                row["impls"][impl] = _measure(impl, shape, q, k, v, n, min_time, repeat)
                if progress:
                    progress.advance()
            _add_ratios(row)
            yield row
        del q, k, v
        gc.collect()


def _measure(
    impl: str,
    shape: Shape,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    threads: int,
    min_time: float,
    repeat: int,
) -> Dict[str, Any]:
    """One implementation on one shape and thread count: seconds per call, or why not."""
    reason = latency_absent_reason(impl)
    if reason is not None:
        return {"status": "absent", "reason": reason}
    # let the previous implementation's worker threads stop spinning before timing this one
    time.sleep(0.05)
    try:
        fn = make_latency_runner(impl, shape, q, k, v, threads)
        with latency_scope(impl, threads):
            times, number = loop_times(fn, min_time, repeat)
    except Exception as exc:  # noqa: BLE001 - a report, not a check (ONNX Runtime raises its own types)
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    return {
        "status": "ok",
        "median_s": statistics.median(times),
        "min_s": min(times),
        "loops": len(times),
        "calls_per_loop": number,
        "times_s": times,
    }


def _add_ratios(row: Dict[str, Any]) -> None:
    """Time ratios of a row (below 1: the first takes less time), None where one is missing."""

    def median(impl: str) -> Optional[float]:
        r = row["impls"].get(impl)
        return r["median_s"] if r and r["status"] == "ok" else None

    row["sdpa_over_torch"] = ratio(median("sdpa"), median("torch"))
    row["sdpa_torch_over_torch"] = ratio(median("sdpa.torch"), median("torch"))
    row["sdpa_over_ort"] = ratio(median("sdpa"), median("ort"))


def run_latency(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    impls: Sequence[str] = LATENCY_IMPLEMENTATIONS,
    dtype: Union[str, np.dtype] = "float32",
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> List[Dict[str, Any]]:
    """Seconds per call of each implementation on each shape and thread count.

    Parameters
    ----------
    shapes
        As for :func:`~sdpa.bench.run_suite`; defaults to :data:`LATENCY_SHAPES`.
    threads
        Thread counts; defaults to :data:`LATENCY_THREADS` (2).
    impls
        A subset of ``("sdpa", "sdpa.torch", "torch", "ort")``.
    min_time, repeat
        Each figure is the median of ``repeat`` timed loops, together about
        ``min_time`` seconds, after warm-up loops (see :func:`~sdpa.bench.timing.loop_times`).

    Each row holds the shape's fields, ``threads`` and ``impls``: ``{impl: {"status":
    "ok", "median_s", "min_s", "loops", "calls_per_loop", "times_s"}}`` or ``{"status":
    "absent" | "error", "reason"}``; then the time ratios ``sdpa_over_torch``,
    ``sdpa_torch_over_torch`` and ``sdpa_over_ort`` (None where one side is missing).
    """
    return list(
        iter_latency(
            shapes, threads, impls, dtype, min_time=min_time, repeat=repeat, seed=seed, progress=progress
        )
    )
