"""Worker-side trace execution inside vLLM: which rows of the flat token batch belong to
which traced invoke at which step, and the handlers the site ops call.

vLLM flattens every scheduled token of every request into one (tokens, H) batch. Before
each forward, `begin_step` reads the runner's request order and query offsets; the site
handlers then hand each traced invoke its own row slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vinterp.fastpath.specs import FAST_KEY
from vinterp.fastpath.tables import RowSpan
from vinterp.fastpath.worker import FastPath
from vinterp.ir.plan import PlanError, make_plan
from vinterp.ir.wire import WireError, from_wire, tensor_from_wire, tensor_to_wire
from vinterp.runtime import site_ops
from vinterp.runtime.executor import Failure, TraceRun
from vinterp.sites.modules import SiteModules, unhooked
from vinterp.sites.names import SiteOrder, UnknownSiteError
from vinterp.sites.raw import install_raw_hooks, raw_sites_of

EXTRA_ARGS_KEY = "vinterp"


@dataclass
class Slot:
    """One traced request in this step: its trace, invoke, step, rows and logits row."""

    run: TraceRun
    invoke: int
    step: int
    start: int
    end: int
    row: int  # index among this step's requests (logits/samples row)


class WorkerRuntime:
    def __init__(
        self,
        runner: Any,
        modules: SiteModules,
        order: SiteOrder,
        vocab_size: int,
        captures_here: bool = True,
    ) -> None:
        self.runner = runner
        self.order = order
        self.functions = {
            "final_norm": unhooked(modules.final_norm),
            "lm_head": self._lm_head(modules, vocab_size),
        }
        self.traces: dict[str, TraceRun] = {}
        self.slots: list[Slot] = []
        self.wanted: dict[str, list[Slot]] = {}  # site -> this step's slots with work there
        self.num_tokens = 0
        self.raw_hooks: dict[str, list[Any]] = {}
        self.fast = FastPath(order, captures_here=captures_here)
        site_ops.HANDLERS.site = self.on_site
        site_ops.HANDLERS.stream = self.on_stream

    @staticmethod
    def _lm_head(modules: SiteModules, vocab_size: int) -> Any:
        head = modules.lm_head  # vocab rows may be padded: keep the real vocabulary
        return lambda x: torch.nn.functional.linear(x, head.weight)[..., :vocab_size]

    # -- trace lifecycle (called through collective_rpc) -----------------------------------
    def begin(self, trace_id: str, wire: dict[str, Any]) -> str | None:
        """Register a trace; an error message (not an exception: the engine stays up)."""
        try:
            graph = from_wire(wire, self.order)
            run = TraceRun(graph, make_plan(graph, self.order), self.functions)
            raw_sites = raw_sites_of(graph)
            if raw_sites and not self.runner.model_config.enforce_eager:
                return (
                    "llm.raw sites need an engine started with enforce_eager=True: hooks "
                    "cannot be added to the compiled model after it started"
                )
            self.raw_hooks[trace_id] = install_raw_hooks(self.runner.model, raw_sites, self.on_raw)
        except (WireError, PlanError, UnknownSiteError) as exc:
            return str(exc)
        self.traces[trace_id] = run
        return None

    def forget(self, trace_id: str) -> TraceRun | None:
        """Drop a trace and its hooks (after collection, or when it could not start)."""
        for handle in self.raw_hooks.pop(trace_id, ()):
            handle.remove()
        return self.traces.pop(trace_id, None)

    def collect(self, trace_id: str) -> dict[str, Any]:
        run = self.forget(trace_id)
        if run is None:
            return {"saved": {}, "failure": None}
        failure = run.failure.__dict__ if run.failure else None
        saved = {node: _encode_saved(value) for node, value in run.results().items()}
        return {"saved": saved, "failure": failure}

    # -- per step -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Map this step's requests to their rows (called before each forward)."""
        self.slots, self.wanted = [], {}
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        offsets = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        self.num_tokens = offsets[-1]
        fast_requests = []
        for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            state = runner.requests[req_id]
            extra_args = getattr(state.sampling_params, "extra_args", None) or {}
            start, end = offsets[row], offsets[row + 1]
            prompt_len = len(state.prompt_token_ids or [])
            fast_requests.append(
                (
                    RowSpan(start, end, state.num_computed_tokens, prompt_len),
                    extra_args.get(FAST_KEY),
                )
            )
            traced = extra_args.get(EXTRA_ARGS_KEY)
            if traced and traced["trace"] in self.traces:
                self._add_slot(
                    self.traces[traced["trace"]], int(traced["invoke"]), state, row, start, end
                )
        self.fast.begin_step(fast_requests)
        for slot in self.slots:
            for site in slot.run.sites_by_invoke.get(slot.invoke, ()):
                self.wanted.setdefault(site, []).append(slot)

    def _add_slot(
        self, run: TraceRun, invoke: int, state: Any, row: int, start: int, end: int
    ) -> None:
        step = len(state.output_token_ids)
        if step == 0 and end - start < len(state.prompt_token_ids or []):
            if run.failure is None:
                run.failure = Failure(
                    "",
                    f"the prompt of invoke {invoke} was split over several engine steps "
                    "(chunked prefill); start the engine with max_num_batched_tokens of at "
                    "least the prompt length",
                    invoke,
                    0,
                )
            return
        self.slots.append(Slot(run, invoke, step, start, end, row))

    def on_site(self, site_id: int, x: torch.Tensor) -> torch.Tensor | None:
        site = self.order.sites[site_id]
        out = self.fast.on_plain(site, x)
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
        site = self.order.sites[site_id]
        out = self.fast.on_stream(site, hidden, residual)
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
        """A raw module's native value: each traced invoke gets its own token rows."""
        for slot in self.wanted.get(site, ()):
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
