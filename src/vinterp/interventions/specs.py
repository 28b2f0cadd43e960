"""What a worker builds from a request's `Steering` and `Capture` (`vinterp.wire.specs`): a
serial and a content key per steering (the tables are keyed by them), the scaled vectors,
and the capture's sites expanded for this model.

The request's data is decoded by the one decoder of the wire package and checked again
against the model here (raising only WireError): a worker never takes a malformed spec for
a valid one, whoever built it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from vinterp.sae import SAE
from vinterp.sae.steering import feature_steering_misfit
from vinterp.sites.names import SiteOrder, is_pattern
from vinterp.wire.errors import WireError
from vinterp.wire.probes import Probe, gating_misfit, probe_misfit, shared_gate_misfit
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import (
    Capture,
    Steering,
    capture_sites,
    feature_host,
    selected,
    selected_count,
    selection_ended,
    selects,
    steering_misfit,
)
from vinterp.wire.tensors import tensor_to_wire

_SERIALS = itertools.count(1)
# Identical specs become one WorkerSteering (WorkerProbe): the same steering sent with 256
# requests is one combination and one table row, not 256 (bounded: cleared when full).
_BY_CONTENT: dict[tuple[Any, ...], Any] = {}
_BY_CONTENT_MAX = 4096
_Shared = TypeVar("_Shared")


def _shared(key: tuple[Any, ...], make: Callable[[], _Shared]) -> _Shared:
    """The one object made for this content key."""
    if key not in _BY_CONTENT:
        if len(_BY_CONTENT) >= _BY_CONTENT_MAX:
            _BY_CONTENT.clear()
        _BY_CONTENT[key] = make()
    return _BY_CONTENT[key]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class WorkerProbe:
    """A `Probe` as the probe tables use it: its serial (equal probes share one, `shared`)."""

    probe: Probe
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False)

    @classmethod
    def shared(cls, probe: Probe) -> WorkerProbe:
        key = ("probe", probe.name, probe.site, _digest(probe.weight), _digest(probe.offsets))
        return _shared(key, lambda: cls(probe))


@dataclass(frozen=True)
class WorkerSteering:
    """A `Steering` as the steering tables use it: its serial, and which tokens it steers;
    a gated one (`when=`) with the request's probe that gates it."""

    steering: Steering
    gate: WorkerProbe | None = None
    positions: frozenset[int] | None = field(init=False)
    # per host site, the SAE features it steers there and their values times scale
    features: dict[str, dict[int, float]] = field(init=False)
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False)

    def __post_init__(self) -> None:
        positions = self.steering.positions
        object.__setattr__(self, "positions", None if positions is None else frozenset(positions))
        scale = self.steering.scale
        features = {
            feature_host(site): {j: v * scale for j, v in chosen.items()}
            for site, chosen in self.steering.features.items()
        }
        object.__setattr__(self, "features", features)

    @classmethod
    def shared(cls, steering: Steering, gate: WorkerProbe | None = None) -> WorkerSteering:
        """The one WorkerSteering of every steering with this content (and gate)."""
        key = (*content_key(steering), None if gate is None else gate.serial)
        return _shared(key, lambda: cls(steering, gate))

    @property
    def vectors(self) -> dict[str, torch.Tensor]:
        return self.steering.vectors

    @property
    def norm_match(self) -> bool:
        return self.steering.norm_match

    @property
    def clamps(self) -> bool:
        """Whether its features are set (clamped) rather than added to."""
        return self.steering.mode == "clamp"

    @property
    def ablates(self) -> bool:
        """Whether it projects its vectors' directions out (`mode="ablate"`)."""
        return self.steering.mode == "ablate"

    @property
    def sites(self) -> list[str]:
        """The sites it steers: its vectors' and its features' hosts."""
        return [*self.vectors, *self.features]

    def applies(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Which of these absolute token positions the steering steers."""
        in_prompt = positions < prompt_len
        phases = {"prefill": in_prompt, "decode": ~in_prompt}
        mask = phases.get(self.steering.phase, np.ones_like(in_prompt))
        if self.positions is not None:
            mask = mask & in_prompt & np.isin(positions, list(self.positions))
        return mask

    def scaled(self, site: str) -> torch.Tensor:
        """What it adds at `site`: scale * v, or scale * v / |v| (times the token's residual
        norm, applied on the device) with norm_match."""
        vector = self.vectors[site].float() * self.steering.scale
        if self.norm_match:
            return vector / self.vectors[site].float().norm().clamp_min(1e-12)
        return vector

    def direction(self, site: str) -> torch.Tensor:
        """The unit direction an ablation projects out at `site`."""
        vector = self.vectors[site].float()
        return vector / vector.norm()


def content_key(steering: Steering) -> tuple[Any, ...]:
    """Equal for steerings that steer alike (the vectors by a digest of their bytes)."""
    vectors = tuple((site, _digest(v)) for site, v in sorted(steering.vectors.items()))
    positions = None if steering.positions is None else tuple(sorted(steering.positions))
    features = tuple(
        (site, tuple(sorted(f.items()))) for site, f in sorted(steering.features.items())
    )
    return (
        vectors,
        steering.scale,
        steering.phase,
        positions,
        steering.norm_match,
        features,
        steering.mode,
        steering.when,
    )


def _digest(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's shape and a digest of its bytes."""
    return tuple(tensor.shape), hashlib.blake2b(tensor_to_wire(tensor)["data"]).digest()


@dataclass(frozen=True)
class WorkerCapture:
    """A request's `Capture` as the capture tables use it: its id, the sites it names
    expanded for this model, and the positions it selects; the attention patterns it names
    apart (one row each, the last prompt token's over the prompt), with their heads."""

    capture_id: str
    sites: tuple[str, ...]
    positions: str | frozenset[int]
    patterns: tuple[str, ...] = ()
    heads: tuple[int, ...] | None = None
    topk: int | None = None  # of the SAE feature sites it names

    @classmethod
    def of(cls, capture_id: str, capture: Capture, order: SiteOrder) -> WorkerCapture:
        try:
            sites = capture_sites(capture, order)
        except ValueError as exc:
            raise WireError(str(exc)) from None
        positions = capture.positions
        return cls(
            capture_id,
            tuple(s for s in sites if not is_pattern(s)),
            positions if isinstance(positions, str) else frozenset(positions),
            tuple(filter(is_pattern, sites)),
            None if capture.heads is None else tuple(capture.heads),
            capture.topk,
        )

    def count(self, first: int, end: int, prompt_len: int) -> int:
        """How many positions in first..end-1 are captured (decides how a step runs)."""
        return selected_count(self.positions, first, end, prompt_len)

    def ended(self, end: int, prompt_len: int) -> bool:
        """Whether no position from `end` on is captured: a request computed up to there
        needs no capturing step any more."""
        return selection_ended(self.positions, end, prompt_len)

    def wants(self, position: int, prompt_len: int) -> bool:
        return selects(self.positions, position, prompt_len)

    def wanted(self, first: int, count: int, prompt_len: int) -> Sequence[int]:
        """The positions of [first, first + count) this capture records, in order."""
        return selected(self.positions, first, count, prompt_len)


@dataclass
class WorkerRequest:
    """What one request asks of the workers (decoded once, cached on the request)."""

    steering: list[WorkerSteering]
    steering_names: list[str]
    capture: WorkerCapture | None
    trace: tuple[str, int] | None
    probes: tuple[WorkerProbe, ...] = ()
    probe_id: str = ""  # the id its scores are kept under (its capture's, if it has one)


def worker_steering(
    steering: Steering,
    order: SiteOrder,
    hidden_size: int,
    saes: Mapping[str, SAE],
    gates: Mapping[str, WorkerProbe] | None = None,
) -> WorkerSteering:
    """A decoded steering checked against this model and the SAEs attached; `gates`: the
    request's probes by name (None: a global or named steering, which cannot be gated)."""
    misfit = steering_misfit(steering, order.num_layers, hidden_size)
    misfit = misfit or feature_steering_misfit(steering, saes)
    if gates is None:
        misfit = misfit or shared_gate_misfit(steering)
    if misfit is not None:
        raise WireError(misfit)
    gate = None if steering.when is None or gates is None else gates[steering.when.probe]
    return WorkerSteering.shared(steering, gate)


def decode_request(
    extra: Any,
    order: SiteOrder,
    hidden_size: int,
    saes: Mapping[str, SAE],
    stage_starts: Sequence[int] = (0,),
) -> WorkerRequest:
    """A request's `extra_args[EXTRA_ARGS_KEY]`, decoded once (cached in that dict);
    `stage_starts`: the first layer of each pipeline stage."""
    cached = extra.get("_decoded") if isinstance(extra, dict) else None
    if cached is None:
        specs = RequestSpecs.from_wire(extra)
        capture = None
        if specs.capture is not None:
            capture = WorkerCapture.of(specs.capture_id, specs.capture, order)
        misfit = gating_misfit(specs.probes, specs.steering, order, stage_starts)
        for probe in specs.probes:
            misfit = misfit or probe_misfit(probe, order.num_layers, hidden_size)
        if misfit is not None:
            raise WireError(misfit)
        probes = {p.name: WorkerProbe.shared(p) for p in specs.probes}
        cached = WorkerRequest(
            [worker_steering(s, order, hidden_size, saes, probes) for s in specs.steering],
            specs.steering_names,
            capture,
            specs.trace,
            tuple(probes.values()),
            specs.capture_id if probes else "",
        )
        extra["_decoded"] = cached
    return cached
