"""Client side of steering and capture: resolve and check specs against the model before
anything is queued, encode them for the workers, turn captured rows into results."""

from __future__ import annotations

import json
import logging
import uuid
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from vinterp.api.errors import InterventionError
from vinterp.api.specs import Capture, Request, Steering
from vinterp.fastpath.specs import CaptureSpec
from vinterp.sites.names import SiteOrder, UnknownSiteError, parse_site

if TYPE_CHECKING:
    from vinterp.api.llm import LLM
    from vinterp.engine.outputs import Output

log = logging.getLogger("vinterp.capture")


@dataclass
class Prepared:
    """One request ready for a backend: token ids, sampling, checked steering and capture."""

    prompt: list[int]
    sampling: dict[str, Any]
    steering: list[Steering] = field(default_factory=list)
    steering_names: list[str] = field(default_factory=list)
    capture: Capture | None = None
    capture_sites: list[str] = field(default_factory=list)
    capture_id: str = ""

    def extra_args(self) -> dict[str, Any] | None:
        """The request's fast-path data for vLLM workers (None when it has none)."""
        if not (self.steering or self.steering_names or self.capture):
            return None
        extra: dict[str, Any] = {
            "steering": [s.to_wire() for s in self.steering],
            "steering_names": self.steering_names,
        }
        if self.capture is not None:
            positions = self.capture.positions
            extra["capture"] = {
                "id": self.capture_id,
                "sites": self.capture_sites,
                "positions": positions,
            }
        return extra


def check_steering(steering: Steering, config: Any, field_name: str = "steering") -> None:
    """Layer range and vector size against the model's HF config; ValueError naming the field."""
    layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    for site, vector in steering.vectors.items():
        layer = parse_site(site).layer  # a Steering holds only layer sites
        assert layer is not None
        if layer >= layers:
            raise ValueError(
                f"{field_name}.vectors[{site!r}]: layer {layer} is out of range; "
                f"this model has layers 0..{layers - 1}"
            )
        if vector.numel() != hidden:
            raise ValueError(
                f"{field_name}.vectors[{site!r}]: the vector has {vector.numel()} "
                f"values; this model's hidden size is {hidden}"
            )


def _steering_list(value: Any) -> list[Steering | str]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def prepare(
    llm: LLM,
    prompts: Any,
    steering: Any,
    capture: Capture | None,
    sampling: dict[str, Any],
    names: set[str] | None = None,
) -> list[Prepared]:
    """Normalize prompts (strings, token ids, Request items) and check every spec. `names`:
    the registered steering names, when the caller has them (else asked when needed)."""
    from vinterp.engine.sampling import sampling_kwargs

    items = prompts if isinstance(prompts, list) and not _is_token_ids(prompts) else [prompts]
    order = SiteOrder(len(llm.layers))
    prepared = []
    for item in items:
        if not isinstance(item, (Request, str, list)):
            raise TypeError(
                f"a prompt is a string, a list of token ids or a vinterp.Request, "
                f"got {type(item).__name__}"
            )
        request = item if isinstance(item, Request) else Request(item)
        (ids,) = llm._tokenize(request.prompt)
        req = Prepared(ids, sampling_kwargs({**sampling, **request.sampling}))
        for spec in _steering_list(steering) + _steering_list(request.steering):
            if isinstance(spec, str):
                names = llm.steering.names() if names is None else names
                if spec not in names:
                    raise ValueError(
                        f"steering: no steering named {spec!r} is registered "
                        f"(registered: {sorted(names)})"
                    )
                req.steering_names.append(spec)
            elif isinstance(spec, Steering):
                check_steering(spec, llm.config)
                req.steering.append(spec)
            else:
                raise TypeError(
                    f"steering: expected vinterp.Steering or a registered name, "
                    f"got {type(spec).__name__}"
                )
        cap = request.capture if request.capture is not None else capture
        if cap is not None:
            try:
                req.capture_sites = [s for pattern in cap.sites for s in order.expand(pattern)]
            except UnknownSiteError as exc:
                raise ValueError(f"capture.sites: {exc}") from None
            req.capture, req.capture_id = cap, uuid.uuid4().hex
        prepared.append(req)
    return prepared


def _is_token_ids(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(t, int) for t in value)


_NOTHING_CAPTURED: dict[str, Any] = {"positions": [], "values": torch.empty(0, 0)}


def captured_tensors(
    rows: dict[str, Any], prompt_len: int, generated: int, capture: Capture, sites: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Per site of `sites`, (P, H) rows in position order, limited to tokens the model
    actually read (a scheduler step past the end would otherwise add one). A site with fewer
    rows than `capture` selects is an InterventionError: a capture that was not applied is an
    error, never an empty or short result (DESIGN.md lesson 11)."""
    read_upto = prompt_len + max(generated - 1, 0)
    selector = capture.positions
    selector = selector if isinstance(selector, str) else frozenset(selector)
    wanted = CaptureSpec("", (), selector).count(0, read_upto, prompt_len)
    tensors, positions = {}, {}
    for site in sites:
        data = rows.get(site, _NOTHING_CAPTURED)
        kept = bisect_left(data["positions"], read_upto)  # positions come in order
        if kept != wanted:
            raise InterventionError(
                f"capture of {site} (positions={capture.positions!r}): {kept} of the {wanted} "
                f"selected positions came back from the engine, for a prompt of {prompt_len} "
                f"tokens and {generated} generated; the intervention was not applied"
            )
        tensors[site] = data["values"][:kept]
        positions[site] = data["positions"][:kept]
    return tensors, positions


def capture_ids(requests: list[Prepared]) -> list[str]:
    """The capture ids of the requests that capture (their rows are taken by these)."""
    return [r.capture_id for r in requests if r.capture is not None]


def deliver_all(
    requests: list[Prepared], outputs: list[Output], rows: dict[str, Any], model: str
) -> None:
    """Every capturing request's rows (taken from the workers by capture id) to its sink."""
    for k, req in enumerate(requests):
        if req.capture is not None:
            deliver(req, outputs[k], rows.get(req.capture_id, {}), k, model)


def deliver(req: Prepared, out: Output, rows: dict[str, Any], index: int, model: str) -> None:
    """Hand a request's captured rows to its sink."""
    assert req.capture is not None
    tensors, positions = captured_tensors(
        rows, len(req.prompt), len(out.token_ids), req.capture, req.capture_sites
    )
    if req.capture.sink == "memory":
        out.captures = tensors
    elif req.capture.sink == "filesystem":
        path = Path(req.capture.path or ".")
        path.mkdir(parents=True, exist_ok=True)
        file = path / f"request-{index:05d}-{req.capture_id[:8]}.safetensors"
        metadata = {
            "model": model,
            "sites": json.dumps(req.capture_sites),
            "positions": json.dumps(positions),
            "prompt_token_ids": json.dumps(req.prompt),
            "token_ids": json.dumps(out.token_ids),
        }
        save_file({s: t.contiguous() for s, t in tensors.items()}, str(file), metadata=metadata)
        out.capture_file = str(file)
    else:
        shapes = {s: tuple(t.shape) for s, t in tensors.items()}
        log.info("capture %s request %d: %s", req.capture_id[:8], index, shapes)
