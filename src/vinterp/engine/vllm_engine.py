"""The vLLM backend: starts a vLLM engine with this machine's settings and generates with it."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from vinterp.engine.backend import Captured, StreamRequest, capture_ids_of
from vinterp.engine.engine_limits import EngineLimits
from vinterp.engine.outputs import Output
from vinterp.engine.platform_settings import configure_engine_environment
from vinterp.engine.settings import EngineSettings
from vinterp.engine.vllm_boundary.engine_config import engine_config, step_engine, stop_engine_core
from vinterp.engine.vllm_boundary.engine_core_calls import collective_rpc_later, engine_alive
from vinterp.engine.vllm_boundary.model_registry import (
    freeze_gc_heap,
    transformers_backend_architectures,
)
from vinterp.engine.vllm_boundary.targets import check_boundary
from vinterp.engine.worker_calls import WorkerCalls
from vinterp.errors import InterventionError
from vinterp.interventions.capture_files import FileHandoff
from vinterp.interventions.capture_store import merge_captures
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan, PlanError
from vinterp.runtime.executor import Failure, TraceResult
from vinterp.sae import SAE
from vinterp.wire.graph import to_wire
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.saved_values import decode_saved
from vinterp.wire.specs import EXTRA_ARGS_KEY, Steering

log = logging.getLogger(__name__)


# vLLM engine arguments whose steps vinterp cannot follow: a draft model that runs through the
# target's sites after the step (speculative decoding), micro-batches on two streams (dual-batch
# overlap), engines that step apart (data parallelism)
# name -> (the feature it turns on, its values that leave the feature off)
UNSUPPORTED_ENGINE_ARGUMENTS = {
    "speculative_config": ("speculative decoding", (None, {})),
    "enable_dbo": ("dual-batch overlap", (None, False)),
    "data_parallel_size": ("data parallelism", (None, 1)),
}


def check_engine_features(engine_kwargs: dict[str, Any]) -> None:
    """Refuse engine arguments whose steps the sites cannot follow, before the engine starts."""
    for name, (feature, off) in UNSUPPORTED_ENGINE_ARGUMENTS.items():
        value = engine_kwargs.get(name)
        if not any(value is o or (type(value) is type(o) and value == o) for o in off):
            raise ValueError(
                f"{name}={value!r}: vinterp does not support {feature} yet (its steps would "
                f"run past the sites' per-step tables); start the engine without {name}"
            )


def check_native_model(config: Any, engine_kwargs: dict[str, Any]) -> None:
    """Refuse models vLLM would run through its Transformers backend.

    On this vLLM (0.32, CPU) that backend's outputs differ from transformers' for the same
    weights (GPT-NeoX: greedy tokens diverge from the first one, plain vLLM without vinterp),
    so sites there would equal wrong values. Such models run with backend="hf".
    """
    architectures = list(getattr(config, "architectures", None) or [])
    via_backend = [a for a in architectures if a in transformers_backend_architectures()]
    if via_backend or engine_kwargs.get("model_impl") == "transformers":
        name = via_backend[0] if via_backend else "this model"
        raise ValueError(
            f"{name} runs on vLLM only through vLLM's Transformers backend, whose outputs "
            "differ from transformers' on this vLLM version, so vinterp's sites would be "
            "wrong; load it with vinterp.LLM(..., backend='hf')"
        )


def vinterp_engine_arguments(settings: EngineSettings) -> dict[str, Any]:
    """What makes a vLLM engine a vinterp one (sites, worker RPCs), for `vllm.LLM` and for
    `vinterp serve` alike: `settings` for the workers, prefix caching off (DESIGN.md lesson 1:
    hooks would miss cached tokens), a fixed seed."""
    check_boundary()
    return {
        "enable_prefix_caching": False,
        "seed": 0,
        "worker_extension_cls": "vinterp.engine.worker_ext.VinterpWorkerExtension",
        "additional_config": settings.to_config(),
    }


def engine_arguments(
    model: Path | str,
    dtype: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    settings: EngineSettings,
    engine_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """vLLM's engine arguments for a vinterp engine (sync and async alike), after the
    platform's settings for that many workers; `engine_kwargs` are vLLM's own. With
    `num_layers`, vLLM builds that many layers (`hf_overrides`) and the workers load only
    theirs (`vllm_boundary.kept_layers`)."""
    configure_engine_environment(tensor_parallel_size * pipeline_parallel_size)
    if settings.num_layers is not None:
        overrides = engine_kwargs.pop("hf_overrides", None) or {}
        engine_kwargs["hf_overrides"] = {**overrides, "num_hidden_layers": settings.num_layers}
    return {
        "model": str(model),
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        **vinterp_engine_arguments(settings),
        **engine_kwargs,
    }


def vllm_prompt(ids: list[int], salted: bool) -> dict[str, Any]:
    """vLLM's prompt for token ids. With prefix caching on, an intervened request is salted
    (its own cache salt): cached blocks skip the forward (DESIGN.md lesson 1), so its prompt
    is computed in full while plain requests keep sharing the cache."""
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if salted:
        prompt["cache_salt"] = uuid.uuid4().hex
    return prompt


class VLLMEngine:
    """The vLLM backend: owns one `vllm.LLM`; `shutdown()` stops its engine core and worker
    processes."""

    name = "vllm"

    def __init__(
        self,
        model: Path,
        dtype: str,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        settings: EngineSettings,
        **engine_kwargs: Any,
    ) -> None:
        import vllm

        sizes = (tensor_parallel_size, pipeline_parallel_size)
        arguments = engine_arguments(model, dtype, *sizes, settings, engine_kwargs)
        self.check_applied = settings.check_applied
        self.llm = vllm.LLM(**arguments)
        self.workers: WorkerCalls[list[Any]] = WorkerCalls.of(self.llm)
        # a take of captures is answered without waiting for the engine's step
        self._later = WorkerCalls(functools.partial(collective_rpc_later, self.llm))
        freeze_startup_heap()
        self._closed = False
        self._prefix_caching = engine_config(self.llm).prefix_caching
        self._global_steering = False
        self._named: set[str] = set()
        self._handoff = FileHandoff(alive=engine_alive(self.llm))
        atexit.register(self.shutdown)

    @property
    def native(self) -> Any:
        return self.llm

    def _prompt(self, ids: list[int], intervened: bool) -> dict[str, Any]:
        return vllm_prompt(ids, (intervened or self._global_steering) and self._prefix_caching)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = True,
    ) -> list[Output]:
        """Generate for token-id prompts, in order, each with its steering and capture."""
        params = [request_params(s, r) for s, r in zip(sampling, specs)]
        results = self.llm.generate(
            [self._prompt(ids, r is not None) for ids, r in zip(prompts, specs)],
            params,
            use_tqdm=use_tqdm,
        )
        self._check_applied(capture_ids_of(specs))
        return [to_output(r) for r in results]

    def _check_applied(self, capture_ids: list[str]) -> None:
        """With the check on: what the sites did not apply is an error (the call's captures
        are dropped with it)."""
        if not self.check_applied:
            return
        error = unapplied_error(self.workers.unapplied())
        if error is not None:
            if capture_ids:
                self.take_captures(capture_ids)
            raise error

    def take_captures(self, capture_ids: list[str]) -> Captured:
        """Captured rows per capture id and site, merged over workers (PP stages differ)."""
        return self.take_captures_later(capture_ids)()

    def take_captures_later(self, capture_ids: list[str]) -> Callable[[], Captured]:
        """Ask the workers for the rows now, without waiting for the engine's step to end;
        the returned call gives them once the workers have answered and written them
        (`capture_files`), so its wait can run on another thread while the engine computes."""
        args = (capture_ids, self._handoff.request())
        answers = self._later.take_captures(*args)
        return lambda: merge_captures(answers(), self._handoff.tensor)

    def stream(
        self, requests: Iterable[StreamRequest], queued_tokens: int
    ) -> Iterator[tuple[int, Output]]:
        """(index, output) of each request as it finishes, keeping about `queued_tokens`
        prompt tokens queued in the engine: the engine never waits between batches (no
        batch's last, part-full step) and the requests not yet queued cost nothing. Closing
        the stream early (or an error) aborts the requests still queued."""
        engine = step_engine(self.llm)
        pending = enumerate(requests)
        queued: dict[str, tuple[int, int]] = {}  # request id -> (index, prompt tokens)
        total = 0
        try:
            while True:
                while (total < queued_tokens or not queued) and (
                    item := next(pending, None)
                ) is not None:
                    index, (ids, sampling, specs) = item
                    request_id = f"vinterp-stream-{uuid.uuid4().hex}"
                    prompt = self._prompt(ids, specs is not None)
                    engine.add_request(request_id, prompt, request_params(sampling, specs))
                    queued[request_id] = (index, len(ids))
                    total += len(ids)
                if not queued:
                    return
                for result in engine.step():
                    if result.finished:
                        index, size = queued.pop(result.request_id)
                        total -= size
                        yield index, to_output(result)
        finally:
            if queued:
                with contextlib.suppress(Exception):  # a dead engine has nothing to abort
                    engine.abort_request(list(queued))

    def limits(self) -> EngineLimits:
        """Its dtype, longest prompt (vLLM keeps room for one generated token) and step size,
        as vLLM resolved them."""
        config = engine_config(self.llm)
        return EngineLimits(
            config.dtype, config.max_model_len - 1, config.step_tokens, config.step_sequences
        )

    def step_stats(self) -> dict[str, int]:
        """Forward steps run so far, and how many of them ran uncompiled (first worker)."""
        return self.workers.step_stats()[0]

    def set_global_steering(self, steering: list[Steering]) -> None:
        self._global_steering = bool(steering)
        self.workers.set_steering([s.to_wire() for s in steering])

    def attach_sae(self, site: str, sae: SAE) -> None:
        """Send the SAE to every worker once (as data: `SAE.to_wire`)."""
        raise_attach_errors(self.workers.attach_sae(site, sae.to_wire()))

    def register_steering(self, name: str, steering: Steering | None) -> None:
        wire = None if steering is None else steering.to_wire()
        self.workers.register_steering(name, wire)
        self._named = self._named - {name} if steering is None else self._named | {name}

    def steering_names(self) -> set[str]:
        return set(self._named)

    def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        """Send the graph once, run the invokes round by round, collect saves and failure."""
        trace_id = uuid.uuid4().hex
        errors = self.workers.begin(trace_id, to_wire(graph))
        if any(errors):
            self.workers.forget(trace_id)
            raise PlanError(next(e for e in errors if e))
        outputs: list[Output | None] = [None] * len(graph.invokes)
        try:
            for round_ in plan.rounds:
                params = [invoke_params(graph, k, trace_id) for k in round_]
                prompts = [self._prompt(graph.invokes[k].prompt, True) for k in round_]
                results = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
                for k, result in zip(round_, results):
                    outputs[k] = to_output(result)
        finally:
            per_worker = self.workers.collect(trace_id)
        self._check_applied([])
        return collected_result(outputs, per_worker)

    def shutdown(self) -> None:
        """Stop the engine core and its workers; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            stop_engine_core(self.llm)
        except Exception:  # already torn down by vLLM's own finalizers
            log.debug("vLLM engine shutdown raised", exc_info=True)
        self._handoff.close()
        gc.unfreeze()  # the engine's objects can be collected again


def freeze_startup_heap() -> None:
    """Leave every object alive after an engine start out of the cyclic garbage collector's
    scans until shutdown, as vLLM's engine core does in its own process. Without it a full
    collection in the front end scans torch's, transformers' and vLLM's objects: 0.66 s
    measured on the CPU machine, landing at random inside a run (a capture's take)."""
    freeze_gc_heap()


def request_params(sampling: dict[str, Any], specs: RequestSpecs | None) -> Any:
    """vLLM's sampling parameters for a request with (or without) interventions.

    Each request gets its own object, so vLLM need not deep-copy it (with its extra_args) per
    request, as its own OpenAI server does not."""
    import vllm

    extra_args = {EXTRA_ARGS_KEY: specs.to_wire()} if specs is not None else None
    return vllm.SamplingParams(**{**sampling, "skip_clone": True}, extra_args=extra_args)


def invoke_params(graph: Graph, invoke: int, trace_id: str) -> Any:
    """vLLM's sampling parameters for one invoke of a trace (the workers find it by them)."""
    return request_params(graph.invokes[invoke].sampling, RequestSpecs(trace=(trace_id, invoke)))


def raise_attach_errors(per_worker: list[str | None]) -> None:
    """The first worker's refusal of an SAE, as a ValueError."""
    error = next((e for e in per_worker if e), None)
    if error is not None:
        raise ValueError(error)


def unapplied_error(per_worker: list[list[str]]) -> InterventionError | None:
    """One error for what the workers' applied checks found (None: everything applied)."""
    messages = list(dict.fromkeys(m for found in per_worker for m in found))  # TP ranks alike
    if not messages:
        return None
    more = f"; and {len(messages) - 5} more" if len(messages) > 5 else ""
    return InterventionError(
        "vinterp's applied check: interventions were not applied, so the results would be "
        f"wrong: {'; '.join(messages[:5])}{more}"
    )


def collected_result(outputs: list[Any], per_worker: list[dict[str, Any]]) -> TraceResult:
    """One result from every worker's report: TP ranks report the same values, PP stages
    their own; the first failure wins."""
    saved: dict[int, Any] = {}
    failure = None
    for collected in per_worker:
        for node, value in collected["saved"].items():
            saved.setdefault(int(node), decode_saved(value))
        failure = failure or collected["failure"]
    return TraceResult(outputs, saved, Failure(**failure) if failure else None)


def to_output(result: Any) -> Output:
    return Output(
        prompt_token_ids=list(result.prompt_token_ids or []),
        token_ids=list(result.outputs[0].token_ids),
        text=result.outputs[0].text,
    )
