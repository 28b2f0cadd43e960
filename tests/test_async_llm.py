"""`vinterp.AsyncLLM` (API.md section 6): concurrent traces and generations on vLLM's async
engine, each with its own results, equal to the transformers reference."""

from __future__ import annotations

import asyncio

import pytest
import torch
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp

pytestmark = pytest.mark.engine("tiny_async")

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "The sky is"]
SITE = "layers.1.output"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def allm(engines, tiny_llama):
    return engines.async_vllm(tiny_llama, **TRACED_NOT_INDUCTOR)


@pytest.fixture(scope="module")
def hf(engines, tiny_llama):
    return engines.hf(tiny_llama)


def direction(seed: int) -> torch.Tensor:
    return torch.randn(256, generator=torch.Generator().manual_seed(seed))


def write_and_read(model, k: int) -> None:
    """Trace k's body: its own write at layer 1, reads after it (used on both models)."""
    model.layers[1].output[-1] = model.layers[1].output[-1] + 4.0 * k * direction(k)
    return model.layers[2].output.save(), model.logits.save()


async def async_trace(model, k: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    async with model.trace(PROMPTS[k % 4], max_tokens=2, use_tqdm=False) as tr:
        await asyncio.sleep(0)  # the other tasks record their traces meanwhile
        hidden, logits = write_and_read(model, k)
    return hidden, logits, tr.outputs[0].token_ids


def test_eight_concurrent_traces_each_get_their_own_results(allm, hf) -> None:
    async def main():
        return await asyncio.gather(*(async_trace(allm, k) for k in range(8)))

    results = asyncio.run(main())
    for k, (hidden, logits, tokens) in enumerate(results):
        with hf.trace(PROMPTS[k % 4], max_tokens=2, use_tqdm=False) as tr:
            want_hidden, want_logits = write_and_read(hf, k)
        assert rel_err(hidden, want_hidden) < 1e-4, k
        assert rel_err(logits, want_logits) < 1e-4, k
        assert tokens == tr.outputs[0].token_ids, k
    # the same prompt with another write gives other values: no trace got another's result
    for k in range(4):
        assert rel_err(results[k][0], results[k + 4][0]) > 1e-2


def test_every_invoke_of_a_trace_runs_and_a_failure_stays_in_its_trace(allm, hf) -> None:
    async def three_invokes():
        saved = []
        async with allm.trace(max_tokens=1, use_tqdm=False) as tr:
            for prompt in PROMPTS[:3]:
                with tr.invoke(prompt):
                    saved.append(allm.logits.save())
        return saved, tr.outputs

    async def failing():
        async with allm.trace(PROMPTS[3], max_tokens=1, use_tqdm=False):
            torch.multinomial(allm.logits * 0 - 1.0, 1).save()

    async def main():
        return await asyncio.gather(three_invokes(), failing(), return_exceptions=True)

    (saved, outputs), failure = asyncio.run(main())
    assert isinstance(failure, vinterp.InterventionError)
    assert "test_async_llm.py" in str(failure)
    assert len(outputs) == 3 and all(len(o.token_ids) == 1 for o in outputs)
    for prompt, logits in zip(PROMPTS[:3], saved):
        with hf.trace(prompt, max_tokens=1, use_tqdm=False):
            want = hf.logits.save()
        assert rel_err(logits, want) < 1e-4


def test_generate_and_stream_steer_and_capture_like_hf(allm, hf) -> None:
    steering = vinterp.Steering({SITE: direction(11)}, scale=4.0)
    capture = vinterp.Capture(["layers.*.output"], positions="all")

    async def main():
        generated = await allm.generate(PROMPTS, steering=steering, capture=capture, max_tokens=6)
        partials = [
            out
            async for out in allm.stream(
                PROMPTS[0], steering=steering, capture=capture, max_tokens=6
            )
        ]
        return generated, partials

    generated, partials = asyncio.run(main())
    want = hf.generate(PROMPTS, steering=steering, capture=capture, max_tokens=6, use_tqdm=False)
    plain = hf.generate(PROMPTS, max_tokens=6, use_tqdm=False)
    assert [g.token_ids for g in generated] == [w.token_ids for w in want]
    assert [g.token_ids for g in generated] != [p.token_ids for p in plain]
    for g, w in zip(generated, want):
        for site, rows in w.captures.items():
            assert g.captures[site].shape == rows.shape
            assert rel_err(g.captures[site], rows) < 1e-4
    # the stream grows token by token to the same final output; captures come on the last
    assert len(partials) > 1
    for before, after in zip(partials, partials[1:]):
        assert after.token_ids[: len(before.token_ids)] == before.token_ids
    assert partials[-1].token_ids == generated[0].token_ids
    assert all(not p.captures for p in partials[:-1])
    for site, rows in generated[0].captures.items():
        assert torch.equal(partials[-1].captures[site], rows)


def test_named_and_global_steering(allm) -> None:
    steering = vinterp.Steering({SITE: direction(5)}, scale=6.0)

    async def main():
        plain = await allm.generate(PROMPTS, max_tokens=6)
        await allm.steering.register("push", steering)
        named = await allm.generate(PROMPTS, steering="push", max_tokens=6)
        direct = await allm.generate(PROMPTS, steering=steering, max_tokens=6)
        await allm.steering.set(steering)
        global_ = await allm.generate(PROMPTS, max_tokens=6)
        await allm.steering.clear()
        cleared = await allm.generate(PROMPTS, max_tokens=6)
        await allm.steering.unregister("push")
        return plain, named, direct, global_, cleared

    plain, named, direct, global_, cleared = (
        [o.token_ids for o in outs] for outs in asyncio.run(main())
    )
    assert named == direct == global_ != plain
    assert cleared == plain
    with pytest.raises(ValueError, match="no steering named 'push'"):
        asyncio.run(allm.generate(PROMPTS[0], steering="push"))


def test_sync_and_async_traces_are_not_mixed_up(allm, hf) -> None:
    assert type(allm.engine).__name__ == "AsyncLLM"  # llm.engine: vLLM's own engine object
    with pytest.raises(TypeError, match="async with"):
        with allm.trace(PROMPTS[0]):
            pass

    async def on_sync_model():
        async with hf.trace(PROMPTS[0]):
            pass

    with pytest.raises(TypeError, match="`with model.trace"):
        asyncio.run(on_sync_model())


def test_a_trace_of_more_prompt_tokens_than_one_step_computes_every_prompt(allm) -> None:
    """256 invokes hold more prompt tokens than a step's budget (2048 here), all in flight at
    once, so the scheduler splits some prompts over steps; each save equals the fast path's
    capture."""
    prompts = [f"Fact number {i}: the capital of France is" for i in range(256)]
    budget = allm.backend.llm.vllm_config.scheduler_config.max_num_batched_tokens
    assert sum(len(allm.tokenizer(p).input_ids) for p in prompts) > budget
    capture = vinterp.Capture(SITE, positions="last_prompt")

    async def traced_and_captured():
        async with allm.trace(max_tokens=1, use_tqdm=False) as tr:
            saved = []
            for prompt in prompts:
                with tr.invoke(prompt):
                    saved.append(allm.layers[1].output[-1].save())
        return saved, await allm.generate(prompts, max_tokens=1, capture=capture)

    saved, captured = asyncio.run(traced_and_captured())
    for got, out in zip(saved, captured):
        assert rel_err(got, out.captures[SITE][-1]) < 1e-5
