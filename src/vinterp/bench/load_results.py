"""The serve load bench's results: each request's outcome, the counts and latency percentiles
per kind, the server's memory growth after warm-up, the checks, and their Markdown."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from vinterp.bench.load_mix import ERROR, INTERVENED, KINDS, LEAKED, LOST, OK, WRONG

# Warm-up: the first share of a phase's requests, and until every kind of request has been
# answered once (what the server allocates the first time it serves a kind is not growth).
WARM_UP_SHARE = 0.1
# The share of the span after warm-up whose samples give the memory at its start and end: the
# lowest of each, the floor memory falls back to between requests. A leak raises the floor; a
# long prompt in flight (its step's activations) lifts only the samples taken meanwhile.
WINDOW_SHARE = 0.1
MAX_GROWTH = 0.02  # server memory after warm-up to the end
VERDICTS = (WRONG, LEAKED, LOST, ERROR)
MIB = 1 << 20


@dataclass(frozen=True)
class Outcome:
    """One request of a load phase: when it started (seconds into the phase), how long it
    took, the verdict and largest relative error (`load_mix.judge`), and a note (the error,
    or how a disconnect ended)."""

    kind: str
    start: float
    latency: float
    verdict: str
    error: float = 0.0
    note: str = ""


@dataclass
class Phase:
    """A load phase's results, its wall time, and the memory samples taken during it:
    (seconds into the phase, requests done, server tree RSS bytes, GPU bytes or None)."""

    results: list[Outcome]
    wall_s: float = 0.0
    samples: list[tuple[float, int, int, int | None]] = field(default_factory=list)


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (nan without values)."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def stats(results: list[Outcome], wall_s: float | None = None) -> dict[str, Any]:
    """Requests, the count of each verdict, latency p50/p99 (every request), the largest
    relative error of the answers judged right, and requests/s over `wall_s`."""
    latencies = [r.latency for r in results]
    counts = {v: sum(r.verdict == v for r in results) for v in (OK, *VERDICTS)}
    ok_errors = [r.error for r in results if r.verdict == OK]
    out = {
        "requests": len(results),
        **counts,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "max_rel_error": max(ok_errors, default=0.0),
    }
    if wall_s:
        out["requests_per_s"] = len(results) / wall_s
    return out


def memory_growth(phase: Phase) -> dict[str, Any]:
    """Server memory from the end of warm-up (the first WARM_UP_SHARE of the requests, and
    every kind answered once) to the end of the phase, and the requests with steering, a
    capture or a trace after warm-up."""
    warm = math.ceil(WARM_UP_SHARE * len(phase.results))
    first_answers: dict[str, float] = {}
    for r in phase.results:
        first_answers[r.kind] = min(first_answers.get(r.kind, math.inf), r.start + r.latency)
    every_kind = max(first_answers.values(), default=0.0)
    # once a request after warm-up began and every kind had been answered
    after = [s for s in phase.samples if s[1] > warm and s[0] >= every_kind]
    if len(after) < 2:
        return {"samples": len(phase.samples)}
    t_warm, t_end = after[0][0], after[-1][0]
    window = WINDOW_SHARE * (t_end - t_warm)

    def floor(index: int, lo: float, hi: float) -> float | None:
        values = [s[index] for s in after if lo <= s[0] <= hi and s[index] is not None]
        return min(values) if values else None

    out: dict[str, Any] = {
        "warm_up_requests": warm,
        "intervened_after_warm_up": sum(
            r.kind in INTERVENED and r.start >= t_warm for r in phase.results
        ),
        "samples": len(phase.samples),
        "series": [
            [round(t, 1), n, rss // MIB, gpu and gpu // MIB] for t, n, rss, gpu in phase.samples
        ],
    }
    for name, index in (("rss", 2), ("gpu", 3)):
        start, end = floor(index, t_warm, t_warm + window), floor(index, t_end - window, t_end)
        if start and end:
            out[f"{name}_mib_after_warm_up"] = start / MIB
            out[f"{name}_mib_end"] = end / MIB
            out[f"{name}_growth"] = end / start - 1
    return out


def failures(details: dict[str, Any]) -> list[str]:
    """Every check of the load that failed, in words."""
    found = [f"{details['totals'][v]} {v}" for v in VERDICTS if details["totals"][v]]
    growth = details["memory"].get("rss_growth")
    if growth is None or growth >= MAX_GROWTH:
        found.append(f"server RSS growth {growth} (limit {MAX_GROWTH:.0%})")
    gpu = details["memory"].get("gpu_growth")
    if gpu is not None and gpu >= MAX_GROWTH:
        found.append(f"GPU memory growth {gpu:.2%} (limit {MAX_GROWTH:.0%})")
    if details["held"] and any(details["held"].values()):
        found.append(f"the workers still hold {details['held']} after the load")
    if details["server_tracebacks"]:
        found.append(f"{details['server_tracebacks']} tracebacks in the server's log")
    return found


def summary(
    mixed: Phase,
    held: dict[str, int] | None,
    logged: list[str],
    compared: dict[str, Phase],
    vllm_differs: int,
) -> dict[str, Any]:
    """JSON-ready: the mixed phase per kind and in total, its memory, what the workers held
    after it, the server's tracebacks, the comparison phases, and the failed checks."""
    errors = [r.note for r in mixed.results if r.verdict == ERROR]
    disconnects = [r.note for r in mixed.results if r.kind == "disconnect" and r.verdict == OK]
    details: dict[str, Any] = {
        "kinds": {k: stats([r for r in mixed.results if r.kind == k]) for k in KINDS},
        "totals": stats(mixed.results, mixed.wall_s),
        "wall_s": mixed.wall_s,
        "disconnected": disconnects.count("disconnected"),
        "finished_before_disconnect": disconnects.count("finished"),
        "first_errors": list(dict.fromkeys(errors))[:5],
        "memory": memory_growth(mixed),
        "held": held,
        "server_tracebacks": len(logged),
        "first_tracebacks": logged[:3],
        "compare": {name: stats(p.results, p.wall_s) for name, p in compared.items()},
        "vllm_differs_from_reference": vllm_differs,
    }
    details["failures"] = failures(details)
    return details


def _s(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def markdown(details: dict[str, Any]) -> str:
    """The mixed phase per kind, its checks and memory, and the comparison with vLLM."""
    totals, memory = details["totals"], details["memory"]
    lines = [
        f"**serve_load**: {details['clients']} clients, {details['wall_s']:.0f} s, "
        f"{totals['requests']} requests ({totals['requests_per_s']:.2f}/s) over "
        f"{details['pool']} distinct ones; server flags `{' '.join(details['flags'])}`",
        "",
        "| kind | requests | p50 s | p99 s | wrong | leaked | lost | errors | max rel. error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, s in [*details["kinds"].items(), ("all", totals)]:
        lines.append(
            f"| {kind} | {s['requests']} | {_s(s['p50_s'])} | {_s(s['p99_s'])} | {s['wrong']}"
            f" | {s['leaked']} | {s['lost']} | {s['error']} | {s['max_rel_error']:.1e} |"
        )
    lines.append("")
    if "rss_growth" in memory:
        lines.append(
            f"Server RSS (API server, engine core, workers) {memory['rss_mib_after_warm_up']:.0f}"
            f" MiB after warm-up ({memory['warm_up_requests']} requests), "
            f"{memory['rss_mib_end']:.0f} MiB at the end: {memory['rss_growth']:+.2%} over "
            f"{memory['intervened_after_warm_up']} requests with steering, a capture or a trace."
        )
    if "gpu_growth" in memory:
        lines.append(f"GPU memory: {memory['gpu_growth']:+.2%}.")
    lines.append(
        f"Disconnects: {details['disconnected']} cut off, {details['finished_before_disconnect']}"
        f" answered first. Held by the workers after the load: {details['held']}. Tracebacks "
        f"in the server's log: {details['server_tracebacks']}."
    )
    lines += ["", "Checks: " + ("; ".join(details["failures"]) or "all passed"), ""]
    if details["compare"]:
        lines += [
            "| plain + streaming completions | requests | requests/s | p50 s | p99 s | wrong |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, s in details["compare"].items():
            server = "vinterp serve" if name == "vinterp" else "vllm serve"
            lines.append(
                f"| {server} | {s['requests']} | {s['requests_per_s']:.2f} | {_s(s['p50_s'])}"
                f" | {_s(s['p99_s'])} | {s['wrong'] + s['leaked'] + s['error']} |"
            )
        lines += [
            "",
            f"vllm serve's sequential answers unlike vinterp serve's reference: "
            f"{details['vllm_differs_from_reference']}.",
            "",
        ]
    return "\n".join(lines)
