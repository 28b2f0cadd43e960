"""The front end's client for the workers' calls: every call it makes is a method the workers'
extension has, taking the arguments the client sends, so a renamed or removed worker method
fails here rather than in a served request. Engines, the async engine and the server routes
call the workers only through it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from vinterp.engine.worker_calls import WorkerCalls
from vinterp.engine.worker_ext import VinterpWorkerExtension

SRC = Path(__file__).resolve().parents[1] / "src" / "vinterp"


def client_methods() -> list[str]:
    return [
        name
        for name, member in inspect.getmembers(WorkerCalls, inspect.isfunction)
        if not name.startswith("_")
    ]


def test_every_call_names_a_worker_method_that_takes_its_arguments() -> None:
    sent: list[tuple[str, tuple]] = []
    calls = WorkerCalls(lambda name, args: sent.append((name, args)) or ["answer"])
    for name in client_methods():
        signature = inspect.signature(getattr(WorkerCalls, name))
        args = [
            f"arg{i}"
            for i, p in enumerate(list(signature.parameters.values())[1:])
            if p.default is inspect.Parameter.empty
        ]
        assert getattr(calls, name)(*args) == ["answer"]
        method, sent_args = sent[-1]
        target = getattr(VinterpWorkerExtension, method)
        inspect.signature(target).bind(None, *sent_args)  # raises if they do not fit
    assert {m for m, _ in sent} == {
        n for n in vars(VinterpWorkerExtension) if n.startswith("vinterp_")
    }, "a worker method no client call reaches, or the reverse"


def test_nothing_calls_the_workers_by_a_string_name() -> None:
    by_name = re.compile(r"collective_rpc\(\s*[\"']")
    found = [
        str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if by_name.search(path.read_text())
    ]
    assert found == []
