"""Puts the site ops into a loaded vLLM model (before it is compiled).

Each site module's `forward` is wrapped on the instance, so module names and weights stay
as vLLM built them (`llm.raw.<path>` still names vLLM's modules). Layouts, detected from the
loaded modules:
- most sites hold the module's (tokens, H) tensor (a tuple output's first element);
- blocks whose forward takes a `residual` pass (hidden, residual) between blocks, their sum
  being the HF residual stream (layer 0's input is the embedding alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vinterp.runtime import site_ops
from vinterp.sites.modules import SiteModules
from vinterp.sites.names import SiteOrder

_HIDDEN_KWARGS = ("hidden_states", "x")


def _wrap(owner: Any, method: str, wrapper: Callable[..., Any]) -> None:
    inner = getattr(owner, method)
    setattr(owner, method, lambda *args, **kwargs: wrapper(inner, *args, **kwargs))


def _input_site(module: nn.Module, site_id: int) -> None:
    """Site on the hidden-state argument: keyword `hidden_states`/`x`, else the first one."""

    def forward(inner: Any, *args: Any, **kwargs: Any) -> Any:
        key = next((k for k in _HIDDEN_KWARGS if k in kwargs), None)
        if key is not None:
            kwargs[key] = torch.ops.vinterp.site(kwargs[key], site_id)
        else:
            args = (torch.ops.vinterp.site(args[0], site_id), *args[1:])
        return inner(*args, **kwargs)

    _wrap(module, "forward", forward)


def _output_site(owner: Any, site_id: int, method: str = "forward") -> None:
    def forward(inner: Any, *args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if isinstance(out, tuple):
            return (torch.ops.vinterp.site(out[0], site_id), *out[1:])
        return torch.ops.vinterp.site(out, site_id)

    _wrap(owner, method, forward)


def _stream_sites(layer: nn.Module, input_id: int, output_id: int) -> None:
    def forward(inner: Any, positions: Any, hidden: Any, residual: Any, **kwargs: Any) -> Any:
        if residual is None:
            hidden = torch.ops.vinterp.site(hidden, input_id)
        else:
            hidden, residual = torch.ops.vinterp.stream(hidden, residual, input_id)
        hidden, residual = inner(positions, hidden, residual, **kwargs)
        return torch.ops.vinterp.stream(hidden, residual, output_id)

    _wrap(layer, "forward", forward)


def _passes_residual(layer: nn.Module) -> bool:
    return "residual" in inspect.signature(layer.forward).parameters


def install_vllm_sites(modules: SiteModules, order: SiteOrder) -> None:
    """Wrap every site module of a vLLM model with the site ops."""
    assert site_ops.LIBRARY is not None  # registers torch.ops.vinterp.*
    _output_site(modules.embed, order["embed.output"], modules.embed_method)
    for i, layer in enumerate(modules.layers):
        if not modules.holds_layer(layer):
            continue
        inner_modules = [
            (modules.attn(layer), "attn.input", "attn.output"),
            (modules.mlp_input(layer), "mlp.input", None),
            (modules.mlp_output(layer), None, "mlp.output"),
        ]
        for module, input_site, output_site in inner_modules:
            if input_site:
                _input_site(module, order[f"layers.{i}.{input_site}"])
            if output_site:
                _output_site(module, order[f"layers.{i}.{output_site}"])
        if _passes_residual(layer):
            _stream_sites(layer, order[f"layers.{i}.input"], order[f"layers.{i}.output"])
        else:
            _input_site(layer, order[f"layers.{i}.input"])
            _output_site(layer, order[f"layers.{i}.output"])
    _output_site(modules.final_norm, order["final_norm.output"])
