"""Engines leave no worker processes behind, in a script and in-process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.engine("shutdown")

SCRIPT = textwrap.dedent(
    """
    import psutil, vinterp

    if __name__ == "__main__":
        traced = {"mode": 2, "backend": "eager"}  # traced_engines: the compiler is not the subject
        llm = vinterp.LLM(
            vinterp.models.tiny("llama"), tensor_parallel_size=2, compilation_config=traced
        )
        llm.generate("Once upon a time", max_tokens=2)
        kids = psutil.Process().children(recursive=True)
        print("CHILDREN", " ".join(str(p.pid) for p in kids), flush=True)
        # no explicit shutdown: interpreter exit must clean up
    """
)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _alive(pids)


def test_script_exit_leaves_no_workers(engines, tmp_path) -> None:
    engines.release()  # one engine at a time on this machine
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(row for row in done.stdout.splitlines() if row.startswith("CHILDREN"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) >= 3  # engine core + two workers
    assert _wait_gone(pids) == []


def test_shutdown_stops_in_process_engine(engines, tiny_llama) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engines.vllm(tiny_llama)
    started = {  # not Python's multiprocessing resource tracker: it lives as long as we do
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    } - before
    assert started, "the engine started no processes"
    engines.release()
    assert _wait_gone(sorted(started)) == []


def test_an_extraction_whose_engine_core_dies_ends_with_an_error_not_a_hang(
    engines, tiny_llama, tmp_path
) -> None:
    """Killed mid-run, the engine core answers nothing more: the feed, the writers waiting
    for rows and the clean-up of what was captured all end within seconds."""
    engines.release()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = engines.vllm(tiny_llama)
    core = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert core, "the engine started no processes"
    prompts = [f"prompt {k}: " + "the residual stream " * 40 for k in range(5000)]
    out = tmp_path / "acts"
    ended: dict[str, object] = {}

    def run() -> None:
        try:
            llm.extract(prompts, "layers.*.output", out=out, buffer_gb=2e-3, use_tqdm=False)
        except Exception as exc:
            ended["error"] = exc

    feed = threading.Thread(target=run, daemon=True)
    feed.start()
    deadline = time.monotonic() + 120
    while not list(out.glob("data-*.arrow")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(out.glob("data-*.arrow")), "no shard written in 120 s"
    assert feed.is_alive(), "the run ended before the engine was killed"
    for process in core:
        process.kill()
    killed = time.monotonic()
    feed.join(60)
    assert not feed.is_alive(), "the extraction still waits 60 s after the engine died"
    assert time.monotonic() - killed < 60 and "error" in ended
    engines.release()
