"""Tensor and pipeline parallelism on the CPU give the single-worker greedy tokens."""

from __future__ import annotations

import pytest
import torch

import vinterp

PROMPTS = ["The capital of France is", "Once upon a time", "Numbers 1 2 3"]
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


STEERING = vinterp.Steering(
    {"layers.1.output": torch.randn(256, generator=torch.Generator().manual_seed(3))}, scale=3.0
)
CAPTURE = vinterp.Capture(["layers.*.output", "layers.2.mlp.output"], positions="all")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def fast_path_results(llm):
    outs = llm.generate(PROMPTS, steering=STEERING, capture=CAPTURE, **SAMPLING)
    with llm.trace(PROMPTS[0], max_tokens=2):
        first, last = llm.layers[0].output.save(), llm.layers[3].output.save()
    return [o.token_ids for o in outs], [o.captures for o in outs], (first, last)


@pytest.fixture(scope="module")
def single_worker_tokens(engines, tiny_llama):
    outs = engines.vllm(tiny_llama).generate(PROMPTS, **SAMPLING)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def single_worker_fast(engines, tiny_llama, single_worker_tokens):
    return fast_path_results(engines.vllm(tiny_llama))


def test_single_worker_equals_hf(engines, tiny_llama, single_worker_tokens) -> None:
    reference = engines.hf(tiny_llama).generate(PROMPTS, **SAMPLING)
    assert single_worker_tokens == [o.token_ids for o in reference]
    assert all(len(t) == 8 for t in single_worker_tokens)


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_parallel_equals_single_worker(
    engines, tiny_llama, single_worker_tokens, single_worker_fast, layout
) -> None:
    llm = engines.vllm(tiny_llama, **layout)
    outs = llm.generate(PROMPTS, **SAMPLING)
    assert [o.token_ids for o in outs] == single_worker_tokens
    tokens, captures, saves = fast_path_results(llm)
    want_tokens, want_captures, want_saves = single_worker_fast
    assert tokens == want_tokens and tokens != single_worker_tokens  # steered, on every stage
    for got, want in zip(captures, want_captures):
        assert list(got) == list(want)  # every stage's sites, merged
        for site in want:
            assert rel_err(got[site], want[site]) < 1e-5, site
    for got, want in zip(saves, want_saves):
        assert rel_err(got, want) < 1e-5


def test_pipeline_cross_stage_write_fails_clearly_and_engine_serves_on(
    engines, tiny_llama, single_worker_fast
) -> None:
    llm = engines.vllm(tiny_llama, pipeline_parallel_size=2)
    with pytest.raises(vinterp.InterventionError, match="read on another stage"):
        with llm.trace(PROMPTS[0], max_tokens=1):
            early = llm.layers[0].output[-1].save()
            llm.layers[3].output[-1] = early  # layer 3 runs on the second stage
    tokens, _, saves = fast_path_results(llm)
    assert tokens == single_worker_fast[0]
    assert rel_err(saves[0], single_worker_fast[2][0]) < 1e-5
