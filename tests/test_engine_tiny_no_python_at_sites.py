"""Steering, and capture with `capture_in_graph`, are compiled into the model: such steps
call no Python at any site.

The engine runs in the script's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker),
so the script can replace the site handlers with ones that raise. Steered and captured
generation must still succeed, run no uncompiled step, and equal the HF reference. The engine
has capture buffers at the captured sites only, sized for a whole step's tokens
(`capture_in_graph_rows="step"`, with fewer sequences per step than prompt rows): a capture of
every position stays compiled; a capture elsewhere (handlers restored) runs its steps
uncompiled and equals the reference too.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import vinterp
from vinterp.sites.names import UnknownSiteError

PROMPTS = ["The capital of France is", "Once upon a time"]
CAPTURED = ["layers.*.output", "layers.1.mlp.output", "embed.output"]  # the buffers' sites
OUTSIDE = "layers.0.attn.output"  # a site without a buffer
SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, vinterp
    from vinterp.engine.worker_ext import site_calls

    HANDLERS = []

    def forbidden(*args):
        raise RuntimeError("Python ran at a site")

    def forbid(worker):
        calls = site_calls(worker.model_runner)
        HANDLERS.append((calls.site, calls.stream))
        calls.site = calls.stream = forbidden

    def restore(worker):
        site_calls(worker.model_runner).site, site_calls(worker.model_runner).stream = HANDLERS[0]

    if __name__ == "__main__":
        path, prompts, captured = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        # buffers of one step's tokens: the prompt steps' captures (more rows than the
        # 4 sequences a step runs) stay compiled too
        llm = vinterp.LLM(
            path, capture_in_graph=captured, capture_in_graph_rows="step", max_num_seqs=4
        )
        llm.engine.collective_rpc(forbid)  # the engine runs in this process
        v = torch.randn(256, generator=torch.Generator().manual_seed(3))
        st = vinterp.Steering({"layers.2.output": v, "layers.1.mlp.output": v}, scale=6.0)
        out = llm.generate(prompts, max_tokens=8, steering=st)
        print("TOKENS", json.dumps([o.token_ids for o in out]), flush=True)
        print("STATS", json.dumps(llm.step_stats()), flush=True)
        cap = vinterp.Capture(captured, positions="all")
        out = llm.generate(prompts, max_tokens=4, steering=st, capture=cap)
        captures = [{s: c.tolist() for s, c in o.captures.items()} for o in out]
        print("CAPTURES", json.dumps(captures), flush=True)
        print("CAPTURE_STATS", json.dumps(llm.step_stats()), flush=True)
        llm.engine.collective_rpc(restore)
        cap = vinterp.Capture(sys.argv[4], positions="all")
        out = llm.generate(prompts, max_tokens=4, steering=st, capture=cap)
        print("OUTSIDE", json.dumps([o.captures[sys.argv[4]].tolist() for o in out]), flush=True)
        print("OUTSIDE_STATS", json.dumps(llm.step_stats()), flush=True)
        llm.shutdown()
    """
)


@pytest.mark.engine("tiny_no_python_at_sites")
def test_steered_and_captured_steps_call_no_python_at_sites(
    engines, engine_script, tiny_llama
) -> None:
    lines = engine_script(
        SCRIPT,
        str(tiny_llama),
        json.dumps(PROMPTS),
        json.dumps(CAPTURED),
        OUTSIDE,
        expect="TOKENS",
    )
    stats = json.loads(lines["STATS"])
    assert stats["steps"] >= 8 and stats["uncompiled_steps"] == 0
    assert stats["graph_capture_steps"] == 0
    hf = engines.hf(tiny_llama)
    v = torch.randn(256, generator=torch.Generator().manual_seed(3))
    st = vinterp.Steering({"layers.2.output": v, "layers.1.mlp.output": v}, scale=6.0)
    want = [o.token_ids for o in hf.generate(PROMPTS, max_tokens=8, steering=st)]
    plain = [o.token_ids for o in hf.generate(PROMPTS, max_tokens=8)]
    assert json.loads(lines["TOKENS"]) == want != plain
    captured = json.loads(lines["CAPTURES"])
    capture_stats = json.loads(lines["CAPTURE_STATS"])
    assert capture_stats["uncompiled_steps"] == 0
    assert capture_stats["graph_capture_steps"] - stats["graph_capture_steps"] >= 4
    cap = vinterp.Capture(CAPTURED, positions="all")
    for got, ref in zip(captured, hf.generate(PROMPTS, max_tokens=4, steering=st, capture=cap)):
        assert sorted(got) == sorted(ref.captures)
        for site, value in ref.captures.items():
            assert_close(got[site], value, site)
    outside_stats = json.loads(lines["OUTSIDE_STATS"])
    assert outside_stats["uncompiled_steps"] >= 4  # the prompt and 3 decoding steps capture
    assert outside_stats["graph_capture_steps"] == capture_stats["graph_capture_steps"]
    cap = vinterp.Capture(OUTSIDE, positions="all")
    refs = hf.generate(PROMPTS, max_tokens=4, steering=st, capture=cap)
    for got, ref in zip(json.loads(lines["OUTSIDE"]), refs):
        assert_close(got, ref.captures[OUTSIDE], OUTSIDE)


def assert_close(got: list, want: torch.Tensor, site: str) -> None:
    mine = torch.tensor(got, dtype=want.dtype)
    assert mine.shape == want.shape, site
    assert float((mine - want).norm() / want.norm()) < 1e-4, site


def test_capture_buffers_at_unknown_sites_are_refused_before_the_engine_starts(
    tiny_llama,
) -> None:
    with pytest.raises(UnknownSiteError, match="layers.9"):
        vinterp.LLM(tiny_llama, capture_in_graph="layers.9.output")
    with pytest.raises(TypeError, match="capture_in_graph"):
        vinterp.LLM(tiny_llama, capture_in_graph=3)
    with pytest.raises(TypeError, match="capture_in_graph_rows"):
        vinterp.LLM(tiny_llama, capture_in_graph=True, capture_in_graph_rows="all")
