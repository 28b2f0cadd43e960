"""Probes and gated steering under CUDA graphs in bf16 (how to run: tests/gpu/conftest.py).

One engine with vLLM's defaults and `probe_sites` at a layer before the middle (the probe) and
at the middle (the gated steering): probing and gating steps stay compiled; a probe changes no
token; its scores are the product of the site's captured rows with the probe at the prompts'
tokens (within the compiled-vs-eager bf16 distance: the captures are taken in uncompiled
steps); a gate that is always open gives the steering's tokens, one that is always closed the
unsteered ones, and one at the median of the scores lies between.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vinterp

pytestmark = [
    pytest.mark.engine("gpu_probes"),
    pytest.mark.gpus(1),
]

MODEL_ENV, DEFAULT_MODEL = "VINTERP_GPU_MODEL", "bundled"
MAX_MODEL_LEN = 2048
TOKENS = 16
# as test_gpu_check's IN_GRAPH_REL_TOL: the scores are computed inside the compiled graphs
IN_GRAPH_REL_TOL = 1e-1


def sites(llm: Any) -> tuple[str, str]:
    mid = len(llm.layers) // 2
    return f"layers.{mid - 2}.output", f"layers.{mid}.output"


def probed(llm: Any, gpu: Any) -> dict[str, Any]:
    """Every run of the module on one engine, with the step counts of the compiled ones."""
    probe_site, gated_site = sites(llm)
    hidden = int(llm.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2, hidden, generator=g) / hidden**0.5
    probe = vinterp.Probe(probe_site, weight, torch.randn(2, generator=g), name="p")

    def run(**kwargs: Any) -> tuple[list[Any], int]:
        before = llm.step_stats()["uncompiled_steps"]
        outs = llm.generate(gpu.PROMPTS, max_tokens=TOKENS, use_tqdm=False, **kwargs)
        return outs, llm.step_stats()["uncompiled_steps"] - before

    plain, _ = run()
    probe_only, probe_uncompiled = run(probes=[probe])
    # the prompts' rows: a capturing step runs uncompiled, and in bf16 its greedy continuation
    # may part from the compiled run's (API.md section 5)
    scores = [o.probes["p"][: len(o.prompt_token_ids)].float() for o in probe_only]
    captured, _ = run(capture=vinterp.Capture(probe_site, positions="all_prompt"))
    direct = [c.captures[probe_site].float() @ weight.T + probe.offsets for c in captured]
    median = float(torch.cat([s[:, 0] for s in scores]).median())
    rows = torch.cat([c.captures[probe_site].float() for c in captured])
    vector = torch.randn(hidden, generator=g)
    vector = vector / vector.norm() * float(rows.norm(dim=-1).mean())  # the residual's size

    def gated(**when: float) -> vinterp.Steering:
        return vinterp.Steering({gated_site: vector}, scale=1.0, when=dict(probe="p", **when))

    always, _ = run(steering=vinterp.Steering({gated_site: vector}))
    opened, open_uncompiled = run(probes=[probe], steering=gated(above=-1e30))
    closed, _ = run(probes=[probe], steering=gated(above=1e30))
    middle, middle_uncompiled = run(probes=[probe], steering=gated(above=median))
    tokens = {
        name: [o.token_ids for o in outs]
        for name, outs in (
            ("plain", plain),
            ("probe_only", probe_only),
            ("always", always),
            ("opened", opened),
            ("closed", closed),
            ("middle", middle),
        )
    }
    uncompiled = {"probe": probe_uncompiled, "open": open_uncompiled, "middle": middle_uncompiled}
    return {"tokens": tokens, "scores": scores, "direct": direct, "uncompiled": uncompiled}


@pytest.fixture(scope="module")
def results(gpu, report):
    from transformers import AutoConfig

    layers = int(AutoConfig.from_pretrained(str(report.model)).num_hidden_layers)
    probe_sites = [f"layers.{layers // 2 - 2}.output", f"layers.{layers // 2}.output"]
    kwargs = {"max_model_len": MAX_MODEL_LEN, "probe_sites": probe_sites}
    done = report.kept(
        "probes-graphs",
        lambda: gpu.vinterp_engine(report.model, lambda llm: probed(llm, gpu), **kwargs),
    )
    report.data.update(tokens=done["tokens"], uncompiled=done["uncompiled"])
    return done


def test_probing_and_gating_steps_stay_compiled(results, report) -> None:
    counts = results["uncompiled"]
    ok = all(n == 0 for n in counts.values())
    assert report.check("probe and gate at probe_sites: no uncompiled step", str(counts), ok)


def test_a_probe_changes_no_token(results, report, gpu) -> None:
    tokens = results["tokens"]
    same = gpu.equal(tokens["probe_only"], tokens["plain"])
    assert report.check("probed tokens = unprobed", f"{same}/{gpu.N}", same == gpu.N)


def test_scores_are_the_sites_rows_times_the_probe(results, report, gpu) -> None:
    worst = max(gpu.rel_err(s, d) for s, d in zip(results["scores"], results["direct"]))
    ok = worst <= IN_GRAPH_REL_TOL
    assert report.check("scores = captured rows @ W.T + b", f"rel {worst:.1e}", ok)


def test_open_closed_and_median_gates(results, report, gpu) -> None:
    tokens = results["tokens"]
    opened = gpu.equal(tokens["opened"], tokens["always"])
    closed = gpu.equal(tokens["closed"], tokens["plain"])
    apart = sum(
        m != p and m != a for m, p, a in zip(tokens["middle"], tokens["plain"], tokens["always"])
    )
    numbers = f"open {opened}, closed {closed}, between {apart}/{gpu.N}"
    ok = opened >= gpu.MIN_EQUAL and closed == gpu.N and apart >= 1
    assert report.check("open gate = steering, closed = unsteered, median between", numbers, ok)
