"""The roofline report: each decode step over each cache dtype against the machine's
own limits, measured in the same run.

A decoding step reads the whole cache once and multiplies each cached value with a few
query rows.  Its time is bounded below by

    max(bytes / read bandwidth, float operations / FMA peak + integer operations / dot peak)

where the bytes are those the cache stores (scales included), the float operations
2 x rows x (E + Ev) a key (the multiply-adds of Q K^T and P V, rows = query rows a
key/value head), and the integer operations the same products where ``integer_qk`` or
``integer_pv`` moves them to int8 dot products.  The three limits are measured by the
library's own C probes (``sdpa._core.probe_read`` and ``probe_peak``) at each thread
count: a streaming sum over ``bandwidth_mib`` MiB, twelve chains of float32 FMAs and of
int8 dot products (VPDPBUSD, SDOT) on the kernel set in use.  ``of roofline`` is that
bound over the measured time: 100% is a step at the machine's limit.  Widening,
rounding, the softmax and the bookkeeping are not counted as operations: where a step
sits far below 100% with ``bound`` "bytes", they are what it pays for.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np

from .. import _core
from .cache import iter_cache, split_spec
from .shapes import CACHE_SHAPES, MiB, Shape, ShapeLike, parse_shape
from .threads import default_threads, threads_text
from .timing import Progress

__all__ = ["ROOFLINE_DTYPES", "measure_limits", "step_operations", "iter_roofline", "format_roofline_table"]

#: The cache dtypes of the report unless told otherwise (the first is the baseline).
ROOFLINE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2", "int4:32",
                   "int8+iqk", "int8+ipv", "int8+iqk+ipv", "int4:32+iqk+ipv")


def measure_limits(threads: Sequence[int], *, bandwidth_mib: int = 512, repeat: int = 5,
                   peak_seconds: float = 0.2, progress: Optional[Progress] = None) -> Dict[int, Dict[str, Any]]:
    """The machine's read bandwidth (GB/s, the median of ``repeat`` streaming sums over
    ``bandwidth_mib`` MiB), float32 FMA peak and int8 dot-product peak (G operations a
    second, the best of ``repeat`` runs of ``peak_seconds``), for each thread count."""
    data = np.ones(max(bandwidth_mib, 1) * MiB // 8, dtype=np.uint64)  # ones(): every page touched
    limits: Dict[int, Dict[str, Any]] = {}
    for n in threads:
        if progress:
            progress.show(f"roofline: the machine's limits, {threads_text(n)}")
        _core.probe_read(data, n)  # warm
        reads = [data.nbytes / _core.probe_read(data, n) / 1e9 for _ in range(repeat)]
        fma = [_core.probe_peak(0, n, peak_seconds) for _ in range(repeat)]
        dots = [_core.probe_peak(1, n, peak_seconds) for _ in range(repeat)]
        limits[n] = {
            "read_gbps": statistics.median(reads),
            "read_gbps_all": reads,
            "fma_gops": max(f[0] for f in fma) / 1e9,
            "fma_probe": fma[0][1],
            "dot_gops": max(d[0] for d in dots) / 1e9,
            "dot_probe": dots[0][1],
        }
        if progress:
            progress.advance()
    return limits


def step_operations(shape: Shape, spec: str) -> Dict[str, float]:
    """The float and integer operations of one step of ``shape`` over a cache of
    ``spec`` (2 a multiply-add; only the rows' products with the keys and values)."""
    _, _, iqk, ipv = split_spec(spec)
    ev = shape.E if shape.Ev is None else shape.Ev
    keys = shape.B * shape.Hkv * shape.S
    rows = shape.Hq // shape.Hkv * shape.L
    qk, pv = 2.0 * keys * rows * shape.E, 2.0 * keys * rows * ev
    return {"float_ops": (0 if iqk else qk) + (0 if ipv else pv), "int_ops": (qk if iqk else 0) + (pv if ipv else 0)}


def iter_roofline(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    cache_dtypes: Sequence[str] = ROOFLINE_DTYPES,
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    bandwidth_mib: int = 512,
    error_rows: int = 0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    limits: Optional[Dict[int, Dict[str, Any]]] = None,
) -> Iterator[Dict[str, Any]]:
    """The cache mode's rows (:func:`~sdpa.bench.iter_cache`), each cache's result with
    ``float_ops``, ``int_ops``, ``bytes_s`` (bytes / bandwidth), ``ops_s`` (operations /
    peaks), ``roofline_s`` (their max), ``bound`` ("bytes" or "ops") and
    ``of_roofline`` (roofline_s / median_s), and the row with ``limits`` (those of
    :func:`measure_limits` at its thread count, measured first unless given)."""
    shape_list = [parse_shape(s) for s in (CACHE_SHAPES if shapes is None else shapes)]
    thread_list = list(threads) if threads is not None else default_threads()
    if limits is None:
        limits = measure_limits(thread_list, bandwidth_mib=bandwidth_mib, repeat=repeat, progress=progress)
    for row in iter_cache(shape_list, thread_list, cache_dtypes, min_time=min_time, repeat=repeat,
                          error_rows=error_rows, seed=seed, progress=progress):
        shape = next(s for s in shape_list if s.name == row["shape"])
        lim = limits[row["threads"]]
        row["limits"] = lim
        row["bandwidth_gbps"] = lim["read_gbps"]
        for spec, r in row["caches"].items():
            if r.get("status") != "ok":
                continue
            ops = step_operations(shape, spec)
            bytes_s = r["bytes"] / (lim["read_gbps"] * 1e9)
            ops_s = ops["float_ops"] / (lim["fma_gops"] * 1e9) + ops["int_ops"] / (lim["dot_gops"] * 1e9)
            r.update(ops, bytes_s=bytes_s, ops_s=ops_s, roofline_s=max(bytes_s, ops_s),
                     bound="bytes" if bytes_s >= ops_s else "ops")
            r["of_roofline"] = r["roofline_s"] / r["median_s"]
            r["pct_bandwidth"] = 100.0 * r["bytes"] / r["median_s"] / 1e9 / lim["read_gbps"]
        yield row


def format_roofline_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The roofline rows as a plain-text table, one line per (shape, threads, cache)."""
    from .report import _render  # the report's table layout

    header = ["shape", "thr", "cache", "MiB", "GFLOP", "GIOP", "ms", "GB/s", "% bw", "roofline ms", "bound",
              "of roofline", f"vs {rows[0]['baseline'] if rows else 'float32'}"]
    lines: List[List[str]] = []
    for row in rows:
        for spec, r in row["caches"].items():
            if r.get("status") != "ok":
                lines.append([row["shape"], str(row["threads"]), spec, "", "", "", r.get("status", "")] + [""] * 6)
                continue
            lines.append([
                row["shape"], str(row["threads"]), spec, f"{r['bytes'] / MiB:.1f}", f"{r['float_ops'] / 1e9:.3f}",
                f"{r['int_ops'] / 1e9:.3f}", f"{r['median_s'] * 1e3:.2f}", f"{r['gbps']:.1f}",
                f"{r['pct_bandwidth']:.0f}%", f"{r['roofline_s'] * 1e3:.2f}", r["bound"],
                f"{100 * r['of_roofline']:.0f}%", f"{r['speedup']:.2f}x" if r.get("speedup") else "",
            ])
    return _render(header, lines)


def limits_text(limits: Dict[int, Dict[str, Any]]) -> List[str]:
    """One line per thread count: the three limits and the probes that measured them."""
    return [
        f"{threads_text(n)}: read {lim['read_gbps']:.1f} GB/s (C streaming sum), float32 FMA "
        f"{lim['fma_gops']:.0f} GFLOP/s ({lim['fma_probe']}), int8 dot products {lim['dot_gops']:.0f} "
        f"GOP/s ({lim['dot_probe']})"
        for n, lim in limits.items()
    ]
