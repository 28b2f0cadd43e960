"""Steering and capture against plain vLLM (no vinterp in the engine), same machine, same run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from vinterp.bench.harness import Row, best_time

PROMPT_TEMPLATE = "Write a short story about a robot number {i} who learns to paint."


def plain_vllm_time(model: Path, prompts: list[str], max_tokens: int, repeats: int) -> float:
    """Time vLLM alone: an engine started without vinterp's plugin or site ops."""
    import vllm

    from vinterp.engine.cpu_settings import configure_cpu_environment
    from vinterp.engine.plugin import ENV_FLAG

    os.environ.pop(ENV_FLAG, None)
    configure_cpu_environment(1)
    llm = vllm.LLM(model=str(model), dtype="float32", enable_prefix_caching=False, seed=0)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        return best_time(lambda: llm.generate(prompts, params, use_tqdm=False), repeats)
    finally:
        llm.llm_engine.engine_core.shutdown()


def run(model: Path, prompts: int = 64, max_tokens: int = 32, repeats: int = 3) -> list[Row]:
    import vinterp

    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(prompts)]
    baseline = plain_vllm_time(model, texts, max_tokens, repeats)
    llm = vinterp.LLM(model)
    vector = torch.randn(int(llm.config.hidden_size), generator=torch.Generator().manual_seed(0))
    layer = len(llm.layers) // 3
    workloads: list[tuple[str, dict[str, Any], float]] = [
        ("vinterp engine, no intervention", {}, 1.05),
        (
            f"steering layers.{layer}.output",
            {"steering": vinterp.Steering({f"layers.{layer}.output": vector}, scale=4.0)},
            1.05,
        ),
        (
            f"capture layers.{layer}.output last_prompt",
            {"capture": vinterp.Capture(f"layers.{layer}.output")},
            1.05,
        ),
        (
            "capture layers.*.output all positions",
            {"capture": vinterp.Capture("layers.*.output", positions="all")},
            1.5,
        ),
    ]
    rows = []
    try:
        for name, kwargs, target in workloads:

            def generate(kwargs: dict[str, Any] = kwargs) -> None:
                llm.generate(texts, max_tokens=max_tokens, ignore_eos=True, **kwargs)

            rows.append(
                Row(
                    f"{name} ({prompts}x{max_tokens})",
                    baseline,
                    best_time(generate, repeats),
                    target,
                )
            )
    finally:
        llm.shutdown()
    return rows
