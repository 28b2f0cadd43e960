"""Sampling settings shared by both backends: vLLM's SamplingParams names, vinterp's defaults."""

from __future__ import annotations

from typing import Any

# Researchers want reproducible runs: greedy unless they ask otherwise.
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16}


def sampling_kwargs(overrides: dict[str, Any]) -> dict[str, Any]:
    """vinterp's defaults updated with the caller's keyword arguments."""
    return {**DEFAULT_SAMPLING, **overrides}
