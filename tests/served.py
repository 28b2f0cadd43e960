"""`vinterp serve` of the bundled model for a test module, in a process of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vinterp.bench.served import Server, running
from vinterp.models import bundled

KEY = "test-key"


@contextmanager
def served(*flags: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`vinterp serve --enforce-eager --api-key KEY *flags` (eager: the server's own
    compilation of the model takes ~9 minutes on two cores), stopped at the block's end."""
    with running(False, str(bundled()), KEY, ["--enforce-eager", *flags], env) as server:
        yield server
