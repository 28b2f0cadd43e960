"""transformers' own attention probabilities, the reference for `layers.{i}.attn.pattern`."""

from __future__ import annotations

from pathlib import Path

import torch


def eager_attentions(path: str | Path, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Per layer (heads, T, T): eager attention with `output_attentions`, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_attentions=True)
    return tuple(a[0] for a in out.attentions)
