"""Trace values that cross pipeline stages: read on one stage, used on a later one.

vLLM sends each step's IntermediateTensors (hidden states, residual) from stage k to k+1.
A trace's values travel in the same dict under their own keys, so they arrive with the step
they belong to, once, in forward order, with no side channel to wait on (nnsight's pull
protocol stalled exactly there). Every stage derives the same export sets from the same
graph and plan, so sender and receiver agree without a handshake.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

from vinterp.ir.graph import node_inputs
from vinterp.ir.plan import ANY_TIME
from vinterp.runtime.executor import Failure, TraceRun

# Two byte tensors (vLLM's CPU transport sends tensors only, at most 8 per step): the values'
# bytes, and the JSON index [(key, dtype, shape, size)] of what they hold.
DATA, INDEX = "vinterp:data", "vinterp:index"


def exports_of(run: TraceRun, last_position: int) -> dict[int, list[int]]:
    """Per invoke: the nodes whose value exists by the end of a stage (anchored at or before
    its last site) and that a node of that invoke anchored on a later stage consumes (the
    producer may belong to an earlier invoke: patching across invokes and stages)."""
    anchors = run.plan.anchors
    needed_later: dict[int, set[int]] = {}
    for consumer, node in enumerate(run.graph.nodes):
        if anchors[consumer] > last_position:
            needed_later.setdefault(node.invoke, set()).update(node_inputs(node))
    return {
        invoke: sorted(n for n in producers if ANY_TIME < anchors[n] <= last_position)
        for invoke, producers in needed_later.items()
    }


class StageValues:
    """This stage's side of the transport: what to send after its forward, what it got."""

    def __init__(self, last_position: int | None) -> None:
        self.last_position = last_position  # None on the last stage: nothing to send
        self.exports: dict[str, dict[int, list[int]]] = {}  # trace id -> invoke -> node ids
        self.received: dict[str, torch.Tensor] = {}

    def add_trace(self, trace_id: str, run: TraceRun) -> None:
        if self.last_position is not None:
            self.exports[trace_id] = exports_of(run, self.last_position)

    def forget(self, trace_id: str) -> None:
        self.exports.pop(trace_id, None)

    def pack(self, slots: Iterable[Any]) -> dict[str, Any]:
        """The values later stages need from this step's traced invokes, as one byte tensor
        and its index (vLLM's CPU transport carries at most 8 tensors per step)."""
        values: dict[str, torch.Tensor] = {}
        for slot in slots:
            run = slot.run
            for node_id in self.exports.get(slot.trace_id, {}).get(slot.invoke, ()):
                if run.failure is not None or not run.active_at(node_id, slot.step):
                    continue
                try:
                    value = torch.as_tensor(run.value(node_id, slot.step))
                except Exception as exc:  # the invoke fails, the step goes on
                    line = run.graph.nodes[node_id].line
                    run.failure = Failure(line, f"{type(exc).__name__}: {exc}", slot.invoke, 0)
                    continue
                values[f"{slot.trace_id}:{slot.invoke}:{node_id}"] = value
        return _to_bytes(values) if values else {}

    def take(self, received: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Keep the values (bytes, index) the previous stage sent with this step, if any.
        Runs every step: the previous stage may send values that this one no longer wants."""
        self.received = {} if received is None else _from_bytes(*received)

    def deliver(self, slots: Iterable[Any]) -> None:
        """Put the received values into their traces, as if read on this stage."""
        for slot in slots:
            prefix = f"{slot.trace_id}:{slot.invoke}:"
            for key in [k for k in self.received if k.startswith(prefix)]:
                node_id = int(key.rsplit(":", 1)[1])
                slot.run.values[slot.run.key(node_id, slot.step)] = self.received.pop(key)
        self.received.clear()


def _to_bytes(values: dict[str, torch.Tensor]) -> dict[str, Any]:
    index, parts = [], []
    for key, value in values.items():
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
        index.append((key, str(value.dtype).removeprefix("torch."), list(value.shape), raw.numel()))
        parts.append(raw)
    encoded = bytearray(json.dumps(index).encode())
    device = parts[0].device
    return {DATA: torch.cat(parts), INDEX: torch.frombuffer(encoded, dtype=torch.uint8).to(device)}


def _from_bytes(data: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
    values, offset = {}, 0
    for key, dtype, shape, size in json.loads(index.cpu().numpy().tobytes()):
        raw = data[offset : offset + size]
        values[key] = raw.view(getattr(torch, dtype)).reshape(shape).clone()
        offset += size
    return values
