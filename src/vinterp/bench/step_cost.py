"""The worker runtime's own work per decode step, without an engine: `on_schedule` and
`begin_step` for a batch of 1,000 running requests against a batch of 1 (each with the same
8 capturing requests beside them, and once with the 1,000 all steered). What the runtime does
per step must not grow with the plain requests in the batch; vLLM's own per-step work does,
and is not timed here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vinterp.bench.harness import REFERENCE, Row, timed_interleaved
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.runtime.request_tracking import NewRequest, StepLayout, StepSchedule
from vinterp.runtime.tensor_parallel import ParallelLayout
from vinterp.runtime.worker_parts import build_parts
from vinterp.runtime.worker_runtime import WorkerRuntime
from vinterp.sites.modules import SiteModules
from vinterp.sites.names import SiteOrder
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Capture, Steering

KEY = "step_cost"
LAYERS, HIDDEN, CAPTURING, STEPS = 4, 64, 8, 200


def _runtime(max_seqs: int) -> WorkerRuntime:
    order = SiteOrder(LAYERS)
    rows = 2 * max_seqs + 2
    steer = SteerBuffers(len(order.sites), HIDDEN, 4 * max_seqs, rows, rows, torch.float32, "cpu")
    stand_in = torch.nn.Identity()  # the sites' modules are never called here
    modules = SiteModules(stand_in, torch.nn.ModuleList(), stand_in, stand_in)
    parts = build_parts(torch.nn.Identity(), modules, order, steer, ParallelLayout(), None)
    return WorkerRuntime.of(parts)


def _decoding(runtime: WorkerRuntime, plain: int, steering: Steering | None) -> Callable[[], None]:
    """A runtime that knows `plain` running requests (steered by `steering`, if given) and
    `CAPTURING` capturing ones, all past their prompts; the returned call runs `STEPS` decode
    steps of them through `on_schedule` and `begin_step`."""
    capture = Capture(["layers.1.output"], positions="all")
    own = RequestSpecs(steering=[steering]) if steering is not None else None
    payload = {f"p{i}": own for i in range(plain)} | {
        f"c{i}": RequestSpecs(capture=capture, capture_id=f"c{i}") for i in range(CAPTURING)
    }
    new = [NewRequest(r, 8, 0, None if s is None else s.to_wire()) for r, s in payload.items()]
    ids = list(payload)
    runtime.on_schedule(StepSchedule((), new, [], [], dict.fromkeys(ids, 8)))
    computed = [8] * len(ids)
    tokens = dict.fromkeys(ids, 1)
    offsets = torch.arange(len(ids) + 1)

    def steps() -> None:
        for step in range(STEPS):
            computed[:] = [8 + step] * len(ids)  # vLLM's list for the step, filled in C
            runtime.on_schedule(StepSchedule((), [], ids, computed, tokens))
            runtime.begin_step(StepLayout(ids, offsets), len(ids))
            runtime.interventions.take_captures([f"c{i}" for i in range(CAPTURING)], None)

    return steps


def run(repeats: int = 5) -> list[Row]:
    """Per batch shape, a decode step of 1,000 running requests against one of 1."""
    rows = []
    vector = torch.ones(HIDDEN)
    for label, steering in (("plain", None), ("steered", Steering({"layers.1.output": vector}))):
        one, many = _runtime(1024), _runtime(1024)
        timings = timed_interleaved(
            {"1": _decoding(one, 1, steering), "1000": _decoding(many, 1000, steering)}, repeats
        )
        rows.append(
            Row(
                f"runtime per decode step, 1,000 {label} + {CAPTURING} capturing requests "
                f"(vs 1 + {CAPTURING}; {STEPS} steps)",
                timings["1"],
                timings["1000"],
                REFERENCE,
                KEY,
            )
        )
    return rows
