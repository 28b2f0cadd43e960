"""Each supported architecture: every standardized site on vLLM equals transformers; the
per-head attention sites (a write to k at the prompt that later steps read from the KV
cache, a head ablation, q and k captured into capture buffers); on mixture-of-experts
models also the router sites, a write to the router logits, and steering with captures
(into capture buffers, and uncompiled) at them.

The engines trace each model whole with Dynamo, site ops included, as every engine does, and
run the traced graph op by op rather than through Inductor (its C++ compile is most of an
engine start on two cores; Inductor with the site ops is tested on the llama engines), in
this process (two process starts fewer each).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from eager_attention import eager_attentions
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp
from vinterp.sites.modules import SUPPORTED, heads_of, router_of, site_order
from vinterp.sites.names import parse_site
from vinterp.sites.params import PROJECTIONS, param_shape

PROMPT = "The capital of France is"


def site_point(llm: vinterp.LLM, site: str) -> tuple[Any, str]:
    """(object, attribute) whose attribute is the named standardized site."""
    parsed = parse_site(site)
    point: Any = llm if parsed.layer is None else llm.layers[parsed.layer]
    for name in parsed.module.split(".") if parsed.module else ():
        point = getattr(point, name)
    return point, parsed.value


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def assert_equal_values(got: torch.Tensor, want: torch.Tensor, site: str) -> None:
    """Expert ids exactly, float values to float32 rounding."""
    assert got.shape == want.shape, site
    if want.dtype == torch.long:
        assert torch.equal(got, want), site
    else:
        assert rel_err(got, want) < 1e-4, site


def every_site(llm: vinterp.LLM) -> dict[str, torch.Tensor]:
    saves = {}
    sites = [s for s in site_order(llm.config).sites if s != "samples"]
    with llm.trace(PROMPT, max_tokens=1):
        for site in sites:
            point, which = site_point(llm, site)
            saves[site] = getattr(point, which).save()
    return saves


def write_middle(llm: vinterp.LLM) -> list[int]:
    direction = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with llm.trace(PROMPT, max_tokens=6) as tr:
        middle = len(llm.layers) // 2
        for _ in tr.iter[:]:
            llm.layers[middle].output = llm.layers[middle].output + 100.0 * direction
    return tr.outputs[0].token_ids


pytestmark = pytest.mark.usefixtures("in_process")


ON_VLLM = [arch for arch in SUPPORTED if arch != "gpt_neox"]
MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ROUTER_SITES = ["layers.*.mlp.router.output", "layers.*.mlp.router.experts"]
HEAD_BUFFERS = ["layers.*.attn.q", "layers.*.attn.k"]


def engine_kwargs(arch: str) -> dict[str, Any]:
    """Capture buffers at q and k, and on a mixture-of-experts engine at its router sites."""
    routers = ROUTER_SITES if arch in MIXTURES_OF_EXPERTS else []
    heads = HEAD_BUFFERS if arch != "opt" else []
    return {**TRACED_NOT_INDUCTOR, "capture_in_graph": [*routers, *heads] or False}


WITH_HF_PROJECTIONS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
PARAMS = ["embed.weight", "lm_head.weight"] + [
    f"layers.1.{block}.{proj}.weight" for block, projs in PROJECTIONS.items() for proj in projs
]


def read_params(llm: vinterp.LLM) -> dict[str, torch.Tensor]:
    with llm.trace(PROMPT, max_tokens=1):
        saves = {name: llm.active_trace().record_param(name).save() for name in PARAMS}
    return saves


@pytest.mark.engine("architectures")
@pytest.mark.parametrize("arch", ON_VLLM)
def test_architecture_sites_equal_hf(engines, arch) -> None:
    path = vinterp.models.tiny(arch, **SHARED_PATTERN_MODELS.get(arch, {}))
    llm, hf = engines.vllm(path, **engine_kwargs(arch)), engines.hf(path)
    got, want = every_site(llm), every_site(hf)
    for site, value in want.items():
        assert_equal_values(got[site], value, site)
    for i in range(len(llm.layers) - 1):
        assert torch.equal(got[f"layers.{i}.output"], got[f"layers.{i + 1}.input"])
    before = llm.step_stats()
    baseline = llm.generate(PROMPT, max_tokens=6, ignore_eos=True)[0].token_ids
    after = llm.step_stats()  # plain steps ran the traced graph, site ops in it
    assert after["steps"] > before["steps"]
    assert after["uncompiled_steps"] == before["uncompiled_steps"]
    steered = write_middle(llm)
    assert steered == write_middle(hf)
    assert steered != baseline
    if arch in WITH_HF_PROJECTIONS:  # merged / packed engine layers split back, exactly
        params, want_params = read_params(llm), read_params(hf)
        for name in PARAMS:
            assert torch.equal(params[name], want_params[name]), name
        k_proj = want_params["layers.1.self_attn.k_proj.weight"]
        assert k_proj.shape == param_shape(llm.config, PARAMS[3])
    else:
        with pytest.raises(vinterp.InterventionError, match="llm.raw"):
            read_params(llm)
    if arch in SHARED_PATTERN_MODELS:
        check_attention_pattern(llm, path, arch)
    if arch in MIXTURES_OF_EXPERTS:
        check_routers(llm, hf, got)
    if heads_of(llm.config) is not None:
        check_heads(llm, hf, got)
    else:  # opt: transformers scales q before attention
        assert "layers.1.attn.q" not in got
        with pytest.raises(vinterp.TraceError, match="no per-head attention sites"):
            with llm.trace(PROMPT, max_tokens=1):
                llm.layers[1].attn.q.save()


def check_heads(llm: vinterp.LLM, hf: vinterp.LLM, unedited: dict[str, torch.Tensor]) -> None:
    """The per-head sites were among the sites compared. A write to k at the prompt is what
    the next step's attention reads from the KV cache, and tokens follow it as on HF; a head
    ablation equals HF's; q and k of the last prompt token are captured into the capture
    buffers, in a compiled step."""
    heads = heads_of(llm.config)
    tokens = len(unedited["layers.1.input"])
    assert unedited["layers.1.attn.q"].shape == (tokens, heads.heads, heads.head_dim)
    assert unedited["layers.1.attn.v"].shape == (tokens, heads.kv_heads, heads.head_dim)
    got, want = write_keys(llm), write_keys(hf)
    assert got["tokens"] == want["tokens"]
    for name in ("written", "q", "k", "v", "heads", "logits"):
        assert rel_err(got[name], want[name]) < 1e-4, name
    # the next step attends to the written prompt keys: softmax(q K^T / sqrt(d)) V, every
    # tiny model scaling by 1/sqrt(head_dim) with no soft cap and windows past the prompt
    groups = heads.heads // heads.kv_heads
    keys = torch.cat([got["written"], got["k"]]).repeat_interleave(groups, dim=1)
    values = torch.cat([unedited["layers.1.attn.v"], got["v"]]).repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", got["q"], keys) / heads.head_dim**0.5
    attended = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
    assert rel_err(got["heads"], attended) < 1e-5
    ablated, want_ablated = ablate_head(llm), ablate_head(hf)
    assert ablated[0] == want_ablated[0] and rel_err(ablated[1], want_ablated[1]) < 1e-4
    assert rel_err(ablated[1], unedited["logits"]) > 1e-4
    before = llm.step_stats()
    captured = captured_last_prompt(llm)
    after = llm.step_stats()
    assert after["graph_capture_steps"] > before["graph_capture_steps"]
    assert after["uncompiled_steps"] == before["uncompiled_steps"]
    for site, value in captured_last_prompt(hf).items():
        assert rel_err(captured[site], value) < 1e-4, site
        assert rel_err(captured[site], unedited[site][-1:]) < 1e-4, site


def write_keys(llm: vinterp.LLM) -> dict[str, Any]:
    """Layer 1's prompt keys flipped and scaled at the prompt step; the next step's q, k, v,
    heads, the last logits and the tokens."""
    out: dict[str, Any] = {}
    with llm.trace(PROMPT, max_tokens=4, ignore_eos=True) as tr:
        written = llm.layers[1].attn.k * -4.0
        llm.layers[1].attn.k = written
        out["written"] = written.save()
        for _ in tr.iter[1]:
            for part in ("q", "k", "v", "heads"):
                out[part] = getattr(llm.layers[1].attn, part).save()
        for _ in tr.iter[3]:
            out["logits"] = llm.logits.save()
    out = {k: v[0] if isinstance(v, list) else v for k, v in out.items()}
    return {**out, "tokens": tr.outputs[0].token_ids}


def ablate_head(llm: vinterp.LLM) -> tuple[list[int], torch.Tensor]:
    """Head 2 of layer 1 zeroed at every step: the tokens and the prompt's logits."""
    with llm.trace(PROMPT, max_tokens=4, ignore_eos=True) as tr:
        for _ in tr.iter[:]:
            llm.layers[1].attn.heads[:, 2] = 0
        logits = llm.logits.save()
    return tr.outputs[0].token_ids, logits


def captured_last_prompt(llm: vinterp.LLM) -> dict[str, torch.Tensor]:
    capture = vinterp.Capture(["layers.1.attn.q", "layers.1.attn.k"], positions="last_prompt")
    return llm.generate(PROMPT, max_tokens=2, capture=capture)[0].captures


def check_routers(llm: vinterp.LLM, hf: vinterp.LLM, unedited: dict[str, torch.Tensor]) -> None:
    """Router sites were among the sites compared; a write to the router logits reroutes on
    both backends alike; steering and captures at the router sites equal HF's, compiled into
    the capture buffers and uncompiled."""
    router = router_of(llm.config)
    assert router is not None and unedited["layers.1.mlp.router.output"].shape[1] == router.experts
    assert unedited["layers.1.mlp.router.experts"].shape[1] == router.top_k
    chosen = unedited["layers.1.mlp.router.experts"]
    expert = int(torch.bincount(chosen.flatten(), minlength=router.experts).argmin())
    tokens, experts, logits = route_to(llm, expert)
    want_tokens, want_experts, want_logits = route_to(hf, expert)
    assert tokens == want_tokens and torch.equal(experts, want_experts)
    assert rel_err(logits, want_logits) < 1e-4
    assert bool((experts[:, 0] == expert).all()) and not torch.equal(experts, chosen)
    assert rel_err(logits, unedited["logits"]) > 1e-3
    with pytest.raises(vinterp.TraceError, match="router.experts is read-only"):
        with llm.trace(PROMPT, max_tokens=1):
            llm.layers[1].mlp.router.experts = llm.layers[1].mlp.router.experts * 0
    outside_buffers = [*ROUTER_SITES, "layers.2.mlp.output"]
    for sites, in_buffers in [(ROUTER_SITES, True), (outside_buffers, False)]:
        before = llm.step_stats()
        got = steered_captures(llm, sites)
        after = llm.step_stats()
        ran = "graph_capture_steps" if in_buffers else "uncompiled_steps"
        assert after[ran] - before[ran] >= 4, sites  # the prompt and 3 decoding steps capture
        want = steered_captures(hf, sites)
        assert got.keys() == want.keys() and "layers.3.mlp.router.experts" in got
        for site, value in want.items():
            assert_equal_values(got[site], value, site)
    prompt_rows = unedited["layers.2.mlp.router.output"]
    steered = got["layers.2.mlp.router.output"][: len(prompt_rows)]
    assert rel_err(steered, prompt_rows) > 1e-3  # captured after the steering upstream


def route_to(llm: vinterp.LLM, expert: int) -> tuple[Any, Any, Any]:
    """Layer 1's router sends every token to `expert` first, at every step: the tokens, and
    the prompt's expert ids and logits."""
    bonus = torch.zeros(router_of(llm.config).experts)
    bonus[expert] = 50.0
    with llm.trace(PROMPT, max_tokens=6, ignore_eos=True) as tr:
        for _ in tr.iter[:]:
            llm.layers[1].mlp.router.output = llm.layers[1].mlp.router.output + bonus
        experts = llm.layers[1].mlp.router.experts.save()
        logits = llm.logits.save()
    return tr.outputs[0].token_ids, experts, logits


def steered_captures(llm: vinterp.LLM, sites: list[str]) -> dict[str, torch.Tensor]:
    v = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(7))
    steering = vinterp.Steering({"layers.1.output": v}, scale=20.0)
    capture = vinterp.Capture(sites, positions="all")
    out = llm.generate(PROMPT, max_tokens=4, ignore_eos=True, steering=steering, capture=capture)
    return out[0].captures


def test_transformers_backend_model_is_refused_on_vllm(engines) -> None:
    """GPT-NeoX goes through vLLM's Transformers backend, which disagrees with transformers."""
    path = vinterp.models.tiny("gpt_neox")
    with pytest.raises(ValueError, match="Transformers backend.*backend='hf'"):
        vinterp.LLM(path)


def test_gpt_neox_sites_on_hf(engines) -> None:
    """Parallel blocks: the residual stream chains, and the MLP reads the layer input's norm."""
    hf = engines.hf(vinterp.models.tiny("gpt_neox"))
    got = every_site(hf)
    layer = hf.backend.sites.layers[1]
    for i in range(len(hf.layers) - 1):
        assert torch.equal(got[f"layers.{i}.output"], got[f"layers.{i + 1}.input"])
    with torch.no_grad():
        norm = layer.post_attention_layernorm(got["layers.1.input"])
    assert rel_err(got["layers.1.mlp.input"], norm) < 1e-6
    parallel_sum = got["layers.1.input"] + got["layers.1.attn.output"] + got["layers.1.mlp.output"]
    assert rel_err(got["layers.1.output"], parallel_sum) < 1e-5
    baseline = hf.generate(PROMPT, max_tokens=6, ignore_eos=True)[0].token_ids
    assert write_middle(hf) != baseline


# The attention patterns checked (`check_attention_pattern`), on tiny models of these
# settings: sliding windows shorter than the pattern's prompt (not than PROMPT); Gemma 2 also
# soft-caps its attention logits at 30, which vLLM's CPU kernel caps otherwise than
# transformers: there only layer 0 (whose q and k follow from the tokens alone) is compared,
# on an engine of its own (its other sites part from transformers'). The others' sites are
# checked on the same engines.
PATTERN_MODELS = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {"sliding_window": 8, "attn_logit_softcapping": 30.0},
    "gemma3_text": {"sliding_window": 8},
}
SOFT_CAP = "attn_logit_softcapping"
SHARED_PATTERN_MODELS = {a: kw for a, kw in PATTERN_MODELS.items() if SOFT_CAP not in kw}
LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen"


@pytest.mark.engine("architectures")
@pytest.mark.parametrize("arch", [a for a in PATTERN_MODELS if a not in SHARED_PATTERN_MODELS])
def test_attention_pattern_with_soft_caps_equals_transformers_eager_attention(
    engines, arch
) -> None:
    path = vinterp.models.tiny(arch, **PATTERN_MODELS[arch])
    check_attention_pattern(engines.vllm(path, **TRACED_NOT_INDUCTOR), path, arch)


def check_attention_pattern(llm: vinterp.LLM, path: Any, arch: str) -> None:
    """The prompt's whole pattern, each decode step's row over every earlier key (kept from
    earlier steps), and rows picked by head or query, equal to transformers' eager attention
    over the prompt and the generated tokens."""
    layers = [0] if SOFT_CAP in PATTERN_MODELS[arch] else [0, len(llm.layers) - 1]
    saved: dict[str, Any] = {}
    with llm.trace(LONG_PROMPT, max_tokens=3, ignore_eos=True) as tr:
        for i in layers:
            saved[f"{i}.prompt"] = llm.layers[i].attn.pattern.save()
            saved[f"{i}.head"] = llm.layers[i].attn.pattern[1].save()
            saved[f"{i}.last"] = llm.layers[i].attn.pattern[:, -1].save()
        for _ in tr.iter[1:3]:
            for i in layers:
                saved[f"{i}.decode"] = llm.layers[i].attn.pattern.save()
    prompt = list(tr.outputs[0].prompt_token_ids)
    tokens, n = tr.outputs[0].token_ids, len(prompt)
    want = eager_attentions(path, prompt + tokens[:2])
    for i in layers:
        full = want[i][:, :n, :n]
        assert saved[f"{i}.prompt"].shape == full.shape
        assert rel_err(saved[f"{i}.prompt"], full) < 1e-4
        assert rel_err(saved[f"{i}.head"], full[1]) < 1e-4
        assert rel_err(saved[f"{i}.last"], full[:, -1]) < 1e-4
        for k, row in enumerate(saved[f"{i}.decode"], start=1):
            assert row.shape == (full.shape[0], 1, n + k)
            assert rel_err(row, want[i][:, n + k - 1 : n + k, : n + k]) < 1e-4
    if "sliding_window" in PATTERN_MODELS[arch]:  # the window shows: keys left out
        assert n > 8 and bool((saved["0.prompt"][:, -1, : n - 8] == 0).all())
