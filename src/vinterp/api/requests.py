"""Front-end side of generation with steering and capture: resolve and check specs against
the model before anything is queued, hand them to the backend, turn captured rows into
results (one `generate` for every synchronous front end, one `agenerate` for the async)."""

from __future__ import annotations

import json
import logging
import uuid
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save

from vinterp.api.front_end import TraceFrontEnd
from vinterp.api.sae_sites import check_sae_capture
from vinterp.engine.outputs import Output
from vinterp.engine.sampling import sampling_kwargs
from vinterp.engine.vllm_boundary.parallel import stage_starts
from vinterp.errors import CaptureWriteError, InterventionError
from vinterp.sae import SAE
from vinterp.sae.steering import feature_steering_misfit
from vinterp.sites.modules import site_order
from vinterp.sites.names import SiteOrder, is_pattern
from vinterp.store.files import write_atomic
from vinterp.wire.probes import (
    Probe,
    gating_misfit,
    probe_misfit,
    probe_store_name,
    shared_gate_misfit,
)
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import (
    Capture,
    Steering,
    capture_sites,
    selected_count,
    steering_misfit,
    stored_sites,
)

log = logging.getLogger("vinterp.capture")


class Request(BaseModel):
    """One prompt with its own steering, capture, probes and sampling settings."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="allow")

    prompt: str | list[int]
    steering: Steering | str | list[Steering | str] | None = None
    capture: Capture | None = None
    probes: list[Probe] | None = None

    def __init__(self, prompt: str | list[int], **kwargs: Any) -> None:
        super().__init__(prompt=prompt, **kwargs)

    @property
    def sampling(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


@dataclass
class Prepared:
    """One request ready for a backend: token ids, sampling, checked steering and capture."""

    prompt: list[int]
    sampling: dict[str, Any]
    steering: list[Steering] = field(default_factory=list)
    steering_names: list[str] = field(default_factory=list)
    capture: Capture | None = None
    capture_sites: list[str] = field(default_factory=list)
    capture_id: str = ""  # its captured rows and probe scores are taken by this id
    probes: list[Probe] = field(default_factory=list)

    def specs(self) -> RequestSpecs | None:
        """What the backend sends to the workers (None: nothing beyond global steering)."""
        if not (self.steering or self.steering_names or self.capture or self.probes):
            return None
        return RequestSpecs(
            list(self.steering),
            list(self.steering_names),
            self.capture,
            self.capture_id,
            probes=list(self.probes),
        )


def check_steering(
    steering: Steering,
    config: Any,
    saes: dict[str, SAE],
    field_name: str = "steering",
    shared: bool = False,
) -> None:
    """Layer range and vector size against the model's HF config, features against the SAEs
    attached, and (`shared`: a global or named steering) no gate; ValueError naming the
    field."""
    misfit = steering_misfit(
        steering, int(config.num_hidden_layers), int(config.hidden_size), field_name
    ) or feature_steering_misfit(steering, saes, field_name)
    if shared:
        misfit = misfit or shared_gate_misfit(steering)
    if misfit is not None:
        raise ValueError(misfit)


def check_probes(
    probes: list[Probe], steering: list[Steering], config: Any, order: SiteOrder, stages: int = 1
) -> None:
    """A request's probes against the model (of `stages` pipeline stages), and the gates of
    its steerings; ValueError naming the field."""
    for probe in probes:
        if not isinstance(probe, Probe):
            raise TypeError(f"probes: expected vinterp.Probe items, got {type(probe).__name__}")
        misfit = probe_misfit(probe, int(config.num_hidden_layers), int(config.hidden_size))
        if misfit is not None:
            raise ValueError(misfit)
    misfit = gating_misfit(probes, steering, order, stage_starts(order.num_layers, stages))
    if misfit is not None:
        raise ValueError(misfit)


def _steering_list(value: Any) -> list[Steering | str]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def prepare(
    llm: TraceFrontEnd,
    prompts: Any,
    steering: Any,
    capture: Capture | None,
    sampling: dict[str, Any],
    names: set[str] | None = None,
    probes: list[Probe] | None = None,
) -> list[Prepared]:
    """Normalize prompts (strings, token ids, Request items) and check every spec. `names`:
    the registered steering names, when the caller has them (else asked when needed)."""
    items = prompts if isinstance(prompts, list) and not _is_token_ids(prompts) else [prompts]
    order = site_order(llm.config)
    for item in items:
        if not isinstance(item, (Request, str, list)):
            raise TypeError(
                f"a prompt is a string, a list of token ids or a vinterp.Request, "
                f"got {type(item).__name__}"
            )
    requests = [item if isinstance(item, Request) else Request(item) for item in items]
    token_lists = llm.tokenize([request.prompt for request in requests])  # one batch of texts
    prepared = []
    for k, (request, ids) in enumerate(zip(requests, token_lists)):
        if not ids:
            raise ValueError(f"prompt {k} has no tokens: give a text or at least one token id")
        req = Prepared(ids, sampling_kwargs({**sampling, **request.sampling}))
        for spec in _steering_list(steering) + _steering_list(request.steering):
            if isinstance(spec, str):
                names = llm.backend.steering_names() if names is None else names
                if spec not in names:
                    raise ValueError(
                        f"steering: no steering named {spec!r} is registered "
                        f"(registered: {sorted(names)})"
                    )
                req.steering_names.append(spec)
            elif isinstance(spec, Steering):
                check_steering(spec, llm.config, llm.saes)
                req.steering.append(spec)
            else:
                raise TypeError(
                    f"steering: expected vinterp.Steering or a registered name, "
                    f"got {type(spec).__name__}"
                )
        cap = request.capture if request.capture is not None else capture
        if cap is not None:
            req.capture_sites = capture_sites(cap, order)  # ValueError naming the field
            check_sae_capture(llm.saes, cap, req.capture_sites)
            req.capture, req.capture_id = cap, uuid.uuid4().hex
        req.probes = list(request.probes if request.probes is not None else probes or [])
        check_probes(req.probes, req.steering, llm.config, order, llm.pipeline_parallel_size)
        if req.probes and not req.capture_id:
            req.capture_id = uuid.uuid4().hex
        prepared.append(req)
    return prepared


def _is_token_ids(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(t, int) for t in value)


_NOTHING_CAPTURED: dict[str, Any] = {"positions": [], "values": torch.empty(0, 0)}


def captured_tensors(
    rows: dict[str, Any], prompt_len: int, generated: int, capture: Capture, sites: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Per site of `sites`, (P, H) rows in position order, limited to tokens the model
    actually read (a scheduler step past the end would otherwise add one); an SAE's top-k
    features as `<site>.indices` and `<site>.values`, (P, topk) each. A site with fewer
    rows than `capture` selects is an InterventionError: a capture that was not applied is an
    error, never an empty or short result (DESIGN.md lesson 11)."""
    read_upto = prompt_len + max(generated - 1, 0)
    wanted = selected_count(capture.positions, 0, read_upto, prompt_len)
    tensors, positions = {}, {}
    for site in (name for s in sites for name in stored_sites(s, capture.topk)):
        data = rows.get(site, _NOTHING_CAPTURED)
        kept = bisect_left(data["positions"], read_upto)  # positions come in order
        if kept != wanted:
            raise InterventionError(
                f"capture of {site} (positions={capture.positions!r}): {kept} of the {wanted} "
                f"selected positions came back from the engine, for a prompt of {prompt_len} "
                f"tokens and {generated} generated; the intervention was not applied"
            )
        values = data["values"][:kept]
        if site.endswith((".indices", ".values")):  # a step's top-k may be another request's k
            values = values[:, : capture.topk]
        # an attention pattern's row is over the prompt (the workers pad rows to the widest)
        tensors[site] = values[..., :prompt_len] if is_pattern(site) else values
        positions[site] = data["positions"][:kept]
    return tensors, positions


def capture_ids(requests: list[Prepared]) -> list[str]:
    """The capture ids of the requests that capture or probe (their rows are taken by these)."""
    return [r.capture_id for r in requests if r.capture_id]


def probe_scores(
    rows: dict[str, Any], prompt_len: int, generated: int, probes: list[Probe]
) -> dict[str, torch.Tensor]:
    """Per probe, (tokens read, outputs) scores in position order; missing ones are an
    InterventionError (DESIGN.md lesson 11)."""
    read_upto = prompt_len + max(generated - 1, 0)
    scores = {}
    for probe in probes:
        data = rows.get(probe_store_name(probe.name), _NOTHING_CAPTURED)
        kept = bisect_left(data["positions"], read_upto)
        if list(data["positions"][:kept]) != list(range(read_upto)):
            raise InterventionError(
                f"probe {probe.name!r}: scores for {kept} of the {read_upto} tokens read came "
                f"back from the engine (a prompt of {prompt_len} tokens, {generated} generated); "
                "the probe was not applied"
            )
        scores[probe.name] = data["values"][:kept]
    return scores


def deliver_all(
    requests: list[Prepared], outputs: list[Output], rows: dict[str, Any], model: str
) -> None:
    """Every probing request's scores to its output, and every capturing request's rows
    (taken from the workers by capture id) to its sink. A request whose file cannot be
    written does not stop the others'; CaptureWriteError then says which failed, and carries
    every output."""
    failed: list[tuple[int, OSError]] = []
    for k, req in enumerate(requests):
        if req.probes:
            found = rows.get(req.capture_id, {})
            outputs[k].probes = probe_scores(
                found, len(req.prompt), len(outputs[k].token_ids), req.probes
            )
        if req.capture is not None:
            try:
                deliver(req, outputs[k], rows.get(req.capture_id, {}), k, model)
            except OSError as exc:
                failed.append((k, exc))
    if failed:
        k, exc = failed[0]
        raise CaptureWriteError(
            f"the captures of {len(failed)} of {len(requests)} requests (the first: request "
            f"{k}) could not be written to {requests[k].capture.path or '.'}: {exc}; free room "
            "there or give Capture(path=...) another folder. Every output, naming the files "
            "that were written, is in this error's .outputs",
            outputs,
        ) from exc


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
        data = save({s: t.contiguous() for s, t in tensors.items()}, metadata=metadata)
        write_atomic(file, lambda f: f.write(data))  # a full disk leaves no torn file
        out.capture_file = str(file)
    else:
        shapes = {s: tuple(t.shape) for s, t in tensors.items()}
        log.info("capture %s request %d: %s", req.capture_id[:8], index, shapes)


def generate(
    model: TraceFrontEnd,
    prompts: Any,
    steering: Any,
    capture: Capture | None,
    sampling: dict[str, Any],
    use_tqdm: bool,
    probes: list[Probe] | None = None,
) -> list[Output]:
    """Check, run on the model's backend, and deliver every capture to its sink."""
    requests = prepare(model, prompts, steering, capture, sampling, probes=probes)
    outputs = model.backend.generate(
        [r.prompt for r in requests],
        [r.sampling for r in requests],
        [r.specs() for r in requests],
        use_tqdm=use_tqdm,
    )
    ids = capture_ids(requests)
    if ids:
        deliver_all(requests, outputs, model.backend.take_captures(ids), model.model_name)
    return outputs


async def agenerate(
    model: TraceFrontEnd,
    prompts: Any,
    steering: Any,
    capture: Capture | None,
    sampling: dict[str, Any],
    use_tqdm: bool,
    probes: list[Probe] | None = None,
) -> list[Output]:
    """As `generate`, on an async backend."""
    names = await model.backend.steering_names()
    requests = prepare(model, prompts, steering, capture, sampling, names, probes)
    outputs = await model.backend.generate(
        [r.prompt for r in requests],
        [r.sampling for r in requests],
        [r.specs() for r in requests],
        use_tqdm=use_tqdm,
    )
    ids = capture_ids(requests)
    if ids:
        rows = await model.backend.take_captures(ids)
        deliver_all(requests, outputs, rows, model.model_name)
    return outputs
