"""Start `vinterp serve` in a process of its own for a test module, and wait for it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

KEY = "test-key"


@dataclass
class Served:
    url: str
    process: subprocess.Popen
    log: object  # the server's output (a temporary file)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


@contextmanager
def served(*flags: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """`vinterp serve --enforce-eager --api-key KEY *flags` on a free port (eager: the server's
    own compilation of the model takes ~9 minutes on two cores), stopped at exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    command = [sys.executable, "-m", "vinterp.cli", "serve", "--port", str(port)]
    command += ["--enforce-eager", *flags, "--api-key", KEY]
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    server = Served(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + server.output()[-3000:])
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # never leave a server (and its engine) behind
            proc.kill()
            proc.wait(timeout=60)
