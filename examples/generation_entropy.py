"""Generation step by step: how sure is each layer of the next token, at every step?

One trace generates 8 tokens; a `tr.iter[:]` block, recorded once, runs at every step and
reads the logit-lens entropy (in nats) of every layer's residual stream at the newest token.
The heatmap has one row per step, labelled with the token sampled there; the last column is
the entropy of the model's own next-token distribution.

    .venv/bin/python examples/generation_entropy.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

PROMPT = "The three primary colors are"
STEPS = 8


def entropy(logits: Any) -> Any:
    """Shannon entropy (nats) of softmax(logits) over the last axis; works in a trace too."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def run(llm: vinterp.LLM, out_dir: Path, prompt: str = PROMPT) -> dict[str, Any]:
    """Lens entropy per step and layer, plot it, return the numbers behind the plot."""
    with llm.trace(prompt, max_tokens=STEPS, ignore_eos=True) as tr:
        for _ in tr.iter[:]:
            lens = [entropy(llm.unembed(layer.output[-1])) for layer in llm.layers]
            per_layer = torch.stack(lens).save()  # a list: one (layers,) tensor per step
            logits = llm.logits.save()  # a list: one (1, V) tensor per step
    entropies = torch.stack(per_layer)  # (steps, layers)
    tokens = [llm.tokenizer.decode(t) for t in tr.outputs[0].token_ids]
    png = plot.heatmap(
        entropies,
        row_labels=[f"{k}: {t!r}" for k, t in enumerate(tokens)],
        col_labels=range(len(llm.layers)),
        title=f"Logit-lens entropy while generating from {prompt!r}",
        path=Path(out_dir) / "generation_entropy.png",
        xlabel="layer",
        ylabel="step: token sampled",
        colorbar_label="entropy (nats)",
        cmap="magma",
    )
    result = {
        "tokens": tokens,
        "entropies": entropies,
        "logits": torch.cat(logits),  # (steps, V)
        "png": png,
    }
    _report(result)
    return result


def _report(result: dict[str, Any]) -> None:
    """Per step: the token, the model's own entropy, and the layer most sure of a token."""
    print(f"generated: {''.join(result['tokens'])!r}")
    own = entropy(result["logits"])
    for k, (token, row) in enumerate(zip(result["tokens"], result["entropies"])):
        low = int(row.argmin())
        print(
            f"  step {k} {token!r:>12}: output entropy {own[k]:.2f} nats, "
            f"lowest at layer {low} ({row[low]:.2f})"
        )
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
