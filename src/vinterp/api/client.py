"""`vinterp.Client` and `vinterp.AsyncClient`: `vinterp.LLM`'s API against a `vinterp serve`
server (API.md section 6).

The module tree comes from the server's site description (no weights here); a trace is
recorded and checked exactly as with `vinterp.LLM`, then travels as its graph's wire form;
steering and capture travel in the `vinterp` body field of `/v1/completions`. Nothing this
side sends is code, and nothing it receives is unpickled.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from vinterp.api.fast import Prepared, prepare
from vinterp.api.front_end import Prompt, TraceFrontEnd
from vinterp.api.http_backend import AsyncHTTPBackend, HTTPBackend, answer
from vinterp.api.specs import Capture, Request, Steering
from vinterp.api.steering_control import AsyncSteeringControl, SteeringControl
from vinterp.engine.outputs import Output
from vinterp.wire.json_form import captures_from_json

CONCURRENT_REQUESTS = 16  # completions a generate() keeps in flight (the server batches them)
SITES = "/v1/vinterp/sites"
COMPLETIONS = "/v1/completions"


class RemoteModel(TraceFrontEnd):
    """What Client and AsyncClient share: the server's model description, tokenization (a
    plain call: recording a trace is synchronous), and the completion request of a prepared
    prompt and its answer."""

    def _connect(self, url: str, api_key: str | None, timeout: float) -> None:
        from transformers import PretrainedConfig

        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._http = httpx.Client(base_url=self._url, headers=self._headers, timeout=timeout)
        description = answer(self._http.get(SITES), "GET", SITES)
        self.model = description["model"]
        self.config = PretrainedConfig.from_dict(description["config"])
        self.backend = "vllm"
        self.pipeline_parallel_size = int(description["pipeline_parallel_size"])
        self._init_front_end()

    def _encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text}
        return list(answer(self._http.post("/tokenize", json=body), "POST", "/tokenize")["tokens"])

    def _prepare(
        self,
        prompts: Any,
        steering: Any,
        capture: Capture | None,
        sampling: dict[str, Any],
        names: set[str] | None = None,
    ) -> list[Prepared]:
        if capture is not None and capture.sink != "memory":
            raise ValueError("capture.sink: a server returns captures; use sink='memory'")
        return prepare(self, prompts, steering, capture, sampling, names)

    def _completion(self, req: Prepared) -> dict[str, Any]:
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
        return body

    @staticmethod
    def _output(req: Prepared, data: dict[str, Any]) -> Output:
        choice = data["choices"][0]
        out = Output(req.prompt, list(choice.get("token_ids") or []), choice["text"])
        if req.capture is not None:
            out.captures = captures_from_json(data["vinterp"]["captures"])
        return out


class ClientSteering(SteeringControl):
    """Named steerings are the server's: registered by any of its clients."""

    def names(self) -> set[str]:
        return self._llm._engine.steering_names()


class Client(RemoteModel):
    """A served model: `client.trace`, `client.generate`, `client.steering` as on an LLM."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._connect(url, api_key, timeout)
        self._engine = HTTPBackend(self._http)
        self.steering = ClientSteering(self)

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

        requests = self._prepare(prompts, steering, capture, sampling)
        with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
            done = pool.map(self._complete, requests)
            return list(tqdm(done, total=len(requests), disable=not use_tqdm, desc="generate"))

    def _complete(self, req: Prepared) -> Output:
        return self._output(req, self._engine.call("POST", COMPLETIONS, self._completion(req)))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClientSteering(AsyncSteeringControl):
    """Named steerings are the server's; `await client.steering.names()` asks it."""

    async def names(self) -> set[str]:  # type: ignore[override]
        return await self._llm._engine.steering_names()


class AsyncClient(RemoteModel):
    """As Client, awaited: `async with client.trace(...)`, `await client.generate(...)`,
    `await client.steering.set(...)`. Many calls may be in flight from one event loop."""

    asynchronous = True

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._connect(url, api_key, timeout)
        self._engine = AsyncHTTPBackend(self._url, self._headers, timeout)
        self.steering = AsyncClientSteering(self)

    async def generate(
        self,
        prompts: Prompt | Request | list[Prompt | Request],
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        **sampling: Any,
    ) -> list[Output]:
        """As `Client.generate`, awaited; up to 16 completions in flight at once."""
        names = await self._engine.steering_names()
        requests = self._prepare(prompts, steering, capture, sampling, names)
        slots = asyncio.Semaphore(CONCURRENT_REQUESTS)

        async def complete(req: Prepared) -> Output:
            async with slots:
                data = await self._engine.call("POST", COMPLETIONS, self._completion(req))
            return self._output(req, data)

        return list(await asyncio.gather(*(complete(r) for r in requests)))

    async def aclose(self) -> None:
        self._http.close()
        await self._engine.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
