"""The requests of the serve load bench (`serve_load`): a pool of distinct requests of every
kind the load mixes, how one client sends each over HTTP, and how an answer is judged against
the reference (the answer the same request got when it ran alone on the same server).

Every request is greedy (temperature 0), so a correct answer is the reference's text exactly;
each steered request has a steering vector of its own, so an answer that took another
request's steering, or an unsteered one that took any, shows in its text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx
import torch
from openai import OpenAI

import vinterp

PROMPTS = (
    "The capital of France is",
    "Once upon a time, a little robot",
    "The three primary colors are",
    "To bake bread, you first",
    "The largest planet in the solar system is",
    "In 1969, the first person to walk on the moon",
    "A good way to learn a new language is",
    "The chemical symbol for gold is",
)
MAX_TOKENS = 16
# The requests whose clients leave: long enough to be cut off mid-way (a trace's steps run
# uncompiled, so fewer tokens do)
LONG_TOKENS = 64
LONG_TRACE_TOKENS = 8
# A traced prompt long enough that a busy server computes it over several steps (chunked
# prefill beside the other clients' tokens): each prompt repeated this many times.
LONG_PROMPT_REPEATS = 200
DISCONNECT_AFTER_S = 0.25  # their client's read timeout
SCALE = 8.0  # steering strength: enough to change every prompt's greedy answer
# Captures and trace saves: the largest relative error (norm of the difference over the
# reference's norm) that counts as equal. Batched with other requests, a row is computed in
# other matmul shapes than alone, so float32 sums may round differently: the 10-minute CPU
# run measured at most 1.9e-7 (docs/BENCH.md); rows of another request's steering differ by
# more than 1e-2 (tests/test_serve.py, 16 distinct steerings).
TOLERANCE = 1e-4

# Kinds of request. Unsteered ones must give the plain answers (no steering leaks into them).
UNSTEERED = ("plain", "stream", "capture_last")
STEERED = ("steered", "named", "capture_all", "trace", "long_trace")
JUDGED = UNSTEERED + STEERED  # answers compared with the reference
KINDS = (*JUDGED, "malformed", "disconnect")
# How often a client picks each kind, relative to the others.
WEIGHTS = {
    "plain": 2.0,
    "stream": 2.0,
    "steered": 2.0,
    "named": 1.0,
    "capture_last": 1.0,
    "capture_all": 1.0,
    "trace": 1.0,
    "long_trace": 0.5,
    "malformed": 0.5,
    "disconnect": 0.5,
}
# Requests that carry steering, a capture or a trace (the memory check counts them).
INTERVENED = (*STEERED, "capture_last", "disconnect")
# The kinds plain `vllm serve` answers too: the comparison row's.
COMPARED = ("plain", "stream")
# How a client disconnects: after a streamed answer's first chunk; a captured and steered
# completion cut off by the read timeout; a trace cut off the same way.
DISCONNECTS = ("stream", "capture", "trace")
OK, WRONG, LEAKED, LOST, ERROR = "ok", "wrong", "leaked", "lost", "error"


class Unexpected(RuntimeError):
    """An answer of the wrong form: an unexpected status, a missing field."""


@dataclass(frozen=True)
class Entry:
    """One distinct request of the pool: its kind and its index among that kind's."""

    kind: str
    index: int


@dataclass(frozen=True)
class Answer:
    """What a request got: the text (a trace's: its outputs' texts) and its tensors
    (captures by site, or a trace's saves by name)."""

    text: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Pool:
    """The distinct requests, built for the served model (its layers and hidden size)."""

    model: str
    layers: int
    hidden: int
    prompts: tuple[str, ...] = PROMPTS

    def entries(self, kinds: tuple[str, ...] = KINDS) -> list[Entry]:
        counts = {"malformed": len(malformed_bodies(self)), "disconnect": len(DISCONNECTS)}
        return [Entry(k, i) for k in kinds for i in range(counts.get(k, len(self.prompts)))]

    @property
    def steered_site(self) -> str:
        return f"layers.{self.layers // 3}.output"

    @property
    def later_site(self) -> str:
        """A site after the steered one: its rows show which steering a request got."""
        return f"layers.{2 * self.layers // 3}.output"

    def steering(self, kind: str, index: int) -> vinterp.Steering:
        """A vector of its own for each steered request (seeded by kind and index)."""
        seed = 1000 * KINDS.index(kind) + index
        vector = torch.randn(self.hidden, generator=torch.Generator().manual_seed(seed))
        return vinterp.Steering({self.steered_site: vector}, scale=SCALE)

    @staticmethod
    def steering_name(index: int) -> str:
        return f"serve-load-{index}"

    def capture(self, kind: str) -> vinterp.Capture:
        if kind == "capture_last":
            return vinterp.Capture("layers.*.output", positions="last_prompt")
        return vinterp.Capture(["embed.output", self.later_site], positions="all")


class Session:
    """One client's connections: the `openai` client, httpx, and `vinterp.Client`s (made on
    first use: plain vLLM has no vinterp routes)."""

    def __init__(self, url: str, api_key: str, pool: Pool) -> None:
        self.url, self.api_key, self.pool = url, api_key, pool
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.http = httpx.Client(base_url=url, headers=self.headers, timeout=600)
        self.openai = OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=600)

    @cached_property
    def client(self) -> vinterp.Client:
        return vinterp.Client(self.url, api_key=self.api_key)

    @cached_property
    def hasty_client(self) -> vinterp.Client:
        """A `vinterp.Client` that gives up on an answer after DISCONNECT_AFTER_S."""
        client = vinterp.Client(self.url, api_key=self.api_key)
        client.http.timeout = httpx.Timeout(DISCONNECT_AFTER_S)
        return client

    def connect_vinterp(self) -> None:
        """Open the `vinterp.Client`s now (each asks the server for its sites)."""
        self.client, self.hasty_client

    def close(self) -> None:
        self.http.close()
        self.openai.close()
        for name in ("client", "hasty_client"):
            if name in self.__dict__:
                self.__dict__[name].close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send(session: Session, entry: Entry) -> Answer:
    """Send one request of the pool and return its answer (raises Unexpected, or the
    client's error, on an answer of the wrong form)."""
    return SENDERS[entry.kind](session, entry)


def _vinterp_field(pool: Pool, entry: Entry) -> dict[str, Any]:
    kind, index = entry.kind, entry.index
    field: dict[str, Any] = {}
    if kind in ("steered", "capture_all", "disconnect"):
        field["steering"] = pool.steering(kind, index).to_json()
    if kind == "named":
        field["steering"] = pool.steering_name(index)
    if kind in ("capture_last", "capture_all", "disconnect"):
        field["capture"] = pool.capture("capture_all" if kind == "disconnect" else kind).to_json()
    return field


def _completion(session: Session, entry: Entry) -> Answer:
    field = _vinterp_field(session.pool, entry)
    r = session.openai.completions.create(
        model=session.pool.model,
        prompt=session.pool.prompts[entry.index],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"vinterp": field} if field else None,
    )
    text = r.choices[0].text
    if "capture" not in field:
        return Answer(text)
    extra = (r.model_extra or {}).get("vinterp") or {}
    return Answer(text, vinterp.captures_from_json(extra.get("captures", {})))


def _stream(session: Session, entry: Entry) -> Answer:
    stream = session.openai.completions.create(
        model=session.pool.model,
        prompt=session.pool.prompts[entry.index],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    return Answer("".join(chunk.choices[0].text for chunk in stream if chunk.choices))


def patching_trace(client: Any, prompts: list[Any], layer: int, max_tokens: int) -> Answer:
    """Patching across invokes: the first prompt's last row at `layer` written into the
    second's; the clean row, the first prompt's attention pattern row at its last token (its
    keys kept over every step), the patched logits and both outputs come back."""
    with client.trace(max_tokens=max_tokens, use_tqdm=False) as tr:
        with tr.invoke(prompts[0]):
            clean = client.layers[layer].output[-1].save()
            pattern = client.layers[layer].attn.pattern[:, -1].save()
        with tr.invoke(prompts[1]):
            client.layers[layer].output[-1] = clean
            patched = client.logits.save()
    text = "\x00".join(out.text for out in tr.outputs)
    return Answer(text, {"clean": clean, "pattern": pattern, "patched": patched})


def _trace(session: Session, entry: Entry) -> Answer:
    prompts = session.pool.prompts
    pair = [prompts[entry.index], prompts[(entry.index + 1) % len(prompts)]]
    return patching_trace(session.client, pair, session.pool.layers // 2, 1)


def _long_trace(session: Session, entry: Entry) -> Answer:
    prompts = session.pool.prompts
    pair = [prompts[entry.index], prompts[(entry.index + 1) % len(prompts)]]
    long = [" ".join([p] * LONG_PROMPT_REPEATS) for p in pair]
    return patching_trace(session.client, long, session.pool.layers // 2, 1)


def malformed_bodies(pool: Pool) -> list[tuple[str, str, Any]]:
    """(method, path, body) of requests that must get a 400 with an error message: bytes
    are sent as they are, anything else as JSON."""
    base = {"model": pool.model, "prompt": pool.prompts[0], "max_tokens": 1}
    capture = pool.capture("capture_last").to_json()
    return [
        ("POST", "/v1/completions", b'{"model": "x", "prompt": '),
        ("POST", "/v1/completions", {**base, "max_tokens": "many"}),
        ("POST", "/v1/completions", {**base, "vinterp": {"steering": {"vectors": {"x": 1}}}}),
        ("POST", "/v1/completions", {**base, "stream": True, "vinterp": {"capture": capture}}),
        ("POST", "/v1/completions", {**base, "vllm_xargs": {"vinterp": "{}"}}),
        ("POST", "/v1/vinterp/trace", b"{graph: nope"),
        ("POST", "/v1/vinterp/trace", {"graph": 5}),
        ("PUT", "/v1/vinterp/steering", {"bogus": 1}),
    ]


def _malformed(session: Session, entry: Entry) -> Answer:
    method, path, body = malformed_bodies(session.pool)[entry.index]
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = session.http.request(method, path, **sent)
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    if r.status_code != 400 or not message:
        raise Unexpected(f"{method} {path} {body!r:.60}: HTTP {r.status_code} {r.text[:200]}")
    return Answer("")


def _disconnect(session: Session, entry: Entry) -> Answer:
    """Close the connection mid-request; the answer says whether it was cut off
    ("disconnected") or came before the timeout ("finished")."""
    pool, way = session.pool, DISCONNECTS[entry.index]
    prompt = pool.prompts[entry.index % len(pool.prompts)]
    if way == "stream":
        stream = session.openai.completions.create(
            model=pool.model, prompt=prompt, max_tokens=LONG_TOKENS, temperature=0.0, stream=True
        )
        with stream:
            next(iter(stream))
        return Answer("disconnected")
    try:
        if way == "capture":
            body = {
                "model": pool.model,
                "prompt": prompt,
                "max_tokens": LONG_TOKENS,
                "temperature": 0.0,
                "vinterp": _vinterp_field(pool, entry),
            }
            r = session.http.post("/v1/completions", json=body, timeout=DISCONNECT_AFTER_S)
            if r.status_code != 200:
                raise Unexpected(f"disconnecting completion: HTTP {r.status_code} {r.text[:200]}")
        else:  # token ids: the hasty client would give up on tokenizing text
            ids = [session.client.encode(p) for p in pool.prompts[:2]]
            patching_trace(session.hasty_client, ids, pool.layers // 2, LONG_TRACE_TOKENS)
    except httpx.TimeoutException:
        return Answer("disconnected")
    return Answer("finished")


SENDERS: dict[str, Callable[[Session, Entry], Answer]] = {
    "plain": _completion,
    "stream": _stream,
    "steered": _completion,
    "named": _completion,
    "capture_last": _completion,
    "capture_all": _completion,
    "trace": _trace,
    "long_trace": _long_trace,
    "malformed": _malformed,
    "disconnect": _disconnect,
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def judge(kind: str, got: Answer, want: Answer) -> tuple[str, float]:
    """The verdict on an answer against the reference, and its largest relative error:
    LOST when a capture or save is missing or of another shape, LEAKED when an unsteered
    request's answer differs, WRONG when a steered one's does."""
    if set(got.tensors) != set(want.tensors) or any(
        got.tensors[k].shape != want.tensors[k].shape for k in want.tensors
    ):
        return LOST, float("inf")
    error = max((relative_error(got.tensors[k], v) for k, v in want.tensors.items()), default=0.0)
    if got.text == want.text and error <= TOLERANCE:
        return OK, error
    return (LEAKED if kind in UNSTEERED else WRONG), error
