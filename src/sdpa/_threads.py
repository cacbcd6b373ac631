"""Thread counts: the check of ``num_threads`` and the process-wide setting."""
from __future__ import annotations

import numbers
from typing import (
    Optional,
)

from . import _core

_MAX_THREADS = _core.MAX_NUM_THREADS  # larger counts are taken as this


def thread_count(num_threads: object, name: str = "num_threads") -> Optional[int]:
    """None, or a thread count >= 1 (counts above 65536 are taken as 65536; the
    core then uses at most ``sdpa.config()["max_threads"]``)."""
    if num_threads is None:
        return None
    if isinstance(num_threads, bool) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(f"{name}: expected None or an int, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"{name}: must be >= 1 (or None for the default), got {num_threads}")
    return min(int(num_threads), _MAX_THREADS)


def set_num_threads(num_threads: Optional[int]) -> None:
    """Set the number of threads later calls use when they are not given ``num_threads``.

    ``None`` goes back to the OpenMP default: ``OMP_NUM_THREADS``, or the limit set
    with ``threadpoolctl.threadpool_limits(n, user_api="openmp")``, else one thread
    per CPU.  The setting holds for the whole process (every Python thread); an
    explicit ``num_threads=`` argument still wins over it.  Like the OpenMP default,
    the set value is a most: a small problem gets fewer threads (at least 1 MFLOP of
    work each, a byte of keys and values read counting as 2 flops), since starting
    a thread costs more than it saves there; only
    ``num_threads=`` is taken as asked.  Results do not depend on the thread count.

    Raises
    ------
    TypeError
        ``num_threads`` is not an int or None.
    ValueError
        ``num_threads`` is smaller than 1.
    """
    n = thread_count(num_threads)
    _core.set_threads_setting(0 if n is None else n)


def get_num_threads() -> int:
    """The number of threads a call without ``num_threads=`` uses now.

    The value set with :func:`set_num_threads`, else the OpenMP default of the
    calling thread (``omp_get_max_threads()``, which follows ``OMP_NUM_THREADS`` and
    threadpoolctl).  Always 1 when sdpa was built without OpenMP.
    """
    if not _core.has_openmp():
        return 1
    n = _core.threads_setting() or max(1, int(_core.default_num_threads()))
    return min(n, _core.max_threads())
