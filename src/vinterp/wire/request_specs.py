"""What one request carries to the workers: its own steering, registered steering names, a
capture, probes and a trace invoke, as the value of `extra_args[EXTRA_ARGS_KEY]`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vinterp.wire.errors import WireError, short
from vinterp.wire.probes import Probe, probes_from_data
from vinterp.wire.specs import EXTRA_ARGS_KEY, Capture, Steering


@dataclass
class RequestSpecs:
    """One request's interventions as the workers receive them: its own steering, the names
    of registered steerings, a capture with its id, probes (their scores kept under the same
    id), or the trace invoke it runs."""

    steering: list[Steering] = field(default_factory=list)
    steering_names: list[str] = field(default_factory=list)
    capture: Capture | None = None
    capture_id: str = ""
    trace: tuple[str, int] | None = None  # (trace id, invoke)
    probes: list[Probe] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        """The value of `extra_args[EXTRA_ARGS_KEY]`."""
        out: dict[str, Any] = {}
        if self.steering:
            out["steering"] = [s.to_wire() for s in self.steering]
        if self.steering_names:
            out["steering_names"] = list(self.steering_names)
        if self.capture is not None:
            out["capture"] = {"id": self.capture_id, **self.capture.to_json()}
        if self.trace is not None:
            out["trace"] = [self.trace[0], self.trace[1]]
        if self.probes:
            out["probes"] = {"id": self.capture_id, "specs": [p.to_wire() for p in self.probes]}
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> RequestSpecs:
        """The inverse of `to_wire`, for data from anyone: raises only WireError."""
        fields = {"steering", "steering_names", "capture", "trace", "probes"}
        if not isinstance(obj, dict) or not set(obj) <= fields:
            raise WireError(f"{EXTRA_ARGS_KEY}: expected a dict with fields among {sorted(fields)}")
        steering = obj.get("steering", [])
        if not isinstance(steering, list):
            raise WireError(f"{EXTRA_ARGS_KEY}.steering: expected a list, got {short(steering)}")
        names = obj.get("steering_names", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WireError(f"{EXTRA_ARGS_KEY}.steering_names: expected names, got {short(names)}")
        specs = cls([Steering.from_wire(s) for s in steering], list(names))
        capture = obj.get("capture")
        if capture is not None:
            if not isinstance(capture, dict):
                raise WireError(f"{EXTRA_ARGS_KEY}.capture: expected a dict, got {short(capture)}")
            capture_id = capture.get("id")
            if not isinstance(capture_id, str) or not capture_id:
                raise WireError(f"capture.id: expected a non-empty string, got {short(capture_id)}")
            specs.capture_id = capture_id
            specs.capture = Capture.from_json({k: v for k, v in capture.items() if k != "id"})
        trace = obj.get("trace")
        if trace is not None:
            if (
                not isinstance(trace, list)
                or len(trace) != 2
                or not isinstance(trace[0], str)
                or not isinstance(trace[1], int)
                or isinstance(trace[1], bool)
            ):
                raise WireError(f"{EXTRA_ARGS_KEY}.trace: expected [trace id, invoke]")
            specs.trace = (trace[0], trace[1])
        probes = obj.get("probes")
        if probes is not None:
            probe_id = probes.get("id") if isinstance(probes, dict) else None
            if not isinstance(probe_id, str) or not probe_id:
                raise WireError(f"{EXTRA_ARGS_KEY}.probes: expected {{id, specs}}")
            if specs.capture_id not in ("", probe_id):
                raise WireError(f"{EXTRA_ARGS_KEY}.probes.id: differs from capture.id")
            specs.capture_id = probe_id
            specs.probes = probes_from_data(probes.get("specs"), Probe.from_wire)
        return specs
