"""Activation patching: which residual-stream cells carry the answer "Paris"?

The clean prompt ("The capital of France is") and the corrupted one ("... Italy is") have the
same number of tokens. One trace runs the clean prompt once, reading every layer's residual
stream, then the corrupted prompt once per (layer, position), with the clean residual written
into that one cell. The measure is logit(" Paris") - logit(" Rome"): a cell that carries the
answer brings it back from the corrupted value to the clean one.

Two pictures: patching the last position, per layer (a line), and every layer x position (a
heatmap; colour = share of the clean-minus-corrupted gap that the patch restores).

    .venv/bin/python examples/activation_patching.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
ANSWERS = (" Paris", " Rome")  # the first token of each is compared


def run(
    llm: vinterp.LLM,
    out_dir: Path,
    clean: str = CLEAN,
    corrupted: str = CORRUPTED,
    answers: tuple[str, str] = ANSWERS,
) -> dict[str, Any]:
    """Patch every layer x position, plot both pictures, return the numbers behind them."""
    labels = _position_labels(llm, clean, corrupted)
    good, bad = (llm.tokenizer(a).input_ids[0] for a in answers)
    clean_diff, corrupted_diff, patched = _sweep(llm, clean, corrupted, len(labels), good, bad)
    restored = (patched - corrupted_diff) / (clean_diff - corrupted_diff)
    measure = f"logit({answers[0]!r}) - logit({answers[1]!r})"
    out_dir = Path(out_dir)
    line_png = plot.line(
        range(len(llm.layers)),
        {f"patched at {labels[-1]}": patched[:, -1].tolist()},
        xlabel="layer patched (residual stream after the layer)",
        ylabel=measure,
        title=f"Clean {clean!r} patched into corrupted {corrupted!r}\nat the last position",
        path=out_dir / "activation_patching_layers.png",
        references={"clean run": clean_diff, "corrupted run": corrupted_diff},
    )
    grid_png = plot.heatmap(
        restored.flip(0),  # last layer on top
        row_labels=[f"layer {i}" for i in reversed(range(len(llm.layers)))],
        col_labels=labels,
        title=f"Patching one cell of clean {clean!r}\ninto corrupted {corrupted!r}",
        path=out_dir / "activation_patching_grid.png",
        cell_text=[[f"{v:.1f}" for v in row] for row in patched.flip(0).tolist()],
        colorbar_label="restored share (cell text: logit difference)",
        cmap="RdBu_r",
        vmin=-1.0,
        vmax=1.0,
    )
    result = {
        "position_labels": labels,
        "clean_diff": clean_diff,
        "corrupted_diff": corrupted_diff,
        "patched": patched,  # (layers, positions)
        "restored": restored,
        "pngs": [line_png, grid_png],
    }
    _report(result)
    return result


def _position_labels(llm: vinterp.LLM, clean: str, corrupted: str) -> list[str]:
    """One label per position ("' France'/' Italy'" where they differ); patching cell by cell
    needs the two prompts to have the same number of tokens."""
    tokens = [
        [llm.tokenizer.decode(t) for t in llm.tokenizer(p).input_ids] for p in (clean, corrupted)
    ]
    if len(tokens[0]) != len(tokens[1]):
        raise ValueError(f"pick prompts with as many tokens: {tokens[0]} vs {tokens[1]}")
    return [repr(a) if a == b else f"{a!r}/{b!r}" for a, b in zip(*tokens)]


def _sweep(
    llm: vinterp.LLM, clean: str, corrupted: str, n_positions: int, good: int, bad: int
) -> tuple[float, float, torch.Tensor]:
    """One trace: the clean residuals are read in the first invoke and written, one cell each,
    in the later ones (vinterp runs those after the clean one)."""

    def logit_diff() -> Any:
        return llm.logits[0, good] - llm.logits[0, bad]

    with llm.trace(max_tokens=1) as tr:
        with tr.invoke(clean):
            residuals = [layer.output for layer in llm.layers]
            clean_diff = logit_diff().save()
        with tr.invoke(corrupted):
            corrupted_diff = logit_diff().save()
        patched = []
        for layer, residual in zip(llm.layers, residuals):
            for pos in range(n_positions):
                with tr.invoke(corrupted):
                    layer.output[pos] = residual[pos]
                    patched.append(logit_diff().save())
    grid = torch.stack(patched).reshape(len(residuals), n_positions)
    return float(clean_diff), float(corrupted_diff), grid


def _report(result: dict[str, Any]) -> None:
    """Per position, the layers whose patch restores more than half of the gap."""
    clean, corrupted = result["clean_diff"], result["corrupted_diff"]
    print(f"logit difference: clean {clean:.2f}, corrupted {corrupted:.2f}")
    for pos, label in enumerate(result["position_labels"]):
        layers = (result["restored"][:, pos] > 0.5).nonzero().flatten().tolist()
        print(f"  patching {label}: layers restoring more than half: {_spans(layers) or 'none'}")
    print(f"wrote {', '.join(str(p) for p in result['pngs'])}")


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
