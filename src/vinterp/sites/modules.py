"""Where the standardized sites live in a model's module tree (the Llama family for now).

The same attribute paths hold in transformers' and vLLM's Llama implementations; what
differs is the value layout at each module, which the backend-specific hooks handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from vinterp.sites.names import UnknownSiteError

LLAMA_FAMILY = ("llama",)


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


def find_site_modules(model: nn.Module, model_type: str) -> SiteModules:
    """The site modules of a causal LM (HF `XForCausalLM` or vLLM's), or a clear error."""
    if model_type not in LLAMA_FAMILY:
        raise UnknownSiteError(
            f"model type {model_type!r} has no site map yet; supported: {LLAMA_FAMILY}"
        )
    body: Any = getattr(model, "model", None)
    missing = [
        path for path, ok in (
            ("model", body is not None),
            ("model.embed_tokens", hasattr(body, "embed_tokens")),
            ("model.layers", hasattr(body, "layers")),
            ("model.norm", hasattr(body, "norm")),
            ("lm_head", hasattr(model, "lm_head")),
        ) if not ok
    ]
    if missing:
        raise UnknownSiteError(f"cannot find {', '.join(missing)} in {type(model).__name__}")
    return SiteModules(body.embed_tokens, body.layers, body.norm, model.lm_head)


def unhooked(module: nn.Module) -> Any:
    """The module's class-level forward: bypasses hooks and vinterp's site wrappers, so
    applying a site module inside a trace (`llm.final_norm(x)`) does not re-enter the site."""
    return lambda *args: type(module).forward(module, *args)
