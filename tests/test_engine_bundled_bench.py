"""`vinterp bench`'s vinterp rows on a live engine: every workload runs and is timed (the
timings themselves are the bench's business, not a test's)."""

from __future__ import annotations

import pytest

from vinterp.bench import fastpath, trace_invokes
from vinterp.bench.harness import Timing

pytestmark = pytest.mark.engine("bundled")


def test_every_vinterp_row_runs_on_one_engine(engines) -> None:
    llm = engines.vllm()
    keys = [*fastpath.VINTERP_KEYS, trace_invokes.KEY]
    assert [key for key, _, _ in fastpath.vinterp_workloads(llm)] == list(fastpath.VINTERP_KEYS)
    baseline = Timing((1.0, 1.0))
    rows = fastpath.vinterp_rows(
        llm, ["The capital of France is", "One, two,"], 2, 1, baseline, set(keys), 2
    )
    assert [r.key for r in rows] == keys and len(keys) == 6
    assert all(r.measured.median > 0 for r in rows)
    assert all(r.baseline is baseline for r in rows[:-1])  # the trace row times its own
    assert rows[0].name.endswith("(2x2)") and rows[0].tokens == 4
