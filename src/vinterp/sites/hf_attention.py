"""The per-head attention sites on transformers models (`layers.{i}.attn.q|k|v|heads`).

transformers' attention modules hand q, k and v, after rotary embedding and any q/k norm, to
an attention function picked by name from its `AttentionInterface`, with the module itself
as the first argument; its output, (B, T, heads, head_dim), goes on to the output projection.
`install_head_sites` registers, for the model's implementation, one that runs the sites
around the same function (its mask function too, so the masks stay the same) and switches
the model to it: every architecture that uses the interface gets the sites, with no hook on
modeling code.

k and v arrive with the cached positions before this step's T: the sites are the last T. The
pattern site gets a `Pattern` of this step's queries over all the keys handed over.
Written k and v go into the tensors in place, which are the cache's own storage
(`DynamicLayer`) or hold its window as a view (`DynamicSlidingWindowLayer`), so a write
reaches both this step's attention and the later steps that read the cache.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vinterp.sites.attention_pattern import Pattern, PatternMath
from vinterp.sites.hf_hooks import SiteCallback
from vinterp.sites.modules import SiteModules

_PREFIX = "vinterp_sites_"
_LAYER = "_vinterp_layer"  # attribute of a hooked attention module: its layer index
_CALLBACK = "_vinterp_heads"


def _at_heads(site: str, value: torch.Tensor, callback: SiteCallback) -> None:
    """Call back with `value` (T, heads, head_dim), a view into the model's tensor; a
    replacement is written into it."""
    new = callback(site, value)
    if new is not None:
        value.copy_(new)


def _attention(inner_name: str) -> Callable[..., Any]:
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        inner = _inner(module, inner_name)
        callback = getattr(module, _CALLBACK, None)
        if callback is None:  # a module of another model, or not a layer's attention
            return inner(module, query, key, value, attention_mask, **kwargs)
        layer, tokens = getattr(module, _LAYER), query.shape[2]
        for part, tensor in (("q", query), ("k", key), ("v", value)):
            rows = tensor[0, :, -tokens:].transpose(0, 1)  # this step's tokens
            _at_heads(f"layers.{layer}.attn.{part}", rows, callback)
        callback(f"layers.{layer}.attn.pattern", _pattern(module, query, key, kwargs))
        out, weights = inner(module, query, key, value, attention_mask, **kwargs)
        new = callback(f"layers.{layer}.attn.heads", out[0])
        return (out if new is None else new.unsqueeze(0)), weights

    return attention


def _pattern(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]
) -> Pattern:
    """The layer's pattern over the keys it was handed, with the scaling, soft-cap and window
    the module passes its attention function (eager attention's default scale without one).
    The queries' positions come with the call; a sliding-window cache hands only the window's
    keys, which end at the last query."""
    tokens, held = query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        positions = torch.arange(held - tokens, held, device=query.device)
    else:
        positions = position_ids[0, -tokens:].to(query.device)
    scale = kwargs.get("scaling") or module.head_dim**-0.5
    math = PatternMath(float(scale), kwargs.get("softcap"), kwargs.get("sliding_window"))
    key_start = int(positions[-1]) + 1 - held
    return Pattern(
        query[0, :, -tokens:].transpose(0, 1), key[0].transpose(0, 1), positions, math, key_start
    )


def _inner(module: nn.Module, name: str) -> Callable[..., Any]:
    """The attention function the model would have called: its own module's eager one, or
    the interface's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _register(inner_name: str) -> str:
    """The name of the sited version of an attention implementation (registered once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _PREFIX + inner_name
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _attention(inner_name))
        if inner_name in ALL_MASK_ATTENTION_FUNCTIONS:  # else transformers builds no mask
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    return name


def install_head_sites(model: Any, modules: SiteModules, callback: SiteCallback) -> None:
    """Run the per-head sites of every layer of an HF causal LM through `callback`."""
    current = str(model.config._attn_implementation)
    model.set_attn_implementation(_register(current.removeprefix(_PREFIX)))
    for i, layer in enumerate(modules.layers):
        attention = modules.attn(layer)
        setattr(attention, _LAYER, i)
        setattr(attention, _CALLBACK, callback)
