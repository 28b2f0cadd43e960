"""The device's timeline in torch-profiler traces (vLLM's `profiler_config`, as
`profile_bulk.py --kernels` writes them): kernel time, the idle gaps between kernels and the
runtime calls made in the largest, the kernels that took the most time, and the runtime calls
(syncs among them) by total time. Two engines' traces of the same tokens side by side say
whether one runs other or slower kernels, or leaves the device idle more.

    python3 scripts/kernel_trace.py KERNELS/plain_mid KERNELS/mid
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path
from typing import Any

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME = ("cuda_runtime", "cuda_driver")


def trace_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        return json.load(file)["traceEvents"]


def summary(events: list[dict[str, Any]], gaps_shown: int = 8, kernels_shown: int = 20) -> str:
    """The trace's device timeline in lines of text (microseconds in, milliseconds out)."""
    device = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in RUNTIME]
    if not device:
        return "no device activity (a CPU engine's trace)"
    busy = sum(e["dur"] for e in device)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    gaps, end = [], device[0]["ts"]
    for e in device:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["name"]))
        end = max(end, e["ts"] + e["dur"])
    idle = sum(g for g, _, _ in gaps)
    lines = [f"device busy {busy / 1e3:.1f} ms, span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms"]
    for gap, at, name in sorted(gaps, reverse=True)[:gaps_shown]:
        calls = collections.Counter(r["name"] for r in runtime if at <= r["ts"] <= at + gap)
        lines.append(f"  idle {gap / 1e3:.2f} ms before {name[:60]}: {calls.most_common(3)}")
    for name, count, us in by_name(device)[:kernels_shown]:
        lines.append(f"  {us / 1e3:9.2f} ms {count:5d}x  {name}")
    listed = (f"{name} {count}x {us / 1e3:.2f} ms" for name, count, us in by_name(runtime)[:10])
    lines.append("  runtime: " + ", ".join(listed))
    return "\n".join(lines)


def by_name(events: list[dict[str, Any]], width: int = 90) -> list[tuple[str, int, float]]:
    """(name cut to `width`, count, total microseconds) per name, most time first."""
    counts: collections.Counter[str] = collections.Counter()
    times: collections.Counter[str] = collections.Counter()
    for e in events:
        counts[e["name"][:width]] += 1
        times[e["name"][:width]] += e["dur"]
    return [(name, counts[name], us) for name, us in times.most_common()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders of *.pt.trace.json(.gz)")
    for folder in parser.parse_args().folders:
        for path in sorted(folder.glob("*.pt.trace.json*")):
            print(f"== {path}\n{summary(trace_events(path))}")


if __name__ == "__main__":
    main()
