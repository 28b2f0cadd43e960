"""Plain HF transformers with forward hooks on the decoder layers: what most researchers
write by hand. Batches run through the base model (no LM head), the cheapest form."""

from __future__ import annotations

from typing import Any

import torch

from .batching import PAD, batches
from .protocol import Task


def version() -> str:
    import transformers

    return transformers.__version__


def load(task: Task) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(task.model, dtype=torch.float32)
    model = model.to(task.device).eval()
    model.generation_config.eos_token_id = None  # exactly max_tokens, like ignore_eos
    model.generation_config.pad_token_id = PAD
    return model


def _tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.inference_mode()
def extract(model: Any, task: Task) -> torch.Tensor:
    seen: list[torch.Tensor] = []  # this batch's layer outputs, in layer order
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: seen.append(_tensor(out)))
        for layer in model.model.layers
    ]
    rows = []
    try:
        for ids, mask, last in batches(task.prompts, task.batch, "right", task.device):
            seen.clear()
            model.model(input_ids=ids, attention_mask=mask)
            picked = torch.arange(len(last))
            rows.append(torch.stack([h[picked, last] for h in seen], dim=1))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(rows)


def _add(vector: torch.Tensor) -> Any:
    def hook(_module: Any, _inputs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + vector, *output[1:])
        return output + vector

    return hook


@torch.inference_mode()
def steer(model: Any, task: Task, vector: torch.Tensor) -> torch.Tensor:
    hook = model.model.layers[task.layer].register_forward_hook(_add(vector.to(task.device)))
    try:
        tokens = []
        for ids, mask, _ in batches(task.prompts, task.batch, "left", task.device):
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=task.max_tokens,
                do_sample=False,
            )
            tokens.append(out[:, ids.shape[1] :])
        return torch.cat(tokens)
    finally:
        hook.remove()
