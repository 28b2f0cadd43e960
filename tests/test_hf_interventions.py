"""The HF backend's steering and capture (the reference the vLLM fast path is checked
against) equal the same interventions written by hand as trace writes and saves."""

from __future__ import annotations

import pytest
import torch

import vinterp

PROMPT = "The capital of France is"
STEPS = 5
SCALE = 30.0


@pytest.fixture(scope="module")
def llm(engines, tiny_llama) -> vinterp.LLM:
    return engines.hf(tiny_llama)


@pytest.fixture(scope="module")
def direction(llm) -> torch.Tensor:
    return torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(3))


def _by_hand(llm: vinterp.LLM, vector: torch.Tensor, phase: str, norm_match: bool) -> list[int]:
    """`layers.1.output += SCALE * v` (norm_match: SCALE * |x| * v/|v|) at the tokens of
    `phase`, written as trace writes."""

    def write() -> None:
        value = llm.layers[1].output
        add = SCALE * vector
        if norm_match:
            add = value.norm(dim=-1, keepdim=True) * (SCALE * vector / vector.norm())
        llm.layers[1].output = value + add

    with llm.trace(PROMPT, max_tokens=STEPS, use_tqdm=False) as tr:
        steps = {"all": tr.iter[:], "prefill": tr.iter[0], "decode": tr.iter[1:]}[phase]
        for _ in steps:
            write()
    return tr.outputs[0].token_ids


@pytest.mark.parametrize("phase", ["all", "prefill", "decode"])
@pytest.mark.parametrize("norm_match", [False, True])
def test_steering_equals_trace_writes(llm, direction, phase, norm_match) -> None:
    spec = vinterp.Steering(
        {"layers.1.output": direction}, scale=SCALE, phase=phase, norm_match=norm_match
    )
    plain = llm.generate(PROMPT, max_tokens=STEPS, use_tqdm=False)[0].token_ids
    steered = llm.generate(PROMPT, max_tokens=STEPS, steering=spec, use_tqdm=False)[0]
    assert steered.token_ids == _by_hand(llm, direction, phase, norm_match)
    assert steered.token_ids != plain


def test_positions_steer_only_those_prompt_rows(llm, direction) -> None:
    spec = vinterp.Steering({"layers.1.output": direction}, scale=SCALE, positions=[0, 2])
    cap = vinterp.Capture("layers.1.output", positions="all_prompt")
    got = llm.generate(PROMPT, max_tokens=1, steering=spec, capture=cap, use_tqdm=False)[0]
    plain = llm.generate(PROMPT, max_tokens=1, capture=cap, use_tqdm=False)[0]
    diff = got.captures["layers.1.output"] - plain.captures["layers.1.output"]
    assert torch.allclose(diff[[0, 2]], SCALE * direction.expand(2, -1), atol=1e-5)
    assert torch.equal(diff[1], torch.zeros_like(diff[1]))
    assert torch.equal(diff[3:], torch.zeros_like(diff[3:]))


def test_capture_equals_trace_saves_and_sees_steering(llm, direction) -> None:
    spec = vinterp.Steering({"layers.2.output": direction}, scale=2.0)
    cap = vinterp.Capture(["layers.2.output", "embed.output"], positions="all")
    out = llm.generate(PROMPT, max_tokens=3, steering=spec, capture=cap, use_tqdm=False)[0]
    with llm.trace(PROMPT, max_tokens=3, use_tqdm=False) as tr:
        for _ in tr.iter[:]:  # a save in an iter body holds one value per step
            llm.layers[2].output = llm.layers[2].output + 2.0 * direction
            saves = {
                "layers.2.output": llm.layers[2].output.save(),
                "embed.output": llm.embed.output.save(),
            }
    assert out.token_ids == tr.outputs[0].token_ids
    for site, per_step in saves.items():
        # every token the model read: the prompt, then each generated token but the last
        want = torch.cat([v.reshape(-1, direction.numel()) for v in per_step])
        assert torch.allclose(out.captures[site], want, atol=1e-6), site


def test_global_and_named_steering_reach_generate_and_traces(llm, direction) -> None:
    spec = vinterp.Steering({"layers.1.output": direction}, scale=SCALE)
    by_hand = _by_hand(llm, direction, "all", False)
    llm.steering.register("push", spec)
    try:
        named = llm.generate(PROMPT, max_tokens=STEPS, steering="push", use_tqdm=False)[0]
        assert named.token_ids == by_hand
        llm.steering.set(spec)
        assert llm.generate(PROMPT, max_tokens=STEPS, use_tqdm=False)[0].token_ids == by_hand
        with llm.trace(PROMPT, max_tokens=STEPS, use_tqdm=False) as tr:
            pass
        assert tr.outputs[0].token_ids == by_hand
    finally:
        llm.steering.clear()
        llm.steering.unregister("push")
    assert llm.generate(PROMPT, max_tokens=STEPS, use_tqdm=False)[0].token_ids != by_hand


def test_pattern_capture_is_the_traced_rows_of_its_heads(llm) -> None:
    """An attention pattern captured at the last prompt token for chosen heads is that row of
    the pattern a trace reads; specs that cannot be met say why."""
    cap = vinterp.Capture("layers.1.attn.pattern", heads=[2, 0])
    assert vinterp.Capture.from_json(cap.to_json()) == cap
    out = llm.generate(PROMPT, max_tokens=2, capture=cap)[0]
    with llm.trace(PROMPT, max_tokens=1, use_tqdm=False):
        last = llm.layers[1].attn.pattern[:, -1].save()
    captured = out.captures["layers.1.attn.pattern"]
    assert captured.shape == (1, 2, len(out.prompt_token_ids))
    assert torch.allclose(captured, last[[2, 0]][None], atol=1e-6)
    with pytest.raises(ValueError, match="positions='last_prompt' only"):
        vinterp.Capture("layers.*.attn.pattern", positions="all")
    with pytest.raises(ValueError, match="heads: picks the heads of attn.pattern sites"):
        vinterp.Capture("layers.1.output", heads=[0])
    with pytest.raises(ValueError, match="distinct head indices"):
        vinterp.Capture("layers.1.attn.pattern", heads=[1, 1])
    heads = llm.config.num_attention_heads
    too_far = vinterp.Capture("layers.1.attn.pattern", heads=[heads])
    with pytest.raises(ValueError, match=f"this model has {heads} heads"):
        llm.generate(PROMPT, max_tokens=1, capture=too_far)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_hf_backend_patterns_over_a_sliding_window_cache(engines, arch) -> None:
    """On the HF backend a decode step's keys come from transformers' cache, which keeps only
    the window on sliding layers: the row still spans every position, equal to eager attention."""
    from eager_attention import eager_attentions

    path = vinterp.models.tiny(arch, sliding_window=8)
    hf = engines.hf(path)
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen"
    with hf.trace(prompt, max_tokens=4, ignore_eos=True, use_tqdm=False) as tr:
        full = hf.layers[0].attn.pattern.save()
        for _ in tr.iter[1:4]:
            rows = hf.layers[0].attn.pattern.save()
    ids, tokens = list(tr.outputs[0].prompt_token_ids), tr.outputs[0].token_ids
    want = eager_attentions(path, ids + tokens[:3])[0]
    n = len(ids)
    assert n > 8 and torch.allclose(full, want[:, :n, :n], atol=1e-5)
    for k, row in enumerate(rows, start=1):
        assert row.shape == (want.shape[0], 1, n + k)
        assert torch.allclose(row, want[:, n + k - 1 : n + k, : n + k], atol=1e-5)
