"""Worker-side steering and capture specs decoded from a request's wire form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vinterp.ir.wire import tensor_from_wire
from vinterp.sites.names import SiteOrder

FAST_KEY = "vinterp_fast"


@dataclass(frozen=True)
class SteerSpec:
    vectors: dict[str, torch.Tensor]
    scale: float
    phase: str
    positions: frozenset[int] | None
    norm_match: bool

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> SteerSpec:
        return cls(
            vectors={s: tensor_from_wire(v) for s, v in obj["vectors"].items()},
            scale=float(obj["scale"]),
            phase=str(obj["phase"]),
            positions=None if obj["positions"] is None else frozenset(obj["positions"]),
            norm_match=bool(obj["norm_match"]),
        )

    def applies(self, position: int, prompt_len: int) -> bool:
        in_prompt = position < prompt_len
        if self.phase == "prefill" and not in_prompt:
            return False
        if self.phase == "decode" and in_prompt:
            return False
        return self.positions is None or (in_prompt and position in self.positions)


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
