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
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in device:
        totals[e["name"][:90]][0] += 1
        totals[e["name"][:90]][1] += e["dur"]
    for name, (count, us) in sorted(totals.items(), key=lambda t: -t[1][1])[:kernels_shown]:
        lines.append(f"  {us / 1e3:9.2f} ms {int(count):5d}x  {name}")
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for r in runtime:
        calls[r["name"]][0] += 1
        calls[r["name"]][1] += r["dur"]
    top = sorted(calls.items(), key=lambda t: -t[1][1])[:10]
    listed = (f"{name} {int(count)}x {us / 1e3:.2f} ms" for name, (count, us) in top)
    lines.append("  runtime: " + ", ".join(listed))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders of *.pt.trace.json(.gz)")
    for folder in parser.parse_args().folders:
        for path in sorted(folder.glob("*.pt.trace.json*")):
            print(f"== {path}\n{summary(trace_events(path))}")


if __name__ == "__main__":
    main()
