"""`vinterp serve` under faults (API.md section 6): a client that leaves a captured completion
or a trace frees what the workers held for it and aborts its generation; a body trickled in
past `--max-body-seconds` gets a 408; an engine core killed mid-step ends every in-flight
request within seconds and the server exits non-zero, and so does one of two tensor-parallel
workers killed. Each on a real server of its own."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI
from served import KEY, served

import vinterp
from vinterp.bench.served import Server

pytestmark = pytest.mark.engine("serve_faults", releases=True)

PROMPT = "The capital of France is"
LONG = 1500  # tokens: far longer than any test waits (about 30 ms each here)
BODY_SECONDS = 3


@pytest.fixture(scope="module")
def server(engines) -> Iterator[Server]:
    engines.release()  # one engine at a time on this machine
    with served("--max-body-seconds", str(BODY_SECONDS)) as running:
        yield running


def openai(server: Server, timeout: float = 60.0) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=timeout, max_retries=0)


def complete(
    server: Server, timeout: float = 60.0, stream: bool = False, tokens: int = LONG, **extra: Any
) -> Any:
    oai = openai(server, timeout)
    model = oai.models.list().data[0].id
    body = {"ignore_eos": True, **extra}
    return oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=tokens,
        temperature=0.0,
        stream=stream,
        extra_body=body,
    )


def held(server: Server) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.get(server.url + "/v1/vinterp/held", headers=headers, timeout=30).json()


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `work` on a thread; the dict gets its result or error and when it ended."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except Exception as exc:  # what the client saw
            outcome["error"] = exc
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def settled(server: Server) -> dict[str, int]:
    """What the workers hold once a short request has run (a step tells the workers which
    requests ended, so an aborted one is dropped by the next step)."""
    openai(server).completions.create(
        model=openai(server).models.list().data[0].id, prompt=PROMPT, max_tokens=2
    )
    return held(server)


def test_a_client_leaving_a_captured_completion_frees_its_rows(server) -> None:
    capture = {"capture": {"sites": ["layers.*.output"], "positions": "all"}}
    thread, outcome = in_thread(lambda: complete(server, timeout=4.0, vinterp=capture))
    assert wait_for(lambda: held(server)["captures"] == 1, 4.0)  # rows held while it runs
    thread.join(30)
    assert "error" in outcome  # the client gave up (its timeout) and closed the connection
    assert wait_for(lambda: not any(settled(server).values()), 15.0), held(server)


def test_a_client_leaving_a_trace_aborts_it_and_frees_its_state(server) -> None:
    client = vinterp.Client(server.url, api_key=KEY, timeout=4.0)

    def trace() -> None:
        with client.trace(PROMPT, max_tokens=LONG, ignore_eos=True):
            client.layers[5].output.save()

    thread, outcome = in_thread(trace)
    assert wait_for(lambda: held(server)["traces"] == 1, 4.0)
    thread.join(30)
    assert "error" in outcome
    left = outcome["ended"]
    # the trace's 1,500 tokens would take far longer: it was aborted, not run to its end
    assert wait_for(lambda: not any(settled(server).values()), 15.0), held(server)
    assert time.monotonic() - left < 20.0


@pytest.mark.parametrize("path", ["/v1/vinterp/trace", "/v1/completions"])
def test_a_body_trickled_in_gets_a_408_and_the_server_serves_on(server, path) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    with socket.create_connection((host, int(port)), timeout=BODY_SECONDS + 20) as sock:
        started = time.monotonic()
        sock.sendall(head.encode())  # and never the rest of the body
        answer = b""
        while b"max-body-seconds" not in answer and (part := sock.recv(4096)):
            answer += part
        answer = answer.decode(errors="replace")
    assert answer.startswith("HTTP/1.1 408"), answer[:300]
    assert "--max-body-seconds" in answer
    assert time.monotonic() - started < BODY_SECONDS + 10
    assert not any(settled(server).values())


def process_of(server: Server, marker: str) -> psutil.Process:
    """The server's child process whose name or command line holds `marker`."""
    for child in psutil.Process(server.pid).children(recursive=True):
        if marker in child.name() or marker in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no {marker} process under the server")


@pytest.fixture(scope="module")
def tp_server(engines, tiny_llama) -> Iterator[Server]:
    """Two tensor-parallel workers (the tiny llama: the bundled model's 9 heads do not split)."""
    engines.release()
    with served("--tensor-parallel-size", "2", model=tiny_llama) as running:
        yield running


@dataclass(frozen=True)
class Victim:
    server: str  # the fixture
    process: str  # a marker of the process killed
    tokens: int  # per request: more than the test waits, within the model's context
    layer: int  # traced


VICTIMS = {
    "engine core": Victim("server", "EngineCore", LONG, 5),
    "TP worker": Victim("tp_server", "Worker_TP1", 480, 1),
}


@pytest.mark.parametrize("victim", VICTIMS.values(), ids=VICTIMS.keys())
def test_a_killed_engine_ends_every_request_and_the_server_exits(victim, request) -> None:
    """Last in the module: the server does not survive it. The engine core, or under tensor
    parallelism one worker, killed mid-step."""
    server = request.getfixturevalue(victim.server)
    client = vinterp.Client(server.url, api_key=KEY, timeout=120.0)
    tokens = victim.tokens

    def streamed() -> int:
        return sum(1 for _ in complete(server, timeout=120.0, stream=True, tokens=tokens))

    def traced() -> None:
        with client.trace(PROMPT, max_tokens=tokens, ignore_eos=True):
            client.layers[victim.layer].output.save()

    capture = {"capture": {"sites": ["layers.3.output"], "positions": "last_prompt"}}
    running = [
        in_thread(lambda: complete(server, timeout=120.0, tokens=tokens)),
        in_thread(lambda: complete(server, timeout=120.0, tokens=tokens, vinterp=capture)),
        in_thread(streamed),
        in_thread(traced),
    ]
    assert wait_for(lambda: held(server)["requests"] >= 4, 10.0)
    os.kill(process_of(server, victim.process).pid, signal.SIGKILL)
    killed = time.monotonic()
    for thread, _ in running:
        thread.join(60)
    for _, outcome in running:
        assert "ended" in outcome and outcome["ended"] - killed < 30.0
        # an error, or a stream cut short of its tokens
        assert "error" in outcome or outcome["result"] < tokens, outcome
    assert psutil.Process(server.pid).wait(timeout=90) != 0
    assert "the engine died while serving" in server.log_tail()
