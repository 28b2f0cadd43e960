"""Attention patterns and mixture-of-experts routers on one GPU, on vLLM's defaults (compiled,
CUDA graphs) in bf16 (how to run: tests/gpu/conftest.py; `-k attention`).

The pattern is recomputed from q and the kept keys with the eager reference math, so it must
not depend on the attention backend: each model runs on FlashAttention and on Triton
attention, each equal to transformers' eager attention (bf16, on the GPU) over the prompt and
the generated tokens, and layer 0 (whose q and k follow from the tokens alone) alike on both.
Mixture-of-experts router logits and chosen experts equal transformers' router (bf16, on the
GPU), and router logits captured in CUDA graphs (`capture_in_graph`) equal the trace's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vinterp

pytestmark = [
    pytest.mark.engine("gpu_attention"),
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("in_process"),
]

PATTERN_MODELS = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen3": {},
    "gemma2": {"sliding_window": 8, "attn_logit_softcapping": 30.0},
    "gemma3_text": {"sliding_window": 8},
}
BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ROUTERS = "layers.*.mlp.router.output"
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen"
DTYPE = torch.bfloat16
ENGINE = {"dtype": "bfloat16", "max_model_len": 512}
LAYER_ZERO: dict[str, torch.Tensor] = {}  # arch -> the first backend's layer-0 prompt pattern


def hf_model(path: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPE, attn_implementation="eager"
    )
    return model.to("cuda").eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", PATTERN_MODELS)
def test_attention_pattern_equals_eager_attention(engines, gpu, arch, backend) -> None:
    path = vinterp.models.tiny(arch, **PATTERN_MODELS[arch])
    llm = engines.vllm(path, attention_backend=backend, **ENGINE, **gpu.SHARE)
    layers = [0, len(llm.layers) - 1]
    saved: dict[str, Any] = {}
    with llm.trace(PROMPT, max_tokens=3, ignore_eos=True) as tr:
        for i in layers:
            saved[f"{i}.prompt"] = llm.layers[i].attn.pattern.save()
        for _ in tr.iter[1:3]:
            for i in layers:
                saved[f"{i}.decode"] = llm.layers[i].attn.pattern[:, -1].save()
    prompt, tokens = list(tr.outputs[0].prompt_token_ids), tr.outputs[0].token_ids
    n = len(prompt)
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:2]], device="cuda")
        want = [a[0].float().cpu() for a in hf_model(path)(ids, output_attentions=True).attentions]
    for i in layers:
        assert gpu.rel_err(saved[f"{i}.prompt"], want[i][:, :n, :n]) < gpu.REL_TOL, i
        for k, row in enumerate(saved[f"{i}.decode"], start=1):
            assert gpu.rel_err(row, want[i][:, n + k - 1, : n + k]) < gpu.REL_TOL, (i, k)
    first = LAYER_ZERO.setdefault(arch, saved["0.prompt"])
    assert gpu.rel_err(saved["0.prompt"], first) < 1e-3  # the backend makes no difference


@pytest.mark.parametrize("arch", MIXTURES_OF_EXPERTS)
def test_routers_equal_transformers_and_their_in_graph_captures(engines, gpu, arch) -> None:
    path = vinterp.models.tiny(arch)
    llm = engines.vllm(path, capture_in_graph=[ROUTERS], **ENGINE, **gpu.SHARE)
    with llm.trace(PROMPT, max_tokens=1):
        logits = llm.layers[1].mlp.router.output.save()
        experts = llm.layers[1].mlp.router.experts.save()
    before = llm.step_stats()["graph_capture_steps"]
    out = llm.generate(PROMPT, max_tokens=1, capture=vinterp.Capture(ROUTERS))[0]
    assert llm.step_stats()["graph_capture_steps"] > before
    model = hf_model(path)
    gate = model.model.layers[1].mlp.gate
    seen: dict[str, torch.Tensor] = {}

    def keep_input(module: Any, args: Any, output: Any) -> None:
        seen["input"] = args[0]

    handle = gate.register_forward_hook(keep_input)
    with torch.no_grad():
        model(torch.tensor([out.prompt_token_ids], device="cuda"))
    handle.remove()
    hidden = seen["input"].reshape(-1, gate.weight.shape[1])  # (T, H) however the block shapes it
    want = torch.nn.functional.linear(hidden, gate.weight).float().cpu()
    assert gpu.rel_err(logits, want) < gpu.REL_TOL
    top_k = experts.shape[-1]
    want_experts = torch.topk(want.softmax(-1), top_k, dim=-1).indices
    agree = float((experts.sort(-1).values == want_experts.sort(-1).values).float().mean())
    assert agree > 0.9  # bf16 ties may swap an expert or two
    captured = out.captures["layers.1.mlp.router.output"]
    assert gpu.rel_err(captured, logits[-1:]) < 1e-1  # compiled-vs-eager distance
