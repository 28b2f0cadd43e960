"""Attention patterns and mixture-of-experts routers on one GPU, on vLLM's defaults (compiled,
CUDA graphs) in bf16 (how to run: tests/gpu/conftest.py; `-k attention`).

The pattern is recomputed from q and the kept keys with the eager reference math, so it must
not depend on the attention backend: each model (llama, mistral, qwen2, qwen3, gemma2,
gemma3) runs on FlashAttention and on Triton attention. Layer 0 (whose q and k follow from
the tokens alone) equals transformers' eager attention (bf16, on the GPU) end to end. Every
read layer, the last one too, equals transformers' eager attention function applied to the
engine's own q and k of that trace (the keys of every step so far), with the scale, soft-cap
and window taken from the model's config: deeper layers' q and k part from transformers' by
bf16 drift (up to 7e-2 at the last of four layers, H200), which says nothing about the
pattern. On every backend, layer 0's pattern also equals that eager function applied to the
q and k of the first backend's run (the same for every backend, as layer 0's q and k are):
the keys each backend's cache layout keeps give the same pattern.
Mixture-of-experts router logits equal transformers' at layer 0 end to end, and at every read
layer transformers' router applied to the engine's own MLP input (the chosen experts its top
k); router logits captured in CUDA graphs (`capture_in_graph`) equal the trace's.
Each comparison's numbers go to $VINTERP_GPU_OUT/gpu_attention.json (tests/gpu/conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig

import vinterp

pytestmark = [
    pytest.mark.engine("gpu_attention"),
    pytest.mark.gpus(1),
    pytest.mark.usefixtures("in_process"),
]

PATTERN_MODELS = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
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
# arch -> layer 0's q and k (every step's) of the first backend's run
LAYER_ZERO: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def eager_math(config: Any, layer: int) -> dict[str, Any]:
    """Layer `layer`'s attention scale, soft-cap and sliding window, read from the HF config
    (a sliding layer's key j is seen by query i when i - window < j <= i)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scalar = getattr(config, "query_pre_attn_scalar", None)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    sliding = types[layer] == "sliding_attention" if types else window is not None
    return {
        "scaling": (scalar or head_dim) ** -0.5,
        "softcap": getattr(config, "attn_logit_softcapping", None),
        "window": window if sliding else None,
        "groups": config.num_attention_heads // config.num_key_value_heads,
    }


def eager_rows(q: torch.Tensor, keys: torch.Tensor, first: int, math: dict) -> torch.Tensor:
    """transformers' eager attention probabilities (heads, Q, K) of the queries `q` (Q, heads,
    D) at positions first.. over `keys` (K, kv_heads, D) at positions 0.., float32."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    i = torch.arange(first, first + q.shape[0])[:, None]
    j = torch.arange(keys.shape[0])[None, :]
    seen = j <= i
    if math["window"] is not None:
        seen &= j > i - math["window"]
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = math["groups"], False
    keys = keys.transpose(0, 1)[None]
    _, weights = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        keys,
        keys,
        mask[None, None],
        scaling=math["scaling"],
        softcap=math["softcap"],
    )
    return weights[0]


SAME_MATH_TOL = 1e-3  # the same math on the same q and k, in float32


def checks(report: Any, gpu: Any, name: str, pairs: list[tuple[str, Any, Any, float]]) -> bool:
    """Records each (what, got, want, tolerance)'s relative error under `name`; whether every
    one holds (a shape that differs: an infinite error)."""
    errs = [(what, gpu.rel_err(got, want), tol) for what, got, want, tol in pairs]
    return all(
        [report.check(f"{name}: {what}", f"{err:.2e}", err < tol) for what, err, tol in errs]
    )


def hf_model(path: Any, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPE, attn_implementation="eager"
    )
    return model.to(device).eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", PATTERN_MODELS)
def test_attention_pattern_equals_eager_attention(engines, gpu, report, arch, backend) -> None:
    if gpu.REHEARSAL and backend != BACKENDS[0]:
        pytest.skip("the CPU engine has one attention backend")
    path = vinterp.models.tiny(arch, **PATTERN_MODELS[arch])
    chosen = {} if gpu.REHEARSAL else {"attention_backend": backend}
    llm = engines.vllm(path, **chosen, **ENGINE, **gpu.SHARE)
    layers = [0, len(llm.layers) - 1]
    saved: dict[str, list[Any]] = {}

    def keep(step: str) -> None:
        for i in layers:
            attn = llm.layers[i].attn
            pattern = attn.pattern if step == "prompt" else attn.pattern[:, -1]
            for name, site in (("pattern", pattern), ("q", attn.q), ("k", attn.k)):
                saved.setdefault(f"{i}.{name}", []).append(site.save())

    with llm.trace(PROMPT, max_tokens=3, ignore_eos=True) as tr:
        keep("prompt")
        for _ in tr.iter[1:3]:
            keep("decode")  # a save in tr.iter holds one value per step
    saved = {key: [prompt, *decode] for key, (prompt, decode) in saved.items()}
    prompt, tokens = list(tr.outputs[0].prompt_token_ids), tr.outputs[0].token_ids
    n = len(prompt)
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:2]], device=gpu.DEVICE)
        model = hf_model(path, gpu.DEVICE)
        want = [a[0].float().cpu() for a in model(ids, output_attentions=True).attentions]
    name = f"{arch} {backend if not gpu.REHEARSAL else 'cpu'} pattern"
    zero = saved["0.pattern"]
    ok = checks(
        report,
        gpu,
        f"{name} layer 0 vs transformers end to end",
        [("prompt", zero[0], want[0][:, :n, :n], gpu.REL_TOL)]
        + [
            (f"decode {k}", row, want[0][:, n + k - 1, : n + k], gpu.REL_TOL)
            for k, row in enumerate(zero[1:], start=1)
        ],
    )
    config = AutoConfig.from_pretrained(str(path))

    def vs_eager_math(i: int, q: torch.Tensor, keys: torch.Tensor, label: str) -> bool:
        math, pattern = eager_math(config, i), saved[f"{i}.pattern"]
        rows = [("prompt", pattern[0], eager_rows(q[:n], keys[:n], 0, math), SAME_MATH_TOL)]
        for k, row in enumerate(pattern[1:], start=1):
            want_row = eager_rows(q[n + k - 1 : n + k], keys[: n + k], n + k - 1, math)[:, 0]
            rows.append((f"decode {k}", row, want_row, SAME_MATH_TOL))
        return checks(report, gpu, f"{name} layer {i} vs eager math on {label}", rows)

    def cat(key: str) -> torch.Tensor:
        return torch.cat([t.float().cpu() for t in saved[key]])

    for i in layers:
        ok &= vs_eager_math(i, cat(f"{i}.q"), cat(f"{i}.k"), "its own q and k")
    # layer 0's q and k follow from the tokens alone: the first backend's are every backend's
    first = LAYER_ZERO.setdefault(arch, (cat("0.q"), cat("0.k")))
    ok &= vs_eager_math(0, *first, "the first backend's q and k")
    assert ok, [c for c in report.checks if c["check"].startswith(name) and not c["ok"]]


def router_logits(gate: Any, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' router linear (`mlp.gate`) on `hidden` (T, H), in float32 on the CPU."""
    weight = gate.weight.detach().float().cpu()
    return torch.nn.functional.linear(hidden.float().cpu().reshape(-1, weight.shape[1]), weight)


@pytest.mark.parametrize("arch", MIXTURES_OF_EXPERTS)
def test_routers_equal_transformers_and_their_in_graph_captures(engines, gpu, report, arch) -> None:
    path = vinterp.models.tiny(arch)
    llm = engines.vllm(path, capture_in_graph=[ROUTERS], **ENGINE, **gpu.SHARE)
    layers = (0, 1)
    with llm.trace(PROMPT, max_tokens=1):
        saved = {
            i: {
                "logits": llm.layers[i].mlp.router.output.save(),
                "experts": llm.layers[i].mlp.router.experts.save(),
                "input": llm.layers[i].mlp.input.save(),
            }
            for i in layers
        }
    before = llm.step_stats()["graph_capture_steps"]
    out = llm.generate(PROMPT, max_tokens=1, capture=vinterp.Capture(ROUTERS))[0]
    in_graph = llm.step_stats()["graph_capture_steps"] - before
    model = hf_model(path, gpu.DEVICE)
    gates = [model.model.layers[i].mlp.gate for i in layers]
    seen: dict[str, torch.Tensor] = {}

    def keep_input(module: Any, args: Any, output: Any) -> None:
        seen["input"] = args[0]

    handle = gates[0].register_forward_hook(keep_input)
    with torch.no_grad():
        model(torch.tensor([out.prompt_token_ids], device=gpu.DEVICE))
    handle.remove()
    name = f"{arch} router"
    ok = report.check(f"{name}: steps captured in the graphs", str(in_graph), in_graph > 0)
    # layer 0 end to end: transformers' router on transformers' own hidden states
    end_to_end = router_logits(gates[0], seen["input"])
    pairs = [("layer 0 vs transformers end to end", saved[0]["logits"], end_to_end, gpu.REL_TOL)]
    agree = {}
    for i in layers:  # each read layer: transformers' router on the engine's own MLP input
        want = router_logits(gates[i], saved[i]["input"])
        # a bf16 GEMM's rounding
        pairs.append(
            (f"layer {i} vs transformers on its MLP input", saved[i]["logits"], want, 1e-2)
        )
        experts = saved[i]["experts"]
        want_experts = torch.topk(want.softmax(-1), experts.shape[-1], dim=-1).indices
        agree[i] = float((experts.sort(-1).values == want_experts.sort(-1).values).float().mean())
    # captured inside the compiled graphs: compiled-vs-eager distance
    captured = out.captures["layers.1.mlp.router.output"]
    pairs.append(
        ("layer 1 captured in the graphs vs the trace", captured, saved[1]["logits"][-1:], 1e-1)
    )
    ok &= checks(report, gpu, name, pairs)
    for i, share in agree.items():  # bf16 ties may swap an expert or two
        chosen = f"{name}: layer {i} experts == top k of those logits"
        ok &= report.check(chosen, f"{share:.2f}", share > 0.9)
    assert ok, [c for c in report.checks if c["check"].startswith(name) and not c["ok"]]
