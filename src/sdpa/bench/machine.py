"""The machine: what it is, and its own ceilings (NumPy's gemm and read bandwidth)."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import __version__ as _sdpa_version, config as _sdpa_config
from . import peers
from .shapes import MiB
from .threads import BlasThreads, threads_text
from .timing import Progress, time_call

__all__ = ["measure_references", "reference_steps", "lookup", "machine_info", "package_version"]


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
    controlled = BlasThreads.available()

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
                progress.show(f"reference: {dt.name} gemm {gemm_n}, {threads_text(n)}")
            with BlasThreads(n):
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
                progress.show(f"reference: read bandwidth {bandwidth_mib} MiB, {threads_text(n)}")
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


def reference_steps(threads: Sequence[int], gemm_n: int, bandwidth_mib: int) -> int:
    """How many measurements :func:`measure_references` makes (for the progress bar)."""
    steps = 0
    if gemm_n > 0:
        steps += len(threads) if BlasThreads.available() else 1
    if bandwidth_mib > 0:
        steps += len(threads)
    return steps


def lookup(entries: List[Dict[str, Any]], threads: int, key: str) -> Optional[float]:
    """The figure measured with ``threads`` threads, or the one uncontrolled measurement."""
    for e in entries:
        if e["threads"] == threads:
            return e[key]
    for e in entries:
        if e["threads"] is None:
            return e[key]
    return None


# --------------------------------------------------------------------------- machine facts


def _cpu_model() -> Optional[str]:
    """The CPU's name from /proc/cpuinfo, else what ``platform`` knows, else None."""
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
    """The commit of the package's checkout, else of the working directory's, else None."""
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
    """The native thread pools threadpoolctl sees (BLAS, OpenMP), or [] without it."""
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415
    except ImportError:
        return []
    keep = ("user_api", "internal_api", "version", "architecture", "threading_layer", "num_threads", "prefix")
    return [{k: lib.get(k) for k in keep if k in lib} for lib in threadpool_info()]


def package_version(name: str) -> Optional[str]:
    """The installed version of the distribution ``name`` (without importing it), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> Dict[str, Any]:
    """Where and with what the figures were measured."""
    torch = peers._load_torch()
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
