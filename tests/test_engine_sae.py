"""A sparse autoencoder inside the engine (bundled model, float32, a random SAE at layer 10):
its sites in traces, top-k capture and extraction, feature steering; vLLM against the HF
backend and against the SAE applied by hand to saved residuals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from traced_engines import TRACED_NOT_INDUCTOR

import vinterp

pytestmark = pytest.mark.engine("bundled_sae")

SITE = "layers.10.output"
FEATURES, ERROR = f"{SITE}.sae.features", f"{SITE}.sae.error"
HIDDEN, WIDTH = 576, 2304
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]


def write_saelens(path, architecture="standard", seed=0, d_in=HIDDEN, **extra):
    """A random SAE in SAELens's format (cfg.json, sae_weights.safetensors)."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        "W_enc": torch.randn(d_in, WIDTH, generator=g) / d_in**0.5,
        "b_enc": torch.randn(WIDTH, generator=g) * 0.1 - 0.1,
        "W_dec": torch.randn(WIDTH, d_in, generator=g) / WIDTH**0.5,
        "b_dec": torch.randn(d_in, generator=g) * 0.1,
    }
    if architecture == "jumprelu":
        weights["threshold"] = torch.rand(WIDTH, generator=g) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "sae_weights.safetensors"))
    cfg = {
        "architecture": architecture,
        "d_in": d_in,
        "d_sae": WIDTH,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "hook_name": "blocks.10.hook_resid_post",
        "model_name": "SmolLM2-135M-Instruct",
        **extra,
    }
    (path / "cfg.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def sae(tmp_path_factory):
    return vinterp.SAE.load(write_saelens(tmp_path_factory.mktemp("sae") / "standard"))


@pytest.fixture(scope="module")
def llm(engines, sae):
    llm = engines.vllm(sae_steering_hosts=SITE, **TRACED_NOT_INDUCTOR)  # features in the graph
    llm.attach_sae(SITE, sae)
    return llm


@pytest.fixture(scope="module")
def hf(engines, sae):
    hf = engines.hf()
    hf.attach_sae(SITE, sae)
    return hf


def _residual_and_sites(llm, prompt):
    with llm.trace(prompt, max_tokens=1):
        x = llm.layers[10].output.save()
        features = llm.layers[10].output.sae.features.save()
        error = llm.layers[10].output.sae.error.save()
    return x, features, error


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_trace_features_and_error_equal_the_sae_on_the_residual(llm, hf, sae, backend) -> None:
    model = llm if backend == "vllm" else hf
    x, features, error = _residual_and_sites(model, PROMPTS[0])
    assert features.shape == (x.shape[0], WIDTH) and error.shape == x.shape
    assert (features > 0).any() and (features == 0).any()  # a real encoding, not all zeros
    torch.testing.assert_close(features, sae.encode(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(error, x - sae.decode(sae.encode(x)), rtol=1e-5, atol=1e-5)


def test_a_feature_write_equals_the_manual_host_write(llm, sae) -> None:
    x, features, _ = _residual_and_sites(llm, PROMPTS[1])
    j = int(features[-1].argmax())
    with llm.trace(PROMPTS[1], max_tokens=1):
        llm.layers[10].output.sae.features[:, j] = 5.0 * features[:, j] + 2.0
        written = llm.layers[10].output.save()
        via_features = llm.logits.save()
    manual = x + (4.0 * features[:, j] + 2.0)[:, None] * sae.W_dec[j]
    torch.testing.assert_close(written, manual, rtol=1e-5, atol=1e-4)
    with llm.trace(PROMPTS[1], max_tokens=1):
        llm.layers[10].output = manual
        via_host = llm.logits.save()
    torch.testing.assert_close(via_features, via_host, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(via_features, _plain_logits(llm, PROMPTS[1]), atol=1e-2)


def _plain_logits(llm, prompt):
    with llm.trace(prompt, max_tokens=1):
        logits = llm.logits.save()
    return logits


def test_an_error_write_keeps_the_reconstruction(llm, sae) -> None:
    x, _, _ = _residual_and_sites(llm, PROMPTS[2])
    with llm.trace(PROMPTS[2], max_tokens=1):
        llm.layers[10].output.sae.error = 0
        written = llm.layers[10].output.save()
    torch.testing.assert_close(written, sae.decode(sae.encode(x)), rtol=1e-5, atol=1e-5)


def test_sae_sites_need_an_attached_sae(llm) -> None:
    with pytest.raises(vinterp.TraceError, match="no sparse autoencoder is attached at layers.3"):
        with llm.trace(PROMPTS[0], max_tokens=1):
            llm.layers[3].output.sae.features.save()


def test_an_sae_of_another_width_is_refused_before_anything_runs(llm, tmp_path) -> None:
    narrow = vinterp.SAE.load(write_saelens(tmp_path / "narrow", d_in=HIDDEN // 2))
    steps = llm.step_stats()["steps"]
    with pytest.raises(ValueError, match=str(HIDDEN // 2)):
        llm.attach_sae("layers.4.output", narrow)
    with pytest.raises(ValueError, match="hidden-size rows"):
        llm.attach_sae("layers.4.attn.q", narrow)
    assert "layers.4.output" not in llm.saes and llm.step_stats()["steps"] == steps


def test_an_unknown_architecture_is_refused_at_load(tmp_path) -> None:
    with pytest.raises(ValueError, match="gated_frobnicator"):
        vinterp.SAE.load(write_saelens(tmp_path / "odd", architecture="gated_frobnicator"))


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_topk_capture_equals_the_sae_on_the_captured_residual(llm, hf, sae, backend) -> None:
    model = llm if backend == "vllm" else hf
    wide = vinterp.Capture([SITE, FEATURES, ERROR], positions="all", topk=32)
    narrow = vinterp.Capture([SITE, FEATURES], positions="all_prompt", topk=4)
    batch = [vinterp.Request(PROMPTS[0], capture=wide), vinterp.Request(PROMPTS[1], capture=narrow)]
    outs = model.generate(batch, max_tokens=3)
    for out, k in zip(outs, (32, 4)):
        x = out.captures[SITE]
        indices, values = out.captures[f"{FEATURES}.indices"], out.captures[f"{FEATURES}.values"]
        assert indices.shape == values.shape == (x.shape[0], k) and not indices.is_floating_point()
        want_indices, want_values = sae.topk(x, k)
        torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
        assert torch.equal(indices.sort().values, want_indices.sort().values)
        assert (values[:, 0] > 0).all()
    torch.testing.assert_close(outs[0].captures[ERROR], sae.error(outs[0].captures[SITE]))
    assert FEATURES not in outs[0].captures  # top-k only: no dense (P, d_sae) rows


def test_capture_of_sae_sites_is_checked_before_anything_runs(llm) -> None:
    with pytest.raises(ValueError, match="needs a sparse autoencoder at layers.3.output"):
        llm.generate(PROMPTS[0], capture=vinterp.Capture("layers.3.output.sae.features"))
    with pytest.raises(ValueError, match="capture.topk: 5000 is more than the 2304"):
        llm.generate(PROMPTS[0], capture=vinterp.Capture(FEATURES, topk=5000))
    with pytest.raises(ValueError, match="topk: keeps the largest features of SAE sites"):
        vinterp.Capture(SITE, topk=3)


# -- steering in the feature basis ------------------------------------------------------------

STEER_PROMPTS = PROMPTS[:2]


def _features(model, prompt):
    """The prompt's features at the host (unsteered) and its last token's most and least
    active ones."""
    with model.trace(prompt, max_tokens=1):
        f = model.layers[10].output.sae.features.save()
    return f, int(f[-1].argmax()), int(f[-1].argmin())


def _clamp_and_add(llm):
    _, active, silent = _features(llm, STEER_PROMPTS[0])
    clamp = vinterp.Steering({FEATURES: {active: 0.0, silent: 300.0}}, mode="clamp")
    add = vinterp.Steering({FEATURES: {7: 300.0}}, mode="add", phase="decode", scale=0.5)
    return clamp, add


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_clamp_and_add_equal_the_hf_backend_and_leave_plain_requests_alone(
    llm, hf, backend
) -> None:
    clamp, add = _clamp_and_add(llm)
    model = llm if backend == "vllm" else hf
    cap = vinterp.Capture(["layers.12.output"], positions="all")
    batch = [
        vinterp.Request(STEER_PROMPTS[0], steering=clamp, capture=cap),
        vinterp.Request(STEER_PROMPTS[1], steering=[clamp, add], capture=cap),
        vinterp.Request(STEER_PROMPTS[1], capture=cap),
    ]
    sampling = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    outs = model.generate(batch, **sampling)
    # the same batch unsteered: the same shapes in every step, so the same kernels
    plain = model.generate([vinterp.Request(r.prompt, capture=cap) for r in batch], **sampling)
    assert outs[0].token_ids != plain[0].token_ids  # the clamp steers
    clamp_only = model.generate(vinterp.Request(STEER_PROMPTS[1], steering=clamp), **sampling)
    assert outs[1].token_ids != clamp_only[0].token_ids  # the add steers too
    assert outs[2].token_ids == plain[2].token_ids  # unsteered in the same batch
    assert torch.equal(outs[2].captures["layers.12.output"], plain[2].captures["layers.12.output"])
    if backend == "vllm":
        want = hf.generate(batch, **sampling)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        for got, ref in zip(outs, want):
            torch.testing.assert_close(
                got.captures["layers.12.output"],
                ref.captures["layers.12.output"],
                rtol=1e-4,
                atol=1e-4,
            )


def test_a_clamp_equals_the_trace_write_of_the_features(llm, sae) -> None:
    """Clamping sets the feature in the SAE's basis as a write of the features site does:
    x + decode(f') - decode(f) at every steered position (what the trace computes with the
    SAE's own encode/decode), compiled into the model."""
    f, active, silent = _features(llm, STEER_PROMPTS[0])
    steps = llm.step_stats()
    clamp = vinterp.Steering({FEATURES: {active: 0.0, silent: 300.0}}, mode="clamp")
    cap = vinterp.Capture([SITE, "layers.11.output"], positions="all_prompt")
    out = llm.generate(STEER_PROMPTS[0], max_tokens=1, steering=clamp, capture=cap)[0]
    with llm.trace(STEER_PROMPTS[0], max_tokens=1):
        features = llm.layers[10].output.sae.features
        features[:, active] = 0.0
        features[:, silent] = 300.0
        written = llm.layers[10].output.save()
        later = llm.layers[11].output.save()
    torch.testing.assert_close(out.captures[SITE], written, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.captures["layers.11.output"], later, rtol=1e-4, atol=1e-4)
    # and by hand: the change is (v - f_j) W_dec[j] for each clamped feature
    with llm.trace(STEER_PROMPTS[0], max_tokens=1):
        x = llm.layers[10].output.save()
    change = (0.0 - f[:, active])[:, None] * sae.W_dec[active]
    change += (300.0 - f[:, silent])[:, None] * sae.W_dec[silent]
    torch.testing.assert_close(out.captures[SITE], x + change, rtol=1e-5, atol=1e-4)
    assert llm.step_stats()["steps"] > steps["steps"]


def test_global_and_named_feature_steering(llm) -> None:
    clamp, _ = _clamp_and_add(llm)
    sampling = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    own = llm.generate(STEER_PROMPTS, steering=clamp, **sampling)
    plain = llm.generate(STEER_PROMPTS, **sampling)
    llm.steering.register("clamped", clamp)
    try:
        assert [
            o.token_ids for o in llm.generate(STEER_PROMPTS, steering="clamped", **sampling)
        ] == [o.token_ids for o in own]
        llm.steering.set(clamp)
        assert [o.token_ids for o in llm.generate(STEER_PROMPTS, **sampling)] == [
            o.token_ids for o in own
        ]
    finally:
        llm.steering.clear()
        llm.steering.unregister("clamped")
    assert [o.token_ids for o in llm.generate(STEER_PROMPTS, **sampling)] == [
        o.token_ids for o in plain
    ]


def test_features_beyond_the_tables_run_uncompiled_with_the_same_result(llm) -> None:
    """Two requests clamping 20 features each: 40 in one step exceed the 32 columns the
    compiled tables hold, so that step runs uncompiled, and gives what each gives alone."""
    specs = [
        vinterp.Steering({FEATURES: {j: 3.0 for j in range(start, start + 20)}}, mode="clamp")
        for start in (0, 100)
    ]
    cap = vinterp.Capture(["layers.11.output"], positions="last_prompt")
    sampling = {"max_tokens": 1, "temperature": 0.0}
    alone = []
    for prompt, spec in zip(STEER_PROMPTS, specs):
        before = llm.step_stats()["uncompiled_steps"]
        alone.append(llm.generate(prompt, steering=spec, **sampling)[0])
        assert llm.step_stats()["uncompiled_steps"] == before  # compiled tables
    before = llm.step_stats()["uncompiled_steps"]
    batch = [vinterp.Request(p, steering=s, capture=cap) for p, s in zip(STEER_PROMPTS, specs)]
    together = llm.generate(batch, **sampling)
    assert llm.step_stats()["uncompiled_steps"] > before
    for got, spec, prompt in zip(together, specs, STEER_PROMPTS):
        want = llm.generate(vinterp.Request(prompt, steering=spec, capture=cap), **sampling)[0]
        torch.testing.assert_close(
            got.captures["layers.11.output"],
            want.captures["layers.11.output"],
            rtol=1e-5,
            atol=1e-5,
        )


def test_feature_steering_is_checked_before_anything_runs(llm, tmp_path) -> None:
    topk = vinterp.SAE.load(write_saelens(tmp_path / "topk", architecture="topk", k=16))
    llm.attach_sae("layers.5.output", topk)
    steps = llm.step_stats()["steps"]
    refused = {
        "feature 2304 is out of range; this SAE has 2304 features": vinterp.Steering(
            {FEATURES: {WIDTH: 1.0}}, mode="clamp"
        ),
        "no sparse autoencoder is attached at layers.3.output": vinterp.Steering(
            {"layers.3.output.sae.features": {1: 1.0}}
        ),
        "top-k SAE": vinterp.Steering({"layers.5.output.sae.features": {1: 1.0}}, mode="clamp"),
    }
    for message, spec in refused.items():
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[0], steering=spec, max_tokens=1)
        with pytest.raises(ValueError, match=message):
            llm.steering.set(spec)
    with pytest.raises(ValueError, match="norm_match"):
        vinterp.Steering({FEATURES: {1: 1.0}}, norm_match=True)
    assert llm.step_stats()["steps"] == steps and llm.steering.active == []
    # adding to a top-k SAE's feature is fine
    llm.generate(PROMPTS[0], steering=vinterp.Steering({"layers.5.output.sae.features": {1: 2.0}}))
