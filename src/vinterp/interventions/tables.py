"""Per-step capture tables: which batch rows each site records and whose they are, built
once per step that captures; and, for steps that capture into the compiled model's buffers,
which rows each buffered site gathers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from vinterp.interventions.host_to_device import on_device
from vinterp.interventions.specs import WorkerCapture
from vinterp.sites.names import SiteOrder


@dataclass
class RowSpan:
    """One request's rows in this step's flat batch and their absolute token positions."""

    start: int
    end: int
    first_position: int
    prompt_len: int


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
            self._on_device[device] = on_device(self.rows, device)
        return self._on_device[device]


def build_capture_tables(requests: list[tuple[RowSpan, WorkerCapture]]) -> dict[str, SiteCapture]:
    """Each site's SiteCapture for this step. Requests are grouped by the sites they capture,
    so the tables cost a few lists per group, not one per request and site."""
    groups: dict[tuple[str, ...], tuple[list[int], list[tuple[str, list[int]]]]] = {}
    for span, cap in requests:
        picked = cap.wanted(span.first_position, span.end - span.start, span.prompt_len)
        if picked:
            rows, parts = groups.setdefault(cap.sites, ([], []))
            offset = span.start - span.first_position  # a position's row in the batch
            if isinstance(picked, range):
                rows.extend(range(picked.start + offset, picked.stop + offset))
            else:
                rows.extend(p + offset for p in picked)
            parts.append((cap.capture_id, list(picked)))
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


@dataclass
class GatherPlan:
    """What the capture buffers gather in a step. A site's rows are gathered at the site that
    computes it (an SAE site at its host), so one buffered site may feed several tables:
    `rows` holds, per buffered site id, the rows to gather (a lone table's own; else the
    union of the tables', each batch row once, so never more than the step captures), and
    `picks`, per captured site, its buffered site and which gathered rows are its table's
    (None: all, in order)."""

    rows: dict[int, torch.Tensor]
    picks: dict[str, tuple[int, torch.Tensor | None]]


def gather_plan(tables: dict[str, SiteCapture], order: SiteOrder) -> GatherPlan:
    """The GatherPlan of a step's capture tables."""
    buffered = {site: order[site] for site in tables}  # an SAE site's is its host's
    at: dict[int, dict[int, SiteCapture]] = {}  # buffered site id -> distinct tables
    for site, table in tables.items():
        at.setdefault(buffered[site], {})[id(table)] = table
    rows = {
        site_id: next(iter(t.values())).rows
        if len(t) == 1
        else torch.unique(torch.cat([table.rows for table in t.values()]))
        for site_id, t in at.items()
    }
    picks: dict[str, tuple[int, torch.Tensor | None]] = {}
    for site, table in tables.items():
        site_id = buffered[site]
        lone = len(at[site_id]) == 1
        picks[site] = (site_id, None if lone else torch.searchsorted(rows[site_id], table.rows))
    return GatherPlan(rows, picks)
