"""Captured rows kept in the worker until the client takes them (one store per worker)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from vinterp.fastpath.tables import CaptureRows
from vinterp.ir.wire import tensor_to_wire


class CaptureStore:
    def __init__(self) -> None:
        self._chunks: dict[str, dict[str, list[tuple[list[int], torch.Tensor]]]] = defaultdict(
            lambda: defaultdict(list)
        )

    def record_site(self, site: str, entries: list[CaptureRows], value: torch.Tensor) -> None:
        for entry in entries:
            rows = value[entry.rows.to(value.device)].detach().to("cpu", copy=True)
            self._chunks[entry.capture_id][site].append((entry.positions, rows))

    def take(self, capture_ids: list[str]) -> dict[str, Any]:
        """Per capture id and site: positions in order and their rows, as wire tensors.

        A position recorded twice (a preempted request recomputed) keeps the latest row."""
        out: dict[str, Any] = {}
        for cid in capture_ids:
            sites = self._chunks.pop(cid, {})
            out[cid] = {}
            for site, chunks in sites.items():
                by_position: dict[int, torch.Tensor] = {}
                for positions, rows in chunks:
                    by_position.update(zip(positions, rows))
                ordered = sorted(by_position)
                out[cid][site] = {
                    "positions": ordered,
                    "values": tensor_to_wire(torch.stack([by_position[p] for p in ordered])),
                }
        return out
