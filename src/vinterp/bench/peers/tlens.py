"""TransformerLens' `TransformerBridge` over the HF model: `run_with_cache` filtered to the
blocks' `hook_resid_post` (stopping after the last block), and a forward hook on one
block's `hook_resid_post` during `generate`."""

from __future__ import annotations

from typing import Any

import torch

from .batching import batches
from .protocol import Task


def version() -> str:
    from importlib.metadata import version as installed

    return installed("transformer-lens")


def load(task: Task) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(task.model, device=task.device, dtype=torch.float32)


def _resid(layer: int) -> str:
    return f"blocks.{layer}.hook_resid_post"


@torch.no_grad()
def extract(bridge: Any, task: Task) -> torch.Tensor:
    names = [_resid(i) for i in range(bridge.cfg.n_layers)]
    rows = []
    for ids, mask, last in batches(task.prompts, task.batch, "right", task.device):
        _, cache = bridge.run_with_cache(
            ids,
            attention_mask=mask,
            names_filter=names,
            return_type=None,
            prepend_bos=False,
        )
        picked = torch.arange(len(last))
        rows.append(torch.stack([cache[name][picked, last] for name in names], dim=1))
    return torch.cat(rows)


@torch.no_grad()
def steer(bridge: Any, task: Task, vector: torch.Tensor) -> torch.Tensor:
    vector = vector.to(task.device)
    tokens = []
    add = [(_resid(task.layer), lambda act, hook: act + vector)]
    with bridge.hooks(fwd_hooks=add):
        for ids, mask, _ in batches(task.prompts, task.batch, "left", task.device):
            out = bridge.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=task.max_tokens,
                do_sample=False,
                stop_at_eos=False,
                prepend_bos=False,
                padding_side="left",
                verbose=False,
            )
            tokens.append(out[:, ids.shape[1] :])
    return torch.cat(tokens)
