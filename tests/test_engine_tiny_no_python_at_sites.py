"""Steering, and capture with `capture_in_graph=True`, are compiled into the model: such
steps call no Python at any site.

The engine runs in the script's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker),
so the script can replace the site handlers with ones that raise. Steered and captured
generation must still succeed, run no uncompiled step, and equal the HF reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

import vinterp

PROMPTS = ["The capital of France is", "Once upon a time"]
CAPTURED = ["layers.*.output", "layers.1.mlp.output", "embed.output"]
SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, vinterp
    from vinterp.runtime import site_ops

    def forbidden(*args):
        raise RuntimeError("Python ran at a site")

    if __name__ == "__main__":
        path, prompts, captured = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        llm = vinterp.LLM(path, capture_in_graph=True)
        site_ops.PYTHON.site = site_ops.PYTHON.stream = forbidden
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
        llm.shutdown()
    """
)


def test_steered_and_captured_steps_call_no_python_at_sites(engines, tiny_llama) -> None:
    engines.release()  # one engine at a time: the script starts its own
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama), json.dumps(PROMPTS), json.dumps(CAPTURED)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if " " in ln)
    assert proc.returncode == 0 and "TOKENS" in lines, proc.stderr[-3000:]
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
            mine = torch.tensor(got[site], dtype=value.dtype)
            assert mine.shape == value.shape, site
            assert float((mine - value).norm() / value.norm()) < 1e-4, site
