"""A compiled engine's uncompiled steps (traces, captures outside the graphs) run on the kernels
of an `enforce_eager=True` engine, so they give its values exactly, not the compiler's native
ops' (engine/eager_kernels.py). On the CPU the two differ by up to ~3e-4 in the tiny llama's
saves without the switch (its rotary and SiluAndMul kernels against their native forms). On an
H200 in fp32 this two-prompt step still parts by ~1e-4 relative, at the first matmul on equal
inputs (cuBLAS's algorithm, not a kernel vinterp picks; in bf16 the bundled model's saves and
captures equal the eager engine's exactly: docs/GPU.md): this equality is
the CPU engine's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import vinterp

pytestmark = [pytest.mark.engine("tiny", releases=True), pytest.mark.usefixtures("in_process")]

PROMPTS = ["The capital of France is", "Once upon a time there was a"]
LAST_PROMPT = vinterp.Capture("layers.*.output", positions="last_prompt")


def uncompiled_values(llm: vinterp.LLM) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Trace saves (two invokes in one step) and last_prompt captures: both run uncompiled."""
    with llm.trace(max_tokens=1) as tr:
        with tr.invoke(PROMPTS[0]):
            first = llm.layers[1].output.save()
            logits = llm.logits.save()
        with tr.invoke(PROMPTS[1]):
            second = llm.layers[0].mlp.output.save()
    captured = llm.generate(PROMPTS, max_tokens=2, capture=LAST_PROMPT)
    return [first, logits, second], [o.captures for o in captured]


def test_uncompiled_steps_equal_the_eager_engine_exactly(engines, tiny_llama) -> None:
    compiled = engines.vllm(tiny_llama)
    assert compiled.engine.llm_engine.vllm_config.compilation_config.mode.value != 0
    layers = AutoConfig.from_pretrained(tiny_llama).num_hidden_layers
    saves, captures = uncompiled_values(compiled)
    eager_saves, eager_captures = uncompiled_values(engines.vllm(tiny_llama, enforce_eager=True))
    for got, want in zip(saves, eager_saves):
        assert got.shape == want.shape
        assert torch.equal(got, want), float((got - want).abs().max())
    for got, want in zip(captures, eager_captures):
        assert got.keys() == want.keys() and len(got) == layers
        for site in got:
            assert torch.equal(got[site], want[site]), site
