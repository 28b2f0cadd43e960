"""`vinterp.Client`: `vinterp.LLM`'s API against a `vinterp serve` server (API.md section 6).

The module tree comes from the server's site description (no weights here); a trace is
recorded and checked exactly as with `vinterp.LLM`, then travels as its graph's wire form;
steering and capture travel in the `vinterp` body field of `/v1/completions`. Nothing this
side sends is code, and nothing it receives is unpickled.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from vinterp.api.fast import Prepared, prepare
from vinterp.api.front_end import Prompt, TraceFrontEnd
from vinterp.api.specs import Capture, Request, Steering
from vinterp.api.steering_control import SteeringControl
from vinterp.engine.outputs import Output
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan, PlanError
from vinterp.ir.wire import to_wire
from vinterp.runtime.executor import Failure, TraceResult
from vinterp.wire.json_form import captures_from_json, payload_to_json, saved_from_json

CONCURRENT_REQUESTS = 16  # generate() keeps this many completions in flight for batching


class ServerError(RuntimeError):
    """The server refused a request or failed; the message is the server's."""


class HTTPBackend:
    """The server's routes, as the calls `Trace` and `SteeringControl` make of a backend."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        response = self.http.request(method, path, json=body, params=params or None)
        if response.status_code == 400 and path == "/v1/vinterp/trace":
            error = response.json()["error"]
            raise PlanError(error["message"], out_of_order=bool(error.get("out_of_order")))
        if response.status_code != 200:
            raise ServerError(f"{method} {path}: HTTP {response.status_code}: {response.text}")
        return response.json()

    def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        data = self.request("POST", "/v1/vinterp/trace", {"graph": payload_to_json(to_wire(graph))})
        outputs = [Output(**out) for out in data["outputs"]]
        saved = {int(node): saved_from_json(value) for node, value in data["saved"].items()}
        failure = Failure(**data["failure"]) if data["failure"] else None
        return TraceResult(outputs, saved, failure)

    def set_global_steering(self, specs: list[Steering]) -> None:
        if specs:
            self.request("PUT", "/v1/vinterp/steering", {"global": [s.to_json() for s in specs]})
        else:
            self.request("DELETE", "/v1/vinterp/steering")

    def register_steering(self, name: str, spec: Steering | None) -> None:
        if spec is None:
            self.request("DELETE", "/v1/vinterp/steering", name=name)
        else:
            self.request("PUT", "/v1/vinterp/steering", {"name": name, "steering": spec.to_json()})

    def steering_names(self) -> set[str]:
        return set(self.request("GET", "/v1/vinterp/steering")["named"])


class ClientSteering(SteeringControl):
    """Named steerings are the server's: registered by any of its clients."""

    def names(self) -> set[str]:
        return self._llm._engine.steering_names()


class Client(TraceFrontEnd):
    """A served model: `client.trace`, `client.generate`, `client.steering` as on an LLM."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        from transformers import PretrainedConfig

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self._engine = HTTPBackend(self._http)
        description = self._engine.request("GET", "/v1/vinterp/sites")
        self.model = description["model"]
        self.config = PretrainedConfig.from_dict(description["config"])
        self.backend = "vllm"
        self.pipeline_parallel_size = int(description["pipeline_parallel_size"])
        self._init_front_end()
        self.steering = ClientSteering(self)

    def _encode(self, text: str) -> list[int]:
        data = self._engine.request("POST", "/tokenize", {"model": self.model, "prompt": text})
        return list(data["tokens"])

    def generate(
        self,
        prompts: Prompt | Request | list[Prompt | Request],
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        use_tqdm: bool = True,
        **sampling: Any,
    ) -> list[Output]:
        """As `LLM.generate`; captures come back in memory (`out.captures`)."""
        from tqdm import tqdm

        if capture is not None and capture.sink != "memory":
            raise ValueError("capture.sink: a server returns captures; use sink='memory'")
        requests = prepare(self, prompts, steering, capture, sampling)
        with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
            done = pool.map(self._complete, requests)
            return list(tqdm(done, total=len(requests), disable=not use_tqdm, desc="generate"))

    def _complete(self, req: Prepared) -> Output:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt,
            **req.sampling,
            "return_token_ids": True,
        }
        field: dict[str, Any] = {}
        if req.steering or req.steering_names:
            field["steering"] = [s.to_json() for s in req.steering] + req.steering_names
        if req.capture is not None:
            field["capture"] = req.capture.to_json()
        if field:
            body["vinterp"] = field
        data = self._engine.request("POST", "/v1/completions", body)
        choice = data["choices"][0]
        out = Output(req.prompt, list(choice.get("token_ids") or []), choice["text"])
        if req.capture is not None:
            out.captures = captures_from_json(data["vinterp"]["captures"])
        return out

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
