"""Engines leave no worker processes behind, in a script and in-process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.engine("shutdown")

SCRIPT = textwrap.dedent(
    """
    import psutil, vinterp

    if __name__ == "__main__":
        llm = vinterp.LLM(vinterp.models.tiny("llama"), tensor_parallel_size=2)
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
