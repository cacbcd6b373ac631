"""The throughput suite: every implementation on every shape and thread count."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import asdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import peers
from .errors import ERROR_ROWS, ReferenceSample, max_abs_error, reference_sample
from .machine import lookup
from .peers import IMPLEMENTATIONS, NUMPY_MAX_SCORE_BYTES, make_runner, peer_note, skip_reason
from .shapes import (
    HALF_DTYPES,
    SHAPES,
    Shape,
    ShapeLike,
    attention_flops,
    bench_dtype,
    kv_bytes,
    make_inputs,
    parse_shape,
)
from .threads import BlasThreads, default_threads, threads_text
from .timing import Progress, time_call

__all__ = ["iter_suite", "run_suite", "ratio", "suite_dtypes"]


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def suite_dtypes(
    dtype: Union[str, np.dtype] = "float32", kv_dtype: Union[str, np.dtype, None] = None
) -> Tuple[np.dtype, np.dtype]:
    """The query's and the key/value cache's dtypes of a run, checked.

    ``kv_dtype`` defaults to ``dtype``; it may differ only for a float32 query against a
    bfloat16 or float16 cache (sdpa reads such a cache in place and returns float32).
    ValueError otherwise, or for a dtype not in :data:`~sdpa.bench.shapes.DTYPES`.
    """
    dt = bench_dtype(dtype)
    kv_dt = dt if kv_dtype is None else bench_dtype(kv_dtype)
    if kv_dt != dt and not (dt.name == "float32" and kv_dt.name in HALF_DTYPES):
        raise ValueError(
            f"a {kv_dt.name} key/value cache goes with a {kv_dt.name} or float32 query, not {dt.name}"
        )
    return dt, kv_dt


def iter_suite(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    impls: Sequence[str] = IMPLEMENTATIONS,
    dtype: Union[str, np.dtype] = "float32",
    *,
    kv_dtype: Union[str, np.dtype, None] = None,
    min_time: float = 0.5,
    repeat: int = 5,
    references: Optional[Dict[str, Any]] = None,
    numpy_max_bytes: int = NUMPY_MAX_SCORE_BYTES,
    error_rows: int = ERROR_ROWS,
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
    dt, kv_dt = suite_dtypes(dtype, kv_dtype)
    if error_rows < 0:
        raise ValueError(f"error_rows must be >= 0, got {error_rows}")
    gemm_entries = (references or {}).get("gemm", {}).get("results", [])
    bw_entries = (references or {}).get("bandwidth", {}).get("results", [])

    torch = peers._load_torch() if "torch" in impl_list else None
    torch_threads0 = torch.get_num_threads() if torch is not None else None
    try:
        for shape in shape_list:
            q, k, v = make_inputs(shape, dt, seed, kv_dt)
            flops = attention_flops(shape)
            nbytes = kv_bytes(shape, kv_dt.itemsize)
            sample = None
            if error_rows:
                if progress:
                    progress.show(f"{shape.name}: float64 reference")
                sample = reference_sample(shape, q, k, v, error_rows, seed)
            for n in thread_list:
                row: Dict[str, Any] = {"shape": shape.name}
                row.update((field, value) for field, value in asdict(shape).items() if field != "name")
                row.update(
                    decode=shape.decode,
                    dtype=dt.name,
                    kv_dtype=kv_dt.name,
                    threads=n,
                    flops=flops,
                    kv_bytes=nbytes,
                    error_rows=None if sample is None else int(sample.rows.size),
                    impls={},
                )
                for impl in impl_list:
                    if progress:
                        progress.show(f"{shape.name}, {threads_text(n)}: {impl}")
                    row["impls"][impl] = _measure(
                        impl, shape, (q, k, v), n, flops, nbytes, min_time, repeat, numpy_max_bytes, sample, torch
                    )
                    if progress:
                        progress.advance()
                _add_ratios(row, lookup(gemm_entries, n, "gflops"), lookup(bw_entries, n, "gbps"))
                yield row
            del q, k, v, sample
            gc.collect()
    finally:
        if torch is not None:
            torch.set_num_threads(torch_threads0)


def _measure(
    impl: str,
    shape: Shape,
    qkv: Tuple[np.ndarray, np.ndarray, np.ndarray],
    threads: int,
    flops: int,
    nbytes: int,
    min_time: float,
    repeat: int,
    numpy_max_bytes: int,
    sample: Optional[ReferenceSample],
    torch: Any,
) -> Dict[str, Any]:
    """One implementation on one shape and thread count: its times, rates and error, or why not."""
    q, k, v = qkv
    reason = skip_reason(impl, shape, q.dtype.itemsize, numpy_max_bytes, (q.dtype, k.dtype))
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    # let the previous implementation's worker threads stop spinning before timing this one
    time.sleep(0.05)
    try:
        if impl == "torch":
            torch.set_num_threads(threads)
        fn = make_runner(impl, shape, q, k, v, threads)
        with BlasThreads(threads) if impl == "numpy" else contextlib.nullcontext():
            out = fn()  # the warm-up, whose output is checked against the reference
            times = time_call(fn, min_time, repeat, warmup=False)
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
    if sample is not None:
        result["max_abs_err"] = max_abs_error(out, sample)
    del out
    note = peer_note(impl, q.dtype, k.dtype)
    if note is not None:
        result["note"] = note
    if impl == "numpy":
        result["blas_threads_controlled"] = BlasThreads.available()
    return result


def _add_ratios(row: Dict[str, Any], gemm_gflops: Optional[float], bandwidth_gbps: Optional[float]) -> None:
    """The derived figures of a row: sdpa against torch, NumPy and the machine references,
    and the errors of sdpa and torch."""

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
    row["sdpa_err"] = figure("sdpa", "max_abs_err")
    row["torch_err"] = figure("torch", "max_abs_err")
    row["sdpa_err_over_torch"] = ratio(row["sdpa_err"], row["torch_err"])


def run_suite(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    impls: Sequence[str] = IMPLEMENTATIONS,
    dtype: Union[str, np.dtype] = "float32",
    *,
    kv_dtype: Union[str, np.dtype, None] = None,
    min_time: float = 0.5,
    repeat: int = 5,
    references: Optional[Dict[str, Any]] = None,
    numpy_max_bytes: int = NUMPY_MAX_SCORE_BYTES,
    error_rows: int = ERROR_ROWS,
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
    dtype, kv_dtype
        The query's dtype (``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``) and
        the key/value cache's (default: the same); they may differ only for a float32
        query against a bfloat16 or float16 cache (see :func:`suite_dtypes`).  torch then
        runs with the query cast to the cache's dtype; NumPy is skipped in 16 bits.
    references
        The result of :func:`measure_references`; when given, each row also carries the
        sdpa throughput as a percentage of the gemm and bandwidth figures.
    error_rows
        Query rows per problem compared with the float64 reference (first, last and
        random ones; every row when L is at most this); 0 measures no errors.

    Each row holds the shape's fields, ``dtype``, ``kv_dtype``, ``threads``, ``flops``,
    ``kv_bytes``, ``error_rows`` and ``impls``: ``{impl: {"status": "ok", "median_s",
    "gflops", ["gbps" for decode,] "max_abs_err", "times_s", ...}}`` or ``{"status":
    "skipped" | "error", "reason"}``; then the derived ``sdpa_over_torch``,
    ``sdpa_over_numpy``, ``sdpa_pct_gemm``, ``sdpa_gbps``, ``sdpa_pct_bandwidth``,
    ``sdpa_err``, ``torch_err`` and ``sdpa_err_over_torch`` (None where they do not apply).
    """
    return list(
        iter_suite(
            shapes,
            threads,
            impls,
            dtype,
            kv_dtype=kv_dtype,
            min_time=min_time,
            repeat=repeat,
            references=references,
            numpy_max_bytes=numpy_max_bytes,
            error_rows=error_rows,
            seed=seed,
            progress=progress,
        )
    )
