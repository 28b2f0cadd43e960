"""A `vinterp serve` server as a front end's backend, over HTTP. The sync and async backends
send the same requests and read the answers with the same functions; nothing received is
unpickled.

Generation goes through the server's OpenAI completion route with steering and capture in
the `vinterp` body field (their JSON forms); the captures in each answer are kept by capture
id until the front end takes them, as the engines keep theirs.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from tqdm import tqdm

from vinterp.engine.backend import Captured
from vinterp.engine.outputs import Output
from vinterp.errors import InterventionError
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan, PlanError
from vinterp.runtime.executor import Failure, TraceResult
from vinterp.wire.graph import to_wire
from vinterp.wire.json_form import captures_from_json, payload_to_json, saved_from_json
from vinterp.wire.probes import probe_store_name
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Steering, selects

SITES = "/v1/vinterp/sites"
TRACE = "/v1/vinterp/trace"
STEERING = "/v1/vinterp/steering"
STATS = "/v1/vinterp/stats"
COMPLETIONS = "/v1/completions"
CONCURRENT_REQUESTS = 16  # completions a generate() keeps in flight (the server batches them)
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


def global_steering_call(steering: list[Steering]) -> Call:
    if steering:
        return "PUT", STEERING, {"global": [s.to_json() for s in steering]}, {}
    return "DELETE", STEERING, None, {}


def registration_call(name: str, steering: Steering | None) -> Call:
    if steering is None:
        return "DELETE", STEERING, None, {"name": name}
    return "PUT", STEERING, {"name": name, "steering": steering.to_json()}, {}


def completion_call(
    model: str, prompt: list[int], sampling: dict[str, Any], specs: RequestSpecs | None
) -> Call:
    body: dict[str, Any] = {"model": model, "prompt": prompt, **sampling, "return_token_ids": True}
    field: dict[str, Any] = {}
    if specs is not None and (specs.steering or specs.steering_names):
        field["steering"] = [s.to_json() for s in specs.steering] + specs.steering_names
    if specs is not None and specs.capture is not None:
        field["capture"] = specs.capture.to_json()
    if specs is not None and specs.probes:
        field["probes"] = [p.to_json() for p in specs.probes]
    if field:
        body["vinterp"] = field
    return "POST", COMPLETIONS, body, {}


class CompletionRows:
    """Outputs of completions, and the captures their answers carried, by capture id."""

    def __init__(self) -> None:
        self.kept: Captured = {}

    def output(self, prompt: list[int], specs: RequestSpecs | None, data: dict[str, Any]) -> Output:
        choice = data["choices"][0]
        out = Output(prompt, list(choice.get("token_ids") or []), choice["text"])
        if specs is None or not specs.capture_id:
            return out
        # the rows the server checked complete: the selected positions the model read
        read_upto = len(prompt) + max(len(out.token_ids) - 1, 0)
        kept = self.kept[specs.capture_id] = {}
        if specs.capture is not None:
            tensors = captures_from_json(data["vinterp"]["captures"])
            selector = specs.capture.positions
            positions = [p for p in range(read_upto) if selects(selector, p, len(prompt))]
            kept.update(
                {
                    site: {"positions": positions[: len(t)], "values": t}
                    for site, t in tensors.items()
                }
            )
        if specs.probes:
            scores = captures_from_json(data["vinterp"]["probes"])
            for name, t in scores.items():
                kept[probe_store_name(name)] = {"positions": list(range(len(t))), "values": t}
        return out

    def take(self, capture_ids: list[str]) -> Captured:
        return {cid: self.kept.pop(cid, {}) for cid in capture_ids}


class HTTPBackend:
    name = "http"

    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http, self.model = http, model
        self.rows = CompletionRows()

    @property
    def native(self) -> Any:
        return self.http

    def call(self, method: str, path: str, body: Any = None, params: Any = None) -> Any:
        response = self.http.request(method, path, json=body, params=params or None)
        return answer(response, method, path)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = True,
    ) -> list[Output]:
        def complete(request: tuple[list[int], dict[str, Any], RequestSpecs | None]) -> Output:
            prompt, options, spec = request
            data = self.call(*completion_call(self.model, prompt, options, spec))
            return self.rows.output(prompt, spec, data)

        with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
            done = pool.map(complete, zip(prompts, sampling, specs))
            return list(tqdm(done, total=len(prompts), disable=not use_tqdm, desc="generate"))

    def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        return trace_result(self.call(*trace_call(graph)))

    def take_captures(self, capture_ids: list[str]) -> Captured:
        return self.rows.take(capture_ids)

    def set_global_steering(self, steering: list[Steering]) -> None:
        self.call(*global_steering_call(steering))

    def register_steering(self, name: str, steering: Steering | None) -> None:
        self.call(*registration_call(name, steering))

    def steering_names(self) -> set[str]:
        return set(self.call("GET", STEERING)["named"])

    def step_stats(self) -> dict[str, int]:
        return dict(self.call("GET", STATS))

    def shutdown(self) -> None:
        self.http.close()


class AsyncHTTPBackend:
    """As HTTPBackend, awaited. httpx's async connections belong to the event loop that
    opened them, so each loop the caller uses (several `asyncio.run` calls) gets its own."""

    name = "http"

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float, model: str) -> None:
        self._options = {"base_url": base_url, "headers": headers, "timeout": timeout}
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.model = model
        self.rows = CompletionRows()

    @property
    def native(self) -> Any:
        return self._http()

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

    async def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = False,
    ) -> list[Output]:
        slots = asyncio.Semaphore(CONCURRENT_REQUESTS)

        async def complete(prompt: list[int], options: dict[str, Any], spec: Any) -> Output:
            async with slots:
                data = await self.call(*completion_call(self.model, prompt, options, spec))
            return self.rows.output(prompt, spec, data)

        return list(await asyncio.gather(*map(complete, prompts, sampling, specs)))

    async def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        return trace_result(await self.call(*trace_call(graph)))

    async def take_captures(self, capture_ids: list[str]) -> Captured:
        return self.rows.take(capture_ids)

    async def set_global_steering(self, steering: list[Steering]) -> None:
        await self.call(*global_steering_call(steering))

    async def register_steering(self, name: str, steering: Steering | None) -> None:
        await self.call(*registration_call(name, steering))

    async def steering_names(self) -> set[str]:
        return set((await self.call("GET", STEERING))["named"])

    async def step_stats(self) -> dict[str, int]:
        return dict(await self.call("GET", STATS))

    async def aclose(self) -> None:
        http = self._clients.pop(asyncio.get_running_loop(), None)
        if http is not None:
            await http.aclose()
