"""Standardized sites on transformers models, read and written through module hooks.

HF modules carry a batch axis of 1 (the HF backend runs one invoke at a time); sites are
the (T, H) slice. `layers[i].input` is the block's hidden_states argument, `.output` its
first output; `attn`/`mlp` inputs are their hidden-state arguments (after the block's norm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vinterp.sites.modules import SiteModules

SiteCallback = Callable[[str, torch.Tensor], torch.Tensor | None]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _with_first(out: Any, new: torch.Tensor) -> Any:
    return (new, *out[1:]) if isinstance(out, tuple) else new


def _output_hook(site: str, callback: SiteCallback) -> Any:
    def hook(module: Any, args: Any, out: Any) -> Any:
        new = callback(site, _first(out)[0])
        return None if new is None else _with_first(out, new.unsqueeze(0))

    return hook


def _input_hook(site: str, callback: SiteCallback) -> Any:
    def hook(module: Any, args: Any, kwargs: Any) -> Any:
        if args:
            new = callback(site, args[0][0])
            return None if new is None else ((new.unsqueeze(0), *args[1:]), kwargs)
        new = callback(site, kwargs["hidden_states"][0])
        return None if new is None else (args, {**kwargs, "hidden_states": new.unsqueeze(0)})

    return hook


def install_hf_hooks(modules: SiteModules, callback: SiteCallback) -> list[Any]:
    """Hook every standardized site of an HF model; returns the hook handles."""
    handles = [modules.embed.register_forward_hook(_output_hook("embed.output", callback))]
    for i, layer in enumerate(modules.layers):
        points = [
            (f"layers.{i}", layer),
            (f"layers.{i}.attn", modules.attn(layer)),
            (f"layers.{i}.mlp", modules.mlp(layer)),
        ]
        for prefix, module in points:
            handles.append(
                module.register_forward_pre_hook(
                    _input_hook(f"{prefix}.input", callback), with_kwargs=True
                )
            )
            handles.append(module.register_forward_hook(_output_hook(f"{prefix}.output", callback)))
    handles.append(
        modules.final_norm.register_forward_hook(_output_hook("final_norm.output", callback))
    )
    return handles
