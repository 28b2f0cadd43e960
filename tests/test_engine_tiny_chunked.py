"""The scheduler splitting long prompts over steps (chunked prefill): the fast path stays
right, tracing refuses clearly."""

from __future__ import annotations

import pytest
import torch

import vinterp

LONG = " ".join(["The capital of France is Paris and the capital of Italy is Rome."] * 6)
SHORT = "Once upon a time"


@pytest.fixture(scope="module")
def chunked(engines, tiny_llama):
    llm = engines.vllm(tiny_llama, max_num_batched_tokens=32, max_num_seqs=4)
    assert len(llm.tokenizer(LONG).input_ids) > 64  # spans at least three steps
    return llm


def test_capture_and_steering_across_chunks_equal_hf(chunked, engines, tiny_llama) -> None:
    hf = engines.hf(tiny_llama)
    v = torch.randn(256, generator=torch.Generator().manual_seed(2))
    spec = vinterp.Steering({"layers.1.output": v}, scale=2.0)
    cap = vinterp.Capture(["layers.*.output"], positions="all")
    prompts = [LONG, SHORT, LONG[:100]]
    got = chunked.generate(prompts, max_tokens=4, steering=spec, capture=cap)
    want = hf.generate(prompts, max_tokens=4, steering=spec, capture=cap)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for site, value in w.captures.items():
            assert g.captures[site].shape == value.shape
            assert float((g.captures[site] - value).norm() / value.norm()) < 1e-4


def test_trace_on_a_split_prompt_fails_clearly(chunked) -> None:
    with pytest.raises(vinterp.InterventionError, match="chunked prefill"):
        with chunked.trace(LONG, max_tokens=1):
            chunked.layers[1].output.save()
    with chunked.trace(SHORT, max_tokens=2) as tr:
        ok = chunked.layers[1].output.save()
    assert ok.shape[0] == len(chunked.tokenizer(SHORT).input_ids)
    assert len(tr.outputs[0].token_ids) == 2
