"""What one client may ask of a shared server, settable by `vinterp serve` flags: the body's
size (checked from its Content-Length on every route before anything is read, so a 1 GB body
is refused at once and never held, and on the routes that read the body here also while it
streams in) and the time it may take to arrive (a body trickled in is refused with a 408
rather than holding a connection open), and per trace its nodes, invokes and tokens, and how
many traces one API key may run at once. The flags reach the server's processes through one
environment variable, as JSON."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pydantic import BaseModel, ConfigDict, PositiveInt
from starlette.requests import Request
from starlette.responses import JSONResponse

from vinterp.serve.error_responses import error_response

ENV = "VINTERP_SERVE_LIMITS"


class ServeLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    body_bytes: PositiveInt = 256 << 20
    body_seconds: PositiveInt = 60  # for the whole body to arrive
    nodes: PositiveInt = 100_000  # of one trace (the wire decoder's own cap is far higher)
    invokes: PositiveInt = 1024
    max_tokens: PositiveInt = 4096  # per invoke
    traces_per_key: PositiveInt = 8  # running at once, per API key (or per client without one)


def current() -> ServeLimits:
    """The limits this server was started with (`ENV`), else the defaults."""
    return _parsed(os.environ.get(ENV))


@functools.lru_cache(maxsize=4)
def _parsed(text: str | None) -> ServeLimits:
    """Validated once per setting, not on every request."""
    return ServeLimits.model_validate_json(text) if text else ServeLimits()


def to_environment(limits: ServeLimits) -> None:
    os.environ[ENV] = json.dumps(limits.model_dump())


class LimitError(ValueError):
    """A request over a limit; `status` is its HTTP status (408, 413 or 429)."""

    KINDS = {408: "RequestTimeoutError", 413: "RequestTooLargeError", 429: "TooManyRequestsError"}

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        """The refusal in the error form of vLLM's server."""
        return error_response(str(self), self.status, self.KINDS[self.status])


def check_declared_size(request: Request, limits: ServeLimits) -> None:
    """Refuse (413) a body whose declared size (Content-Length) is over the limit, before a
    byte of it is read: cheap enough for every route, vLLM's included."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.body_bytes:
        raise LimitError(too_large(int(declared), limits.body_bytes), 413)


async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The body, refused (413) as soon as its declared or received size passes the limit, and
    (408) when it has not all arrived within the time limit."""
    check_declared_size(request, limits)
    limit = limits.body_bytes
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise LimitError(too_large(size, limit, more=True), 413)
                chunks.append(chunk)
    except TimeoutError:
        raise LimitError(
            f"the body did not arrive within {limits.body_seconds} s ({size} bytes came); "
            "send it at once (vinterp serve --max-body-seconds)",
            408,
        ) from None
    body = b"".join(chunks)
    request._body = body  # read once: later readers (vLLM's route) get it from here
    return body


def too_large(size: int, limit: int, more: bool = False) -> str:
    return (
        f"body of {'more than ' if more else ''}{size} bytes; the limit is {limit} "
        "(vinterp serve --max-body-mb)"
    )


class TraceGate:
    """How many traces each API key runs; one over `traces_per_key` is refused (429) at once
    rather than queued, so one client cannot hold the engine for the others."""

    def __init__(self) -> None:
        self._running: defaultdict[str, int] = defaultdict(int)

    @asynccontextmanager
    async def enter(self, request: Request, limit: int) -> AsyncIterator[None]:
        key = request.headers.get("authorization") or f"client {client_host(request)}"
        if self._running[key] >= limit:
            raise LimitError(
                f"{limit} traces of this API key are running; wait for one to finish "
                "(vinterp serve --max-traces-per-key)",
                429,
            )
        self._running[key] += 1
        try:
            yield
        finally:
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]


def client_host(request: Request) -> str:
    return request.client.host if request.client else "unknown"
