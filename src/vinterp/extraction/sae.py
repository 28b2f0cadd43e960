"""Sparse autoencoders' sites in an activation dataset. An SAE's features are stored as their
top k per token, an indices column and a values column (k values a row, not d_sae), and the
dataset's spec holds k and the digest of each SAE its sites read, so a run resumed with
another SAE or another k is refused instead of mixing rows of two encodings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vinterp.api.sae_sites import check_attachable
from vinterp.sae import SAE
from vinterp.sites.names import sae_site
from vinterp.store import INDEX_DTYPE
from vinterp.wire.specs import is_sae_features, stored_sites
from vinterp.wire.tensors import is_int


@dataclass(frozen=True)
class SaeFacts:
    """What a dataset needs of an attached SAE: its digest (for the spec) and width."""

    digest: str
    d_sae: int

    @classmethod
    def of(cls, sae: SAE) -> SaeFacts:
        return cls(sae.digest, sae.d_sae)


def load_saes(config: Any, saes: Mapping[str, SAE | str | Path]) -> dict[str, SAE]:
    """Each SAE (a `vinterp.SAE`, or a directory in SAELens's format) loaded and checked
    against its host site, before any engine starts: ValueError naming the problem."""
    if not isinstance(saes, Mapping):
        raise TypeError(f"saes: expected {{site: SAE or directory}}, got {type(saes).__name__}")
    loaded = {}
    for site, sae in saes.items():
        loaded[site] = sae if isinstance(sae, SAE) else SAE.load(sae)
        check_attachable(config, site, loaded[site])
    return loaded


def check_sae_sites(sites: list[str], widths: Mapping[str, int], topk: int | None) -> None:
    """The SAE sites of an extraction (expanded) against the SAEs attached (host -> d_sae)
    and `topk`: ValueError naming the field and the fix, before anything runs."""
    if topk is not None and (not is_int(topk) or topk < 1):
        raise ValueError(f"topk: expected an int >= 1 (features kept per token), got {topk!r}")
    features = [site for site in sites if is_sae_features(site)]
    if topk is not None and not features:
        raise ValueError(
            "topk: keeps the largest features of SAE sites; name one in sites, e.g. "
            "'layers.10.output.sae.features'"
        )
    for site in sites:
        parsed = sae_site(site)
        if parsed is None:
            continue
        host = parsed.host
        if host not in widths:
            raise ValueError(
                f"sites: {site} needs a sparse autoencoder at {host}; call "
                f"llm.attach_sae({host!r}, sae) first (vinterp extract: --sae {host}=DIR)"
            )
        if parsed.sae != "features":
            continue
        if topk is None:
            raise ValueError(
                f"sites: extract stores {site} as its top k features per token; give topk=k "
                "(vinterp extract: --topk K)"
            )
        if topk > widths[host]:
            raise ValueError(
                f"topk: {topk} is more than the {widths[host]} features of the SAE at {host}"
            )


def sae_spec(sites: list[str], saes: Mapping[str, SaeFacts], topk: int | None) -> dict[str, Any]:
    """The spec's fields for the SAE sites: k and the digest of each SAE they read (none
    for a dataset without SAE sites, whose spec stays as it was)."""
    hosts = sorted({parsed.host for site in sites if (parsed := sae_site(site)) is not None})
    if not hosts:
        return {}
    return {"topk": topk, "sae_digest": {host: saes[host].digest for host in hosts}}


def site_columns(site: str, topk: int | None, value_dtype: str, hidden_size: int) -> dict:
    """A site's columns: (numpy dtype, width) by name; an SAE's features as the pair
    `<site>.indices` (int32) and `<site>.values`, k wide."""
    if topk and is_sae_features(site):
        indices, values = stored_sites(site, topk)
        return {indices: (INDEX_DTYPE, topk), values: (value_dtype, topk)}
    return {site: (value_dtype, hidden_size)}


def index_values(indices: torch.Tensor) -> np.ndarray:
    """Feature indices (int64 from the workers) as their column's int32 array."""
    return indices.to(device="cpu", dtype=torch.int32).numpy()
