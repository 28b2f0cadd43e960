"""`vinterp bench`'s vinterp rows on a live engine: every workload runs and is timed (the
timings themselves are the bench's business, not a test's)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from vinterp.bench import trace_invokes
from vinterp.bench import workloads as engine_workloads

pytestmark = pytest.mark.engine("bundled")


def test_every_vinterp_row_runs_on_one_engine(engines) -> None:
    """The bench's vinterp engine (as `one_worker_rows` builds it) on the live shared engine."""
    llm = engines.vllm()
    keys = {*engine_workloads.VINTERP_KEYS, trace_invokes.KEY}
    elsewhere = ("capture_router", engine_workloads.SAE_CAPTURE, engine_workloads.SAE_CLAMP)
    dense = [key for key in engine_workloads.VINTERP_KEYS if key not in elsewhere]
    assert [key for key, _, _ in engine_workloads.vinterp_workloads(llm)] == dense
    texts = ["The capital of France is", "One, two,"]
    engine = engine_workloads.vinterp_bench_engine(
        lambda: nullcontext(llm), texts, 2, keys, 2, 1, " [x]"
    )
    workloads, timings, traced = engine_workloads.time_engines([engine], 1, together=False)
    assert [w.key for w in workloads.values()] == dense
    assert [r.key for r in traced] == [trace_invokes.KEY] and traced[0].name.endswith(" [x]")
    assert all(timings[name].median > 0 for name in workloads) and traced[0].measured.median > 0
    assert next(iter(workloads)).endswith("(2x2) [x]")
