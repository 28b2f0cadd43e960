"""Runs a planned graph as the forward pass reaches each site; shared by every backend.

A backend calls `TraceRun.at_site(invoke, step, site, value)` with the invoke's own slice of
the site value; reads copy it (engines reuse buffers in place), writes return a replacement.
Computed values are evaluated lazily when a write or a save needs them. An error stops the
trace's interventions (the forward goes on unchanged) and is reported with the user's line.

The prompt's step may come in chunks of positions (`begin_chunk`; vLLM's chunked prefill): a
read or write of the prompt's step keeps a buffer of the whole prompt, each chunk fills its
rows, and computed values are evaluated over those buffers, so indices, shapes and broadcasting
are those of one step (`ir.positions` refuses the writes that would need a later position).
Saves, logits, samples and attention patterns of that step wait for its last chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vinterp.ir.graph import STEP_ZERO, Graph, Node, decode_arg
from vinterp.ir.ops import lookup
from vinterp.ir.plan import Plan
from vinterp.ir.positions import written_positions
from vinterp.sites.attention_pattern import Pattern
from vinterp.sites.names import RAW_PREFIX, is_pattern

ModelFunctions = dict[str, Callable[[torch.Tensor], torch.Tensor]]


@dataclass
class Failure:
    line: str
    message: str
    invoke: int
    step: int


@dataclass
class Chunk:
    """The positions `start`..`end` of an invoke's prompt of `length` this step computes."""

    start: int
    end: int
    length: int

    @property
    def final(self) -> bool:
        return self.end >= self.length


@dataclass
class TraceRun:
    graph: Graph
    plan: Plan
    model_functions: ModelFunctions
    values: dict[tuple[int, int], Any] = field(default_factory=dict)
    saved: dict[int, Any] = field(default_factory=dict)
    failure: Failure | None = None
    max_steps: dict[int, int] = field(default_factory=dict)
    keeps_results: bool = True  # False on TP ranks other than the first: they compute, not copy
    chunks: dict[int, Chunk] = field(default_factory=dict)  # invoke -> its prompt's chunk now
    _ran: dict[int, int] = field(default_factory=dict)  # invoke -> positions its nodes ran
    raw_parts: dict[int, list[Any]] = field(default_factory=dict)  # raw reads, chunk by chunk

    def __post_init__(self) -> None:
        self.save_set = set(self.graph.saves)
        self.calls_by_invoke: dict[int, list[int]] = {}  # memoised per chunk of the prompt
        for node_id, node in enumerate(self.graph.nodes):
            if node.kind == "call":
                self.calls_by_invoke.setdefault(node.invoke, []).append(node_id)
        self.writes: dict[int, dict[str, list[int]]] = {}  # invoke -> site -> write nodes
        for (invoke, site), node_ids in self.plan.schedule.items():
            written = [n for n in node_ids if self.graph.nodes[n].kind == "write"]
            if written and _token_site(site):
                self.writes.setdefault(invoke, {})[site] = written
        self.sites_by_invoke: dict[int, list[str]] = {}
        self.nodes_by_invoke: dict[int, list[int]] = {}  # per step, look at one invoke's only
        # attention patterns an invoke reads: its keys are kept from every step for them
        self.patterns_by_invoke: dict[int, list[str]] = {}
        for (invoke, site), node_ids in self.plan.schedule.items():
            self.sites_by_invoke.setdefault(invoke, []).append(site)
            self.nodes_by_invoke.setdefault(invoke, []).extend(node_ids)
            if is_pattern(site):
                self.patterns_by_invoke.setdefault(invoke, []).append(site)
        for k, inv in enumerate(self.graph.invokes):
            self.max_steps[k] = int(inv.sampling.get("max_tokens", 16))

    def _active(self, node: Node, step: int) -> bool:
        if node.block == STEP_ZERO:
            return step == 0
        return self.graph.blocks[node.block].contains(step)

    def active_at(self, node_id: int, step: int) -> bool:
        return self._active(self.graph.nodes[node_id], step)

    def key(self, node_id: int, step: int) -> tuple[int, int]:
        return (node_id, 0 if self.graph.nodes[node_id].block == STEP_ZERO else step)

    def works_at(self, invoke: int, step: int) -> bool:
        """Whether the invoke has anything to run at any site in this generation step (an
        invoke that reads an attention pattern keeps its keys in every step)."""
        if self.failure is not None or step >= self.max_steps.get(invoke, 0):
            return False
        if invoke in self.patterns_by_invoke:
            return True
        nodes = self.nodes_by_invoke.get(invoke, ())
        return any(self.active_at(node_id, step) for node_id in nodes)

    def begin_chunk(self, invoke: int, start: int, end: int) -> None:
        """The invoke's prompt positions start..end come next (an unsplit prompt: one chunk);
        values computed from the previous chunk's buffers are computed again."""
        self.chunks[invoke] = Chunk(start, end, len(self.graph.invokes[invoke].prompt))
        for node_id in self.calls_by_invoke.get(invoke, ()):
            self.values.pop((node_id, 0), None)

    def positions_ran(self, invoke: int) -> int:
        """How many of the invoke's positions its nodes ran: a request computed again (after
        a preemption) replays those."""
        return self._ran.get(invoke, 0)

    def runs(self, invoke: int, step: int, start: int, end: int) -> None:
        """The invoke's nodes run positions start..end-1 in this engine step (in generation
        step `step`; in step 0, a chunk of its prompt)."""
        if step == 0:
            self.begin_chunk(invoke, start, end)
        self._ran[invoke] = end

    def chunk(self, invoke: int) -> Chunk:
        length = len(self.graph.invokes[invoke].prompt)
        return self.chunks.get(invoke) or Chunk(0, length, length)

    def write_sites(self, invoke: int) -> dict[str, list[int]]:
        return self.writes.get(invoke, {})

    def replayed(
        self, invoke: int, site: str, first: int, rows: torch.Tensor
    ) -> torch.Tensor | None:
        """Rows of positions `first`.. computed again (after a preemption) as the trace left
        them at `site`: what its last write there gave each position (None: it wrote none)."""
        nodes = self.writes.get(invoke, {}).get(site, ())
        length = len(self.graph.invokes[invoke].prompt)
        out, changed = rows, False
        for i in range(len(rows)):
            position = first + i
            step = 0 if position < length else position - length + 1
            written = next(
                (
                    self.values[self.key(n, step)]
                    for n in reversed(nodes)
                    if self.active_at(n, step) and self.key(n, step) in self.values
                ),
                None,
            )
            if written is None:
                continue
            if not changed:
                out, changed = rows.clone(), True
            out[i] = written[position] if step == 0 else written[-1]
        return out if changed else None

    def wants(self, invoke: int, site: str) -> bool:
        return (invoke, site) in self.plan.schedule and self.failure is None

    def at_site(
        self, invoke: int, step: int, site: str, value: torch.Tensor
    ) -> torch.Tensor | None:
        """Run the invoke's nodes scheduled at `site`; the replacement value, or None."""
        if self.failure is not None or step >= self.max_steps.get(invoke, 0):
            return None  # one step past the end (scheduler overrun) adds nothing
        chunk = self.chunk(invoke) if step == 0 else None
        rows = chunk is not None and _token_site(site)
        if chunk is not None and not rows and not site.startswith(RAW_PREFIX) and not chunk.final:
            return None  # logits, samples, patterns of the prompt: once it is all computed
        current, replaced = value, False
        for node_id in self.plan.schedule.get((invoke, site), ()):
            node = self.graph.nodes[node_id]
            if not self._active(node, step):
                continue
            try:
                if node.kind == "read" and rows:
                    self._buffer(node_id, current, chunk)[chunk.start : chunk.end] = current
                elif node.kind == "read" and chunk is not None and site.startswith(RAW_PREFIX):
                    self._raw_part(node_id, current, chunk)
                elif node.kind == "read":
                    self.values[self.key(node_id, step)] = _copy(current)
                elif node.kind == "write" and rows:
                    new = self._write_rows(node_id, node, current, chunk)
                    replaced = replaced or new is not None
                    current = current if new is None else new
                elif node.kind == "write":
                    current = self._write(node_id, node, current, step)
                    replaced = True
                if node_id in self.save_set and (chunk is None or chunk.final):
                    self._save(node_id, step)
            except Exception as exc:  # reported to the caller, never kills the engine
                self.failure = Failure(node.line, f"{type(exc).__name__}: {exc}", invoke, step)
                return None
        return current if replaced else None

    def _buffer(self, node_id: int, rows: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """The node's value over the whole prompt, filled chunk by chunk."""
        buffer = self.values.get((node_id, 0))
        if buffer is None:
            buffer = rows.new_zeros((chunk.length, *rows.shape[1:]))
            self.values[(node_id, 0)] = buffer
        return buffer

    def _write_rows(
        self, node_id: int, node: Node, current: torch.Tensor, chunk: Chunk
    ) -> torch.Tensor | None:
        """A write in the prompt's step, applied to the whole prompt's buffer where it writes
        a position of this chunk; the chunk's rows after it (None: unchanged)."""
        buffer = self._buffer(node_id, current, chunk)
        buffer[chunk.start : chunk.end] = current
        if len(node.args) > 1 and not self._writes_in(node, buffer, chunk):
            return None
        return self._write(node_id, node, buffer, 0)[chunk.start : chunk.end]

    def _writes_in(self, node: Node, buffer: torch.Tensor, chunk: Chunk) -> bool:
        """Whether an indexed write writes a position of this chunk; one that does not waits
        for the chunk holding its positions (its value may need them)."""
        index = decode_arg(node.args[1], lambda r: self.value(r, 0))
        written = written_positions(index, chunk.length, buffer.dim() - 1)
        return written is None or any(chunk.start <= p < chunk.end for p in written)

    def _raw_part(self, node_id: int, value: Any, chunk: Chunk) -> None:
        """A raw module's value of one chunk; joined along its token axis after the last."""
        parts = self.raw_parts.setdefault(node_id, [])
        parts.append((_copy(value), chunk.end - chunk.start))
        if chunk.final:
            self.values[(node_id, 0)] = _join_token_parts(self.raw_parts.pop(node_id))

    def _write(self, node_id: int, node: Node, current: torch.Tensor, step: int) -> torch.Tensor:
        new = self._arg(node.args[0], step)
        if len(node.args) > 1:
            index = decode_arg(node.args[1], lambda r: self.value(r, step))
            out = current.clone()
            out[index] = torch.as_tensor(new, dtype=out.dtype, device=out.device)
        else:
            new = torch.as_tensor(new, device=current.device)
            if new.shape != current.shape:
                try:
                    new = torch.broadcast_to(new, current.shape)
                except RuntimeError:
                    raise ValueError(
                        f"the write to {node.target} has shape {tuple(new.shape)}, "
                        f"the site has shape {tuple(current.shape)}"
                    ) from None
            out = new.to(current.dtype).clone()
        self.values[self.key(node_id, step)] = out
        return out

    def _arg(self, encoded: Any, step: int) -> Any:
        return decode_arg(encoded, lambda r: self.value(r, step))

    def value(self, node_id: int, step: int, rows_of_pattern: bool = False) -> Any:
        """The value of a node at a step, computing call nodes on demand. An attention
        pattern read stays a `Pattern` only for `rows_of_pattern` (the first argument of an
        index, which computes only the rows it picks); elsewhere it is computed whole."""
        key = self.key(node_id, step)
        if key in self.values:
            value = self.values[key]
            if isinstance(value, Pattern) and not rows_of_pattern:
                value = self.values[key] = value.full()
            return value
        node = self.graph.nodes[node_id]
        if node.kind == "const":
            result = self.graph.tensors[node.args[0]]
        elif node.kind == "call":
            lazy = node.target == "op.getitem"
            args = [
                decode_arg(a, lambda r, rows=lazy and i == 0: self.value(r, step, rows))
                for i, a in enumerate(node.args)
            ]
            kwargs = {k: self._arg(v, step) for k, v in node.kwargs.items()}
            if node.target.startswith("model."):
                name = node.target.removeprefix("model.")
                function = self.model_functions[name]
                if name in ROW_FUNCTIONS:
                    result = on_rows(function, *args, **kwargs)
                else:
                    result = function(*args, **kwargs)
            else:
                result = lookup(node.target)(*args, **kwargs)
        else:
            raise RuntimeError(
                f"the value of {node.target} (invoke {node.invoke}, step {step}) is not "
                "available here: the engine did not compute it before this point"
            )
        self.values[key] = result
        return result

    def _save(self, node_id: int, step: int) -> None:
        if not self.keeps_results:
            self.value(node_id, step)  # computed all the same: a later node may need it
            return
        value = _copy(self.value(node_id, step), "cpu")
        if self.graph.nodes[node_id].block == STEP_ZERO:
            self.saved[node_id] = value
        else:
            self.saved.setdefault(node_id, {})[step] = value

    def results(self) -> dict[int, Any]:
        """Saved values: a tensor per node, or a list (one per step that ran) in blocks."""
        return {
            n: [v[s] for s in sorted(v)] if isinstance(v, dict) else v
            for n, v in self.saved.items()
        }


# Model functions that map each row of the hidden size to a row (a norm, the unembedding).
ROW_FUNCTIONS = ("final_norm", "lm_head")


def on_rows(function: Any, x: Any) -> Any:
    """`function` on the rows of `x` as one contiguous (rows, H) matrix, the result in `x`'s
    leading shape. The engines' GPU kernels take only that layout: vLLM's CUDA RMSNorm fails
    on a 1-D row (`llm.unembed(llm.layers[i].output[-1])`), where the CPU kernels pass."""
    if not isinstance(x, torch.Tensor) or (x.dim() == 2 and x.is_contiguous()):
        return function(x)
    out = function(x.reshape(-1, x.shape[-1]).contiguous())
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _token_site(site: str) -> bool:
    """A site whose value has one row per token (not logits, samples, patterns, raw)."""
    return (
        site not in ("logits", "samples")
        and not is_pattern(site)
        and not (site.startswith(RAW_PREFIX))
    )


def _join_token_parts(parts: list[tuple[Any, int]]) -> Any:
    """Values of consecutive chunks joined along their token axis (the first of their first
    two axes whose size is the chunk's token count, as the worker cut them)."""
    first, count = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        axis = next((a for a, n in enumerate(first.shape[:2]) if n == count), None)
        if axis is None:
            return parts[-1][0]  # no token axis: the value of the last chunk
        return torch.cat([p for p, _ in parts], dim=axis)
    if isinstance(first, (list, tuple)):
        return [_join_token_parts([(p[i], n) for p, n in parts]) for i in range(len(first))]
    return parts[-1][0]


def _copy(value: Any, device: str | None = None) -> Any:
    """A detached copy (engines reuse activation buffers in place; DESIGN.md lesson 2)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device or value.device, copy=True)
    if isinstance(value, Pattern):
        return value.copied() if device is None else value.full().to(device)
    if isinstance(value, (tuple, list)):
        return [_copy(v, device) for v in value]
    return value


@dataclass
class TraceResult:
    """What a backend returns for a trace: per-invoke outputs, saved values, a failure."""

    outputs: list[Any]
    saved: dict[int, Any]
    failure: Failure | None
