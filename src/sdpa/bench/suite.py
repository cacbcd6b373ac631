"""The throughput suite: every implementation on every shape and thread count."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import peers
from .machine import lookup
from .peers import IMPLEMENTATIONS, NUMPY_MAX_SCORE_BYTES, make_runner, skip_reason
from .shapes import SHAPES, Shape, ShapeLike, attention_flops, kv_bytes, make_inputs, parse_shape
from .threads import BlasThreads, default_threads, threads_text
from .timing import Progress, time_call

__all__ = ["iter_suite", "run_suite", "ratio"]


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def iter_suite(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    impls: Sequence[str] = IMPLEMENTATIONS,
    dtype: Union[str, np.dtype] = "float32",
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    references: Optional[Dict[str, Any]] = None,
    numpy_max_bytes: int = NUMPY_MAX_SCORE_BYTES,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> Iterator[Dict[str, Any]]:
    """Like :func:`run_suite`, yielding each (shape, threads) row as soon as it is measured."""
    shape_list = [parse_shape(s) for s in (SHAPES if shapes is None else shapes)]
    thread_list = list(threads) if threads is not None else default_threads()
    impl_list = list(impls)
    for impl in impl_list:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    gemm_entries = (references or {}).get("gemm", {}).get("results", [])
    bw_entries = (references or {}).get("bandwidth", {}).get("results", [])

    torch = peers._load_torch() if "torch" in impl_list else None
    torch_threads0 = torch.get_num_threads() if torch is not None else None
    try:
        for shape in shape_list:
            q, k, v = make_inputs(shape, dt, seed)
            flops = attention_flops(shape)
            nbytes = kv_bytes(shape, dt.itemsize)
            for n in thread_list:
                row: Dict[str, Any] = {"shape": shape.name}
                row.update((field, value) for field, value in asdict(shape).items() if field != "name")
                row.update(
                    decode=shape.decode,
                    dtype=dt.name,
                    threads=n,
                    flops=flops,
                    kv_bytes=nbytes,
                    impls={},
                )
                for impl in impl_list:
                    if progress:
                        progress.show(f"{shape.name}, {threads_text(n)}: {impl}")
                    row["impls"][impl] = _measure(
                        impl, shape, q, k, v, n, flops, nbytes, min_time, repeat, numpy_max_bytes, dt, torch
                    )
                    if progress:
                        progress.advance()
                _add_ratios(row, lookup(gemm_entries, n, "gflops"), lookup(bw_entries, n, "gbps"))
                yield row
            del q, k, v
            gc.collect()
    finally:
        if torch is not None:
            torch.set_num_threads(torch_threads0)


def _measure(
    impl: str,
    shape: Shape,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    threads: int,
    flops: int,
    nbytes: int,
    min_time: float,
    repeat: int,
    numpy_max_bytes: int,
    dt: np.dtype,
    torch: Any,
) -> Dict[str, Any]:
    """One implementation on one shape and thread count: its times and rates, or why not."""
    reason = skip_reason(impl, shape, dt.itemsize, numpy_max_bytes)
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    # let the previous implementation's worker threads stop spinning before timing this one
    time.sleep(0.05)
    try:
        if impl == "torch":
            torch.set_num_threads(threads)
        fn = make_runner(impl, shape, q, k, v, threads)
        if impl == "numpy":
            with BlasThreads(threads):
                times = time_call(fn, min_time, repeat)
        else:
            times = time_call(fn, min_time, repeat)
    except (MemoryError, RuntimeError, ValueError, TypeError) as exc:
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    med = statistics.median(times)
    result: Dict[str, Any] = {
        "status": "ok",
        "median_s": med,
        "min_s": min(times),
        "runs": len(times),
        "gflops": flops / med / 1e9,
        "times_s": times,
    }
    if shape.decode:
        result["gbps"] = nbytes / med / 1e9
    if impl == "numpy":
        result["blas_threads_controlled"] = BlasThreads.available()
    return result


def _add_ratios(row: Dict[str, Any], gemm_gflops: Optional[float], bandwidth_gbps: Optional[float]) -> None:
    """The derived figures of a row: sdpa against torch, NumPy and the machine references."""

    def figure(impl: str, key: str) -> Optional[float]:
        r = row["impls"].get(impl)
        return r.get(key) if r and r.get("status") == "ok" else None

    sdpa_gflops = figure("sdpa", "gflops")
    row["gemm_gflops"] = gemm_gflops
    row["bandwidth_gbps"] = bandwidth_gbps
    row["sdpa_over_torch"] = ratio(sdpa_gflops, figure("torch", "gflops"))
    row["sdpa_over_numpy"] = ratio(sdpa_gflops, figure("numpy", "gflops"))
    pct = ratio(sdpa_gflops, gemm_gflops)
    row["sdpa_pct_gemm"] = None if pct is None else 100.0 * pct
    row["sdpa_gbps"] = figure("sdpa", "gbps")
    pct = ratio(row["sdpa_gbps"], bandwidth_gbps)
    row["sdpa_pct_bandwidth"] = None if pct is None else 100.0 * pct


def run_suite(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    impls: Sequence[str] = IMPLEMENTATIONS,
    dtype: Union[str, np.dtype] = "float32",
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    references: Optional[Dict[str, Any]] = None,
    numpy_max_bytes: int = NUMPY_MAX_SCORE_BYTES,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> List[Dict[str, Any]]:
    """Time every implementation on every shape and thread count; one dict per (shape, threads).

    Parameters
    ----------
    shapes
        Suite names (``"1k"``), :class:`Shape` objects, tuples
        ``(name, B, Hq, Hkv, L, S, E, causal[, Ev])`` or ``"name:B,Hq,Hkv,L,S,E[,causal]"``
        strings; defaults to :data:`SHAPES`.
    threads
        Thread counts; defaults to ``[1, os.cpu_count()]``.
    impls
        A subset of ``("sdpa", "numpy", "torch")``.
    references
        The result of :func:`measure_references`; when given, each row also carries the
        sdpa throughput as a percentage of the gemm and bandwidth figures.

    Each row holds the shape's fields, ``threads``, ``flops``, ``kv_bytes`` and ``impls``:
    ``{impl: {"status": "ok", "median_s", "gflops", ["gbps" for decode,] "times_s", ...}}``
    or ``{"status": "skipped" | "error", "reason"}``; then the derived ``sdpa_over_torch``,
    ``sdpa_over_numpy``, ``sdpa_pct_gemm``, ``sdpa_gbps`` and ``sdpa_pct_bandwidth``
    (None where they do not apply).
    """
    return list(
        iter_suite(
            shapes,
            threads,
            impls,
            dtype,
            min_time=min_time,
            repeat=repeat,
            references=references,
            numpy_max_bytes=numpy_max_bytes,
            seed=seed,
            progress=progress,
        )
    )
