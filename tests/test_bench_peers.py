"""The peer comparison without a vLLM engine: the output checker flags a wrong answer, the
HF-hooks peer (run as the bench runs it, in a subprocess) matches an independent HF
computation, and a peer that cannot run becomes an error, never a missing row."""

from __future__ import annotations

import os

import pytest
import torch

from vinterp.bench.peers import envs, runner, suite
from vinterp.bench.peers.batching import batches
from vinterp.bench.peers.check import verdict
from vinterp.bench.peers.protocol import EXTRACT, STEER, Result, write_task
from vinterp.bench.peers.registry import Peer
from vinterp.models import tiny

SIZES = suite.Sizes(extract_prompts=12, steer_prompts=12, steer_tokens=4)  # lengths differ


def test_checker_passes_fp32_noise_and_flags_a_mutated_output() -> None:
    residuals = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0)) * 50
    assert verdict(EXTRACT, residuals, residuals + 1e-5).startswith("ok")
    wrong = residuals.clone()
    wrong[2, 1, 5] += 1.0  # one entry of layer 1, well past fp32 noise
    assert verdict(EXTRACT, residuals, wrong).startswith("WRONG: layers [1] differ")
    assert verdict(EXTRACT, residuals, residuals[:, :2]).startswith("WRONG: shape")
    assert verdict(EXTRACT, residuals, None) == "WRONG: no output"
    tokens = torch.arange(12).reshape(3, 4)
    assert verdict(STEER, tokens, tokens.clone()) == "ok (tokens equal)"
    flipped = tokens.clone()
    flipped[1, 3] = 99
    assert verdict(STEER, tokens, flipped) == "WRONG: 1/3 prompts' tokens differ (first: prompt 1)"
    many = torch.arange(32 * 4).reshape(32, 4)
    late = many.clone()
    late[5, 2:] = 0  # one prompt in 32 parts after two equal tokens: a near-tie
    assert verdict(STEER, many, late).startswith("ok (31/32 prompts equal; prompts [5] agree")
    early = late.clone()
    early[7, 0] = 0  # another prompt differs from its first token: not a near-tie
    assert verdict(STEER, many, early).startswith("WRONG: 2/32")
    spread = many.clone()
    spread[[1, 9, 17], 3] = 0  # three in 32 (over one in 16) part late
    assert verdict(STEER, many, spread).startswith("WRONG: 3/32")


def test_batches_keep_positions_and_find_each_last_token() -> None:
    prompts = [[1, 2, 3], [4], [5, 6]]
    ((ids, mask, last),) = batches(prompts, 8, "right")
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]] and last.tolist() == [2, 0, 1]
    ((ids, mask, last),) = batches(prompts, 8, "left")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 5, 6]] and last.tolist() == [2, 2, 2]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert [len(b[0]) for b in batches(prompts, 2, "right")] == [2, 1]


def _independent(model_path: str, task, vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One prompt at a time, no hooks and no padding: the layers from `hidden_states` (the
    last one through the final norm, as HF reports it), steering as a bias on the steered
    layer's MLP output projection (which adds the vector to the layer's output)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        hidden = [
            model(torch.tensor([p]), output_hidden_states=True).hidden_states for p in task.prompts
        ]
        residuals = torch.stack([torch.stack([h[0, -1] for h in states[1:]]) for states in hidden])
        model.model.layers[task.layer].mlp.down_proj.bias = torch.nn.Parameter(vector)
        tokens = torch.stack(
            [
                model.generate(
                    torch.tensor([p]), max_new_tokens=SIZES.steer_tokens, do_sample=False
                )[0, len(p) :]
                for p in task.prompts[: SIZES.steer_prompts]
            ]
        )
    return residuals, tokens


def test_hf_hooks_peer_matches_an_independent_hf_computation(tmp_path) -> None:
    model = tiny("llama")
    (extract, steer), vector = suite.tasks(model, SIZES, repeats=1)
    assert len({len(p) for p in steer.prompts}) > 1  # padding is exercised
    for task in (extract, steer):
        write_task(tmp_path / task.workload, task, vector)
    got = runner.run(
        Peer("HF", "hf_hooks"),
        [(tmp_path / t.workload, t.workload) for t in (extract, steer)],
        tmp_path / "hf.log",
    )
    assert [r.error for r in got] == [None, None] and all(len(r.times) == 1 for r in got)
    residuals, tokens = _independent(str(model), extract, vector)
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).model.norm
    with torch.inference_mode():
        peer = got[0].output.clone()
        peer[:, -1] = norm(peer[:, -1])  # HF's last hidden state is after the final norm
    assert verdict(EXTRACT, residuals, peer).startswith("ok")
    assert verdict(STEER, tokens, got[1].output) == "ok (tokens equal)"
    unsteered = _independent(str(model), steer, torch.zeros_like(vector))[1]
    assert not torch.equal(unsteered, tokens)  # the vector changes the greedy tokens


def test_a_peer_that_cannot_run_is_an_error_row(tmp_path, monkeypatch) -> None:
    (extract, _), vector = suite.tasks(tiny("llama"), SIZES, repeats=1)
    write_task(tmp_path / "extract", extract, vector)
    (result,) = runner.run(
        Peer("missing", "no_such_tool"), [(tmp_path / "extract", EXTRACT)], tmp_path / "log"
    )
    assert result.error == "ModuleNotFoundError: No module named 'peers.no_such_tool'"
    row = suite._row(EXTRACT, Peer("missing", "no_such_tool"), result, Result([1.0], "0", None))
    assert not row.ran and row.check.startswith("error: ModuleNotFoundError")
    # an environment that failed to build is remembered with pip's error, not rebuilt
    monkeypatch.setenv("VINTERP_CACHE_DIR", str(tmp_path / "cache"))
    env = envs.Env("broken", ("nothing==0",))
    env.root.mkdir(parents=True)
    (env.root / envs.FAILED).write_text("pip install nothing==0: ERROR: No matching distribution")
    with pytest.raises(envs.EnvError, match="No matching distribution"):
        envs.ensure(env)
    (result,) = runner.run(
        Peer("broken", "hf_hooks", env), [(tmp_path / "extract", EXTRACT)], tmp_path / "log"
    )
    assert result.error == "pip install nothing==0: ERROR: No matching distribution"


def test_peer_processes_see_the_packages_they_should() -> None:
    """vinterp's own interpreter keeps this process's PYTHONPATH (the GPU machines find every
    package through it); a peer in its own environment gets only the peers package, and no
    vinterp plugin in its vLLM."""
    parent = {"PYTHONPATH": "/site/packages", "HOME": "/root"}
    own = runner.peer_environment(Peer("HF", "hf_hooks"), parent)
    assert own["PYTHONPATH"].split(os.pathsep) == [str(runner.BENCH_DIR), "/site/packages"]
    assert own["HOME"] == "/root" and "VLLM_PLUGINS" not in own
    apart = runner.peer_environment(Peer("x", "tlens", envs.Env("e", ("p==1",))), parent)
    assert apart["PYTHONPATH"] == str(runner.BENCH_DIR) and apart["VLLM_PLUGINS"] == ""
    assert runner.peer_environment(Peer("HF", "hf_hooks"), {})["PYTHONPATH"] == str(
        runner.BENCH_DIR
    )
    assert parent == {"PYTHONPATH": "/site/packages", "HOME": "/root"}  # left as it was
