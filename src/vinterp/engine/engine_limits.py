"""What a backend's engine computes in and how much it takes at once, read from the engine
itself (vLLM's resolved configuration, or the transformers model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineLimits:
    dtype: str  # what the engine computes in, and what captures come back in
    max_prompt_len: int | None  # the longest prompt it takes with one token to generate
    step_tokens: int | None  # the most tokens one engine step computes
    step_sequences: int | None = None  # the most sequences one engine step computes


def engine_limits(backend: Any, config: Any) -> EngineLimits:
    """The limits of a `vinterp.LLM`'s backend (`config`: the model's HF configuration)."""
    if backend.name == "vllm":
        vllm_config = backend.native.llm_engine.vllm_config
        model_config = vllm_config.model_config
        return EngineLimits(
            str(model_config.dtype).removeprefix("torch."),
            int(model_config.max_model_len) - 1,  # vLLM keeps room for the generated token
            int(vllm_config.scheduler_config.max_num_batched_tokens),
            int(vllm_config.scheduler_config.max_num_seqs),
        )
    positions = getattr(config, "max_position_embeddings", None)
    return EngineLimits(
        str(backend.native.dtype).removeprefix("torch."),
        None if positions is None else int(positions) - 1,
        None,
    )
