"""Tensor and pipeline parallelism on the CPU give the single-worker greedy tokens."""

from __future__ import annotations

import pytest

PROMPTS = ["The capital of France is", "Once upon a time", "Numbers 1 2 3"]
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def single_worker_tokens(engines, tiny_llama):
    outs = engines.vllm(tiny_llama).generate(PROMPTS, **SAMPLING)
    return [o.token_ids for o in outs]


def test_single_worker_equals_hf(engines, tiny_llama, single_worker_tokens) -> None:
    reference = engines.hf(tiny_llama).generate(PROMPTS, **SAMPLING)
    assert single_worker_tokens == [o.token_ids for o in reference]
    assert all(len(t) == 8 for t in single_worker_tokens)


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_parallel_equals_single_worker(engines, tiny_llama, single_worker_tokens, layout) -> None:
    outs = engines.vllm(tiny_llama, **layout).generate(PROMPTS, **SAMPLING)
    assert [o.token_ids for o in outs] == single_worker_tokens
