"""What a generation returns, identical in shape on every backend."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Output:
    """One prompt's result: the completion text and token ids (plus later captures)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    captures: dict[str, torch.Tensor] = field(default_factory=dict)
    capture_file: str | None = None
