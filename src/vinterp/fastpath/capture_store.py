"""Captured rows kept in the worker until the client takes them (one store per worker).

Each site is gathered once per step for all requests (one copy, not one per request) and
stays on the device; the requests' slices are cut out and moved to the host only when they
are taken, so recording never waits for the device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from vinterp.fastpath.tables import SiteCapture
from vinterp.wire.tensors import tensor_to_wire

# per capture id, per site: (one step's gathered rows, first row, positions) for each step
_Chunk = tuple[torch.Tensor, int, list[int]]


class CaptureStore:
    def __init__(self) -> None:
        self._chunks: dict[str, dict[str, list[_Chunk]]] = defaultdict(lambda: defaultdict(list))

    def record_site(self, site: str, capture: SiteCapture, value: torch.Tensor) -> None:
        gathered = value.detach().index_select(0, capture.rows.to(value.device))
        start = 0
        for capture_id, positions in capture.parts:
            self._chunks[capture_id][site].append((gathered, start, positions))
            start += len(positions)

    def take(self, capture_ids: list[str]) -> dict[str, Any]:
        """Per capture id and site: positions in order and their rows, as wire tensors."""
        out: dict[str, Any] = {}
        on_host: dict[int, torch.Tensor] = {}  # one device-to-host copy per gathered step

        def host(chunk: _Chunk) -> _Chunk:
            gathered, start, positions = chunk
            if id(gathered) not in on_host:
                on_host[id(gathered)] = gathered.cpu()
            return on_host[id(gathered)], start, positions

        for cid in capture_ids:
            sites = self._chunks.pop(cid, {})
            out[cid] = {}
            for site, chunks in sites.items():
                positions, values = latest_by_position([host(c) for c in chunks])
                out[cid][site] = {"positions": positions, "values": tensor_to_wire(values)}
        return out


def latest_by_position(chunks: list[_Chunk]) -> tuple[list[int], torch.Tensor]:
    """Rows sorted by position; a position recorded twice (a preempted request recomputed)
    keeps its latest row. The usual case, one step's rows already in order, is a slice."""
    if len(chunks) == 1:
        gathered, start, positions = chunks[0]
        if all(a < b for a, b in zip(positions, positions[1:])):
            return list(positions), gathered[start : start + len(positions)]
    values = torch.cat([g[start : start + len(pos)] for g, start, pos in chunks])
    positions = torch.tensor([p for _, _, pos in chunks for p in pos], dtype=torch.long)
    order = torch.argsort(positions, stable=True)
    ordered = positions[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return ordered[last].tolist(), values[order[last]]
