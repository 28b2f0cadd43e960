"""Probes and gated steering inside the compiled model (`vinterp.Probe`, `Steering(when=)`).

Each output of each probe of a step has a slot s: at the probe's site the model computes

    scores[t, s] = weight[s] . x[t] + bias[s]   (float32; x the site's value before steering)

and keeps it in a persistent (tokens, slots) buffer, which the runner copies out after the
step for the requests that asked. A gated steering has rows of its own in the steering tables
(`gated_rows[combo, site]`, beside the ungated `site_rows`), each with the slot of its gate and
a threshold; at every site

    passes[t] = sign[row] * (scores[t, gate_slot[row]] - threshold[row]) > 0
    delta += passes[t] * (what the gated row adds)

so the decision is made per token inside the step (a probe is read at or before the sites it
gates). Slot 0 and row 0 are zero. The compiled model carries both formulas only at the sites
named at engine start (`probe_sites`), so every other site costs what it costs without probes;
a step that probes or gates elsewhere, or needs more slots or rows than the buffers hold, runs
uncompiled with tables of the same form, at the sites it probes and gates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vinterp.interventions.host_to_device import upload
from vinterp.interventions.site_settings import site_list_setting, steerable_site_ids
from vinterp.sites.names import SiteOrder

# The probe outputs the compiled buffers hold in a step (slot 0 aside)
PROBE_SLOTS = 16


def probe_sites_setting(value: object) -> list[str]:
    """The engine setting `probe_sites`: the sites whose probes and gates are compiled."""
    return site_list_setting("probe_sites", value, "probe scoring (and gating)")


def probe_site_ids(setting: list[str], order: SiteOrder) -> frozenset[int]:
    """The ids of the `probe_sites`; a site that cannot be probed raises UnknownSiteError."""
    return steerable_site_ids("probe_sites", setting, order, "cannot be probed; probes read")


@dataclass
class ProbeTables:
    """The tensors the probe and gate formulas read (module docstring)."""

    weight: torch.Tensor  # (slots, H) float32
    bias: torch.Tensor  # (slots,) float32
    site: torch.Tensor  # (slots,) int64: the site a slot's probe reads (-1: none)
    scores: torch.Tensor  # (tokens, slots) float32, written at each slot's site
    gated_rows: torch.Tensor  # (combos, sites) int64: the gated steering's table row
    gate_slot: torch.Tensor  # (rows,) int64
    threshold: torch.Tensor  # (rows,) float32
    sign: torch.Tensor  # (rows,) float32: 1 passes above the threshold, -1 below

    @classmethod
    def zeros(
        cls,
        slots: int,
        hidden: int,
        tokens: int,
        combos: int,
        sites: int,
        rows: int,
        device: torch.device | str,
    ) -> ProbeTables:
        def z(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            z(slots, hidden),
            z(slots),
            torch.full((slots,), -1, dtype=torch.long, device=device),
            z(tokens, slots),
            z(combos, sites, dtype=torch.long),
            z(rows, dtype=torch.long),
            z(rows),
            torch.ones(rows, device=device),
        )

    def fits(self, buffers: ProbeTables) -> bool:
        """Whether these host tables fit the persistent buffers."""
        return all(
            len(getattr(self, name)) <= len(getattr(buffers, name))
            for name in ("weight", "gated_rows", "gate_slot")
        )

    def upload_to(self, buffers: ProbeTables) -> None:
        """Copy into the persistent buffers' first rows; slots past these read no site."""
        for name in self.__dataclass_fields__:
            if name != "scores":
                mine = getattr(self, name)
                upload(getattr(buffers, name)[: len(mine)], mine)
        buffers.site[len(self.site) :] = -1

    def with_scores(self, tokens: int) -> ProbeTables:
        """These tables with a zero scores buffer of `tokens` rows (an uncompiled step's)."""
        fields = {n: getattr(self, n) for n in self.__dataclass_fields__}
        fields["scores"] = torch.zeros(tokens, len(self.weight))
        return ProbeTables(**fields)

    def to(self, device: torch.device) -> ProbeTables:
        return ProbeTables(*(getattr(self, n).to(device) for n in self.__dataclass_fields__))


def probe_scores(
    t: ProbeTables, site: torch.Tensor, source: torch.Tensor, reads_here: bool
) -> torch.Tensor:
    """This step's scores (tokens, slots) as they stand at `site`: the slots of probes at
    `site` computed from its value `source` and kept (when `reads_here`), the rest as earlier
    sites left them."""
    kept = t.scores[: source.shape[0]]
    if not reads_here:
        return kept
    fresh = source.float() @ t.weight.T + t.bias
    scores = torch.where(t.site == site, fresh, kept)
    kept.copy_(scores)
    return scores


def gate_passes(t: ProbeTables, scores: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
    """(tokens, 1) float32: 1 where the gated row's probe score passes its threshold."""
    score = scores.gather(1, t.gate_slot[gated].unsqueeze(1)).squeeze(1)
    passes = t.sign[gated] * (score - t.threshold[gated]) > 0
    return passes.unsqueeze(1).float()


class ProbeBuffers(nn.Module):
    """The persistent ProbeTables of an engine with `probe_sites`."""

    def __init__(
        self,
        sites: frozenset[int],
        num_sites: int,
        hidden_size: int,
        max_tokens: int,
        max_combos: int,
        max_rows: int,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.sites = sites
        zeros = ProbeTables.zeros(
            PROBE_SLOTS + 1, hidden_size, max_tokens, max_combos, num_sites, max_rows, device
        )
        for name in ProbeTables.__dataclass_fields__:
            self.register_buffer(name, getattr(zeros, name), persistent=False)

    def tables(self) -> ProbeTables:
        return ProbeTables(*(getattr(self, n) for n in ProbeTables.__dataclass_fields__))
