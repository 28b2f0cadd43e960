"""Steering: a sentiment direction from contrasting prompts, added while the model generates.

The direction is the mean residual stream (layer 12, last prompt token) of a few positive
prompts minus that of matching negative ones, read with `vinterp.Capture`. It is then set as
a `vinterp.Steering` at a range of scales; at each scale one trace reads the next-token
logits of neutral prompts ("I think the movie was"), and the effect is the mean log-odds of
positive words (" great", " good", " wonderful") against negative ones (" terrible", " bad",
" awful"). Steered generations at a few scales are printed.

    .venv/bin/python examples/steering.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

LAYER = 12
POSITIVE = [
    "I love this, it is wonderful",
    "What a great and happy day",
    "This is excellent, I am delighted",
    "Such a beautiful, joyful moment",
]
NEGATIVE = [
    "I hate this, it is awful",
    "What a terrible and sad day",
    "This is horrible, I am disgusted",
    "Such an ugly, painful moment",
]
NEUTRAL = [
    "I think the movie was",
    "The food at this restaurant is",
    "My day at work was",
    "The hotel room was",
    "The weather today is",
    "Honestly, the service was",
]
GOOD = (" great", " good", " wonderful")
BAD = (" terrible", " bad", " awful")
SCALES = (-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0)
SAMPLE_PROMPT = "My day at work was"  # its steered generations are printed
SHOWN = (-1.0, 0.0, 1.0)


def run(llm: vinterp.LLM, out_dir: Path, layer: int = LAYER) -> dict[str, Any]:
    """Build the direction, sweep the scale, plot the effect, return the numbers behind it."""
    site = f"layers.{layer}.output"
    direction = contrast_direction(llm, site, POSITIVE, NEGATIVE)
    good, bad = ([llm.tokenizer(w).input_ids[0] for w in words] for words in (GOOD, BAD))
    baseline = _sentiment(llm, good, bad)
    effects = []
    for scale in SCALES:
        llm.steering.set(vinterp.Steering({site: direction}, scale=scale))
        try:  # global, because a trace takes no per-request steering
            effects.append(_sentiment(llm, good, bad))
        finally:
            llm.steering.clear()
    png = plot.line(
        SCALES,
        {f"steered at {site}": effects},
        xlabel="steering scale (x the positive-minus-negative direction)",
        ylabel="log-odds of positive vs negative next word",
        title=f"Sentiment steering, mean over {len(NEUTRAL)} neutral prompts",
        path=Path(out_dir) / "steering.png",
        references={"unsteered": baseline},
    )
    result = {
        "site": site,
        "direction_norm": float(direction.norm()),
        "scales": list(SCALES),
        "effects": effects,
        "baseline": baseline,
        "samples": _steered_generations(llm, site, direction),
        "png": png,
    }
    _report(result)
    return result


def contrast_direction(
    llm: vinterp.LLM, site: str, positive: list[str], negative: list[str]
) -> torch.Tensor:
    """Mean of `site` at the last prompt token over `positive` minus that over `negative`."""
    capture = vinterp.Capture(site, positions="last_prompt")
    outs = llm.generate(positive + negative, max_tokens=1, capture=capture)
    rows = torch.stack([out.captures[site][-1] for out in outs])
    return rows[: len(positive)].mean(0) - rows[len(positive) :].mean(0)


def _sentiment(llm: vinterp.LLM, good: list[int], bad: list[int]) -> float:
    """Mean over NEUTRAL of `log_odds`, under whatever global steering is set."""
    return float(log_odds(llm, NEUTRAL, good, bad).mean())


def log_odds(llm: vinterp.LLM, prompts: list[str], good: list[int], bad: list[int]) -> torch.Tensor:
    """Per prompt, log(sum p(good)) - log(sum p(bad)) for the next token, in one trace under
    whatever global steering is set (the softmax normalizer cancels, so raw logits do)."""
    with llm.trace(max_tokens=1) as tr:
        per_prompt = []
        for prompt in prompts:
            with tr.invoke(prompt):
                logits = llm.logits[0]
                odds = torch.logsumexp(logits[good], -1) - torch.logsumexp(logits[bad], -1)
                per_prompt.append(odds.save())
    return torch.stack(per_prompt)


def _steered_generations(llm: vinterp.LLM, site: str, direction: torch.Tensor) -> dict[float, str]:
    """Greedy completions of SAMPLE_PROMPT at the SHOWN scales, in one batch."""
    requests = [
        vinterp.Request(SAMPLE_PROMPT, steering=vinterp.Steering({site: direction}, scale=s))
        for s in SHOWN
    ]
    outs = llm.generate(requests, max_tokens=14)
    return {scale: out.text for scale, out in zip(SHOWN, outs)}


def _report(result: dict[str, Any]) -> None:
    print(f"direction at {result['site']}: norm {result['direction_norm']:.1f}")
    effects = ", ".join(f"{s:+g}: {e:.2f}" for s, e in zip(result["scales"], result["effects"]))
    print(f"log-odds positive vs negative (unsteered {result['baseline']:.2f}) by scale: {effects}")
    for scale, text in result["samples"].items():
        print(f"  scale {scale:+g}: {SAMPLE_PROMPT!r} -> {text!r}")
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
