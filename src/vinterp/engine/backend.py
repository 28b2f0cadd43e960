"""What the front ends (`vinterp.LLM`, `AsyncLLM`, `Client`, `AsyncClient`) ask of whatever
runs the model: the vLLM engine, vLLM's async engine, transformers, or a `vinterp serve`
server over HTTP. The front ends hold one as `model.backend` and talk only to it.

Requests come as token ids, vLLM sampling options and each request's `RequestSpecs`
(steering, named steerings, a capture with its id); captured rows are taken afterwards by
capture id, per site as `{"positions": [...], "values": (P, H) tensor}` in position order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from vinterp.engine.engine_limits import EngineLimits
from vinterp.engine.outputs import Output
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan
from vinterp.runtime.executor import TraceResult
from vinterp.sae import SAE
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Steering

Captured = dict[str, dict[str, dict[str, Any]]]  # capture id -> site -> positions, values
StreamRequest = tuple[list[int], dict[str, Any], RequestSpecs | None]  # ids, sampling, specs


class Backend(Protocol):
    name: str  # "vllm", "hf" or "http"

    @property
    def native(self) -> Any:
        """The object it drives (a `vllm.LLM`, a transformers model, an HTTP client)."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = True,
    ) -> list[Output]: ...

    def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult: ...

    def take_captures(self, capture_ids: list[str]) -> Captured: ...

    def attach_sae(self, site: str, sae: SAE) -> None: ...

    def set_global_steering(self, steering: list[Steering]) -> None: ...

    def register_steering(self, name: str, steering: Steering | None) -> None: ...

    def steering_names(self) -> set[str]: ...

    def step_stats(self) -> dict[str, int]: ...

    def shutdown(self) -> None: ...


class StreamingBackend(Backend, Protocol):
    """A backend in this process that also feeds a long stream of requests to its engine
    (`llm.extract`): outputs as requests finish, captures taken now and read later."""

    def stream(
        self, requests: Iterable[StreamRequest], queued_tokens: int
    ) -> Iterator[tuple[int, Output]]: ...

    def take_captures_later(self, capture_ids: list[str]) -> Callable[[], Captured]: ...

    def limits(self) -> EngineLimits:
        """What the engine computes in and how much it takes at once."""
        ...


class AsyncBackend(Protocol):
    """As Backend, awaited."""

    name: str

    @property
    def native(self) -> Any: ...

    async def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = True,
    ) -> list[Output]: ...

    async def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult: ...

    async def take_captures(self, capture_ids: list[str]) -> Captured: ...

    async def attach_sae(self, site: str, sae: SAE) -> None: ...

    async def set_global_steering(self, steering: list[Steering]) -> None: ...

    async def register_steering(self, name: str, steering: Steering | None) -> None: ...

    async def steering_names(self) -> set[str]: ...

    async def step_stats(self) -> dict[str, int]: ...

    async def aclose(self) -> None: ...


def capture_ids_of(specs: list[RequestSpecs | None]) -> list[str]:
    """The capture ids of the requests that capture."""
    return [s.capture_id for s in specs if s is not None and s.capture is not None]
