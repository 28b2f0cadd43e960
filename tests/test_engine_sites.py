"""Tracing on the bundled model: vLLM equals the transformers reference, site by site."""

from __future__ import annotations

import pytest
import torch

import vinterp

pytestmark = pytest.mark.engine("bundled")

PROMPT = "The capital of France is"
DETAIL_LAYERS = (0, 14, 29)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def save_every_site(llm: vinterp.LLM) -> dict[str, torch.Tensor]:
    saves: dict[str, torch.Tensor] = {}
    with llm.trace(PROMPT, max_tokens=1):
        saves["embed.output"] = llm.embed.output.save()
        for i, layer in enumerate(llm.layers):
            saves[f"layers.{i}.input"] = layer.input.save()
            saves[f"layers.{i}.output"] = layer.output.save()
        for i in DETAIL_LAYERS:
            for part in ("attn", "mlp"):
                point = getattr(llm.layers[i], part)
                saves[f"layers.{i}.{part}.input"] = point.input.save()
                saves[f"layers.{i}.{part}.output"] = point.output.save()
            for head_part in ("q", "k", "v", "heads"):
                saves[f"layers.{i}.attn.{head_part}"] = getattr(
                    llm.layers[i].attn, head_part
                ).save()
        saves["final_norm.output"] = llm.final_norm.output.save()
        saves["logits"] = llm.logits.save()
    return saves


@pytest.fixture(scope="module")
def vllm_llm(engines):
    return engines.vllm()


@pytest.fixture(scope="module")
def hf_llm(engines):
    return engines.hf()


def test_engine_is_compiled_not_eager(vllm_llm) -> None:
    config = vllm_llm.engine.llm_engine.vllm_config
    assert not config.model_config.enforce_eager
    assert config.compilation_config.mode.value != 0  # CompilationMode.NONE


def test_every_site_equals_hf(vllm_llm, hf_llm) -> None:
    got, want = save_every_site(vllm_llm), save_every_site(hf_llm)
    assert len(got) == 1 + 2 * 30 + 8 * len(DETAIL_LAYERS) + 2
    tokens = len(vllm_llm.tokenizer(PROMPT).input_ids)
    for site, value in want.items():
        assert got[site].shape == value.shape, site
        assert rel_err(got[site], value) < 1e-4, site
    assert got["layers.3.output"].shape == (tokens, 576)
    # 9 query heads share 3 kv heads of 64
    assert got["layers.14.attn.q"].shape == got["layers.14.attn.heads"].shape == (tokens, 9, 64)
    assert got["layers.14.attn.k"].shape == got["layers.14.attn.v"].shape == (tokens, 3, 64)
    assert got["logits"].shape == (1, 49152)
    assert torch.equal(got["layers.4.input"], got["layers.3.output"])


def test_logit_lens_and_final_norm_function(vllm_llm, hf_llm) -> None:
    def lens(llm):
        with llm.trace(PROMPT, max_tokens=1):
            last = llm.layers[-1].output[-1]
            lensed = llm.unembed(last).save()
            batched = llm.unembed(llm.layers[-1].output[None]).save()  # (1, T, V)
            normed = llm.final_norm(llm.layers[-1].output).save()
            direct = llm.lm_head(llm.final_norm.output).save()
            logits = llm.logits.save()
        assert rel_err(batched[0, -1], logits[0]) < 1e-4
        return lensed, normed, direct, logits

    for llm in (vllm_llm, hf_llm):
        lensed, normed, direct, logits = lens(llm)
        assert lensed.shape == logits[0].shape
        assert rel_err(lensed, logits[0]) < 1e-4
        assert rel_err(direct[-1], logits[0]) < 1e-4
        assert normed.shape == (len(llm.tokenizer(PROMPT).input_ids), 576)
    assert rel_err(lens(vllm_llm)[0], lens(hf_llm)[0]) < 1e-4


def test_saves_inside_lists_and_dicts(vllm_llm) -> None:
    with vllm_llm.trace(PROMPT, max_tokens=1):
        per_layer = [vllm_llm.layers[i].output[-1].save() for i in (1, 2)]
        by_name = {"mlp": vllm_llm.layers[1].mlp.output.save()}
    assert all(isinstance(t, torch.Tensor) and t.shape == (576,) for t in per_layer)
    assert isinstance(by_name["mlp"], torch.Tensor) and by_name["mlp"].device.type == "cpu"


def test_outputs_match_generate(vllm_llm) -> None:
    with vllm_llm.trace(PROMPT, max_tokens=4) as tr:
        vllm_llm.layers[0].output.save()
    plain = vllm_llm.generate(PROMPT, max_tokens=4)[0]
    assert tr.outputs[0].token_ids == plain.token_ids and tr.outputs[0].text == plain.text


def test_raw_sites_run_on_the_compiled_engine_in_uncompiled_steps_only(vllm_llm) -> None:
    before = vllm_llm.step_stats()
    with vllm_llm.trace(PROMPT, max_tokens=4):
        raw = vllm_llm.raw.model.layers[0].mlp.output.save()
        site = vllm_llm.layers[0].mlp.output.save()
    after = vllm_llm.step_stats()
    assert torch.equal(raw, site)  # the MLP module's output is the mlp.output site
    assert after["steps"] - before["steps"] >= 4  # prompt + 3 decode steps (+ scheduler overrun)
    assert after["uncompiled_steps"] - before["uncompiled_steps"] == 1  # only step 0 has work
