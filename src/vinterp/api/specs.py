"""Steering and capture specs (API.md section 5): validated data, no code.

Checks that need the model (layer range, hidden size) run in `LLM` before a request is
queued; the checks here are the ones that hold for any model.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from vinterp.sites.names import UnknownSiteError, is_steerable, parse_site
from vinterp.wire.errors import WireError

CAPTURABLE_OUTSIDE_LAYERS = ("embed.output", "final_norm.output")
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
            if not isinstance(site, str) or not is_steerable(site):
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
        """The inverse of `to_json`, for data from anyone: raises only WireError."""
        from vinterp.wire.json_form import tensor_from_json

        _check_fields(obj, "steering", cls.model_fields)
        if not isinstance(obj["vectors"], dict):
            raise WireError("steering.vectors: expected {site: tensor}")
        vectors = {
            s: tensor_from_json(v, f"steering.vectors[{s!r}]") for s, v in obj["vectors"].items()
        }
        return _validated(cls, "steering", {**obj, "vectors": vectors})

    def to_wire(self) -> dict[str, Any]:
        from vinterp.wire.tensors import tensor_to_wire

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
            if not _is_capturable(site):
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
        """The inverse of `to_json`, for data from anyone: raises only WireError."""
        _check_fields(obj, "capture", cls.model_fields)
        return _validated(cls, "capture", obj)

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


def _is_capturable(site: str) -> bool:
    try:
        parsed = parse_site(site, pattern=True)
    except UnknownSiteError:
        return False
    return parsed.kind == "layer" or site in CAPTURABLE_OUTSIDE_LAYERS


def _check_fields(obj: Any, what: str, fields: dict[str, Any]) -> None:
    """A JSON spec is an object with its first field and no unknown ones."""
    first = next(iter(fields))
    if not isinstance(obj, dict) or first not in obj:
        raise WireError(f"{what}: expected {{{', '.join(fields)}}} with {first}")
    unknown = [k for k in obj if k not in fields]
    if unknown:
        raise WireError(
            f"{what}: unknown fields {[str(k) for k in unknown][:5]}; the fields are "
            f"{', '.join(fields)}"
        )


def _validated(cls: type[BaseModel], what: str, fields: dict[str, Any]) -> Any:
    """`cls(**fields)` with pydantic's validation errors as one WireError naming each field."""
    try:
        return cls(**fields)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            message = str(error["msg"]).removeprefix("Value error, ")
            field = str(error["loc"][0]) if error["loc"] else ""
            problems.append(
                f"{what}.{message}"
                if not field or message.startswith(field)
                else f"{what}.{field}: {message}"
            )
        raise WireError("; ".join(problems)) from None
