"""Puts the site ops into a loaded vLLM model (before it is compiled).

Each site module's `forward` is wrapped on the instance, so module names and weights stay
as vLLM built them (`llm.raw.<path>` still names vLLM's modules). Layout per site:
- `embed.output`, `attn.*`, `mlp.*`, `final_norm.output`: the module's (tokens, H) tensor;
- `layers.{i}.input|output`: vLLM passes (hidden, residual) between blocks, their sum being
  the HF residual stream (layer 0's input is the embedding alone).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vinterp.runtime import site_ops
from vinterp.sites.modules import SiteModules
from vinterp.sites.names import SiteOrder


def _wrap(module: nn.Module, wrapper: Any) -> None:
    inner = module.forward
    module.forward = lambda *args, **kwargs: wrapper(inner, *args, **kwargs)  # type: ignore[method-assign]


def _io_sites(module: nn.Module, input_id: int, output_id: int, arg: str) -> None:
    """A module whose hidden input is positional arg 0 or keyword `arg`; output a tensor."""

    def forward(inner: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (torch.ops.vinterp.site(args[0], input_id), *args[1:])
        else:
            kwargs[arg] = torch.ops.vinterp.site(kwargs[arg], input_id)
        return torch.ops.vinterp.site(inner(*args, **kwargs), output_id)

    _wrap(module, forward)


def _layer_sites(layer: nn.Module, input_id: int, output_id: int) -> None:
    def forward(inner: Any, positions: Any, hidden: Any, residual: Any, **kwargs: Any) -> Any:
        if residual is None:
            hidden = torch.ops.vinterp.site(hidden, input_id)
        else:
            hidden, residual = torch.ops.vinterp.stream(hidden, residual, input_id)
        hidden, residual = inner(positions, hidden, residual, **kwargs)
        return torch.ops.vinterp.stream(hidden, residual, output_id)

    _wrap(layer, forward)


def _output_site(module: nn.Module, output_id: int) -> None:
    def forward(inner: Any, *args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if isinstance(out, tuple):
            return (torch.ops.vinterp.site(out[0], output_id), *out[1:])
        return torch.ops.vinterp.site(out, output_id)

    _wrap(module, forward)


def install_vllm_sites(modules: SiteModules, order: SiteOrder) -> None:
    """Wrap every site module of a vLLM Llama-family model with the site ops."""
    assert site_ops.site is not None  # registers torch.ops.vinterp.*
    _output_site(modules.embed, order["embed.output"])
    for i, layer in enumerate(modules.layers):
        if not hasattr(layer, modules.attn_name):
            continue  # a pipeline stage's placeholder for a layer another stage owns
        _layer_sites(layer, order[f"layers.{i}.input"], order[f"layers.{i}.output"])
        _io_sites(
            modules.attn(layer),
            order[f"layers.{i}.attn.input"],
            order[f"layers.{i}.attn.output"],
            "hidden_states",
        )
        _io_sites(
            modules.mlp(layer), order[f"layers.{i}.mlp.input"], order[f"layers.{i}.mlp.output"], "x"
        )
    _output_site(modules.final_norm, order["final_norm.output"])
