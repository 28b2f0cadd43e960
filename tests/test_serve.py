"""`vinterp serve` (API.md section 6): steering and capture through the official `openai`
client on vLLM's own server, the same numbers as `vinterp.LLM`, keys, and clear 400s."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from openai import OpenAI

import vinterp

KEY = "test-key"
PROMPT = "The capital of France is"
SAMPLING = {"max_tokens": 8, "temperature": 0.0}
STEERING = vinterp.Steering(
    {"layers.10.output": torch.randn(576, generator=torch.Generator().manual_seed(7))}, scale=8.0
)
CAPTURE = vinterp.Capture(["layers.*.output", "embed.output"], positions="all_prompt")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def reference(engines) -> dict:
    """vinterp.LLM's results for the same requests, before the server takes the machine."""
    llm = engines.vllm(None)
    plain = llm.generate(PROMPT, use_tqdm=False, **SAMPLING)[0]
    steered = llm.generate(PROMPT, steering=STEERING, capture=CAPTURE, use_tqdm=False, **SAMPLING)
    engines.release()  # one engine at a time on this machine
    return {"plain": plain.text, "steered": steered[0].text, "captures": steered[0].captures}


@pytest.fixture(scope="module")
def server(reference) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    command = [sys.executable, "-m", "vinterp.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen([*command, "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError("server did not start:\n" + log.read().decode()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def complete(server: str, **extra) -> object:
    oai = OpenAI(base_url=server + "/v1", api_key=KEY)
    model = oai.models.list().data[0].id
    return oai.completions.create(model=model, prompt=PROMPT, **SAMPLING, **extra)


def test_openai_client_steers_and_captures_like_llm(server, reference) -> None:
    plain = complete(server)
    assert plain.choices[0].text == reference["plain"]
    r = complete(
        server,
        extra_body={"vinterp": {"steering": STEERING.to_json(), "capture": CAPTURE.to_json()}},
    )
    assert r.choices[0].text == reference["steered"] != reference["plain"]
    captures = vinterp.captures_from_json(r.model_extra["vinterp"]["captures"])
    want = reference["captures"]
    assert list(captures) == list(want)
    for site, value in want.items():
        assert captures[site].shape == value.shape, site
        assert rel_err(captures[site], value) < 1e-5, site
    assert complete(server).choices[0].text == reference["plain"]  # nothing left behind


def test_keys_are_required_except_for_health(server) -> None:
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.post(server + "/v1/completions", json=body, headers=headers).status_code == 401
        assert httpx.get(server + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize(
    "field, message",
    [
        ({"steering": {"vectors": {"layers.99.output": [1.0]}}}, "a tensor is"),
        ({"steering": {"vectors": {"layers.1.output": {"data": "AAAA", "dtype": "int8"}}}}, ""),
        ({"steering": vinterp.Steering({"layers.99.output": torch.ones(576)}).to_json()}, "range"),
        ({"steering": vinterp.Steering({"layers.1.output": torch.ones(3)}).to_json()}, "hidden"),
        ({"capture": {"sites": ["layers.99.output"]}}, "out of range"),
        (
            {"capture": {"sites": ["layers.1.output"], "sink": "filesystem", "path": "/etc"}},
            "memory",
        ),
        ({"bogus": 1}, "expected"),
        ("not an object", "expected"),
    ],
)
def test_bad_vinterp_fields_get_a_400_and_the_server_serves_on(server, field, message) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(server + "/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "vinterp": field}
    r = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    body.pop("vinterp")
    assert httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60).is_success
