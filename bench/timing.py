"""In-process timing shared by the benchmarks that call a function many times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeat: int, warmup: int) -> tuple[float, float, float]:
    """(median wall s, min wall s, median thread CPU s) of ``repeat`` calls after ``warmup`` untimed ones.
    Thread CPU beside wall time: what other work on a shared machine does not distort."""
    for _ in range(warmup):
        fn()
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(repeat):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), min(wall), statistics.median(cpu)
