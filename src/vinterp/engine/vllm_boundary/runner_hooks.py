"""How vinterp follows each step of vLLM's model runners (V1, its CPU subclass, and V2).

Every runner gets the same four hooks, placed where that runner exposes them:
- the scheduler's output, before the step's graph mode is chosen (`execute_model`): read
  into a `StepSchedule` (`step_schedule`), `runtime.on_schedule` plans steering and says
  whether the step runs uncompiled;
- the graph-mode choice: an uncompiled step is forced out of CUDA graphs (V1:
  `_determine_batch_execution_and_padding(force_eager=...)`, V2: `dispatch_cg_and_sync_dp(
  need_eager=...)`) and the model's forward skips the compiled code (vLLM's own
  `skip_compiled` switch), so the Python at the sites runs, on the kernels an
  `enforce_eager=True` engine uses (`eager_kernels`);
- the batch layout, once the runner has built it: `runtime.begin_step`; the forward queued,
  after `execute_model`: `runtime.end_step`;
- logits and sampled tokens, outside the model (`compute_logits`, the sampler).
A runner of another kind is refused at engine start: running it without these hooks would
silently skip interventions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from vllm.sequence import IntermediateTensors

from vinterp.engine.site_ops import SiteCalls
from vinterp.engine.vllm_boundary.eager_kernels import EagerKernels
from vinterp.engine.vllm_boundary.parallel import received_trace_values
from vinterp.engine.vllm_boundary.targets import V2_RUNNER, resolve
from vinterp.runtime.request_tracking import NewRequest, StepLayout, StepSchedule
from vinterp.runtime.step_routing import StepMode
from vinterp.runtime.worker_runtime import WorkerRuntime, request_payload

V2_MODULE = V2_RUNNER.partition(":")[0]
# The mode of the step this thread's runner is executing, for vLLM functions that are not
# the runner's own (V2's graph dispatch); set around each `execute_model` call.
_EXECUTING: ContextVar[StepMode | None] = ContextVar("vinterp_executing", default=None)


class UnsupportedRunnerError(RuntimeError):
    pass


def runner_kind(runner: Any) -> str:
    """ "v1" (GPU V1 runner and vLLM's CPU runner), "v2", or UnsupportedRunnerError."""
    from vinterp.engine.vllm_boundary.targets import V1_RUNNER

    if isinstance(runner, resolve(V1_RUNNER)):
        return "v1"
    if type(runner).__module__ == V2_MODULE:
        return "v2"
    raise UnsupportedRunnerError(
        f"vinterp cannot instrument vLLM's {type(runner).__module__}.{type(runner).__name__}; "
        "its interventions would be skipped. Supported: the V1 and V2 GPU model runners and "
        "the CPU runner (set VLLM_USE_V2_MODEL_RUNNER=0 or 1 to pick a GPU runner)"
    )


def step_schedule(scheduler_output: Any) -> StepSchedule:
    """The step as vinterp's runtime reads it, from vLLM's scheduler output (its lists are
    passed on, not copied: a step of plain running requests costs nothing per request)."""
    new = [
        NewRequest(
            r.req_id,
            len(r.prompt_token_ids or []),
            r.num_computed_tokens,
            request_payload(getattr(r.sampling_params, "extra_args", None)),
        )
        for r in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    return StepSchedule(
        scheduler_output.finished_req_ids,
        new,
        cached.req_ids,
        cached.num_computed_tokens,
        scheduler_output.num_scheduled_tokens,
    )


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


def instrument(runner: Any, runtime: WorkerRuntime, calls: SiteCalls) -> None:
    """Hook `runner`'s steps to `runtime`, whose handlers the sites reach through `calls`."""
    kind = runner_kind(runner)
    calls.site, calls.stream = runtime.on_site, runtime.on_stream
    calls.pattern = runtime.on_pattern

    def execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dummy_run", False):
                return original(scheduler_output, *args, **kwargs)
            mode = runtime.on_schedule(step_schedule(scheduler_output))
            calls.uncompiled = mode.uncompiled
            received = args[0] if args else kwargs.get("intermediate_tensors")
            if received is not None:  # from the previous pipeline stage
                runtime.pipeline.take(received_trace_values(received))
            executing = _EXECUTING.set(mode)
            try:
                output = original(scheduler_output, *args, **kwargs)
            finally:
                _EXECUTING.reset(executing)
            runtime.end_step()
            if mode.uncompiled and isinstance(output, IntermediateTensors):
                output.tensors.update(runtime.pipeline_values())  # to the next stage
            return output

        return run

    _wrap(runner, "execute_model", execute_model)
    model = runner.get_model()
    kernels = EagerKernels(model, runner.vllm_config)

    def skip_compiled(module: Any, args: Any, kwargs: Any) -> None:
        if runtime.mode.uncompiled:
            from vllm.forward_context import get_forward_context

            get_forward_context().skip_compiled = True
            kernels.enter()

    model.register_forward_pre_hook(skip_compiled, with_kwargs=True)
    model.register_forward_hook(lambda *_: kernels.exit(), always_call=True)
    compute_logits = model.compute_logits

    def logits_with_sites(hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = compute_logits(hidden_states)
        return None if logits is None else runtime.on_logits(logits)

    model.compute_logits = logits_with_sites
    (_instrument_v1 if kind == "v1" else _instrument_v2)(runner, runtime)


def _instrument_v1(runner: Any, runtime: WorkerRuntime) -> None:
    def prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            num_reqs = runner.input_batch.num_reqs
            offsets = runner.query_start_loc.cpu[: num_reqs + 1]
            req_ids = runner.input_batch.req_ids[:num_reqs]
            runtime.begin_step(StepLayout(req_ids, offsets), int(offsets[-1]))
            return result

        return run

    def batch_execution(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            kwargs["force_eager"] = kwargs.get("force_eager", False) or runtime.mode.uncompiled
            return original(*args, **kwargs)

        return run

    _wrap(runner, "_prepare_inputs", prepare_inputs)
    _wrap(runner, "_determine_batch_execution_and_padding", batch_execution)
    if getattr(runner, "sampler", None) is not None:
        runner.sampler.register_forward_hook(
            lambda module, args, out: runtime.on_samples(out.sampled_token_ids[:, 0])
        )


def _instrument_v2(runner: Any, runtime: WorkerRuntime) -> None:
    import importlib

    def prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            batch = original(*args, **kwargs)
            layout = StepLayout(batch.req_ids, batch.query_start_loc_np)
            runtime.begin_step(layout, batch.num_tokens)
            return batch

        return run

    def sample(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            runtime.on_samples(result[0].sampled_token_ids[:, 0])
            return result

        return run

    _wrap(runner, "prepare_inputs", prepare_inputs)
    _wrap(runner, "sample", sample)
    module = importlib.import_module(V2_MODULE)
    if not getattr(module.dispatch_cg_and_sync_dp, "_vinterp", False):

        def dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                mode = _EXECUTING.get()
                uncompiled = mode is not None and mode.uncompiled
                kwargs["need_eager"] = kwargs.get("need_eager", False) or uncompiled
                return original(*args, **kwargs)

            run._vinterp = True  # type: ignore[attr-defined]
            return run

        _wrap(module, "dispatch_cg_and_sync_dp", dispatch)
