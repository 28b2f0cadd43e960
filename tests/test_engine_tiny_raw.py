"""`llm.raw.<path>`: engine modules in native layout, on the compiled vLLM engine and on HF."""

from __future__ import annotations

import pytest
import torch

import vinterp

pytestmark = [pytest.mark.engine("tiny"), pytest.mark.usefixtures("in_process")]

PROMPTS = ["The capital of France is", "Once upon a time there was"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def compiled(engines, tiny_llama):
    return engines.vllm(tiny_llama)


def test_raw_qkv_equals_hf_projections(compiled, engines, tiny_llama) -> None:
    hf = engines.hf(tiny_llama)
    with compiled.trace(max_tokens=1) as tr:
        qkv = []
        for prompt in PROMPTS:
            with tr.invoke(prompt):
                qkv.append(compiled.raw.model.layers[1].self_attn.qkv_proj.output.save())
    with hf.trace(PROMPTS[1], max_tokens=1):
        q = hf.raw.model.layers[1].self_attn.q_proj.output.save()
        attn_in = hf.layers[1].attn.input.save()
    tokens = [len(compiled.tokenizer(p).input_ids) for p in PROMPTS]
    assert isinstance(qkv[1], list)  # native layout: (output, bias) of a parallel linear
    assert [t[0].shape[0] for t in qkv] == tokens  # each invoke gets its own token rows
    assert q.shape == (1, tokens[1], 256)
    assert rel_err(qkv[1][0][:, :256], q[0]) < 1e-4
    weight = hf.engine.model.layers[1].self_attn.q_proj.weight.detach()
    assert rel_err(q[0], attn_in @ weight.T) < 1e-4


def test_raw_errors_are_named(compiled) -> None:
    with pytest.raises(vinterp.TraceError, match="no module 'model.layers.1.nope'"):
        with compiled.trace(PROMPTS[0], max_tokens=1):
            compiled.raw.model.layers[1].nope.output.save()
    with pytest.raises(vinterp.TraceError, match="can only be saved"):
        with compiled.trace(PROMPTS[0], max_tokens=1):
            (compiled.raw.model.layers[1].mlp.output * 2).save()
    with pytest.raises(AttributeError, match="read-only"):
        with compiled.trace(PROMPTS[0], max_tokens=1):
            compiled.raw.model.layers[1].mlp.output = 0
    with compiled.trace(PROMPTS[0], max_tokens=1):
        ok = compiled.layers[1].output.save()
    assert ok.shape == (len(compiled.tokenizer(PROMPTS[0]).input_ids), 256)
