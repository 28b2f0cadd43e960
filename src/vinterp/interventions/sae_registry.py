"""The sparse autoencoders attached at a model's sites (`llm.attach_sae`), where the forward
runs: a vLLM worker (every TP rank and PP stage keeps them all: they are small beside the
model, and under TP the residual they read is whole on every rank) or the HF backend.

A trace reads their sites through two model functions, `sae_encode(x, host)` and
`sae_decode(f, host, x)` (x: the rows f was encoded from, for an SAE that normalises its
input at run time; the front end records `llm.layers[i].output.sae.features` as
`sae_encode` of the host's value), so every backend runs the same code. A capture of an
SAE site keeps what `captured` derives from its host's captured rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vinterp.sae import SAE
from vinterp.sites.names import parse_site
from vinterp.wire.specs import stored_sites


class SaeRegistry:
    """Host site -> SAE, on the model's device and in its dtype."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.saes: dict[str, SAE] = {}
        self.attachments = 0  # tables and specs built from an attached SAE are built again

    def attach(self, site: str, sae: SAE) -> None:
        """Attach (or replace) the SAE at `site`."""
        self.saes[site] = sae.to(device=self.device, dtype=self.dtype)
        self.attachments += 1

    def attach_wire(self, site: str, wire: dict[str, Any]) -> None:
        """Attach an SAE sent as data (`SAE.to_wire`: no pickle, no code)."""
        self.attach(site, SAE.from_wire(wire))

    def of(self, site: str) -> SAE:
        """The SAE at `site`; KeyError saying how to attach one."""
        sae = self.saes.get(site)
        if sae is None:
            attached = ", ".join(sorted(self.saes)) or "none"
            raise KeyError(
                f"no sparse autoencoder is attached at {site} (attached: {attached}); "
                f"call llm.attach_sae({site!r}, sae) first"
            )
        return sae

    def encode(self, x: torch.Tensor, site: str) -> torch.Tensor:
        return self.of(site).encode(x)

    def decode(self, features: torch.Tensor, site: str, x: torch.Tensor) -> torch.Tensor:
        return self.of(site).decode(features, x)

    def functions(self) -> dict[str, Callable[..., Any]]:
        """The model functions a trace calls (`ir.ops.MODEL_FUNCTIONS`)."""
        return {"sae_encode": self.encode, "sae_decode": self.decode}

    def captured(self, site: str, rows: torch.Tensor, topk: int | None) -> dict[str, torch.Tensor]:
        """What a capture of the SAE site `site` keeps of its host's rows (`stored_sites`):
        the features, or their `topk` largest as `.indices` (int64) and `.values`, largest
        first; or the reconstruction error."""
        parsed = parse_site(site)
        sae = self.of(parsed.host)
        if parsed.sae == "error":
            return {site: sae.error(rows)}
        if topk is None:
            return {site: sae.encode(rows)}
        indices, values = sae.topk(rows, min(topk, sae.d_sae))
        return dict(zip(stored_sites(site, topk), (indices, values)))
