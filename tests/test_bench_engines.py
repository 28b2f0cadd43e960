"""How `vinterp bench` times engines: one at a time (the default), or all alive at once with
every workload in each round (`--engines together`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from vinterp.bench import workloads as engine_workloads
from vinterp.bench.harness import REFERENCE, target


def recording_engines(events: list[tuple[str, str]]) -> list[engine_workloads.Engine]:
    """Engine `a` with one workload and `b` with two; starts, stops and runs go to `events`."""

    @contextmanager
    def start(name: str) -> Iterator[str]:
        events.append(("start", name))
        yield name
        events.append(("stop", name))

    def workloads(name: str, count: int) -> list[engine_workloads.Workload]:
        return [
            engine_workloads.Workload(
                "k", f"{name}{i}", lambda w=f"{name}{i}": events.append(("run", w))
            )
            for i in range(count)
        ]

    return [
        engine_workloads.Engine(lambda: start("a"), lambda name: workloads(name, 1)),
        engine_workloads.Engine(lambda: start("b"), lambda name: workloads(name, 2)),
    ]


def test_together_keeps_every_engine_alive_and_interleaves_them_in_each_round() -> None:
    events: list[tuple[str, str]] = []
    workloads, timings, _ = engine_workloads.time_engines(
        recording_engines(events), 2, together=True
    )
    assert events[:2] == [("start", "a"), ("start", "b")]
    assert events[-2:] == [("stop", "b"), ("stop", "a")]
    runs = [name for kind, name in events if kind == "run"]
    assert runs == ["a0", "b0", "b1"] * 3  # a warm-up round, then two timed rounds
    assert list(workloads) == ["a0", "b0", "b1"]
    assert all(len(timings[name].times) == 2 for name in workloads)


def test_apart_runs_one_engine_at_a_time() -> None:
    events: list[tuple[str, str]] = []
    _, timings, _ = engine_workloads.time_engines(recording_engines(events), 2, together=False)
    assert events == [
        ("start", "a"),
        *[("run", "a0")] * 3,
        ("stop", "a"),
        ("start", "b"),
        *[("run", "b0"), ("run", "b1")] * 3,
        ("stop", "b"),
    ]
    assert all(len(t.times) == 2 for t in timings.values())


@pytest.mark.engine("bench_engines")
def test_engines_alive_together_time_vinterp_against_plain_vllm(engines, tiny_llama) -> None:
    """Real engines (tiny llama, eager: their plumbing is under test, not two compilations):
    plain vLLM and vinterp alive at once give rows against plain vLLM's times (the TP rows'
    test runs real engines one at a time)."""
    engines.release()  # these rows start their own engines
    rows = engine_workloads.one_worker_rows(
        tiny_llama,
        ["The capital of France is", "One, two,"],
        2,
        2,
        "float32",
        {"idle", "steer", "capture_pattern", "capture_router", engine_workloads.trace_invokes.KEY},
        2,
        (False,),
        True,
        enforce_eager=True,
    )
    # a dense model has no router row
    keys = ["idle", "steer", "capture_pattern", engine_workloads.trace_invokes.KEY]
    assert [r.key for r in rows] == keys
    assert rows[0].baseline is rows[1].baseline and len(rows[0].baseline.times) == 2
    assert rows[0].name == "vinterp engine, no intervention (2x2)" and rows[0].tokens == 4
    assert rows[1].target == target("steer") < REFERENCE
    assert all(r.measured.median > 0 and r.baseline.median > 0 for r in rows)
