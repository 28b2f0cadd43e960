"""`vinterp.AsyncLLM`: `vinterp.LLM` on vLLM's async engine (API.md section 6).

Many traces and generations in flight at once from one process: each `async with
llm.trace(...)` records in its own task and runs when its block ends, every invoke of a
round submitted together; `await llm.generate(...)` and `async for out in llm.stream(...)`
share the engine's batches with them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from vinterp.api.llm import LocalModel
from vinterp.api.requests import Request, agenerate, deliver_all, prepare
from vinterp.api.sae_sites import check_attachable
from vinterp.api.steering_control import AsyncSteeringControl
from vinterp.api.trace import Prompt
from vinterp.engine.outputs import Output
from vinterp.sae import SAE
from vinterp.wire.probes import Probe
from vinterp.wire.specs import Capture, Steering


class AsyncLLM(LocalModel):
    """As `vinterp.LLM` (same constructor), with traces in `async with`, `await generate`,
    `async for ... in stream`, and `await llm.steering.set(...)`. vLLM backend only: the
    transformers reference is `vinterp.LLM(..., backend="hf")`."""

    asynchronous = True

    def __init__(
        self,
        model: str | Path | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        backend: Literal["vllm"] = "vllm",
        sites: dict[str, str] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if backend != "vllm":
            raise ValueError(
                "AsyncLLM runs on vLLM's async engine (backend='vllm'); the transformers "
                "reference is vinterp.LLM(model, backend='hf')"
            )
        from vinterp.engine.async_vllm_engine import AsyncVLLMEngine

        model, dtype = self._load(model, backend, pipeline_parallel_size, sites, engine_kwargs)
        self.backend = AsyncVLLMEngine(
            model,
            dtype,
            tensor_parallel_size,
            pipeline_parallel_size,
            self.settings,
            **engine_kwargs,
        )
        self._init_front_end()
        self.steering = AsyncSteeringControl(self)

    async def generate(
        self,
        prompts: Prompt | Request | list[Prompt | Request],
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        use_tqdm: bool = False,
        probes: list[Probe] | None = None,
        **sampling: Any,
    ) -> list[Output]:
        """As `LLM.generate`, awaited; every prompt in flight at once. No progress bar unless
        `use_tqdm=True` (many generations at once would draw over each other)."""
        return await agenerate(self, prompts, steering, capture, sampling, use_tqdm, probes)

    async def attach_sae(self, site: str, sae: SAE) -> None:
        """As `LLM.attach_sae`, awaited."""
        check_attachable(self.config, site, sae)
        await self.backend.attach_sae(site, sae)
        self.saes[site] = sae

    async def stream(
        self,
        prompt: Prompt | Request,
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        probes: list[Probe] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Output]:
        """One prompt's output as it grows (token ids and text so far); the last one is the
        final output and carries the captures and probe scores. Leaving the loop early aborts
        the request."""
        names = await self.backend.steering_names()
        requests = prepare(self, prompt, steering, capture, sampling, names, probes)
        if len(requests) != 1:
            raise ValueError(f"stream takes one prompt, got {len(requests)}; use generate")
        (req,) = requests
        stream = self.backend.stream(req.prompt, req.sampling, req.specs())
        async for out, finished in stream:
            if finished and req.capture_id:
                rows = await self.backend.take_captures([req.capture_id])
                deliver_all([req], [out], rows, self.model_name)
            yield out

    async def step_stats(self) -> dict[str, int]:
        """Forward steps run so far and how many ran uncompiled (see `LLM.step_stats`)."""
        return await self.backend.step_stats()
