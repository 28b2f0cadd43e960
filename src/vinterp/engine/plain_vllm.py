"""Plain vLLM — the same engine without vinterp's sites — for the comparisons benchmarks and
tests make against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vinterp.engine.platform_settings import configure_engine_environment
from vinterp.engine.vllm_boundary.engine_config import stop_engine_core


def start_plain_vllm(
    model: str | Path, dtype: str, enforce_eager: bool = False, **engine_kwargs: Any
) -> Any:
    """A `vllm.LLM` without vinterp's site ops, with vinterp's engine settings (prefix
    caching off, seed 0) and this machine's platform settings."""
    import vllm

    world = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get(
        "pipeline_parallel_size", 1
    )
    configure_engine_environment(world)
    return vllm.LLM(
        model=str(model),
        dtype=dtype,
        enable_prefix_caching=False,
        seed=0,
        enforce_eager=enforce_eager,
        **engine_kwargs,
    )


def shutdown_plain_vllm(llm: Any) -> None:
    stop_engine_core(llm)


def greedy_params(max_tokens: int, ignore_eos: bool = False) -> Any:
    """vLLM's sampling parameters for `max_tokens` greedy tokens."""
    import vllm

    return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
