"""Timing shared by the benchmark scripts (run as ``python benchmarks/bench_*.py``: this folder is on
``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[int], object], n: int) -> float:
    """Median wall time of `n` calls ``fn(0) .. fn(n - 1)``, in milliseconds."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
