"""Prefix caching on (DESIGN.md lesson 1): intervened requests still compute their prompt."""

from __future__ import annotations

import pytest
import torch
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp

pytestmark = [pytest.mark.engine("tiny_prefix_cache"), pytest.mark.usefixtures("in_process")]

PROMPT = " ".join(f"word{i}" for i in range(50))  # a few hundred tokens, several KV blocks


@pytest.fixture(scope="module")
def cached(engines, tiny_llama):
    return engines.vllm(
        tiny_llama,
        enable_prefix_caching=True,
        max_num_batched_tokens=2048,
        **TRACED_NOT_INDUCTOR,
    )


def test_capture_and_trace_see_every_prompt_token_after_a_cache_hit(cached, engines, tiny_llama):
    prompt_len = len(cached.tokenizer(PROMPT).input_ids)
    cached.generate(PROMPT, max_tokens=1)  # fills the prefix cache
    cached.generate(PROMPT, max_tokens=1)  # a plain request reuses it
    cap = vinterp.Capture("layers.1.output", positions="all_prompt")
    out = cached.generate(PROMPT, max_tokens=1, capture=cap)[0]
    assert out.captures["layers.1.output"].shape == (prompt_len, 256)
    with cached.trace(PROMPT, max_tokens=1):
        saved = cached.layers[1].output.save()
    hf = engines.hf(tiny_llama)
    with hf.trace(PROMPT, max_tokens=1):
        want = hf.layers[1].output.save()
    assert saved.shape == want.shape == (prompt_len, 256)
    assert float((saved - want).norm() / want.norm()) < 1e-4
    assert torch.allclose(out.captures["layers.1.output"], saved, rtol=1e-4, atol=1e-4)
