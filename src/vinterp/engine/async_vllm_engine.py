"""The async vLLM backend: vLLM's `AsyncLLM` for `vinterp.AsyncLLM`, and the trace runner it
shares with the server's trace route."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from vinterp.engine.backend import Captured, capture_ids_of
from vinterp.engine.outputs import Output
from vinterp.engine.settings import EngineSettings
from vinterp.engine.vllm_boundary.engine_config import engine_config
from vinterp.engine.vllm_engine import (
    collected_result,
    engine_arguments,
    freeze_startup_heap,
    invoke_params,
    raise_attach_errors,
    request_params,
    to_output,
    unapplied_error,
    vllm_prompt,
)
from vinterp.engine.worker_calls import WorkerCalls
from vinterp.interventions.capture_files import FileHandoff
from vinterp.interventions.capture_store import merge_captures
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan, PlanError
from vinterp.runtime.executor import TraceResult
from vinterp.sae import SAE
from vinterp.wire.graph import to_wire
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Steering

T = TypeVar("T")
log = logging.getLogger(__name__)


async def final_output(engine: Any, prompt: dict[str, Any], params: Any) -> Output:
    """One request on vLLM's async engine, to its final output."""
    final = None
    async for out in engine.generate(prompt, params, f"vinterp-{uuid.uuid4().hex}"):
        final = out
    assert final is not None, "vLLM's generate ended without an output"
    return to_output(final)


async def run_trace(
    engine: Any, wire: dict[str, Any], graph: Graph, plan: Plan, use_tqdm: bool = False
) -> tuple[list[Output], list[Any]]:
    """A trace on vLLM's async engine (`engine`: its `AsyncLLM`): the graph sent to the workers
    once, every invoke of a round in flight at once, rounds in order, the saves collected even
    when a round fails. Returns the outputs and every worker's report."""
    trace_id = uuid.uuid4().hex
    workers = WorkerCalls.of(engine)
    errors = await workers.begin(trace_id, wire)
    if any(errors):
        await workers.forget(trace_id)
        raise PlanError(next(e for e in errors if e))
    salted = engine_config(engine).prefix_caching
    bar = tqdm(total=len(graph.invokes), desc="trace", disable=not use_tqdm)

    async def complete(k: int) -> Output:
        prompt = vllm_prompt(graph.invokes[k].prompt, salted)
        out = await final_output(engine, prompt, invoke_params(graph, k, trace_id))
        bar.update()
        return out

    outputs: list[Any] = [None] * len(graph.invokes)
    try:
        for round_ in plan.rounds:
            for k, out in zip(round_, await asyncio.gather(*(complete(k) for k in round_))):
                outputs[k] = out
    finally:
        bar.close()
        per_worker = await workers.collect(trace_id)
    return outputs, per_worker


class AsyncVLLMEngine:
    """The async vLLM backend: owns one vLLM `AsyncLLM`, on a private event loop in its own
    thread.

    vLLM's engine client binds its output handler to the loop it first ran on; keeping it on
    a loop of its own lets callers on any loop (several `asyncio.run` calls, a notebook's
    loop, threads) share one engine. Every call hops onto that loop and back; cancelling the
    caller cancels the request there (vLLM then aborts it)."""

    name = "vllm"

    def __init__(
        self,
        model: Path | str,
        dtype: str,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        settings: EngineSettings,
        **engine_kwargs: Any,
    ) -> None:
        arguments = engine_arguments(
            model, dtype, tensor_parallel_size, pipeline_parallel_size, settings, engine_kwargs
        )
        arguments.setdefault("disable_log_stats", True)  # as vllm.LLM: no periodic stats lines
        self.check_applied = settings.check_applied
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vinterp-async-engine", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self.llm = asyncio.run_coroutine_threadsafe(_start(arguments), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        freeze_startup_heap()
        self.workers: WorkerCalls[Any] = WorkerCalls.of(self.llm)  # answers are awaitables
        self._prefix_caching = engine_config(self.llm).prefix_caching
        self._global_steering = False
        self._named: set[str] = set()
        self._handoff = FileHandoff()
        atexit.register(self.shutdown)

    @property
    def native(self) -> Any:
        return self.llm

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("this AsyncLLM was shut down")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _prompt(self, ids: list[int], intervened: bool) -> dict[str, Any]:
        return vllm_prompt(ids, (intervened or self._global_steering) and self._prefix_caching)

    async def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = True,
    ) -> list[Output]:
        """Every prompt in flight at once (vLLM batches them); outputs in prompt order."""
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)

        async def one(ids: list[int], s: dict[str, Any], r: RequestSpecs | None) -> Output:
            prompt = self._prompt(ids, r is not None)
            out = await final_output(self.llm, prompt, request_params(s, r))
            bar.update()
            return out

        async def every() -> list[Output]:
            return list(await asyncio.gather(*(one(*a) for a in zip(prompts, sampling, specs))))

        try:
            outputs = await self._on_loop(every())
        finally:
            bar.close()
        await self._check_applied(capture_ids_of(specs))
        return outputs

    async def _check_applied(self, capture_ids: list[str]) -> None:
        """As `VLLMEngine._check_applied`; concurrent calls may see each other's findings."""
        if not self.check_applied:
            return
        error = unapplied_error(await self._on_loop(self.workers.unapplied()))
        if error is not None:
            if capture_ids:
                await self.take_captures(capture_ids)
            raise error

    async def stream(
        self, prompt: list[int], sampling: dict[str, Any], specs: RequestSpecs | None
    ) -> AsyncIterator[tuple[Output, bool]]:
        """(partial output, finished) as vLLM makes them; leaving early aborts the request."""
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def send(kind: str, value: Any) -> None:
            caller.call_soon_threadsafe(queue.put_nowait, (kind, value))

        async def pump() -> None:
            try:
                params = request_params(sampling, specs)
                request_id = f"vinterp-{uuid.uuid4().hex}"
                async for out in self.llm.generate(
                    self._prompt(prompt, specs is not None), params, request_id
                ):
                    send("output", (to_output(out), bool(out.finished)))
            except Exception as exc:  # handed to the consumer, which raises it
                send("error", exc)
            finally:
                send("end", None)

        if self._closed:
            raise RuntimeError("this AsyncLLM was shut down")
        running = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "end":
                    await self._check_applied([])  # after the last chunk: all steps ran
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            running.cancel()

    async def take_captures(self, capture_ids: list[str]) -> Captured:
        args = (capture_ids, self._handoff.request())
        blocks = await self._on_loop(self.workers.take_captures(*args))
        return await asyncio.to_thread(merge_captures, blocks, self._handoff.tensor)

    async def step_stats(self) -> dict[str, int]:
        return (await self._on_loop(self.workers.step_stats()))[0]

    async def set_global_steering(self, steering: list[Steering]) -> None:
        wires = [s.to_wire() for s in steering]
        await self._on_loop(self.workers.set_steering(wires))
        self._global_steering = bool(steering)

    async def attach_sae(self, site: str, sae: SAE) -> None:
        """Send the SAE to every worker once (as data: `SAE.to_wire`)."""
        rpc = self.workers.attach_sae(site, sae.to_wire())
        raise_attach_errors(await self._on_loop(rpc))

    async def register_steering(self, name: str, steering: Steering | None) -> None:
        wire = None if steering is None else steering.to_wire()
        rpc = self.workers.register_steering(name, wire)
        await self._on_loop(rpc)
        self._named = self._named - {name} if steering is None else self._named | {name}

    async def steering_names(self) -> set[str]:
        return set(self._named)

    async def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        outputs, per_worker = await self._on_loop(
            run_trace(self.llm, to_wire(graph), graph, plan, use_tqdm)
        )
        await self._check_applied([])
        return collected_result(outputs, per_worker)

    def shutdown(self) -> None:
        """Stop the engine core, its workers and the loop; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            asyncio.run_coroutine_threadsafe(_shutdown(self.llm), self._loop).result(120)
        except Exception:  # already torn down by vLLM's own finalizers
            log.debug("vLLM async engine shutdown raised", exc_info=True)
        self._stop_loop()
        self._handoff.close()
        gc.unfreeze()  # the engine's objects can be collected again

    async def aclose(self) -> None:
        self.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


async def _start(arguments: dict[str, Any]) -> Any:
    """vLLM's AsyncLLM, built on the engine's own loop (its output handler starts there)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments))


async def _shutdown(engine: Any) -> None:
    engine.shutdown()
