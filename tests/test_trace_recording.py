"""Recording a trace (symbolic values, shapes, rebinding, static errors) on the HF backend."""

from __future__ import annotations

import pytest
import torch

import vinterp

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(engines, tiny_llama):
    return engines.hf(tiny_llama)


def test_shapes_are_known_while_recording(llm) -> None:
    tokens = len(llm.tokenizer(PROMPT).input_ids)
    with llm.trace(PROMPT, max_tokens=1):
        hidden = llm.layers[0].output
        assert hidden.shape == (tokens, 256) and len(hidden) == tokens
        assert (hidden[-1] @ torch.ones(256, 3)).shape == (3,)
        assert llm.logits.shape == (1, 512)
        assert torch.softmax(llm.logits, dim=-1).topk(2).values.shape == (1, 2)


def test_saves_replace_stand_ins_in_containers(llm) -> None:
    with llm.trace(PROMPT, max_tokens=1):
        nested = {"layers": [llm.layers[i].output.save() for i in range(2)]}
        pair = (llm.embed.output.save(), 3)
        unsaved = llm.layers[1].mlp.output
    assert all(isinstance(t, torch.Tensor) for t in nested["layers"])
    assert isinstance(pair[0], torch.Tensor) and pair[1] == 3
    assert isinstance(unsaved, vinterp.api.values.Value)
    nested["layers"][0].requires_grad_()  # plain tensors, usable with autograd


def test_values_cannot_drive_python_control_flow(llm) -> None:
    with pytest.raises(TypeError, match=r"test_trace_recording.py:\d+: iteration of a traced"):
        with llm.trace(PROMPT, max_tokens=1):
            for _ in llm.layers[0].output:
                pass
    with pytest.raises(TypeError, match="float"):
        with llm.trace(PROMPT, max_tokens=1):
            float(llm.logits.max())


def test_structural_errors(llm) -> None:
    with pytest.raises(vinterp.TraceError, match="needs a prompt"):
        with llm.trace(max_tokens=1):
            pass
    with pytest.raises(vinterp.TraceError, match="must be inside"):
        with llm.trace(max_tokens=1) as tr:
            llm.layers[0].output.save()
            with tr.invoke(PROMPT):
                pass
    with pytest.raises(vinterp.TraceError, match="cannot be nested"):
        with llm.trace(PROMPT, max_tokens=2) as tr:
            for _ in tr.iter[0:2]:
                for _ in tr.iter[1]:
                    pass
    with pytest.raises(RuntimeError, match="only inside"):
        llm.layers[0].output  # noqa: B018
    with pytest.raises(TypeError, match="cannot be used inside a trace"):
        with llm.trace(PROMPT, max_tokens=1):
            torch.nn.functional.dropout(llm.layers[0].output)


def test_same_tensor_is_sent_once(llm) -> None:
    direction = torch.randn(256)
    with llm.trace(max_tokens=1) as tr:
        for prompt in (PROMPT, "Once upon a time", "Numbers 1 2 3"):
            with tr.invoke(prompt):
                llm.layers[1].output = llm.layers[1].output + direction
    assert len(tr.graph.tensors) == 1


def test_progress_bars_show_unless_turned_off(llm, capsys) -> None:
    llm.generate(["One", "Two"], max_tokens=1)
    assert "prompts" in capsys.readouterr().err
    llm.generate(["One", "Two"], max_tokens=1, use_tqdm=False)
    assert "prompts" not in capsys.readouterr().err
    for use_tqdm in (True, False):
        with llm.trace(max_tokens=1, use_tqdm=use_tqdm) as tr:
            for prompt in ("One", "Two"):
                with tr.invoke(prompt):
                    llm.layers[0].output.save()
        assert ("invokes" in capsys.readouterr().err) == use_tqdm


def test_router_sites_have_their_shapes_and_exist_on_mixtures_of_experts_only(engines, llm) -> None:
    moe = engines.hf(vinterp.models.tiny("mixtral"))  # 8 experts, 2 per token
    tokens = len(moe.tokenizer(PROMPT).input_ids)
    with moe.trace(PROMPT, max_tokens=1):
        router = moe.layers[1].mlp.router
        assert router.output.shape == (tokens, 8)
        assert router.experts.shape == (tokens, 2) and router.experts.dtype == torch.long
    with pytest.raises(vinterp.TraceError, match="layers.1.mlp.router.experts is read-only"):
        with moe.trace(PROMPT, max_tokens=1):
            moe.layers[1].mlp.router.experts[0] = 3
    with pytest.raises(vinterp.TraceError, match="this model has no router"):
        with llm.trace(PROMPT, max_tokens=1):
            llm.layers[0].mlp.router.output.save()


def test_head_sites_have_their_shapes_on_each_attention_layout(engines, llm) -> None:
    """Grouped kv heads (llama, qwen3: q/k norms), every head its own (gpt2's merged c_attn,
    gpt_neox's partial rotary): the shapes known while recording are the values' shapes."""
    tokens = len(llm.tokenizer(PROMPT).input_ids)
    for arch, kv_heads in [("llama", 2), ("qwen3", 2), ("gpt2", 4), ("gpt_neox", 4)]:
        model = engines.hf(vinterp.models.tiny(arch))
        with model.trace(PROMPT, max_tokens=1):
            attn = model.layers[1].attn
            values = {part: getattr(attn, part) for part in ("q", "k", "v", "heads")}
            known = {part: tuple(value.shape) for part, value in values.items()}
            saved = {part: value.save() for part, value in values.items()}
        assert known == {part: tuple(value.shape) for part, value in saved.items()}, arch
        assert known["q"] == known["heads"] == (tokens, 4, 64), arch
        assert known["k"] == known["v"] == (tokens, kv_heads, 64), arch
    with pytest.raises(AttributeError, match="has no site 'o'; it has .input, .output, .q, .k"):
        with llm.trace(PROMPT, max_tokens=1):
            llm.layers[0].attn.o
    opt = engines.hf(vinterp.models.tiny("opt"))  # q scaled before attention in transformers
    with pytest.raises(vinterp.TraceError, match="no per-head attention sites"):
        with opt.trace(PROMPT, max_tokens=1):
            opt.layers[0].attn.q.save()


def test_a_head_ablation_is_what_the_output_projection_reads(llm) -> None:
    with llm.trace(PROMPT, max_tokens=1):
        heads = llm.layers[1].attn.heads.save()
        llm.layers[1].attn.heads[:, 2] = 0
        output = llm.layers[1].attn.output.save()
    o_proj = llm.engine.model.layers[1].self_attn.o_proj
    ablated = heads.clone()
    ablated[:, 2] = 0
    with torch.no_grad():
        want, unablated = o_proj(ablated.flatten(1)), o_proj(heads.flatten(1))
    assert float((output - want).norm() / want.norm()) < 1e-6
    assert float((output - unablated).norm() / unablated.norm()) > 1e-2
