"""`vinterp serve` (the bundled model unless told) for a test module, in a process of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vinterp.bench.served import Server, running
from vinterp.models import bundled

KEY = "test-key"


@contextmanager
def served(
    *flags: str, env: dict[str, str] | None = None, model: str | Path | None = None
) -> Iterator[Server]:
    """`vinterp serve --api-key KEY *flags`, stopped at the block's end. Without a CUDA GPU
    with `--enforce-eager`: the server's own compilation of the model takes ~9 minutes on two
    cores; on a GPU compiled, with CUDA graphs, as researchers serve it."""
    model = str(model or bundled())
    eager = [] if torch.cuda.device_count() else ["--enforce-eager"]
    with running(False, model, KEY, [*eager, *flags], env) as server:
        yield server
