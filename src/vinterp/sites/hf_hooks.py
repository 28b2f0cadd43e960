"""Standardized sites on transformers models, read and written through module hooks.

HF modules mostly carry a batch axis of 1 (the HF backend runs one invoke at a time); sites
are the (T, H) slice (some modules, like OPT's fc1/fc2, see (T, H) already).
`layers[i].input` is the block's hidden_states argument, `.output` its first output;
`attn`/`mlp` inputs are their hidden-state arguments (after the block's norm). A router
(transformers' top-k router module) returns (logits, weights, expert ids): its sites are the
logits and the ids; written logits route again as the router would have routed them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vinterp.sites.attention_pattern import Pattern
from vinterp.sites.modules import SiteModules
from vinterp.sites.names import Router

# What every site of an HF model runs through (these hooks and `hf_attention`'s per-head
# sites): the site's name and its value, a tensor or, at a pattern site, its `Pattern`; a
# returned tensor replaces the value.
SiteCallback = Callable[[str, torch.Tensor | Pattern], torch.Tensor | None]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _with_first(out: Any, new: torch.Tensor) -> Any:
    return (new, *out[1:]) if isinstance(out, tuple) else new


def _at_site(site: str, value: torch.Tensor, callback: SiteCallback) -> torch.Tensor | None:
    """Call back with the (T, H) view of `value`; the replacement in `value`'s layout."""
    batched = value.dim() == 3
    new = callback(site, value[0] if batched else value)
    if new is None:
        return None
    return new.unsqueeze(0) if batched else new


def _output_hook(site: str, callback: SiteCallback) -> Any:
    def hook(module: Any, args: Any, out: Any) -> Any:
        new = _at_site(site, _first(out), callback)
        return None if new is None else _with_first(out, new)

    return hook


def _input_hook(site: str, callback: SiteCallback) -> Any:
    def hook(module: Any, args: Any, kwargs: Any) -> Any:
        if args:
            new = _at_site(site, args[0], callback)
            return None if new is None else ((new, *args[1:]), kwargs)
        new = _at_site(site, kwargs["hidden_states"], callback)
        return None if new is None else (args, {**kwargs, "hidden_states": new})

    return hook


def _routed(router: Any, logits: torch.Tensor, dtype: torch.dtype) -> tuple[Any, Any]:
    """(weights, expert ids) of transformers' top-k routers for these logits: the top-k of
    their softmax, renormalized unless the router says not to (`norm_topk_prob`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalizes
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def _router_hook(layer: int, callback: SiteCallback) -> Any:
    def hook(module: Any, args: Any, out: Any) -> Any:
        logits, weights, experts = out
        new = callback(f"layers.{layer}.mlp.router.output", logits)
        if new is not None:
            logits = new
            weights, experts = _routed(module, new, weights.dtype)
        callback(f"layers.{layer}.mlp.router.experts", experts)  # read-only
        return None if new is None else (logits, weights, experts)

    return hook


def install_hf_hooks(
    modules: SiteModules, callback: SiteCallback, router: Router | None = None
) -> list[Any]:
    """Hook every standardized site of an HF model (and its routers' sites, at
    `router.layers`); returns the hook handles."""
    handles = [modules.embed.register_forward_hook(_output_hook("embed.output", callback))]
    for i, layer in enumerate(modules.layers):
        points = [
            (layer, "input", "output"),
            (modules.attn(layer), "attn.input", "attn.output"),
            (modules.mlp_input(layer), "mlp.input", None),
            (modules.mlp_output(layer), None, "mlp.output"),
        ]
        for module, input_site, output_site in points:
            if input_site:
                hook = _input_hook(f"layers.{i}.{input_site}", callback)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            if output_site:
                hook = _output_hook(f"layers.{i}.{output_site}", callback)
                handles.append(module.register_forward_hook(hook))
    for i in router.layers if router else ():
        gate = modules.router(modules.layers[i])
        handles.append(gate.register_forward_hook(_router_hook(i, callback)))
    handles.append(
        modules.final_norm.register_forward_hook(_output_hook("final_norm.output", callback))
    )
    return handles
