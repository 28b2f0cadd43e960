"""Per-step steering and capture tables: which batch rows get which vector, which rows are
recorded, built once per step from the requests' specs and applied at each site."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from vinterp.fastpath.specs import CaptureSpec, SteerSpec


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
class SiteSteer:
    rows: list[int] = field(default_factory=list)
    add: list[torch.Tensor] = field(default_factory=list)  # scale * v
    norm_rows: list[int] = field(default_factory=list)
    norm_add: list[torch.Tensor] = field(default_factory=list)  # scale * v / |v|

    def freeze(self) -> FrozenSteer:
        def stack(
            rows: list[int], adds: list[torch.Tensor]
        ) -> tuple[torch.Tensor, torch.Tensor] | None:
            return (torch.tensor(rows, dtype=torch.long), torch.stack(adds)) if rows else None

        return FrozenSteer(stack(self.rows, self.add), stack(self.norm_rows, self.norm_add))


@dataclass
class FrozenSteer:
    plain: tuple[torch.Tensor, torch.Tensor] | None
    norm: tuple[torch.Tensor, torch.Tensor] | None

    def rows(self) -> torch.Tensor:
        parts = [p[0] for p in (self.plain, self.norm) if p is not None]
        return torch.unique(torch.cat(parts))

    def add_to(self, out: torch.Tensor) -> None:
        """out[rows] += vectors (index_add: several vectors on one row add up)."""
        if self.norm is not None:
            rows, unit = self.norm
            norms = out[rows].norm(dim=-1, keepdim=True)
            out.index_add_(0, rows.to(out.device), (unit.to(out) * norms))
        if self.plain is not None:
            rows, add = self.plain
            out.index_add_(0, rows.to(out.device), add.to(out))


@dataclass
class SiteCapture:
    """One site's recorded rows this step: `rows` gathers them all at once; `parts` says
    whose they are, in order: (capture id, positions), one row per position."""

    rows: torch.Tensor
    parts: list[tuple[str, list[int]]]


@dataclass
class StepTables:
    steer: dict[str, FrozenSteer] = field(default_factory=dict)
    capture: dict[str, SiteCapture] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.steer or self.capture)


def build_tables(requests: list[tuple[RowSpan, list[SteerSpec], CaptureSpec | None]]) -> StepTables:
    steer: dict[str, SiteSteer] = defaultdict(SiteSteer)
    capture_rows: dict[str, list[int]] = defaultdict(list)
    capture_parts: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
    for span, specs, cap in requests:
        positions = span.positions()
        for spec in specs:
            rows = [
                span.start + i for i, p in enumerate(positions) if spec.applies(p, span.prompt_len)
            ]
            if not rows:
                continue
            for site, vector in spec.vectors.items():
                table = steer[site]
                if spec.norm_match:
                    unit = spec.scale * vector / vector.norm().clamp_min(1e-12)
                    table.norm_rows.extend(rows)
                    table.norm_add.extend([unit] * len(rows))
                else:
                    table.rows.extend(rows)
                    table.add.extend([spec.scale * vector] * len(rows))
        if cap is not None:
            picked = [
                (span.start + i, p)
                for i, p in enumerate(positions)
                if cap.wants(p, span.prompt_len)
            ]
            if picked:
                part = (cap.capture_id, [p for _, p in picked])
                for site in cap.sites:
                    capture_rows[site].extend(r for r, _ in picked)
                    capture_parts[site].append(part)
    return StepTables(
        {s: t.freeze() for s, t in steer.items()},
        {
            site: SiteCapture(torch.tensor(rows, dtype=torch.long), capture_parts[site])
            for site, rows in capture_rows.items()
        },
    )
