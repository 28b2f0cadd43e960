"""Steering and capture specs (API.md section 5): validated data, no code.

Checks that need the model (layer range, hidden size) run in `LLM` before a request is
queued; the checks here are the ones that hold for any model.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

STEERABLE = re.compile(r"^layers\.(\d+)\.(input|output|attn\.output|mlp\.output)$")
CAPTURABLE = re.compile(
    r"^(embed\.output|final_norm\.output|"
    r"layers\.(\d+|\*)\.(input|output|attn\.input|attn\.output|mlp\.input|mlp\.output))$"
)
PositionSelector = Literal["last_prompt", "all_prompt", "all_generated", "all"]


class Steering(BaseModel):
    """Add `scale * vector` at sites of the residual stream, per request or globally."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    vectors: dict[str, torch.Tensor]
    scale: float = 1.0
    phase: Literal["all", "prefill", "decode"] = "all"
    positions: list[int] | None = None
    norm_match: bool = False

    def __init__(self, vectors: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(vectors=vectors, **kwargs)

    @field_validator("vectors", mode="before")
    @classmethod
    def _vectors(cls, value: Any) -> dict[str, torch.Tensor]:
        if not isinstance(value, dict) or not value:
            raise ValueError("vectors: give a dict {site: vector}, e.g. {'layers.10.output': v}")
        out = {}
        for site, vector in value.items():
            if not isinstance(site, str) or not STEERABLE.match(site):
                raise ValueError(
                    f"vectors: {site!r} cannot be steered; use layers.{{i}}.input|output, "
                    "layers.{i}.attn.output or layers.{i}.mlp.output"
                )
            tensor = torch.as_tensor(vector).detach().to("cpu", torch.float32)
            if tensor.dim() != 1:
                raise ValueError(
                    f"vectors[{site!r}]: expected a 1-D vector, got {tuple(tensor.shape)}"
                )
            if not torch.isfinite(tensor).all():
                raise ValueError(f"vectors[{site!r}]: contains inf or nan")
            out[site] = tensor
        return out

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(p < 0 for p in value):
            raise ValueError("positions: prompt positions are >= 0")
        return value

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (API.md section 6): the `steering` of the `vinterp` extra body field."""
        from vinterp.wire.json_form import tensor_to_json

        return {
            **self.to_wire(),
            "vectors": {s: tensor_to_json(v) for s, v in self.vectors.items()},
        }

    @classmethod
    def from_json(cls, obj: Any) -> Steering:
        """The inverse of `to_json`; WireError or ValueError (pydantic) on bad input."""
        from vinterp.ir.wire import WireError
        from vinterp.wire.json_form import tensor_from_json

        if not isinstance(obj, dict) or not isinstance(obj.get("vectors"), dict):
            raise WireError("steering: expected {vectors: {site: tensor}, scale, ...}")
        vectors = {s: tensor_from_json(v, f"vectors[{s!r}]") for s, v in obj["vectors"].items()}
        return cls(vectors, **{k: v for k, v in obj.items() if k != "vectors"})

    def to_wire(self) -> dict[str, Any]:
        from vinterp.ir.wire import tensor_to_wire

        return {
            "vectors": {s: tensor_to_wire(v) for s, v in self.vectors.items()},
            "scale": self.scale,
            "phase": self.phase,
            "positions": self.positions,
            "norm_match": self.norm_match,
        }


class Capture(BaseModel):
    """Record site values at chosen positions; returned per request or written to a sink."""

    model_config = ConfigDict(frozen=True)

    sites: list[str]
    positions: PositionSelector | list[int] = "last_prompt"
    sink: Literal["memory", "filesystem", "logging"] = "memory"
    path: str | None = None

    def __init__(self, sites: list[str] | str, **kwargs: Any) -> None:
        if isinstance(kwargs.get("path"), os.PathLike):  # a pathlib.Path is welcome too
            kwargs["path"] = os.fspath(kwargs["path"])
        super().__init__(sites=[sites] if isinstance(sites, str) else sites, **kwargs)

    @field_validator("sites")
    @classmethod
    def _sites(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("sites: name at least one site, e.g. 'layers.*.output'")
        for site in value:
            if not CAPTURABLE.match(site):
                raise ValueError(
                    f"sites: {site!r} cannot be captured; use embed.output, final_norm.output "
                    "or layers.{i|*}.input|output|attn.input|attn.output|mlp.input|mlp.output"
                )
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: Any) -> Any:
        if isinstance(value, list) and any(p < 0 for p in value):
            raise ValueError("positions: token positions are >= 0")
        return value

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (API.md section 6): the `capture` of the `vinterp` extra body field."""
        return self.model_dump()

    @classmethod
    def from_json(cls, obj: Any) -> Capture:
        from vinterp.ir.wire import WireError

        if not isinstance(obj, dict) or "sites" not in obj:
            raise WireError("capture: expected {sites, positions, sink, path}")
        return cls(**obj)

    @model_validator(mode="after")
    def _sink_path(self) -> Capture:
        if self.sink == "filesystem" and not self.path:
            raise ValueError("path: the filesystem sink needs path=<directory>")
        return self


class Request(BaseModel):
    """One prompt with its own steering, capture and sampling settings."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="allow")

    prompt: str | list[int]
    steering: Steering | str | list[Steering | str] | None = None
    capture: Capture | None = None

    def __init__(self, prompt: str | list[int], **kwargs: Any) -> None:
        super().__init__(prompt=prompt, **kwargs)

    @property
    def sampling(self) -> dict[str, Any]:
        return dict(self.model_extra or {})
