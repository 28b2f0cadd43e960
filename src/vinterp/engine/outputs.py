"""What a generation returns, identical in shape on every backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Output:
    """One prompt's result: the completion text and token ids (plus later captures and
    probe scores: `probes[name]`, (tokens read, outputs) float32)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    captures: dict[str, torch.Tensor] = field(default_factory=dict)
    capture_file: str | None = None
    probes: dict[str, torch.Tensor] = field(default_factory=dict)


def output_to_json(out: Output) -> dict[str, Any]:
    """The tokens and text of an output (what a server returns for a trace's invoke)."""
    return {"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text}
