"""Side-by-side attention benchmark: sdpa against NumPy and PyTorch on this machine.

    python -m sdpa.bench                      # the whole suite, 1 and all threads
    python -m sdpa.bench --quick              # a few small shapes (CI smoke run)
    python -m sdpa.bench --shapes 1k,gqa-2k --threads 1,2 --json out.json --plot out.png

Every implementation runs in the same process on the same inputs, and the results
are reported as throughput next to ratios measured in the same run: sdpa against
PyTorch, and against the machine's own matmul throughput (a NumPy gemm) and read
bandwidth (a NumPy reduction over a large array).  See benchmarks/README.md for
what each column means.

Only the standard library and NumPy are needed; PyTorch, threadpoolctl and
matplotlib are used when they are installed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import __version__ as _sdpa_version
from . import config as _sdpa_config
from . import scaled_dot_product_attention as _sdpa

__all__ = [
    "Shape",
    "SHAPES",
    "QUICK_SHAPES",
    "IMPLEMENTATIONS",
    "attention_flops",
    "causal_pairs",
    "kv_bytes",
    "numpy_attention",
    "machine_info",
    "measure_references",
    "run_suite",
    "format_table",
    "plot_results",
    "main",
]

GiB = 1024**3
MiB = 1024**2

IMPLEMENTATIONS = ("sdpa", "numpy", "torch")

#: NumPy's version builds the whole score matrix; above this many bytes it is skipped.
NUMPY_MAX_SCORE_BYTES = 2 * GiB


@dataclass(frozen=True)
class Shape:
    """One attention problem: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev)."""

    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    causal: bool = False
    Ev: Optional[int] = None  # defaults to E

    def __post_init__(self) -> None:
        if self.Ev is None:
            object.__setattr__(self, "Ev", self.E)
        for field in ("B", "Hq", "Hkv", "L", "S", "E", "Ev"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"shape {self.name!r}: {field} must be >= 1")
        if self.Hq % self.Hkv:
            raise ValueError(f"shape {self.name!r}: Hq ({self.Hq}) must be a multiple of Hkv ({self.Hkv})")

    @property
    def decode(self) -> bool:
        """A single query row per head: bound by streaming K and V, not by arithmetic."""
        return self.L == 1

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hkv

    def describe(self) -> str:
        heads = f"{self.Hq}" if not self.gqa else f"{self.Hq}/{self.Hkv}"
        ev = f" Ev={self.Ev}" if self.Ev != self.E else ""
        return f"B={self.B} H={heads} L={self.L} S={self.S} E={self.E}{ev}" + (
            " causal" if self.causal else ""
        )


SHAPES: List[Shape] = [
    Shape("bert-base", 8, 12, 12, 128, 128, 64, False),
    Shape("1k", 1, 16, 16, 1024, 1024, 64, False),
    Shape("2k-causal-e128", 1, 32, 32, 2048, 2048, 128, True),
    Shape("4k-causal", 1, 16, 16, 4096, 4096, 64, True),
    Shape("gqa-2k", 1, 32, 8, 2048, 2048, 128, True),
    Shape("long-16k", 1, 8, 8, 16384, 16384, 64, True),
    Shape("e80", 1, 16, 16, 2048, 2048, 80, True),
    Shape("e96", 1, 16, 16, 2048, 2048, 96, True),
    Shape("decode-mha", 8, 32, 32, 1, 2048, 128, False),
    Shape("decode-gqa-32k", 1, 32, 8, 1, 32768, 128, False),
]

#: Small shapes for smoke runs (``--quick``): seconds, not minutes.
QUICK_SHAPES: List[Shape] = [
    SHAPES[0],
    SHAPES[1],
    Shape("e80-512", 1, 16, 16, 512, 512, 80, True),
    Shape("decode-gqa-4k", 1, 32, 8, 1, 4096, 128, False),
]

_SHAPES_BY_NAME: Dict[str, Shape] = {s.name: s for s in SHAPES + QUICK_SHAPES}

ShapeLike = Union[Shape, str, Sequence[Any]]


def parse_shape(spec: ShapeLike) -> Shape:
    """A :class:`Shape` from a suite name, a tuple, or ``"name:B,Hq,Hkv,L,S,E[,causal]"``.

    Tuples are ``(name, B, Hq, Hkv, L, S, E, causal[, Ev])``.
    """
    if isinstance(spec, Shape):
        return spec
    if isinstance(spec, str):
        spec = spec.strip()
        if spec in _SHAPES_BY_NAME:
            return _SHAPES_BY_NAME[spec]
        if ":" not in spec:
            known = ", ".join(_SHAPES_BY_NAME)
            raise ValueError(
                f"unknown shape {spec!r}; known shapes: {known} (or NAME:B,Hq,Hkv,L,S,E[,causal])"
            )
        name, _, dims = spec.partition(":")
        parts = [p.strip() for p in dims.split(",") if p.strip()]
        causal = False
        if len(parts) == 7:
            flag = parts.pop().lower()
            if flag not in ("causal", "c", "true", "1", "false", "0", "full"):
                raise ValueError(f"shape {spec!r}: the 7th field must be 'causal' or 'full'")
            causal = flag in ("causal", "c", "true", "1")
        if len(parts) != 6:
            raise ValueError(f"shape {spec!r}: expected NAME:B,Hq,Hkv,L,S,E[,causal]")
        try:
            B, Hq, Hkv, L, S, E = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"shape {spec!r}: dims must be integers") from None
        return Shape(name or "custom", B, Hq, Hkv, L, S, E, causal)
    fields = list(spec)
    if len(fields) not in (8, 9):
        raise ValueError(f"shape tuple must be (name, B, Hq, Hkv, L, S, E, causal[, Ev]); got {spec!r}")
    name, B, Hq, Hkv, L, S, E, causal = fields[:8]
    Ev = int(fields[8]) if len(fields) == 9 and fields[8] is not None else None
    return Shape(str(name), int(B), int(Hq), int(Hkv), int(L), int(S), int(E), bool(causal), Ev)


# --------------------------------------------------------------------------- work counts


def causal_pairs(L: int, S: int) -> int:
    """Number of (l, s) pairs with ``s <= l`` in an L x S grid (top-left causal mask)."""
    m = min(L, S)
    return m * (m + 1) // 2 + (L - m) * S


def attention_flops(shape: Shape) -> int:
    """Multiply-adds of Q Kᵀ and P V, counted as 2 flops, over the unmasked pairs only."""
    pairs = causal_pairs(shape.L, shape.S) if shape.causal else shape.L * shape.S
    return 2 * shape.B * shape.Hq * pairs * (shape.E + shape.Ev)


def kv_bytes(shape: Shape, itemsize: int) -> int:
    """Bytes of K and V, each read once: what a decode step has to stream from memory."""
    return shape.B * shape.Hkv * shape.S * (shape.E + shape.Ev) * itemsize


def score_bytes(shape: Shape, itemsize: int) -> int:
    return shape.B * shape.Hq * shape.L * shape.S * itemsize


# --------------------------------------------------------------------------- implementations


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False) -> np.ndarray:
    """Textbook attention in the inputs' dtype: full score matrix, softmax, then P V.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev); Hq a multiple of Hkv (GQA).
    """
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    # query heads of one group side by side, so K and V broadcast instead of being copied
    qg = q.reshape(B, Hkv, group, L, E)
    kg = k[:, :, None]
    vg = v[:, :, None]
    scores = qg @ np.swapaxes(kg, -1, -2)  # (B, Hkv, group, L, S)
    scores *= 1.0 / math.sqrt(E)
    if causal:
        np.copyto(scores, -np.inf, where=~np.tri(L, S, dtype=bool))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ vg  # (B, Hkv, group, L, Ev)
    return out.reshape(B, Hq, L, v.shape[-1])


_torch_module: Any = None
_torch_error: Optional[str] = None


def _load_torch() -> Any:
    """``torch`` when it can be imported, else None (the reason is kept for the report)."""
    global _torch_module, _torch_error
    if _torch_module is None and _torch_error is None:
        try:
            import torch  # noqa: PLC0415 - optional, heavy

            _torch_module = torch
        except ImportError as exc:
            missing = getattr(exc, "name", None) == "torch"
            _torch_error = "torch is not installed" if missing else f"torch cannot be imported ({exc})"
    return _torch_module


def _make_runner(
    impl: str, shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int
) -> Callable[[], Any]:
    """A zero-argument callable that computes the attention once with ``impl``."""
    if impl == "sdpa":
        gqa = shape.gqa
        causal = shape.causal

        def run_sdpa() -> Any:
            return _sdpa(q, k, v, is_causal=causal, enable_gqa=gqa, num_threads=threads)

        return run_sdpa

    if impl == "numpy":

        def run_numpy() -> Any:
            return numpy_attention(q, k, v, shape.causal)

        return run_numpy

    if impl == "torch":
        torch = _load_torch()
        F = torch.nn.functional
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        kwargs: Dict[str, Any] = {"is_causal": shape.causal}
        if shape.gqa:
            try:
                with torch.inference_mode():
                    F.scaled_dot_product_attention(tq[:, :, :1], tk[:, :, :1], tv[:, :, :1], enable_gqa=True)
                kwargs["enable_gqa"] = True
            except TypeError:  # older torch: expand K and V to every query head up front
                group = shape.Hq // shape.Hkv
                tk = tk.repeat_interleave(group, dim=1)
                tv = tv.repeat_interleave(group, dim=1)

        def run_torch() -> Any:
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, **kwargs)

        return run_torch

    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")


def _skip_reason(impl: str, shape: Shape, itemsize: int, numpy_max_bytes: int) -> Optional[str]:
    if impl == "numpy":
        need = score_bytes(shape, itemsize)
        if need > numpy_max_bytes:
            return f"score matrix needs {need / GiB:.1f} GiB (limit {numpy_max_bytes / GiB:.1f} GiB)"
    if impl == "torch" and _load_torch() is None:
        return _torch_error
    return None


# --------------------------------------------------------------------------- timing


def time_call(
    fn: Callable[[], Any], min_time: float = 0.5, repeat: int = 5, max_runs: int = 100_000
) -> List[float]:
    """Seconds per call: one untimed warm-up, then at least ``repeat`` calls and ``min_time`` s."""
    fn()
    times: List[float] = []
    total = 0.0
    while (len(times) < repeat or total < min_time) and len(times) < max_runs:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
    return times


class _BlasThreads:
    """Context manager limiting the BLAS pool to ``n`` threads, when threadpoolctl is there."""

    def __init__(self, n: Optional[int]) -> None:
        self.n = n
        self._limits: Any = None

    @staticmethod
    def available() -> bool:
        try:
            import threadpoolctl  # noqa: F401, PLC0415
        except ImportError:
            return False
        return True

    def __enter__(self) -> "_BlasThreads":
        if self.n is not None and self.available():
            from threadpoolctl import threadpool_limits  # noqa: PLC0415

            self._limits = threadpool_limits(limits=self.n, user_api="blas")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._limits is not None:
            self._limits.restore_original_limits()
            self._limits = None


class Progress:
    """A one-line progress bar on stderr, redrawn in place with carriage returns."""

    def __init__(self, total: int, enabled: bool = True, stream: Any = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self._last_len = 0

    def show(self, label: str) -> None:
        """Draw the bar with ``label`` naming the step that is about to run."""
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s  {label}"
        pad = max(self._last_len - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)

    def advance(self) -> None:
        self.done = min(self.done + 1, self.total)

    def close(self) -> None:
        if self.enabled and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self.stream.flush()
            self._last_len = 0


# --------------------------------------------------------------------------- machine references


def measure_references(
    threads: Sequence[int],
    dtype: Union[str, np.dtype] = "float32",
    *,
    gemm_n: int = 2048,
    bandwidth_mib: int = 512,
    min_time: float = 0.5,
    repeat: int = 5,
    progress: Optional[Progress] = None,
) -> Dict[str, Any]:
    """The machine's own ceilings, per thread count: gemm GFLOP/s and read bandwidth GB/s.

    The gemm is NumPy's ``n x n @ n x n`` matmul; its BLAS pool is limited to each thread
    count with threadpoolctl when that is installed, otherwise it is measured once with
    the default pool.  Bandwidth is ``np.add.reduce`` over a large array, split into one
    contiguous chunk per thread and summed on that many Python threads (NumPy releases
    the GIL inside the reduction).
    """
    dt = np.dtype(dtype)
    rng = np.random.default_rng(1)
    threads = list(threads)
    controlled = _BlasThreads.available()

    gemm: Dict[str, Any] = {
        "n": gemm_n,
        "dtype": dt.name,
        "threads_controlled": controlled,
        "results": [],
    }
    if gemm_n > 0:
        a = rng.standard_normal((gemm_n, gemm_n)).astype(dt)
        b = rng.standard_normal((gemm_n, gemm_n)).astype(dt)
        c = np.empty((gemm_n, gemm_n), dtype=dt)
        flops = 2 * gemm_n**3
        for n in threads if controlled else [None]:
            if progress:
                progress.show(f"reference: {dt.name} gemm {gemm_n}, {_threads_text(n)}")
            with _BlasThreads(n):
                times = time_call(lambda: np.matmul(a, b, out=c), min_time, repeat)
            med = statistics.median(times)
            gemm["results"].append(
                {"threads": n, "median_s": med, "gflops": flops / med / 1e9, "times_s": times}
            )
            if progress:
                progress.advance()
        del a, b, c

    bandwidth: Dict[str, Any] = {"bytes": 0, "dtype": "float32", "results": []}
    if bandwidth_mib > 0:
        data = np.ones(bandwidth_mib * MiB // 4, dtype=np.float32)  # ones(): every page touched
        bandwidth["bytes"] = int(data.nbytes)
        for n in threads:
            if progress:
                progress.show(f"reference: read bandwidth {bandwidth_mib} MiB, {_threads_text(n)}")
            chunks = np.array_split(data, n)
            if n == 1:
                times = time_call(lambda: np.add.reduce(data), min_time, repeat)
            else:
                with ThreadPoolExecutor(max_workers=n) as pool:
                    times = time_call(
                        lambda chunks=chunks: list(pool.map(np.add.reduce, chunks)), min_time, repeat
                    )
            med = statistics.median(times)
            bandwidth["results"].append(
                {"threads": n, "median_s": med, "gbps": data.nbytes / med / 1e9, "times_s": times}
            )
            if progress:
                progress.advance()
        del data
    return {"gemm": gemm, "bandwidth": bandwidth}


def _threads_text(n: Optional[int]) -> str:
    if n is None:
        return "default threads"
    return f"{n} thread" + ("s" if n != 1 else "")


def _reference_steps(threads: Sequence[int], gemm_n: int, bandwidth_mib: int) -> int:
    steps = 0
    if gemm_n > 0:
        steps += len(threads) if _BlasThreads.available() else 1
    if bandwidth_mib > 0:
        steps += len(threads)
    return steps


def _lookup(entries: List[Dict[str, Any]], threads: int, key: str) -> Optional[float]:
    """The figure measured with ``threads`` threads, or the one uncontrolled measurement."""
    for e in entries:
        if e["threads"] == threads:
            return e[key]
    for e in entries:
        if e["threads"] is None:
            return e[key]
    return None


# --------------------------------------------------------------------------- the suite


def _make_inputs(shape: Shape, dtype: np.dtype, seed: int):
    """Standard-normal q, k, v of ``shape`` in ``dtype``, the same for every implementation."""
    rng = np.random.default_rng(seed)
    dims = (
        (shape.B, shape.Hq, shape.L, shape.E),
        (shape.B, shape.Hkv, shape.S, shape.E),
        (shape.B, shape.Hkv, shape.S, shape.Ev),
    )
    return tuple(rng.standard_normal(d, dtype=np.float32).astype(dtype, copy=False) for d in dims)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
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

    torch = _load_torch() if "torch" in impl_list else None
    torch_threads0 = torch.get_num_threads() if torch is not None else None
    try:
        for shape in shape_list:
            q, k, v = _make_inputs(shape, dt, seed)
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
                        progress.show(f"{shape.name}, {_threads_text(n)}: {impl}")
                    row["impls"][impl] = _measure(
                        impl, shape, q, k, v, n, flops, nbytes, min_time, repeat, numpy_max_bytes, dt, torch
                    )
                    if progress:
                        progress.advance()
                _add_ratios(row, _lookup(gemm_entries, n, "gflops"), _lookup(bw_entries, n, "gbps"))
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
    reason = _skip_reason(impl, shape, dt.itemsize, numpy_max_bytes)
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    # let the previous implementation's worker threads stop spinning before timing this one
    time.sleep(0.05)
    try:
        if impl == "torch":
            torch.set_num_threads(threads)
        fn = _make_runner(impl, shape, q, k, v, threads)
        if impl == "numpy":
            with _BlasThreads(threads):
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
        result["blas_threads_controlled"] = _BlasThreads.available()
    return result


def _add_ratios(row: Dict[str, Any], gemm_gflops: Optional[float], bandwidth_gbps: Optional[float]) -> None:
    def figure(impl: str, key: str) -> Optional[float]:
        r = row["impls"].get(impl)
        return r.get(key) if r and r.get("status") == "ok" else None

    sdpa_gflops = figure("sdpa", "gflops")
    row["gemm_gflops"] = gemm_gflops
    row["bandwidth_gbps"] = bandwidth_gbps
    row["sdpa_over_torch"] = _ratio(sdpa_gflops, figure("torch", "gflops"))
    row["sdpa_over_numpy"] = _ratio(sdpa_gflops, figure("numpy", "gflops"))
    pct = _ratio(sdpa_gflops, gemm_gflops)
    row["sdpa_pct_gemm"] = None if pct is None else 100.0 * pct
    row["sdpa_gbps"] = figure("sdpa", "gbps")
    pct = _ratio(row["sdpa_gbps"], bandwidth_gbps)
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


def default_threads() -> List[int]:
    n = os.cpu_count() or 1
    return [1] if n == 1 else [1, n]


# --------------------------------------------------------------------------- machine facts


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip().lower(), value.strip()
                # x86 says "model name"; other architectures use one of the others
                if (
                    key in ("model name", "cpu model", "hardware", "processor")
                    and value
                    and not value.isdigit()
                ):
                    return value
    except OSError:
        pass
    return platform.processor() or None


def _git_commit() -> Dict[str, Optional[str]]:
    here = os.path.dirname(os.path.abspath(__file__))
    for where, cwd in (("package", here), ("cwd", os.getcwd())):
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return {"commit": out.stdout.strip(), "from": where}
    return {"commit": None, "from": None}


def _threadpool_info() -> List[Dict[str, Any]]:
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415
    except ImportError:
        return []
    keep = ("user_api", "internal_api", "version", "architecture", "threading_layer", "num_threads", "prefix")
    return [{k: lib.get(k) for k in keep if k in lib} for lib in threadpool_info()]


def machine_info() -> Dict[str, Any]:
    """Where and with what the figures were measured."""
    torch = _load_torch()
    try:
        sdpa_cfg: Any = _sdpa_config()
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        sdpa_cfg = {"error": str(exc)}
    try:
        affinity: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    env_keys = (
        "OMP_NUM_THREADS",
        "OMP_PROC_BIND",
        "OMP_PLACES",
        "OPENBLAS_NUM_THREADS",
        "OPENBLAS_CORETYPE",
        "OPENBLAS_L2_SIZE",
        "MKL_NUM_THREADS",
    )
    git = _git_commit()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": affinity,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": getattr(torch, "__version__", None),
        "sdpa": _sdpa_version,
        "sdpa_config": sdpa_cfg,
        "git_commit": git["commit"],
        "git_commit_from": git["from"],
        "threadpools": _threadpool_info(),
        "env": {k: os.environ[k] for k in env_keys if k in os.environ},
    }


# --------------------------------------------------------------------------- output


def _fmt_rate(x: Optional[float]) -> str:
    if x is None:
        return ""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _fmt_impl(row: Dict[str, Any], impl: str, key: str = "gflops") -> str:
    r = row["impls"].get(impl)
    if r is None or r["status"] == "skipped":
        return "-"
    if r["status"] == "error":
        return "err"
    return _fmt_rate(r.get(key))


def format_table(rows: Sequence[Dict[str, Any]], dtype: str = "float32") -> str:
    """The results as a plain-text table, one line per (shape, threads)."""
    gemm = "sgemm" if dtype == "float32" else "dgemm" if dtype == "float64" else "gemm"
    header = [
        "shape",
        "threads",
        "sdpa GFLOP/s",
        "numpy GFLOP/s",
        "torch GFLOP/s",
        "sdpa/torch",
        f"% {gemm}",
        "sdpa GB/s",
        "% bw",
    ]
    lines: List[List[str]] = []
    for row in rows:
        ratio = row.get("sdpa_over_torch")
        pct = row.get("sdpa_pct_gemm")
        decode = row.get("decode")
        pct_bw = row.get("sdpa_pct_bandwidth") if decode else None
        lines.append(
            [
                row["shape"],
                str(row["threads"]),
                _fmt_impl(row, "sdpa"),
                _fmt_impl(row, "numpy"),
                _fmt_impl(row, "torch"),
                "-" if ratio is None else f"{ratio:.2f}x",
                "" if pct is None else f"{pct:.1f}%",
                _fmt_impl(row, "sdpa", "gbps") if decode else "",
                "" if pct_bw is None else f"{pct_bw:.0f}%",
            ]
        )
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)
    ]

    def render(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule] + [render(line) for line in lines])


def format_references(references: Dict[str, Any]) -> str:
    lines = []
    gemm = references.get("gemm", {})
    if gemm.get("results"):
        parts = [
            f"{e['gflops']:.1f} GFLOP/s ({e['threads'] if e['threads'] is not None else 'default'} thr)"
            for e in gemm["results"]
        ]
        how = (
            "BLAS threads set with threadpoolctl"
            if gemm["threads_controlled"]
            else "default BLAS threads: threadpoolctl not installed"
        )
        lines.append(f"{gemm['dtype']} gemm {gemm['n']}^3: " + ", ".join(parts) + f"  [{how}]")
    bw = references.get("bandwidth", {})
    if bw.get("results"):
        parts = [f"{e['gbps']:.1f} GB/s ({e['threads']} thr)" for e in bw["results"]]
        lines.append(f"read bandwidth, np.add.reduce over {bw['bytes'] // MiB} MiB: " + ", ".join(parts))
    return "\n".join(lines)


def _describe_skips(rows: Sequence[Dict[str, Any]]) -> List[str]:
    notes: Dict[str, None] = {}
    for row in rows:
        for impl, r in row["impls"].items():
            if r["status"] != "ok":
                notes[f"{row['shape']}: {impl} {r['status']} ({r['reason']})"] = None
    return list(notes)


def plot_results(
    rows: Sequence[Dict[str, Any]], path: str, references: Optional[Dict[str, Any]] = None
) -> None:
    """Two panels: prefill GFLOP/s against sequence length, and against thread count."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.lines import Line2D  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(f"plotting needs matplotlib (pip install matplotlib): {exc}") from None

    prefill = [r for r in rows if not r["decode"]]
    thread_counts = sorted({r["threads"] for r in rows})
    tmax = thread_counts[-1] if thread_counts else 1
    markers = {"sdpa": "o", "numpy": "s", "torch": "^"}
    styles = {"sdpa": "-", "numpy": ":", "torch": "--"}
    impls = [i for i in IMPLEMENTATIONS if any(i in r["impls"] for r in rows)]
    gemm_entries = (references or {}).get("gemm", {}).get("results", [])

    def gflops(row: Dict[str, Any], impl: str) -> Optional[float]:
        r = row["impls"].get(impl)
        return r["gflops"] if r and r["status"] == "ok" else None

    fig, (ax_len, ax_thr) = plt.subplots(1, 2, figsize=(13, 5.2))

    at_tmax = [r for r in prefill if r["threads"] == tmax]
    for impl in impls:
        pts = sorted((r["L"], g) for r in at_tmax if (g := gflops(r, impl)) is not None)
        if pts:
            ax_len.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                linestyle="none",
                marker=markers[impl],
                markersize=7,
                alpha=0.8,
                label=impl,
            )
    for r in at_tmax:
        g = gflops(r, "sdpa")
        if g is not None:
            ax_len.annotate(r["shape"], (r["L"], g), textcoords="offset points", xytext=(6, 3), fontsize=7)
    ref = _lookup(gemm_entries, tmax, "gflops")
    if ref is not None:
        ax_len.axhline(ref, color="0.5", linestyle="--", linewidth=1, label="gemm (NumPy)")
    ax_len.set_xscale("log", base=2)
    lengths = sorted({r["L"] for r in at_tmax})
    if lengths:
        ax_len.set_xticks(lengths)
        ax_len.set_xticklabels([str(n) for n in lengths])
        ax_len.minorticks_off()
    ax_len.margins(x=0.15)
    ax_len.set_xlabel("sequence length L")
    ax_len.set_ylabel("GFLOP/s")
    ax_len.set_title(f"prefill shapes, {tmax} thread{'s' if tmax != 1 else ''}")
    ax_len.set_ylim(0, max(ax_len.get_ylim()[1], (ref or 0.0) * 1.08))
    ax_len.grid(True, alpha=0.3)
    ax_len.legend(fontsize=8)

    names = list(dict.fromkeys(r["shape"] for r in prefill))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        color = colors[i % len(colors)]
        for impl in impls:
            pts = sorted(
                (r["threads"], g)
                for r in prefill
                if r["shape"] == name and (g := gflops(r, impl)) is not None
            )
            if pts:
                ax_thr.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    linestyle=styles[impl],
                    marker=markers[impl],
                    markersize=4,
                )
    ref_pts = [(e["threads"], e["gflops"]) for e in gemm_entries if e["threads"] is not None]
    if ref_pts:
        ax_thr.plot([p[0] for p in ref_pts], [p[1] for p in ref_pts], color="0.4", linewidth=2, alpha=0.6)
    handles = [Line2D([], [], color=colors[i % len(colors)], label=n) for i, n in enumerate(names)]
    handles += [
        Line2D([], [], color="k", linestyle=styles[i], marker=markers[i], markersize=4, label=i)
        for i in impls
    ]
    if ref_pts:
        handles.append(Line2D([], [], color="0.4", linewidth=2, alpha=0.6, label="gemm (NumPy)"))
    ax_thr.set_xticks(thread_counts)
    ax_thr.set_xlabel("threads")
    ax_thr.set_ylabel("GFLOP/s")
    ax_thr.set_title("prefill shapes against thread count")
    ax_thr.set_ylim(bottom=0)
    ax_thr.grid(True, alpha=0.3)
    ax_thr.legend(handles=handles, fontsize=7, ncol=2)

    fig.suptitle(f"sdpa {_sdpa_version}: attention throughput ({rows[0]['dtype'] if rows else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def _int_list(text: str) -> List[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sdpa.bench",
        description="Time sdpa against NumPy and PyTorch attention on this machine.",
        epilog="Columns are explained in benchmarks/README.md.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--shapes",
        help="comma-separated shape names (see --list) or NAME:B,Hq,Hkv,L,S,E[,causal] specs",
    )
    which.add_argument("--quick", action="store_true", help="a few small shapes only (smoke runs)")
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument(
        "--threads", type=_int_list, help="comma-separated thread counts (default: 1,N for N CPUs)"
    )
    p.add_argument(
        "--impls", default=",".join(IMPLEMENTATIONS), help="implementations to run (default: %(default)s)"
    )
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        help="seconds of timed runs per measurement (default: %(default)s)",
    )
    p.add_argument(
        "--repeat", type=int, default=5, help="at least this many timed runs (default: %(default)s)"
    )
    p.add_argument("--gemm-size", type=int, default=2048, help="n of the n x n reference matmul; 0 skips it")
    p.add_argument(
        "--bandwidth-mib", type=int, default=512, help="size of the bandwidth reference array; 0 skips it"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write machine facts and every measurement as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw GFLOP/s against length and threads (needs matplotlib)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return p


def _split_shapes(text: str) -> List[str]:
    """Split ``--shapes`` on commas, keeping the commas inside NAME:B,Hq,... specs."""
    items: List[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if items and ":" in items[-1] and ":" not in token and token not in _SHAPES_BY_NAME:
            items[-1] += "," + token
        else:
            items.append(token)
    return items


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)

    if args.list:
        for s in SHAPES + [q for q in QUICK_SHAPES if q not in SHAPES]:
            tag = " (--quick)" if s in QUICK_SHAPES else ""
            print(f"{s.name:16s} {s.describe():46s} {attention_flops(s) / 1e9:10.2f} GFLOP{tag}")
        return 0

    try:
        if args.quick:
            shapes = list(QUICK_SHAPES)
        elif args.shapes:
            shapes = [parse_shape(s) for s in _split_shapes(args.shapes)]
        else:
            shapes = list(SHAPES)
        impls = [i.strip() for i in args.impls.split(",") if i.strip()]
        bad = [i for i in impls if i not in IMPLEMENTATIONS]
        if bad or not impls:
            raise ValueError(f"--impls: choose from {', '.join(IMPLEMENTATIONS)}")
        if args.repeat < 1 or args.min_time < 0:
            raise ValueError("--repeat must be >= 1 and --min-time >= 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if args.plot:
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2

    threads = args.threads or default_threads()
    if "OPENBLAS_CORETYPE" in os.environ and "numpy" in impls:
        print(
            "note: OPENBLAS_CORETYPE is set; NumPy's matmul (the numpy column and the gemm "
            "reference) may run a slower kernel than this CPU allows",
            file=sys.stderr,
        )

    show = sys.stderr.isatty() if args.progress is None else args.progress
    steps = _reference_steps(threads, args.gemm_size, args.bandwidth_mib) + len(shapes) * len(threads) * len(
        impls
    )
    progress = Progress(steps, enabled=show)

    info = machine_info()
    rows: List[Dict[str, Any]] = []
    references: Dict[str, Any] = {}
    interrupted = False
    try:
        references = measure_references(
            threads,
            args.dtype,
            gemm_n=args.gemm_size,
            bandwidth_mib=args.bandwidth_mib,
            min_time=args.min_time,
            repeat=args.repeat,
            progress=progress,
        )
        for row in iter_suite(
            shapes,
            threads,
            impls,
            args.dtype,
            min_time=args.min_time,
            repeat=args.repeat,
            references=references,
            seed=args.seed,
            progress=progress,
        ):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()

    cfg = info["sdpa_config"]
    print(
        f"sdpa {info['sdpa']} ({', '.join(f'{k}={v}' for k, v in cfg.items() if k != 'version')})"
        if isinstance(cfg, dict)
        else f"sdpa {info['sdpa']}"
    )
    blas = next((b for b in info["threadpools"] if b.get("user_api") == "blas"), None)
    blas_text = (
        f", BLAS {blas.get('internal_api')} {blas.get('version')} ({blas.get('architecture')})"
        if blas
        else ""
    )
    print(
        f"{info['cpu_model'] or info['machine']}, {info['cpu_count']} CPUs, numpy {info['numpy']}"
        f"{blas_text}, torch {info['torch'] or 'not installed'}, {args.dtype}"
    )
    ref_text = format_references(references)
    if ref_text:
        print(ref_text)
    print()
    print(format_table(rows, args.dtype))
    for note in _describe_skips(rows):
        print(f"  {note}")
    if interrupted:
        print("(interrupted: partial results)")

    if args.json:
        payload = {
            "machine": info,
            "settings": {
                "shapes": [asdict(s) for s in shapes],
                "threads": threads,
                "impls": impls,
                "dtype": args.dtype,
                "min_time": args.min_time,
                "repeat": args.repeat,
                "seed": args.seed,
                "numpy_max_score_bytes": NUMPY_MAX_SCORE_BYTES,
                "complete": not interrupted,
            },
            "references": references,
            "results": rows,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, default=str)
            f.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot_results(rows, args.plot, references)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
