"""The applied check without an engine: the compiled steering and capture ops count what they
did, the host's expectation agrees with what the ops did, and a site that did not run is
reported (interventions/applied.py)."""

from __future__ import annotations

import random
from functools import partial

import numpy as np
import torch

from vinterp.interventions.applied import AppliedCheck, AppliedCounters
from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import WorkerSteering
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import RequestSteering, SteeredRequest, SteeringPlanner
from vinterp.sites.names import SiteOrder, is_steerable
from vinterp.wire.specs import Steering

ORDER = SiteOrder(3)
STEERABLE = [s for s in ORDER.sites if is_steerable(s)]
H = 4
PADDED = 16  # a graph's batch size: the step's tokens, then padding


def worker_spec(vectors, scale, phase, positions, norm_match) -> WorkerSteering:
    """A worker's steering, built from the user's spec."""
    positions = None if positions is None else sorted(positions)
    spec = Steering(vectors, scale=scale, phase=phase, positions=positions, norm_match=norm_match)
    return WorkerSteering(spec)


def random_step(rng: random.Random) -> tuple[list[SteeredRequest], list[tuple[str, int, int]]]:
    """A few requests, each prefilling or decoding, steered (or not) at random sites, phases
    and positions with positive vectors (so a steered row always changes)."""
    requests, layout, row = [], [], 0
    for k in range(rng.randint(1, 4)):
        prompt_len = rng.randint(1, 5)
        first = rng.choice([0, prompt_len + rng.randint(0, 3)])
        count = prompt_len if first == 0 else 1
        layout.append((str(k), row, row + count))
        row += count
        specs = []
        for _ in range(rng.randint(0, 3)):
            sites = rng.sample(STEERABLE, rng.randint(1, 3))
            positions = frozenset(rng.sample(range(6), 2)) if rng.random() < 0.3 else None
            vectors = {s: torch.rand(H) + 0.5 for s in sites}
            phase = rng.choice(["all", "prefill", "decode"])
            specs.append(worker_spec(vectors, rng.uniform(0.5, 2.0), phase, positions, False))
        if specs:
            steering = RequestSteering(tuple(specs), prompt_len)
            requests.append(SteeredRequest(str(k), first, count, steering))
    return requests, layout


def test_the_compiled_ops_count_exactly_the_rows_they_change() -> None:
    counters = AppliedCounters(len(ORDER.sites), "cpu")
    steer = SteerBuffers(len(ORDER.sites), H, PADDED, 16, 64, torch.float32, "cpu", counters)
    state = SteeringPlanner(steer, ORDER, SaeRegistry("cpu", torch.float32))
    check = AppliedCheck(counters, frozenset(range(len(ORDER.sites))), ORDER)
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([steer(i, torch.tensor([i]), x) for i in range(len(ORDER.sites))])

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(0)
    steps_with_steering = 0
    for step in range(40):
        requests, layout = random_step(rng)
        assert not state.plan(requests)
        num_tokens = layout[-1][2]
        state.write(partial(list, layout), num_tokens)
        check.begin()
        out = compiled(torch.zeros(PADDED, H))
        # the reference is the ops' effect: the rows each site changed
        changed = (out != 0).any(dim=-1).sum(dim=1).numpy()
        assert counters.steered.numpy().tolist() == changed.tolist(), step
        expected = state.steered_per_site()
        want = np.zeros(len(ORDER.sites), dtype=np.int64) if expected is None else expected
        assert want.tolist() == changed.tolist(), step
        check.end(step, False, expected, [])
        assert check.take() == []
        steps_with_steering += bool(changed.any())
    assert steps_with_steering > 20  # the steps were not all trivial
    assert len(compiles) == 1


def test_a_site_that_did_not_run_is_reported() -> None:
    """The failures the check exists for: a site missing from the model (steering and the
    Python handlers never reach it) and a capture buffer that never gathered."""
    counters = AppliedCounters(len(ORDER.sites), "cpu")
    steer = SteerBuffers(len(ORDER.sites), H, PADDED, 16, 64, torch.float32, "cpu", counters)
    site, missing = ORDER["layers.1.output"], ORDER["layers.2.output"]
    held = list(range(len(ORDER.sites)))
    capture = CaptureBuffers(
        len(ORDER.sites), frozenset({site, missing}), held, 4, H, torch.float32, "cpu", counters
    )
    state = SteeringPlanner(steer, ORDER, SaeRegistry("cpu", torch.float32))
    check = AppliedCheck(counters, frozenset(held), ORDER)
    spec = worker_spec(
        {ORDER.sites[site]: torch.ones(H), ORDER.sites[missing]: torch.ones(H)},
        1.0,
        "all",
        None,
        False,
    )
    assert not state.plan([SteeredRequest("a", 0, 3, RequestSteering((spec,), 3))])
    state.write(lambda: [("a", 0, 3)], 3)
    capture.write({site: torch.tensor([2]), missing: torch.tensor([2])})
    capture.active = True
    check.begin()
    x = torch.zeros(3, H)
    for site_id in held:
        if site_id != missing:
            check.visit(site_id)
            site_index = torch.tensor([site_id])
            capture(site_id, site_index, steer(site_id, site_index, x))
    check.end(7, True, state.steered_per_site(), [site, missing])
    messages = check.take()
    assert messages == [
        "step 7: steering at layers.2.output reached 0 of the 3 tokens it steers",
        "step 7: the compiled model did not gather the captured rows at layers.2.output",
        "step 7 ran uncompiled, but the sites' Python handlers did not run at layers.2.output",
    ]
    assert check.take() == []  # taken once
    check.end(8, True, None, [])  # no step began since: nothing to compare
    assert check.take() == []


def test_engine_features_the_sites_cannot_follow_are_refused_before_the_start(tiny_llama) -> None:
    import pytest

    import vinterp

    for kwargs, feature in (
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"enable_dbo": True}, "dual-batch overlap"),
        ({"data_parallel_size": 2}, "data parallelism"),
    ):
        with pytest.raises(ValueError, match=feature):
            vinterp.LLM(tiny_llama, **kwargs)
