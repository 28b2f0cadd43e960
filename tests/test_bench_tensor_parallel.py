"""`vinterp bench`'s TP=2 rows: vinterp and plain vLLM at TP=2, each on its own engine."""

from __future__ import annotations

import pytest

import vinterp
from vinterp.bench import workloads as engine_workloads
from vinterp.bench.harness import target


@pytest.mark.engine("bench_tensor_parallel")
@pytest.mark.usefixtures("in_process")
def test_tensor_parallel_rows_time_vinterp_and_plain_vllm_at_tp2(engines, tiny_llama) -> None:
    engines.release()  # the rows start their own engines, one at a time
    rows = engine_workloads.tensor_parallel_rows(
        tiny_llama,
        ["The capital of France is", "One, two,"],
        2,
        1,
        "float32",
        set(engine_workloads.TENSOR_PARALLEL),
        enforce_eager=True,  # the rows' plumbing is under test, not two more compilations
    )
    assert [r.key for r in rows] == list(engine_workloads.TENSOR_PARALLEL)
    assert all(r.name.endswith("(2x2) TP=2") for r in rows)
    assert all(r.target == target(r.key) < float("inf") for r in rows)
    assert all(r.measured.median > 0 and r.baseline.median > 0 for r in rows)
    assert len({id(r.baseline) for r in rows}) == 1  # one plain vLLM TP=2 time for all


def test_tensor_parallel_rows_are_skipped_with_the_reason_for_odd_heads(capsys) -> None:
    """The bundled model's 9 heads cannot split over two workers: `vinterp bench` says so
    instead of stopping at vLLM's config error (no engine starts)."""
    rows = engine_workloads.run(
        vinterp.models.bundled(), workloads=list(engine_workloads.TENSOR_PARALLEL)
    )
    assert rows == []
    assert "TP=2 rows: skipped (the model's 9 attention heads" in capsys.readouterr().out
