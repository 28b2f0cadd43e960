"""The server's limits (`vinterp.serve.client_limits`) on a Starlette app of their own: bodies over
the limit get a 413 from their declared size before anything is read, or as soon as a
streamed body passes it; a body trickled in past the time limit a 408; a body within both
reaches the route intact; an API key over its
running traces gets a 429 at once, and its slots come back when traces end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vinterp.serve import client_limits
from vinterp.serve.client_limits import LimitError, ServeLimits, TraceGate, read_body

LIMIT = 1000
LIMITS = ServeLimits(body_bytes=LIMIT, body_seconds=1)


async def echo(request: Request) -> JSONResponse:
    try:
        body = await read_body(request, LIMITS)
    except LimitError as exc:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)
    return JSONResponse({"size": len(body), "again": len(await request.body())})


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(Starlette(routes=[Route("/echo", echo, methods=["POST"])])) as test_client:
        yield test_client


def test_a_body_within_the_limit_reaches_the_route_and_reads_again(client) -> None:
    r = client.post("/echo", content=b"x" * LIMIT)
    assert r.status_code == 200 and r.json() == {"size": LIMIT, "again": LIMIT}


def test_a_declared_size_over_the_limit_is_refused_before_the_body_is_read(client) -> None:
    pulled = []

    def body() -> Iterator[bytes]:  # what the server takes of the body
        for _ in range(10):
            pulled.append(1)
            yield b"x" * 1000

    headers = {"content-length": str(10 * 1000)}
    r = client.post("/echo", content=body(), headers=headers)
    assert r.status_code == 413 and "limit is 1000" in r.json()["error"]
    assert "--max-body-mb" in r.json()["error"]
    assert len(pulled) <= 1  # refused from the header: the client's stream was not drained


def test_a_streamed_body_is_refused_once_it_passes_the_limit(client) -> None:
    def body() -> Iterator[bytes]:  # chunked: no declared size
        for _ in range(50):
            yield b"x" * 300

    r = client.post("/echo", content=body())
    assert r.status_code == 413 and "more than" in r.json()["error"]


def test_a_body_trickled_in_past_the_time_limit_is_refused() -> None:
    sent = []

    async def receive() -> dict:  # one byte every 0.25 s: 2 s for the whole body
        await asyncio.sleep(0.25)
        sent.append(1)
        return {"type": "http.request", "body": b"x", "more_body": len(sent) < 8}

    async def scenario() -> None:
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        started = time.monotonic()
        with pytest.raises(LimitError) as refused:
            await read_body(request, LIMITS)
        assert time.monotonic() - started < 1.5  # at the limit, not after the whole body
        assert refused.value.status == 408 and "--max-body-seconds" in str(refused.value)
        assert refused.value.response().status_code == 408
        # within the limit the same trickle arrives whole
        sent.clear()
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        patient = ServeLimits(body_bytes=LIMIT, body_seconds=5)
        assert await read_body(request, patient) == b"x" * 8

    asyncio.run(scenario())


def test_a_key_over_its_running_traces_is_refused_and_gets_its_slots_back() -> None:
    gate = TraceGate()

    def request(key: str) -> Request:
        headers = [(b"authorization", key.encode())]
        return Request({"type": "http", "headers": headers, "client": ("1.2.3.4", 1)})

    async def scenario() -> None:
        async with gate.enter(request("Bearer a"), 2), gate.enter(request("Bearer a"), 2):
            with pytest.raises(LimitError) as refused:
                async with gate.enter(request("Bearer a"), 2):
                    pass
            assert refused.value.status == 429
            async with gate.enter(request("Bearer b"), 2):  # another key runs on
                pass
        async with gate.enter(request("Bearer a"), 2), gate.enter(request("Bearer a"), 2):
            pass  # both slots back

    asyncio.run(scenario())


def test_limits_come_from_the_environment_and_bad_ones_are_refused(monkeypatch) -> None:
    # recorded (an empty value reads as unset), so the value to_environment sets is undone
    # and the later tests' servers get the defaults
    monkeypatch.setenv(client_limits.ENV, "")
    assert client_limits.current() == ServeLimits()
    client_limits.to_environment(ServeLimits(body_bytes=5, traces_per_key=1))
    assert client_limits.current().body_bytes == 5 and client_limits.current().traces_per_key == 1
    with pytest.raises(ValueError, match="greater than 0"):
        ServeLimits(nodes=0)
