"""Host side of in-graph steering: per step, which spec combination each token gets and what
each combination adds at each site, written into the persistent buffers before the forward.

`plan` runs when the scheduler's batch is known (before vLLM picks the graph mode, so a step
whose steering does not fit the buffers can be run uncompiled with larger tables); `write`
runs once the runner has laid the batch out, and copies only what changed: the per-token
combination ids when they differ from the last step's, the tables when the set of
combinations changed. Per request, the work is a dictionary lookup in decode steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vinterp.interventions.applied import steered_per_site
from vinterp.interventions.feature_buffers import FeatureTables
from vinterp.interventions.host_to_device import upload
from vinterp.interventions.probe_buffers import ProbeTables
from vinterp.interventions.probe_tables import (
    Probed,
    ProbeRead,
    ProbeSlots,
    probe_reads,
    probe_slots,
    probe_tables,
)
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import WorkerProbe, WorkerSteering
from vinterp.interventions.steer_buffers import SteerBuffers, SteerTables
from vinterp.sites.names import SiteOrder


@dataclass
class RequestSteering:
    """One request's steering specs in order, and those that steer its generated tokens (the
    same for all of them), worked out once: most steps are decode steps."""

    specs: tuple[WorkerSteering, ...]
    prompt_len: int
    probes: tuple[WorkerProbe, ...] = ()
    probe_id: str = ""  # the id its probes' scores are kept under
    generated: tuple[WorkerSteering, ...] = field(init=False)
    generated_key: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        at = np.array([self.prompt_len])
        self.generated = tuple(s for s in self.specs if s.applies(at, self.prompt_len)[0])
        self.generated_key = tuple(s.serial for s in self.generated)


@dataclass
class SteeredRequest:
    """One scheduled request's steering this step: its first position and token count."""

    req_id: str
    first: int
    num_tokens: int
    steering: RequestSteering


@dataclass
class SteerPlan:
    combos: dict[str, int | np.ndarray]  # req id -> combination id of its tokens this step
    key: tuple[tuple[int, ...], ...]  # the combinations (spec serials), in id order
    saes: int = 0  # the SAE attachments so far: tables built from a replaced SAE are built again
    site_rows: np.ndarray | None = None  # (combos, sites), built only when key changed
    gated_rows: np.ndarray | None = None  # (combos, sites): the gated steering's rows
    add: torch.Tensor | None = None
    unit: torch.Tensor | None = None
    ablate: torch.Tensor | None = None
    ablate_scale: torch.Tensor | None = None
    features: FeatureTables | None = None  # SAE features' tables, when key changed and any
    steered_hosts: frozenset[int] = frozenset()  # the hosts whose SAE features are steered
    slots: ProbeSlots = field(default_factory=dict)  # this step's probes (`probe_tables`)
    probes: ProbeTables | None = None  # their tables and the gates, when key changed and any
    probed: Probed = field(default_factory=dict)  # the requests with probes
    overflow: bool = False  # the step runs uncompiled: its tables do not fit the buffers, or
    # the compiled model holds no steering

    @property
    def loaded_key(self) -> tuple[Any, ...]:
        """What the buffers' tables are built from: combinations, probes, SAE attachments."""
        return self.key, tuple(self.slots), self.saes


def _combinations(
    requests: list[SteeredRequest],
) -> tuple[dict[str, int | np.ndarray], dict[tuple[int, ...], tuple[WorkerSteering, ...]]]:
    """Per request, a combination id (one for all its tokens, or one per token while its
    prompt is computed); and each combination's specs, keyed by their serials, in id order
    (id 0: none)."""
    combos: dict[tuple[int, ...], tuple[WorkerSteering, ...]] = {(): ()}
    ids: dict[tuple[int, ...], int] = {(): 0}

    def combo_id(key: tuple[int, ...], chosen: tuple[WorkerSteering, ...]) -> int:
        found = ids.get(key)
        if found is None:
            found = ids[key] = len(combos)
            combos[key] = chosen
        return found

    per_request: dict[str, int | np.ndarray] = {}
    for req in requests:
        steering = req.steering
        if req.first >= steering.prompt_len:
            per_request[req.req_id] = combo_id(steering.generated_key, steering.generated)
            continue
        positions = np.arange(req.first, req.first + req.num_tokens)
        specs = steering.specs
        codes = np.zeros(len(positions), dtype=np.int64)
        for bit, spec in enumerate(specs):  # a token's code: which of the specs apply to it
            codes |= spec.applies(positions, steering.prompt_len).astype(np.int64) << bit
        token_ids = np.zeros_like(codes)
        for code in np.unique(codes):
            chosen = tuple(s for bit, s in enumerate(specs) if code >> bit & 1)
            token_ids[codes == code] = combo_id(tuple(s.serial for s in chosen), chosen)
        per_request[req.req_id] = token_ids
    return per_request, combos


@dataclass
class VectorTables:
    """A plan's vector tables: per combination and site its row (`site_rows`) and its gated
    steering's row (`gated_rows`); per row the summed plain (add) and norm-matched (unit)
    vectors, the directions ablated (rows, slots, H) and their scales (rows, slots), a slot
    per ablation of the row's specs at its site (one at least), and the gate of a gated row
    (None for the others). Row 0 is zero."""

    site_rows: np.ndarray
    gated_rows: np.ndarray
    add: torch.Tensor
    unit: torch.Tensor
    ablate: torch.Tensor
    ablate_scale: torch.Tensor
    gates: list[WorkerSteering | None]


def _tables(
    specs_by_combo: list[tuple[WorkerSteering, ...]], order: SiteOrder, hidden_size: int
) -> VectorTables:
    site_rows = np.zeros((len(specs_by_combo), len(order.sites)), dtype=np.int64)
    gated_rows = np.zeros_like(site_rows)
    adds, units = [torch.zeros(hidden_size)], [torch.zeros(hidden_size)]
    ablations: list[list[tuple[torch.Tensor, float]]] = [[]]
    gates: list[WorkerSteering | None] = [None]

    def row(specs: list[WorkerSteering], site: str) -> int:
        add, unit, ablated = torch.zeros(hidden_size), torch.zeros(hidden_size), []
        for spec in specs:
            if site not in spec.vectors:
                continue
            if spec.ablates:
                ablated.append((spec.direction(site), spec.steering.scale))
            else:
                target = unit if spec.norm_match else add
                target += spec.scaled(site)
        adds.append(add)
        units.append(unit)
        ablations.append(ablated)
        gates.append(next((s for s in specs if s.gate is not None), None))
        return len(adds) - 1

    for combo, specs in enumerate(specs_by_combo):
        for site in dict.fromkeys(s for spec in specs for s in spec.sites):
            plain = [s for s in specs if s.gate is None]
            if any(site in s.sites for s in plain):
                site_rows[combo, order[site]] = row(plain, site)
            gated = [s for s in specs if s.gate is not None and site in s.vectors]
            if gated:  # a request's gated steerings share one gate at a site (`gating_misfit`)
                gated_rows[combo, order[site]] = row(gated, site)
    slots = max(1, *map(len, ablations))
    directions = torch.zeros(len(adds), slots, hidden_size)
    scales = torch.zeros(len(adds), slots)
    for r, ablated in enumerate(ablations):
        for slot, (direction, scale) in enumerate(ablated):
            directions[r, slot], scales[r, slot] = direction, scale
    return VectorTables(
        site_rows, gated_rows, torch.stack(adds), torch.stack(units), directions, scales, gates
    )


def _feature_tables(
    specs_by_combo: list[tuple[WorkerSteering, ...]],
    site_rows: np.ndarray,
    num_rows: int,
    order: SiteOrder,
    saes: SaeRegistry,
    width: int,
    slots: int,
) -> FeatureTables | None:
    """The SAE feature tables (`feature_buffers`): a slot per host whose features are steered
    (`slots` in all, more if more hosts are steered), `width` columns (more if a host has more
    features: then they do not fit the buffers), and
    per table row at a host its features' values and which are clamped. At a token, a clamp
    sets the feature (the last clamp of it wins), adds add to it: value = clamp + adds."""
    hosts: dict[str, dict[int, int]] = {}  # host -> feature -> column
    for specs in specs_by_combo:
        for spec in specs:
            for host, chosen in spec.features.items():
                columns = hosts.setdefault(host, {})
                for j in chosen:
                    columns.setdefault(j, len(columns))
    if not hosts:
        return None
    width = max(width, *map(len, hosts.values()))
    slots = max(slots, len(hosts) + 1)
    hidden = saes.of(next(iter(hosts))).d_in
    tables = FeatureTables.zeros(len(order.sites), slots, width, num_rows, hidden, "cpu")
    for slot, (host, columns) in enumerate(hosts.items(), 1):
        tables.site_slot[order[host]] = slot
        tables.fill_slot(slot, saes.of(host), list(columns))
    for combo, specs in enumerate(specs_by_combo):
        for host, columns in hosts.items():
            row = site_rows[combo, order[host]]
            clamped: dict[int, float] = {}
            added: dict[int, float] = {}
            for spec in specs:
                for j, v in spec.features.get(host, {}).items():
                    if spec.clamps:
                        clamped[j] = v
                    else:
                        added[j] = added.get(j, 0.0) + v
            for j in clamped.keys() | added.keys():
                tables.value[row, columns[j]] = clamped.get(j, 0.0) + added.get(j, 0.0)
                tables.clamp[row, columns[j]] = j in clamped
    return tables


@dataclass
class SteeringPlanner:
    """Plans each step's steering and keeps the persistent buffers up to date."""

    buffers: SteerBuffers
    order: SiteOrder
    saes: SaeRegistry  # the SAEs whose features steering names
    plan_: SteerPlan | None = None
    _loaded_key: tuple | None = field(default=None)
    # what the first rows of the token_combo buffer hold (the rest is zero): a decode step
    # usually repeats the last step's, and then nothing is copied
    _on_device: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # the plan and batch layout the buffers were last filled for: a decode step that repeats
    # them (the common case) has nothing to do
    _written: tuple[SteerPlan | None, list[tuple[str, int, int]]] | None = None
    # the host copies of what this step's steering reads: (token_combo, site_rows)
    _step_tables: tuple[np.ndarray, np.ndarray] | None = None
    _loaded_site_rows: np.ndarray | None = None
    _features_loaded = False  # whether the feature buffers hold a plan's slots
    # this step's probed requests' rows, grouped by probe (`probe_tables.ProbeRead`)
    probe_reads: list[ProbeRead] = field(default_factory=list)

    def plan(self, requests: list[SteeredRequest]) -> bool:
        """Plan this step; True when it must run uncompiled (tables too large, or no steering
        in the compiled model)."""
        buffers = self.buffers
        buffers.overflow = None
        buffers.active = bool(requests)
        buffers.steered_hosts = frozenset()
        buffers.probed_sites = buffers.gated_sites = frozenset()
        self.probe_reads = []  # until `write` lays this step out (a step of no tokens does not)
        if not requests:
            self.plan_ = None
            return False
        per_request, combos = _combinations(requests)
        probes = probe_slots(r.steering.probes for r in requests)
        plan = SteerPlan(per_request, tuple(combos), self.saes.attachments, slots=probes)
        plan.probed = {
            r.req_id: (r.steering.probe_id, r.steering.probes)
            for r in requests
            if r.steering.probes
        }
        specs_by_combo = list(combos.values())
        plan.steered_hosts = frozenset(
            self.order[host] for specs in specs_by_combo for spec in specs for host in spec.features
        )
        probed_sites = frozenset(self.order[p.probe.site] for p, _ in probes.values())
        gated_sites = frozenset(
            self.order[site]
            for specs in specs_by_combo
            for spec in specs
            if spec.gate is not None
            for site in spec.vectors
        )
        if plan.loaded_key != self._loaded_key:
            vectors = _tables(specs_by_combo, self.order, buffers.add.shape[1])
            plan.site_rows, plan.gated_rows = vectors.site_rows, vectors.gated_rows
            plan.add, plan.unit = vectors.add, vectors.unit
            plan.ablate, plan.ablate_scale = vectors.ablate, vectors.ablate_scale
            if probes:
                plan.probes = probe_tables(probes, vectors.gated_rows, vectors.gates, self.order)
            probe_buffers = buffers.probes
            feature_buffers = buffers.features
            slots, width = (0, 0) if feature_buffers is None else feature_buffers.enc.shape[:2]
            plan.features = _feature_tables(
                specs_by_combo, plan.site_rows, len(plan.add), self.order, self.saes, width, slots
            )
            plan.overflow = (
                not buffers.in_graph
                or len(plan.site_rows) > buffers.site_rows.shape[0]
                or len(plan.add) > buffers.add.shape[0]
                or plan.ablate.shape[1] > buffers.ablate.shape[1]
                or (
                    plan.features is not None
                    and (
                        feature_buffers is None
                        or not plan.steered_hosts <= feature_buffers.hosts  # a host not compiled
                        or not plan.features.fits(feature_buffers)
                    )
                )
                or (
                    plan.probes is not None
                    and (
                        probe_buffers is None
                        or not probed_sites | gated_sites <= probe_buffers.sites  # not compiled
                        or not plan.probes.fits(probe_buffers.tables())
                    )
                )
            )
            if plan.overflow:
                self._loaded_key = None
        buffers.steered_hosts = plan.steered_hosts
        buffers.probed_sites, buffers.gated_sites = probed_sites, gated_sites
        self.plan_ = plan
        return plan.overflow

    def write(self, layout: Callable[[], list[tuple[str, int, int]]], num_tokens: int) -> None:
        """Fill the buffers for this step's batch: `layout()` gives (req id, first row, end
        row) per request, asked for only when something is steered."""
        plan = self.plan_
        if plan is None:
            self._written = self._step_tables = None
            self.probe_reads = []
            if len(self._on_device):
                self.buffers.token_combo[: len(self._on_device)].zero_()
                self._on_device = np.zeros(0, dtype=np.int64)
            return
        rows = layout()
        if self._written is not None and self._written[0] is plan and self._written[1] == rows:
            return
        self._written = (plan, rows)
        self._step_tables = None
        self.probe_reads = probe_reads(plan.slots, plan.probed, rows)
        token_combo = np.zeros(max(num_tokens, len(self._on_device)), dtype=np.int64)
        for req_id, start, end in rows:
            ids = plan.combos.get(req_id)
            if ids is not None:
                token_combo[start:end] = ids
        buffers = self.buffers
        if plan.overflow:
            buffers.overflow = SteerTables(
                torch.from_numpy(token_combo).to(buffers.token_combo.device),
                torch.from_numpy(plan.site_rows).to(buffers.site_rows.device),
                plan.add.to(buffers.add),  # type: ignore[union-attr]
                plan.unit.to(buffers.unit),  # type: ignore[union-attr]
                plan.ablate.to(buffers.ablate.device),  # type: ignore[union-attr]
                plan.ablate_scale.to(buffers.ablate.device),  # type: ignore[union-attr]
                None if plan.features is None else plan.features.to(buffers.add.device),
                None
                if plan.probes is None
                else plan.probes.with_scores(len(token_combo)).to(buffers.add.device),
            )
            self._step_tables = (token_combo, plan.site_rows)  # type: ignore[assignment]
            return
        if plan.site_rows is not None:
            upload(buffers.site_rows[: len(plan.site_rows)], torch.from_numpy(plan.site_rows))
            upload(buffers.add[: len(plan.add)], plan.add.to(buffers.add.dtype))  # type: ignore[arg-type]
            upload(buffers.unit[: len(plan.unit)], plan.unit.to(buffers.unit.dtype))  # type: ignore[arg-type]
            upload(buffers.ablate[: len(plan.add)], plan.ablate)  # type: ignore[arg-type]
            upload(buffers.ablate_scale[: len(plan.add)], plan.ablate_scale)  # type: ignore[arg-type]
            self._load_features(plan.features)
            self._load_probes(plan)
            self._loaded_key, self._loaded_site_rows = plan.loaded_key, plan.site_rows
        if not np.array_equal(token_combo, self._on_device):
            upload(buffers.token_combo[: len(token_combo)], torch.from_numpy(token_combo))
            self._on_device = token_combo
        self._step_tables = (token_combo, self._loaded_site_rows)  # type: ignore[assignment]

    def _load_probes(self, plan: SteerPlan) -> None:
        """Put a plan's probe tables and gated rows into the probe buffers (a plan without
        probes points every combination at the zero gated row)."""
        probes = self.buffers.probes
        if probes is None:
            return
        if plan.probes is not None:
            plan.probes.upload_to(probes.tables())
        else:
            assert plan.gated_rows is not None
            upload(probes.gated_rows[: len(plan.gated_rows)], torch.from_numpy(plan.gated_rows))

    def scores(self) -> torch.Tensor:
        """The scores buffer this step's probes write (`probe_reads` says whose rows)."""
        tables = self.buffers.tables()
        assert tables.probes is not None
        return tables.probes.scores

    def _load_features(self, tables: FeatureTables | None) -> None:
        """Put a plan's SAE feature tables into the feature buffers; a plan without features
        points every site at the zero slot (the buffers' rows may hold another plan's)."""
        features = self.buffers.features
        if features is None:
            return
        if tables is not None:
            tables.upload_to(features.tables())
        elif self._features_loaded:
            features.site_slot.zero_()
        self._features_loaded = tables is not None

    def steered_per_site(self) -> np.ndarray | None:
        """Per site, the tokens this step's steering steers there (None: no steering)."""
        if self._step_tables is None:
            return None
        return steered_per_site(*self._step_tables)
