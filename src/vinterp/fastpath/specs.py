"""Worker-side steering and capture specs decoded from a request's wire form.

The wire form is built by vinterp's front ends from checked specs, but the decoders check it
again (they raise only WireError): a worker must never take a malformed spec for a valid one.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vinterp.sites.names import SiteOrder, UnknownSiteError, is_steerable
from vinterp.wire.errors import WireError, short
from vinterp.wire.tensors import is_int, tensor_from_wire, tensor_to_wire

FAST_KEY = "vinterp_fast"
_SERIALS = itertools.count(1)
# Identical specs decode to one SteerSpec: the same steering sent with 256 requests is one
# combination and one table row, not 256 (bounded: cleared when full).
_BY_CONTENT: dict[tuple[Any, ...], SteerSpec] = {}
_BY_CONTENT_MAX = 4096
PHASES = ("all", "prefill", "decode")
POSITION_SELECTORS = ("last_prompt", "all_prompt", "all_generated", "all")


def _fields(obj: Any, what: str, names: set[str], optional: set[str] = frozenset()) -> None:
    if not isinstance(obj, dict) or not names <= set(obj) <= names | optional:
        raise WireError(f"{what}: expected a dict with fields {sorted(names)}, got {short(obj)}")


def _finite_number(value: Any, what: str) -> float:
    try:
        number = float(value) if isinstance(value, (int, float)) else math.nan
    except OverflowError:
        number = math.inf
    if isinstance(value, bool) or not math.isfinite(number):
        raise WireError(f"{what}: expected a finite number, got {short(value)}")
    return number


def _positions(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(p) and p >= 0 for p in value):
        raise WireError(f"{what}: expected a list of token positions >= 0, got {short(value)}")
    return value


@dataclass(frozen=True)
class SteerSpec:
    vectors: dict[str, torch.Tensor]
    scale: float
    phase: str
    positions: frozenset[int] | None
    norm_match: bool
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False)

    @classmethod
    def from_wire(cls, obj: Any, order: SiteOrder, hidden_size: int) -> SteerSpec:
        _fields(obj, "steering", {"vectors", "scale", "phase", "positions", "norm_match"})
        wires = obj["vectors"]
        if not isinstance(wires, dict) or not wires:
            raise WireError(f"steering.vectors: expected {{site: vector}}, got {short(wires)}")
        vectors = {}
        for site, wire in wires.items():
            _check_steerable(site, order)
            vector = vectors[site] = tensor_from_wire(wire)
            if vector.shape != (hidden_size,) or not vector.is_floating_point():
                raise WireError(
                    f"steering.vectors[{site!r}]: expected a float vector of this model's "
                    f"hidden size {hidden_size}, got {vector.dtype} {tuple(vector.shape)}"
                )
            if not torch.isfinite(vector).all():
                raise WireError(f"steering.vectors[{site!r}]: contains inf or nan")
        scale = _finite_number(obj["scale"], "steering.scale")
        if obj["phase"] not in PHASES:
            raise WireError(f"steering.phase: expected one of {PHASES}, got {short(obj['phase'])}")
        if not isinstance(obj["norm_match"], bool):
            raise WireError("steering.norm_match: expected true or false")
        positions = obj["positions"]
        spec = cls(
            vectors=vectors,
            scale=scale,
            phase=obj["phase"],
            positions=None
            if positions is None
            else frozenset(_positions(positions, "steering.positions")),
            norm_match=obj["norm_match"],
        )
        key = spec.content_key()
        if key not in _BY_CONTENT:
            if len(_BY_CONTENT) >= _BY_CONTENT_MAX:
                _BY_CONTENT.clear()
            _BY_CONTENT[key] = spec
        return _BY_CONTENT[key]

    def content_key(self) -> tuple[Any, ...]:
        """Equal for specs that steer alike (the vectors by a digest of their bytes)."""
        vectors = tuple(
            (
                site,
                str(v.dtype),
                tuple(v.shape),
                hashlib.blake2b(tensor_to_wire(v)["data"]).digest(),
            )
            for site, v in sorted(self.vectors.items())
        )
        positions = None if self.positions is None else tuple(sorted(self.positions))
        return (vectors, self.scale, self.phase, positions, self.norm_match)

    def applies(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Which of these absolute token positions the spec steers."""
        in_prompt = positions < prompt_len
        phases = {"prefill": in_prompt, "decode": ~in_prompt}
        mask = phases.get(self.phase, np.ones_like(in_prompt))
        if self.positions is not None:
            mask = mask & in_prompt & np.isin(positions, list(self.positions))
        return mask

    def scaled(self, site: str) -> torch.Tensor:
        """What the spec adds at `site`: scale * v, or scale * v / |v| (times the token's
        residual norm, applied on the device) with norm_match."""
        vector = self.vectors[site].float() * self.scale
        if self.norm_match:
            return vector / self.vectors[site].float().norm().clamp_min(1e-12)
        return vector


@dataclass(frozen=True)
class CaptureSpec:
    capture_id: str
    sites: tuple[str, ...]
    positions: str | frozenset[int]

    @classmethod
    def from_wire(cls, obj: Any, order: SiteOrder) -> CaptureSpec:
        _fields(obj, "capture", {"id", "sites", "positions"})
        if not isinstance(obj["id"], str) or not obj["id"]:
            raise WireError(f"capture.id: expected a non-empty string, got {short(obj['id'])}")
        patterns, positions = obj["sites"], obj["positions"]
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise WireError(f"capture.sites: expected a list of site names, got {short(patterns)}")
        try:
            sites = tuple(s for pattern in patterns for s in order.expand(pattern))
        except UnknownSiteError as exc:
            raise WireError(f"capture.sites: {exc}") from None
        if positions not in POSITION_SELECTORS:
            positions = frozenset(_positions(positions, "capture.positions"))
        return cls(obj["id"], sites, positions)

    def count(self, first: int, end: int, prompt_len: int) -> int:
        """How many positions in first..end-1 are captured (decides how a step runs)."""
        if isinstance(self.positions, frozenset):
            return sum(first <= p < end for p in self.positions)
        if self.positions == "last_prompt":
            return int(first <= prompt_len - 1 < end)
        if self.positions == "all_prompt":
            return max(0, min(end, prompt_len) - first)
        if self.positions == "all_generated":
            return max(0, end - max(first, prompt_len))
        return end - first

    def ended(self, end: int, prompt_len: int) -> bool:
        """Whether no position from `end` on is captured: a request computed up to there
        needs no capturing step any more."""
        if isinstance(self.positions, frozenset):
            return all(p < end for p in self.positions)
        if self.positions in ("last_prompt", "all_prompt"):
            return end >= prompt_len
        return False

    def wants(self, position: int, prompt_len: int) -> bool:
        if isinstance(self.positions, frozenset):
            return position in self.positions
        if self.positions == "last_prompt":
            return position == prompt_len - 1
        if self.positions == "all_prompt":
            return position < prompt_len
        if self.positions == "all_generated":
            return position >= prompt_len
        return True


@dataclass
class RequestFast:
    """What one request asks of the fast path (decoded once, cached on the request)."""

    steering: list[SteerSpec]
    steering_names: list[str]
    capture: CaptureSpec | None


def decode_request(extra: Any, order: SiteOrder, hidden_size: int) -> RequestFast:
    """A request's fast-path data, decoded once (cached in the request's extra args)."""
    cached = extra.get("_decoded") if isinstance(extra, dict) else None
    if cached is None:
        _fields(extra, "vinterp_fast", {"steering", "steering_names"}, {"capture"})
        steering, names = extra["steering"], extra["steering_names"]
        if not isinstance(steering, list):
            raise WireError(f"vinterp_fast.steering: expected a list, got {short(steering)}")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WireError(f"vinterp_fast.steering_names: expected names, got {short(names)}")
        capture = extra.get("capture")
        cached = RequestFast(
            [SteerSpec.from_wire(s, order, hidden_size) for s in steering],
            list(names),
            None if capture is None else CaptureSpec.from_wire(capture, order),
        )
        extra["_decoded"] = cached
    return cached


def _check_steerable(site: Any, order: SiteOrder) -> None:
    if not isinstance(site, str) or not is_steerable(site):
        raise WireError(f"steering.vectors: {short(site)} is not a steerable site")
    if site not in order.position:
        raise WireError(f"steering.vectors: {site!r} is out of this model's layer range")
