"""Probes and gated steering without an engine: the spec and its checks, the wire forms, and
the site formula over the planner's tables (compiled buffers and uncompiled tables) against
scores and gates computed by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vinterp.api.requests import check_steering
from vinterp.interventions.probe_buffers import probe_site_ids, probe_sites_setting
from vinterp.interventions.probe_tables import probe_reads
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import (
    WorkerProbe,
    WorkerSteering,
    decode_request,
    worker_steering,
)
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import RequestSteering, SteeredRequest, SteeringPlanner
from vinterp.interventions.worker_state import WorkerInterventions
from vinterp.sites.names import SiteOrder, UnknownSiteError
from vinterp.wire.errors import WireError
from vinterp.wire.probes import Probe, gating_misfit, probe_misfit, probe_store_name
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Steering, When
from vinterp.wire.tensors import tensor_from_wire

ORDER = SiteOrder(3)
H = 4
PROBED, GATED = "layers.0.output", "layers.1.output"


def test_a_probe_takes_one_or_more_outputs_and_checks_its_fields() -> None:
    one = Probe(PROBED, torch.ones(H))
    assert (
        one.weight.shape == (1, H)
        and one.name == PROBED
        and torch.equal(one.offsets, torch.zeros(1))
    )
    x = torch.randn(3, H)
    two = Probe(PROBED, torch.eye(2, H), torch.tensor([1.0, -1.0]), name="p")
    assert torch.allclose(two.scores(x), x[:, :2] + torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="bias: 3 values for a weight of 2 outputs"):
        Probe(PROBED, torch.ones(2, H), torch.ones(3))
    with pytest.raises(ValueError, match="weight: contains inf or nan"):
        Probe(PROBED, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="cannot be probed"):
        Probe("embed.output", torch.ones(H))
    with pytest.raises(ValueError, match="expected \\(outputs, hidden\\)"):
        Probe(PROBED, torch.ones(2, 2, H))
    assert probe_misfit(one, 3, H) is None
    assert "hidden size is 8" in probe_misfit(one, 3, 8)
    assert "out of range" in probe_misfit(Probe("layers.5.output", torch.ones(H)), 3, H)


def test_when_takes_one_threshold_and_decides_like_the_definition() -> None:
    with pytest.raises(ValueError, match="one threshold"):
        When(probe="p")
    with pytest.raises(ValueError, match="one threshold"):
        When(probe="p", above=0.0, below=1.0)
    scores = torch.tensor([-1.0, 0.5, 2.0])
    assert When(probe="p", above=0.5).passes(scores).tolist() == [False, False, True]
    assert When(probe="p", below=0.5).passes(scores).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="SAE feature steering is not gated"):
        Steering({f"{GATED}.sae.features": {1: 2.0}}, when={"probe": "p", "above": 0})


def test_probes_and_gates_travel_in_both_wire_forms() -> None:
    probe = Probe(PROBED, torch.randn(2, H), torch.randn(2), name="p")
    gated = Steering({GATED: torch.randn(H)}, when=When(probe="p", below=-1.0, output=1))
    for back in (Probe.from_json(probe.to_json()), Probe.from_wire(probe.to_wire())):
        assert back.name == "p" and torch.equal(back.weight, probe.weight)
        assert torch.equal(back.bias, probe.bias)
    assert Steering.from_json(gated.to_json()).when == gated.when
    specs = RequestSpecs([gated], capture_id="id", probes=[probe])
    back = RequestSpecs.from_wire(specs.to_wire())
    assert back.capture_id == "id" and back.probes[0].name == "p" and back.steering[0].when
    with pytest.raises(WireError, match="probe.weight"):
        Probe.from_json({**probe.to_json(), "weight": [1.0, 2.0]})
    with pytest.raises(WireError, match="unknown fields"):
        Probe.from_json({**probe.to_json(), "code": "import os"})


def test_gating_checks_name_the_problem() -> None:
    p = Probe(GATED, torch.ones(H), name="p")
    vector = torch.ones(H)

    def gate(site: str, **when) -> Steering:
        return Steering({site: vector}, when={"probe": "p", "above": 0.0, **when})

    assert gating_misfit([p], [gate(GATED)], ORDER) is None  # at its own site
    assert gating_misfit([p], [gate("layers.2.output")], ORDER) is None
    assert "at or before" in gating_misfit([p], [gate(PROBED)], ORDER)
    assert "no probe named 'p'" in gating_misfit([], [gate(GATED)], ORDER)
    assert "has 1 output" in gating_misfit([p], [gate(GATED, output=1)], ORDER)
    assert "two probes are named" in gating_misfit([p, p], [], ORDER)
    # pipeline stages of layers 0 | 1-2: a probe's scores stay on its stage
    staged = gating_misfit([p], [gate("layers.2.output")], ORDER, stage_starts=(0, 1))
    assert staged is None
    early = Probe(PROBED, torch.ones(H), name="p")
    assert "different pipeline stages" in gating_misfit([early], [gate(GATED)], ORDER, (0, 1))
    other = Steering({GATED: vector}, when={"probe": "p", "above": 1.0})
    assert "share one when=" in gating_misfit([p], [gate(GATED), other], ORDER)
    # the workers refuse the same, and a gated global or named steering
    wire = RequestSpecs([gate(PROBED)], capture_id="i", probes=[p]).to_wire()
    with pytest.raises(WireError, match="at or before"):
        decode_request(wire, ORDER, H, {})
    with pytest.raises(WireError, match="cannot be gated"):
        worker_steering(gate(GATED), ORDER, H, {})  # global or named: no request's probes
    config = SimpleNamespace(num_hidden_layers=3, hidden_size=H)
    with pytest.raises(ValueError, match="cannot be gated"):
        check_steering(gate(GATED), config, {}, shared=True)


def planner(probe_sites: frozenset[int]) -> SteeringPlanner:
    buffers = SteerBuffers(
        len(ORDER.sites), H, 16, 8, 8, torch.float32, "cpu", probe_sites=probe_sites
    )
    return SteeringPlanner(buffers, ORDER, SaeRegistry("cpu", torch.float32))


def forward(state: SteeringPlanner, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the site formula at every site of `xs`, in forward order (as the model does)."""
    out = {}
    for site in sorted(xs, key=ORDER.__getitem__):
        out[site] = state.buffers(ORDER[site], torch.tensor([ORDER[site]]), xs[site])
    return out


@pytest.mark.parametrize(
    "compiled_sites",
    [frozenset({ORDER[PROBED], ORDER[GATED]}), frozenset({ORDER[PROBED]}), frozenset()],
)
def test_scores_and_gates_follow_the_definition(compiled_sites) -> None:
    """Request a (rows 0-2) probes and is steered at GATED only where its probe's second output
    passes a threshold; request b (rows 3-4) is steered everywhere; c (row 5) only probes."""
    g = torch.Generator().manual_seed(0)
    probe = WorkerProbe.shared(
        Probe(PROBED, torch.randn(2, H, generator=g), torch.randn(2, generator=g), name="p")
    )
    vector = torch.randn(H, generator=g)
    xs = {PROBED: torch.randn(6, H, generator=g), GATED: torch.randn(6, H, generator=g)}
    scores = probe.probe.scores(xs[PROBED])
    low, mid, _ = scores[:3, 1].sort().values.tolist()
    threshold = (low + mid) / 2  # open at two of a's three tokens, closed at one
    gated = WorkerSteering.shared(
        Steering({GATED: vector}, when={"probe": "p", "above": threshold, "output": 1}), probe
    )
    plain = WorkerSteering.shared(Steering({GATED: vector}, scale=2.0))
    requests = [
        SteeredRequest("a", 0, 3, RequestSteering((gated,), 3, (probe,), "id-a")),
        SteeredRequest("b", 0, 2, RequestSteering((plain,), 2)),
        SteeredRequest("c", 4, 1, RequestSteering((), 3, (probe,), "id-c")),
    ]
    layout = [("a", 0, 3), ("b", 3, 5), ("c", 5, 6)]
    state = planner(compiled_sites)
    # uncompiled unless the probe's site and the gated site both have the compiled formulas
    assert state.plan(requests) == (len(compiled_sites) < 2)
    state.write(lambda: layout, 6)
    out = forward(state, xs)
    passes = scores[:3, 1] > threshold
    assert int(passes.sum()) == 2
    want = xs[GATED].clone()
    want[:3] += passes[:, None] * vector
    want[3:5] += 2.0 * vector
    assert torch.allclose(out[GATED], want, atol=1e-6)
    assert torch.equal(out[PROBED], xs[PROBED])  # nothing steered there
    # the scores the runner keeps, per request and position
    kept = WorkerInterventions(True, ORDER, H, SaeRegistry("cpu", torch.float32))
    assert state.probe_reads == probe_reads(state.plan_.slots, state.plan_.probed, layout)
    kept.keep_scores(state.probe_reads, state.scores(), {"a": 0, "c": 4}.__getitem__)
    taken = kept.store.take(["id-a", "id-c"])[probe_store_name("p")]
    assert taken["parts"] == [["id-a", [0, 1, 2]], ["id-c", [4]]]
    values = tensor_from_wire(taken["values"], "scores")
    assert torch.allclose(values, scores[[0, 1, 2, 5]], atol=1e-6)


def test_a_step_of_no_tokens_reads_no_scores() -> None:
    """vLLM runs a step with no scheduled tokens when only finished requests are left: it is
    planned but never laid out, so no earlier step's rows may be read after it."""
    probe = WorkerProbe.shared(Probe(PROBED, torch.ones(H), name="p"))
    state = planner(frozenset({ORDER[PROBED]}))
    state.plan([SteeredRequest("a", 0, 2, RequestSteering((), 2, (probe,), "id-a"))])
    state.write(lambda: [("a", 0, 2)], 2)
    assert [r.requests for r in state.probe_reads] == [[("a", "id-a", 0, 2)]]
    state.plan([])
    assert state.probe_reads == []


def test_probe_sites_name_sites_of_the_residual_stream() -> None:
    assert probe_site_ids(probe_sites_setting("layers.*.output"), ORDER) == frozenset(
        ORDER[f"layers.{i}.output"] for i in range(3)
    )
    with pytest.raises(UnknownSiteError, match="probe_sites: embed.output cannot be probed"):
        probe_site_ids(["embed.output"], ORDER)
    with pytest.raises(TypeError, match="probe_sites=3: give the sites"):
        probe_sites_setting(3)
