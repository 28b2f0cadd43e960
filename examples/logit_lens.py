"""Logit lens: what the model would predict if it stopped after each layer.

Every layer's residual stream is unembedded (final norm, then LM head) at every prompt
position, all in one trace. The heatmap shows the top token (text) and its probability
(colour); the top row is the last layer, whose last cell is the model's own next token.

    .venv/bin/python examples/logit_lens.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

PROMPT = "The capital of France is"


def run(llm: vinterp.LLM, out_dir: Path, prompt: str = PROMPT) -> dict[str, Any]:
    """Lens every layer at every position, plot it, return the numbers behind the plot."""
    with llm.trace(prompt, max_tokens=1) as tr:
        probs = [llm.unembed(layer.output).softmax(-1) for layer in llm.layers]
        top_probs = torch.stack([p.amax(-1) for p in probs]).save()  # (layers, positions)
        top_ids = torch.stack([p.argmax(-1) for p in probs]).save()
    decode = llm.tokenizer.decode
    prompt_tokens = [decode(t) for t in tr.outputs[0].prompt_token_ids]
    top_tokens = [[decode(t) for t in row] for row in top_ids.tolist()]
    layers = range(len(llm.layers))
    png = plot.heatmap(
        top_probs.flip(0),  # last layer on top
        row_labels=[f"layer {i}" for i in reversed(layers)],
        col_labels=[repr(t) for t in prompt_tokens],  # quotes show leading spaces
        title=f"Logit lens: top token per layer and position\n{prompt!r}",
        path=Path(out_dir) / "logit_lens.png",
        cell_text=[[repr(t) for t in row] for row in reversed(top_tokens)],
        colorbar_label="probability of the top token",
    )
    result = {
        "prompt_tokens": prompt_tokens,
        "top_ids": top_ids,
        "top_probs": top_probs,
        "top_tokens": top_tokens,
        "next_token_id": tr.outputs[0].token_ids[0],
        "png": png,
    }
    _report(result)
    return result


def _report(result: dict[str, Any]) -> None:
    """Where the final answer appears at the last position, and how sure each layer is."""
    last = [row[-1] for row in result["top_tokens"]]
    settled = len(last)
    while settled > 0 and last[settled - 1] == last[-1]:
        settled -= 1
    probs = result["top_probs"][:, -1]
    print(f"prompt tokens: {result['prompt_tokens']}")
    print(f"last position, top token from layer {settled} on: {last[-1]!r}")
    print(f"  its probability there: {probs[settled]:.2f}, at the last layer: {probs[-1]:.2f}")
    guesses = " ".join(f"{i}:{last[i]!r}" for i in range(0, settled, 4))
    print(f"  earlier layers' guesses (layer:token): {guesses}")
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
