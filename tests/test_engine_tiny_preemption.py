"""The scheduler running out of KV cache, preempting requests and recomputing them later:
steering, captures and traces must give the same tokens and values as if nothing had been
preempted (the HF reference), with vLLM's prefix cache off and on."""

from __future__ import annotations

import pytest
import torch
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp

pytestmark = pytest.mark.engine("tiny_preemption")

BLOCK = 32
BLOCKS = 5  # one is vLLM's null block: 128 cached tokens, too few for four ~52-token requests
PROMPTS = [
    "The capital of France is Paris and the capital of",
    "Once upon a time there was a small village near the",
    "In the beginning the universe was created and this has",
    "She opened the door slowly and looked into the dark room",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module", params=[False, True], ids=["no_prefix_cache", "prefix_cache"])
def tight(engines, tiny_llama, request):
    return engines.vllm(
        tiny_llama,
        block_size=BLOCK,
        num_gpu_blocks_override=BLOCKS,
        max_model_len=BLOCK * (BLOCKS - 1),
        max_num_seqs=len(PROMPTS),
        enable_prefix_caching=request.param,
        disable_log_stats=False,  # keeps the scheduler's preemption counter
        **TRACED_NOT_INDUCTOR,
    )


def _preemptions(llm: vinterp.LLM) -> float:
    return sum(m.value for m in llm.engine.get_metrics() if m.name == "vllm:num_preemptions")


def test_preempted_requests_keep_steering_and_captures(tight, engines, tiny_llama) -> None:
    hf = engines.hf(tiny_llama)
    v = torch.randn(256, generator=torch.Generator().manual_seed(3))
    spec = vinterp.Steering({"layers.2.output": v}, scale=4.0, phase="decode")
    cap = vinterp.Capture(["layers.1.output"], positions="all")
    before = _preemptions(tight)
    run = dict(max_tokens=MAX_TOKENS, ignore_eos=True, steering=spec, capture=cap)
    got = tight.generate(PROMPTS, **run)
    assert _preemptions(tight) > before, "the test needs the scheduler to preempt"
    want = hf.generate(PROMPTS, **run)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        value = w.captures["layers.1.output"]
        assert g.captures["layers.1.output"].shape == value.shape
        assert float((g.captures["layers.1.output"] - value).norm() / value.norm()) < 1e-4


def test_preempted_mixed_requests_keep_every_row(tight, engines, tiny_llama) -> None:
    """24 requests: steered (global or not), captured at every prompt or generated position,
    and plain, preempted while they run; tokens and every captured row equal the reference's."""
    vectors = [torch.randn(256, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    requests = []
    for k in range(24):
        spec = vinterp.Steering({"layers.2.output": vectors[k % 3]}, scale=3.0)
        positions = "all_prompt" if k % 2 else "all_generated"
        requests.append(
            vinterp.Request(
                PROMPTS[k % 4] + " " * (k // 4),
                steering=spec if k % 3 else None,
                capture=vinterp.Capture(["layers.1.output"], positions=positions),
            )
        )
    before = _preemptions(tight)
    got = tight.generate(requests, max_tokens=MAX_TOKENS, ignore_eos=True, use_tqdm=False)
    preempted = _preemptions(tight) - before
    assert preempted > 0, "the test needs the scheduler to preempt"
    want = engines.hf(tiny_llama).generate(
        requests, max_tokens=MAX_TOKENS, ignore_eos=True, use_tqdm=False
    )
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        value = w.captures["layers.1.output"]
        assert g.captures["layers.1.output"].shape == value.shape
        assert float((g.captures["layers.1.output"] - value).norm() / value.norm()) < 1e-4
    print(f"preemptions: {preempted:.0f}")


def _traced(llm) -> tuple[list, list]:
    """Eight invokes that write in the prompt and in every generated step and save both."""
    v = torch.randn(256, generator=torch.Generator().manual_seed(9)) * 3
    with llm.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
        saved = []
        for k in range(8):
            with tr.invoke(PROMPTS[k % 4]):
                llm.layers[1].output[3] += v
                prompt_rows = llm.layers[2].output.save()
                for _ in tr.iter[1:]:
                    llm.layers[1].output[-1] = llm.layers[1].output[-1] - v
                    generated = llm.layers[3].output.save()
                saved.append((prompt_rows, generated))
    return saved, [o.token_ids for o in tr.outputs]


def test_preempted_traces_complete_with_the_same_saves(tight, engines, tiny_llama) -> None:
    before = _preemptions(tight)
    got, got_tokens = _traced(tight)
    assert _preemptions(tight) > before, "the test needs the scheduler to preempt"
    want, want_tokens = _traced(engines.hf(tiny_llama))
    assert got_tokens == want_tokens
    for (g_prompt, g_gen), (w_prompt, w_gen) in zip(got, want):
        assert float((g_prompt - w_prompt).norm() / w_prompt.norm()) < 1e-4
        assert len(g_gen) == len(w_gen) == MAX_TOKENS - 1
        g_gen, w_gen = torch.stack(g_gen), torch.stack(w_gen)
        assert float((g_gen - w_gen).norm() / w_gen.norm()) < 1e-4
    held = tight.engine.collective_rpc("vinterp_held_state")[0]
    assert held["traces"] == held["requests"] == 0
