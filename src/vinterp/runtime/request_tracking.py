"""Which requests the worker knows, from the scheduler's reports, step by step.

The engine reports each step as a `StepSchedule` (`engine.vllm_boundary.runner_hooks` reads it
off vLLM's scheduler output). A step's running requests report how many of their tokens are
computed; that is read for a request only when the step looks at it (a capturing, traced or
steered request), so a step of many plain requests costs no per-request work here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vinterp.interventions.specs import WorkerCapture, WorkerRequest
from vinterp.interventions.steer_tables import RequestSteering


@dataclass(frozen=True)
class NewRequest:
    """A request in its first scheduled step: its prompt length, tokens already computed
    (prefix cache) and vinterp's payload from its sampling parameters (None: plain)."""

    req_id: str
    prompt_len: int
    num_computed: int
    payload: dict[str, Any] | None


@dataclass
class StepSchedule:
    """One step as the scheduler planned it. The sequences are the engine's own (not copied)."""

    finished: Iterable[str]
    new: list[NewRequest]
    cached_ids: Sequence[str]  # running requests scheduled again
    cached_computed: Sequence[int]  # their computed tokens, in the same order
    tokens: dict[str, int]  # every scheduled request -> its tokens this step


@dataclass
class TrackedRequest:
    """What the worker knows of one request."""

    prompt_len: int
    num_computed: int  # tokens computed before this step (kept current by `RequestTracker`)
    specs: WorkerRequest | None
    steering: RequestSteering | None = None  # as of `steering_version` of the interventions
    steering_version: tuple[int, int] | None = None
    captures_in_buffers: bool = False  # every site it captures has a capture buffer
    synced_step: int = field(default=-1, repr=False)

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


class RequestTracker:
    """The live requests and those among them that capture or trace (`watched`)."""

    def __init__(self, describe: Callable[[NewRequest], TrackedRequest]) -> None:
        self.describe = describe
        self.requests: dict[str, TrackedRequest] = {}
        self.watched: set[str] = set()  # live requests that capture or trace
        self.step = 0
        self._cached: tuple[Sequence[str], Sequence[int]] = ((), ())
        self._computed: dict[str, int] | None = None  # this step's, built on first need

    def track(self, schedule: StepSchedule) -> list[str]:
        """Take in a step's schedule; the ids of the requests that finished."""
        self.step += 1
        finished = list(schedule.finished)
        for req_id in finished:
            self.requests.pop(req_id, None)
            self.watched.discard(req_id)
        for new in schedule.new:
            req = self.requests[new.req_id] = self.describe(new)
            req.synced_step = self.step
            if req.trace is not None or req.capture is not None:
                self.watched.add(new.req_id)
        self._cached, self._computed = (schedule.cached_ids, schedule.cached_computed), None
        return finished

    def get(self, req_id: str) -> TrackedRequest | None:
        """A live request, its computed tokens as of this step."""
        req = self.requests.get(req_id)
        if req is not None and req.synced_step != self.step:
            if self._computed is None:
                self._computed = dict(zip(*self._cached))
            computed = self._computed.get(req_id)
            if computed is not None:
                req.num_computed = computed
            req.synced_step = self.step
        return req

    def scheduled_watched(self, tokens: dict[str, int]) -> list[str]:
        """The watched requests scheduled in this step."""
        if len(self.watched) <= len(tokens):
            return [r for r in self.watched if r in tokens]
        return [r for r in tokens if r in self.watched]


class StepLayout:
    """This step's requests in batch order and their rows of the flat token batch, from the
    runner's own sequences; each view is built on first use, so a step that looks at a few
    requests does not walk the whole batch in Python."""

    def __init__(self, req_ids: Sequence[str], offsets: Any) -> None:
        self.req_ids, self.offsets = req_ids, offsets  # offsets: num_reqs + 1 query starts
        self._starts: list[int] | None = None
        self._rows: list[tuple[str, int, int]] | None = None
        self._index: dict[str, int] | None = None

    def _start_list(self) -> list[int]:
        if self._starts is None:
            self._starts = self.offsets[: len(self.req_ids) + 1].tolist()
        return self._starts

    def rows(self) -> list[tuple[str, int, int]]:
        """(req id, first row, end row) of every request, in batch order."""
        if self._rows is None:
            starts = self._start_list()
            self._rows = [(r, starts[i], starts[i + 1]) for i, r in enumerate(self.req_ids)]
        return self._rows

    def find(self, req_id: str) -> tuple[int, int, int] | None:
        """(index in the batch, first row, end row) of one request, None if not in it."""
        if self._index is None:
            self._index = dict(zip(self.req_ids, range(len(self.req_ids))))
        index = self._index.get(req_id)
        if index is None:
            return None
        starts = self._start_list()
        return index, starts[index], starts[index + 1]
