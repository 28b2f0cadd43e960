"""Where the standardized sites live in each architecture's module tree, on HF and on vLLM.

A site map names, per architecture, the modules whose inputs and outputs are the sites
(API.md section 2). vLLM keeps transformers' module names for most architectures; where it
does not (Gemma's scaled embedding and tied unembedding) the map says so. How values
are laid out at each module (vLLM's (hidden, residual) pairs, a leading batch axis) is the
backend hooks' business, detected from the loaded modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from vinterp.sites.names import Heads, Router, SiteOrder, UnknownSiteError

# The keys of a site map. embed/layers/final_norm/lm_head are paths from the causal LM's root;
# attn/mlp_input/mlp_output are attribute names inside one layer (`mlp` in `sites=` sets both);
# a mixture-of-experts map adds `router`, the path of a layer's router (its logits' linear).
PATH_KEYS = ("embed", "layers", "final_norm", "lm_head", "attn", "mlp_input", "mlp_output")
OVERRIDE_KEYS = (*PATH_KEYS, "mlp")

_LLAMA_PATHS = {
    "embed": "model.embed_tokens",
    "layers": "model.layers",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
    "attn": "self_attn",
    "mlp_input": "mlp",
    "mlp_output": "mlp",
}


@dataclass(frozen=True)
class SiteMap:
    """Module paths of the sites in one architecture; `vllm` lists where vLLM's tree differs.
    `heads`: its attention's per-head sites, "grouped" (`num_key_value_heads` kv heads),
    "multi" (every head its own keys and values) or None (none)."""

    paths: dict[str, str]
    vllm: dict[str, str] = field(default_factory=dict)
    heads: Literal["grouped", "multi"] | None = "grouped"

    def for_backend(self, backend: str) -> dict[str, str]:
        return {**self.paths, **self.vllm} if backend == "vllm" else dict(self.paths)


SITE_MAPS: dict[str, SiteMap] = {
    **{name: SiteMap(_LLAMA_PATHS) for name in ("llama", "mistral", "qwen2", "qwen3", "phi3")},
    # HF scales Gemma's embedding inside the module, vLLM in `embed_input_ids`; vLLM's
    # Gemma 2 unembeds with the embedding module itself.
    "gemma2": SiteMap(
        _LLAMA_PATHS,
        vllm={"embed": "model.embed_input_ids", "lm_head": "model.embed_tokens"},
    ),
    "gemma3_text": SiteMap(_LLAMA_PATHS, vllm={"embed": "model.embed_input_ids"}),
    "gpt2": SiteMap(
        {
            "embed": "transformer.wte",
            "layers": "transformer.h",
            "final_norm": "transformer.ln_f",
            "lm_head": "lm_head",
            "attn": "attn",
            "mlp_input": "mlp",
            "mlp_output": "mlp",
        },
        heads="multi",
    ),
    # OPT's MLP is two linears directly in the layer: its input enters fc1, its output leaves fc2.
    # transformers scales OPT's q before attention, vLLM inside it: no per-head sites.
    "opt": SiteMap(
        {
            "embed": "model.decoder.embed_tokens",
            "layers": "model.decoder.layers",
            "final_norm": "model.decoder.final_layer_norm",
            "lm_head": "lm_head",
            "attn": "self_attn",
            "mlp_input": "fc1",
            "mlp_output": "fc2",
        },
        heads=None,
    ),
    # Mixture-of-experts MLPs: HF's router module returns (logits, weights, expert ids),
    # vLLM's gate linear (logits, bias); vLLM keeps Mixtral's older name for the MoE block.
    "mixtral": SiteMap(
        {**_LLAMA_PATHS, "router": "mlp.gate"},
        vllm={
            "mlp_input": "block_sparse_moe",
            "mlp_output": "block_sparse_moe",
            "router": "block_sparse_moe.gate",
        },
    ),
    **{
        name: SiteMap({**_LLAMA_PATHS, "router": "mlp.gate"})
        for name in ("qwen2_moe", "qwen3_moe", "olmoe")
    },
    # Parallel attention + MLP blocks. HF backend only: see `vllm_engine.check_native_model`.
    "gpt_neox": SiteMap(
        {
            "embed": "gpt_neox.embed_in",
            "layers": "gpt_neox.layers",
            "final_norm": "gpt_neox.final_layer_norm",
            "lm_head": "lm_head",
            "attn": "attention",
            "mlp_input": "mlp",
            "mlp_output": "mlp",
        },
        heads="multi",
    ),
}
SUPPORTED = tuple(SITE_MAPS)


def router_of(config: Any) -> Router | None:
    """The routers of a mixture-of-experts model with a site map (None: a dense model). Qwen's
    MoE models may keep dense MLPs in some layers (`mlp_only_layers`, `decoder_sparse_step`),
    as transformers and vLLM build them."""
    site_map = SITE_MAPS.get(getattr(config, "model_type", ""))
    if site_map is None or "router" not in site_map.paths:
        return None
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    layers = range(int(config.num_hidden_layers))
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    return Router(
        tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
        int(experts),
        int(config.num_experts_per_tok),
    )


def heads_of(config: Any) -> Heads | None:
    """The attention heads of a model whose site map has per-head sites (None: no such
    sites). Without `head_dim` in its config the heads split the hidden size."""
    site_map = SITE_MAPS.get(getattr(config, "model_type", ""))
    if site_map is None or site_map.heads is None:
        return None
    heads = int(config.num_attention_heads)
    kv_heads = int(config.num_key_value_heads) if site_map.heads == "grouped" else heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return Heads(heads, kv_heads, int(head_dim))


def site_order(config: Any) -> SiteOrder:
    """The sites of the model an HF config describes, in forward order."""
    return SiteOrder(int(config.num_hidden_layers), router_of(config), heads_of(config))


@dataclass
class SiteModules:
    """The site modules of one loaded model. `embed` may be a module or, where the backend
    computes the embedding in a method (vLLM's Gemma 3), that method's owner and name."""

    embed: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module
    attn_name: str = "self_attn"
    mlp_input_name: str = "mlp"
    mlp_output_name: str = "mlp"
    embed_method: str = "forward"
    router_path: str | None = None  # a mixture-of-experts layer's router, inside the layer

    def attn(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attn_name)

    def mlp_input(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.mlp_input_name)

    def mlp_output(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.mlp_output_name)

    def router(self, layer: nn.Module) -> nn.Module:
        assert self.router_path is not None
        return layer.get_submodule(self.router_path)

    def holds_layer(self, layer: nn.Module) -> bool:
        """False for a pipeline stage's placeholder of a layer another stage owns."""
        return hasattr(layer, self.attn_name)


def check_site_paths(
    model_type: str, overrides: dict[str, str] | None, backend: str = "hf"
) -> dict[str, str]:
    """The module paths to use, or a clear error for an unsupported model without overrides."""
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(OVERRIDE_KEYS)
    if unknown:
        raise UnknownSiteError(
            f"sites: unknown keys {sorted(unknown)}; the keys are {sorted(OVERRIDE_KEYS)}"
        )
    if "mlp" in overrides:
        mlp = overrides.pop("mlp")
        overrides = {"mlp_input": mlp, "mlp_output": mlp, **overrides}
    site_map = SITE_MAPS.get(model_type)
    if site_map is None and not overrides:
        raise UnknownSiteError(
            f"model type {model_type!r} has no site map; supported: {', '.join(SUPPORTED)}. "
            "For a model built like them (blocks with attention and MLP) pass sites={...} "
            f"with the module paths, e.g. {_LLAMA_PATHS}"
        )
    defaults = site_map.for_backend(backend) if site_map else _LLAMA_PATHS
    return {**defaults, **overrides}


def _resolve(model: nn.Module, path: str) -> Any:
    """The module or method at a dotted attribute path; AttributeError if absent."""
    owner, _, name = path.rpartition(".")
    found = getattr(model.get_submodule(owner), name)
    if not isinstance(found, nn.Module) and not callable(found):
        raise AttributeError(path)
    return found


def find_site_modules(
    model: nn.Module,
    model_type: str,
    overrides: dict[str, str] | None = None,
    backend: str = "hf",
) -> SiteModules:
    """The site modules of a causal LM (HF `XForCausalLM` or vLLM's), or an error that names
    every module that could not be found."""
    paths = check_site_paths(model_type, overrides, backend)
    found: dict[str, Any] = {}
    missing = []
    for key in ("embed", "layers", "final_norm", "lm_head"):
        try:
            found[key] = _resolve(model, paths[key])
        except AttributeError:
            missing.append(f"{key} at {paths[key]!r}")
    layers = found.get("layers")
    real = [layer for layer in layers or () if hasattr(layer, paths["attn"])]
    for key in ("attn", "mlp_input", "mlp_output", "router"):
        if key in paths and layers is not None and not any(_holds(r, paths[key]) for r in real):
            missing.append(f"{key} at {paths['layers']}[i].{paths[key]}")
    if missing:
        raise UnknownSiteError(
            f"cannot find {'; '.join(missing)} in {type(model).__name__}; pass sites={{...}} "
            "with the right module paths"
        )
    embed, embed_method = found["embed"], "forward"
    if not isinstance(embed, nn.Module):  # a bound method: wrap it on its owner
        embed, embed_method = embed.__self__, embed.__name__
    return SiteModules(
        embed,
        layers,
        found["final_norm"],
        found["lm_head"],
        paths["attn"],
        paths["mlp_input"],
        paths["mlp_output"],
        embed_method,
        paths.get("router"),
    )


def _holds(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def unhooked(module: nn.Module) -> Any:
    """The module's class-level forward: bypasses hooks and vinterp's site wrappers, so
    applying a site module inside a trace (`llm.final_norm(x)`) does not re-enter the site."""
    cls = getattr(type(module), "_vinterp_base", type(module))  # before vLLM sites were added
    return lambda *args: cls.forward(module, *args)
