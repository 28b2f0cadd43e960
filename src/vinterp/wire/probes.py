"""Linear probes read inside the engine (`vinterp.Probe`, API.md section 5, "Probes"), their
one encoding, and the checks of a request's probes and the steerings they gate.

A probe's score at a token is `weight @ x + bias` (one value per output), x the site's value
as it arrives there, before that site's steering: a steering gated at the probe's own site
(`Steering(when=...)`) is decided on the value it would change. Scores are returned for every
token the model reads. Checks that need the model are `probe_misfit` and `gating_misfit`, run
by the front ends before a request is queued and again by the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from vinterp.sites.names import SiteOrder, is_steerable, parse_site
from vinterp.wire.errors import WireError, short
from vinterp.wire.json_form import tensor_from_json, tensor_to_json
from vinterp.wire.specs import Steering, TensorDecoder, TensorEncoder
from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire
from vinterp.wire.validation import check_fields, validated


class Probe(BaseModel):
    """A linear probe at a site of the residual stream: `weight` (outputs, hidden) or
    (hidden,) for one output, `bias` (outputs,) or none; `name` (default: the site) is what
    `out.probes` and `when=` call it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    site: str
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    name: str = ""

    def __init__(self, site: str, weight: Any, bias: Any = None, **kwargs: Any) -> None:
        super().__init__(site=site, weight=weight, bias=bias, **kwargs)

    @field_validator("site")
    @classmethod
    def _site(cls, value: str) -> str:
        if not is_steerable(value):
            raise ValueError(
                f"site: {short(value)} cannot be probed; use layers.{{i}}.input|output, "
                "layers.{i}.attn.output or layers.{i}.mlp.output"
            )
        return value

    @field_validator("weight", mode="before")
    @classmethod
    def _weight(cls, value: Any) -> torch.Tensor:
        weight = torch.as_tensor(value).detach().to("cpu", torch.float32)
        if weight.dim() == 1:
            weight = weight[None]
        if weight.dim() != 2 or weight.shape[0] == 0:
            raise ValueError(
                f"weight: expected (outputs, hidden) or (hidden,), got {_shape(value)}"
            )
        if not torch.isfinite(weight).all():
            raise ValueError("weight: contains inf or nan")
        return weight

    @field_validator("bias", mode="before")
    @classmethod
    def _bias(cls, value: Any) -> torch.Tensor | None:
        if value is None:
            return None
        bias = torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(-1)
        if not torch.isfinite(bias).all():
            raise ValueError("bias: contains inf or nan")
        return bias

    @model_validator(mode="after")
    def _fits(self) -> Probe:
        if self.bias is not None and self.bias.numel() != self.outputs:
            raise ValueError(
                f"bias: {self.bias.numel()} values for a weight of {self.outputs} outputs"
            )
        if not self.name:
            object.__setattr__(self, "name", self.site)
        return self

    @property
    def outputs(self) -> int:
        return int(self.weight.shape[0])

    @property
    def offsets(self) -> torch.Tensor:
        """The bias, zeros when none was given."""
        return torch.zeros(self.outputs) if self.bias is None else self.bias

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, outputs) float32 scores of a site's (tokens, hidden) values."""
        return x.float() @ self.weight.to(x.device).T + self.offsets.to(x.device)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (API.md section 6): an item of the `probes` of the `vinterp` field."""
        return _probe_data(self, tensor_to_json)

    @classmethod
    def from_json(cls, obj: Any) -> Probe:
        """The inverse of `to_json`, for data from anyone: raises only WireError."""
        return _probe_from_data(obj, tensor_from_json)

    def to_wire(self) -> dict[str, Any]:
        """The worker form: as `to_json`, with raw bytes."""
        return _probe_data(self, tensor_to_wire)

    @classmethod
    def from_wire(cls, obj: Any) -> Probe:
        return _probe_from_data(obj, tensor_from_wire)


def _shape(value: Any) -> tuple[int, ...] | str:
    return tuple(value.shape) if hasattr(value, "shape") else short(value)


def _probe_data(probe: Probe, tensor: TensorEncoder) -> dict[str, Any]:
    return {
        "site": probe.site,
        "weight": tensor(probe.weight),
        "bias": None if probe.bias is None else tensor(probe.bias),
        "name": probe.name,
    }


def _probe_from_data(obj: Any, tensor: TensorDecoder) -> Probe:
    check_fields(obj, "probe", Probe.model_fields)
    fields = dict(obj)
    if "weight" in fields:
        fields["weight"] = tensor(fields["weight"], "probe.weight")
    if fields.get("bias") is not None:
        fields["bias"] = tensor(fields["bias"], "probe.bias")
    return validated(Probe, "probe", fields)


def probe_store_name(name: str) -> str:
    """What a probe's scores travel under among a request's captured sites (never a site)."""
    return f"probe:{name}"


def probes_from_data(obj: Any, decode: Any) -> list[Probe]:
    """A request's probes from a list of their data (`Probe.from_json` or `.from_wire`)."""
    if not isinstance(obj, list):
        raise WireError(f"probes: expected a list, got {short(obj)}")
    return [decode(p) for p in obj]


def probe_misfit(probe: Probe, num_layers: int, hidden_size: int) -> str | None:
    """What makes `probe` unfit for a model of this depth and width (None: it fits)."""
    layer = parse_site(probe.site).layer
    if layer is None or layer >= num_layers:
        return (
            f"probes[{probe.name!r}].site: layer {layer} is out of range; this model has "
            f"layers 0..{num_layers - 1}"
        )
    width = int(probe.weight.shape[1])
    if width != hidden_size:
        return (
            f"probes[{probe.name!r}].weight: {width} columns; this model's hidden size is "
            f"{hidden_size}: give a weight of shape (outputs, {hidden_size})"
        )
    return None


def shared_gate_misfit(steering: Steering) -> str | None:
    """A global or named steering cannot be gated: a probe belongs to one request."""
    if steering.when is None:
        return None
    return (
        "steering.when: a global or named steering cannot be gated (a probe belongs to one "
        "request); pass the gated Steering with the request"
    )


def gating_misfit(
    probes: Sequence[Probe],
    steering: Sequence[Steering],
    order: SiteOrder,
    stage_starts: Sequence[int] = (0,),
) -> str | None:
    """What is wrong with a request's probes and the gates (`when=`) of its own steerings;
    `stage_starts`: the first layer of each pipeline stage (a probe's scores do not cross
    stages)."""
    named = {}
    for probe in probes:
        if probe.name in named:
            return f"probes: two probes are named {probe.name!r}; give each its own name="
        named[probe.name] = probe
    gates: dict[str, tuple[Any, ...]] = {}
    for k, spec in enumerate(steering):
        when = spec.when
        if when is None:
            continue
        probe = named.get(when.probe)
        if probe is None:
            return (
                f"steering[{k}].when: no probe named {when.probe!r} in this request "
                f"(its probes: {sorted(named)}); add it to probes="
            )
        if when.output >= probe.outputs:
            return (
                f"steering[{k}].when.output: {when.output}, but probe {when.probe!r} has "
                f"{probe.outputs} output(s)"
            )
        for site in spec.vectors:
            if order[probe.site] > order[site]:
                return (
                    f"steering[{k}].when: probe {when.probe!r} reads {probe.site}, after "
                    f"{site} in the forward pass; a gate's probe must be at or before the "
                    "sites it gates"
                )
            if _stage(probe.site, stage_starts) != _stage(site, stage_starts):
                return (
                    f"steering[{k}].when: probe {when.probe!r} at {probe.site} and {site}, "
                    "which it gates, run on different pipeline stages; gate a site of the "
                    "probe's stage"
                )
            gate = (when.probe, when.output, when.above, when.below)
            if gates.setdefault(site, gate) != gate:
                return (
                    f"steering[{k}].when: another steering of this request is gated "
                    f"differently at {site}; at one site a request's gated steerings share "
                    "one when="
                )
    return None


def _stage(site: str, stage_starts: Sequence[int]) -> int:
    """The pipeline stage that runs a layer site."""
    layer = parse_site(site).layer or 0
    return sum(start <= layer for start in stage_starts) - 1
