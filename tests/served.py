"""`vinterp serve` (the bundled model unless told) for a test module, in a process of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vinterp.bench.served import Server, running
from vinterp.models import bundled

KEY = "test-key"


@contextmanager
def served(
    *flags: str, env: dict[str, str] | None = None, model: str | Path | None = None
) -> Iterator[Server]:
    """`vinterp serve --enforce-eager --api-key KEY *flags` (eager: the server's own
    compilation of the model takes ~9 minutes on two cores), stopped at the block's end."""
    model = str(model or bundled())
    with running(False, model, KEY, ["--enforce-eager", *flags], env) as server:
        yield server
