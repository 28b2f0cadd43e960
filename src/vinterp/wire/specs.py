"""Steering and capture specs (API.md section 5), and their one encoding.

`Steering` and `Capture` are validated data, no code. Each has two forms on the wire: the
JSON form (API.md section 6, tensors as base64 text) that HTTP clients send, and the worker
form (tensors as raw bytes) that rides in a vLLM request's `extra_args` under
`EXTRA_ARGS_KEY`; both come from one encoder and go through one decoder, which raises only
WireError. What a worker needs beyond the spec (serials, content keys, scaled vectors) is
built from it there (`vinterp.interventions.specs`).

Checks that need the model (layer range, hidden size, heads) are `steering_misfit` and
`capture_sites`, run by the front ends before a request is queued and again by the workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from vinterp.sites.names import (
    SiteOrder,
    UnknownSiteError,
    is_pattern,
    is_steerable,
    parse_site,
)
from vinterp.wire.errors import WireError, short
from vinterp.wire.json_form import tensor_from_json, tensor_to_json
from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire
from vinterp.wire.validation import check_fields, validated

Phase = Literal["all", "prefill", "decode"]
SteerMode = Literal["add", "clamp", "ablate"]
PositionSelector = Literal["last_prompt", "all_prompt", "all_generated", "all"]
PHASES: tuple[str, ...] = get_args(Phase)
POSITION_SELECTORS: tuple[str, ...] = get_args(PositionSelector)
CAPTURABLE_OUTSIDE_LAYERS = ("embed.output", "final_norm.output")
# The one key of a request's `SamplingParams.extra_args` that vinterp reads in the workers.
EXTRA_ARGS_KEY = "vinterp"

TensorEncoder = Callable[[torch.Tensor], dict[str, Any]]
TensorDecoder = Callable[[Any, str], torch.Tensor]


class When(BaseModel):
    """Where a steering applies: at the tokens whose score from the request's probe named
    `probe` (its output `output`) is above `above` (or below `below`), decided per token
    inside the engine step (`vinterp.Probe`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    probe: str
    above: float | None = None
    below: float | None = None
    output: int = 0

    @model_validator(mode="after")
    def _threshold(self) -> When:
        if (self.above is None) == (self.below is None):
            raise ValueError("when: give one threshold, above= or below=")
        threshold = self.above if self.above is not None else self.below
        if not math.isfinite(threshold):  # type: ignore[arg-type]
            raise ValueError("when: the threshold must be a finite number")
        if self.output < 0:
            raise ValueError("when.output: a probe output index is >= 0")
        return self

    def passes(self, score: torch.Tensor) -> torch.Tensor:
        """Where a score passes the threshold (the definition both backends follow)."""
        if self.above is not None:
            return score > self.above
        return score < self.below  # type: ignore[operator]


class Steering(BaseModel):
    """Add `scale * vector` at sites of the residual stream, per request or globally; project
    a direction out of them (`mode="ablate"`: x - scale * (x . d) d, d the unit vector); or,
    at the `<host>.sae.features` site of an attached SAE, add to (`mode="add"`) or set
    (`mode="clamp"`) features: `{"layers.10.output.sae.features": {1234: 8.0}}`. With
    `when=`, only at the tokens where a probe of the request passes a threshold."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    vectors: dict[str, torch.Tensor]
    scale: float = 1.0
    phase: Phase = "all"
    positions: list[int] | None = None
    norm_match: bool = False
    features: dict[str, dict[int, float]] = {}  # SAE feature site -> {feature: value}
    mode: SteerMode = "add"
    when: When | None = None

    def __init__(self, vectors: dict[str, Any], **kwargs: Any) -> None:
        if isinstance(vectors, dict) and "features" not in kwargs:
            kwargs["features"] = {s: v for s, v in vectors.items() if _is_feature_site(s)}
            vectors = {s: v for s, v in vectors.items() if not _is_feature_site(s)}
        super().__init__(vectors=vectors, **kwargs)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], scale: float = 1.0, **fields: Any) -> Steering:
        """The control vector in a GGUF file (llama.cpp's and repeng's form): each
        `direction.N` added at `layers.N.output`, times `scale` (the coefficient); `fields`
        are the other Steering fields. ValueError naming the file when it holds none
        (`wire.control_vectors`)."""
        from vinterp.wire.control_vectors import read_control_vector

        return cls(read_control_vector(path), scale=scale, **fields)

    @field_validator("vectors", mode="before")
    @classmethod
    def _vectors(cls, value: Any) -> dict[str, torch.Tensor]:
        if not isinstance(value, dict):
            raise ValueError("vectors: give a dict {site: vector}, e.g. {'layers.10.output': v}")
        out = {}
        for site, vector in value.items():
            if not isinstance(site, str) or not is_steerable(site):
                raise ValueError(
                    f"vectors: {short(site)} cannot be steered; use layers.{{i}}.input|output, "
                    "layers.{i}.attn.output or layers.{i}.mlp.output, or such a site followed "
                    "by .sae.features with {feature: value}"
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

    @field_validator("features", mode="before")
    @classmethod
    def _features(cls, value: Any) -> dict[str, dict[int, float]]:
        if not isinstance(value, dict):
            raise ValueError("features: give {'layers.{i}.output.sae.features': {feature: value}}")
        out: dict[str, dict[int, float]] = {}
        for site, chosen in value.items():
            if not _is_feature_site(site):
                raise ValueError(
                    f"features: {short(site)} is not the feature site of a steerable host; "
                    "use layers.{i}.input|output|attn.output|mlp.output followed by .sae.features"
                )
            if not isinstance(chosen, dict) or not chosen:
                raise ValueError(
                    f"features[{site!r}]: give {{feature index: value}}, e.g. {{7: 8.0}}"
                )
            out[site] = {}
            for index, amount in chosen.items():
                feature = _feature_index(index)
                if feature is None:
                    raise ValueError(
                        f"features[{site!r}]: {short(index)} is not a feature index (an int >= 0)"
                    )
                if isinstance(amount, bool) or not isinstance(amount, (int, float)):
                    raise ValueError(f"features[{site!r}][{feature}]: expected a number")
                if not math.isfinite(amount):
                    raise ValueError(f"features[{site!r}][{feature}]: expected a finite number")
                out[site][feature] = float(amount)
        return out

    @field_validator("scale")
    @classmethod
    def _scale(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("scale: expected a finite number")
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(p < 0 for p in value):
            raise ValueError("positions: prompt positions are >= 0")
        return value

    @model_validator(mode="after")
    def _kinds(self) -> Steering:
        if not self.vectors and not self.features:
            raise ValueError(
                "vectors: give a dict {site: vector}, e.g. {'layers.10.output': v}, or "
                "{'layers.10.output.sae.features': {feature: value}}"
            )
        if self.mode == "clamp" and self.vectors:
            raise ValueError(
                f"mode: 'clamp' sets SAE features; {next(iter(self.vectors))} is a vector "
                "site: steer it in another Steering with mode='add'"
            )
        if self.mode == "ablate":
            if self.features:
                raise ValueError(
                    f"mode: 'ablate' projects directions out of the residual stream; "
                    f"{next(iter(self.features))} is an SAE feature site: steer it in another "
                    "Steering with mode='add' or 'clamp'"
                )
            if self.norm_match:
                raise ValueError(
                    "norm_match: scales added vectors; an ablation removes the direction's "
                    "component whatever the norm: leave norm_match off with mode='ablate'"
                )
            for site, vector in self.vectors.items():
                if not vector.norm() > 0:
                    raise ValueError(
                        f"vectors[{site!r}]: a zero vector has no direction to ablate; give "
                        "the direction to project out (any nonzero length: it is normalized)"
                    )
        if self.norm_match and self.features:
            raise ValueError(
                "norm_match: scales vectors by the residual's norm; it does not apply to SAE "
                "features: steer them in a Steering without norm_match"
            )
        if self.when is not None and self.features:
            raise ValueError(
                "when: gates vectors; SAE feature steering is not gated: steer the features "
                "in a Steering without when="
            )
        return self

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (API.md section 6): the `steering` of the `vinterp` extra body field."""
        return _steering_data(self, tensor_to_json)

    @classmethod
    def from_json(cls, obj: Any) -> Steering:
        """The inverse of `to_json`, for data from anyone: raises only WireError."""
        return _steering_from_data(obj, tensor_from_json)

    def to_wire(self) -> dict[str, Any]:
        """The worker form: as `to_json`, with the vectors' raw bytes."""
        return _steering_data(self, tensor_to_wire)

    @classmethod
    def from_wire(cls, obj: Any) -> Steering:
        """The inverse of `to_wire`: raises only WireError."""
        return _steering_from_data(obj, tensor_from_wire)


class Capture(BaseModel):
    """Record site values at chosen positions; returned per request or written to a sink."""

    model_config = ConfigDict(frozen=True)

    sites: list[str]
    positions: PositionSelector | list[int] = "last_prompt"
    sink: Literal["memory", "filesystem", "logging"] = "memory"
    path: str | None = None
    heads: list[int] | None = None  # the heads of attn.pattern sites to capture (None: all)
    topk: int | None = None  # SAE feature sites: the k largest features, indices and values

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
                    f"sites: {short(site)} cannot be captured; use embed.output, "
                    "final_norm.output or "
                    "layers.{i|*}.input|output|attn.input|attn.output|mlp.input|mlp.output"
                    "|attn.q|attn.k|attn.v|attn.heads|attn.pattern|mlp.router.output"
                    "|mlp.router.experts, or such a site followed by .sae.features|.sae.error"
                )
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: Any) -> Any:
        if isinstance(value, list) and any(p < 0 for p in value):
            raise ValueError("positions: token positions are >= 0")
        return value

    @model_validator(mode="after")
    def _topk(self) -> Capture:
        if self.topk is not None:
            if self.topk < 1:
                raise ValueError("topk: the number of features kept per token, >= 1")
            if not any(is_sae_features(s) for s in self.sites):
                raise ValueError(
                    "topk: keeps the largest features of SAE sites; name one in sites, e.g. "
                    "'layers.10.output.sae.features'"
                )
        return self

    @model_validator(mode="after")
    def _sink_path(self) -> Capture:
        if self.sink == "filesystem" and not self.path:
            raise ValueError("path: the filesystem sink needs path=<directory>")
        return self

    @model_validator(mode="after")
    def _patterns(self) -> Capture:
        patterns = [s for s in self.sites if is_pattern(s)]
        if patterns and self.positions != "last_prompt":
            raise ValueError(
                "positions: an attention pattern (attn.pattern) is captured at "
                "positions='last_prompt' only: the last prompt token's row over the prompt"
            )
        if self.heads is not None:
            if not patterns:
                raise ValueError("heads: picks the heads of attn.pattern sites; name one in sites")
            if not self.heads or min(self.heads) < 0 or len(set(self.heads)) < len(self.heads):
                raise ValueError("heads: distinct head indices >= 0, e.g. [0, 3]")
        return self

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (API.md section 6): the `capture` of the `vinterp` extra body field."""
        return self.model_dump()

    @classmethod
    def from_json(cls, obj: Any) -> Capture:
        """The inverse of `to_json`, for data from anyone: raises only WireError."""
        check_fields(obj, "capture", cls.model_fields)
        return validated(cls, "capture", obj)


def is_sae_features(site: str) -> bool:
    """Whether a site name (or glob) names an SAE's features."""
    return site.endswith(".sae.features")


def stored_sites(site: str, topk: int | None) -> list[str]:
    """The names a captured site's rows come back under: `<site>.indices` and
    `<site>.values` for the top-k features of an SAE, else the site itself."""
    return [f"{site}.indices", f"{site}.values"] if topk and is_sae_features(site) else [site]


# -- positions a capture selects (one definition, used by the workers and the front ends) ---


def selected_count(positions: str | Collection[int], first: int, end: int, prompt_len: int) -> int:
    """How many positions in first..end-1 a selector captures."""
    if not isinstance(positions, str):
        return sum(first <= p < end for p in positions)
    if positions == "last_prompt":
        return int(first <= prompt_len - 1 < end)
    if positions == "all_prompt":
        return max(0, min(end, prompt_len) - first)
    if positions == "all_generated":
        return max(0, end - max(first, prompt_len))
    return end - first


def selection_ended(positions: str | Collection[int], end: int, prompt_len: int) -> bool:
    """Whether a selector captures nothing from `end` on."""
    if not isinstance(positions, str):
        return all(p < end for p in positions)
    if positions in ("last_prompt", "all_prompt"):
        return end >= prompt_len
    return False


def selected(
    positions: str | Collection[int], first: int, count: int, prompt_len: int
) -> Sequence[int]:
    """The positions of [first, first + count) a selector captures, in order: a range for the
    named selectors (a step of thousands of prompt tokens costs no Python per token)."""
    end = first + count
    if not isinstance(positions, str):
        return sorted(p for p in positions if first <= p < end)
    if positions == "last_prompt":
        return range(max(first, prompt_len - 1), min(end, prompt_len))
    if positions == "all_prompt":
        return range(first, min(end, prompt_len))
    if positions == "all_generated":
        return range(max(first, prompt_len), end)
    return range(first, end)


def selects(positions: str | Collection[int], position: int, prompt_len: int) -> bool:
    """Whether a selector captures this position."""
    if not isinstance(positions, str):
        return position in positions
    if positions == "last_prompt":
        return position == prompt_len - 1
    if positions == "all_prompt":
        return position < prompt_len
    if positions == "all_generated":
        return position >= prompt_len
    return True


# -- checks against a model ----------------------------------------------------------------


def steering_misfit(
    steering: Steering, num_layers: int, hidden_size: int, field_name: str = "steering"
) -> str | None:
    """What makes `steering` unfit for a model of this depth and width (None: it fits)."""
    for site in steering.features:
        layer = parse_site(site).layer
        if layer is None or layer >= num_layers:
            return (
                f"{field_name}.features[{site!r}]: layer {layer} is out of range; "
                f"this model has layers 0..{num_layers - 1}"
            )
    for site, vector in steering.vectors.items():
        layer = parse_site(site).layer  # a Steering holds only layer sites
        if layer is None or layer >= num_layers:
            return (
                f"{field_name}.vectors[{site!r}]: layer {layer} is out of range; "
                f"this model has layers 0..{num_layers - 1}"
            )
        if vector.numel() != hidden_size:
            return (
                f"{field_name}.vectors[{site!r}]: the vector has {vector.numel()} "
                f"values; this model's hidden size is {hidden_size}"
            )
    return None


def _steering_data(steering: Steering, tensor: TensorEncoder) -> dict[str, Any]:
    return {
        "vectors": {s: tensor(v) for s, v in steering.vectors.items()},
        "scale": steering.scale,
        "phase": steering.phase,
        "positions": steering.positions,
        "norm_match": steering.norm_match,
        # JSON object keys are strings: feature indices travel as decimal text
        "features": {s: {str(j): v for j, v in f.items()} for s, f in steering.features.items()},
        "mode": steering.mode,
        "when": None if steering.when is None else steering.when.model_dump(),
    }


def _steering_from_data(obj: Any, tensor: TensorDecoder) -> Steering:
    check_fields(obj, "steering", Steering.model_fields)
    if not isinstance(obj["vectors"], dict):
        raise WireError("steering.vectors: expected {site: tensor}")
    vectors = {s: tensor(v, f"steering.vectors[{short(s)}]") for s, v in obj["vectors"].items()}
    return validated(Steering, "steering", {**obj, "vectors": vectors})


def _is_feature_site(site: Any) -> bool:
    """Whether `site` names the features of an SAE at a steerable host."""
    return isinstance(site, str) and is_sae_features(site) and is_steerable(feature_host(site))


def feature_host(site: str) -> str:
    """The host of an SAE feature site (`layers.3.output.sae.features`: `layers.3.output`)."""
    return site.removesuffix(".sae.features")


def _feature_index(index: Any) -> int | None:
    """A feature index given as an int, or as decimal text (JSON object keys); None if neither."""
    if isinstance(index, str) and index.isascii() and index.isdigit():
        return int(index)
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
        return index
    return None


def capture_sites(capture: Capture, order: SiteOrder) -> list[str]:
    """The sites a capture names on this model, expanded; raises ValueError naming the field
    (`capture.sites`: an unknown site, `capture.heads`: a head the model does not have)."""
    try:
        sites = [s for pattern in capture.sites for s in order.expand(pattern)]
    except UnknownSiteError as exc:
        raise ValueError(f"capture.sites: {exc}") from None
    if capture.heads is not None and order.heads is not None:
        heads = order.heads.heads
        if max(capture.heads) >= heads:
            raise ValueError(f"capture.heads: this model has {heads} heads (0..{heads - 1})")
    return sites


def _is_capturable(site: Any) -> bool:
    if not isinstance(site, str):
        return False
    try:
        parsed = parse_site(site, pattern=True)
    except UnknownSiteError:
        return False
    return parsed.kind == "layer" or site in CAPTURABLE_OUTSIDE_LAYERS
