"""A server of the serve load bench in a child process: `vinterp serve` or plain `vllm serve`
with vinterp's engine settings (`plain_serve`), started on a free port, its log kept in a
file, and the memory of its whole process tree (API server, engine core, workers)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

# A first start of a configuration compiles the model: minutes on two CPU cores.
START_TIMEOUT_S = 1200
STOP_TIMEOUT_S = 120
MIB = 1 << 20


@dataclass(frozen=True)
class Server:
    url: str
    api_key: str
    pid: int
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(plain: bool, model: str, port: int, api_key: str, flags: list[str]) -> list[str]:
    """The command line of a vinterp server, or of plain vLLM's (`plain`), on `port`."""
    module = ["vinterp.bench.plain_serve"] if plain else ["vinterp.cli", "serve"]
    address = ["--host", "127.0.0.1", "--port", str(port), "--api-key", api_key]
    return [sys.executable, "-m", *module, model, *address, *flags]


@contextmanager
def running(
    plain: bool, model: str, api_key: str, flags: list[str], env: dict[str, str] | None = None
) -> Iterator[Server]:
    """A server answering /health until the block ends (`env` added to its environment);
    its log is kept for the block."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="vinterp-serve-load-") as folder:
        log_path = Path(folder) / "server.log"
        with log_path.open("wb") as log:
            command = serve_command(plain, model, port, api_key, flags)
            environment = {**os.environ, **(env or {})}
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        server = Server(f"http://127.0.0.1:{port}", api_key, proc.pid, log_path)
        try:
            _wait_healthy(proc, server)
            yield server
        finally:
            up = proc.poll() is None
            status = _stop(proc)
        if up and status != 0:  # asked to stop, a server exits cleanly
            message = f"the server exited with {status} when stopped:\n{server.log_tail()}"
            raise RuntimeError(message)


def _stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # never leave a server (and its engine) behind
        proc.kill()
        return proc.wait()


def _wait_healthy(proc: subprocess.Popen, server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (those that end meanwhile are
    skipped)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def gpu_memory_used() -> int | None:
    """Bytes used on the first GPU (nvidia-smi), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    return int(done.stdout.strip()) * MIB if done.returncode == 0 else None
