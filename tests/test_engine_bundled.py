"""The bundled model on vLLM equals the transformers reference, token for token."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine("bundled")

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def add(a, b):",
]


@pytest.fixture(scope="module")
def vllm_outputs(engines):
    return engines.vllm().generate(PROMPTS, max_tokens=8, temperature=0.0, ignore_eos=True)


def test_france_is_paris(vllm_outputs) -> None:
    assert vllm_outputs[0].text.startswith(" Paris")


def test_vllm_greedy_equals_hf_greedy(engines, vllm_outputs) -> None:
    reference = engines.hf().generate(PROMPTS, max_tokens=8, temperature=0.0, ignore_eos=True)
    for got, want in zip(vllm_outputs, reference):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert len(got.token_ids) == 8
        assert got.token_ids == want.token_ids
        assert got.text == want.text


def test_token_id_prompts_and_defaults(engines, vllm_outputs) -> None:
    llm = engines.vllm()
    ids = llm.tokenizer(PROMPTS[0]).input_ids
    (out,) = llm.generate(ids, max_tokens=8, ignore_eos=True)  # greedy by default
    assert out.token_ids == vllm_outputs[0].token_ids


def test_bad_prompt_type_is_named(engines) -> None:
    with pytest.raises(TypeError, match="a prompt is a string, a list of token ids"):
        engines.vllm().generate([3.5])


def test_the_demo_shows_each_tool_working(engines) -> None:
    """`make demo`'s run on the shared engine: the patch moves Italy's answer to " Paris" where
    the answer lives and not elsewhere, and both steering signs change the text."""
    from vinterp import demo

    shown = demo.run(engines.vllm())
    assert shown["greedy"][0].startswith(" Paris")
    patched = {label.split("->")[0].strip(): token for label, token in shown["patched"].items()}
    tokens = list(patched.values())
    assert tokens[:2] == [" Paris", " Rome"]  # clean, corrupted
    assert tokens[2:] == [" Paris", " Rome", " Paris"]  # country token at 15, last at 15, 25
    steered = shown["steered"]
    assert len(set(steered.values())) == 3  # -1, unsteered, +1 all differ
