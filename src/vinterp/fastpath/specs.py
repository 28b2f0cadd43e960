"""Worker-side steering and capture specs decoded from a request's wire form."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vinterp.sites.names import SiteOrder
from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire

FAST_KEY = "vinterp_fast"
_SERIALS = itertools.count(1)
# Identical specs decode to one SteerSpec: the same steering sent with 256 requests is one
# combination and one table row, not 256 (bounded: cleared when full).
_BY_CONTENT: dict[tuple[Any, ...], SteerSpec] = {}
_BY_CONTENT_MAX = 4096


@dataclass(frozen=True)
class SteerSpec:
    vectors: dict[str, torch.Tensor]
    scale: float
    phase: str
    positions: frozenset[int] | None
    norm_match: bool
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False)

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> SteerSpec:
        spec = cls(
            vectors={s: tensor_from_wire(v) for s, v in obj["vectors"].items()},
            scale=float(obj["scale"]),
            phase=str(obj["phase"]),
            positions=None if obj["positions"] is None else frozenset(obj["positions"]),
            norm_match=bool(obj["norm_match"]),
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
    def from_wire(cls, obj: dict[str, Any], order: SiteOrder) -> CaptureSpec:
        sites = tuple(s for pattern in obj["sites"] for s in order.expand(pattern))
        positions = obj["positions"]
        return cls(
            obj["id"], sites, frozenset(positions) if isinstance(positions, list) else positions
        )

    def wants_any(self, first: int, end: int, prompt_len: int) -> bool:
        """Whether any position in first..end-1 is captured (decides how a step runs)."""
        if isinstance(self.positions, frozenset):
            return any(first <= p < end for p in self.positions)
        if self.positions == "last_prompt":
            return first <= prompt_len - 1 < end
        if self.positions == "all_prompt":
            return first < prompt_len
        if self.positions == "all_generated":
            return end > prompt_len
        return True

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


def decode_request(extra: dict[str, Any], order: SiteOrder) -> RequestFast:
    cached = extra.get("_decoded")
    if cached is None:
        capture = extra.get("capture")
        cached = RequestFast(
            [SteerSpec.from_wire(s) for s in extra.get("steering", [])],
            list(extra.get("steering_names", [])),
            None if capture is None else CaptureSpec.from_wire(capture, order),
        )
        extra["_decoded"] = cached
    return cached
