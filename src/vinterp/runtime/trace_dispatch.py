"""Traces on a worker: their lifecycle (begin, collect, forget) and, in each uncompiled step,
which traced invoke has which rows of the batch and which sites it works at."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vinterp.ir.plan import PlanError, make_plan
from vinterp.runtime.executor import Failure, TraceRun
from vinterp.runtime.request_tracking import TrackedRequest
from vinterp.sites.names import SiteOrder, UnknownSiteError
from vinterp.sites.raw import install_raw_hooks, parse_raw, raw_sites_of
from vinterp.wire.errors import WireError
from vinterp.wire.graph import from_wire
from vinterp.wire.saved_values import encode_saved


@dataclass
class Slot:
    """One traced request in this step: its trace, invoke, step, rows and logits row."""

    run: TraceRun
    trace_id: str
    invoke: int
    step: int
    start: int
    end: int
    row: int  # index among this step's requests (logits/samples row)
    first: int = 0  # the position of its first row


@dataclass
class Replay:
    """Rows of a traced request that recompute positions its trace already ran (after a
    preemption): `start`..`end` of the batch, from position `first`."""

    run: TraceRun
    invoke: int
    start: int
    end: int
    first: int


class TraceDispatch:
    """The worker's traces and this step's slots: `wanted` (site -> slots with work there)
    and `keeping` (pattern site -> slots whose invoke reads it in some step)."""

    def __init__(
        self,
        order: SiteOrder,
        device: torch.device,
        functions: dict[str, Callable[..., Any]],
        last_stage_start: int | None,
        keeps_results: bool,
        model: torch.nn.Module,
    ) -> None:
        self.order, self.device, self.functions = order, device, functions
        self.last_stage_start, self.keeps_results, self.model = (
            last_stage_start,
            keeps_results,
            model,
        )
        self.traces: dict[str, TraceRun] = {}
        self.raw_hooks: dict[str, list[Any]] = {}
        self.raw_modules: dict[str, tuple[torch.nn.Module, str]] = {}  # raw site -> module, which
        self.slots: list[Slot] = []
        self.wanted: dict[str, list[Slot]] = {}
        self.keeping: dict[str, list[Slot]] = {}
        self.replays: dict[str, list[Replay]] = {}

    def begin(self, trace_id: str, wire: dict[str, Any], on_raw: Callable[..., Any]) -> str | None:
        """Register a trace; an error message (not an exception: the engine stays up)."""
        try:
            graph = from_wire(wire, self.order)
            graph.tensors = [t.to(self.device) for t in graph.tensors]
            plan = make_plan(graph, self.order, self.last_stage_start)
            run = TraceRun(graph, plan, self.functions, keeps_results=self.keeps_results)
            raw_sites = raw_sites_of(graph)
            self.raw_hooks[trace_id] = install_raw_hooks(self.model, raw_sites, on_raw)
            for site in raw_sites:
                path, which = parse_raw(site)
                self.raw_modules[site] = (self.model.get_submodule(path), which)
        except (WireError, PlanError, UnknownSiteError) as exc:
            return str(exc)
        self.traces[trace_id] = run
        return None

    def forget(self, trace_id: str) -> TraceRun | None:
        """Drop a trace and its hooks (after collection, or when it could not start)."""
        for handle in self.raw_hooks.pop(trace_id, ()):
            handle.remove()
        return self.traces.pop(trace_id, None)

    @staticmethod
    def report(run: TraceRun | None) -> dict[str, Any]:
        """A finished trace's saves and failure, as they cross vLLM's RPC."""
        if run is None:
            return {"saved": {}, "failure": None}
        failure = run.failure.__dict__ if run.failure else None
        try:
            saved = {node: encode_saved(value) for node, value in run.results().items()}
        except (WireError, RuntimeError, TypeError) as exc:  # the trace fails, not the engine
            message = f"a saved value cannot be sent back: {exc}"
            saved, failure = {}, Failure("", message, -1, 0).__dict__
        return {"saved": saved, "failure": failure}

    def works_now(self, req: TrackedRequest, num_tokens: int) -> bool:
        """Whether a traced request's invoke has work in a step of `num_tokens` of its tokens
        (its nodes, or rows to replay where it wrote)."""
        if req.trace is None:
            return False
        run = self.traces.get(req.trace[0])
        if run is None:
            return False
        invoke = req.trace[1]
        replays = req.num_computed < run.positions_ran(invoke) and bool(run.write_sites(invoke))
        return replays or run.works_at(invoke, req.step(num_tokens))

    def clear_step(self) -> None:
        self.slots, self.wanted, self.keeping, self.replays = [], {}, {}, {}

    def add_slot(self, req: TrackedRequest, row: int, start: int, end: int) -> None:
        """A traced request's rows in this (uncompiled) step. The prompt's step may come in
        chunks (chunked prefill); positions the trace already ran (a preempted request
        computed again) are replayed: at the sites the invoke wrote, their written rows."""
        trace_id, invoke = req.trace  # type: ignore[misc]
        run = self.traces[trace_id]
        first, done = req.num_computed, run.positions_ran(invoke)
        step = req.step(end - start)
        if first > done and step == 0:  # prompt positions the trace never saw
            if run.failure is None:
                run.failure = Failure("", _uncomputed_prefix(req, invoke), invoke, 0)
            return
        done = max(done, first)  # steps it had no work in ran compiled: nothing to replay
        fresh = start + min(end - start, done - first)
        if fresh > start:
            replay = Replay(run, invoke, start, fresh, first)
            for site in run.write_sites(invoke):
                self.replays.setdefault(site, []).append(replay)
        if fresh == end:
            return
        begin = first + fresh - start
        run.runs(invoke, step, begin, begin + end - fresh)
        slot = Slot(run, trace_id, invoke, step, fresh, end, row, begin)
        self.slots.append(slot)
        for site in run.sites_by_invoke.get(invoke, ()):
            self.wanted.setdefault(site, []).append(slot)
        for site in run.patterns_by_invoke.get(invoke, ()):
            self.keeping.setdefault(site, []).append(slot)

    def _replay(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """`x` with the replayed rows of this site set to what the trace wrote there."""
        out = None
        for replay in self.replays.get(site, ()):
            rows = slice(replay.start, replay.end)
            written = replay.run.replayed(replay.invoke, site, replay.first, x[rows])
            if written is not None:
                out = x.clone() if out is None else out
                out[rows] = written
        return out

    def at_site(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """The traced invokes' nodes at a site whose value `x` (T, ...) is whole: a new value
        where one of them writes (their rows replaced), else None."""
        out = self._replay(site, x) if self.replays else None
        for slot in self.wanted.get(site, ()):
            source = x if out is None else out
            new = slot.run.at_site(slot.invoke, slot.step, site, source[slot.start : slot.end])
            if new is not None:
                out = x.clone() if out is None else out
                out[slot.start : slot.end] = new
        return out

    def at_stream(
        self, site: str, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As `at_site`, for a value vLLM carries as (hidden, residual) with the sum meant."""
        out = None
        for replay in self.replays.get(site, ()):
            rows = slice(replay.start, replay.end)
            sum_ = hidden[rows] + residual[rows]
            new = replay.run.replayed(replay.invoke, site, replay.first, sum_)
            if new is not None:
                out = (hidden.clone(), residual.clone()) if out is None else out
                out[0][rows] = 0
                out[1][rows] = new
        for slot in self.wanted.get(site, ()):
            h, r = (hidden, residual) if out is None else out
            rows = slice(slot.start, slot.end)
            new = slot.run.at_site(slot.invoke, slot.step, site, h[rows] + r[rows])
            if new is not None:
                out = (hidden.clone(), residual.clone()) if out is None else out
                out[0][rows] = 0  # the next block adds hidden + residual: the sum is `new`
                out[1][rows] = new
        return out

    def at_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows of `logits` are this step's requests in batch order (the slot's `row`)."""
        out = logits
        for slot in self.wanted.get("logits", ()):
            row = out[slot.row : slot.row + 1]
            new = slot.run.at_site(slot.invoke, slot.step, "logits", row)
            if new is not None:
                out = logits.clone() if out is logits else out
                out[slot.row : slot.row + 1] = new
        return out

    def at_samples(self, sampled: torch.Tensor) -> None:
        """This step's sampled token ids, one per request: read only."""
        for slot in self.wanted.get("samples", ()):
            token = sampled[slot.row].reshape(1).long()
            slot.run.at_site(slot.invoke, slot.step, "samples", token)


def _uncomputed_prefix(req: TrackedRequest, invoke: int) -> str:
    return (
        f"the prompt of invoke {invoke} was not computed by the trace: its first "
        f"{req.num_computed} tokens came from vLLM's prefix cache"
    )
