"""Writes, patching, generation steps and errors give the same results on vLLM and HF."""

from __future__ import annotations

import pytest
import torch

import vinterp

pytestmark = pytest.mark.engine("bundled")

FRANCE, ITALY = "The capital of France is", "The capital of Italy is"


@pytest.fixture(scope="module")
def backends(engines):
    return {"vllm": engines.vllm(), "hf": engines.hf()}


@pytest.fixture(scope="module")
def direction():
    return torch.randn(576, generator=torch.Generator().manual_seed(0))


def _tokens(tr) -> list[list[int]]:
    return [o.token_ids for o in tr.outputs]


def zero_mlp(llm, direction):
    with llm.trace(FRANCE, max_tokens=6) as tr:
        llm.layers[0].mlp.output = llm.layers[0].mlp.output * 0
    return _tokens(tr)


def steer(llm, direction):
    with llm.trace(FRANCE, max_tokens=6) as tr:
        for _ in tr.iter[:]:
            llm.layers[10].output = llm.layers[10].output + 8.0 * direction
    return _tokens(tr)


def indexed_writes(llm, direction):
    with llm.trace(FRANCE, max_tokens=6) as tr:
        llm.layers[10].output[-1] += 30.0 * direction
        llm.layers[5].attn.output[0] = 0.0
    return _tokens(tr)


def shift_embedding(llm, direction):
    with llm.trace(FRANCE, max_tokens=6) as tr:  # each position takes the one before's
        llm.embed.output[1:] = llm.embed.output[:-1]
    return _tokens(tr)


def force_logits(llm, direction):
    target = llm.tokenizer(" Berlin").input_ids[0]
    with llm.trace(FRANCE, max_tokens=3) as tr:
        forced = torch.full((1, llm.config.vocab_size), -1e4)
        forced[0, target] = 0.0
        llm.logits = forced
    assert tr.outputs[0].token_ids[0] == target
    return _tokens(tr)


@pytest.mark.parametrize(
    "intervention", [zero_mlp, steer, indexed_writes, shift_embedding, force_logits]
)
def test_intervention_changes_tokens_identically(backends, direction, intervention) -> None:
    baseline = backends["vllm"].generate(FRANCE, max_tokens=6)[0].token_ids
    got = intervention(backends["vllm"], direction)
    assert got == intervention(backends["hf"], direction)
    assert got[0] != baseline[: len(got[0])]


def patch(llm):
    with llm.trace(max_tokens=1) as tr:
        with tr.invoke(FRANCE):
            clean = llm.layers[14].output[-1].save()
        with tr.invoke(ITALY):
            unpatched = llm.logits.save()
        with tr.invoke(ITALY):
            llm.layers[14].output[-1] = clean
            patched = llm.logits.save()
    return clean, unpatched, patched, _tokens(tr)


def test_patching_across_invokes_matches_hf(backends) -> None:
    results = {name: patch(llm) for name, llm in backends.items()}
    clean, unpatched, patched, tokens = results["vllm"]
    tok = backends["vllm"].tokenizer
    top = lambda logits: tok.decode(int(logits.argmax()))  # noqa: E731
    print(f"patching layer 14: unpatched top {top(unpatched)!r}, patched top {top(patched)!r}")
    assert tokens == results["hf"][3]
    assert top(patched) == top(results["hf"][2])
    assert top(unpatched) == " Rome"
    assert not torch.allclose(patched, unpatched)
    assert float((clean - results["hf"][0]).norm() / clean.norm()) < 1e-4


def test_writes_touch_only_their_request(backends, direction) -> None:
    llm = backends["vllm"]
    baseline = llm.generate([FRANCE, ITALY], max_tokens=6)
    with llm.trace(max_tokens=6) as tr:
        with tr.invoke(FRANCE):
            llm.layers[10].output = llm.layers[10].output + 30.0 * direction
        with tr.invoke(ITALY):
            pass
    assert tr.outputs[1].token_ids == baseline[1].token_ids
    assert tr.outputs[0].token_ids != baseline[0].token_ids


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_steps_and_per_step_saves(backends, direction, backend) -> None:
    llm = backends[backend]
    baseline = llm.generate(FRANCE, max_tokens=5)[0].token_ids
    with llm.trace(FRANCE, max_tokens=5) as tr:
        for _ in tr.iter[2:4]:
            llm.layers[8].output = llm.layers[8].output + 30.0 * direction
            hidden = llm.layers[8].output.save()
        for _ in tr.iter[:]:
            samples = llm.samples.save()
        first = llm.logits.save()
    tokens = tr.outputs[0].token_ids
    assert len(hidden) == 2 and all(h.shape == (1, 576) for h in hidden)
    assert len(samples) == 5 and [int(s) for s in samples] == tokens
    assert first.shape == (1, llm.config.vocab_size)
    assert tokens[:2] == baseline[:2] and tokens != baseline


def test_one_step_block(backends) -> None:
    llm = backends["vllm"]
    with llm.trace(FRANCE, max_tokens=3) as tr:
        for _ in tr.iter[1]:
            second = llm.logits.save()
    assert len(second) == 1 and int(second[0].argmax()) == tr.outputs[0].token_ids[1]


def test_static_errors_before_running(backends) -> None:
    llm = backends["vllm"]
    with pytest.raises(AttributeError, match="layers.1 has no site 'resid'; it has .input"):
        with llm.trace(FRANCE, max_tokens=1):
            llm.layers[1].resid.save()
    with pytest.raises(vinterp.TraceError, match="layer index 30 is out of range"):
        with llm.trace(FRANCE, max_tokens=1):
            llm.layers[30].output.save()
    with pytest.raises(vinterp.OutOfOrderError, match="needs a value from layers.9.output"):
        with llm.trace(FRANCE, max_tokens=1):
            llm.layers[2].output = llm.layers[9].output
    with pytest.raises(vinterp.TraceError, match="does not fit the site's shape"):
        with llm.trace(FRANCE, max_tokens=1):
            llm.layers[2].output = torch.zeros(3, 7)
    with pytest.raises(TypeError, match="torch.where"):
        with llm.trace(FRANCE, max_tokens=1):
            if llm.layers[2].output.sum() > 0:
                pass


def test_runtime_error_names_line_and_engine_keeps_serving(backends) -> None:
    llm = backends["vllm"]
    with pytest.raises(
        vinterp.InterventionError,
        match=r"test_engine_interventions.py:\d+: "
        r"RuntimeError.*invoke 0",
    ) as info:
        with llm.trace(max_tokens=2) as tr:
            with tr.invoke(FRANCE):
                torch.multinomial(llm.logits * 0 - 1.0, 1).save()
            with tr.invoke(ITALY):
                pass
    assert "multinomial" in str(info.value) or "probability" in str(info.value)
    assert tr.outputs[1].token_ids == llm.generate(ITALY, max_tokens=2)[0].token_ids
    with llm.trace(FRANCE, max_tokens=1) as tr:
        ok = llm.layers[3].output.save()
    assert ok.shape[1] == 576 and tr.outputs[0].text == " Paris"
