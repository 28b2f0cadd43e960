"""What vinterp reads of a running vLLM engine and of a worker's model runner, and how it
drives and stops an engine: the only reads of vLLM's configuration objects and engine
internals outside the hooks (each a declared target in `targets`).

`engine` below is a `vllm.LLM`, vLLM's `AsyncLLM`, or the OpenAI server's engine client (an
`AsyncLLM` too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EngineConfig:
    """A running engine's configuration, as vinterp uses it."""

    hf_config: Any  # the model's transformers configuration
    served_name: str
    dtype: str  # what the engine computes in ("float32", "bfloat16", ...)
    max_model_len: int
    step_tokens: int  # the most tokens one engine step computes
    step_sequences: int  # the most sequences one engine step computes
    prefix_caching: bool
    pipeline_parallel_size: int
    additional: Mapping[str, Any]  # vLLM's `additional_config` (vinterp's settings)


def engine_config(engine: Any) -> EngineConfig:
    config = getattr(engine, "llm_engine", engine).vllm_config
    model, scheduler = config.model_config, config.scheduler_config
    return EngineConfig(
        model.hf_config,
        str(model.served_model_name),
        str(model.dtype).removeprefix("torch."),
        int(model.max_model_len),
        int(scheduler.max_num_batched_tokens),
        int(scheduler.max_num_seqs),
        bool(config.cache_config.enable_prefix_caching),
        int(config.parallel_config.pipeline_parallel_size),
        config.additional_config or {},
    )


@dataclass(frozen=True)
class RunnerConfig:
    """A worker's model runner and its engine's configuration, as the sites' buffers are
    sized by it."""

    model: torch.nn.Module  # the loaded model (before vLLM compiles it)
    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    step_tokens: int  # the most tokens one step computes
    padded_step_tokens: int  # ... and the most a CUDA graph is padded to
    step_sequences: int


def runner_additional_config(runner: Any) -> Mapping[str, Any]:
    """The runner's engine's `additional_config` (read before its model loads)."""
    return runner.vllm_config.additional_config or {}


def runner_config(runner: Any) -> RunnerConfig:
    """What the sites of `runner`'s model are built with (after it loaded its model)."""
    config = runner.vllm_config
    scheduler = config.scheduler_config
    step_tokens = int(scheduler.max_num_batched_tokens)
    return RunnerConfig(
        runner.get_model(),
        runner.model_config.hf_config,
        runner.model_config.dtype,
        torch.device(runner.device),
        step_tokens,
        max(step_tokens, config.compilation_config.max_cudagraph_capture_size or 0),
        int(scheduler.max_num_seqs),
    )


def step_engine(llm: Any) -> Any:
    """The `LLMEngine` of a `vllm.LLM`, for a caller that adds requests and steps it itself
    (`add_request`, `step`, `abort_request`)."""
    return llm.llm_engine


def stop_engine_core(llm: Any) -> None:
    """Stop a `vllm.LLM`'s engine core and its workers."""
    llm.llm_engine.engine_core.shutdown()


def worker_runner(worker: Any) -> Any:
    """The model runner of a vLLM worker (the object vinterp's worker extension is mixed
    into)."""
    return worker.model_runner
