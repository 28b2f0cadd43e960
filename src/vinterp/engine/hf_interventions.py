"""Steering and capture on the HF backend: the reference that vLLM's steering and capture
are checked against.

Written from the API's definitions (API.md section 5), token by token, and independently of
the workers' tables (`vinterp.interventions`), so that a test comparing the two backends checks
the workers' tables against the definition, not against itself. The order at a site is the
workers': steering first, then capture (which records the steered value), then a trace.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.sites.attention_pattern import Pattern
from vinterp.sites.names import SiteOrder, sae_site
from vinterp.wire.probes import Probe, probe_store_name
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Steering


def steers(spec: Steering, position: int, prompt_len: int) -> bool:
    """Whether `spec` adds its vector at this token: its phase, and its prompt positions."""
    in_prompt = position < prompt_len
    if (spec.phase == "prefill" and not in_prompt) or (spec.phase == "decode" and in_prompt):
        return False
    return spec.positions is None or (in_prompt and position in spec.positions)


def captures(positions: str | list[int], position: int, prompt_len: int) -> bool:
    """Whether a capture with this position selector records this token."""
    if isinstance(positions, list):
        return position in positions
    return {
        "last_prompt": position == prompt_len - 1,
        "all_prompt": position < prompt_len,
        "all_generated": position >= prompt_len,
        "all": True,
    }[positions]


@dataclass
class HFRequest:
    """One request's steering (global, named, its own, in that order) and capture."""

    steering: list[Steering]
    prompt_len: int
    capture_id: str | None = None
    capture_sites: frozenset[str] = frozenset()
    capture_positions: str | list[int] = "last_prompt"
    capture_heads: list[int] | None = None  # of the attention patterns it captures
    capture_topk: int | None = None  # of the SAE feature sites it captures
    first_position: int = 0  # of the tokens the current forward step computes
    probes: list[Probe] = field(default_factory=list)
    scores: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (probe, position)


@dataclass
class HFInterventions:
    """The HF engine's global and named steerings, and captured rows until they are taken."""

    saes: SaeRegistry
    global_steering: list[Steering] = field(default_factory=list)
    named: dict[str, Steering] = field(default_factory=dict)
    current: HFRequest | None = None  # the request whose step is running
    _captured: dict[str, dict[str, dict[int, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict))
    )

    def request(self, specs: RequestSpecs | None, prompt_len: int, order: SiteOrder) -> HFRequest:
        """A request's interventions (None: the global steering only)."""
        specs = specs or RequestSpecs()
        named = [self.named[n] for n in specs.steering_names if n in self.named]
        request = HFRequest([*self.global_steering, *named, *specs.steering], prompt_len)
        if specs.probes:
            request.capture_id, request.probes = specs.capture_id, list(specs.probes)
        if specs.capture is not None:
            request.capture_id = specs.capture_id
            request.capture_sites = frozenset(
                s for pattern in specs.capture.sites for s in order.expand(pattern)
            )
            request.capture_positions = specs.capture.positions
            request.capture_heads = specs.capture.heads
            request.capture_topk = specs.capture.topk
        return request

    def at_site(self, site: str, value: torch.Tensor) -> torch.Tensor | None:
        """Steer the current step's (T, H) rows at `site` and record what is captured there
        (a router site's rows are (T, experts) or (T, top_k), a per-head site's (T, heads,
        head_dim)); the steered value, or None when no steering applies."""
        request = self.current
        if request is None:
            return None
        positions = range(request.first_position, request.first_position + value.shape[0])
        self._score(request, site, value, positions)
        deltas = [
            delta
            for delta in (
                _steering_delta(request, site, value, positions),
                _feature_delta(request, site, value, positions, self.saes),
            )
            if delta is not None
        ]
        # the sum rounded once to the model's dtype, as the engine's site formula rounds it
        steered = (value.float() + sum(deltas)).to(value.dtype) if deltas else None
        if site in request.capture_sites:
            assert request.capture_id is not None
            rows = self._captured[request.capture_id][site]
            seen = value if steered is None else steered
            for t, position in enumerate(positions):
                if captures(request.capture_positions, position, request.prompt_len):
                    rows[position] = seen[t].detach().clone()
        for sae_at in request.capture_sites:
            parsed = sae_site(sae_at)
            if parsed is not None and parsed.host == site and parsed.host in self.saes.saes:
                self._capture_sae(request, sae_at, value if steered is None else steered, positions)
        return steered

    def _score(self, request: HFRequest, site: str, value: torch.Tensor, positions: range) -> None:
        """The scores of the request's probes at `site`, from its value before steering: kept
        for its output and for the gates at this and later sites."""
        for probe in request.probes:
            if probe.site != site:
                continue
            scores = probe.scores(value)
            rows = self._captured[request.capture_id][probe_store_name(probe.name)]  # type: ignore[index]
            for t, position in enumerate(positions):
                rows[position] = scores[t].detach().clone()
                request.scores[probe.name, position] = scores[t]

    def _capture_sae(
        self, request: HFRequest, site: str, seen: torch.Tensor, positions: range
    ) -> None:
        """Record what a capture of an SAE site keeps of its host's captured rows."""
        picked = [
            t
            for t, p in enumerate(positions)
            if captures(request.capture_positions, p, request.prompt_len)
        ]
        if not picked:
            return
        derived = self.saes.captured(site, seen[picked].detach(), request.capture_topk)
        for name, values in derived.items():
            rows = self._captured[request.capture_id][name]  # type: ignore[index]
            for row, t in zip(values, picked):
                rows[positions[t]] = row.clone()

    def at_pattern(self, site: str, pattern: Pattern) -> None:
        """Record the last prompt token's row of an attention pattern the current request
        captures (the prompt is one forward here)."""
        request = self.current
        if request is None or site not in request.capture_sites or request.first_position:
            return
        assert request.capture_id is not None
        row = pattern.row(-1, request.capture_heads)
        self._captured[request.capture_id][site][request.prompt_len - 1] = row

    def take(self, capture_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Per capture id and site: positions in order and their rows (as `merge_captures`)."""
        out: dict[str, dict[str, Any]] = {}
        for cid in capture_ids:
            sites = self._captured.pop(cid, {})
            out[cid] = {}
            for site, rows in sites.items():
                positions = sorted(rows)
                out[cid][site] = {
                    "positions": positions,
                    "values": torch.stack([rows[p] for p in positions]),
                }
        return out


def _feature_delta(
    request: HFRequest, site: str, value: torch.Tensor, positions: range, saes: SaeRegistry
) -> torch.Tensor | None:
    """What steering of the features of the SAE at `site` adds, from the definition: at each
    steered token, features f = encode(x) of the unsteered value become f' (a clamp sets a
    feature, the last clamp of it wins; adds add to it), and x gains decode(f') - decode(f)."""
    features_site = f"{site}.sae.features"
    specs = [spec for spec in request.steering if features_site in spec.features]
    if not specs:
        return None
    sae = saes.of(site)
    rows, changes = [], []
    for t, position in enumerate(positions):
        clamped: dict[int, float] = {}
        added: dict[int, float] = defaultdict(float)
        for spec in specs:
            if steers(spec, position, request.prompt_len):
                for j, v in spec.features[features_site].items():
                    if spec.mode == "clamp":
                        clamped[j] = spec.scale * v
                    else:
                        added[j] += spec.scale * v
        if clamped or added:
            rows.append(t)
            changes.append((clamped, added))
    delta = torch.zeros(value.shape, dtype=torch.float32)
    if not rows:
        return delta
    x = value[rows]
    f = sae.encode(x)
    new = f.clone()
    for r, (clamped, added) in enumerate(changes):
        for j in clamped.keys() | added.keys():
            new[r, j] = clamped.get(j, f[r, j]) + added.get(j, 0.0)
    delta[rows] = (sae.decode(new, x) - sae.decode(f, x)).float()
    return delta


def _steering_delta(
    request: HFRequest, site: str, value: torch.Tensor, positions: range
) -> torch.Tensor | None:
    """The sum of every applying spec's addend, in float32; a norm-matched
    addend is scaled by the token's norm before any steering at this site, an ablation's is
    minus scale times the component of that value along its unit direction. A gated spec
    applies where its probe's score at the token passes `when`."""
    specs = [spec for spec in request.steering if site in spec.vectors]
    if not specs:  # most sites of most steps: nothing to compute
        return None
    delta: torch.Tensor | None = None
    norms = value.float().norm(dim=-1)
    for spec in specs:
        vector = spec.vectors[site].float()
        unit = vector / vector.norm().clamp_min(1e-12)
        for t, position in enumerate(positions):
            if not steers(spec, position, request.prompt_len):
                continue
            when = spec.when
            if when is not None:
                score = request.scores[when.probe, position][when.output]
                if not bool(when.passes(score)):
                    continue
            if spec.mode == "ablate":
                addend = -spec.scale * torch.dot(value[t].float(), unit) * unit
            else:
                addend = spec.scale * (norms[t] * unit if spec.norm_match else vector)
            delta = torch.zeros(value.shape, dtype=torch.float32) if delta is None else delta
            delta[t] += addend
    return delta
