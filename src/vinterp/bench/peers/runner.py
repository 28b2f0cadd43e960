"""Run one tool on its task directories in a subprocess, from its own environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .envs import EnvError, ensure
from .protocol import Result, read_result
from .registry import Peer

BENCH_DIR = Path(__file__).resolve().parents[1]  # on the path, `peers` is a top-level package
TIMEOUT_S = 3600


def run(peer: Peer, tasks: list[tuple[Path, str]], log: Path) -> list[Result]:
    """The peer's result for each (task directory, workload), from one process (the model
    loads once; its output goes to `log`); any failure (environment, crash, timeout) is a
    Result whose error is the exact message that stopped it."""
    try:
        python = ensure(peer.env) if peer.env else Path(sys.executable)
    except EnvError as exc:
        return [Result([], "?", error=str(exc))] * len(tasks)
    env = peer_environment(peer, dict(os.environ))
    directories = [str(directory) for directory, _ in tasks]
    command = [str(python), "-m", "peers.worker", peer.module, *directories]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Result([], "?", error=f"timed out after {TIMEOUT_S} s")] * len(tasks)
    log.write_text(done.stdout + done.stderr)
    tail = (done.stderr.strip().splitlines() or [""])[-1]
    died = Result([], "?", error=f"process died (exit status {done.returncode}): {tail}")
    return [read_result(directory, workload) or died for directory, workload in tasks]


def peer_environment(peer: Peer, parent: dict[str, str]) -> dict[str, str]:
    """The peer process's environment: `peers` importable; on vinterp's own interpreter also
    whatever this process imports through PYTHONPATH (on the GPU machines, every package); a
    peer's own environment keeps to its packages, and its vLLM loads no vinterp plugin."""
    env = dict(parent)
    paths = [str(BENCH_DIR)]
    if peer.env:
        env["VLLM_PLUGINS"] = ""
    elif parent.get("PYTHONPATH"):
        paths.append(parent["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
