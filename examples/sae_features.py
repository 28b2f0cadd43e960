"""Sparse autoencoder features: which of an SAE's features fire on each token of a few prompts.

The SAE that examples/sae_training.py trains on the residual stream after layer 6 (saved in
OUT/sae; where none is saved yet, this script runs that example first, a minute or two on
the CPU) is loaded with `vinterp.SAE.load` and attached at layers.6.output. One `generate`
call captures the top features of every prompt token with `vinterp.Capture(..., topk=k)`:
the worker encodes the captured rows and returns each token's k largest features (indices
and values), not the d_sae dense ones. Each token's three largest are printed; the picture
shows, for the features that most often rank among a token's top k, their activation on
every token (zero where a feature is not in the top k).

    .venv/bin/python examples/sae_features.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

import runpy
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

SITE = "layers.6.output"  # where examples/sae_training.py trained its SAE
FEATURES = f"{SITE}.sae.features"
PROMPTS = [
    "The capital of France is Paris.",
    "def add(a, b): return a + b",
    "My grandmother baked bread every winter.",
    "1, 2, 3, 4, 5, 6, 7",
]
TOPK = 8  # features kept per token
PRINTED = 3  # of them, printed per token
PICTURED = 16  # features in the picture


def run(llm: vinterp.LLM, out_dir: Path, sae_dir: Path | None = None) -> dict[str, Any]:
    """Attach the SAE in `sae_dir` (default OUT/sae, trained there by examples/sae_training.py
    when missing), capture each prompt token's top features, print and plot them; return the
    numbers behind the picture (and the training's, when it ran)."""
    trained = None
    if sae_dir is None and not (Path(out_dir) / "sae" / "cfg.json").is_file():
        print(f"no SAE in {Path(out_dir) / 'sae'} yet: training one (examples/sae_training.py)")
        training = runpy.run_path(str(Path(__file__).with_name("sae_training.py")))
        trained = training["run"](llm, Path(out_dir))
    sae_dir = Path(sae_dir or Path(out_dir) / "sae")
    if not (sae_dir / "cfg.json").is_file():
        raise SystemExit(f"no SAE in {sae_dir}: give the directory of an SAE of {SITE}")
    sae = vinterp.SAE.load(sae_dir)
    llm.attach_sae(SITE, sae)
    capture = vinterp.Capture(FEATURES, positions="all_prompt", topk=TOPK)
    outs = llm.generate(PROMPTS, max_tokens=1, capture=capture)
    indices = [out.captures[f"{FEATURES}.indices"] for out in outs]  # (P, TOPK) each
    values = [out.captures[f"{FEATURES}.values"] for out in outs]
    tokens = [[llm.tokenizer.decode([t]) for t in llm.encode(p)] for p in PROMPTS]
    pictured = [f for f, _ in Counter(torch.cat(indices).flatten().tolist()).most_common(PICTURED)]
    grid = torch.zeros(sum(map(len, tokens)), len(pictured))
    column = {feature: k for k, feature in enumerate(pictured)}
    for row, (i, v) in enumerate(zip(torch.cat(indices).tolist(), torch.cat(values).tolist())):
        for feature, value in zip(i, v):
            if feature in column:
                grid[row, column[feature]] = value
    labels = [f"{k}: {t!r}" for k, toks in enumerate(tokens) for t in toks]
    png = plot.heatmap(
        grid,
        labels,
        pictured,
        title=f"Top-{TOPK} features of the SAE at {SITE} ({sae.d_sae} features)",
        path=Path(out_dir) / "sae_features.png",
        xlabel="feature (the most frequent in a token's top k)",
        ylabel="prompt: token",
        colorbar_label="activation (0: not in the token's top k)",
    )
    result = {"tokens": tokens, "indices": indices, "values": values, "png": png}
    _report(result)
    return {**result, "trained": trained}


def _report(result: dict[str, Any]) -> None:
    for k, toks in enumerate(result["tokens"]):
        print(f"prompt {k}: {PROMPTS[k]!r}")
        for token, i, v in zip(toks, result["indices"][k], result["values"][k]):
            top = ", ".join(f"{f}={a:.2f}" for f, a in zip(i[:PRINTED].tolist(), v[:PRINTED]))
            print(f"  {token!r:>14}  {top}")
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
