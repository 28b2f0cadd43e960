"""Probes inside the engine and steering gated by them (`vinterp.Probe`, `Steering(when=)`):
scores and gated tokens equal the HF backend's, computed from the definitions; compiled where
the engine names the probe's site, uncompiled elsewhere."""

from __future__ import annotations

import pytest
import torch
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp

pytestmark = [pytest.mark.engine("tiny"), pytest.mark.usefixtures("in_process")]

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):",
    "Water boils at",
]
COMPILED_SITE = "layers.1.output"  # the engine's probe_sites, with GATED_SITE
OTHER_SITE = "layers.2.mlp.output"  # probed in uncompiled steps
GATED_SITE = "layers.2.output"
TOKENS = 6


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def make_probe(site: str, outputs: int, seed: int, name: str) -> vinterp.Probe:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs, 256, generator=g) / 16
    return vinterp.Probe(site, weight, torch.randn(outputs, generator=g), name=name)


@pytest.fixture(scope="module")
def compiled(engines, tiny_llama):
    return engines.vllm(tiny_llama, probe_sites=(COMPILED_SITE, GATED_SITE), **TRACED_NOT_INDUCTOR)


@pytest.fixture(scope="module")
def hf(engines, tiny_llama):
    return engines.hf(tiny_llama)


def test_scores_equal_hf_at_every_token_read(compiled, hf) -> None:
    probes = [make_probe(COMPILED_SITE, 2, 0, "a"), make_probe(OTHER_SITE, 3, 1, "b")]
    batch = [vinterp.Request(p, probes=probes) if i % 2 == 0 else p for i, p in enumerate(PROMPTS)]
    plain = compiled.generate(PROMPTS, max_tokens=TOKENS, use_tqdm=False)
    outs = compiled.generate(batch, max_tokens=TOKENS, use_tqdm=False)
    refs = hf.generate(batch, max_tokens=TOKENS, use_tqdm=False)
    for i, (out, ref, base) in enumerate(zip(outs, refs, plain)):
        assert out.token_ids == ref.token_ids == base.token_ids  # a probe changes nothing
        if i % 2:
            assert out.probes == {}
            continue
        read = len(out.prompt_token_ids) + TOKENS - 1
        for probe in probes:
            got, want = out.probes[probe.name], ref.probes[probe.name]
            assert got.shape == want.shape == (read, probe.outputs)
            assert rel_err(got, want) < 1e-4, probe.name
        # the definition, from a capture of the same site
        cap = compiled.generate(
            PROMPTS[i], max_tokens=TOKENS, capture=vinterp.Capture(OTHER_SITE, positions="all")
        )[0]
        direct = cap.captures[OTHER_SITE] @ probes[1].weight.T + probes[1].bias
        assert rel_err(out.probes["b"], direct) < 1e-4


def test_a_probe_at_a_compiled_site_keeps_steps_compiled(compiled) -> None:
    probe = make_probe(COMPILED_SITE, 1, 2, "c")
    before = compiled.step_stats()["uncompiled_steps"]
    compiled.generate(PROMPTS, max_tokens=TOKENS, probes=[probe], use_tqdm=False)
    assert compiled.step_stats()["uncompiled_steps"] == before
    elsewhere = make_probe(OTHER_SITE, 1, 2, "c")
    compiled.generate(PROMPTS, max_tokens=TOKENS, probes=[elsewhere], use_tqdm=False)
    assert compiled.step_stats()["uncompiled_steps"] > before


def _threshold_between(scores: torch.Tensor) -> float:
    """A threshold near the median with the widest gap to any score (no token within rounding
    distance of it)."""
    s = scores.flatten().sort().values
    middle = len(s) // 2
    k = max(range(middle - 3, middle + 3), key=lambda j: float(s[j + 1] - s[j]))
    return float(s[k] + s[k + 1]) / 2


@pytest.mark.parametrize("site", [COMPILED_SITE, OTHER_SITE])
def test_gated_steering_equals_hf(compiled, hf, site) -> None:
    gate = make_probe(site, 1, 3, "gate")
    plain = hf.generate(PROMPTS, max_tokens=TOKENS, probes=[gate], use_tqdm=False)
    threshold = _threshold_between(torch.cat([o.probes["gate"] for o in plain]))
    vector = torch.randn(256, generator=torch.Generator().manual_seed(4))
    always = vinterp.Steering({GATED_SITE: vector}, scale=6.0)
    gated = vinterp.Steering(
        {GATED_SITE: vector}, scale=6.0, when=vinterp.When(probe="gate", above=threshold)
    )
    before = compiled.step_stats()["uncompiled_steps"]
    outs = compiled.generate(
        PROMPTS, max_tokens=TOKENS, probes=[gate], steering=gated, use_tqdm=False
    )
    # compiled where the probe and the gated site are both probe_sites
    compiled_steps = compiled.step_stats()["uncompiled_steps"] == before
    assert compiled_steps == (site == COMPILED_SITE)
    refs = hf.generate(PROMPTS, max_tokens=TOKENS, probes=[gate], steering=gated, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    for out, ref in zip(outs, refs):
        assert rel_err(out.probes["gate"], ref.probes["gate"]) < 1e-4
    steered = hf.generate(PROMPTS, max_tokens=TOKENS, steering=always, use_tqdm=False)
    ids = [o.token_ids for o in outs]
    assert ids != [o.token_ids for o in plain]  # the gate let some tokens be steered
    assert ids != [o.token_ids for o in steered]  # and kept others from it


def test_gated_steering_at_the_probes_site_reads_the_unsteered_value(compiled, hf) -> None:
    """At one site the gate decides on the value the steering would change."""
    gate = make_probe(GATED_SITE, 1, 5, "here")
    plain = hf.generate(PROMPTS, max_tokens=TOKENS, probes=[gate], use_tqdm=False)
    threshold = _threshold_between(torch.cat([o.probes["here"] for o in plain]))
    vector = torch.randn(256, generator=torch.Generator().manual_seed(6))
    spec = vinterp.Steering(
        {GATED_SITE: vector}, scale=6.0, when={"probe": "here", "below": threshold}
    )
    outs = compiled.generate(PROMPTS, max_tokens=TOKENS, probes=[gate], steering=spec)
    refs = hf.generate(PROMPTS, max_tokens=TOKENS, probes=[gate], steering=spec)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]


def test_bad_probes_are_refused_and_the_engine_serves_on(compiled) -> None:
    probe = make_probe(COMPILED_SITE, 1, 7, "p")
    vector = torch.randn(256)
    with pytest.raises(ValueError, match="hidden size is 256"):
        compiled.generate(PROMPTS[0], probes=[vinterp.Probe(COMPILED_SITE, torch.randn(1, 64))])
    with pytest.raises(ValueError, match="no probe named 'q'"):
        compiled.generate(
            PROMPTS[0],
            probes=[probe],
            steering=vinterp.Steering({GATED_SITE: vector}, when={"probe": "q", "above": 0}),
        )
    with pytest.raises(ValueError, match="at or before"):
        compiled.generate(
            PROMPTS[0],
            probes=[probe],
            steering=vinterp.Steering({"layers.0.output": vector}, when={"probe": "p", "above": 0}),
        )
    with pytest.raises(ValueError, match="output: 1, but probe 'p' has 1 output"):
        compiled.generate(
            PROMPTS[0],
            probes=[probe],
            steering=vinterp.Steering(
                {GATED_SITE: vector}, when={"probe": "p", "above": 0, "output": 1}
            ),
        )
    with pytest.raises(ValueError, match="two probes are named 'p'"):
        compiled.generate(PROMPTS[0], probes=[probe, probe])
    with pytest.raises(ValueError, match="cannot be gated"):
        compiled.steering.set(
            vinterp.Steering({GATED_SITE: vector}, when={"probe": "p", "above": 0})
        )
    with pytest.raises(ValueError, match="cannot be probed"):
        vinterp.Probe("layers.1.attn.pattern", torch.randn(256))
    out = compiled.generate(PROMPTS[0], max_tokens=2, probes=[probe])[0]
    assert out.probes["p"].shape == (len(out.prompt_token_ids) + 1, 1)
