"""Timing and reporting shared by the benchmarks: best-of-n wall time, ratio to baseline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    baseline_s: float
    vinterp_s: float
    target: float

    @property
    def ratio(self) -> float:
        return self.vinterp_s / self.baseline_s

    def line(self) -> str:
        verdict = "ok" if self.ratio <= self.target else "OVER TARGET"
        return (
            f"{self.name:<44} {self.baseline_s:8.3f} s {self.vinterp_s:8.3f} s "
            f"{self.ratio:6.2f}x  (target <= {self.target:.2f}x) {verdict}"
        )


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` runs after one warm-up (first runs pay one-off costs)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def header() -> str:
    return f"{'workload':<44} {'vLLM':>10} {'vinterp':>10} {'ratio':>7}"
