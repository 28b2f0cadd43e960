"""`vinterp serve` (API.md section 6): steering and capture through the official `openai`
client on vLLM's own server, the same numbers as `vinterp.LLM`, keys, and clear 400s."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch
from openai import OpenAI
from served import KEY, served

import vinterp

pytestmark = pytest.mark.engine("bundled", releases=True)

PROMPT = "The capital of France is"
SAMPLING = {"max_tokens": 8, "temperature": 0.0}
STEERING = vinterp.Steering(
    {"layers.10.output": torch.randn(576, generator=torch.Generator().manual_seed(7))}, scale=8.0
)
CAPTURE = vinterp.Capture(["layers.*.output", "embed.output"], positions="all_prompt")
# 16 clients at once, each with its own steering; the row captured after it tells them apart
DISTINCT = [
    vinterp.Steering(
        {"layers.10.output": torch.randn(576, generator=torch.Generator().manual_seed(100 + k))},
        scale=8.0,
    )
    for k in range(16)
]
AFTER = vinterp.Capture(["layers.20.output"], positions="last_prompt")
# the bundled model's induction heads (examples/induction_heads.py)
PATTERNS = vinterp.Capture(["layers.17.attn.pattern", "layers.18.attn.pattern"], heads=[6, 3])
# a probe, and a steering it gates (API.md section 5, "Probes")
PROBE = vinterp.Probe(
    "layers.8.output",
    torch.randn(2, 576, generator=torch.Generator().manual_seed(8)) / 24,
    name="p",
)
GATED = vinterp.Steering(STEERING.vectors, scale=8.0, when=vinterp.When(probe="p", above=0.0))
STEP_TOKENS = 1024  # the server's max_num_batched_tokens
BODY_MB = 1  # the server's --max-body-mb


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def traces(model) -> dict:
    """The same traces on `vinterp.LLM` and `vinterp.Client` (API.md section 6): the logit
    lens, patching across two invokes, and `tr.iter` over 4 steps with a write."""
    with model.trace(PROMPT, max_tokens=1, use_tqdm=False):
        lens = [model.unembed(model.layers[i].output[-1]).save() for i in (5, 15, 29)]
        logits = model.logits.save()
    with model.trace(max_tokens=1, use_tqdm=False) as tr:
        with tr.invoke("The capital of France is"):
            clean = model.layers[12].output[-1].save()
        with tr.invoke("The capital of Italy is"):
            model.layers[12].output[-1] = clean
            patched = model.logits.save()
    with model.trace(PROMPT, max_tokens=4, use_tqdm=False) as tr:
        for _ in tr.iter[:]:
            model.layers[10].output = model.layers[10].output + STEERING.vectors["layers.10.output"]
            samples = model.samples.save()
            norms = model.layers[20].output.norm(dim=-1).save()
    return {
        "lens": lens,
        "logits": logits,
        "clean": clean,
        "patched": patched,
        "samples": samples,
        "norms": norms,
        "text": tr.outputs[0].text,
    }


@pytest.fixture(scope="module")
def reference(engines) -> dict:
    """vinterp.LLM's results for the same requests, before the server takes the machine."""
    llm = engines.vllm(None)
    plain = llm.generate(PROMPT, use_tqdm=False, **SAMPLING)[0]
    steered = llm.generate(PROMPT, steering=STEERING, capture=CAPTURE, use_tqdm=False, **SAMPLING)
    traced = traces(llm)
    distinct = llm.generate(
        [vinterp.Request(PROMPT, steering=st) for st in DISTINCT],
        capture=AFTER,
        use_tqdm=False,
        **SAMPLING,
    )
    patterns = llm.generate(PROMPT, capture=PATTERNS, use_tqdm=False, **SAMPLING)
    probed = llm.generate(PROMPT, probes=[PROBE], steering=GATED, use_tqdm=False, **SAMPLING)
    engines.release()  # one engine at a time on this machine
    return {
        "plain": plain.text,
        "steered": steered[0].text,
        "captures": steered[0].captures,
        "patterns": patterns[0].captures,
        "traces": traced,
        "distinct": distinct,
        "probed": probed[0],
    }


@pytest.fixture(scope="module")
def server(reference) -> Iterator[str]:
    # a step a trace can outgrow; with the applied check, every steered or captured answer
    # below has passed it
    flags = (f"--max-num-batched-tokens={STEP_TOKENS}", "--max-body-mb", str(BODY_MB))
    with served(*flags, env={"VINTERP_CHECK_APPLIED": "1"}) as running:
        yield running.url


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


def test_attention_pattern_captures_come_back_like_llms(server, reference) -> None:
    r = complete(server, extra_body={"vinterp": {"capture": PATTERNS.to_json()}})
    captures = vinterp.captures_from_json(r.model_extra["vinterp"]["captures"])
    assert list(captures) == list(reference["patterns"])
    for site, value in reference["patterns"].items():
        assert captures[site].shape == value.shape == (1, 2, value.shape[-1]), site
        assert rel_err(captures[site], value) < 1e-5, site


def test_probes_and_gated_steering_come_back_like_llms(server, reference) -> None:
    field = {"steering": GATED.to_json(), "probes": [PROBE.to_json()]}
    r = complete(server, extra_body={"vinterp": field})
    want = reference["probed"]
    assert r.choices[0].text == want.text
    scores = vinterp.captures_from_json(r.model_extra["vinterp"]["probes"])
    assert scores["p"].shape == want.probes["p"].shape == (len(want.prompt_token_ids) + 7, 2)
    assert rel_err(scores["p"], want.probes["p"]) < 1e-5
    with vinterp.Client(server, api_key=KEY) as client:
        (out,) = client.generate(PROMPT, probes=[PROBE], steering=GATED, **SAMPLING)
    assert out.text == want.text and rel_err(out.probes["p"], want.probes["p"]) < 1e-5


@pytest.mark.parametrize("forged", [{"trace": ["0" * 32, 0]}, "{}"])
def test_vinterps_own_extra_args_cannot_be_sent_raw(server, reference, forged) -> None:
    """The workers trust this extra arg (vinterp writes it after its checks): a client's
    vllm_xargs carrying it would skip the checks or join another client's trace."""
    headers = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(server + "/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "vllm_xargs": {"vinterp": forged}}
    r = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"], r.text
    assert complete(server).choices[0].text == reference["plain"]  # and it serves on


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
        ({"capture": {"sites": ["layers.1.attn.pattern"], "heads": [9]}}, "has 9 heads"),
        (
            {"capture": {"sites": ["layers.1.attn.pattern"], "positions": "all"}},
            "positions='last_prompt' only",
        ),
        (
            {"capture": {"sites": ["layers.1.output"], "sink": "filesystem", "path": "/etc"}},
            "memory",
        ),
        ({"probes": [vinterp.Probe("layers.1.output", torch.ones(3)).to_json()]}, "hidden size"),
        (
            {
                "steering": GATED.to_json(),
                "probes": [vinterp.Probe("layers.12.output", torch.ones(576), name="p").to_json()],
            },
            "at or before",
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


@pytest.fixture(scope="module")
def client(server) -> Iterator[vinterp.Client]:
    with vinterp.Client(server, api_key=KEY) as c:
        yield c


def test_client_traces_equal_llm_traces(client, reference) -> None:
    assert len(client.layers) == 30 and client.config.hidden_size == 576
    got, want = traces(client), reference["traces"]
    assert got["text"] == want["text"]
    assert got["samples"] == want["samples"] and len(got["samples"]) == 4
    for name in ("lens", "logits", "clean", "patched", "norms"):
        pairs = (
            zip(got[name], want[name])
            if isinstance(want[name], list)
            else [(got[name], want[name])]
        )
        for g, w in pairs:
            assert g.shape == w.shape, name
            assert rel_err(g.float(), w.float()) < 1e-5, name
    assert not torch.equal(got["patched"], got["logits"])  # the patch changed something


def test_client_generate_and_steering_equal_llm(client, server, reference) -> None:
    (plain,) = client.generate(PROMPT, use_tqdm=False, **SAMPLING)
    assert plain.text == reference["plain"] and len(plain.token_ids) == 8
    (steered,) = client.generate(
        PROMPT, steering=STEERING, capture=CAPTURE, use_tqdm=False, **SAMPLING
    )
    assert steered.text == reference["steered"]
    for site, value in reference["captures"].items():
        assert rel_err(steered.captures[site], value) < 1e-5, site
    client.steering.set(STEERING)  # global: every later request, from any client
    assert complete(server).choices[0].text == reference["steered"]
    client.steering.clear()
    assert client.generate(PROMPT, use_tqdm=False, **SAMPLING)[0].text == reference["plain"]
    client.steering.register("tenfold", STEERING)  # named: usable by name from the openai client
    r = complete(server, extra_body={"vinterp": {"steering": "tenfold"}})
    assert r.choices[0].text == reference["steered"]
    assert (
        client.generate(PROMPT, steering="tenfold", use_tqdm=False, **SAMPLING)[0].text
        == (reference["steered"])
    )
    client.steering.unregister("tenfold")
    with pytest.raises(ValueError, match="no steering named 'tenfold'"):
        client.generate(PROMPT, steering="tenfold", use_tqdm=False)


def test_sixteen_concurrent_clients_each_get_their_own_results(server, reference) -> None:
    async def one(k: int) -> vinterp.Output:
        async with vinterp.AsyncClient(server, api_key=KEY) as client:
            (out,) = await client.generate(PROMPT, steering=DISTINCT[k], capture=AFTER, **SAMPLING)
        return out

    async def main() -> list[vinterp.Output]:
        return await asyncio.gather(*(one(k) for k in range(16)))

    got, want = asyncio.run(main()), reference["distinct"]
    site = "layers.20.output"
    for k, out in enumerate(got):
        assert out.text == want[k].text, k
        errors = [rel_err(out.captures[site], w.captures[site]) for w in want]
        assert errors[k] < 1e-5, k
        assert min(e for j, e in enumerate(errors) if j != k) > 1e-2, k  # not another's row
    assert len({out.text for out in got}) > 1


def test_async_client_traces_and_steers_like_llm(server, reference) -> None:
    async def main():
        async with vinterp.AsyncClient(server, api_key=KEY) as client:
            async with client.trace(PROMPT, max_tokens=1, use_tqdm=False):
                lens = [client.unembed(client.layers[i].output[-1]).save() for i in (5, 15, 29)]
            await client.steering.register("async-push", STEERING)
            named = await client.steering.names()
            (steered,) = await client.generate(PROMPT, steering="async-push", **SAMPLING)
            await client.steering.unregister("async-push")
            return lens, named, steered.text, await client.steering.names()

    lens, named, steered, after = asyncio.run(main())
    for got, want in zip(lens, reference["traces"]["lens"]):
        assert rel_err(got.float(), want.float()) < 1e-5
    assert "async-push" in named and "async-push" not in after
    assert steered == reference["steered"]


def test_vinterp_routes_need_the_key(server) -> None:
    routes = [
        ("GET", "/v1/vinterp/sites"),
        ("GET", "/v1/vinterp/stats"),
        ("GET", "/v1/vinterp/held"),
        ("GET", "/v1/vinterp/steering"),
        ("PUT", "/v1/vinterp/steering"),
        ("DELETE", "/v1/vinterp/steering"),
        ("POST", "/v1/vinterp/trace"),
    ]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, server + path, json={}, headers=headers)
            assert r.status_code == 401, (method, path)


def _graph(client) -> dict:
    """The wire form (JSON) of a small valid trace, to mutate."""
    from vinterp.wire.graph import to_wire
    from vinterp.wire.json_form import payload_to_json

    captured = {}

    def record(graph, plan, use_tqdm=True):
        captured["graph"] = payload_to_json(to_wire(graph))
        raise RuntimeError("recorded")

    client.backend.run_trace = record  # this instance only: the graph, not a run
    try:
        with pytest.raises(RuntimeError, match="recorded"):
            with client.trace(PROMPT, max_tokens=1, use_tqdm=False):
                client.layers[3].output.norm().save()
    finally:
        del client.backend.run_trace
    return captured["graph"]


def _mutations(graph: dict) -> list[tuple[str, object]]:
    import copy

    def edited(fn) -> dict:
        g = copy.deepcopy(graph)
        fn(g)
        return {"graph": g}

    def set_node(index: int, slot: int, value) -> object:
        return lambda g: g["nodes"][index].__setitem__(slot, value)

    read = next(i for i, n in enumerate(graph["nodes"]) if n[0] == "read")
    call = next(i for i, n in enumerate(graph["nodes"]) if n[0] not in ("read", "save", "const"))
    big = {"dtype": "float32", "shape": [1 << 29], "data": {"__b64__": ""}}
    return [
        ("unknown op", edited(set_node(call, 1, "os.system"))),
        ("out-of-range layer", edited(set_node(read, 1, "layers.99.output"))),
        (
            "bad dtype",
            edited(
                lambda g: g["tensors"].append(
                    {"dtype": "complex", "shape": [1], "data": {"__b64__": ""}}
                )
            ),
        ),
        ("2 GB constant", edited(lambda g: g["tensors"].append(big))),
        ("10^6 nodes", edited(lambda g: g["nodes"].extend([g["nodes"][0]] * 1_000_000))),
        ("reference forward", edited(set_node(call, 2, [{"ref": 10**6}]))),
        (
            "bad base64",
            edited(
                lambda g: g["tensors"].append(
                    {"dtype": "float32", "shape": [1], "data": {"__b64__": "%%%"}}
                )
            ),
        ),
        ("wrong version", edited(lambda g: g.__setitem__("version", 99))),
        ("no invokes", edited(lambda g: g.__setitem__("invokes", []))),
        ("bad prompt", edited(lambda g: g["invokes"][0].__setitem__("prompt", ["a"]))),
        (
            "too many tokens",
            edited(lambda g: g["invokes"][0]["sampling"].__setitem__("max_tokens", 10**6)),
        ),
        ("nodes not a list", edited(lambda g: g.__setitem__("nodes", "x"))),
        ("not a graph", {"graph": 5}),
        ("no graph", {"nodes": []}),
        ("extra keys", {"graph": graph, "code": "print(1)"}),
        ("a list", [1, 2]),
    ]


def test_malformed_traces_get_a_400_and_the_server_serves_on(client, server, reference) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server + "/v1/vinterp/trace"
    graph = _graph(client)
    cases = _mutations(graph)
    raw = [("not JSON", b"{graph: nope"), ("truncated body", b'{"graph": {"version": 1, "nod')]
    for name, body in cases + raw:
        if isinstance(body, bytes):
            r = httpx.post(url, content=body, headers=headers, timeout=120)
        else:
            r = httpx.post(url, json=body, headers=headers, timeout=120)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        assert r.json()["error"]["message"], name
    assert len(cases) + len(raw) >= 18
    r = httpx.post(url, json={"graph": graph}, headers=headers, timeout=120)
    assert r.status_code == 200 and r.json()["failure"] is None
    assert traces(client)["samples"] == reference["traces"]["samples"]  # serves on


def test_bodies_over_the_limit_get_a_413_and_the_server_serves_on(server, client) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"x" * (BODY_MB << 20) + b'"}'
    for path in ("/v1/vinterp/trace", "/v1/completions", "/v1/vinterp/steering"):
        send = httpx.put if path.endswith("steering") else httpx.post
        r = send(server + path, content=big, headers=headers, timeout=120)
        assert r.status_code == 413, (path, r.status_code, r.text[:300])
        assert "--max-body-mb" in r.json()["error"]["message"], path
    assert traces(client)["samples"]  # serves on


def test_out_of_order_trace_is_refused_with_its_cause(client) -> None:
    with pytest.raises(vinterp.OutOfOrderError):
        with client.trace(PROMPT, max_tokens=1, use_tqdm=False):
            late = client.layers[20].output
            client.layers[3].output = late


def test_a_traced_prompt_longer_than_a_step_runs_in_chunks(client) -> None:
    """More prompt tokens than the server's step computes: the trace runs over the chunks,
    its saves equal the fast path's capture of the same prompt."""
    long = " ".join(["Paris"] * (STEP_TOKENS + 100))
    site = "layers.5.output"
    with client.trace(long, max_tokens=1, use_tqdm=False):
        last = client.layers[5].output[-1].save()
        mean = client.layers[5].output.mean(0).save()
    capture = vinterp.Capture(site, positions="all_prompt")
    rows = client.generate(long, max_tokens=1, capture=capture, use_tqdm=False)[0].captures[site]
    assert rows.shape[0] > STEP_TOKENS
    assert rel_err(last.float(), rows[-1].float()) < 1e-5
    assert rel_err(mean.float(), rows.float().mean(0)) < 1e-3
