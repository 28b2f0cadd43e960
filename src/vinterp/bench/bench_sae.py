"""The sparse autoencoder of the bench's SAE rows: random weights of a 4x SAE (d_sae = 4 x
the hidden size: 2304 features on the bundled model, 16384 on Llama 3 8B's shape) at the
output of layer n_layers // 3, saved in SAELens's format and loaded from there, as a
researcher's SAE is."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vinterp.sae import SAE

EXPANSION = 4  # d_sae over the hidden size
TOPK = 32  # features kept per token by the top-k rows
# The clamp row's features and values: one turned off, three set high
CLAMPED = {0: 0.0, 1: 8.0, 2: 8.0, 3: 8.0}


def host_site(config: Any) -> str:
    """Where the bench attaches its SAE: the layer the steering rows steer."""
    return f"layers.{int(config.num_hidden_layers) // 3}.output"


def random_sae(hidden: int, seed: int = 0) -> SAE:
    """A ReLU SAE of EXPANSION x `hidden` features, float32, a fixed seed: about half the
    features fire on a residual, so top-k picks from many."""
    g = torch.Generator().manual_seed(seed)
    d_sae = EXPANSION * hidden
    return SAE(
        "standard",
        torch.randn(hidden, d_sae, generator=g) / hidden**0.5,
        torch.zeros(d_sae),
        torch.randn(d_sae, hidden, generator=g) / d_sae**0.5,
        torch.zeros(hidden),
    )


@contextmanager
def saved_sae(hidden: int, under: str | Path | None = None) -> Iterator[Path]:
    """`random_sae(hidden)` saved in SAELens's format in a fresh folder (under `under`, or
    the system temp dir), removed when the block ends."""
    folder = Path(tempfile.mkdtemp(prefix="vinterp-bench-sae-", dir=under))
    try:
        random_sae(hidden).save(folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def attach_saved(llm: Any, saes: dict[str, Path]) -> None:
    """Attach each SAE directory at its site of `llm`."""
    for site, folder in saes.items():
        llm.attach_sae(site, SAE.load(folder))
