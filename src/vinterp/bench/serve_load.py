"""`vinterp bench --workloads serve_load`: `vinterp serve` under many concurrent clients.

The server answers every distinct request of the pool (`load_mix`) once, one at a time: the
reference. Then `clients` threads send requests picked at random from the whole mix for
`seconds`, each answer judged against the reference, while the memory of the server's
process tree is sampled. Last, the plain and streaming completions alone, for
`compare_seconds` on the same server and then on plain `vllm serve` (same model and flags,
the same clients): the comparison row. One server is alive at a time."""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import vinterp
from vinterp.bench import load_mix, served
from vinterp.bench.harness import REFERENCE, Row, Timing, device_kind
from vinterp.bench.load_mix import COMPARED, ERROR, OK, Answer, Entry, Pool, Session
from vinterp.bench.load_results import Outcome, Phase, stats, summary

KEY = "serve_load"
CLIENTS = {"cpu": 16, "cuda": 64}
SECONDS = 600
COMPARE_SECONDS = 120
SAMPLE_EVERY_S = 1.0
SEED = 0
HELD = "/v1/vinterp/held"
QUIET_WITHIN_S = 60  # after a phase, how long the workers may take to drop what they held


def default_clients() -> int:
    return CLIENTS[device_kind()]


def describe(server: served.Server, prompts: int) -> Pool:
    """The pool for the served model (its description from `GET /v1/vinterp/sites`)."""
    with vinterp.Client(server.url, api_key=server.api_key) as client:
        config = client.config
        return Pool(
            client.model_name,
            int(config.num_hidden_layers),
            int(config.hidden_size),
            load_mix.PROMPTS[:prompts],
        )


def reference(session: Session, entries: list[Entry]) -> dict[Entry, Answer]:
    """Each entry's answer, sent one at a time; the judged kinds' answers are returned.
    Raises where the mix could not tell a wrong answer from a right one: a streamed answer
    unlike the plain one, or a steering that leaves a prompt's answer unchanged."""
    answers = {entry: load_mix.send(session, entry) for entry in entries}
    plain = {e.index: a.text for e, a in answers.items() if e.kind == "plain"}
    for entry, answer in answers.items():
        same = plain.get(entry.index) == answer.text
        if entry.kind == "stream" and not same:
            raise RuntimeError(f"prompt {entry.index}: streamed {answer.text!r}, plain differs")
        if entry.kind in ("steered", "named", "capture_all") and same and entry.index in plain:
            raise RuntimeError(f"{entry}: the steering did not change the answer")
    return {e: a for e, a in answers.items() if e.kind in load_mix.JUDGED}


def timed_request(
    session: Session, entry: Entry, references: dict[Entry, Answer], t0: float
) -> Outcome:
    start = time.perf_counter()
    try:
        got = load_mix.send(session, entry)
        want = references.get(entry)  # malformed and disconnect: an answer of the right form
        verdict, error = (OK, 0.0) if want is None else load_mix.judge(entry.kind, got, want)
        note = got.text if entry.kind == "disconnect" else ""
    except Exception as exc:  # every failure is counted, none stops the client
        verdict, error, note = ERROR, 0.0, f"{type(exc).__name__}: {exc}"[:500]
    return Outcome(entry.kind, start - t0, time.perf_counter() - start, verdict, error, note)


def load(
    server: served.Server,
    pool: Pool,
    references: dict[Entry, Answer],
    kinds: tuple[str, ...],
    clients: int,
    seconds: float,
    sample: bool = False,
) -> Phase:
    """`clients` threads, each with its own connections, sending entries of `kinds` picked at
    random (seeded, weighted by `load_mix.WEIGHTS`) until `seconds` have passed; requests
    under way then finish. `sample`: the server's memory every SAMPLE_EVERY_S."""
    entries = pool.entries(kinds)
    per_kind = {k: sum(e.kind == k for e in entries) for k in kinds}
    weights = [load_mix.WEIGHTS[e.kind] / per_kind[e.kind] for e in entries]
    sessions = [Session(server.url, server.api_key, pool) for _ in range(clients)]
    if {"trace", "disconnect"} & set(kinds):  # their clients connect before the clock starts
        for session in sessions:
            session.connect_vinterp()
    results: list[Outcome] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds

    def client(k: int, session: Session) -> None:
        rng = random.Random(SEED * 1000 + k)
        while time.perf_counter() < deadline:
            entry = rng.choices(entries, weights)[0]
            results.append(timed_request(session, entry, references, t0))

    threads = [threading.Thread(target=client, args=kv) for kv in enumerate(sessions)]
    phase = Phase(results)
    sampler = _Sampler(server.pid, lambda: len(results), t0, phase.samples) if sample else None
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    phase.wall_s = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()
    for session in sessions:
        session.close()
    return phase


class _Sampler:
    """Samples the server tree's memory on a thread of its own until stopped (once more
    then)."""

    def __init__(self, pid: int, done: Callable[[], int], t0: float, into: list) -> None:
        self.pid, self.done, self.t0, self.into = pid, done, t0, into
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _take(self) -> None:
        t = time.perf_counter() - self.t0
        gpu = served.gpu_memory_used() if device_kind() == "cuda" else None
        self.into.append((t, self.done(), served.tree_rss(self.pid), gpu))

    def _run(self) -> None:
        while not self.stopping.wait(SAMPLE_EVERY_S):
            self._take()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self._take()


def held_when_quiet(session: Session) -> dict[str, int] | None:
    """What the workers still hold once the disconnected requests have ended (all zero when
    nothing leaked), waiting up to QUIET_WITHIN_S; None where the server has no such route."""
    deadline = time.monotonic() + QUIET_WITHIN_S
    while True:
        # the workers drop an aborted request at the next step: run one
        session.openai.completions.create(
            model=session.pool.model, prompt=session.pool.prompts[0], max_tokens=1
        )
        r = session.http.get(HELD)
        if r.status_code == 404:
            return None
        held = dict(r.raise_for_status().json())
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(1)


def tracebacks(server: served.Server) -> list[str]:
    """The tracebacks the server logged, each cut to its last lines."""
    parts = server.log.read_text(errors="replace").split("Traceback (most recent call last):")
    return ["\n".join(part.strip().splitlines()[-6:]) for part in parts[1:]]


def run(
    model: str,
    clients: int,
    seconds: float = SECONDS,
    compare_seconds: float = COMPARE_SECONDS,
    flags: list[str] | None = None,
    prompts: int = len(load_mix.PROMPTS),
) -> tuple[list[Row], dict[str, Any]]:
    """The comparison row (none when `compare_seconds` is 0) and the summary of the load
    (`load_results.summary`); `flags` go to both servers."""
    flags = list(flags or [])
    api_key = secrets.token_hex(16)
    compared: dict[str, Phase] = {}
    with served.running(False, model, api_key, flags) as server:
        pool = describe(server, prompts)
        with Session(server.url, api_key, pool) as session:
            for i in range(len(pool.prompts)):
                session.client.steering.register(pool.steering_name(i), pool.steering("named", i))
            references = reference(session, pool.entries())
            mixed = load(server, pool, references, load_mix.KINDS, clients, seconds, sample=True)
            held = held_when_quiet(session)
            if compare_seconds:
                compared["vinterp"] = load(
                    server, pool, references, COMPARED, clients, compare_seconds
                )
        logged = tracebacks(server)
    differs = 0
    if compare_seconds:
        with served.running(True, model, api_key, flags) as server:
            with Session(server.url, api_key, pool) as session:
                plain = reference(session, pool.entries(COMPARED))
            differs = sum(answer.text != references[e].text for e, answer in plain.items())
            compared["vllm"] = load(server, pool, plain, COMPARED, clients, compare_seconds)
    details = summary(mixed, held, logged, compared, differs)
    details.update(clients=clients, seconds=seconds, flags=flags, pool=len(pool.entries()))
    return comparison_rows(compared, clients), details


def comparison_rows(compared: dict[str, Phase], clients: int) -> list[Row]:
    """vinterp serve's latencies against plain vllm serve's, plain and streaming completions
    from the same clients; the row's extras give p99 and requests/s of both."""
    if not compared:
        return []
    ours, theirs = (stats(compared[k].results, compared[k].wall_s) for k in ("vinterp", "vllm"))
    latencies = {k: Timing(tuple(r.latency for r in p.results)) for k, p in compared.items()}
    return [
        Row(
            f"serve_load: plain and streaming completions, {clients} clients (latency)",
            latencies["vllm"],
            latencies["vinterp"],
            REFERENCE,
            KEY,
            extras={
                "p99_s": ours["p99_s"],
                "vllm_p99_s": theirs["p99_s"],
                "req_per_s": ours["requests_per_s"],
                "vllm_req_per_s": theirs["requests_per_s"],
            },
        )
    ]
