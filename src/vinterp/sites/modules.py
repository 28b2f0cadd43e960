"""Where the standardized sites live in a model's module tree (the Llama family for now).

The same attribute paths hold in transformers' and vLLM's Llama implementations; what
differs is the value layout at each module, which the backend-specific hooks handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from vinterp.sites.names import UnknownSiteError

# Pre-norm decoders whose vLLM blocks pass (hidden, residual) and whose modules are named
# model.embed_tokens / model.layers[i].self_attn|mlp / model.norm / lm_head in both engines.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass
class SiteModules:
    embed: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module
    attn_name: str = "self_attn"
    mlp_name: str = "mlp"

    def attn(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attn_name)

    def mlp(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.mlp_name)


# Module paths of the sites in the Llama family; `sites=` overrides any of them (attn and mlp
# are attribute names inside a layer, the others paths from the causal LM's root).
DEFAULT_PATHS = {
    "embed": "model.embed_tokens",
    "layers": "model.layers",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
    "attn": "self_attn",
    "mlp": "mlp",
}


def check_site_paths(model_type: str, overrides: dict[str, str] | None) -> dict[str, str]:
    """The module paths to use, or a clear error for an unsupported model without overrides."""
    unknown = set(overrides or {}) - set(DEFAULT_PATHS)
    if unknown:
        raise UnknownSiteError(
            f"sites: unknown keys {sorted(unknown)}; the keys are {sorted(DEFAULT_PATHS)}"
        )
    if model_type not in LLAMA_FAMILY and not overrides:
        raise UnknownSiteError(
            f"model type {model_type!r} has no site map; supported: {', '.join(LLAMA_FAMILY)}. "
            "For a model built like them (pre-norm blocks with attention and MLP) pass "
            f"sites={{...}} with the module paths, e.g. {DEFAULT_PATHS}"
        )
    return {**DEFAULT_PATHS, **(overrides or {})}


def find_site_modules(
    model: nn.Module, model_type: str, overrides: dict[str, str] | None = None
) -> SiteModules:
    """The site modules of a causal LM (HF `XForCausalLM` or vLLM's), or an error that names
    every module that could not be found."""
    paths = check_site_paths(model_type, overrides)
    found: dict[str, Any] = {}
    missing = []
    for key in ("embed", "layers", "final_norm", "lm_head"):
        try:
            found[key] = model.get_submodule(paths[key])
        except AttributeError:
            missing.append(f"{key} at {paths[key]!r}")
    layers = found.get("layers")
    real = [layer for layer in layers or () if hasattr(layer, paths["attn"])]
    for key in ("attn", "mlp"):
        if layers is not None and (not real or not hasattr(real[0], paths[key])):
            missing.append(f"{key} at {paths['layers']}[i].{paths[key]}")
    if missing:
        raise UnknownSiteError(
            f"cannot find {'; '.join(missing)} in {type(model).__name__}; pass sites={{...}} "
            "with the right module paths"
        )
    return SiteModules(
        found["embed"],
        found["layers"],
        found["final_norm"],
        found["lm_head"],
        paths["attn"],
        paths["mlp"],
    )


def unhooked(module: nn.Module) -> Any:
    """The module's class-level forward: bypasses hooks and vinterp's site wrappers, so
    applying a site module inside a trace (`llm.final_norm(x)`) does not re-enter the site."""
    return lambda *args: type(module).forward(module, *args)
