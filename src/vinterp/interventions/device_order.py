"""Ordering work on a GPU by events instead of by the compute stream's queue: rows a step
computed are marked by an event (`step_event`), and work on them runs on a stream of its own
after those events (`after`), so it does not wait for the steps queued behind them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

StepEvent = torch.cuda.Event | None  # None: the rows are not on a GPU (nothing to order)

_streams: dict[torch.device, torch.cuda.Stream] = {}


def step_event(rows: torch.Tensor) -> StepEvent:
    """An event recorded now on the compute stream: `rows` are computed once it completes."""
    if not rows.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(rows.device))
    return event


@contextlib.contextmanager
def after(events: list[StepEvent], inputs: list[torch.Tensor]) -> Iterator[None]:
    """Run the block on a side stream once `events` complete (a plain block off a GPU). The
    `inputs` it reads are marked as used there, so the allocator does not hand their memory
    to the compute stream before the side stream is done with them."""
    waited = [e for e in events if e is not None]
    if not waited:
        yield
        return
    device = inputs[0].device
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    for event in waited:
        stream.wait_event(event)
    for tensor in inputs:
        tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        yield
