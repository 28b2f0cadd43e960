"""A long traced prompt for engines that split prompts over steps (chunked prefill): the
saves, reductions, pattern row and writes whose values must not depend on the split."""

from __future__ import annotations

import torch

LONG = " ".join(["The capital of France is Paris and the capital of Italy is Rome."] * 6)


def prompt_ids(llm, count: int) -> list[int]:
    """The first `count` tokens of LONG repeated."""
    ids = llm.tokenizer(" ".join([LONG] * 8)).input_ids
    assert len(ids) >= count
    return ids[:count]


def long_trace(llm, ids: list[int], v: torch.Tensor) -> tuple[dict, list[int]]:
    """Saves of several sites, reductions over positions, the last token's pattern row and a
    write at position 300 with the logits it gives, over a prompt of `len(ids)` tokens."""
    with llm.trace(ids, max_tokens=3) as tr:
        saved = {
            "embed": llm.embed.output.save(),
            "q": llm.layers[0].attn.q.save(),
            "mean": llm.layers[1].output.mean(0).save(),
        }
        llm.layers[2].output[300] += v
        llm.layers[2].mlp.output[-1] = llm.layers[2].mlp.output[-1] * 0.5
        saved["after"] = llm.layers[3].output.save()
        saved["pattern"] = llm.layers[3].attn.pattern[:, -1].save()
        saved["logits"] = llm.logits.save()
        for _ in tr.iter[1:]:
            saved["generated"] = llm.layers[1].output.save()
    return saved, tr.outputs[0].token_ids


def close(got, want) -> None:
    """Equal shapes and a relative error under 1e-4 (tensors or lists of them)."""
    got, want = (
        (got, want) if isinstance(got, torch.Tensor) else (torch.stack(got), torch.stack(want))
    )
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-4
