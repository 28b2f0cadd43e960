"""Induction heads: which attention heads look back at what followed a token's first occurrence.

A sequence of random tokens is repeated once. In the second copy, an induction head at a
token attends to the token that came right after that token's first occurrence (the one to
copy next). Every layer's attention pattern (`llm.layers[i].attn.pattern`, which vLLM's
kernels never materialize) is read in one trace; a head's induction score is its mean
attention to that position over the second copy. The heatmap shows the score per layer and
head.

    .venv/bin/python examples/induction_heads.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

LENGTH = 24  # tokens in each copy
SEED = 0


def repeated_tokens(llm: vinterp.LLM) -> list[int]:
    """A random token sequence twice, after the tokenizer's start token if it has one."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1000, int(llm.config.vocab_size) - 1000, (LENGTH,), generator=g).tolist()
    start = llm.tokenizer.bos_token_id
    return ([start] if start is not None else []) + ids + ids


def induction_scores(patterns: torch.Tensor, first: int) -> torch.Tensor:
    """(layers, heads): mean attention from each query of the second copy (positions from
    `first + LENGTH` on) to the position after its token's first occurrence."""
    queries = torch.arange(first + LENGTH, first + 2 * LENGTH)
    return patterns[:, :, queries, queries - LENGTH + 1].mean(-1)


def run(llm: vinterp.LLM, out_dir: Path) -> dict[str, Any]:
    """Read every layer's pattern, score the heads, plot them, return the numbers."""
    ids = repeated_tokens(llm)
    with llm.trace(ids, max_tokens=1):
        saved = [layer.attn.pattern.save() for layer in llm.layers]
    patterns = torch.stack(saved)  # (layers, heads, T, T)
    first = len(ids) - 2 * LENGTH
    scores = induction_scores(patterns, first)
    layers, heads = scores.shape
    png = plot.heatmap(
        scores.flip(0),  # last layer on top
        row_labels=[f"layer {i}" for i in reversed(range(layers))],
        col_labels=[f"head {h}" for h in range(heads)],
        title=(
            "Induction score per head\n(attention to the token\n"
            f"after the earlier copy, {LENGTH} tokens)"
        ),
        path=Path(out_dir) / "induction_heads.png",
        colorbar_label="mean attention",
        vmin=0.0,
        vmax=1.0,
    )
    result = {"ids": ids, "patterns": patterns, "scores": scores, "png": png}
    _report(result)
    return result


def _report(result: dict[str, Any]) -> None:
    scores = result["scores"]
    top = torch.topk(scores.flatten(), 5)
    heads = scores.shape[1]
    best = ", ".join(
        f"layer {int(i) // heads} head {int(i) % heads}: {float(v):.2f}"
        for v, i in zip(top.values, top.indices)
    )
    print(f"strongest induction heads: {best}")
    print(f"median score over all heads: {float(scores.median()):.3f}")
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
