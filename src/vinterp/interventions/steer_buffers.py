"""Steering inside the compiled model: persistent tables read by plain tensor ops.

A CUDA-graph replay runs the kernels recorded at capture and no Python, so per-step steering
cannot be a decision made at the site. Instead every site computes

    out = x + add[row] + |x| * unit[row] - sum_k s[row, k] (x . d[row, k]) d[row, k] + sae[row]
    row = site_rows[token_combo[t], site]

from buffers at fixed addresses that the runner fills before each step, outside the graph:
`token_combo` says which combination of steering specs applies to each token of the flat
batch, `site_rows` which table row that combination adds at each site, `add`/`unit` hold the
summed plain and norm-matched vectors, `ablate`/`ablate_scale` the unit directions that
ablation projects out and their scales (one slot in the persistent buffers; a combination
that ablates more directions at one site gets larger tables, and its step runs uncompiled).
Row 0 of every table is zero and combination 0 maps
every site to row 0, so an unsteered token gets exactly `x + 0`. `sae[row]` is what steering
in the feature basis of an attached SAE adds (`feature_buffers`: clamped or added features,
computed from x with the SAE's encoder columns), zero at row 0 as well; only the hosts named at
engine start compute it in the compiled model. The ops are ordinary tensor
ops, so torch.compile fuses them into the neighbouring kernels (the norm and residual adds
around every site) rather than adding a pass over the activations.

The buffers are registered on the model (as a submodule of every site module), so the
compiled graph takes them as inputs like weights: updates are seen without recompiling, also
when vLLM loads the compiled graph from its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vinterp.interventions.applied import AppliedCounters
from vinterp.interventions.feature_buffers import (
    SAE_STEERING_FEATURES,
    FeatureBuffers,
    FeatureTables,
    feature_delta,
)
from vinterp.interventions.graph_recording import ops_recorded
from vinterp.interventions.probe_buffers import (
    ProbeBuffers,
    ProbeTables,
    gate_passes,
    probe_scores,
)


@dataclass
class SteerTables:
    """The tensors the site formula reads (the persistent buffers, or larger ones for a step
    whose steering does not fit them: such a step runs uncompiled)."""

    token_combo: torch.Tensor  # (tokens,) int64
    site_rows: torch.Tensor  # (combos, sites) int64
    add: torch.Tensor  # (rows, H) model dtype
    unit: torch.Tensor  # (rows, H) model dtype
    ablate: torch.Tensor  # (rows, slots, H) float32 unit directions
    ablate_scale: torch.Tensor  # (rows, slots) float32
    features: FeatureTables | None = None  # SAE feature steering (None: no feature tables)
    probes: ProbeTables | None = None  # probes and gated steering (None: no probe tables)


class SteerBuffers(nn.Module):
    def __init__(
        self,
        num_sites: int,
        hidden_size: int,
        max_tokens: int,
        max_combos: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device | str,
        counters: AppliedCounters | None = None,
        feature_hosts: frozenset[int] = frozenset(),
        features_per_host: int = SAE_STEERING_FEATURES,
        probe_sites: frozenset[int] = frozenset(),
        in_graph: bool = True,
    ) -> None:
        """`feature_hosts`: the sites whose SAE feature steering is compiled, `features_per_host`
        features each (none: steps that steer features run uncompiled); `probe_sites`: the
        sites whose probes and gated steering are compiled (a step with probes or gates
        elsewhere runs uncompiled); `in_graph=False`: the compiled model holds no steering
        ops (every steered step runs uncompiled), as an engine that only extracts wants: at
        a prefill step's thousands of tokens the formula at every site costs device time."""
        super().__init__()
        self.in_graph = in_graph
        self.counters = counters  # with the check on (`interventions.applied`)

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.register_buffer("token_combo", zeros(max_tokens), persistent=False)
        self.register_buffer("site_rows", zeros(max_combos, num_sites), persistent=False)
        self.register_buffer("add", zeros(max_rows, hidden_size, dtype=dtype), persistent=False)
        self.register_buffer("unit", zeros(max_rows, hidden_size, dtype=dtype), persistent=False)
        f32 = torch.float32
        self.register_buffer("ablate", zeros(max_rows, 1, hidden_size, dtype=f32), persistent=False)
        self.register_buffer("ablate_scale", zeros(max_rows, 1, dtype=f32), persistent=False)
        self.features = None
        if feature_hosts:
            self.features = FeatureBuffers(
                num_sites,
                feature_hosts,
                hidden_size,
                features_per_host,
                max_rows,
                torch.device(device),
            )
        self.probes = None
        if probe_sites:
            self.probes = ProbeBuffers(
                probe_sites, num_sites, hidden_size, max_tokens, max_combos, max_rows, device
            )
        self.overflow: SteerTables | None = None  # set only for steps run uncompiled
        self.active = False  # whether any token is steered this step
        self.steered_hosts: frozenset[int] = (
            frozenset()
        )  # the hosts whose features this step steers
        self.probed_sites: frozenset[int] = frozenset()  # the sites this step's probes read
        self.gated_sites: frozenset[int] = frozenset()  # and those its gated steering steers

    def tables(self) -> SteerTables:
        """The tables this step reads; in a recorded graph always the persistent buffers."""
        if not ops_recorded() and self.overflow is not None:
            return self.overflow
        features = None if self.features is None else self.features.tables()
        probes = None if self.probes is None else self.probes.tables()
        return SteerTables(
            self.token_combo,
            self.site_rows,
            self.add,
            self.unit,
            self.ablate,
            self.ablate_scale,
            features,
            probes,
        )

    def _probe_sites(self) -> frozenset[int]:
        """The sites that score probes or gate steering: in a recorded graph the engine's
        `probe_sites`, in an uncompiled step those this step's probes read and gates steer."""
        if ops_recorded():
            return self.probes.sites if self.probes is not None else frozenset()
        return self.probed_sites | self.gated_sites

    def _scoring_sites(self) -> frozenset[int]:
        """The sites that score probes (uncompiled: only where this step's probes read)."""
        return self._probe_sites() if ops_recorded() else self.probed_sites

    def forward(
        self,
        site_id: int,
        site: torch.Tensor,
        x: torch.Tensor,
        norm_of: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x plus this step's steering at `site` (the site id as a one-element tensor: a graph
        input, not a constant, so every layer's compiled graph is the same one; `site_id` only
        decides whether the site is a compiled SAE host); `norm_of` is the tensor whose row
        norms scale norm-matched vectors, whose SAE features are steered and whose component
        along an ablated direction is removed (the residual stream when x is one of its two
        parts). An uncompiled step with no steering skips the ops (Python may decide there, but
        never while a graph records: `ops_recorded`)."""
        if not (self.in_graph if ops_recorded() else self.active):
            return x
        t = self.tables()
        combo = t.token_combo[: x.shape[0]]
        rows = t.site_rows[combo, site]
        if self.counters is not None:
            self.counters.count_steered(site, rows)
        source = x if norm_of is None else norm_of
        norm = torch.linalg.vector_norm(source, dim=-1, keepdim=True, dtype=torch.float32)
        delta = _vector_delta(t, rows, source, norm)
        compiled = ops_recorded() and self.features is not None
        hosts = self.features.hosts if compiled else self.steered_hosts  # type: ignore[union-attr]
        if t.features is not None and site_id in hosts:
            delta = delta + feature_delta(t.features, site, source, rows)
        if t.probes is not None and site_id in self._probe_sites():
            scores = probe_scores(t.probes, site, source, site_id in self._scoring_sites())
            gated = t.probes.gated_rows[combo, site]
            delta = delta + gate_passes(t.probes, scores, gated) * _vector_delta(
                t, gated, source, norm
            )
        # one rounding to the model's dtype, of the sum: an ablation's delta nearly cancels x,
        # and rounding the delta first would leave its rounding error in the result (in bf16,
        # eager steps then part from compiled ones, whose fused kernels round only the sum)
        return (x.float() + delta).to(x.dtype)


def _vector_delta(
    t: SteerTables, rows: torch.Tensor, source: torch.Tensor, norm: torch.Tensor
) -> torch.Tensor:
    """What the table rows `rows` add to the site's value `source` (norm: its row norms),
    float32: the plain and norm-matched vectors, less the ablated components."""
    delta = t.add[rows].float() + norm * t.unit[rows].float()
    directions = t.ablate[rows]  # (tokens, slots, H)
    along = (source.float().unsqueeze(1) * directions).sum(-1) * t.ablate_scale[rows]
    return delta - (along.unsqueeze(-1) * directions).sum(1)
