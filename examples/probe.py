"""Linear probe: from which layer on can a line separate true from false statements?

Forty statements "The city of X is in Y.", half true and half false (each city once), are
run with a `vinterp.Capture` of every layer's residual stream at the last prompt token,
written by the filesystem sink (one safetensors file per prompt). A logistic regression per
layer is fit on a stratified 70% split and scored on the held-out 30%.

Early layers can score below chance: by construction, a country that is the right answer
for one city is the wrong one for another, so surface features mislead a probe there.

    .venv/bin/python examples/probe.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import vinterp
from vinterp import plot

CITIES = [
    ("Paris", "France"), ("Tokyo", "Japan"), ("Berlin", "Germany"), ("Madrid", "Spain"),
    ("Rome", "Italy"), ("Moscow", "Russia"), ("Cairo", "Egypt"), ("Beijing", "China"),
    ("Toronto", "Canada"), ("Sydney", "Australia"), ("Mumbai", "India"), ("Lisbon", "Portugal"),
    ("Athens", "Greece"), ("Dublin", "Ireland"), ("Vienna", "Austria"), ("Stockholm", "Sweden"),
    ("Oslo", "Norway"), ("Warsaw", "Poland"), ("Bangkok", "Thailand"), ("Seoul", "South Korea"),
    ("Istanbul", "Turkey"), ("Nairobi", "Kenya"), ("Lima", "Peru"), ("Havana", "Cuba"),
    ("Chicago", "the United States"), ("Amsterdam", "the Netherlands"), ("Brussels", "Belgium"),
    ("Budapest", "Hungary"), ("Helsinki", "Finland"), ("Copenhagen", "Denmark"),
    ("Manila", "the Philippines"), ("Jakarta", "Indonesia"), ("Santiago", "Chile"),
    ("Bogota", "Colombia"), ("Tehran", "Iran"), ("Baghdad", "Iraq"), ("Hanoi", "Vietnam"),
    ("Lagos", "Nigeria"), ("Kyiv", "Ukraine"), ("Buenos Aires", "Argentina"),
]  # fmt: skip
TEST_SHARE = 0.3
SEED = 0


def statements() -> tuple[list[str], list[int]]:
    """Even-numbered cities get their true country (label 1), odd ones a wrong one (0)."""
    prompts, labels = [], []
    for i, (city, country) in enumerate(CITIES):
        true = i % 2 == 0
        named = country if true else CITIES[(i + 7) % len(CITIES)][1]
        prompts.append(f"The city of {city} is in {named}.")
        labels.append(int(true))
    return prompts, labels


def run(llm: vinterp.LLM, out_dir: Path) -> dict[str, Any]:
    """Capture to files, probe every layer, plot accuracy, return the numbers behind it."""
    prompts, labels = statements()
    files = capture_to_files(llm, prompts, Path(out_dir) / "probe_captures")
    train, test = train_test_split(
        np.arange(len(prompts)), test_size=TEST_SHARE, stratify=labels, random_state=SEED
    )
    captured = [load_file(file) for file in files]  # {site: (1, H)} per prompt
    y = np.array(labels)
    accuracy = []
    for layer in range(len(llm.layers)):
        x = np.stack([c[f"layers.{layer}.output"][-1].float().numpy() for c in captured])
        probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        accuracy.append(float(probe.fit(x[train], y[train]).score(x[test], y[test])))
    png = plot.line(
        range(len(llm.layers)),
        {"logistic probe, held-out": accuracy},
        xlabel="layer (residual stream after it, last prompt token)",
        ylabel="accuracy",
        title=f"True vs false 'The city of X is in Y.' ({len(train)} train, {len(test)} test)",
        path=Path(out_dir) / "probe.png",
        references={"chance": 0.5},
    )
    result = {
        "accuracy": accuracy,
        "n_train": len(train),
        "n_test": len(test),
        "capture_files": files,
        "png": png,
    }
    _report(result)
    return result


def capture_to_files(llm: vinterp.LLM, prompts: list[str], directory: Path) -> list[str]:
    """Every layer's residual at the last prompt token, one safetensors file per prompt (in
    prompt order); a file also names the model, sites, positions and token ids."""
    for stale in directory.glob("*.safetensors"):  # files of an earlier run
        stale.unlink()
    capture = vinterp.Capture(
        "layers.*.output", positions="last_prompt", sink="filesystem", path=directory
    )
    return [out.capture_file for out in llm.generate(prompts, max_tokens=1, capture=capture)]


def _report(result: dict[str, Any]) -> None:
    accuracy = result["accuracy"]
    best = int(np.argmax(accuracy))
    print(
        f"{len(result['capture_files'])} capture files in {Path(result['capture_files'][0]).parent}"
    )
    print(f"held-out accuracy ({result['n_test']} statements) per layer:")
    print("  " + " ".join(f"{a:.2f}" for a in accuracy))
    print(f"best layer {best}: {accuracy[best]:.2f}; layer 0: {accuracy[0]:.2f}; chance 0.50")
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
