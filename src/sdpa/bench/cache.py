"""The cache mode: one decoding step over a :class:`~sdpa.KVCache` of each dtype.

A decode step reads the whole key/value cache once, so a cache stored in fewer bytes
makes it faster as long as reading, not arithmetic, bounds it.  ``--cache-dtypes``
fills a cache of each dtype asked for (float32, bfloat16, float16; the quantized
int8, float8_e4m3fn, float8_e5m2 and int4, with one float32 scale per position and
head, or ``NAME:G`` with one per G features; ``+iqk`` times the same cache with
``integer_qk=True``, ``+ipv`` with ``integer_pv=True``, int8 and int4 only) with the
same standard-normal keys and values, and times :meth:`~sdpa.KVCache.attend` of the same float32 query over each,
in alternating rounds (:func:`~sdpa.bench.timing.alternating_loop_times`).  The
rates count the bytes each cache holds for those keys and values, the scales
included; the errors are against float64 attention over the float32 keys and
values, so they include what storing them in the cache's dtype loses.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
from dataclasses import asdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..kvcache import KVCache
from .errors import ERROR_ROWS, max_abs_error, reference_sample
from .machine import lookup
from .shapes import CACHE_SHAPES, Shape, ShapeLike, bench_dtype, make_inputs, parse_shape
from .suite import ratio
from .threads import default_threads, threads_text
from .timing import Progress, alternating_loop_times

__all__ = ["CACHE_DTYPES", "parse_cache_dtypes", "split_spec", "cache_bytes", "iter_cache", "run_cache"]

#: The cache dtypes timed unless told otherwise; the first is the one the others are
#: compared with.
CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2", "int4:32",
                "int8+iqk", "int4:32+iqk")

_FLOAT_CACHES = ("float32", "bfloat16", "float16")
_QUANTIZED = ("int8", "float8_e4m3fn", "float8_e5m2", "int4")


def split_spec(spec: str) -> Tuple[str, Optional[int], bool, bool]:
    """``"int8:32"`` -> ``("int8", 32, False, False)``, ``"int4:32+iqk+ipv"`` ->
    ``("int4", 32, True, True)``, ``"float16"`` -> ``("float16", None, False,
    False)``: the name, the group, integer_qk and integer_pv; ValueError for
    anything else."""
    body, *flags = spec.split("+")
    iqk, ipv = "iqk" in flags, "ipv" in flags
    name, sep, group = body.partition(":")
    if (flags and (name not in ("int8", "int4") or len(set(flags)) != len(flags)
                   or any(f not in ("iqk", "ipv") for f in flags))):
        name = ""  # refused below
    if name in _FLOAT_CACHES and not sep and not flags:
        return name, None, False, False
    if name in _QUANTIZED:
        if not sep:
            return name, None, iqk, ipv
        try:
            size = int(group)
        except ValueError:
            size = 0
        if size >= 1:
            return name, size, iqk, ipv
    raise ValueError(
        f"cache dtype {spec!r}: expected one of {', '.join(_FLOAT_CACHES + _QUANTIZED)}, a quantized "
        "one as NAME:G (G >= 1 features per scale), and int8 or int4 with +iqk (integer_qk) and/or "
        "+ipv (integer_pv)"
    )


def parse_cache_dtypes(text: str) -> List[str]:
    """The cache dtypes of ``--cache-dtypes``: comma-separated names among
    :data:`CACHE_DTYPES`, ``NAME:G`` for a quantized cache with one scale per G
    features, and ``+iqk`` / ``+ipv`` after an int8 or int4 one for
    ``integer_qk=True`` / ``integer_pv=True``;
    duplicates dropped, order kept.  ValueError for anything else, or for none."""
    specs = [t.strip() for t in text.split(",") if t.strip()]
    if not specs:
        raise ValueError("--cache-dtypes: name at least one cache dtype")
    for spec in specs:
        split_spec(spec)
    return list(dict.fromkeys(specs))


def _absent_reason(spec: str) -> Optional[str]:
    """Why a cache of this dtype cannot be made here (a package missing), or None."""
    if spec == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
        return "a bfloat16 cache needs ml_dtypes (pip install ml_dtypes)"
    return None


def _make_cache(spec: str, shape: Shape, k: np.ndarray, v: np.ndarray) -> KVCache:
    """A cache of ``spec``'s dtype holding exactly k and v (capacity S)."""
    name, group, _, _ = split_spec(spec)
    dtype: Any = name if name in _QUANTIZED else bench_dtype(name)
    cache = KVCache(shape.B, shape.Hkv, shape.S, shape.E, shape.Ev, dtype=dtype, group_size=group)
    cache.append(k, v)
    return cache


def cache_bytes(cache: KVCache) -> int:
    """Bytes a step over ``cache`` reads: its keys and values as stored, and for a
    quantized cache their float32 scales."""
    scales = [s for s in (cache.key_scales, cache.value_scales) if s is not None]
    return int(cache.key_data.nbytes + cache.value_data.nbytes + sum(s.nbytes for s in scales))


def iter_cache(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    cache_dtypes: Sequence[str] = CACHE_DTYPES,
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    references: Optional[Dict[str, Any]] = None,
    error_rows: int = ERROR_ROWS,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> Iterator[Dict[str, Any]]:
    """Like :func:`run_cache`, yielding each (shape, threads) row as soon as it is measured."""
    shape_list = [parse_shape(s) for s in (CACHE_SHAPES if shapes is None else shapes)]
    thread_list = list(threads) if threads is not None else default_threads()
    specs = parse_cache_dtypes(",".join(cache_dtypes))
    if error_rows < 0:
        raise ValueError(f"error_rows must be >= 0, got {error_rows}")
    bw_entries = (references or {}).get("bandwidth", {}).get("results", [])
    f32 = np.dtype(np.float32)
    for shape in shape_list:
        q, k, v = make_inputs(shape, f32, seed)
        sample = None
        if error_rows:
            if progress:
                progress.show(f"cache {shape.name}: float64 reference")
            sample = reference_sample(shape, q, k, v, error_rows, seed)
        caches: Dict[str, KVCache] = {}
        missing: Dict[str, Dict[str, Any]] = {}
        for spec in specs:
            reason = _absent_reason(spec)
            if reason is not None:
                missing[spec] = {"status": "absent", "reason": reason}
                continue
            base = spec.partition("+")[0]  # a +iqk variant times the same cache
            shared = next((c for s, c in caches.items() if s.partition("+")[0] == base), None)
            if shared is not None:
                caches[spec] = shared
                continue
            if progress:
                progress.show(f"cache {shape.name}: filling the {base} cache")
            try:
                caches[spec] = _make_cache(spec, shape, k, v)
            except ValueError as exc:  # a group size that does not divide E or Ev
                missing[spec] = {"status": "unsupported", "reason": str(exc)}
        del k, v  # each cache holds its own copy
        for n in thread_list:
            if progress:
                progress.show(f"cache {shape.name}, {threads_text(n)}: {', '.join(caches) or 'nothing'}")
            yield _measure_row(shape, q, caches, missing, specs, n, min_time, repeat, sample, bw_entries)
            if progress:
                progress.advance()
        del q, caches, sample
        gc.collect()


def _measure_row(
    shape: Shape,
    q: np.ndarray,
    caches: Dict[str, KVCache],
    missing: Dict[str, Dict[str, Any]],
    specs: Sequence[str],
    threads: int,
    min_time: float,
    repeat: int,
    sample: Any,
    bw_entries: List[Dict[str, Any]],
) -> Dict[str, Any]:
    """One (shape, threads) row: every cache's step timed in alternating rounds."""
    row: Dict[str, Any] = {"shape": shape.name}
    row.update((field, value) for field, value in asdict(shape).items() if field != "name")
    row.update(decode=shape.decode, dtype="float32", threads=threads, error_rows=None, caches={})
    if sample is not None:
        row["error_rows"] = int(sample.rows.size)
    calls = {}
    results: Dict[str, Dict[str, Any]] = {}
    for spec, cache in caches.items():
        out = np.empty((shape.B, shape.Hq, shape.L, shape.E if shape.Ev is None else shape.Ev), dtype=np.float32)

        _, _, iqk, ipv = split_spec(spec)

        def call(cache: KVCache = cache, out: np.ndarray = out, iqk: bool = iqk, ipv: bool = ipv) -> None:
            cache.attend(q, is_causal=shape.causal, out=out, num_threads=threads, integer_qk=iqk,
                         integer_pv=ipv)

        call()  # its output is checked here; the timing warms up on its own
        result: Dict[str, Any] = {"status": "ok", "bytes": cache_bytes(cache)}
        if sample is not None:
            result["max_abs_err"] = max_abs_error(out, sample)
        results[spec] = result
        calls[spec] = call
    times, numbers = alternating_loop_times(calls, min_time, repeat)
    for spec, result in results.items():
        med = statistics.median(times[spec])
        result.update(
            median_s=med,
            min_s=min(times[spec]),
            rounds=len(times[spec]),
            calls_per_round=numbers[spec],
            times_s=times[spec],
        )
        if shape.decode:
            result["gbps"] = result["bytes"] / med / 1e9
    base = results.get(specs[0], {}).get("median_s")
    bandwidth = lookup(bw_entries, threads, "gbps")
    row["baseline"] = specs[0]
    row["bandwidth_gbps"] = bandwidth
    for spec in specs:
        if spec in missing:
            row["caches"][spec] = dict(missing[spec])
            continue
        result = results[spec]
        result["speedup"] = ratio(base, result["median_s"])  # the first cache's time over this one's
        pct = ratio(result.get("gbps"), bandwidth)
        result["pct_bandwidth"] = None if pct is None else 100.0 * pct
        row["caches"][spec] = result
    return row


def run_cache(
    shapes: Optional[Iterable[ShapeLike]] = None,
    threads: Optional[Sequence[int]] = None,
    cache_dtypes: Sequence[str] = CACHE_DTYPES,
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    references: Optional[Dict[str, Any]] = None,
    error_rows: int = ERROR_ROWS,
    seed: int = 0,
    progress: Optional[Progress] = None,
) -> List[Dict[str, Any]]:
    """Time a step of a float32 query over a :class:`~sdpa.KVCache` of each dtype.

    Parameters
    ----------
    shapes
        As for :func:`~sdpa.bench.run_suite`; defaults to
        :data:`~sdpa.bench.shapes.CACHE_SHAPES` (``decode-gqa-32k`` and
        ``decode-gqa-4k``).  The cache holds S positions; the query is (B, Hq, L, E),
        causal (top-left) when the shape is.
    threads
        Thread counts; defaults to ``[1, os.cpu_count()]``.
    cache_dtypes
        Among ``"float32"``, ``"bfloat16"`` (needs ml_dtypes: reported ``absent``
        without it), ``"float16"``, the quantized ``"int8"``, ``"float8_e4m3fn"``,
        ``"float8_e5m2"`` and ``"int4"`` (one scale per position and head; ``NAME:G``
        one per G features), and ``"int8+iqk"`` / ``"int4:G+iqk"`` (the same caches
        with ``integer_qk=True``; ``+ipv``: ``integer_pv=True``, ``+iqk+ipv``: both);
        the first is the baseline of ``speedup``.
    min_time, repeat
        ``repeat`` rounds, each timing a loop of back-to-back calls over every cache
        in turn (the order rotated from round to round); each cache's loops last
        about ``min_time`` seconds together.
    references
        The result of :func:`~sdpa.bench.measure_references`; its read bandwidth gives
        ``pct_bandwidth``.
    error_rows
        Query rows compared with float64 attention over the float32 keys and values
        (0: none).

    Each row holds the shape's fields, ``decode``, ``dtype`` (the query's,
    float32), ``threads``, ``error_rows``, ``baseline`` (the first cache dtype),
    ``bandwidth_gbps`` and ``caches``: ``{dtype: {"status": "ok", "bytes",
    "median_s", "min_s", "rounds", "calls_per_round", "times_s", "gbps" (decode
    shapes), "max_abs_err", "speedup" (the baseline's time over this one's),
    "pct_bandwidth"}}`` or ``{"status": "absent" | "unsupported", "reason"}``.
    """
    return list(
        iter_cache(
            shapes,
            threads,
            cache_dtypes,
            min_time=min_time,
            repeat=repeat,
            references=references,
            error_rows=error_rows,
            seed=seed,
            progress=progress,
        )
    )
