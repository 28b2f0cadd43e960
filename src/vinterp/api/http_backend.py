"""A `vinterp serve` server as the trace front-end's backend: the calls `Trace` and the
steering controls make of a backend, over HTTP. The sync and async backends send the same
requests and read the answers with the same functions; nothing received is unpickled."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from vinterp.api.errors import InterventionError
from vinterp.api.specs import Steering
from vinterp.engine.outputs import Output
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan, PlanError
from vinterp.runtime.executor import Failure, TraceResult
from vinterp.wire.graph import to_wire
from vinterp.wire.json_form import payload_to_json, saved_from_json

TRACE = "/v1/vinterp/trace"
STEERING = "/v1/vinterp/steering"
# One call: method, path, JSON body, query parameters.
Call = tuple[str, str, Any, dict[str, Any]]


class ServerError(RuntimeError):
    """The server refused a request or failed; the message is the server's."""


def answer(response: httpx.Response, method: str, path: str) -> Any:
    """The JSON of a successful answer; a refused trace as the error the engine raised
    (InterventionError: the engine cannot run it; PlanError: the plan), else ServerError."""
    if response.status_code == 400 and path == TRACE:
        error = response.json()["error"]
        if error.get("type") == InterventionError.__name__:
            raise InterventionError(error["message"])
        raise PlanError(error["message"], out_of_order=bool(error.get("out_of_order")))
    if response.status_code != 200:
        raise ServerError(f"{method} {path}: HTTP {response.status_code}: {response.text}")
    return response.json()


def trace_call(graph: Graph) -> Call:
    return "POST", TRACE, {"graph": payload_to_json(to_wire(graph))}, {}


def trace_result(data: dict[str, Any]) -> TraceResult:
    outputs = [Output(**out) for out in data["outputs"]]
    saved = {int(node): saved_from_json(value) for node, value in data["saved"].items()}
    failure = Failure(**data["failure"]) if data["failure"] else None
    return TraceResult(outputs, saved, failure)


def global_steering_call(specs: list[Steering]) -> Call:
    if specs:
        return "PUT", STEERING, {"global": [s.to_json() for s in specs]}, {}
    return "DELETE", STEERING, None, {}


def registration_call(name: str, spec: Steering | None) -> Call:
    if spec is None:
        return "DELETE", STEERING, None, {"name": name}
    return "PUT", STEERING, {"name": name, "steering": spec.to_json()}, {}


class HTTPBackend:
    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def call(self, method: str, path: str, body: Any = None, params: Any = None) -> Any:
        response = self.http.request(method, path, json=body, params=params or None)
        return answer(response, method, path)

    def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        return trace_result(self.call(*trace_call(graph)))

    def set_global_steering(self, specs: list[Steering]) -> None:
        self.call(*global_steering_call(specs))

    def register_steering(self, name: str, spec: Steering | None) -> None:
        self.call(*registration_call(name, spec))

    def steering_names(self) -> set[str]:
        return set(self.call("GET", STEERING)["named"])


class AsyncHTTPBackend:
    """As HTTPBackend, awaited. httpx's async connections belong to the event loop that
    opened them, so each loop the caller uses (several `asyncio.run` calls) gets its own."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float) -> None:
        self._options = {"base_url": base_url, "headers": headers, "timeout": timeout}
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._clients if lp.is_closed()]:
            del self._clients[old]
        if loop not in self._clients:
            self._clients[loop] = httpx.AsyncClient(**self._options)  # type: ignore[arg-type]
        return self._clients[loop]

    async def call(self, method: str, path: str, body: Any = None, params: Any = None) -> Any:
        response = await self._http().request(method, path, json=body, params=params or None)
        return answer(response, method, path)

    async def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        return trace_result(await self.call(*trace_call(graph)))

    async def set_global_steering(self, specs: list[Steering]) -> None:
        await self.call(*global_steering_call(specs))

    async def register_steering(self, name: str, spec: Steering | None) -> None:
        await self.call(*registration_call(name, spec))

    async def steering_names(self) -> set[str]:
        return set((await self.call("GET", STEERING))["named"])

    async def aclose(self) -> None:
        http = self._clients.pop(asyncio.get_running_loop(), None)
        if http is not None:
            await http.aclose()
