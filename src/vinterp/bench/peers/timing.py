"""Repeated wall times after a warm-up, median and spread. Here rather than in the harness
because peer processes, which cannot import vinterp, time themselves with it too."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Timing:
    """Wall times of the repeats (warm-up excluded): the median is reported, the spread
    (max - min over the median) says how far to trust it on a shared machine."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def spread(self) -> float:
        return (max(self.times) - min(self.times)) / self.median if self.median else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "spread": self.spread, "times_s": list(self.times)}


def measure(fn: Callable[[], object], repeats: int) -> tuple[Timing, object]:
    """Wall times of `repeats` runs of `fn` after one warm-up (first runs pay one-off costs),
    and what the last run returned."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return Timing(tuple(times)), result
