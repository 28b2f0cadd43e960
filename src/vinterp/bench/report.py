"""The bench's results as `bench.json`, `bench.md` (Markdown tables) and `bench.png` (bars):
the steering, capture and trace rows against plain vLLM, then the peers against vinterp."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vinterp.bench import load_results
from vinterp.bench.harness import CONFIDENCE, Row
from vinterp.bench.peers.row import PeerRow

WORKLOAD_TITLES = {
    "extract": "batch activation extraction (every layer at the last prompt token)",
    "steer": "steered generation (one layer steered, greedy)",
}


@dataclass
class Report:
    machine: dict[str, Any]
    command: str
    rows: list[Row] = field(default_factory=list)
    peers: list[PeerRow] = field(default_factory=list)
    # JSON-ready results of workloads beyond their rows, by key (serve_load's summary)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "command": self.command,
            "rows": [row.to_dict() for row in self.rows],
            "peers": [row.to_dict() for row in self.peers],
            **({"details": self.details} if self.details else {}),
        }


def write(report: Report, out_dir: str | Path) -> list[Path]:
    """bench.json, bench.md and, when there is a row to draw and matplotlib (the `plot`
    extra) is installed, bench.png in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    write_json(report, paths[0])
    paths[1].write_text(markdown(report))
    if not (report.rows or report.peers):
        return paths
    try:
        paths.append(chart(report, out / "bench.png"))
    except ImportError:
        print("(pip install 'vinterp[plot]' to draw bench.png)")
    return paths


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _cell(text: str) -> str:
    """Text as one Markdown table cell (errors carry pipes and newlines)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _percent(value: float) -> str:
    return f"±{100 * value / 2:.0f}%"


# How a row's extras read in the table, by name (None: in bench.json only, the name says it)
EXTRAS: dict[str, str | None] = {
    "gb_written": "{:.3g} GB written",
    "gb_per_s": "{:.3g} GB/s",
    "dense_gb": "{:.3g} GB as dense rows",
    "size_vs_dense": "{:.3f}x the dense size",
    "store_alone_s": "the store alone writes them in {:.3g} s",
    "producer_s": "the producer alone takes {:.3g} s",
    "engine_waited_s": "the engine waited {:.3g} s for the writers",
    "writers_waited_s": "the writers waited {:.3g} s for rows",
    "gb_collected": "{:.3g} GB collected",
    "hf_batch": None,
    "vinterp_throughput_x_hf": "vinterp's throughput {:.2f}x HF's",
    "p99_s": "p99 {:.3g} s",
    "vllm_p99_s": "vLLM's p99 {:.3g} s",
    "req_per_s": "{:.3g} requests/s",
    "vllm_req_per_s": "vLLM's {:.3g} requests/s",
}


def _extras(row: Row) -> str:
    """A row's extras, after its name: "; 1.23 GB written, 0.5 GB/s"."""
    forms = {k: EXTRAS.get(k, k + " {:.3g}") for k in row.extras}
    parts = [form.format(row.extras[k]) for k, form in forms.items() if form is not None]
    return "; " + ", ".join(parts) if parts else ""


def markdown(report: Report) -> str:
    """Both tables with the machine and the command; spread is half of (max - min) / median
    over the repeats, the interval the ratio's bootstrap interval over the rounds."""
    m = report.machine
    lines = [
        f"Measured {m['date']} on {m['device']} ({m.get('cpus', '?')} CPUs, "
        f"{m['device_kind']}), {m['dtype']}, model `{m['model']}`.",
        "",
        f"Command: `{report.command}`",
        "",
    ]
    if report.rows:
        lines += [
            "| workload | plain vLLM s | vinterp s | spread | tokens/s | ratio | "
            f"{CONFIDENCE:.0%} interval | target | |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in report.rows:
            tps = f"{row.tokens_per_s:.0f}" if row.tokens_per_s else ""
            goal = "" if math.isinf(row.target) else f"<= {row.target:.2f}x"
            low, high = row.interval
            lines.append(
                f"| {_cell(row.name + _extras(row))} | {_seconds(row.baseline.median)}"
                f" | {_seconds(row.measured.median)}"
                f" | {_percent(row.measured.spread)} | {tps} | {row.ratio:.2f}x"
                f" | {low:.2f}-{high:.2f}x | {goal} | {row.verdict} |"
            )
        lines.append("")
    for workload, title in WORKLOAD_TITLES.items():
        rows = [row for row in report.peers if row.workload == workload]
        if not rows:
            continue
        lines += [
            f"**{title}**",
            "",
            "| tool | version | median s | spread | time / vinterp's | output |",
            "|---|---|---:|---:|---:|---|",
        ]
        for row in rows:
            if row.timing is None:
                time_cells = "| | |"
            else:
                time_cells = f"| {_seconds(row.timing.median)} | {_percent(row.timing.spread)} |"
            ratio = f"{row.vs_vinterp:.2f}x" if row.vs_vinterp is not None else ""
            tool, check = _cell(row.tool), _cell(row.check)
            lines.append(f"| {tool} | {_cell(row.version)} {time_cells} {ratio} | {check} |")
        lines.append("")
    if "serve_load" in report.details:
        lines.append(load_results.markdown(report.details["serve_load"]))
    return "\n".join(lines)


def chart(report: Report, path: str | Path) -> Path:
    """Bars: each vinterp row's ratio to plain vLLM (target marked), and each tool's time
    on each peer workload relative to vinterp's (log scale; tools that did not run or gave a
    wrong answer are labelled)."""
    from matplotlib.figure import Figure

    panels = [("vinterp", report.rows)] if report.rows else []
    panels += [(w, [r for r in report.peers if r.workload == w]) for w in WORKLOAD_TITLES]
    panels = [(kind, rows) for kind, rows in panels if rows]
    heights = [0.9 + 0.32 * len(rows) for _, rows in panels]
    fig = Figure(figsize=(12, sum(heights) + 0.5), layout="constrained")
    axes = fig.subplots(len(panels), 1, height_ratios=heights, squeeze=False)[:, 0]
    for ax, (kind, rows) in zip(axes, panels):
        if kind == "vinterp":
            _vinterp_panel(ax, rows)
        else:
            _peer_panel(ax, kind, rows)
    fig.suptitle(f"vinterp bench, {report.machine['device']}, {report.machine['date'][:10]}")
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def _vinterp_panel(ax: Any, rows: list[Row]) -> None:
    names = [row.name for row in rows][::-1]
    ratios = [row.ratio for row in rows][::-1]
    colors = ["tab:red" if row.verdict.startswith("OVER TARGET") else "tab:blue" for row in rows][
        ::-1
    ]
    ax.barh(names, ratios, color=colors)
    for i, row in enumerate(rows[::-1]):
        if not math.isinf(row.target):
            ax.plot([row.target, row.target], [i - 0.4, i + 0.4], color="black", lw=1.5)
    ax.axvline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("time / plain vLLM's (bar: median; black tick: target)")
    ax.set_title("vinterp against plain vLLM, same engine settings", fontsize="medium")


def _peer_panel(ax: Any, workload: str, rows: list[PeerRow]) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = rows[::-1]
    values = [row.vs_vinterp or 0.0 for row in rows]
    ran = [v for v in values if v] or [1.0]
    wide = max(ran) / min(ran) > 10  # a log axis only when the tools differ by 10x or more
    left = min(ran) / 2 if wide else 0.0  # bars grow from `left`
    colors = [
        "tab:green" if row.check == "reference" else "tab:red" if row.wrong else "tab:orange"
        for row in rows
    ]
    widths = [value - left if value else 0.0 for value in values]
    ax.barh([row.tool for row in rows], widths, left=left, color=colors)
    if wide:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(left, max(ran) * (4 if wide else 1.3))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axvline(1.0, color="gray", lw=0.8, ls="--")
    for i, (row, value) in enumerate(zip(rows, values)):
        if not row.ran:
            label = "did not run (see table)"
        else:
            label = f"{value:.2g}x" + (", WRONG output" if row.wrong else "")
        ax.text(value or left, i, " " + label, va="center", fontsize="small")
    scale = "log scale; " if wide else ""
    ax.set_xlabel(f"time / vinterp's ({scale}median of the repeats; above 1x: vinterp is faster)")
    ax.set_title(WORKLOAD_TITLES[workload], fontsize="medium")
