"""The throughput suite: every implementation on every shape and thread count."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import asdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from . import peers
from .errors import ERROR_ROWS, ReferenceSample, max_abs_error, reference_sample
from .machine import lookup
from .peers import (
    IMPLEMENTATIONS,
    NUMPY_MAX_SCORE_BYTES,
    absent_reason,
    agreement,
    check_dtype,
    peer_note,
    skip_reason,
    unsupported_reason,
)
from .shapes import (
    HALF_DTYPES,
    SHAPES,
    Shape,
    ShapeLike,
    attention_flops,
    bench_dtype,
    kept_pairs,
    kv_bytes,
    make_inputs,
    make_mask,
    parse_shape,
    unmasked,
)
from .threads import BlasThreads, default_threads, threads_text
from .timing import Progress, time_call

__all__ = ["iter_suite", "run_suite", "ratio", "suite_dtypes", "SETTLE_S"]

#: Seconds of rest before each implementation is timed, so that the previous one's
#: worker threads (OpenMP, ONNX Runtime's pool, OpenVINO's TBB arena) stop spinning.
SETTLE_S = 0.05


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
        if not peers.is_implementation(impl):
            raise ValueError(
                f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}, or sdpa@SET for a "
                f"kernel set SET ({', '.join(_core.ISAS)})"
            )
    dt, kv_dt = suite_dtypes(dtype, kv_dtype)
    if error_rows < 0:
        raise ValueError(f"error_rows must be >= 0, got {error_rows}")
    gemm_entries = (references or {}).get("gemm", {}).get("results", [])
    bw_entries = (references or {}).get("bandwidth", {}).get("results", [])
    timing = (min_time, repeat)

    torch = peers._load_torch() if "torch" in impl_list else None
    torch_threads0 = torch.get_num_threads() if torch is not None else None
    try:
        for shape in shape_list:
            q, k, v = make_inputs(shape, dt, seed, kv_dt)
            mask = make_mask(shape, dt, seed)
            sample = None
            if error_rows:
                if progress:
                    progress.show(f"{shape.name}: float64 reference")
                sample = reference_sample(shape, q, k, v, error_rows, seed, attn_mask=mask)
            run = _ShapeRun(shape, (q, k, v), mask, timing, numpy_max_bytes, sample, torch)
            for n in thread_list:
                row: Dict[str, Any] = {"shape": shape.name}
                row.update((field, value) for field, value in asdict(shape).items() if field != "name")
                row.update(
                    decode=shape.decode,
                    dtype=dt.name,
                    kv_dtype=kv_dt.name,
                    threads=n,
                    flops=run.flops,
                    kv_bytes=run.nbytes,
                    error_rows=None if sample is None else int(sample.rows.size),
                    impls={},
                )
                if mask is not None:
                    row["mask_kept"] = kept_pairs(shape, mask) / (shape.B * shape.Hq * shape.L * shape.S)
                    row["unmasked_flops"] = run.unmasked_flops
                for impl in impl_list:
                    if progress:
                        progress.show(f"{shape.name}, {threads_text(n)}: {impl}")
                    row["impls"][impl] = run.measure(impl, n)
                    if impl == "sdpa" and mask is not None and row["impls"]["sdpa"]["status"] == "ok":
                        if progress:
                            progress.show(f"{shape.name}, {threads_text(n)}: sdpa without the mask")
                        row["sdpa_unmasked"] = run.measure_unmasked(n)
                    if progress:
                        progress.advance()
                _add_ratios(row, lookup(gemm_entries, n, "gflops"), lookup(bw_entries, n, "gbps"))
                yield row
            del q, k, v, mask, sample, run
            gc.collect()
    finally:
        if torch is not None:
            torch.set_num_threads(torch_threads0)


class _ShapeRun:
    """One shape's inputs, and what is learnt about it across thread counts: sdpa's
    output, which every other implementation's is checked against once, and the
    verdicts of those checks."""

    def __init__(
        self,
        shape: Shape,
        qkv: Tuple[np.ndarray, np.ndarray, np.ndarray],
        mask: Optional[np.ndarray],
        timing: Tuple[float, int],
        numpy_max_bytes: int,
        sample: Optional[ReferenceSample],
        torch: Any,
    ) -> None:
        self.shape = shape
        self.q, self.k, self.v = qkv
        self.mask = mask
        self.min_time, self.repeat = timing
        self.numpy_max_bytes = numpy_max_bytes
        self.sample = sample
        self.torch = torch
        self.flops = attention_flops(shape, mask)
        self.unmasked_flops = attention_flops(shape)
        self.nbytes = kv_bytes(shape, self.k.dtype.itemsize)
        self.baseline: Any = None  # sdpa's output, for the agreement checks
        self.checks: Dict[str, Dict[str, Any]] = {}

    def _sdpa_output(self, threads: int) -> Any:
        """sdpa's output on this shape (computed now, untimed, unless sdpa ran already)."""
        if self.baseline is None:
            self.baseline = peers.prepare("sdpa", self.shape, self.q, self.k, self.v, threads, self.mask).call()
        return self.baseline

    def measure(self, impl: str, threads: int) -> Dict[str, Any]:
        """One implementation at one thread count: its times, rates, error and kernel, or why not."""
        shape, q, k, v = self.shape, self.q, self.k, self.v
        absent = absent_reason(impl)
        if absent is not None:
            return {"status": "absent", "reason": absent}
        reason = skip_reason(impl, shape, q.dtype.itemsize, self.numpy_max_bytes, (q.dtype, k.dtype))
        if reason is not None:
            return {"status": "skipped", "reason": reason}
        reason = unsupported_reason(impl, shape, self.mask)
        if reason is not None:
            return {"status": "unsupported", "reason": reason}
        verdict = self.checks.get(impl)
        if verdict is not None and not verdict["agrees"]:
            return _mismatch(verdict)
        time.sleep(SETTLE_S)
        try:
            if impl == "torch":
                self.torch.set_num_threads(threads)
            prepared = peers.prepare(impl, shape, q, k, v, threads, self.mask)
            # sdpa's own output, on the set of its own choice, before any other setting
            want = self._sdpa_output(threads) if impl != "sdpa" and verdict is None else None
            with BlasThreads(threads) if impl == "numpy" else contextlib.nullcontext(), prepared.setting():
                out = prepared.output(prepared.call())  # the warm-up, checked below
                if impl == "sdpa":
                    if self.baseline is None:
                        self.baseline = out
                elif verdict is None:
                    verdict = agreement(out, want, check_dtype(q.dtype, k.dtype, out.dtype))
                    verdict["threads"] = threads
                    self.checks[impl] = verdict
                    if not verdict["agrees"]:
                        return dict(_mismatch(verdict), kernel=prepared.kernel, kernel_how=prepared.kernel_how)
                times = time_call(prepared.call, self.min_time, self.repeat, warmup=False)
        except Exception as exc:  # noqa: BLE001 - a report, not a check (ONNX Runtime and OpenVINO raise their own types)
            return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        med = statistics.median(times)
        result: Dict[str, Any] = {
            "status": "ok",
            "median_s": med,
            "min_s": min(times),
            "runs": len(times),
            "gflops": self.flops / med / 1e9,
            "times_s": times,
            "kernel": prepared.kernel,
            "kernel_how": prepared.kernel_how,
        }
        if shape.decode:
            result["gbps"] = self.nbytes / med / 1e9
        if self.sample is not None:
            result["max_abs_err"] = max_abs_error(out, self.sample)
        if verdict is not None:
            result["agreement"] = verdict
        del out
        note = peer_note(impl, q.dtype, k.dtype, shape)
        if note is not None:
            result["note"] = note
        if impl == "numpy":
            result["blas_threads_controlled"] = BlasThreads.available()
        return result

    def measure_unmasked(self, threads: int) -> Dict[str, Any]:
        """sdpa on the same inputs without the mask: its own unmasked speed on this shape."""
        time.sleep(SETTLE_S)
        call = peers.prepare("sdpa", unmasked(self.shape), self.q, self.k, self.v, threads).call
        times = time_call(call, self.min_time, self.repeat)
        med = statistics.median(times)
        return {
            "median_s": med,
            "min_s": min(times),
            "runs": len(times),
            "gflops": self.unmasked_flops / med / 1e9,
            "times_s": times,
        }


def _mismatch(verdict: Dict[str, Any]) -> Dict[str, Any]:
    """The result of an implementation whose output disagreed with sdpa's: not timed."""
    if verdict.get("reason"):
        why = verdict["reason"]
    else:
        why = (
            f"output differs from sdpa's by up to {verdict['max_abs_diff']:.2g} "
            f"(np.allclose rtol={verdict['rtol']:.2g}, atol={verdict['atol']:.2g}, "
            f"checked at {threads_text(verdict.get('threads'))}); not timed"
        )
    return {"status": "mismatch", "reason": why, "agreement": verdict}


def _add_ratios(row: Dict[str, Any], gemm_gflops: Optional[float], bandwidth_gbps: Optional[float]) -> None:
    """The derived figures of a row: sdpa against every other implementation and the
    machine references, the errors of sdpa and torch, and sdpa's speed with the mask
    over its speed without it (masked shapes)."""

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
    row["sdpa_over"] = {
        impl: ratio(sdpa_gflops, figure(impl, "gflops")) for impl in row["impls"] if impl != "sdpa"
    }
    row["sdpa_err"] = figure("sdpa", "max_abs_err")
    row["torch_err"] = figure("torch", "max_abs_err")
    row["sdpa_err_over_torch"] = ratio(row["sdpa_err"], row["torch_err"])
    plain = row.get("sdpa_unmasked")
    masked = row["impls"].get("sdpa", {}).get("median_s") if plain else None
    # calls per second with the mask over calls per second without: the times' inverse ratio
    row["sdpa_mask_speed"] = ratio(plain["median_s"], masked) if plain else None


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
        A subset of :data:`~sdpa.bench.peers.IMPLEMENTATIONS`: ``("sdpa", "numpy",
        "torch", "ort", "ort-mha", "openvino")``, all by default; those whose package is
        not installed are reported ``absent``.  ONNX Runtime and OpenVINO run float32
        only.
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

    A masked shape (``mask`` one of :data:`~sdpa.bench.shapes.MASKS`) gives every
    implementation the same mask (:func:`~sdpa.bench.shapes.make_mask`), and sdpa is
    timed without it too, on the same inputs.  Every implementation's output is checked
    against sdpa's once per shape (:func:`~sdpa.bench.peers.agreement`); one that
    disagrees is reported ``mismatch`` and not timed.

    Each row holds the shape's fields, ``dtype``, ``kv_dtype``, ``threads``, ``flops``
    (the pairs the mask keeps, for a masked shape), ``kv_bytes``, ``error_rows`` and
    ``impls``: ``{impl: {"status": "ok", "median_s", "gflops", ["gbps" for decode,]
    "max_abs_err", "times_s", "kernel", "kernel_how", ["agreement",] ...}}`` or
    ``{"status": "absent" | "skipped" | "unsupported" | "mismatch" | "error",
    "reason"}``; then the derived ``sdpa_over_torch``, ``sdpa_over_numpy``, ``sdpa_over``
    (every other implementation), ``sdpa_pct_gemm``, ``sdpa_gbps``,
    ``sdpa_pct_bandwidth``, ``sdpa_err``, ``torch_err``, ``sdpa_err_over_torch`` and, for
    a masked shape, ``mask_kept``, ``unmasked_flops``, ``sdpa_unmasked`` and
    ``sdpa_mask_speed`` (None where they do not apply).
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
