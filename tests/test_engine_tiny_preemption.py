"""The scheduler running out of KV cache, preempting requests and recomputing them later: the
steering and capture must give the same tokens and captures as if nothing had been preempted."""

from __future__ import annotations

import pytest
import torch

import vinterp

pytestmark = pytest.mark.engine("tiny_preemption")

BLOCK = 32
BLOCKS = 5  # one is vLLM's null block: 128 cached tokens, too few for four ~52-token requests
PROMPTS = [
    "The capital of France is Paris and the capital of",
    "Once upon a time there was a small village near the",
    "In the beginning the universe was created and this has",
    "She opened the door slowly and looked into the dark room",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tight(engines, tiny_llama):
    return engines.vllm(
        tiny_llama,
        block_size=BLOCK,
        num_gpu_blocks_override=BLOCKS,
        max_model_len=BLOCK * (BLOCKS - 1),
        max_num_seqs=len(PROMPTS),
        disable_log_stats=False,  # keeps the scheduler's preemption counter
    )


def _preemptions(llm: vinterp.LLM) -> float:
    return sum(m.value for m in llm.engine.get_metrics() if m.name == "vllm:num_preemptions")


def test_preempted_requests_keep_steering_and_captures(tight, engines, tiny_llama) -> None:
    hf = engines.hf(tiny_llama)
    v = torch.randn(256, generator=torch.Generator().manual_seed(3))
    spec = vinterp.Steering({"layers.2.output": v}, scale=4.0, phase="decode")
    cap = vinterp.Capture(["layers.1.output"], positions="all")
    before = _preemptions(tight)
    run = dict(max_tokens=MAX_TOKENS, ignore_eos=True, steering=spec, capture=cap)
    got = tight.generate(PROMPTS, **run)
    assert _preemptions(tight) > before, "the test needs the scheduler to preempt"
    want = hf.generate(PROMPTS, **run)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        value = w.captures["layers.1.output"]
        assert g.captures["layers.1.output"].shape == value.shape
        assert float((g.captures["layers.1.output"] - value).norm() / value.norm()) < 1e-4
