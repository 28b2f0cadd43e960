"""Prompts of different lengths as padded batches, for the tools that batch by hand."""

from __future__ import annotations

from collections.abc import Iterator

import torch

PAD = 0  # any id: padded positions are masked out


def batches(
    prompts: list[list[int]], size: int, side: str, device: str = "cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, index of each prompt's last token) per `size` prompts.
    Right padding keeps every real token at its own position (extraction); generation
    needs left padding, so that new tokens follow every prompt directly. `ids` and `mask`
    are on `device` (the tool's)."""
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            span = slice(0, len(prompt)) if side == "right" else slice(width - len(prompt), width)
            ids[row, span] = torch.tensor(prompt)
            mask[row, span] = 1
        last = mask.sum(1) - 1 if side == "right" else torch.full((len(chunk),), width - 1)
        yield ids.to(device), mask.to(device), last
