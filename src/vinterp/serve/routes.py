"""vinterp's routes on vLLM's server (API.md section 6): `GET /v1/vinterp/sites`,
`POST /v1/vinterp/trace`, `GET|PUT|DELETE /v1/vinterp/steering`, `GET /v1/vinterp/stats`,
`GET /v1/vinterp/held`.

Added through vLLM's endpoint-plugin entry point (`vllm.endpoint_plugins`, allowlisted by
`vinterp serve`), so they sit behind vLLM's own `--api-key` check like every /v1 route. A
trace arrives as the graph's wire form in JSON: data, validated against the whitelist and
the server's limits (`serve/client_limits.py`) before anything reaches the engine; nothing from the
client is executed or unpickled. Every malformed request gets a 400 that names the problem, a
body over the limit a 413, one too slow to arrive a 408, a trace over its key's running traces
a 429.
"""

from __future__ import annotations

import asyncio
import json
import threading
from argparse import Namespace
from collections.abc import Awaitable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse

from vinterp.api.requests import check_steering
from vinterp.engine.outputs import output_to_json
from vinterp.engine.vllm_boundary.engine_config import engine_config
from vinterp.engine.vllm_boundary.parallel import last_stage_start
from vinterp.engine.worker_calls import WorkerCalls
from vinterp.errors import InterventionError
from vinterp.ir.graph import Graph
from vinterp.ir.plan import PlanError, make_plan
from vinterp.serve import client_limits
from vinterp.serve.client_limits import LimitError, TraceGate, read_body
from vinterp.serve.error_responses import bad_request
from vinterp.sites.modules import site_order
from vinterp.wire.errors import WireError
from vinterp.wire.graph import from_wire
from vinterp.wire.json_form import payload_from_json, saved_to_json
from vinterp.wire.specs import Steering

PLUGIN_NAME = "vinterp_routes"
T = TypeVar("T")


@dataclass
class ServedSteering:
    """The server's global and named steering, as clients set them (JSON forms kept to
    describe them back)."""

    global_: list[Steering] = field(default_factory=list)
    named: dict[str, Steering] = field(default_factory=dict)


class BadRequest(ValueError):
    pass


def _engine(request: Request) -> Any:
    return request.app.state.engine_client


def _workers(request: Request) -> WorkerCalls[Any]:
    return WorkerCalls.of(_engine(request))


def _config(request: Request) -> Any:
    return engine_config(_engine(request)).hf_config


async def _json_body(request: Request) -> Any:
    body = await read_body(request, client_limits.current())
    try:
        return json.loads(body)
    except ValueError:
        raise BadRequest("the body is not JSON") from None


router = APIRouter()


@router.get("/v1/vinterp/sites")
async def sites(request: Request) -> JSONResponse:
    """The served model's sites and configuration: what `vinterp.Client` builds its module
    tree from (no weights)."""
    served = engine_config(_engine(request))
    config = served.hf_config
    return JSONResponse(
        {
            "model": served.served_name,
            "num_layers": int(config.num_hidden_layers),
            "hidden_size": int(config.hidden_size),
            "vocab_size": int(config.vocab_size),
            "sites": site_order(config).sites,
            "pipeline_parallel_size": served.pipeline_parallel_size,
            "config": json.loads(config.to_json_string()),
        }
    )


@router.get("/v1/vinterp/stats")
async def stats(request: Request) -> JSONResponse:
    """The engine's step counts (`LLM.step_stats`)."""
    return JSONResponse((await _workers(request).step_stats())[0])


@router.get("/v1/vinterp/held")
async def held(request: Request) -> JSONResponse:
    """What the workers hold for requests, summed (`vinterp_held_state`): traces, requests
    followed, captured rows not yet taken, keys kept for attention patterns; all zero once
    nothing runs."""
    per_worker = await _workers(request).held_state()
    return JSONResponse({key: sum(w[key] for w in per_worker) for key in per_worker[0]})


def decode_trace(
    body: Any, config: Any, stages: int, limit: client_limits.ServeLimits
) -> tuple[dict[str, Any], Graph, Any]:
    """The request's graph (wire form, decoded graph, plan), within the server's limits."""
    if not isinstance(body, dict) or set(body) != {"graph"}:
        raise BadRequest("expected {graph: the trace's wire form}")
    nodes = body["graph"].get("nodes") if isinstance(body["graph"], dict) else None
    if isinstance(nodes, list) and len(nodes) > limit.nodes:
        raise BadRequest(f"{len(nodes)} nodes; the limit is {limit.nodes} (--max-trace-nodes)")
    wire = payload_from_json(body["graph"])
    order = site_order(config)
    graph = from_wire(wire, order)
    if len(graph.invokes) > limit.invokes:
        raise BadRequest(
            f"{len(graph.invokes)} invokes; the limit is {limit.invokes} (--max-trace-invokes)"
        )
    for k, invoke in enumerate(graph.invokes):
        max_tokens = invoke.sampling.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or not 0 < max_tokens <= limit.max_tokens:
            raise BadRequest(
                f"invoke {k}: max_tokens {max_tokens!r:.20} must be 1..{limit.max_tokens} "
                "(--max-trace-tokens)"
            )
    plan = make_plan(graph, order, last_stage_start(order.num_layers, stages))
    return wire, graph, plan


@router.post("/v1/vinterp/trace")
async def trace(request: Request) -> JSONResponse:
    """Run one serialized trace; its outputs, saves and failure (one that names the line)."""
    engine, limit = _engine(request), client_limits.current()
    stages = engine_config(engine).pipeline_parallel_size
    try:
        body = await _json_body(request)
        wire, graph, plan = decode_trace(body, _config(request), stages, limit)
    except PlanError as exc:
        return bad_request(str(exc), out_of_order=exc.out_of_order)
    except LimitError as exc:
        return exc.response()
    except (BadRequest, WireError) as exc:
        return bad_request(str(exc))
    from vinterp.engine.async_vllm_engine import run_trace
    from vinterp.engine.vllm_engine import collected_result

    try:
        async with request.app.state.vinterp_traces.enter(request, limit.traces_per_key):
            ran = await _unless_client_leaves(request, run_trace(engine, wire, graph, plan))
    except LimitError as exc:
        return exc.response()
    except PlanError as exc:
        return bad_request(str(exc), out_of_order=exc.out_of_order)
    except InterventionError as exc:  # a trace this engine cannot run (a prompt too long)
        return bad_request(str(exc), kind=InterventionError.__name__)
    if ran is None:
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    outputs, per_worker = ran
    result = collected_result(outputs, per_worker)
    return JSONResponse(
        {
            "outputs": [output_to_json(out) for out in outputs],
            "saved": {str(node): saved_to_json(v) for node, v in result.saved.items()},
            "failure": None if result.failure is None else result.failure.__dict__,
        }
    )


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None once the client has disconnected: `work` is then cancelled,
    which aborts its requests in the engine and frees the trace's state on the workers
    (`run_trace` collects in its `finally`). The body has been read: every message left is
    the disconnect."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _steering_state(request: Request) -> ServedSteering:
    return request.app.state.vinterp_steering


@router.get("/v1/vinterp/steering")
async def get_steering(request: Request) -> JSONResponse:
    state = _steering_state(request)
    return JSONResponse(
        {
            "global": [s.to_json() for s in state.global_],
            "named": {name: s.to_json() for name, s in state.named.items()},
        }
    )


@router.put("/v1/vinterp/steering")
async def put_steering(request: Request) -> JSONResponse:
    """`{"global": [steering, ...]}` replaces the global steering; `{"name": N, "steering":
    steering}` registers a named one."""
    state, config, engine = _steering_state(request), _config(request), _engine(request)
    try:
        body = await _json_body(request)
        if isinstance(body, dict) and set(body) == {"global"} and isinstance(body["global"], list):
            specs = [Steering.from_json(item) for item in body["global"]]
            for spec in specs:
                check_steering(spec, config, {}, "global", shared=True)  # a server holds no SAE
            wires = [s.to_wire() for s in specs]
            await WorkerCalls.of(engine).set_steering(wires)
            state.global_ = specs
        elif isinstance(body, dict) and set(body) == {"name", "steering"}:
            name = body["name"]
            if not isinstance(name, str) or not name or len(name) > 200:
                raise BadRequest("name: a non-empty string of at most 200 characters")
            spec = Steering.from_json(body["steering"])
            check_steering(spec, config, {}, "steering", shared=True)
            await WorkerCalls.of(engine).register_steering(name, spec.to_wire())
            state.named[name] = spec
        else:
            raise BadRequest(
                'expected {"global": [steering, ...]} or {"name": ..., "steering": ...}'
            )
    except LimitError as exc:
        return exc.response()
    except (BadRequest, WireError, ValueError) as exc:
        return bad_request(str(exc))
    return await get_steering(request)


@router.delete("/v1/vinterp/steering")
async def delete_steering(request: Request, name: str | None = None) -> JSONResponse:
    """No name: clear the global steering; `?name=N`: unregister N."""
    state, engine = _steering_state(request), _engine(request)
    if name is None:
        await WorkerCalls.of(engine).set_steering([])
        state.global_ = []
    elif name in state.named:
        await WorkerCalls.of(engine).register_steering(name, None)
        del state.named[name]
    else:
        return bad_request(f"no steering named {name!r} is registered")
    return await get_steering(request)


# Set when the served engine was already dead when the server first stopped it (its core or
# a worker died): `vinterp serve` then exits non-zero, where vLLM 0.32's server exits with 0.
ENGINE_DIED = threading.Event()


def _note_engine_death(engine: Any) -> None:
    """Wrap `engine.shutdown`, which the server calls on every way out, to judge the first call.

    The server's own shutdown (a signal) stops a running engine; after a death the engine is
    already errored when the server gets to stop it, however soon after the death it exits.
    """
    stop = engine.shutdown
    judged = threading.Event()

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        if not judged.is_set():
            judged.set()
            if engine.errored:
                ENGINE_DIED.set()
        return stop(*args, **kwargs)

    engine.shutdown = shutdown


class VinterpRoutes:
    """The `vllm.endpoint_plugins` entry point."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        state.vinterp_steering = ServedSteering()
        state.vinterp_traces = TraceGate()
        if engine_client is None:
            return
        _note_engine_death(engine_client)
