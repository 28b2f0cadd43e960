"""`vinterp serve` under faults and over its limits (API.md section 6): a client that leaves a
captured completion or a trace frees what the workers held for it and aborts its generation;
a body trickled in past `--max-body-seconds` gets a 408; a body declared over `--max-body-mb`
a 413 on any route, before it is sent; a trace over the node, invoke or token limit a 400, one
beyond the key's running traces a 429, each naming its flag, and the server serves on; an
engine core killed mid-step ends every in-flight request within seconds and the server exits
non-zero, and so does one of two tensor-parallel workers killed. Each on a real server of its
own."""

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
from vinterp.wire.graph import to_wire
from vinterp.wire.json_form import payload_to_json

pytestmark = pytest.mark.engine("serve_faults", releases=True)

PROMPT = "The capital of France is"
LONG = 1500  # tokens: far longer than any test waits (about 30 ms each here)
BODY_SECONDS = 3
NODES, INVOKES, TOKENS = 8, 2, LONG  # per trace: small, and enough for the faults' traces
TRACES_PER_KEY = 1


@pytest.fixture(scope="module")
def server(engines) -> Iterator[Server]:
    engines.release()  # one engine at a time on this machine
    limits = {
        "--max-body-seconds": BODY_SECONDS,
        "--max-trace-nodes": NODES,
        "--max-trace-invokes": INVOKES,
        "--max-trace-tokens": TOKENS,
        "--max-traces-per-key": TRACES_PER_KEY,
    }
    with served(*(str(part) for item in limits.items() for part in item)) as running:
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


def half_sent(
    server: Server, path: str, declared: int, body: bytes, flag: str
) -> tuple[str, float]:
    """The server's answer to a POST whose head declares `declared` bytes of body of which
    only `body` is sent, read until it names `flag`; and the seconds it took."""
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=BODY_SECONDS + 20) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + body)  # and never the rest of the body
        answer = b""
        while flag.encode() not in answer and (part := sock.recv(4096)):
            answer += part
    return answer.decode(errors="replace"), time.monotonic() - started


@pytest.mark.parametrize("path", ["/v1/vinterp/trace", "/v1/completions"])
def test_a_body_trickled_in_gets_a_408_and_the_server_serves_on(server, path) -> None:
    answer, seconds = half_sent(server, path, 1000, b"{", "--max-body-seconds")
    assert answer.startswith("HTTP/1.1 408") and "--max-body-seconds" in answer, answer[:300]
    assert seconds < BODY_SECONDS + 10
    assert not any(settled(server).values())


@pytest.mark.parametrize("path", ["/tokenize", "/v1/responses"])
def test_a_body_declared_over_the_limit_gets_a_413_on_any_route_at_once(server, path) -> None:
    """1 GiB declared, over the default 256 MiB, and none of it sent: refused from the head
    (vLLM's own routes would wait for the body)."""
    answer, seconds = half_sent(server, path, 1 << 30, b"", "--max-body-mb")
    assert answer.startswith("HTTP/1.1 413") and "--max-body-mb" in answer, answer[:300]
    assert seconds < 5.0
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"], r.text  # serves on


class Recorded(Exception):
    """Ends a trace's body: the client records the trace and does not run it."""


@pytest.fixture(scope="module")
def client(server) -> Iterator[vinterp.Client]:
    with vinterp.Client(server.url, api_key=KEY) as c:
        yield c


def trace_body(client: vinterp.Client, invokes: int = 1, reads: int = 1, **sampling: Any) -> dict:
    """The body of `POST /v1/vinterp/trace` for `invokes` prompts, each reading and saving
    the output of `reads` layers (a node each)."""
    with pytest.raises(Recorded):
        with client.trace(use_tqdm=False, **{"max_tokens": 1, **sampling}) as tr:
            for _ in range(invokes):
                with tr.invoke(PROMPT):
                    for layer in range(reads):
                        client.layers[layer].output.save()
            raise Recorded
    return {"graph": payload_to_json(to_wire(tr.graph))}


def post_trace(server: Server, body: dict, timeout: float = 60.0) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(server.url + "/v1/vinterp/trace", json=body, headers=headers, timeout=timeout)


OVER = {
    "--max-trace-nodes": {"reads": NODES + 1},
    "--max-trace-invokes": {"invokes": INVOKES + 1},
    "--max-trace-tokens": {"max_tokens": TOKENS + 1},
}


@pytest.mark.parametrize("flag", OVER)
def test_a_trace_over_a_limit_gets_a_400_naming_its_flag(server, client, flag) -> None:
    r = post_trace(server, trace_body(client, **OVER[flag]))
    assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
    r = post_trace(server, trace_body(client))
    assert r.status_code == 200 and r.json()["failure"] is None, r.text  # serves on


def test_a_trace_beyond_the_keys_running_traces_gets_a_429_at_once(server, client) -> None:
    long = trace_body(client, max_tokens=LONG, ignore_eos=True)
    thread, outcome = in_thread(lambda: post_trace(server, long, timeout=6.0))
    assert wait_for(lambda: held(server)["traces"] == TRACES_PER_KEY, 4.0)
    started = time.monotonic()
    r = post_trace(server, trace_body(client))
    assert r.status_code == 429 and "--max-traces-per-key" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < 5.0  # refused, not queued behind the running trace
    thread.join(30)
    assert "error" in outcome  # its client left: the running trace was aborted
    # the key's slot comes back
    assert wait_for(lambda: post_trace(server, trace_body(client)).status_code == 200, 15.0)


def process_of(server: Server, marker: str) -> psutil.Process:
    """The server's child process whose name or command line holds `marker`."""
    children = psutil.Process(server.pid).children(recursive=True)
    for child in children:
        if marker in child.name() or marker in " ".join(child.cmdline()):
            return child
    names = [child.name() for child in children]
    # vLLM titles its processes, except with VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR set:
    # its engine core and workers then run as "python" (vLLM 0.32 CPU)
    raise AssertionError(f"no {marker} process under the server: {names}")


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
