"""Worker-side runtime inside vLLM: one per model runner, made of parts with one job each.

- `RequestTracker` (request_tracking): the live requests and their progress;
- `StepRouter` (step_routing): steering plans and each step's `StepMode`;
- `TraceDispatch` (trace_dispatch): traces and, per uncompiled step, their rows and sites;
- `KeyStore` (attention_keys): keys kept across steps for attention patterns;
- `TensorParallel` and `StageValues`: whole values under TP, trace values between PP stages;
- `WorkerInterventions`: steering specs and captures.

Per step, in the order the runner hooks (`engine.vllm_boundary.runner_hooks`) call them:
`on_schedule(schedule)` before vLLM picks the step's graph mode; `begin_step(layout)` once
the runner has laid the batch out (steering buffers written, capture tables built, the
traced invokes' slots); the site handlers during the forward (uncompiled steps only, but for
the capture buffers); `end_step()` once the forward is queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vinterp.interventions.applied import AppliedCheck
from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import SteeringPlanner
from vinterp.interventions.tables import RowSpan
from vinterp.interventions.worker_state import WorkerInterventions
from vinterp.runtime.attention_keys import (
    KeyStore,
    RequestCapture,
    kept_pattern,
    pattern_captures,
)
from vinterp.runtime.pipeline import StageValues
from vinterp.runtime.request_tracking import (
    NewRequest,
    RequestTracker,
    StepLayout,
    StepSchedule,
    TrackedRequest,
)
from vinterp.runtime.step_routing import StepMode, StepRouter
from vinterp.runtime.tensor_parallel import ParallelLayout, TensorParallel, VLLMParams
from vinterp.runtime.trace_dispatch import TraceDispatch
from vinterp.sites.attention_pattern import PatternMath
from vinterp.sites.modules import SiteModules, unhooked
from vinterp.sites.names import HEAD_SITES, PATTERN, SiteOrder, parse_site
from vinterp.wire.json_form import payload_from_text
from vinterp.wire.specs import EXTRA_ARGS_KEY


class WorkerRuntime:
    def __init__(
        self,
        model: torch.nn.Module,
        modules: SiteModules,
        order: SiteOrder,
        steer: SteerBuffers,
        parallel: ParallelLayout,
        last_stage_start: int | None,
        capture: CaptureBuffers | None = None,
        check: AppliedCheck | None = None,
    ) -> None:
        self.order = order
        self.check = check  # counts what the sites applied, per step (`interventions.applied`)
        self.tp = TensorParallel(parallel)
        # TP ranks hold the same values: the first of each stage keeps saves and captures
        keeps_results = parallel.tp_rank == 0
        head = modules.lm_head
        functions: dict[str, Callable[..., Any]] = {
            "final_norm": unhooked(modules.final_norm),
            "lm_head": lambda x: self.tp.full_logits(
                head, torch.nn.functional.linear(x, head.weight)
            ),
            "param": VLLMParams(model, modules, self.tp).read,
        }
        self.saes = SaeRegistry(steer.add.device, steer.add.dtype)
        functions.update(self.saes.functions())
        # under TP each rank holds some of the heads: per-head sites are gathered (`_on_heads`)
        sharded = parallel.tp_size > 1
        self.sharded = order.ids_of((*HEAD_SITES, PATTERN)) if sharded else frozenset()
        self.captured_sites: frozenset[str] = frozenset()  # those this step's captures name
        self.pipeline = StageValues(_last_position(modules, order, parallel.is_last_stage))
        self.traces = TraceDispatch(
            order, steer.add.device, functions, last_stage_start, keeps_results, model
        )
        self.keys = KeyStore()
        self.pattern_captures: dict[str, list[RequestCapture]] = {}
        self.capture_buffers = capture
        self.interventions = WorkerInterventions(
            keeps_results, order, steer.add.shape[1], self.saes
        )
        self.steering = SteeringPlanner(steer, order, self.saes)
        self.tracker = RequestTracker(self._describe)
        self.router = StepRouter(
            self.tracker, self.interventions, self.steering, capture, self.traces.works_now
        )
        self.mode = StepMode()
        self.num_tokens = 0
        self.counts = {"steps": 0, "uncompiled_steps": 0, "graph_capture_steps": 0}

    # -- trace lifecycle (called through collective_rpc) -----------------------------------
    def begin(self, trace_id: str, wire: dict[str, Any]) -> str | None:
        """Register a trace; an error message (not an exception: the engine stays up)."""
        error = self.traces.begin(trace_id, wire, self.on_raw)
        if error is None:
            self.pipeline.add_trace(trace_id, self.traces.traces[trace_id])
        return error

    def attach_sae(self, site: str, wire: dict[str, Any]) -> str | None:
        """Attach an SAE sent as data; an error message (the engine stays up)."""
        try:
            self.saes.attach_wire(site, wire)
        except (KeyError, TypeError, ValueError) as exc:
            return f"the SAE for {site} could not be attached: {exc}"
        return None

    def forget(self, trace_id: str) -> None:
        """Drop a trace, its hooks and kept keys (after collection, or when it could not
        start)."""
        self.traces.forget(trace_id)
        self.pipeline.forget(trace_id)
        self.keys.forget_trace(trace_id)

    def collect(self, trace_id: str) -> dict[str, Any]:
        run = self.traces.traces.get(trace_id)
        self.forget(trace_id)
        return TraceDispatch.report(run)

    def held_state(self) -> dict[str, int]:
        return {
            "traces": len(self.traces.traces),
            "requests": len(self.tracker.requests),
            "exports": len(self.pipeline.exports),
            "received": len(self.pipeline.received),
            "captures": self.interventions.store.held(),
            "kept_keys": self.keys.held(),  # for attention patterns
        }

    @property
    def stats(self) -> dict[str, int]:
        """Steps, uncompiled and graph-capturing steps, and "watched": live requests looked
        at for captures or traces, summed over steps."""
        return {**self.counts, "watched": self.router.watched_total}

    # -- per step -----------------------------------------------------------------------------
    def on_schedule(self, schedule: StepSchedule) -> StepMode:
        """Follow the scheduled requests, plan steering, choose how the step runs."""
        if self.check is not None:
            self.check.begun = False  # a step that raised before its end compares nothing
        for req_id in schedule.finished:
            self.keys.forget_request(req_id)
        self.mode = self.router.route(schedule)
        if self.capture_buffers is not None:
            self.capture_buffers.active = self.mode.graph_capture
        self.counts["steps"] += 1
        self.counts["uncompiled_steps"] += self.mode.uncompiled
        self.counts["graph_capture_steps"] += self.mode.graph_capture
        return self.mode

    def _describe(self, new: NewRequest) -> TrackedRequest:
        payload = new.payload
        if isinstance(payload, str):  # from `vinterp serve` (vLLM's server passes text only)
            payload = payload_from_text(payload)
        specs = self.interventions.decode(payload) if payload else None
        req = TrackedRequest(new.prompt_len, new.num_computed, specs)
        capture = req.capture
        if capture is not None and self.capture_buffers is not None:
            chosen = self.capture_buffers.chosen
            # an SAE site is gathered at its host (`order` gives the host's id)
            req.captures_in_buffers = not capture.patterns and all(
                self.order[s] in chosen for s in capture.sites
            )
        return req

    def begin_step(self, layout: StepLayout, num_tokens: int) -> None:
        """Once the runner has laid out the batch: steering buffers written, capture tables
        built, the traced invokes' slots. Only the watched requests of the step are looked
        up in the layout; steering reads all of it where something is steered."""
        uncompiled, graph_capture = self.mode.uncompiled, self.mode.graph_capture
        self.steering.write(layout.rows, num_tokens)
        if self.check is not None:
            self.check.begin()
        self.traces.clear_step()
        self.num_tokens = num_tokens
        placed = self._watched_rows(layout) if uncompiled or graph_capture else []
        captures = [
            (req_id, RowSpan(start, end, req.num_computed, req.prompt_len), req.capture)
            for req_id, req, _, start, end in placed
            if req.capture is not None
        ]
        self.interventions.begin_capture_step([(span, c) for _, span, c in captures])
        self.pattern_captures = pattern_captures(captures) if uncompiled else {}
        if self.sharded:  # known on every rank, unlike the capture tables of the shipping one
            self.captured_sites = frozenset(site for _, _, c in captures for site in c.sites)
        if self.capture_buffers is not None:  # also empties the index after a capturing step
            self.capture_buffers.write(self.interventions.gather_rows() if graph_capture else {})
        if not uncompiled:
            return
        for _, req, row, start, end in placed:
            if req.trace is not None and req.trace[0] in self.traces.traces:
                self.traces.add_slot(req, row, start, end)
        self.pipeline.deliver(self.traces.slots)

    def _watched_rows(self, layout: StepLayout) -> list[tuple[str, TrackedRequest, int, int, int]]:
        """The step's capturing and traced requests, in batch order: (id, request, index in
        the batch, first row, end row)."""
        placed = []
        for req_id in self.tracker.scheduled_watched(self.router.scheduled):
            req, found = self.tracker.get(req_id), layout.find(req_id)
            if req is not None and found is not None:
                placed.append((req_id, req, *found))
        return sorted(placed, key=lambda p: p[2])

    def end_step(self) -> None:
        """After the forward is queued: keep what the capture buffers gathered; with the
        check on, compare what the sites applied with what the step asked for."""
        buffers = self.capture_buffers
        gathers: list[int] = []
        if buffers is not None and buffers.active:
            gathers = self.interventions.keep_gathered(buffers)
        if self.check is not None:
            steered = self.steering.steered_per_site()
            self.check.end(self.counts["steps"], self.mode.uncompiled, steered, gathers)

    def pipeline_values(self) -> dict[str, Any]:
        """What this stage sends on with the step's IntermediateTensors (uncompiled steps)."""
        return self.pipeline.pack(self.traces.slots)

    # -- site handlers (uncompiled steps) ------------------------------------------------------
    def on_site(self, site_id: int, x: torch.Tensor) -> torch.Tensor | None:
        if self.check is not None:
            self.check.visit(site_id)
        site = self.order.sites[site_id]
        if site_id in self.sharded:
            return self._on_heads(site, x)
        return self._at_site(site, x)

    def _on_heads(self, site: str, local: torch.Tensor) -> torch.Tensor | None:
        """A per-head site under tensor parallelism, (T, this rank's heads, head_dim): when a
        trace or a capture of this step looks at it (alike on every rank: the gather is a
        collective), its heads are gathered whole; a replacement is cut back to this rank's."""
        if site not in self.traces.wanted and site not in self.captured_sites:
            return None
        assert self.order.heads is not None
        heads = self.order.heads.of(parse_site(site).part)
        new = self._at_site(site, self.tp.full_heads(local, heads))
        return None if new is None else self.tp.own_heads(new, local.shape[1])

    def _at_site(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """Capture and the traced invokes' nodes at a site whose value `x` is whole."""
        self.interventions.record(site, x)
        return self.traces.at_site(site, x)

    def on_stream(
        self, site_id: int, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.check is not None:
            self.check.visit(site_id)
        site = self.order.sites[site_id]
        if self.interventions.records_at(site):
            self.interventions.record(site, hidden + residual)
        return self.traces.at_stream(site, hidden, residual)

    def on_pattern(
        self, site_id: int, query: torch.Tensor, key: torch.Tensor, math: PatternMath
    ) -> None:
        """A layer's q and k (T, heads, head_dim): each traced invoke that reads this layer's
        pattern in some step keeps its keys (its positions before this step's from earlier
        steps: vLLM's cache layout is the attention backend's own), and where it reads the
        pattern in this step gets it over all of them. Whole heads under TP (a collective,
        alike on every rank: the slots are)."""
        if self.check is not None:
            self.check.visit(site_id)
        site = self.order.sites[site_id]
        slots, captures = self.traces.keeping.get(site, ()), self.pattern_captures.get(site, ())
        if not slots and not captures:
            return
        if site_id in self.sharded:
            assert self.order.heads is not None
            query = self.tp.full_heads(query, self.order.heads.heads)
            key = self.tp.full_heads(key, self.order.heads.kv_heads)
        reading = {id(slot) for slot in self.traces.wanted.get(site, ())}
        for slot in slots:
            kept = self.keys.of_invoke(slot.trace_id, slot.invoke)
            pattern = kept_pattern(kept, site, query, key, slot.start, slot.end, slot.first, math)
            if id(slot) not in reading:
                continue
            chunk = slot.run.chunk(slot.invoke)
            if slot.step == 0 and (chunk.start > 0 or not chunk.final):  # a prompt in chunks
                ids = (slot.trace_id, slot.invoke, site)
                whole = self.keys.whole_prompt(*ids, pattern, chunk.final)
                if whole is None:
                    continue
                pattern = whole
            slot.run.at_site(slot.invoke, slot.step, site, pattern)
        for req_id, span, capture in captures:
            kept = self.keys.of_capture(req_id)
            first, last = span.first_position, span.prompt_len - 1
            pattern = kept_pattern(kept, site, query, key, span.start, span.end, first, math)
            if last < first + span.end - span.start:  # the last prompt token is in this step
                row = pattern.row(last - first, capture.heads)
                self.interventions.keep_row(site, capture.capture_id, last, row)
                self.keys.drop_capture_site(req_id, site)

    def on_raw(self, site: str, value: Any) -> None:
        """A raw module's native value, made whole under TP; each traced invoke gets its own
        token rows."""
        slots = self.traces.wanted.get(site, ())
        if not slots:
            return
        module, which = self.traces.raw_modules[site]
        value = self.tp.full_raw(module, which, value)
        for slot in slots:
            rows = _token_rows(value, slot.start, slot.end, self.num_tokens)
            slot.run.at_site(slot.invoke, slot.step, site, rows)

    def on_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows of `logits` are this step's requests in batch order."""
        return self.traces.at_logits(logits)

    def on_samples(self, sampled: torch.Tensor) -> None:
        self.traces.at_samples(sampled)


def request_payload(extra_args: dict[str, Any] | None) -> Any:
    """vinterp's payload in a request's sampling `extra_args` (None: a plain request)."""
    return (extra_args or {}).get(EXTRA_ARGS_KEY)


def _last_position(modules: SiteModules, order: SiteOrder, is_last_stage: bool) -> int | None:
    """The forward position of this pipeline stage's last site, from the layers it really
    holds; None on the last (or only) stage: it sends nothing on."""
    if is_last_stage:
        return None
    held = [i for i, layer in enumerate(modules.layers) if modules.holds_layer(layer)]
    return order[f"layers.{held[-1]}.output"]


def _token_rows(value: Any, start: int, end: int, num_tokens: int) -> Any:
    """Slice the token axis (the first axis of length num_tokens) of a native value."""
    if isinstance(value, torch.Tensor):
        for axis, size in enumerate(value.shape[:2]):
            if size == num_tokens:
                return value.narrow(axis, start, end - start)
        return value
    if isinstance(value, (tuple, list)):
        return [_token_rows(v, start, end, num_tokens) for v in value]
    return value
