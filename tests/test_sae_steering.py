"""Steering in an SAE's feature basis without an engine: the compiled tables' formula against the
definition (x + decode(f') - decode(f), the SAE's own encode/decode) for every architecture
and normalisation, unsteered rows untouched, the overflow route, and the checks."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vinterp.interventions.feature_buffers import (
    sae_steering_features_setting,
    sae_steering_host_ids,
    sae_steering_hosts_setting,
)
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import WorkerSteering
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import RequestSteering, SteeredRequest, SteeringPlanner
from vinterp.sae import SAE
from vinterp.sae.steering import feature_steering_misfit
from vinterp.sites.names import SiteOrder, UnknownSiteError
from vinterp.wire.errors import WireError
from vinterp.wire.specs import Steering

ORDER = SiteOrder(2)
HOST = "layers.1.output"
FEATURES = f"{HOST}.sae.features"
H, D_SAE = 8, 24


def make_sae(architecture: str = "standard", seed: int = 0, **settings) -> SAE:
    g = torch.Generator().manual_seed(seed)
    extra = {}
    if architecture == "jumprelu":
        extra["threshold"] = torch.rand(D_SAE, generator=g) * 0.3
    if architecture == "topk":
        extra["k"] = 4
    return SAE(
        architecture,
        torch.randn(H, D_SAE, generator=g),
        torch.randn(D_SAE, generator=g) * 0.5,
        torch.randn(D_SAE, H, generator=g),
        torch.randn(H, generator=g) * 0.3,
        **extra,
        **settings,
    )


def planner(
    sae: SAE, features_per_host: int = 4, hosts: frozenset[int] = frozenset({ORDER[HOST]})
) -> SteeringPlanner:
    steer = SteerBuffers(
        len(ORDER.sites), H, 16, 8, 8, torch.float32, "cpu", None, hosts, features_per_host
    )
    saes = SaeRegistry("cpu", torch.float32)
    saes.attach(HOST, sae)
    return SteeringPlanner(steer, ORDER, saes)


def worker(features: dict[int, float], mode: str = "clamp", **kwargs) -> WorkerSteering:
    return WorkerSteering(Steering({FEATURES: features}, mode=mode, **kwargs))


def run(state: SteeringPlanner, specs: list[WorkerSteering], x: torch.Tensor) -> torch.Tensor:
    """One step: request a (rows 0..2, a prompt) steered by `specs`, b (rows 3..4) not; the
    buffers applied at the host. Whether it overflowed is `state.plan_.overflow`."""
    a = SteeredRequest("a", 0, 3, RequestSteering(tuple(specs), 3))
    state.plan([a])
    state.write(lambda: [("a", 0, 3), ("b", 3, 5)], 5)
    return state.buffers(ORDER[HOST], torch.tensor([ORDER[HOST]]), x)


def by_definition(sae: SAE, x: torch.Tensor, clamp: dict, add: dict) -> torch.Tensor:
    """x + decode(f') - decode(f): f' sets the clamped features, adds to the added ones."""
    f = sae.encode(x)
    new = f.clone()
    for j, v in clamp.items():
        new[:, j] = v
    for j, v in add.items():
        new[:, j] += v
    return x + sae.decode(new, x) - sae.decode(f, x)


SAES = {
    "standard": {},
    "jumprelu": {},
    "constant_norm_rescale": {"normalize_activations": "constant_norm_rescale"},
    "layer_norm": {"normalize_activations": "layer_norm", "apply_b_dec_to_input": False},
}


@pytest.mark.parametrize("name", list(SAES))
def test_clamp_and_add_equal_the_definition_and_leave_other_rows_alone(name) -> None:
    sae = make_sae("jumprelu" if name == "jumprelu" else "standard", **SAES[name])
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)) * 2
    f = sae.encode(x[:3])
    active, silent = int(f[0].argmax()), int(f[0].argmin())
    state = planner(sae)
    specs = [worker({active: 0.0, silent: 1.5}), worker({3: 0.25}, "add", scale=2.0)]
    out = run(state, specs, x)
    assert not state.plan_.overflow  # three features fit the four columns: compiled tables
    want = by_definition(sae, x[:3], {active: 0.0, silent: 1.5}, {3: 0.5})
    torch.testing.assert_close(out[:3], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:3], x[:3], atol=1e-2)  # it steers
    assert torch.equal(out[3:], x[3:])  # unsteered rows: exactly x
    # the last clamp of a feature wins, adds add to it
    out = run(
        state, [worker({active: 5.0}), worker({active: 1.0}, "add"), worker({active: 2.0})], x
    )
    torch.testing.assert_close(out[:3], by_definition(sae, x[:3], {active: 3.0}, {}))


def test_adding_to_a_topk_saes_feature_uses_the_decoder_row_decode_applies() -> None:
    sae = make_sae("topk", rescale_acts_by_decoder_norm=True)
    x = torch.randn(5, H)
    out = run(planner(sae), [worker({5: 2.0}, "add")], x)
    torch.testing.assert_close(out[:3], by_definition(sae, x[:3], {}, {5: 2.0}))


def test_more_features_than_the_tables_hold_overflow_to_the_same_result() -> None:
    sae = make_sae()
    x = torch.randn(5, H)
    clamps = {j: 0.5 * j for j in range(6)}
    small, large = planner(sae, features_per_host=4), planner(sae, features_per_host=8)
    overflowed = run(small, [worker(clamps)], x)
    assert small.plan_.overflow and small.buffers.overflow is not None
    compiled = run(large, [worker(clamps)], x)
    assert not large.plan_.overflow
    torch.testing.assert_close(overflowed, compiled)  # widths differ: rounding only
    torch.testing.assert_close(overflowed[:3], by_definition(sae, x[:3], clamps, {}))
    # without clamp tables (no sae_steering_hosts), or with them at another host, every feature
    # steering overflows
    for hosts in (frozenset(), frozenset({ORDER["layers.0.output"]})):
        elsewhere = planner(sae, features_per_host=4, hosts=hosts)
        torch.testing.assert_close(run(elsewhere, [worker(clamps)], x), overflowed, rtol=0, atol=0)
        assert elsewhere.plan_.overflow


def test_a_plan_without_features_clears_the_last_ones() -> None:
    sae = make_sae()
    x = torch.randn(5, H)
    state = planner(sae)
    run(state, [worker({0: 3.0, 1: 3.0})], x)
    vector = WorkerSteering(Steering({HOST: torch.ones(H)}))
    out = run(state, [vector], x)  # the same table row, a vector now
    assert torch.equal(out[:3], x[:3] + 1) and torch.equal(out[3:], x[3:])


def test_the_formula_compiles_and_follows_buffer_updates() -> None:
    sae = make_sae()
    state = planner(sae)
    buffers = state.buffers
    fn = torch.compile(
        lambda x: buffers(ORDER[HOST], torch.tensor([ORDER[HOST]]), x), fullgraph=True
    )
    x = torch.randn(5, H)
    for value in (0.0, 4.0):
        want = run(state, [worker({2: value})], x)
        torch.testing.assert_close(fn(x), want)
    state.plan([])
    state.write(lambda: [], 5)
    assert torch.equal(fn(x), x)


def test_steering_features_is_checked_against_the_saes() -> None:
    saes = {HOST: make_sae(), "layers.0.output": make_sae("topk")}
    fits = Steering({FEATURES: {D_SAE - 1: 1.0}}, mode="clamp")
    assert feature_steering_misfit(fits, saes) is None
    problems = {
        "out of range; this SAE has 24 features": Steering({FEATURES: {D_SAE: 1.0}}),
        "no sparse autoencoder is attached at layers.0.input": Steering(
            {"layers.0.input.sae.features": {1: 1.0}}
        ),
        "top-k SAE.*use mode='add'": Steering(
            {"layers.0.output.sae.features": {1: 1.0}}, mode="clamp"
        ),
    }
    for message, steering in problems.items():
        misfit = feature_steering_misfit(steering, saes)
        assert misfit is not None and re.search(message, misfit), misfit
    assert (
        feature_steering_misfit(Steering({"layers.0.output.sae.features": {1: 1.0}}), saes) is None
    )


def test_feature_steering_specs_round_trip_and_refuse_what_does_not_apply() -> None:
    spec = Steering({FEATURES: {7: 8.0, 1234: 0}}, mode="clamp", phase="decode", scale=2.0)
    assert spec.features == {FEATURES: {7: 8.0, 1234: 0.0}} and spec.vectors == {}
    assert Steering.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert Steering.from_wire(spec.to_wire()) == spec
    refused = {
        "mode: 'clamp' sets SAE features": dict(mode="clamp", vectors={HOST: torch.ones(H)}),
        "norm_match: .* does not apply to SAE": dict(vectors={FEATURES: {1: 1.0}}, norm_match=True),
        "-3 is not a feature index": dict(vectors={FEATURES: {-3: 1.0}}),
        "expected a finite number": dict(vectors={FEATURES: {3: float("inf")}}),
        "attn.input.sae.features' cannot be steered": dict(
            vectors={"layers.1.attn.input.sae.features": {1: 1.0}}
        ),
    }
    for message, kwargs in refused.items():
        with pytest.raises(ValueError, match=message):
            Steering(**kwargs)
    with pytest.raises(WireError, match="not a feature index"):
        Steering.from_json({"vectors": {}, "features": {FEATURES: {"x": 1.0}}})


def test_only_the_compiled_hosts_carry_the_formula_in_a_recorded_graph() -> None:
    state = planner(make_sae())
    buffers = state.buffers
    graphs = {}
    for site in (HOST, "layers.0.output"):

        def backend(gm, example_inputs, site=site):
            graphs[site] = gm
            return gm.forward

        fn = torch.compile(
            lambda x, site=site: buffers(ORDER[site], torch.tensor([ORDER[site]]), x),
            backend=backend,
            fullgraph=True,
        )
        fn(torch.randn(5, H))

    def reads_the_encoder(gm) -> bool:
        return any("features" in node.name and "enc" in node.name for node in gm.graph.nodes)

    assert reads_the_encoder(graphs[HOST]) and not reads_the_encoder(graphs["layers.0.output"])


def test_the_compiled_hosts_are_named_as_sites_and_checked() -> None:
    assert sae_steering_host_ids(sae_steering_hosts_setting(None), ORDER) == frozenset()
    assert sae_steering_host_ids(sae_steering_hosts_setting(HOST), ORDER) == {ORDER[HOST]}
    assert sae_steering_host_ids(sae_steering_hosts_setting("layers.*.output"), ORDER) == {
        ORDER["layers.0.output"],
        ORDER[HOST],
    }
    with pytest.raises(UnknownSiteError, match="cannot host feature steering"):
        sae_steering_host_ids(["layers.1.attn.input"], ORDER)  # no steering there
    with pytest.raises(UnknownSiteError, match="layers.7"):
        sae_steering_host_ids(["layers.7.output"], ORDER)
    with pytest.raises(TypeError, match="sae_steering_hosts"):
        sae_steering_hosts_setting(3)
    with pytest.raises(ValueError, match="sae_steering_features"):
        sae_steering_features_setting(0)
