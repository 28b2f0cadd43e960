"""The `vinterp` body field of `/v1/completions` and `/v1/chat/completions` (API.md section 6).

A middleware of vLLM's own server (its `--middleware` entry point, no fork): it validates the
field as data (specs from their JSON form, checked against the served model), hands it to the
workers through `vllm_xargs` (vLLM's field for extensions), and adds the captured rows and
probe scores to the response. A bad field is a 400 that names the problem; nothing from the
client is executed. It also refuses, on every route, a body whose declared size is over
`--max-body-mb` (413).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vinterp.api.requests import (
    Prepared,
    captured_tensors,
    check_probes,
    check_steering,
    probe_scores,
)
from vinterp.engine.settings import EngineSettings
from vinterp.engine.vllm_boundary.engine_config import engine_config
from vinterp.engine.vllm_engine import unapplied_error
from vinterp.engine.worker_calls import WorkerCalls
from vinterp.errors import InterventionError
from vinterp.interventions.capture_store import merge_captures
from vinterp.serve import client_limits
from vinterp.serve.client_limits import LimitError, check_declared_size, read_body
from vinterp.serve.error_responses import bad_request, error_response
from vinterp.sites.modules import site_order
from vinterp.wire.errors import WireError
from vinterp.wire.json_form import captures_to_json, payload_to_text
from vinterp.wire.probes import Probe, probes_from_data
from vinterp.wire.specs import EXTRA_ARGS_KEY, Capture, Steering, capture_sites

FIELD = "vinterp"
PATHS = ("/v1/completions", "/v1/chat/completions")


class FieldError(WireError):
    """A `vinterp` field that is malformed or does not fit the served model."""


def parse_field(value: Any, config: Any, named: Any = (), stages: int = 1) -> Prepared:
    """The request's steering, capture and probes, checked against the model (HF `config`,
    `stages` pipeline stages) and the server's `named` steerings; raises only WireError
    (FieldError is one)."""
    if not isinstance(value, dict) or not set(value) <= {"steering", "capture", "probes"}:
        raise FieldError("vinterp: expected {steering: ..., capture: ..., probes: ...}")
    prepared = Prepared(prompt=[], sampling={})
    steering = value.get("steering")
    for item in steering if isinstance(steering, list) else [steering] if steering else []:
        if isinstance(item, str):
            if item not in named:
                raise FieldError(
                    f"vinterp.steering: no steering named {item!r:.80} is registered "
                    f"(registered: {sorted(named)}); PUT /v1/vinterp/steering registers one"
                )
            prepared.steering_names.append(item)
            continue
        spec = Steering.from_json(item)
        try:
            check_steering(spec, config, {}, "vinterp.steering")  # a server holds no SAE
        except ValueError as exc:
            raise FieldError(str(exc)) from None
        prepared.steering.append(spec)
    if value.get("capture") is not None:
        capture = Capture.from_json(value["capture"])
        if capture.sink != "memory":
            raise FieldError("vinterp.capture.sink: the server returns captures; use 'memory'")
        order = site_order(config)
        try:
            prepared.capture_sites = capture_sites(capture, order)
        except ValueError as exc:
            raise FieldError(f"vinterp.{exc}") from None
        prepared.capture, prepared.capture_id = capture, uuid.uuid4().hex
    if value.get("probes") is not None:
        prepared.probes = probes_from_data(value["probes"], Probe.from_json)
        try:
            order = site_order(config)
            check_probes(prepared.probes, prepared.steering, config, order, stages)
        except ValueError as exc:
            raise FieldError(f"vinterp.{exc}") from None
        prepared.capture_id = prepared.capture_id or uuid.uuid4().hex
    return prepared


# What vinterp puts into a request's extra_args: a client's own vllm_xargs may not carry it
# (it would reach the workers unchecked, or join another client's trace).
RESERVED_XARGS = {EXTRA_ARGS_KEY}


async def vinterp_fields(request: Request, call_next: Any) -> Response:
    """vLLM `--middleware`: any route's body declared over the size limit refused (413),
    steering and capture from the body field, captures back."""
    limit = client_limits.current()
    try:
        check_declared_size(request, limit)
    except LimitError as exc:
        return exc.response()
    if request.method != "POST" or request.url.path not in PATHS:
        return await call_next(request)
    try:
        body = json.loads(await read_body(request, limit))
    except LimitError as exc:
        return exc.response()
    except ValueError:
        return await call_next(request)  # vLLM answers a malformed body itself
    if not isinstance(body, dict):
        return await call_next(request)
    xargs = body.get("vllm_xargs")
    reserved = sorted(set(xargs) & RESERVED_XARGS) if isinstance(xargs, dict) else []
    if reserved:  # the workers trust these: only vinterp writes them, after its checks
        return bad_request(
            f"vllm_xargs.{reserved[0]} is reserved for vinterp; send steering and capture "
            f"in the {FIELD!r} body field",
            param=FIELD,
        )
    if FIELD not in body:
        return await call_next(request)
    engine = request.app.state.engine_client
    try:
        served = getattr(request.app.state, "vinterp_steering", None)
        named = served.named if served is not None else {}
        facts = engine_config(engine)
        prepared = parse_field(
            body.pop(FIELD), facts.hf_config, named, facts.pipeline_parallel_size
        )
        several = _many_prompts(body) or body.get("n") not in (None, 1)
        if prepared.capture_id and (body.get("stream") or several):
            what = "capture" if prepared.capture is not None else "probes"
            raise FieldError(
                f"vinterp.{what}: one prompt and one choice (n=1) per request, without streaming"
            )
    except (FieldError, WireError, ValueError) as exc:
        message = str(exc)
        text = message if message.startswith(FIELD) else f"{FIELD}: {message}"
        return bad_request(text, param=FIELD)
    specs = prepared.specs()
    if specs is not None:
        body.setdefault("vllm_xargs", {})[EXTRA_ARGS_KEY] = payload_to_text(specs.to_wire())
        body.setdefault("cache_salt", uuid.uuid4().hex)  # computed in full (DESIGN.md lesson 1)
    request._body = json.dumps(body).encode()  # what vLLM's route reads
    taken = False
    try:
        response = await call_next(request)
        # a streamed answer has gone out before the check could change its status
        checked = specs is not None and not body.get("stream") and _checks_applied(engine)
        if response.status_code != 200 or (not prepared.capture_id and not checked):
            return response
        raw = b"".join([chunk async for chunk in response.body_iterator])
        data = json.loads(raw) if raw else None
        # vLLM's route ended early, its client gone: 0.32 answers `null`, 0.33 an empty body
        if not isinstance(data, dict):
            return Response(raw, status_code=response.status_code)
        try:
            if checked:
                await _raise_unapplied(engine)
            if prepared.capture_id:
                rows = await _take_captures(engine, prepared.capture_id)
                taken = True
                data[FIELD] = _results_json(prepared, rows, data)
        except InterventionError as exc:
            return error_response(f"{FIELD}: {exc}", 500, "InterventionError")
        return JSONResponse(data)
    finally:
        # the rows of a request that failed, or whose client left, are dropped, not kept
        if prepared.capture_id and not taken:
            await asyncio.shield(_take_captures(engine, prepared.capture_id))


def _checks_applied(engine: Any) -> bool:
    """Whether the served engine's workers count what their site ops applied
    (`VINTERP_CHECK_APPLIED=1` when the server started)."""
    settings = EngineSettings.of_config(engine_config(engine).additional)
    return settings is not None and settings.check_applied


async def _raise_unapplied(engine: Any) -> None:
    """Raise what the workers' checks found (concurrent requests share the findings)."""
    error = unapplied_error(await WorkerCalls.of(engine).unapplied())
    if error is not None:
        raise error


def _results_json(prepared: Prepared, rows: dict[str, Any], data: dict[str, Any]) -> dict:
    """The request's captured rows and probe scores as JSON, checked complete against the
    answer's usage."""
    usage = data.get("usage") or {}
    prompt_len = int(usage.get("prompt_tokens", 0))
    generated = int(usage.get("completion_tokens", 0))
    out = {}
    if prepared.capture is not None:
        tensors, _ = captured_tensors(
            rows, prompt_len, generated, prepared.capture, prepared.capture_sites
        )
        out["captures"] = captures_to_json(tensors)
    if prepared.probes:
        out["probes"] = captures_to_json(probe_scores(rows, prompt_len, generated, prepared.probes))
    return out


def _many_prompts(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


async def _take_captures(engine: Any, capture_id: str) -> dict[str, Any]:
    per_worker = await WorkerCalls.of(engine).take_captures([capture_id])
    return merge_captures(per_worker).get(capture_id, {})
