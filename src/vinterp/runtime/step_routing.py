"""How each step runs: compiled (vLLM's graphs, steering and capture buffers inside them) or
uncompiled (Python at the sites), decided before vLLM picks the step's graph mode.

A step runs uncompiled when a traced invoke has work in it, a capture of attention patterns
keeps keys, steering overflows its buffers, or rows are captured that the capture buffers
cannot take; otherwise it stays compiled, capturing into the buffers when a capture has rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.steer_tables import RequestSteering, SteeredRequest, SteeringPlanner
from vinterp.interventions.worker_state import WorkerInterventions
from vinterp.runtime.request_tracking import RequestTracker, StepSchedule, TrackedRequest


@dataclass(frozen=True)
class StepMode:
    """How a step runs: `uncompiled` (Python at the sites; vLLM's graphs and compiled code
    left for this step) or compiled, capturing into the capture buffers or not."""

    uncompiled: bool = False
    graph_capture: bool = False


@dataclass
class StepNeeds:
    """What this step's capturing and traced requests need of it."""

    traced: bool = False  # a traced invoke has work in this step
    captured_rows: int = 0
    outside_buffers: bool = False  # a captured row at a site without a capture buffer
    keeps_keys: bool = False  # a capture of attention patterns, its prompt not all computed


class StepRouter:
    """Plans each step's steering (probes included) and chooses its `StepMode`.

    Most steps repeat the last one: the same requests, each decoding one token. Then the
    steering plan stands; a step without steered requests plans nothing; and only the
    watched requests (capturing or traced) scheduled in it are looked at."""

    def __init__(
        self,
        tracker: RequestTracker,
        interventions: WorkerInterventions,
        steering: SteeringPlanner,
        capture_buffers: CaptureBuffers | None,
        traced_now: Callable[[TrackedRequest, int], bool],
    ) -> None:
        self.tracker, self.interventions, self.steering = tracker, interventions, steering
        self.capture_buffers, self.traced_now = capture_buffers, traced_now
        self.steered: set[str] = set()  # live requests with steering of their own or named
        self.scheduled: dict[str, int] = {}  # this step's requests -> tokens
        # the last steering plan: for which interventions version, whether every steered
        # request was decoding (then the same batch next step keeps the plan), and whether
        # it overflows the buffers
        self.planned_version: tuple[int, int] | None = None
        self.decodes_only = False
        self.overflows = False
        self.watched_total = 0  # watched requests looked at, summed over steps
        self.ended: list[str] = []  # captures whose last rows the step being run computes

    def route(self, schedule: StepSchedule) -> StepMode:
        self.tracker.watched.difference_update(self.ended)  # their last step has run
        for req_id in self.tracker.track(schedule):
            self.steered.discard(req_id)
        for new in schedule.new:
            specs = self.tracker.requests[new.req_id].specs
            if specs is not None and (specs.steering or specs.steering_names or specs.probes):
                self.steered.add(new.req_id)
        needs = self._needs(schedule.tokens)
        if not self._plan_stands(schedule.tokens):
            self._plan_steering(schedule.tokens)
        self.scheduled = schedule.tokens
        return self._mode(needs)

    def _needs(self, scheduled: dict[str, int]) -> StepNeeds:
        """What the capturing and traced requests need of this step; those whose capture
        ends with it (e.g. last_prompt in its prompt's last step) are watched no longer after
        it."""
        needs, ended = StepNeeds(), []
        looked_at = self.tracker.scheduled_watched(scheduled)
        for req_id in looked_at:
            req = self.tracker.get(req_id)
            assert req is not None
            num_tokens = scheduled[req_id]
            end = req.num_computed + num_tokens
            needs.traced = needs.traced or self.traced_now(req, num_tokens)
            capture = req.capture
            if capture is None:
                continue  # traced only
            needs.keeps_keys |= bool(capture.patterns) and req.num_computed < req.prompt_len
            rows = capture.count(req.num_computed, end, req.prompt_len)
            needs.captured_rows += rows
            needs.outside_buffers |= rows > 0 and not req.captures_in_buffers
            if req.trace is None and capture.ended(end, req.prompt_len):
                ended.append(req_id)
        self.watched_total += len(looked_at)
        self.ended = ended
        return needs

    def _plan_stands(self, scheduled: dict[str, int]) -> bool:
        """Whether the last steering plan stands: no steering changed since, and either
        nothing is steered or the batch repeats with every steered request decoding."""
        if self.planned_version != self.interventions.version:
            return False
        if not self.steered and not self.interventions.global_steering:
            return self.steering.plan_ is None
        return self.decodes_only and scheduled == self.scheduled

    def _plan_steering(self, scheduled: dict[str, int]) -> None:
        everyone = bool(self.interventions.global_steering)
        candidates = scheduled if everyone else [r for r in self.steered if r in scheduled]
        steered = []
        for req_id in candidates:
            req = self.tracker.get(req_id)
            steering = None if req is None else self._steering(req)
            if steering is not None:
                steered.append(
                    SteeredRequest(req_id, req.num_computed, scheduled[req_id], steering)
                )
        self.overflows = self.steering.plan(steered)
        self.planned_version = self.interventions.version
        self.decodes_only = all(
            r.num_tokens == 1 and r.first >= r.steering.prompt_len for r in steered
        )

    def _steering(self, req: TrackedRequest) -> RequestSteering | None:
        """The request's steering, worked out again only when global or named steering
        changed since."""
        if req.steering_version != self.interventions.version:
            specs = self.interventions.steering_for(req.specs)
            probes = () if req.specs is None else req.specs.probes
            probe_id = "" if req.specs is None else req.specs.probe_id
            req.steering = None
            if specs or probes:
                req.steering = RequestSteering(tuple(specs), req.prompt_len, probes, probe_id)
            req.steering_version = self.interventions.version
        return req.steering

    def _mode(self, needs: StepNeeds) -> StepMode:
        buffers, rows = self.capture_buffers, needs.captured_rows
        in_graph = (
            buffers is not None and not needs.outside_buffers and 0 < rows <= buffers.max_rows
        )
        uncompiled = needs.traced or needs.keeps_keys or self.overflows
        uncompiled |= rows > 0 and not in_graph
        return StepMode(uncompiled=uncompiled, graph_capture=in_graph and not uncompiled)
