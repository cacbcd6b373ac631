"""The timer, and the progress bar shown while it runs."""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Tuple

__all__ = ["time_call", "median_time", "loop_times", "alternating_loop_times", "Progress"]


def time_call(
    fn: Callable[[], Any], min_time: float = 0.5, repeat: int = 5, max_runs: int = 100_000, warmup: bool = True
) -> List[float]:
    """Seconds per call: one untimed warm-up, then at least ``repeat`` calls and ``min_time`` s.

    ``warmup=False`` leaves the warm-up to the caller (who may want its result).
    """
    if warmup:
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


def median_time(fn: Callable[[], Any], min_time: float = 0.0, repeat: int = 5) -> float:
    """The median of :func:`time_call`'s figures: seconds per call, after one warm-up."""
    return statistics.median(time_call(fn, min_time, repeat))


def loop_times(
    fn: Callable[[], Any], min_time: float = 0.5, repeat: int = 5, max_number: int = 1_000_000
) -> Tuple[List[float], int]:
    """Seconds per call, one figure per timed loop of ``number`` back-to-back calls.

    For calls of microseconds, where the clock read around each call would weigh.
    Loops of 1, 2, 4, ... calls warm up first and pick ``number``, the first count whose
    loop lasts ``min_time / repeat`` seconds; then ``repeat`` loops of that many calls
    are timed, so together they take about ``min_time``.  Returns the per-call time of
    each timed loop, and ``number``.
    """
    target = min_time / max(repeat, 1)
    number = 1
    while _time_loop(fn, number) < target and number < max_number:
        number *= 2
    return [_time_loop(fn, number) / number for _ in range(repeat)], number


def alternating_loop_times(
    fns: Mapping[str, Callable[[], Any]],
    min_time: float = 0.5,
    repeat: int = 5,
    max_number: int = 1_000_000,
    *,
    settle: bool = False,
) -> Tuple[Dict[str, List[float]], Dict[str, int]]:
    """Seconds per call of several functions, timed in alternating rounds.

    Each function's calls per loop are picked as by :func:`loop_times` (loops of 1, 2,
    4, ... calls warm it up, the first lasting ``min_time / repeat`` seconds sets
    ``number``).  Then ``repeat`` rounds each time one loop of every function, the
    order rotated by one from round to round, so that a slow spell of a noisy machine
    falls on all of them alike and none always follows the same one.  With
    ``settle``, each timed loop follows one untimed call of its function: the
    threads of the library timed before (another OpenMP runtime's, which spin a
    while after their work) have gone quiet, and the first call, which meets
    them, is not counted.  Returns, per function, the per-call time of each of
    its loops, and its ``number``.
    """
    names = list(fns)
    target = min_time / max(repeat, 1)
    numbers: Dict[str, int] = {}
    for name in names:
        number = 1
        while _time_loop(fns[name], number) < target and number < max_number:
            number *= 2
        numbers[name] = number
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
            if settle:
                fns[name]()
            times[name].append(_time_loop(fns[name], numbers[name]) / numbers[name])
    return times, numbers


def _time_loop(fn: Callable[[], Any], number: int) -> float:
    """Seconds taken by ``number`` calls in a row, with the garbage collector off (as in timeit)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        calls = itertools.repeat(None, number)
        t0 = time.perf_counter()
        for _ in calls:
            fn()
        return time.perf_counter() - t0
    finally:
        if gc_was_enabled:
            gc.enable()


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
        """Count one step as done."""
        self.done = min(self.done + 1, self.total)

    def close(self) -> None:
        """Erase the bar."""
        if self.enabled and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self.stream.flush()
            self._last_len = 0
