"""The scheduler splitting long prompts over steps (chunked prefill): the fast path stays
right, and a traced prompt split over any number of steps gives what one step gives."""

from __future__ import annotations

import pytest
import torch
from eager_attention import eager_attentions
from long_prompt import LONG, close, long_trace, prompt_ids
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp

pytestmark = [pytest.mark.engine("tiny_chunked"), pytest.mark.usefixtures("in_process")]

SHORT = "Once upon a time"


@pytest.fixture(scope="module")
def chunked(engines, tiny_llama):
    llm = engines.vllm(tiny_llama, max_num_batched_tokens=32, max_num_seqs=4, **TRACED_NOT_INDUCTOR)
    assert len(llm.tokenizer(LONG).input_ids) > 64  # spans at least three steps
    return llm


def test_capture_and_steering_across_chunks_equal_hf(chunked, engines, tiny_llama) -> None:
    hf = engines.hf(tiny_llama)
    v = torch.randn(256, generator=torch.Generator().manual_seed(2))
    spec = vinterp.Steering({"layers.1.output": v}, scale=2.0)
    cap = vinterp.Capture(["layers.*.output"], positions="all")
    prompts = [LONG, SHORT, LONG[:100]]
    got = chunked.generate(prompts, max_tokens=4, steering=spec, capture=cap)
    want = hf.generate(prompts, max_tokens=4, steering=spec, capture=cap)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for site, value in w.captures.items():
            assert g.captures[site].shape == value.shape
            assert float((g.captures[site] - value).norm() / value.norm()) < 1e-4


def test_attention_pattern_captures_across_chunks_equal_transformers(
    chunked, engines, tiny_llama
) -> None:
    """The last prompt token's row of chosen heads, over prompts split across steps (keys
    kept from every chunk) and short ones in the same steps, equal to transformers' eager
    attention; the HF backend's captures too."""
    heads = [3, 0]
    cap = vinterp.Capture(["layers.0.attn.pattern", "layers.2.attn.pattern"], heads=heads)
    prompts = [LONG, SHORT, LONG[:100]]
    got = chunked.generate(prompts, max_tokens=2, capture=cap)
    hf = engines.hf(tiny_llama).generate(prompts, max_tokens=2, capture=cap)
    held = chunked.engine.collective_rpc("vinterp_held_state")[0]
    assert held["kept_keys"] == held["captures"] == 0  # the keys went with the rows
    for out, hf_out in zip(got, hf):
        ids = list(out.prompt_token_ids)
        want = eager_attentions(tiny_llama, ids)
        for layer in (0, 2):
            site = f"layers.{layer}.attn.pattern"
            row = want[layer][heads, -1][None]
            assert out.captures[site].shape == row.shape == (1, 2, len(ids))
            assert float((out.captures[site] - row).norm() / row.norm()) < 1e-4
            assert torch.allclose(hf_out.captures[site], row, atol=1e-5)


def test_a_traced_prompt_over_many_steps_equals_hf(chunked, engines, tiny_llama) -> None:
    """400 tokens in steps of 32: every save, the pattern row, the write at position 300 and
    the tokens it leads to equal the HF reference's (one forward over the whole prompt)."""
    ids = prompt_ids(chunked, 400)
    v = torch.randn(256, generator=torch.Generator().manual_seed(5)) * 4
    got, got_tokens = long_trace(chunked, ids, v)
    want, want_tokens = long_trace(engines.hf(tiny_llama), ids, v)
    assert got_tokens == want_tokens
    for name in want:
        close(got[name], want[name])
    assert got["after"].shape[0] == 400 and got["pattern"].shape[-1] == 400
    plain, _ = long_trace(chunked, ids, torch.zeros(256))
    moved = (got["after"] - plain["after"]).norm(dim=-1) > 1e-3
    assert not moved[:300].any() and moved[300]  # the write reached its position only


def test_invokes_split_beside_each_other_and_values_between_them(chunked, engines, tiny_llama):
    """Three long prompts in one round, split over the same steps; a mean over one prompt's
    positions patched into a later invoke's every position."""

    def run(llm):
        with llm.trace(max_tokens=1) as tr:
            saved = []
            for n in (90, 120, 75):
                with tr.invoke(prompt_ids(llm, n)):
                    saved.append(llm.layers[1].output.save())
            with tr.invoke(prompt_ids(llm, 110)):
                llm.layers[2].output[:] = llm.layers[2].output + saved[0].mean(0)
                saved.append(llm.layers[3].output.save())
        return saved, [o.token_ids for o in tr.outputs]

    got, got_tokens = run(chunked)
    want, want_tokens = run(engines.hf(tiny_llama))
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        close(g, w)


def test_a_write_needing_a_later_position_is_refused_before_it_runs(chunked) -> None:
    ids = prompt_ids(chunked, 100)
    with pytest.raises(vinterp.OutOfOrderError, match="position 0 .* from position 99"):
        with chunked.trace(ids, max_tokens=1):
            chunked.layers[2].output[0] = chunked.layers[1].output[-1]
    with pytest.raises(vinterp.OutOfOrderError, match="earlier invoke"):
        with chunked.trace(ids, max_tokens=1):
            y = chunked.layers[1].output
            chunked.layers[2].output = chunked.layers[2].output - y.mean(0)
    with chunked.trace(ids, max_tokens=2) as tr:  # the engine serves on
        ok = chunked.layers[1].output.save()
    assert ok.shape[0] == 100 and len(tr.outputs[0].token_ids) == 2


# Each fits the 32-token step; the first four together do not (the scheduler takes 4 at once)
MANY = [
    "The capital of France is Paris, and the capital of Italy is",
    "Once upon a time there was a small robot who",
    "Numbers 1 2 3 4 5 6 7 8 9",
    "Researchers read the residual stream to find",
    "def fibonacci(n): return n if n < 2 else",
]


def many_invokes(llm) -> tuple[list, object, list]:
    """Every prompt's layer-1 output, and a patch from the first invoke into a later one."""
    with llm.trace(max_tokens=2) as tr:
        saved = []
        for prompt in MANY:
            with tr.invoke(prompt):
                saved.append(llm.layers[1].output.save())
        with tr.invoke(MANY[1]):
            llm.layers[2].output[-1] = saved[0][-1]
            patched = llm.logits.save()
    return saved, patched, [o.token_ids for o in tr.outputs]


def test_a_trace_whose_prompts_outgrow_one_step_equals_hf(chunked, engines, tiny_llama) -> None:
    lengths = [len(chunked.tokenizer(p).input_ids) for p in MANY]
    assert max(lengths) <= 32 < sum(lengths[:4])
    got_saved, got_patched, got_tokens = many_invokes(chunked)
    want_saved, want_patched, want_tokens = many_invokes(engines.hf(tiny_llama))
    assert got_tokens == want_tokens
    for got, want in zip([*got_saved, got_patched], [*want_saved, want_patched]):
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 1e-4
