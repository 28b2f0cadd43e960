"""`vinterp bench`'s command line reaches every engine it starts, without starting one: vLLM's
memory options go to the engine rows' keyword arguments."""

from __future__ import annotations

import pytest

from vinterp import cli, models
from vinterp.bench import workloads


class Started(Exception):
    """Raised where the bench would start its first engine."""


def test_vllms_memory_options_reach_every_engine(monkeypatch) -> None:
    seen: dict = {}

    def run(model, **kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setattr(workloads, "run", run)
    argv = ["bench", "--model", str(models.tiny("llama")), "--peers", "none", "--workloads"]
    with pytest.raises(Started):
        cli.main([*argv, "idle", "--kv-cache-memory-bytes", "1000000"])
    assert seen["kv_cache_memory_bytes"] == 1_000_000 and "gpu_memory_utilization" not in seen
    seen.clear()
    with pytest.raises(Started):
        cli.main([*argv, "idle", "--gpu-memory-utilization", "0.3", "--max-model-len", "512"])
    assert seen["gpu_memory_utilization"] == 0.3 and seen["max_model_len"] == 512
    assert "kv_cache_memory_bytes" not in seen
