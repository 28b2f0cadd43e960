"""The parts of a worker's runtime, built from the model's sites and the engine's layout, so
that `WorkerRuntime` only sequences a step across them (its docstring lists what each does)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from vinterp.interventions.applied import AppliedCheck
from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import SteeringPlanner
from vinterp.interventions.worker_state import WorkerInterventions
from vinterp.runtime.attention_keys import KeyStore
from vinterp.runtime.pipeline import StageValues
from vinterp.runtime.request_tracking import NewRequest, RequestTracker, TrackedRequest
from vinterp.runtime.step_routing import StepRouter
from vinterp.runtime.tensor_parallel import ParallelLayout, TensorParallel, VLLMParams
from vinterp.runtime.trace_dispatch import TraceDispatch
from vinterp.sites.modules import SiteModules, unhooked
from vinterp.sites.names import HEAD_SITES, PATTERN, SiteOrder
from vinterp.wire.json_form import payload_from_text


@dataclass
class WorkerParts:
    order: SiteOrder
    tp: TensorParallel
    saes: SaeRegistry
    sharded: frozenset[int]  # the per-head sites, gathered under TP (empty without TP)
    pipeline: StageValues
    traces: TraceDispatch
    keys: KeyStore
    interventions: WorkerInterventions
    steering: SteeringPlanner
    tracker: RequestTracker
    router: StepRouter
    capture_buffers: CaptureBuffers | None
    check: AppliedCheck | None  # counts what the sites applied, per step (`applied`)


def build_parts(
    model: torch.nn.Module,
    modules: SiteModules,
    order: SiteOrder,
    steer: SteerBuffers,
    parallel: ParallelLayout,
    last_stage_start: int | None,
    capture: CaptureBuffers | None = None,
    check: AppliedCheck | None = None,
    held: frozenset[int] | None = None,
    stage_starts: tuple[int, ...] = (0,),
) -> WorkerParts:
    """`held`: the sites this worker's model runs (a pipeline stage's; None: all);
    `stage_starts`: the first layer of each pipeline stage."""
    tp = TensorParallel(parallel)
    # TP ranks hold the same values: the first of each stage keeps saves and captures
    keeps_results = parallel.tp_rank == 0
    head = modules.lm_head
    functions: dict[str, Callable[..., Any]] = {
        "final_norm": unhooked(modules.final_norm),
        "lm_head": lambda x: tp.full_logits(head, torch.nn.functional.linear(x, head.weight)),
        "param": VLLMParams(model, modules, tp).read,
    }
    saes = SaeRegistry(steer.add.device, steer.add.dtype)
    functions.update(saes.functions())
    sharded = order.ids_of((*HEAD_SITES, PATTERN)) if parallel.tp_size > 1 else frozenset()
    traces = TraceDispatch(
        order, steer.add.device, functions, last_stage_start, keeps_results, model
    )
    interventions = WorkerInterventions(
        keeps_results, order, steer.add.shape[1], saes, held, stage_starts
    )
    steering = SteeringPlanner(steer, order, saes)
    tracker = RequestTracker(partial(describe, interventions, capture, order))
    return WorkerParts(
        order,
        tp,
        saes,
        sharded,
        StageValues(_last_position(modules, order, parallel.is_last_stage)),
        traces,
        KeyStore(),
        interventions,
        steering,
        tracker,
        StepRouter(tracker, interventions, steering, capture, traces.works_now),
        capture,
        check,
    )


def describe(
    interventions: WorkerInterventions,
    capture_buffers: CaptureBuffers | None,
    order: SiteOrder,
    new: NewRequest,
) -> TrackedRequest:
    """A request as the runtime follows it: its specs decoded (and checked) once, and whether
    its capture is gathered by the capture buffers in the compiled model."""
    payload = new.payload
    if isinstance(payload, str):  # from `vinterp serve` (vLLM's server passes text only)
        payload = payload_from_text(payload)
    specs = interventions.decode(payload) if payload else None
    req = TrackedRequest(new.prompt_len, new.num_computed, specs)
    capture = req.capture
    if capture is not None and capture_buffers is not None:
        chosen = capture_buffers.chosen
        # an SAE site is gathered at its host (`order` gives the host's id)
        req.captures_in_buffers = not capture.patterns and all(
            order[s] in chosen for s in capture.sites
        )
    return req


def _last_position(modules: SiteModules, order: SiteOrder, is_last_stage: bool) -> int | None:
    """The forward position of this pipeline stage's last site, from the layers it really
    holds; None on the last (or only) stage: it sends nothing on."""
    if is_last_stage:
        return None
    held = [i for i, layer in enumerate(modules.layers) if modules.holds_layer(layer)]
    return order[f"layers.{held[-1]}.output"]
