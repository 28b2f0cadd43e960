"""Steering and capture on the fast path (bundled model): equal to traces and to HF."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors import safe_open

import vinterp
import vinterp.api.requests as requests_module
from vinterp.store import files

pytestmark = pytest.mark.engine("bundled")

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The best way to learn is",
    "def add(a, b):",
]
SITE = "layers.10.output"


@pytest.fixture(scope="module")
def llm(engines):
    return engines.vllm()


@pytest.fixture(scope="module")
def hf(engines):
    return engines.hf()


@pytest.fixture(scope="module")
def direction():
    return torch.randn(576, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def baseline(llm):
    return llm.generate(PROMPTS * 2, max_tokens=8)


def _ids(outs):
    return [o.token_ids for o in outs]


def test_fast_path_keeps_compiled_engine(llm, direction) -> None:
    llm.generate(
        PROMPTS[0],
        max_tokens=2,
        steering=vinterp.Steering({SITE: direction}),
        capture=vinterp.Capture(SITE),
    )
    config = llm.engine.llm_engine.vllm_config
    assert not config.model_config.enforce_eager
    assert config.compilation_config.mode.value != 0


def test_steering_changes_text_and_clear_restores(llm, direction, baseline) -> None:
    st = vinterp.Steering({SITE: direction}, scale=8.0)
    steered = llm.generate(PROMPTS, max_tokens=8, steering=st)
    assert all(s.text != b.text for s, b in zip(steered, baseline))
    llm.steering.set(st)
    try:
        assert _ids(llm.generate(PROMPTS, max_tokens=8)) == _ids(steered)
    finally:
        llm.steering.clear()
    again = llm.generate(PROMPTS, max_tokens=8)
    assert [(o.text, o.token_ids) for o in again] == [(o.text, o.token_ids) for o in baseline[:4]]


def test_unsteered_requests_in_a_steered_batch_are_untouched(llm, direction, baseline) -> None:
    st = vinterp.Steering({SITE: direction}, scale=8.0)
    batch = [vinterp.Request(p, steering=st) if i % 2 else p for i, p in enumerate(PROMPTS * 2)]
    outs = llm.generate(batch, max_tokens=8)
    for i, (out, base) in enumerate(zip(outs, baseline)):
        if i % 2 == 0:
            assert (out.text, out.token_ids) == (base.text, base.token_ids)
        else:
            assert out.token_ids != base.token_ids


def test_named_steering_and_scale_zero(llm, direction, baseline) -> None:
    llm.steering.register("zero", vinterp.Steering({SITE: direction}, scale=0.0))
    llm.steering.register("strong", vinterp.Steering({SITE: direction}, scale=8.0))
    assert _ids(llm.generate(PROMPTS, max_tokens=8, steering="zero")) == _ids(baseline[:4])
    both = llm.generate(PROMPTS, max_tokens=8, steering=["strong", "zero"])
    direct = llm.generate(
        PROMPTS, max_tokens=8, steering=vinterp.Steering({SITE: direction}, scale=8.0)
    )
    assert _ids(both) == _ids(direct)


def _trace_steered(llm, prompt, direction, scale):
    with llm.trace(prompt, max_tokens=8) as tr:
        for _ in tr.iter[:]:
            llm.layers[10].output += scale * direction
    return tr.outputs[0].token_ids


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"phase": "prefill"},
        {"phase": "decode"},
        {"positions": [1, 3]},
        {"norm_match": True, "scale": 0.5},
    ],
    ids=["all", "prefill", "decode", "positions", "norm_match"],
)
def test_steering_equals_trace_and_hf(llm, hf, direction, options) -> None:
    spec = vinterp.Steering(
        {SITE: direction, "layers.4.mlp.output": direction / 2}, **{"scale": 8.0, **options}
    )
    fast = llm.generate(PROMPTS[:2], max_tokens=8, steering=spec)
    reference = hf.generate(PROMPTS[:2], max_tokens=8, steering=spec)
    assert _ids(fast) == _ids(reference)
    if not options:
        one_site = vinterp.Steering({SITE: direction}, scale=8.0)
        assert llm.generate(PROMPTS[0], max_tokens=8, steering=one_site)[
            0
        ].token_ids == _trace_steered(llm, PROMPTS[0], direction, 8.0)


@pytest.mark.parametrize(
    "positions", ["last_prompt", "all_prompt", "all_generated", "all", [0, 2, 6]]
)
def test_capture_equals_trace_and_hf(llm, hf, positions) -> None:
    cap = vinterp.Capture(
        ["layers.*.output", "layers.3.attn.output", "embed.output"], positions=positions
    )
    fast = llm.generate(PROMPTS[:2], max_tokens=5, capture=cap)
    reference = hf.generate(PROMPTS[:2], max_tokens=5, capture=cap)
    for got, want in zip(fast, reference):
        assert got.token_ids == want.token_ids
        assert list(got.captures) == list(want.captures)
        assert len(got.captures) == 30 + 2
        for site, value in want.captures.items():
            assert got.captures[site].shape == value.shape, site
            assert float((got.captures[site] - value).norm() / value.norm()) < 1e-4, site
    prompt_len = len(fast[0].prompt_token_ids)
    expected_rows = {
        "last_prompt": 1,
        "all_prompt": prompt_len,
        "all_generated": 4,
        "all": prompt_len + 4,
    }
    rows = expected_rows.get(positions if isinstance(positions, str) else "", 3)
    assert fast[0].captures["layers.5.output"].shape == (rows, 576)


def test_capture_equals_trace_read(llm) -> None:
    out = llm.generate(
        PROMPTS[0], max_tokens=1, capture=vinterp.Capture(SITE, positions="all_prompt")
    )
    with llm.trace(PROMPTS[0], max_tokens=1):
        traced = llm.layers[10].output.save()
    assert torch.allclose(out[0].captures[SITE], traced, rtol=1e-4, atol=1e-5)


def test_filesystem_sink_round_trips(llm, tmp_path) -> None:
    cap = vinterp.Capture(
        ["layers.2.output", "final_norm.output"],
        positions="all",
        sink="filesystem",
        path=str(tmp_path),
    )
    outs = llm.generate(PROMPTS[:2], max_tokens=3, capture=cap)
    memory = llm.generate(
        PROMPTS[:2], max_tokens=3, capture=cap.model_copy(update={"sink": "memory"})
    )
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 2 and [o.capture_file for o in outs] == [str(f) for f in files]
    for out, mem, file in zip(outs, memory, files):
        with safe_open(file, "pt") as f:
            meta = f.metadata()
            assert json.loads(meta["token_ids"]) == out.token_ids
            assert json.loads(meta["prompt_token_ids"]) == out.prompt_token_ids
            assert json.loads(meta["sites"]) == ["layers.2.output", "final_norm.output"]
            assert json.loads(meta["positions"])["layers.2.output"] == list(
                range(len(out.prompt_token_ids) + 2)
            )
            assert "SmolLM2" in meta["model"]
            for site in ("layers.2.output", "final_norm.output"):
                # two engine runs: batching may differ in the last float bits
                assert torch.allclose(f.get_tensor(site), mem.captures[site], rtol=1e-4, atol=1e-5)


def test_a_sink_that_cannot_write_loses_no_output(llm, tmp_path, monkeypatch) -> None:
    cap = vinterp.Capture("layers.2.output", positions="all", sink="filesystem", path=str(tmp_path))

    def disk_full_at_the_second(path, write):  # its file is half written when the disk fills
        def half_then_full(file) -> None:
            file.write(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        return files.write_atomic(path, half_then_full if "request-00001" in path.name else write)

    monkeypatch.setattr(requests_module, "write_atomic", disk_full_at_the_second)
    with pytest.raises(vinterp.CaptureWriteError) as failed:
        llm.generate(PROMPTS[:3], max_tokens=3, capture=cap)
    message = str(failed.value)
    assert "No space left" in message and str(tmp_path) in message and "request 1" in message
    monkeypatch.undo()
    in_memory = cap.model_copy(update={"sink": "memory"})
    memory = llm.generate(PROMPTS[:3], max_tokens=3, capture=in_memory)  # the engine serves on
    outs = failed.value.outputs
    assert [o.token_ids for o in outs] == [m.token_ids for m in memory]  # no output lost
    assert outs[1].capture_file is None
    written = sorted(str(p) for p in tmp_path.iterdir())  # no torn file, no temporary left
    assert written == [outs[0].capture_file, outs[2].capture_file]
    for out, mem in ((outs[0], memory[0]), (outs[2], memory[2])):
        with safe_open(out.capture_file, "pt") as f:
            got = f.get_tensor("layers.2.output")
        assert torch.allclose(got, mem.captures["layers.2.output"], rtol=1e-4, atol=1e-5)


def test_steering_then_capture_sees_steered_values(llm, direction) -> None:
    st = vinterp.Steering({SITE: direction}, scale=8.0)
    cap = vinterp.Capture([SITE], positions="all_prompt")
    plain = llm.generate(PROMPTS[0], max_tokens=1, capture=cap)[0].captures[SITE]
    steered = llm.generate(PROMPTS[0], max_tokens=1, capture=cap, steering=st)[0].captures[SITE]
    assert torch.allclose(steered - plain, (8.0 * direction).expand_as(plain), atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"steering": vinterp.Steering({"layers.30.output": torch.ones(576)})},
            "layer 30 is out of range",
        ),
        ({"steering": vinterp.Steering({SITE: torch.ones(7)})}, "hidden size is 576"),
        ({"steering": "never-registered"}, "no steering named 'never-registered'"),
        ({"capture": vinterp.Capture("layers.31.mlp.output")}, "capture.sites"),
    ],
)
def test_bad_specs_rejected_before_queueing(llm, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], max_tokens=2, **kwargs)
    assert llm.generate(PROMPTS[0], max_tokens=2)[0].text  # engine still serving


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="vectors: 'layers.1.attn.input' cannot be steered"):
        vinterp.Steering({"layers.1.attn.input": torch.ones(3)})
    with pytest.raises(ValueError, match=r"vectors\['layers.1.output'\]: expected a 1-D vector"):
        vinterp.Steering({"layers.1.output": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="positions"):
        vinterp.Capture("layers.1.output", positions="first")
    with pytest.raises(ValueError, match="path"):
        vinterp.Capture("layers.1.output", sink="filesystem")


def test_steering_stays_compiled_and_capture_leaves_only_its_steps(llm, direction) -> None:
    before = llm.step_stats()
    llm.generate(PROMPTS, max_tokens=8, steering=vinterp.Steering({SITE: direction}, scale=8.0))
    steered = llm.step_stats()
    assert steered["steps"] - before["steps"] >= 8
    assert steered["uncompiled_steps"] == before["uncompiled_steps"]  # no Python at any site
    llm.generate(PROMPTS, max_tokens=8, capture=vinterp.Capture(SITE))  # last_prompt
    captured = llm.step_stats()
    assert captured["steps"] - steered["steps"] >= 8
    # only the step(s) that prefill the prompts (the scheduler may split the arrivals)
    assert 1 <= captured["uncompiled_steps"] - steered["uncompiled_steps"] <= len(PROMPTS)
    # a last_prompt capture is looked at only in its prompt's step, not in the 7 decoding ones
    assert captured["watched"] - steered["watched"] == len(PROMPTS)


def test_ablation_equals_hf_leaves_no_component_and_stays_compiled(llm, hf, baseline) -> None:
    """A direction found from captures (the mean last-prompt residual of two prompts), ablated
    at a residual site and an MLP output: the same tokens as HF under the same edit, nothing
    left along it at the site, the unablated requests of the batch untouched."""
    found = llm.generate(PROMPTS[:2], max_tokens=1, capture=vinterp.Capture(SITE))
    direction = torch.stack([o.captures[SITE][-1] for o in found]).mean(0)
    spec = vinterp.Steering({SITE: direction, "layers.4.mlp.output": direction}, mode="ablate")
    before = llm.step_stats()
    batch = [vinterp.Request(p, steering=spec) if i % 2 else p for i, p in enumerate(PROMPTS)]
    fast = llm.generate(batch, max_tokens=8)
    assert llm.step_stats()["uncompiled_steps"] == before["uncompiled_steps"]
    for i, (out, base) in enumerate(zip(fast, baseline)):
        if i % 2 == 0:
            assert out.token_ids == base.token_ids
    reference = hf.generate(PROMPTS[1::2], max_tokens=8, steering=spec)
    assert _ids(fast[1::2]) == _ids(reference)
    llm.steering.register("ablated", spec)
    assert _ids(llm.generate(PROMPTS[1::2], max_tokens=8, steering="ablated")) == _ids(reference)
    llm.steering.set(spec)  # global
    try:
        assert _ids(llm.generate(PROMPTS[1::2], max_tokens=8)) == _ids(reference)
    finally:
        llm.steering.clear()
        llm.steering.unregister("ablated")
    assert any(out.token_ids != base.token_ids for out, base in zip(fast[1::2], baseline[1::2]))
    cap = vinterp.Capture([SITE], positions="all_prompt")
    ablated = llm.generate(PROMPTS[1], max_tokens=1, capture=cap, steering=spec)[0].captures[SITE]
    unit = direction / direction.norm()
    plain = llm.generate(PROMPTS[1], max_tokens=1, capture=cap)[0].captures[SITE]
    assert (plain @ unit).abs().max() > 1.0
    assert (ablated @ unit).abs().max() < 1e-3 * plain.norm(dim=-1).max()
