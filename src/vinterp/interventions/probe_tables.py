"""Host side of probes and gated steering (`probe_buffers`): per step, a slot for each output
of each distinct probe of the scheduled requests, the tables the step reads, and which rows of
the scores buffer belong to whom once it has run."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vinterp.interventions.probe_buffers import ProbeTables
from vinterp.interventions.specs import WorkerProbe, WorkerSteering
from vinterp.sites.names import SiteOrder

# per probe serial: the probe and its first slot (slot 0 stays empty)
ProbeSlots = dict[int, tuple[WorkerProbe, int]]
# per probing request id: the id its scores are kept under, and its probes
Probed = dict[str, tuple[str, Sequence[WorkerProbe]]]


def probe_slots(probed: Iterable[Sequence[WorkerProbe]]) -> ProbeSlots:
    """The slots of this step's probes (each request's), each distinct probe once, in the
    order first met."""
    slots: ProbeSlots = {}
    first = 1
    for probes in probed:
        for probe in probes:
            if probe.serial not in slots:
                slots[probe.serial] = (probe, first)
                first += probe.probe.outputs
    return slots


def probe_tables(
    slots: ProbeSlots,
    gated_rows: np.ndarray,
    gates: list[WorkerSteering | None],
    order: SiteOrder,
) -> ProbeTables:
    """The host tables of a plan: the probes' weights in their slots, and per steering table
    row the slot and threshold of its gate (`gates`: the gated spec of each row, or None)."""
    width = 1 + sum(p.probe.outputs for p, _ in slots.values())
    hidden = int(next(iter(slots.values()))[0].probe.weight.shape[1])
    tables = ProbeTables.zeros(width, hidden, 0, *gated_rows.shape, len(gates), "cpu")
    for probe, first in slots.values():
        span = slice(first, first + probe.probe.outputs)
        tables.weight[span] = probe.probe.weight
        tables.bias[span] = probe.probe.offsets
        tables.site[span] = order[probe.probe.site]
    tables.gated_rows = torch.from_numpy(gated_rows)
    for row, spec in enumerate(gates):
        if spec is None or spec.gate is None or spec.steering.when is None:
            continue
        when = spec.steering.when
        tables.gate_slot[row] = slots[spec.gate.serial][1] + when.output
        above = when.above is not None
        tables.threshold[row] = when.above if above else when.below  # type: ignore[assignment]
        tables.sign[row] = 1.0 if above else -1.0
    return tables


@dataclass
class ProbeRead:
    """One probe's scores this step: its slots, and the requests that asked, each as
    (req id, the id its scores are kept under, first row, end row) of the flat batch."""

    probe: WorkerProbe
    first_slot: int
    requests: list[tuple[str, str, int, int]]


def probe_reads(
    slots: ProbeSlots, probed: Probed, layout: list[tuple[str, int, int]]
) -> list[ProbeRead]:
    """Whose rows of the scores buffer this step's probes wrote, grouped by probe."""
    reads = {serial: ProbeRead(probe, first, []) for serial, (probe, first) in slots.items()}
    for req_id, start, end in layout:
        found = probed.get(req_id)
        if found is not None:
            probe_id, probes = found
            for probe in probes:
                reads[probe.serial].requests.append((req_id, probe_id, start, end))
    return [read for read in reads.values() if read.requests]
