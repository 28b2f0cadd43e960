"""The examples run on the bundled model, and the numbers behind each picture mean what the
picture says (not only that a PNG was written)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from eager_attention import eager_attentions

import vinterp
from vinterp.bench.bench_sae import random_sae

pytestmark = pytest.mark.engine("bundled")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str) -> ModuleType:
    """Import examples/NAME.py (a script, not a package) under a name that shadows nothing."""
    spec = importlib.util.spec_from_file_location(
        f"vinterp_example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llm(engines):
    return engines.vllm(None)


def assert_pngs(*paths: Path) -> None:
    for path in paths:
        assert Path(path).read_bytes().startswith(b"\x89PNG")


def test_logit_lens(llm, tmp_path) -> None:
    result = example("logit_lens").run(llm, tmp_path)
    layers, positions = len(llm.layers), len(result["prompt_tokens"])
    assert result["top_ids"].shape == result["top_probs"].shape == (layers, positions)
    assert ((result["top_probs"] > 0) & (result["top_probs"] <= 1)).all()
    # The last layer's lens at the last position is the model's own next-token prediction.
    assert int(result["top_ids"][-1, -1]) == result["next_token_id"]
    assert result["top_tokens"][-1][-1] == " Paris"
    assert_pngs(result["png"])


def test_activation_patching(llm, tmp_path) -> None:
    result = example("activation_patching").run(llm, tmp_path)
    clean, corrupted, patched = result["clean_diff"], result["corrupted_diff"], result["patched"]
    gap = clean - corrupted
    assert patched.shape == (len(llm.layers), len(result["position_labels"]))
    assert gap > 5  # " Paris" wins on the clean prompt, " Rome" on the corrupted one
    # The last layer at the last position is all the logits see: patching it restores clean.
    assert patched[-1, -1] == pytest.approx(clean, abs=0.02 * gap)
    # Layer 0 at the last position has barely read " France": almost nothing changes.
    assert patched[0, -1] == pytest.approx(corrupted, abs=0.05 * gap)
    # Positions before " France"/" Italy" hold the same residuals in both runs.
    assert torch.allclose(
        patched[:, :3], torch.full_like(patched[:, :3], corrupted), atol=0.01 * gap
    )
    assert_pngs(*result["pngs"])


def test_steering(llm, tmp_path) -> None:
    module = example("steering")
    result = module.run(llm, tmp_path)
    effects, baseline = result["effects"], result["baseline"]
    assert effects[module.SCALES.index(0.0)] == pytest.approx(baseline, abs=1e-4)
    assert all(a < b for a, b in zip(effects, effects[1:]))  # more positive with the scale
    assert max(effects) > baseline + 3
    assert set(result["samples"]) == set(module.SHOWN)
    assert llm.steering.active == []  # the sweep leaves no global steering behind
    assert_pngs(result["png"])


def test_probe(llm, tmp_path) -> None:
    result = example("probe").run(llm, tmp_path)
    accuracy = result["accuracy"]
    assert len(accuracy) == len(llm.layers)
    assert len(list((tmp_path / "probe_captures").glob("*.safetensors"))) == 40
    assert max(accuracy) >= 0.8  # some layer separates true from false statements
    assert accuracy[0] <= 0.6  # ... which the first layer cannot
    assert_pngs(result["png"])


def test_sae_training_run_by_sae_features_on_its_own(llm, tmp_path) -> None:
    """examples/sae_features.py with no SAE saved trains one with examples/sae_training.py,
    then shows its features."""
    module = example("sae_training")
    features = example("sae_features").run(llm, tmp_path)
    result = features["trained"]
    assert len(features["indices"]) == len(example("sae_features").PROMPTS)
    losses = result["losses"]
    assert len(losses) == module.STEPS and result["rows"] == result["dataset_rows"] > 1000
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.05 * first  # SAELens's loss falls
    # held-out prompts' rows: the SAE explains most of their variance, their mean none of it
    assert result["held_out_fve"] >= 0.8
    sae = vinterp.SAE.load(tmp_path / "sae")  # saved by SAELens's save_model
    assert (sae.architecture, sae.d_in, sae.d_sae) == ("standard", 576, module.EXPANSION * 576)
    assert_pngs(result["png"])


def test_generation_entropy(llm, tmp_path) -> None:
    module = example("generation_entropy")
    result = module.run(llm, tmp_path)
    entropies, logits = result["entropies"], result["logits"]
    assert entropies.shape == (module.STEPS, len(llm.layers))
    assert logits.shape == (module.STEPS, llm.config.vocab_size)
    assert torch.isfinite(entropies).all()
    assert (entropies >= -1e-4).all() and (entropies <= math.log(logits.shape[-1]) + 1e-4).all()
    # At the last layer the lens is the model's own logits: same distribution, same entropy.
    own = torch.distributions.Categorical(logits=logits[0]).entropy()
    assert entropies[0, -1] == pytest.approx(float(own), abs=1e-3)
    assert_pngs(result["png"])


def test_induction_heads(llm, tmp_path) -> None:
    module = example("induction_heads")
    result = module.run(llm, tmp_path)
    patterns, ids, scores = result["patterns"], result["ids"], result["scores"]
    heads = llm.config.num_attention_heads
    assert patterns.shape == (len(llm.layers), heads, len(ids), len(ids))
    # the engine's patterns are transformers' eager attention over the same weights
    want = torch.stack(eager_attentions(vinterp.models.bundled(), ids))
    assert float((patterns - want).norm() / want.norm()) < 1e-4
    # a score is the mean attention to the token after the earlier copy, here by hand
    layer, head = divmod(int(scores.argmax()), heads)
    first, length = len(ids) - 2 * module.LENGTH, module.LENGTH
    by_hand = sum(
        float(patterns[layer, head, q, q - length + 1])
        for q in range(first + length, first + 2 * length)
    )
    assert scores[layer, head] == pytest.approx(by_hand / length, rel=1e-5)
    # a trained model has a few strong induction heads among many that are not
    assert float(scores.max()) > 0.5 > 5 * float(scores.median())
    assert_pngs(result["png"])


def test_sae_features(llm, tmp_path, capsys) -> None:
    """On a random SAE saved where examples/sae_training.py saves its own: the top features
    returned and printed are `sae.topk` of the residual captured apart."""
    module = example("sae_features")
    sae = random_sae(576)
    sae.save(tmp_path / "sae")
    result = module.run(llm, tmp_path)
    printed = capsys.readouterr().out
    capture = vinterp.Capture(module.SITE, positions="all_prompt")
    outs = llm.generate(module.PROMPTS, max_tokens=1, capture=capture)
    for k, out in enumerate(outs):
        want_indices, want_values = sae.topk(out.captures[module.SITE], module.TOPK)
        indices, values = result["indices"][k], result["values"][k]
        assert len(result["tokens"][k]) == len(indices) == len(want_indices)
        torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
        assert torch.equal(indices.sort().values, want_indices.sort().values)
        top = f"{int(want_indices[-1, 0])}={float(want_values[-1, 0]):.2f}"
        assert top in printed  # the last token's largest feature, as printed
    assert_pngs(result["png"])
    assert result["trained"] is None  # the SAE saved there was used
    with pytest.raises(SystemExit, match="no SAE in .*give the directory of an SAE"):
        module.run(llm, tmp_path, sae_dir=tmp_path / "empty")


def test_ablate_a_direction(llm, tmp_path) -> None:
    result = example("ablate_a_direction").run(llm, tmp_path)
    plain, ablated = result["separation"], result["ablated_separation"]
    assert len(plain) == len(ablated) == len(llm.layers)
    # the held-out prompts lie apart along the direction where it was found...
    assert plain[result["layer"]] > 1.0
    # ... and nothing is left along it at any layer once it is ablated there
    assert max(map(abs, ablated)) < 1e-3 * max(plain)
    assert abs(result["ablated_sentiment_gap"]) < abs(result["sentiment_gap"])
    assert llm.steering.active == []
    assert_pngs(result["png"])


def test_probe_gates_steering(llm, tmp_path) -> None:
    result = example("probe_gates_steering").run(llm, tmp_path)
    fired, moved = result["fired"], result["moved"]
    for label in ("positive", "negative"):
        # the residual moved exactly at the tokens the probe read as negative...
        assert moved[label] == fired[label]
    # ... which were some tokens, not all: the gate opened and closed
    every = fired["positive"] + fired["negative"]
    assert any(every) and not all(every)
    # the probe reads the sentiment word: "loved" above the gate, "hated" below it
    assert result["scores"]["positive"][1] > 0 > result["scores"]["negative"][1]
    assert result["gated"] != result["plain"]
    assert_pngs(result["png"])
