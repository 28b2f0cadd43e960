"""Whether the ops a site runs now are recorded into a graph that replays them later.

Python at a site may skip its ops in a step that needs none of them, but only while it runs
them itself: torch.compile traces them into the model's graph once, and a CUDA graph capture
records the kernels once, after which every step replays them with no Python. The capture
also records code that never meets torch.compile: vLLM's opaque custom ops (the fused
mixture-of-experts op calls the router's gate inside it) run eagerly while the CUDA graph is
captured, so `torch.compiler.is_compiling()` alone would let such a site drop its ops from
every replay.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def _cuda_graphs_possible() -> bool:
    """Whether this process can capture CUDA graphs (asked once: CPU builds of torch raise
    on the capture query)."""
    return torch.cuda.is_available()


def ops_recorded() -> bool:
    """Whether the ops run now go into a compiled graph or a CUDA graph being captured: then
    a site runs every op its replay needs, whatever this step asks for."""
    if torch.compiler.is_compiling():
        return True
    return _cuda_graphs_possible() and torch.cuda.is_current_stream_capturing()
