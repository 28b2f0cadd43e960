"""Steering and capture inside a worker: global and named steerings, capture tables and store.

Steering itself runs in the compiled model (`steer_buffers`, planned by `steer_tables`);
captures are recorded after steering, so they hold the values the model computes: by the
site handlers in the steps that capture uncompiled, or by the compiled model into capture
buffers (`capture_buffers`) and kept after the step. An SAE site's rows are its host's, encoded
where they are kept (only the captured rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.capture_files import FileWriter
from vinterp.interventions.capture_store import CaptureStore
from vinterp.interventions.host_to_device import on_device
from vinterp.interventions.probe_tables import ProbeRead
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import (
    WorkerCapture,
    WorkerRequest,
    WorkerSteering,
    decode_request,
    worker_steering,
)
from vinterp.interventions.tables import (
    GatherPlan,
    RowSpan,
    SiteCapture,
    build_capture_tables,
    gather_plan,
)
from vinterp.sites.names import SiteOrder, sae_site
from vinterp.wire.probes import probe_store_name
from vinterp.wire.specs import Steering


class WorkerInterventions:
    def __init__(
        self,
        keeps_results: bool,
        order: SiteOrder,
        hidden_size: int,
        saes: SaeRegistry,
        held: frozenset[int] | None = None,
        stage_starts: tuple[int, ...] = (0,),
    ) -> None:
        """`held`: the sites this worker runs (a pipeline stage's; None: all); `stage_starts`:
        the first layer of each pipeline stage."""
        self.order, self.hidden_size, self.saes, self.held = order, hidden_size, saes, held
        self.stage_starts = stage_starts
        self.keeps_results = keeps_results  # TP: one rank records, the others skip the copies
        self.global_steering: list[WorkerSteering] = []
        self.named: dict[str, WorkerSteering] = {}
        self.store = CaptureStore()
        self.files = FileWriter()
        self.capture_tables: dict[str, SiteCapture] = {}
        # this step's captured SAE sites at each host, with the most features one keeps
        self.sae_captures: dict[str, list[tuple[str, int | None]]] = {}
        self.gathering = GatherPlan({}, {})  # what this step's capture buffers gather
        self._steering_changes = 0  # global or named steering set

    def set_global(self, wires: list[dict[str, Any]]) -> None:
        self.global_steering = [self._steer_spec(w) for w in wires]
        self._steering_changes += 1

    def register(self, name: str, wire: dict[str, Any] | None) -> None:
        if wire is None:
            self.named.pop(name, None)
        else:
            self.named[name] = self._steer_spec(wire)
        self._steering_changes += 1

    @property
    def version(self) -> tuple[int, int]:
        """Changes with global or named steering and with every SAE attached: what requests'
        decoded steering and the step's plan are cached for."""
        return self._steering_changes, self.saes.attachments

    def _steer_spec(self, wire: dict[str, Any]) -> WorkerSteering:
        return worker_steering(
            Steering.from_wire(wire), self.order, self.hidden_size, self.saes.saes
        )

    def decode(self, extra: dict[str, Any]) -> WorkerRequest:
        """A request's steering, capture and trace invoke (checked; decoded once)."""
        return decode_request(
            extra, self.order, self.hidden_size, self.saes.saes, self.stage_starts
        )

    def steering_for(self, request: WorkerRequest | None) -> list[WorkerSteering]:
        """Every steering of a request: global, then its named ones, then its own."""
        if request is None:
            return list(self.global_steering)
        named = [self.named[n] for n in request.steering_names if n in self.named]
        return [*self.global_steering, *named, *request.steering]

    def begin_capture_step(self, requests: list[tuple[RowSpan, WorkerCapture]]) -> None:
        self.capture_tables = build_capture_tables(requests) if self.keeps_results else {}
        self.sae_captures = {}
        topk: dict[str, int | None] = {}
        for _, capture in requests:
            for site in capture.sites:
                if site in self.capture_tables and sae_site(site) is not None:
                    k = topk.get(site, capture.topk)
                    topk[site] = None if k is None or capture.topk is None else max(k, capture.topk)
        for site, k in topk.items():
            host = sae_site(site).host  # type: ignore[union-attr]
            if host in self.saes.saes:  # else its rows are missing: the front end says so
                self.sae_captures.setdefault(host, []).append((site, k))

    def records_at(self, site: str) -> bool:
        """Whether this step captures rows at `site` (or at an SAE site computed from it)."""
        return site in self.capture_tables or site in self.sae_captures

    def record(self, site: str, value: torch.Tensor) -> None:
        capture = self.capture_tables.get(site)
        if capture is not None:
            self.store.record_site(site, capture, value)
        for sae_at, topk in self.sae_captures.get(site, ()):  # only the captured rows encoded
            capture = self.capture_tables[sae_at]
            rows = value.detach().index_select(0, capture.rows_on(value.device))
            self._keep_sae(sae_at, topk, capture, rows)

    def _keep_sae(
        self, site: str, topk: int | None, capture: SiteCapture, rows: torch.Tensor
    ) -> None:
        """Keep what the SAE site `site` computes from its host's captured `rows`."""
        for name, derived in self.saes.captured(site, rows, topk).items():
            self.store.add_gathered(name, capture, derived)

    def keep_row(self, site: str, capture_id: str, position: int, row: torch.Tensor) -> None:
        """Keep one captured row computed apart from the step's tables (an attention pattern's)."""
        if self.keeps_results:
            parts = [(capture_id, [position])]
            self.store.add_gathered(
                site, SiteCapture(torch.zeros(1, dtype=torch.long), parts), row[None]
            )

    def gather_rows(self) -> dict[int, torch.Tensor]:
        """The rows the capture buffers gather this step, per buffered site id (an SAE site's
        at its host); `keep_gathered` reads them back after the step."""
        self.gathering = gather_plan(self.capture_tables, self.order)
        return self.gathering.rows

    def keep_gathered(self, buffers: CaptureBuffers) -> list[int]:
        """Store this step's rows that the compiled model gathered into `buffers` (at the sites
        this worker holds: other pipeline stages keep theirs), SAE sites encoded from their
        host's; the buffered sites read."""
        plan = self.gathering
        gathered = {
            site_id: buffers.gathered(site_id, len(rows))
            for site_id, rows in plan.rows.items()
            if site_id in buffers.site_ids
        }
        topk = {site: k for at_host in self.sae_captures.values() for site, k in at_host}
        for site, (site_id, pick) in plan.picks.items():
            if site_id not in gathered:
                continue
            capture = self.capture_tables[site]
            rows = gathered[site_id]
            if pick is not None:
                rows = rows.index_select(0, on_device(pick, rows.device))
            if sae_site(site) is None:
                self.store.add_gathered(site, capture, rows)
            elif site in topk:  # else its host has no SAE: the front end says so
                self._keep_sae(site, topk[site], capture, rows)
        return list(gathered)

    def keep_scores(
        self, reads: list[ProbeRead], scores: torch.Tensor, computed: Callable[[str], int]
    ) -> None:
        """Keep this step's probe scores (`scores`: the step's buffer, `reads`: whose rows)
        under each request's probe id, as `probe_store_name(name)`; `computed(req_id)`: the
        tokens of the request computed before this step. A probe another pipeline stage
        reads is kept there."""
        if not self.keeps_results:
            return
        for read in reads:
            probe = read.probe.probe
            if self.held is not None and self.order[probe.site] not in self.held:
                continue
            rows: list[int] = []
            parts: list[tuple[str, list[int]]] = []
            for req_id, probe_id, start, end in read.requests:
                first = computed(req_id)
                rows.extend(range(start, end))
                parts.append((probe_id, list(range(first, first + end - start))))
            index = torch.tensor(rows, dtype=torch.long)
            slots = slice(read.first_slot, read.first_slot + probe.outputs)
            values = scores[:, slots].index_select(0, on_device(index, scores.device))
            self.store.add_gathered(probe_store_name(probe.name), SiteCapture(index, parts), values)

    def take_captures(
        self, capture_ids: list[str], handoff: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The rows of `capture_ids`, as files in the front end's `handoff` directory when
        it is on this host (`capture_files`), else inline."""
        if not self.keeps_results:
            return {}
        return self.store.take(capture_ids, self.files.encoder(handoff))
