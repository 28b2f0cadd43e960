"""Timing shared by the benchmarks: repeated wall times after a warm-up (median and spread),
ratio to baseline, targets per device kind, machine info, memory freed between engines."""

from __future__ import annotations

import datetime
import gc
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from vinterp.bench.peers.timing import Timing, measure

# A row without a target: a reference measurement, reported but never judged.
REFERENCE = math.inf
# The ratio's interval: its confidence, and the bootstrap resamples that estimate it
CONFIDENCE = 0.9
RESAMPLES = 2000

# Ratio targets (measured / baseline) per device kind and workload key; the per-head, router
# and SAE capture rows are reported against plain vLLM without a target.
TARGETS: dict[str, dict[str, float]] = {
    "cuda": {
        "idle": 1.02,
        "steer": 1.05,
        "ablate": 1.05,  # issue 59: directional ablation costs what steering costs
        "capture_one": 1.1,
        "capture_layers_last": 1.5,
        "tp_idle": 1.02,
        "tp_steer": 1.05,
        "tp_capture_layers_last": 1.5,
        "capture_layers_all": 1.5,
        "trace": 1.3,
        "pp_save_layers": 1.3,
        "pp_patch": 1.5,
        "extract_layers_all": 1.10,  # issue 58
        "extract_layers_last": 1.05,
        "extract_sae_topk": 1.15,
        "extract_mid_depth": 0.60,  # issue 59: half the layers, against the whole prefill
        "sae_clamp": 1.10,
        "probe": 1.10,  # issue 59: a probe's scores at every token, on an engine with probe_sites
        "probe_gated": 1.10,  # and a steering that probe gates
        "sae_capture_topk": 1.5,
        "extract_pipeline": 1.05,
        **dict.fromkeys(("capture_qk", "capture_pattern", "capture_router"), REFERENCE),
    },
    "cpu": {  # issue 16's targets for this project's 2-core machine
        "idle": 1.02,
        "steer": 1.05,
        "ablate": 1.05,
        "capture_one": 1.05,
        "capture_layers_last": 1.3,
        "tp_idle": 1.02,
        "tp_steer": 1.05,
        "tp_capture_layers_last": 1.3,
        "capture_layers_all": 1.5,
        "trace": 1.3,
        "pp_save_layers": 1.3,
        "pp_patch": 1.5,
        "extract_layers_all": 1.3,
        "extract_layers_last": 1.1,
        "extract_sae_topk": 1.3,  # as extract_layers_all on this machine
        "extract_mid_depth": 0.60,
        "sae_clamp": 1.10,  # as on a GPU
        "probe": 1.10,
        "probe_gated": 1.10,
        "extract_pipeline": 1.05,
        **dict.fromkeys(
            ("capture_qk", "capture_pattern", "capture_router", "sae_capture_topk"), REFERENCE
        ),
    },
}


@dataclass
class Row:
    """One workload against its baseline; `tokens` (processed in one run) gives tokens/s;
    `extras`: further numbers of the row by name (e.g. GB written), reported with it."""

    name: str
    baseline: Timing
    measured: Timing
    target: float
    key: str = ""
    tokens: int = 0
    extras: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.measured.median / self.baseline.median

    @cached_property
    def interval(self) -> tuple[float, float]:
        """The ratio's `CONFIDENCE` interval (`ratio_interval`), resampled once per row."""
        return ratio_interval(self.measured, self.baseline)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.measured.median if self.tokens else None

    @property
    def verdict(self) -> str:
        """Against the target: by the ratio, and "(within noise)" when the ratio's interval
        holds the target, so that the rounds can neither confirm nor refute it."""
        if math.isinf(self.target):
            return "reference"
        verdict = "ok" if self.ratio <= self.target else "OVER TARGET"
        low, high = self.interval
        return f"{verdict} (within noise)" if low <= self.target < high else verdict

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; a reference row's target is null."""
        return {
            "key": self.key,
            "name": self.name,
            "baseline": self.baseline.to_dict(),
            "vinterp": self.measured.to_dict(),
            "ratio": self.ratio,
            "ratio_interval": list(self.interval),
            "tokens_per_s": self.tokens_per_s,
            "target": None if math.isinf(self.target) else self.target,
            "verdict": self.verdict,
            **({"extras": self.extras} if self.extras else {}),
        }


def ratio_interval(
    measured: Timing, baseline: Timing, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """Bootstrap interval of median(measured) / median(baseline): rounds drawn with
    replacement, the same rounds of both when they have one time per round each (interleaved
    rounds share the machine's state of the moment), seeded so that a report reads the same
    every time it is written."""
    rng = random.Random(0)
    ours, theirs = measured.times, baseline.times
    ratios = []
    for _ in range(RESAMPLES):
        drawn = [rng.randrange(len(ours)) for _ in ours]
        paired = drawn if len(theirs) == len(ours) else [rng.randrange(len(theirs)) for _ in theirs]
        ratios.append(
            statistics.median(ours[i] for i in drawn) / statistics.median(theirs[i] for i in paired)
        )
    ratios.sort()
    tail = int(RESAMPLES * (1 - confidence) / 2)
    return ratios[tail], ratios[-1 - tail]


def timed(fn: Callable[[], object], repeats: int) -> Timing:
    """Wall times of `repeats` runs after one warm-up."""
    return measure(fn, repeats)[0]


def timed_interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    cleanup: dict[str, Callable[[], object]] | None = None,
    warm: dict[str, Callable[[], object]] | None = None,
) -> dict[str, Timing]:
    """Wall times of each workload over `repeats` rounds that run every workload once (after
    one warm-up each): drift of the machine over the run reaches every workload alike, where
    blocks of runs per workload would turn it into differences between them. Each run starts
    after a full garbage collection, so none pays for the garbage of the one before.
    `cleanup[key]`, when given, runs after each run of `key` (the warm-up too), untimed;
    `warm[key]`, when given, is the warm-up instead of a full run (a smaller one, for
    workloads of minutes)."""
    cleanup, warm = cleanup or {}, warm or {}

    def after(key: str) -> None:
        if key in cleanup:
            cleanup[key]()

    for key, fn in fns.items():
        warm.get(key, fn)()
        after(key)
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            gc.collect()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
            after(key)
    return {key: Timing(tuple(runs)) for key, runs in times.items()}


def device_kind() -> str:
    """'cuda' when a CUDA GPU is visible, else 'cpu' (the keys of TARGETS). Asks NVML
    (`device_count`), not the CUDA driver: a driver initialised in this process before vLLM
    forks its engine process can hang that process's first pinned allocation."""
    import torch

    return "cuda" if torch.cuda.device_count() > 0 else "cpu"


def target(key: str) -> float:
    """The ratio target of workload `key` on this machine's device kind."""
    return TARGETS[device_kind()][key]


def free_memory() -> None:
    """Between engines: drop dead objects and, on a GPU, the allocator's cached blocks."""
    import torch

    gc.collect()
    if torch.cuda.is_initialized():  # else this process holds no GPU memory (see device_kind)
        torch.cuda.empty_cache()


def machine_info(dtype: str, model: str | Path) -> dict[str, Any]:
    """Where and how the rows were measured."""
    import torch

    kind = device_kind()
    device = torch.cuda.get_device_name(0) if kind == "cuda" else _cpu_name()
    return {
        "device": device,
        "device_kind": kind,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "dtype": dtype,
        "model": str(model),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _cpu_name() -> str:
    """The CPU's model name (platform.processor() is often empty on Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
