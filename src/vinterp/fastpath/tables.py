"""Per-step capture tables: which batch rows each site records and whose they are, built
once per step that captures (such steps run uncompiled, with Python at the sites)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from vinterp.fastpath.specs import CaptureSpec


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
    whose they are, in order: (capture id, positions), one row per position."""

    rows: torch.Tensor
    parts: list[tuple[str, list[int]]]


def build_capture_tables(requests: list[tuple[RowSpan, CaptureSpec]]) -> dict[str, SiteCapture]:
    capture_rows: dict[str, list[int]] = defaultdict(list)
    capture_parts: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
    for span, cap in requests:
        picked = [
            (span.start + i, p)
            for i, p in enumerate(span.positions())
            if cap.wants(p, span.prompt_len)
        ]
        if picked:
            part = (cap.capture_id, [p for _, p in picked])
            for site in cap.sites:
                capture_rows[site].extend(r for r, _ in picked)
                capture_parts[site].append(part)
    return {
        site: SiteCapture(torch.tensor(rows, dtype=torch.long), capture_parts[site])
        for site, rows in capture_rows.items()
    }
