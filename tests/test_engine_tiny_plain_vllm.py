"""An unsteered vinterp engine computes what plain vLLM computes: its site ops (steering by
zero rows, capture buffers unread) change no value. Float32, compiled, the tiny llama, whose
random weights leave greedy tokens at near-ties, so a change of one rounding shows within 32
tokens of some prompt (in bf16 the norm-matched term's reduction moves rounding: DESIGN.md,
"Steering and capture as data")."""

from __future__ import annotations

from typing import Any

import pytest
from sample_prompts import PROMPTS

from vinterp.bench.workloads import plain_vllm, vinterp_engine

pytestmark = pytest.mark.engine("tiny_plain_vllm")

TOKENS = 32


def test_unsteered_tokens_equal_plain_vllms(engines: Any, tiny_llama: Any) -> None:
    import vllm

    engines.release()  # this test starts its own engines, one at a time
    params = vllm.SamplingParams(temperature=0.0, max_tokens=TOKENS)
    with plain_vllm(tiny_llama, "float32", max_model_len=512) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    with vinterp_engine(tiny_llama, "float32", max_model_len=512) as llm:
        got = [list(o.token_ids) for o in llm.generate(PROMPTS, max_tokens=TOKENS)]
        steered = llm.generate(PROMPTS[:1], max_tokens=TOKENS, steering=steering(llm))
    assert got == want
    assert list(steered[0].token_ids) != want[0]  # the same engine does steer


def steering(llm: Any) -> Any:
    import torch

    import vinterp

    hidden = int(llm.config.hidden_size)
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0)) * 50
    return vinterp.Steering({"layers.1.output": vector})
