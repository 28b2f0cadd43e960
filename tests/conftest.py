"""Shared engines: at most one vLLM engine alive at a time, reused by every test that asks for
the same configuration (an engine start costs a minute on two cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import vinterp


class EnginePool:
    """Keeps the most recently requested vLLM engine; asking for another stops it first."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.llm: Any = None
        self._hf: dict[str, vinterp.LLM] = {}

    def vllm(self, model: Any = None, **kwargs: Any) -> vinterp.LLM:
        return self._engine(vinterp.LLM, model, kwargs)

    def async_vllm(self, model: Any = None, **kwargs: Any) -> vinterp.AsyncLLM:
        return self._engine(vinterp.AsyncLLM, model, kwargs)

    def _engine(self, cls: type, model: Any, kwargs: dict[str, Any]) -> Any:
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        key = (cls.__name__, str(model), tuple(sorted(kwargs.items())), in_process)
        if key != self.key:
            self.release()
            self.llm = cls(model, **kwargs)
            self.key = key
        return self.llm

    def hf(self, model: Any = None) -> vinterp.LLM:
        if str(model) not in self._hf:
            self._hf[str(model)] = vinterp.LLM(model, backend="hf")
        return self._hf[str(model)]

    def release(self) -> None:
        """Stop the live vLLM engine, if any (before a test starts its own)."""
        if self.llm is not None:
            self.llm.shutdown()
        self.llm, self.key = None, None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "engine(name, releases=False): the module uses the shared engine `name`; modules of one"
        " engine run next to each other, those that stop it (releases=True) last",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that share an engine one after another, so it starts once (a start costs
    minutes on two cores); the rest keep their order."""
    first: dict[str, int] = {}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, bool, int]:
        index, item = indexed
        mark = item.get_closest_marker("engine")
        if mark is None:
            return index, False, index
        group = first.setdefault(mark.args[0], index)
        return group, bool(mark.kwargs.get("releases", False)), index

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run without `engine` tests (`-m "not engine"`, `make test-fast`) refuses every vLLM
    engine start, here and in child processes (tests/no_engine/sitecustomize.py): a test that
    starts one unmarked fails at once instead of slowing the fast tier down."""
    if not session.items or any(item.get_closest_marker("engine") for item in session.items):
        return
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parent / "no_engine"
    spec = importlib.util.spec_from_file_location("vinterp_no_engine", folder / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    guard.install()
    os.environ[guard.ENV] = "1"
    paths = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)


@pytest.fixture(scope="session")
def engines() -> Iterator[EnginePool]:
    pool = EnginePool()
    yield pool
    pool.release()


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    """The module's engines in this process: no engine-core and worker processes to spawn
    (an engine start of the tiny model takes seconds instead of half a minute, and its memory
    is freed at shutdown). Modules whose subject is the processes (shutdown, a killed engine
    core, the server, the async engine), the bundled model's modules (the default a user
    runs) and those that look at what the workers hold between steps (an engine core in this
    process runs no step after the last request's) keep them. An in-process engine freezes
    vLLM's environment (its envs cache), so it is thawed again for the engines of later
    modules. vLLM's start also writes its settings into this process's environment (thread
    binding, preloads, compile cache folders): the whole environment is put back afterwards,
    so a server or engine process started by a later module sees none of it. A module asks
    for it with `pytest.mark.usefixtures("in_process")`."""
    import vllm.envs

    saved = dict(os.environ)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
    vllm.envs.disable_envs_cache()


@pytest.fixture(scope="session")
def tiny_llama() -> Callable[[], Any]:
    return vinterp.models.tiny("llama")


@pytest.fixture(scope="session")
def engine_script(engines: EnginePool) -> Callable[..., dict[str, str]]:
    """Runs a script whose vLLM engine lives in the script's own process (so it can reach the
    loaded model) and returns its output lines as {tag: rest}; `expect` must be among them."""

    def run(script: str, *args: str, expect: str) -> dict[str, str]:
        engines.release()  # one engine at a time: the script starts its own
        proc = subprocess.run(
            [sys.executable, "-c", script, *args],
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if " " in ln)
        assert proc.returncode == 0 and expect in lines, proc.stderr[-3000:]
        return lines

    return run
