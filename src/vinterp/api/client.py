"""`vinterp.Client` and `vinterp.AsyncClient`: `vinterp.LLM`'s API against a `vinterp serve`
server (API.md section 6).

The module tree comes from the server's site description (no weights here); a trace is
recorded and checked exactly as with `vinterp.LLM`, then travels as its graph's wire form;
steering and capture travel in the `vinterp` body field of `/v1/completions`. Nothing this
side sends is code, and nothing it receives is unpickled.
"""

from __future__ import annotations

from typing import Any

import httpx

from vinterp.api.front_end import TraceFrontEnd
from vinterp.api.http_backend import SITES, AsyncHTTPBackend, HTTPBackend, answer
from vinterp.api.requests import Request, agenerate, generate
from vinterp.api.steering_control import AsyncSteeringControl, SteeringControl
from vinterp.api.trace import Prompt
from vinterp.engine.outputs import Output
from vinterp.wire.probes import Probe
from vinterp.wire.specs import Capture, Steering


class RemoteModel(TraceFrontEnd):
    """What Client and AsyncClient share: the server's model description and tokenization
    (a plain call: recording a trace is synchronous)."""

    def _connect(self, url: str, api_key: str | None, timeout: float) -> None:
        from transformers import PretrainedConfig

        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)
        description = answer(self.http.get(SITES), "GET", SITES)
        self.model_name = description["model"]
        self.config = PretrainedConfig.from_dict(description["config"])
        self.pipeline_parallel_size = int(description["pipeline_parallel_size"])
        self._init_front_end()

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model_name, "prompt": text}
        return list(answer(self.http.post("/tokenize", json=body), "POST", "/tokenize")["tokens"])


def _memory_only(capture: Capture | None, prompts: Any) -> None:
    items = prompts if isinstance(prompts, list) else [prompts]
    captures = [capture] + [i.capture for i in items if isinstance(i, Request)]
    if any(c is not None and c.sink != "memory" for c in captures):
        raise ValueError("capture.sink: a server returns captures; use sink='memory'")


class Client(RemoteModel):
    """A served model: `client.trace`, `client.generate`, `client.steering` as on an LLM."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._connect(url, api_key, timeout)
        self.backend = HTTPBackend(self.http, self.model_name)
        self.steering = SteeringControl(self)

    def generate(
        self,
        prompts: Prompt | Request | list[Prompt | Request],
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        use_tqdm: bool = True,
        probes: list[Probe] | None = None,
        **sampling: Any,
    ) -> list[Output]:
        """As `LLM.generate`; captures and probe scores come back in memory (`out.captures`,
        `out.probes`)."""
        _memory_only(capture, prompts)
        return generate(self, prompts, steering, capture, sampling, use_tqdm, probes)

    def attach_sae(self, site: str, sae: Any) -> None:
        """Not over HTTP yet: a server takes no SAE from its clients."""
        raise NotImplementedError(
            "vinterp serve does not take sparse autoencoders from clients yet; attach the SAE "
            "with vinterp.LLM(...).attach_sae(site, sae) in the model's own process"
        )

    def step_stats(self) -> dict[str, int]:
        """The server engine's step counts (see `LLM.step_stats`)."""
        return self.backend.step_stats()

    def close(self) -> None:
        self.backend.shutdown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(RemoteModel):
    """As Client, awaited: `async with client.trace(...)`, `await client.generate(...)`,
    `await client.steering.set(...)`. Many calls may be in flight from one event loop."""

    asynchronous = True

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._connect(url, api_key, timeout)
        self.backend = AsyncHTTPBackend(self.url, self.headers, timeout, self.model_name)
        self.steering = AsyncSteeringControl(self)

    async def generate(
        self,
        prompts: Prompt | Request | list[Prompt | Request],
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        probes: list[Probe] | None = None,
        **sampling: Any,
    ) -> list[Output]:
        """As `Client.generate`, awaited; up to 16 completions in flight at once."""
        _memory_only(capture, prompts)
        return await agenerate(
            self, prompts, steering, capture, sampling, use_tqdm=False, probes=probes
        )

    async def step_stats(self) -> dict[str, int]:
        return await self.backend.step_stats()

    async def aclose(self) -> None:
        self.http.close()
        await self.backend.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
