"""Thread counts: the defaults, how they are written, and the BLAS pool's limit."""

from __future__ import annotations

import os
from typing import Any, List, Optional

from .. import _core, set_num_threads

__all__ = ["default_threads", "threads_text", "BlasThreads", "SdpaThreads", "TorchThreads"]


def default_threads() -> List[int]:
    """One thread and every CPU: ``[1, os.cpu_count()]`` (just ``[1]`` on one CPU)."""
    n = os.cpu_count() or 1
    return [1] if n == 1 else [1, n]


def threads_text(n: Optional[int]) -> str:
    """``"1 thread"``, ``"4 threads"``, or ``"default threads"`` for None."""
    if n is None:
        return "default threads"
    return f"{n} thread" + ("s" if n != 1 else "")


class BlasThreads:
    """Context manager limiting the BLAS pool to ``n`` threads, when threadpoolctl is there."""

    def __init__(self, n: Optional[int]) -> None:
        self.n = n
        self._limits: Any = None

    @staticmethod
    def available() -> bool:
        """Whether threadpoolctl can be imported (without it the pool is left alone)."""
        try:
            import threadpoolctl  # noqa: F401, PLC0415
        except ImportError:
            return False
        return True

    def __enter__(self) -> "BlasThreads":
        if self.n is not None and self.available():
            from threadpoolctl import threadpool_limits  # noqa: PLC0415

            self._limits = threadpool_limits(limits=self.n, user_api="blas")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._limits is not None:
            self._limits.restore_original_limits()
            self._limits = None


class SdpaThreads:
    """Context manager: sdpa calls without ``num_threads=`` use ``n`` threads inside it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._saved = 0

    def __enter__(self) -> "SdpaThreads":
        self._saved = _core.threads_setting()  # 0: none set, the OpenMP default applies
        set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_num_threads(self._saved or None)


class TorchThreads:
    """Context manager: ``torch.set_num_threads(n)`` inside it, the count before restored after."""

    def __init__(self, torch: Any, n: int) -> None:
        self.torch = torch
        self.n = n
        self._saved = 0

    def __enter__(self) -> "TorchThreads":
        self._saved = self.torch.get_num_threads()
        self.torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.torch.set_num_threads(self._saved)
