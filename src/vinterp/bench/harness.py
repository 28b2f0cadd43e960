"""Timing and reporting shared by the benchmarks: best-of-n wall time, ratio to baseline,
targets per device kind, machine info, memory freed between engines."""

from __future__ import annotations

import datetime
import gc
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A row without a target: a reference measurement, reported but never judged.
REFERENCE = math.inf

# Ratio targets (measured / baseline) per device kind and workload key.
TARGETS: dict[str, dict[str, float]] = {
    "cuda": {
        "idle": 1.02,
        "steer": 1.05,
        "capture_one": 1.1,
        "capture_layers_last": 1.5,
        "capture_layers_all": 1.5,
        "trace": 1.3,
        "pp_save_layers": 1.3,
        "pp_patch": 1.5,
    },
    "cpu": {
        "idle": 1.05,
        "steer": 1.05,
        "capture_one": 1.05,
        "capture_layers_last": 1.3,
        "capture_layers_all": 1.5,
        "trace": 1.3,
        "pp_save_layers": 1.3,
        "pp_patch": 1.5,
    },
}


@dataclass
class Row:
    name: str
    baseline_s: float
    vinterp_s: float
    target: float
    key: str = ""

    @property
    def ratio(self) -> float:
        return self.vinterp_s / self.baseline_s

    @property
    def verdict(self) -> str:
        if math.isinf(self.target):
            return "reference"
        return "ok" if self.ratio <= self.target else "OVER TARGET"

    def line(self) -> str:
        target = "(no target)" if math.isinf(self.target) else f"(target <= {self.target:.2f}x)"
        return (
            f"{self.name:<44} {self.baseline_s:8.3f} s {self.vinterp_s:8.3f} s "
            f"{self.ratio:6.2f}x  {target} {self.verdict}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; a reference row's target is null."""
        return {
            "key": self.key,
            "name": self.name,
            "baseline_s": self.baseline_s,
            "vinterp_s": self.vinterp_s,
            "ratio": self.ratio,
            "target": None if math.isinf(self.target) else self.target,
            "verdict": self.verdict,
        }


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
    return f"{'workload':<44} {'baseline':>10} {'measured':>10} {'ratio':>7}"


def device_kind() -> str:
    """'cuda' when a CUDA GPU is visible, else 'cpu' (the keys of TARGETS)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def target(key: str) -> float:
    """The ratio target of workload `key` on this machine's device kind."""
    return TARGETS[device_kind()][key]


def free_memory() -> None:
    """Between engines: drop dead objects and, on a GPU, the allocator's cached blocks."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def machine_info(dtype: str, model: str | Path) -> dict[str, Any]:
    """Where and how the rows were measured."""
    import torch

    kind = device_kind()
    device = torch.cuda.get_device_name(0) if kind == "cuda" else platform.processor()
    return {
        "device": device or platform.machine(),
        "device_kind": kind,
        "dtype": dtype,
        "model": str(model),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def write_json(path: str | Path, rows: list[Row], info: dict[str, Any]) -> None:
    """`{"machine": info, "rows": [...]}` at `path`."""
    doc = {"machine": info, "rows": [row.to_dict() for row in rows]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
