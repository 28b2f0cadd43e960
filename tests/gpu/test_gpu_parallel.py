"""Tensor and pipeline parallelism on two GPUs: the same results at TP=2, PP=2 and TP=1 (vLLM's
defaults: compiled, CUDA graphs; bf16). How to run: tests/gpu/conftest.py.

One engine at a time, each running the same workload: greedy tokens of the 8 prompts with and
without a middle-layer steering; every layer's output and the logits saved by one trace;
`llm.lm_head.weight[t]` for a token in the vocabulary's upper half (held by TP rank 1); a
patching trace whose value is read on layer 1 (PP stage 0) of one invoke and written at the
second-to-last layer (the last stage) of another. TP=2 and PP=2 are compared with TP=1
(tokens equal for at least 7 of 8 prompts, saves and logits within bf16's 2e-2 relative
error) and every layout's lm_head row with the checkpoint's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import vinterp

pytestmark = [
    pytest.mark.engine("gpu_parallel"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

MODEL_ENV, DEFAULT_MODEL = "VINTERP_GPU_PARALLEL_MODEL", "llama1b"
LAYOUTS: dict[str, dict[str, int]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}
PARALLEL = ("tp2", "pp2")  # each against tp1


def checkpoint_row(path: Path, token: int) -> torch.Tensor:
    """Row `token` of the checkpoint's output embedding (the input embedding where tied)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in f.keys():
                    found[name] = f.get_slice(name)[token]
    return found.get("lm_head.weight", found.get("model.embed_tokens.weight"))


def workload(llm: Any, gpu: Any, norm: float | None) -> dict[str, Any]:
    """Everything one engine runs. The steering vector is a random unit vector times `norm`,
    else times the middle layer's residual norm at the first prompt's last token (TP=1's,
    reused by the others)."""
    prompts = gpu.PROMPTS
    layers = len(llm.layers)
    mid = layers // 2
    upper = int(llm.config.vocab_size) * 3 // 4
    with llm.trace(prompts[0], max_tokens=1):
        saves = [layer.output.save() for layer in llm.layers]
        logits = llm.logits.save()
        row = llm.lm_head.weight[upper].save()
    if norm is None:
        norm = float(saves[mid][-1].float().norm())
    unit = torch.randn(int(llm.config.hidden_size), generator=torch.Generator().manual_seed(0))
    steering = vinterp.Steering({f"layers.{mid}.output": unit / unit.norm() * norm}, scale=4.0)

    def tokens(**kwargs: Any) -> list[list[int]]:
        return [list(o.token_ids) for o in llm.generate(prompts, max_tokens=16, **kwargs)]

    with llm.trace(max_tokens=1) as tr:
        with tr.invoke(prompts[0]):
            source = llm.layers[1].output[-1]
        with tr.invoke(prompts[7]):
            llm.layers[layers - 2].output[-1] = source
            patched = llm.logits.save()
        with tr.invoke(prompts[7]):
            unpatched = llm.logits.save()

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.float().cpu()

    return {
        "norm": norm,
        "upper_token": upper,
        "saves": [cpu(s) for s in saves],
        "logits": cpu(logits),
        "lm_head_row": row.cpu(),
        "patched_logits": cpu(patched),
        "unpatched_logits": cpu(unpatched),
        "tokens": {"unsteered": tokens(), "steered": tokens(steering=steering)},
    }


@pytest.fixture(scope="module")
def results(gpu, report):
    """results(layout): that layout's workload results (run once per module)."""
    done: dict[str, dict[str, Any]] = {}

    def get(layout: str) -> dict[str, Any]:
        if layout not in done:
            norm = None if layout == "tp1" else get("tp1")["norm"]

            def run() -> dict[str, Any]:
                work = lambda llm: workload(llm, gpu, norm)  # noqa: E731
                return gpu.vinterp_engine(report.model, work, **LAYOUTS[layout])

            done[layout] = report.kept(layout, run)
            report.data.setdefault("tokens", {})[layout] = done[layout]["tokens"]
        return done[layout]

    return get


@pytest.mark.parametrize("layout", LAYOUTS)
def test_steering_changes_tokens(results, report, gpu, layout) -> None:
    tokens = results(layout)["tokens"]
    differ = gpu.N - gpu.equal(tokens["steered"], tokens["unsteered"])
    assert report.check(f"{layout} steered differs from unsteered", f"{differ}/{gpu.N}", differ > 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lm_head_row_equals_the_checkpoint(results, report, layout) -> None:
    r = results(layout)
    want = checkpoint_row(report.model, r["upper_token"]).to(r["lm_head_row"].dtype)
    same = torch.equal(r["lm_head_row"], want)
    assert report.check(
        f"{layout} lm_head.weight[{r['upper_token']}] == checkpoint row", str(same), same
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cross_stage_patch_changes_logits(results, report, layout) -> None:
    r = results(layout)
    moved = float((r["patched_logits"] - r["unpatched_logits"]).abs().max())
    assert report.check(
        f"{layout} cross-stage patch changes logits (max abs)", f"{moved:.3g}", moved > 0
    )


@pytest.mark.parametrize("layout", PARALLEL)
@pytest.mark.parametrize("kind", ("unsteered", "steered"))
def test_tokens_equal_one_worker(results, report, gpu, layout, kind) -> None:
    k = gpu.equal(results(layout)["tokens"][kind], results("tp1")["tokens"][kind])
    assert report.check(f"tokens {kind}: {layout} == tp1", f"{k}/{gpu.N}", k >= gpu.MIN_EQUAL)


@pytest.mark.parametrize("layout", PARALLEL)
def test_layer_outputs_equal_one_worker(results, report, gpu, layout) -> None:
    got, want = results(layout)["saves"], results("tp1")["saves"]
    errs = [gpu.rel_err(a, b) for a, b in zip(got, want)]
    worst = max(range(len(errs)), key=errs.__getitem__)
    numbers = f"{errs[worst]:.2e} ({worst})"
    ok = len(got) == len(want) and errs[worst] < gpu.REL_TOL
    assert report.check(f"{layout} layer outputs: max rel err (layer)", numbers, ok)


@pytest.mark.parametrize("layout", PARALLEL)
@pytest.mark.parametrize("name", ("logits", "patched_logits"))
def test_logits_equal_one_worker(results, report, gpu, layout, name) -> None:
    err = gpu.rel_err(results(layout)[name], results("tp1")[name])
    assert report.check(f"{layout} {name}: rel err", f"{err:.2e}", err < gpu.REL_TOL)
