"""Worker-side runtime inside vLLM: which rows of the flat token batch belong to which
request, how each step runs, and the handlers the sites call.

Per step, in the order the runner hooks (`engine.runner_hooks`) call them:
- `on_schedule(scheduler_output)`: before vLLM picks the step's graph mode. It follows the
  scheduled requests, plans steering and chooses the step's `StepMode`: uncompiled (Python
  at the sites) when a traced or capturing request has work in it, and only then — except
  captures that fit the capture buffers of a `capture_in_graph` engine (rows and sites),
  which keep the graphs.
- `begin_step(layout)`: once the runner has laid the batch out. The steering buffers are
  written and the capture tables built (and written to the capture buffers); in an
  uncompiled step the traced invokes get their row slices (`Slot`s).
- `end_step()`: once the forward is queued. Rows gathered into the capture buffers are
  copied into the capture store.
One WorkerRuntime serves one model runner and owns all of its per-step state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vinterp.interventions.applied import AppliedCheck
from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.specs import WorkerCapture, WorkerRequest
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import RequestSteering, SteeredRequest, SteeringPlanner
from vinterp.interventions.tables import RowSpan
from vinterp.interventions.worker_state import WorkerInterventions
from vinterp.ir.plan import PlanError, make_plan
from vinterp.runtime.executor import Failure, TraceRun
from vinterp.runtime.pipeline import StageValues, last_stage_start
from vinterp.runtime.tensor_parallel import (
    VLLMParams,
    full_heads,
    full_logits,
    full_raw,
    own_heads,
)
from vinterp.sites.attention_pattern import Pattern, PatternMath
from vinterp.sites.modules import SiteModules, unhooked
from vinterp.sites.names import HEAD_SITES, PATTERN, SiteOrder, UnknownSiteError, parse_site
from vinterp.sites.raw import install_raw_hooks, parse_raw, raw_sites_of
from vinterp.wire.errors import WireError
from vinterp.wire.graph import from_wire
from vinterp.wire.json_form import payload_from_text
from vinterp.wire.specs import EXTRA_ARGS_KEY
from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire

RequestCapture = tuple[str, RowSpan, WorkerCapture]  # a capturing request's id, rows and spec


@dataclass
class Scheduled:
    """What the worker knows of one request, from the scheduler's outputs."""

    prompt_len: int
    num_computed: int  # tokens computed before this step
    specs: WorkerRequest | None
    steering: RequestSteering | None = None  # as of `steering_version` of the interventions
    steering_version: int = -1
    captures_in_buffers: bool = False  # every site it captures has a capture buffer

    @property
    def trace(self) -> tuple[str, int] | None:
        """(trace id, invoke) of a traced request."""
        return None if self.specs is None else self.specs.trace

    @property
    def capture(self) -> WorkerCapture | None:
        return None if self.specs is None else self.specs.capture

    def step(self, num_tokens: int) -> int:
        """The generation step this forward runs (0: the prompt; k: samples token k+1)."""
        return max(0, self.num_computed + num_tokens - self.prompt_len)


@dataclass(frozen=True)
class StepMode:
    """How a step runs: uncompiled with Python at the sites (traces, captures outside the
    buffers, steering tables too large for the buffers), or compiled, capturing into the
    capture buffers or not."""

    uncompiled: bool = False
    graph_capture: bool = False


@dataclass
class Watched:
    """What this step's capturing and traced requests need of it."""

    traced: bool = False  # a traced invoke has work in this step
    captured_rows: int = 0
    outside_buffers: bool = False  # a captured row at a site without a capture buffer
    keeps_keys: bool = False  # a capture of attention patterns, its prompt not all computed


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


class WorkerRuntime:
    def __init__(
        self,
        runner: Any,
        modules: SiteModules,
        order: SiteOrder,
        steer: SteerBuffers,
        capture: CaptureBuffers | None = None,
        ships_results: bool = True,
        check: AppliedCheck | None = None,
    ) -> None:
        self.runner = runner
        self.check = check  # counts what the sites applied, per step (`interventions.applied`)
        self.order = order
        self.device = steer.add.device
        head = modules.lm_head
        self.functions = {
            "final_norm": unhooked(modules.final_norm),
            "lm_head": lambda x: full_logits(head, torch.nn.functional.linear(x, head.weight)),
            "param": VLLMParams(runner.get_model(), modules).read,
        }
        self.ships_results = ships_results  # one TP rank per stage ships saves and captures
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size

        # under TP each rank holds some of the heads: per-head sites are gathered (`_on_heads`)
        tp = get_tensor_model_parallel_world_size()
        self.sharded = order.ids_of((*HEAD_SITES, PATTERN)) if tp > 1 else frozenset()
        self.captured_sites: frozenset[str] = frozenset()  # those this step's captures name

        self.last_stage_start = last_stage_start(order.num_layers, get_pp_group().world_size)
        self.pipeline = StageValues(_last_position(modules, order))
        self.traces: dict[str, TraceRun] = {}
        self.requests: dict[str, Scheduled] = {}
        self.scheduled: dict[str, int] = {}  # this step's requests -> tokens
        self.slots: list[Slot] = []
        self.wanted: dict[str, list[Slot]] = {}  # site -> this step's slots with work there
        # pattern site -> this step's slots whose invoke reads it in some step (keys kept)
        self.keeping: dict[str, list[Slot]] = {}
        # (trace, invoke) -> pattern site -> the invoke's keys at that layer so far
        self.keys: dict[tuple[str, int], dict[str, KeptKeys]] = {}
        # pattern site -> this step's requests capturing it whose prompt is not all computed
        self.pattern_captures: dict[str, list[RequestCapture]] = {}
        self.capture_keys: dict[str, dict[str, KeptKeys]] = {}  # request -> site -> keys
        self.num_tokens = 0
        # watched: live requests looked at for captures or traces, summed over steps
        self.stats = {"steps": 0, "uncompiled_steps": 0, "graph_capture_steps": 0, "watched": 0}
        self.capture_buffers = capture
        self.raw_hooks: dict[str, list[Any]] = {}
        self.raw_modules: dict[str, tuple[torch.nn.Module, str]] = {}  # raw site -> module, which
        self.interventions = WorkerInterventions(ships_results, order, steer.add.shape[1])
        self.steering = SteeringPlanner(steer, order)
        self.watched: set[str] = set()  # live requests that capture or trace
        # the last steering plan: for which interventions version, and whether every steered
        # request was decoding (then the same batch next step keeps the plan)
        self.planned_version = -1
        self.steering_decodes_only = False
        self.steering_overflows = False
        self.mode = StepMode()

    # -- trace lifecycle (called through collective_rpc) -----------------------------------
    def begin(self, trace_id: str, wire: dict[str, Any]) -> str | None:
        """Register a trace; an error message (not an exception: the engine stays up)."""
        try:
            graph = from_wire(wire, self.order)
            graph.tensors = [t.to(self.device) for t in graph.tensors]
            plan = make_plan(graph, self.order, self.last_stage_start)
            run = TraceRun(graph, plan, self.functions, keeps_saves=self.ships_results)
            raw_sites = raw_sites_of(graph)
            model = self.runner.get_model()
            self.raw_hooks[trace_id] = install_raw_hooks(model, raw_sites, self.on_raw)
            for site in raw_sites:
                path, which = parse_raw(site)
                self.raw_modules[site] = (model.get_submodule(path), which)
        except (WireError, PlanError, UnknownSiteError) as exc:
            return str(exc)
        self.traces[trace_id] = run
        self.pipeline.add_trace(trace_id, run)
        return None

    def forget(self, trace_id: str) -> TraceRun | None:
        """Drop a trace and its hooks (after collection, or when it could not start)."""
        for handle in self.raw_hooks.pop(trace_id, ()):
            handle.remove()
        self.pipeline.forget(trace_id)
        for kept in [k for k in self.keys if k[0] == trace_id]:
            del self.keys[kept]
        return self.traces.pop(trace_id, None)

    def collect(self, trace_id: str) -> dict[str, Any]:
        run = self.forget(trace_id)
        if run is None:
            return {"saved": {}, "failure": None}
        failure = run.failure.__dict__ if run.failure else None
        try:
            saved = {node: _encode_saved(value) for node, value in run.results().items()}
        except (WireError, RuntimeError, TypeError) as exc:  # the trace fails, not the engine
            message = f"a saved value cannot be sent back: {exc}"
            saved, failure = {}, Failure("", message, -1, 0).__dict__
        return {"saved": saved, "failure": failure}

    def held_state(self) -> dict[str, int]:
        return {
            "traces": len(self.traces),
            "requests": len(self.requests),
            "exports": len(self.pipeline.exports),
            "received": len(self.pipeline.received),
            "captures": self.interventions.store.held(),
            "kept_keys": len(self.keys) + len(self.capture_keys),  # for attention patterns
        }

    @property
    def python_step(self) -> bool:
        """Whether this step runs uncompiled, with Python at the sites."""
        return self.mode.uncompiled

    @property
    def graph_capture_step(self) -> bool:
        """Whether this step captures through the capture buffers (in the compiled model)."""
        return self.mode.graph_capture

    # -- per step -----------------------------------------------------------------------------
    def on_schedule(self, scheduler_output: Any) -> StepMode:
        """Follow the scheduled requests, plan steering, choose how the step runs.

        Most steps repeat the last one: the same requests, each decoding one token. Then the
        steering plan stands and only requests that capture or trace are looked at, so the
        per-step work does not grow with the batch."""
        if self.check is not None:
            self.check.begun = False  # a step that raised before its end compares nothing
        self._track(scheduler_output)
        scheduled = dict(scheduler_output.num_scheduled_tokens)
        watched = self._watch(scheduled)
        if not self._repeats_decode_batch(scheduled):
            self._plan_steering(scheduled)
        self.scheduled = scheduled
        self.mode = self._route(watched)
        if self.capture_buffers is not None:
            self.capture_buffers.active = self.mode.graph_capture
        self._count(self.mode)
        return self.mode

    def _track(self, scheduler_output: Any) -> None:
        """Requests that finished, started, or computed more tokens since the last step."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.watched.discard(req_id)
            self.capture_keys.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            req = self.requests[new.req_id] = self._describe(new)
            if req.trace is not None or req.capture is not None:
                self.watched.add(new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if req_id in self.requests:
                self.requests[req_id].num_computed = computed

    def _watch(self, scheduled: dict[str, int]) -> Watched:
        """What the capturing and traced requests need of this step; those whose capture
        has ended (e.g. last_prompt once the prompt is computed) are no longer watched."""
        watched, ended = Watched(), []
        for req_id in self.watched:
            if req_id not in scheduled:
                continue
            req = self.requests[req_id]
            end = req.num_computed + scheduled[req_id]
            watched.traced = watched.traced or self._traces_now(req, scheduled[req_id])
            capture = req.capture
            if capture is None:
                continue  # traced only
            watched.keeps_keys |= bool(capture.patterns) and req.num_computed < req.prompt_len
            rows = capture.count(req.num_computed, end, req.prompt_len)
            watched.captured_rows += rows
            watched.outside_buffers |= rows > 0 and not req.captures_in_buffers
            if req.trace is None and capture.ended(end, req.prompt_len):
                ended.append(req_id)
        self.stats["watched"] += len(self.watched)
        self.watched.difference_update(ended)
        return watched

    def _repeats_decode_batch(self, scheduled: dict[str, int]) -> bool:
        """Whether the last steering plan stands: the same batch, every steered request
        decoding, no steering changed since."""
        return (
            self.steering_decodes_only
            and self.planned_version == self.interventions.version
            and scheduled == self.scheduled
        )

    def _plan_steering(self, scheduled: dict[str, int]) -> None:
        steered = []
        for req_id, num_tokens in scheduled.items():
            req = self.requests.get(req_id)
            steering = None if req is None else self._steering(req)
            if steering is not None:
                steered.append(SteeredRequest(req_id, req.num_computed, num_tokens, steering))
        self.steering_overflows = self.steering.plan(steered)
        self.planned_version = self.interventions.version
        self.steering_decodes_only = all(
            r.num_tokens == 1 and r.first >= r.steering.prompt_len for r in steered
        )

    def _route(self, watched: Watched) -> StepMode:
        """Uncompiled when a trace has work, a capture of attention patterns keeps keys,
        steering overflows the buffers, or rows are captured that the capture buffers cannot
        take; else compiled, capturing into the buffers when there is something to capture."""
        buffers, rows = self.capture_buffers, watched.captured_rows
        in_graph = (
            buffers is not None and not watched.outside_buffers and 0 < rows <= buffers.max_rows
        )
        uncompiled = watched.traced or watched.keeps_keys or self.steering_overflows
        uncompiled |= rows > 0 and not in_graph
        return StepMode(uncompiled=uncompiled, graph_capture=in_graph and not uncompiled)

    def _count(self, mode: StepMode) -> None:
        self.stats["steps"] += 1
        self.stats["uncompiled_steps"] += mode.uncompiled
        self.stats["graph_capture_steps"] += mode.graph_capture

    def _steering(self, req: Scheduled) -> RequestSteering | None:
        """The request's steering, worked out again only when global or named steering
        changed since."""
        if req.steering_version != self.interventions.version:
            specs = self.interventions.steering_for(req.specs)
            req.steering = RequestSteering(tuple(specs), req.prompt_len) if specs else None
            req.steering_version = self.interventions.version
        return req.steering

    def _describe(self, new: Any) -> Scheduled:
        extra = getattr(new.sampling_params, "extra_args", None) or {}
        payload = extra.get(EXTRA_ARGS_KEY)
        if isinstance(payload, str):  # from `vinterp serve` (vLLM's server passes text only)
            payload = extra[EXTRA_ARGS_KEY] = payload_from_text(payload)
        specs = self.interventions.decode(payload) if payload else None
        prompt_len = len(new.prompt_token_ids or [])
        scheduled = Scheduled(prompt_len, new.num_computed_tokens, specs)
        capture = scheduled.capture
        if capture is not None and self.capture_buffers is not None:
            chosen = self.capture_buffers.chosen
            scheduled.captures_in_buffers = not capture.patterns and all(
                self.order[s] in chosen for s in capture.sites
            )
        return scheduled

    def _traces_now(self, req: Scheduled, num_tokens: int) -> bool:
        if req.trace is None:
            return False
        run = self.traces.get(req.trace[0])
        return run is not None and run.works_at(req.trace[1], req.step(num_tokens))

    def begin_step(self, layout: list[tuple[str, int, int]], num_tokens: int) -> None:
        """Rows of this step's requests in batch order: (req id, first row, end row)."""
        self.steering.write(layout, num_tokens)
        if self.check is not None:
            self.check.begin()
        self.slots, self.wanted, self.keeping, self.num_tokens = [], {}, {}, num_tokens
        capturing = self.python_step or self.graph_capture_step
        captures = self._captures(layout) if capturing else []
        self.interventions.begin_capture_step([(span, c) for _, span, c in captures])
        self.pattern_captures = _pattern_captures(captures) if self.python_step else {}
        if self.sharded:  # known on every rank, unlike the capture tables of the shipping one
            self.captured_sites = frozenset(site for _, _, c in captures for site in c.sites)
        if self.capture_buffers is not None:  # also empties the index after a capturing step
            tables = self.interventions.capture_tables if self.graph_capture_step else {}
            self.capture_buffers.write({self.order[s]: t for s, t in tables.items()})
        if not self.python_step:
            return
        for row, (req_id, start, end) in enumerate(layout):
            req = self.requests.get(req_id)
            if req is not None and req.trace is not None and req.trace[0] in self.traces:
                self._add_slot(req, row, start, end)
        self.pipeline.deliver(self.slots)
        for slot in self.slots:
            for site in slot.run.sites_by_invoke.get(slot.invoke, ()):
                self.wanted.setdefault(site, []).append(slot)
            for site in slot.run.patterns_by_invoke.get(slot.invoke, ()):
                self.keeping.setdefault(site, []).append(slot)

    def _captures(self, layout: list[tuple[str, int, int]]) -> list[RequestCapture]:
        """This step's capturing requests: their ids, rows and capture specs."""
        captures = []
        for req_id, start, end in layout:
            req = self.requests.get(req_id)
            if req is not None and req.capture is not None:
                span = RowSpan(start, end, req.num_computed, req.prompt_len)
                captures.append((req_id, span, req.capture))
        return captures

    def end_step(self) -> None:
        """After the forward is queued: keep what the capture buffers gathered; with the
        check on, compare what the sites applied with what the step asked for."""
        buffers = self.capture_buffers
        gathers: list[int] = []
        if buffers is not None and buffers.active:
            self.interventions.keep_gathered(buffers)
            gathers = [
                s
                for s in map(self.order.__getitem__, self.interventions.capture_tables)
                if s in buffers.site_ids
            ]
        if self.check is not None:
            steered = self.steering.steered_per_site()
            self.check.end(self.stats["steps"], self.python_step, steered, gathers)

    def _add_slot(self, req: Scheduled, row: int, start: int, end: int) -> None:
        trace_id, invoke = req.trace  # type: ignore[misc]
        run = self.traces[trace_id]
        step = req.step(end - start)
        if step == 0 and (req.num_computed > 0 or end - start < req.prompt_len):
            if run.failure is None:
                cause = (
                    f"its first {req.num_computed} tokens came from vLLM's prefix cache"
                    if req.num_computed
                    else f"the scheduler split its {req.prompt_len} tokens over several engine "
                    "steps (chunked prefill) to fit them beside other requests' tokens in a "
                    "step's budget (max_num_batched_tokens); run the trace again, or start the "
                    "engine with a larger max_num_batched_tokens"
                )
                run.failure = Failure(
                    "",
                    f"the prompt of invoke {invoke} was not computed in one step: {cause}",
                    invoke,
                    0,
                )
            return
        self.slots.append(Slot(run, trace_id, invoke, step, start, end, row, req.num_computed))

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
        if site not in self.wanted and site not in self.captured_sites:
            return None
        assert self.order.heads is not None
        heads = self.order.heads.of(parse_site(site).part)
        new = self._at_site(site, full_heads(local, heads))
        return None if new is None else own_heads(new, local.shape[1])

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
        slots, captures = self.keeping.get(site, ()), self.pattern_captures.get(site, ())
        if not slots and not captures:
            return
        if site_id in self.sharded:
            assert self.order.heads is not None
            query = full_heads(query, self.order.heads.heads)
            key = full_heads(key, self.order.heads.kv_heads)
        reading = {id(slot) for slot in self.wanted.get(site, ())}
        for slot in slots:
            kept = self.keys.setdefault((slot.trace_id, slot.invoke), {})
            pattern = _kept_pattern(kept, site, query, key, slot.start, slot.end, slot.first, math)
            if id(slot) in reading:
                slot.run.at_site(slot.invoke, slot.step, site, pattern)
        for req_id, span, capture in captures:
            kept = self.capture_keys.setdefault(req_id, {})
            first, last = span.first_position, span.prompt_len - 1
            pattern = _kept_pattern(kept, site, query, key, span.start, span.end, first, math)
            if last < first + span.end - span.start:  # the last prompt token is in this step
                row = pattern.row(last - first, capture.heads)
                self.interventions.keep_row(site, capture.capture_id, last, row)
                del kept[site]
                if not kept:
                    del self.capture_keys[req_id]

    def _at_site(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """Capture and the traced invokes' nodes at a site whose value `x` is whole."""
        self.interventions.record(site, x)
        out = None
        for slot in self.wanted.get(site, ()):
            source = x if out is None else out
            new = slot.run.at_site(slot.invoke, slot.step, site, source[slot.start : slot.end])
            if new is not None:
                out = x.clone() if out is None else out
                out[slot.start : slot.end] = new
        return out

    def on_stream(
        self, site_id: int, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.check is not None:
            self.check.visit(site_id)
        site = self.order.sites[site_id]
        if site in self.interventions.capture_tables:
            self.interventions.record(site, hidden + residual)
        out = None
        for slot in self.wanted.get(site, ()):
            h, r = (hidden, residual) if out is None else out
            rows = slice(slot.start, slot.end)
            new = slot.run.at_site(slot.invoke, slot.step, site, h[rows] + r[rows])
            if new is not None:
                out = (hidden.clone(), residual.clone()) if out is None else out
                out[0][rows] = 0  # the next block adds hidden + residual: the sum is `new`
                out[1][rows] = new
        return out

    def on_raw(self, site: str, value: Any) -> None:
        """A raw module's native value, made whole under TP; each traced invoke gets its own
        token rows."""
        slots = self.wanted.get(site, ())
        if not slots:
            return
        module, which = self.raw_modules[site]
        value = full_raw(module, which, value)
        for slot in slots:
            rows = _token_rows(value, slot.start, slot.end, self.num_tokens)
            slot.run.at_site(slot.invoke, slot.step, site, rows)

    def on_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows of `logits` are this step's requests in batch order."""
        out = logits
        for slot in self.wanted.get("logits", ()):
            row = out[slot.row : slot.row + 1]
            new = slot.run.at_site(slot.invoke, slot.step, "logits", row)
            if new is not None:
                out = logits.clone() if out is logits else out
                out[slot.row : slot.row + 1] = new
        return out

    def on_samples(self, sampled: torch.Tensor) -> None:
        for slot in self.wanted.get("samples", ()):
            slot.run.at_site(slot.invoke, slot.step, "samples", sampled[slot.row].reshape(1).long())


class KeptKeys:
    """One request's keys at one layer, position by position, in a buffer that doubles when
    full (a step adds its keys without copying the earlier ones)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def put(self, first: int, own: torch.Tensor) -> torch.Tensor:
        """Keys of positions `first`.. (a request recomputed from an earlier position
        replaces them from there); all of them up to the last, a view."""
        end = first + len(own)
        if self.buffer is None or end > len(self.buffer):
            grown = own.new_empty((max(end, 2 * self.length), *own.shape[1:]))
            if self.buffer is not None:
                grown[:first] = self.buffer[:first]
            self.buffer = grown
        self.buffer[first:end] = own
        self.length = end
        return self.buffer[:end]


def _pattern_captures(
    captures: list[RequestCapture],
) -> dict[str, list[RequestCapture]]:
    """Per pattern site, the capturing requests that compute prompt tokens in this step (they
    keep their keys until the last prompt token's row is captured)."""
    found: dict[str, list[RequestCapture]] = {}
    for req_id, span, capture in captures:
        if capture.patterns and span.first_position < span.prompt_len:
            for site in capture.patterns:
                found.setdefault(site, []).append((req_id, span, capture))
    return found


def _kept_pattern(
    kept: dict[str, KeptKeys],
    site: str,
    query: torch.Tensor,
    key: torch.Tensor,
    start: int,
    end: int,
    first: int,
    math: PatternMath,
) -> Pattern:
    """One request's pattern at a site this step, rows start..end of the batch from position
    `first` on, over its keys of this step and those `kept` from earlier steps."""
    keys = kept.setdefault(site, KeptKeys()).put(first, key[start:end])
    positions = torch.arange(first, end - start + first, device=key.device)
    return Pattern(query[start:end], keys, positions, math)


def _last_position(modules: SiteModules, order: SiteOrder) -> int | None:
    """The forward position of this pipeline stage's last site, from the layers it really
    holds; None on the last (or only) stage: it sends nothing on."""
    from vllm.distributed import get_pp_group

    if get_pp_group().is_last_rank:
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


def _encode_saved(value: Any) -> Any:
    """Saved values cross vLLM's RPC as wire tensors (its own encoding does not round-trip
    tensors nested in containers)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_to_wire(value)}
    if isinstance(value, list):
        return [_encode_saved(v) for v in value]
    return value


def decode_saved(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return tensor_from_wire(value["tensor"])
    if isinstance(value, list):
        return [decode_saved(v) for v in value]
    return value
