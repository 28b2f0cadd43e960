"""What a backend's engine computes in and how much it takes at once (`backend.limits()`: read
from the engine itself, vLLM's resolved configuration or the transformers model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    dtype: str  # what the engine computes in, and what captures come back in
    max_prompt_len: int | None  # the longest prompt it takes with one token to generate
    step_tokens: int | None  # the most tokens one engine step computes
    step_sequences: int | None = None  # the most sequences one engine step computes
