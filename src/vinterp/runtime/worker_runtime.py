"""Worker-side runtime inside vLLM: one per model runner, made of parts with one job each
(built by `worker_parts.build_parts`):

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

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from vinterp.interventions.tables import RowSpan
from vinterp.runtime.attention_keys import (
    RequestCapture,
    pattern_captures,
    read_patterns,
)
from vinterp.runtime.request_tracking import (
    StepLayout,
    StepSchedule,
    TrackedRequest,
)
from vinterp.runtime.step_routing import StepMode
from vinterp.runtime.trace_dispatch import TraceDispatch
from vinterp.runtime.worker_parts import WorkerParts
from vinterp.sites.attention_pattern import PatternMath
from vinterp.sites.names import parse_site
from vinterp.wire.specs import EXTRA_ARGS_KEY


@dataclass(eq=False)
class WorkerRuntime(WorkerParts):
    """Sequences each step across its parts (`worker_parts.build_parts` makes them)."""

    captured_sites: frozenset[str] = frozenset()  # those this step's captures name
    pattern_captures: dict[str, list[RequestCapture]] = field(default_factory=dict)
    mode: StepMode = field(default_factory=StepMode)
    num_tokens: int = 0
    counts: dict[str, int] = field(
        default_factory=lambda: {"steps": 0, "uncompiled_steps": 0, "graph_capture_steps": 0}
    )

    @classmethod
    def of(cls, parts: WorkerParts) -> WorkerRuntime:
        return cls(**{f.name: getattr(parts, f.name) for f in fields(WorkerParts)})

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
        """After the forward is queued: keep what the capture buffers gathered and the probes
        scored; with the check on, compare what the sites applied with what the step asked for."""
        buffers = self.capture_buffers
        gathers: list[int] = []
        if buffers is not None and buffers.active:
            gathers = self.interventions.keep_gathered(buffers)
        reads = self.steering.probe_reads
        if reads:
            self.interventions.keep_scores(reads, self.steering.scores(), self._computed)
        if self.check is not None:
            steered = self.steering.steered_per_site()
            self.check.end(self.counts["steps"], self.mode.uncompiled, steered, gathers)

    def _computed(self, req_id: str) -> int:
        """The tokens of a scheduled request computed before this step."""
        req = self.tracker.get(req_id)
        assert req is not None
        return req.num_computed

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
        """A layer's q and k (T, heads, head_dim), whole heads under TP (a collective, alike
        on every rank: the slots are), for the traced invokes and captures that read its
        pattern (`attention_keys.read_patterns`)."""
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
        reading = self.traces.wanted.get(site, ())
        keep_row = self.interventions.keep_row
        read_patterns(self.keys, site, query, key, math, slots, reading, captures, keep_row)

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
