"""Per-step capture tables: which batch rows each site records and whose they are, built
once per step that captures (such steps run uncompiled, with Python at the sites)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from vinterp.interventions.specs import WorkerCapture


@dataclass
class RowSpan:
    """One request's rows in this step's flat batch and their absolute token positions."""

    start: int
    end: int
    first_position: int
    prompt_len: int

    def positions(self) -> range:
        return range(self.first_position, self.first_position + self.end - self.start)


@dataclass
class SiteCapture:
    """One site's recorded rows this step: `rows` gathers them all at once; `parts` says
    whose they are, in order: (capture id, positions), one row per position. Sites that the
    same requests capture share one (every site of a `Capture`)."""

    rows: torch.Tensor
    parts: list[tuple[str, list[int]]]
    _on_device: dict[torch.device, torch.Tensor] = field(
        default_factory=dict, repr=False, compare=False
    )

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """`rows` on `device`, copied there once for all the sites that share them."""
        if device not in self._on_device:
            self._on_device[device] = self.rows.to(device)
        return self._on_device[device]


def build_capture_tables(requests: list[tuple[RowSpan, WorkerCapture]]) -> dict[str, SiteCapture]:
    """Each site's SiteCapture for this step. Requests are grouped by the sites they capture,
    so the tables cost a few lists per group, not one per request and site."""
    groups: dict[tuple[str, ...], tuple[list[int], list[tuple[str, list[int]]]]] = {}
    for span, cap in requests:
        picked = [
            (span.start + i, p)
            for i, p in enumerate(span.positions())
            if cap.wants(p, span.prompt_len)
        ]
        if picked:
            rows, parts = groups.setdefault(cap.sites, ([], []))
            rows.extend(r for r, _ in picked)
            parts.append((cap.capture_id, [p for _, p in picked]))
    member: dict[str, list[tuple[str, ...]]] = defaultdict(list)  # the groups at each site
    for sites in groups:
        for site in sites:
            member[site].append(sites)
    shared: dict[tuple[tuple[str, ...], ...], SiteCapture] = {}
    tables = {}
    for site, keys in member.items():
        key = tuple(keys)
        if key not in shared:
            rows = [r for k in key for r in groups[k][0]]
            parts = [part for k in key for part in groups[k][1]]
            shared[key] = SiteCapture(torch.tensor(rows, dtype=torch.long), parts)
        tables[site] = shared[key]
    return tables
