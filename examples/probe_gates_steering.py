"""A probe that gates a steering: push toward positive only where the text reads as negative.

A linear probe at layer 8 reads sentiment: its weight is the unit difference of the positive
and negative prompts' mean residual there (examples/steering.py's prompts, last prompt token,
read with `vinterp.Capture`), its bias puts 0 halfway between the two means. The positive
direction at layer 12 (examples/steering.py's) is then added with
`when=vinterp.When(probe="sentiment", below=0.0)`: the engine scores the probe at every token
inside the step and steers only the tokens it reads as negative (conditional activation
steering). The plot shows the probe's score per token of two held-out prompts; the report
checks, token by token, that the steering moved the residual exactly where the probe fired,
and prints the completions, plain, gated and steered everywhere.

    .venv/bin/python examples/probe_gates_steering.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

PROBE_LAYER, STEER_LAYER, SCALE = 8, 12, 2.0
# examples/steering.py, the script beside this one: its contrasting prompts and its direction
STEERING = runpy.run_path(str(Path(__file__).with_name("steering.py")))
POSITIVE, NEGATIVE = STEERING["POSITIVE"], STEERING["NEGATIVE"]
# held out: the probe is not fitted on them
HELD_OUT = {"positive": "I loved the movie, it was", "negative": "I hated the movie, it was"}


def run(llm: vinterp.LLM, out_dir: Path) -> dict[str, Any]:
    """Fit the probe, gate the sentiment steering with it, plot the scores, return the numbers."""
    probe = sentiment_probe(llm, f"layers.{PROBE_LAYER}.output")
    site = f"layers.{STEER_LAYER}.output"
    direction = STEERING["contrast_direction"](llm, site, POSITIVE, NEGATIVE)
    gated = vinterp.Steering(
        {site: direction}, scale=SCALE, when=vinterp.When(probe="sentiment", below=0.0)
    )
    always = vinterp.Steering({site: direction}, scale=SCALE)
    prompts = list(HELD_OUT.values())
    capture = vinterp.Capture(site, positions="all_prompt")
    plain = llm.generate(prompts, max_tokens=12, probes=[probe], capture=capture)
    steered = llm.generate(prompts, max_tokens=12, probes=[probe], capture=capture, steering=gated)
    everywhere = llm.generate(prompts, max_tokens=12, steering=always)
    scores, fired, moved = {}, {}, {}
    for label, p, s in zip(HELD_OUT, plain, steered):
        prompt_len = len(p.prompt_token_ids)
        scores[label] = p.probes["sentiment"][:prompt_len, 0].tolist()
        fired[label] = [score < 0 for score in scores[label]]
        # at the steered site itself a prompt token's value changes only by its own steering
        change = (s.captures[site] - p.captures[site]).norm(dim=-1)
        moved[label] = [bool(c > 1e-3 * SCALE * direction.norm()) for c in change]
    longest = max(map(len, scores.values()))
    png = plot.line(
        list(range(longest)),
        {
            f"{label}: {HELD_OUT[label]!r}": s + [math.nan] * (longest - len(s))
            for label, s in scores.items()
        },
        xlabel="prompt token",
        ylabel="sentiment probe score",
        title=f"Probe at layer {PROBE_LAYER}; positive steering at layer {STEER_LAYER} where < 0",
        path=Path(out_dir) / "probe_gates_steering.png",
        references={"gate threshold": 0.0},
    )
    result = {
        "probe": probe,
        "scores": scores,
        "fired": fired,
        "moved": moved,
        "plain": [o.text for o in plain],
        "gated": [o.text for o in steered],
        "always": [o.text for o in everywhere],
        "png": png,
    }
    _report(result)
    return result


def sentiment_probe(llm: vinterp.LLM, site: str) -> vinterp.Probe:
    """Positive minus negative: the unit difference of the two groups' mean last-prompt rows at
    `site`, its bias minus the midpoint of the two means along it."""
    capture = vinterp.Capture(site, positions="last_prompt")
    outs = llm.generate(POSITIVE + NEGATIVE, max_tokens=1, capture=capture)
    rows = torch.stack([out.captures[site][-1] for out in outs]).float()
    positive, negative = rows[: len(POSITIVE)].mean(0), rows[len(POSITIVE) :].mean(0)
    weight = (positive - negative) / (positive - negative).norm()
    bias = -float(weight @ (positive + negative)) / 2
    return vinterp.Probe(site, weight, torch.tensor([bias]), name="sentiment")


def _report(result: dict[str, Any]) -> None:
    for k, label in enumerate(HELD_OUT):
        fired, moved = result["fired"][label], result["moved"][label]
        print(
            f"{label} prompt {HELD_OUT[label]!r}: probe below 0 at {sum(fired)} of "
            f"{len(fired)} prompt tokens; steered at {sum(moved)}, the same tokens: "
            f"{fired == moved}"
        )
        print(f"  plain : {result['plain'][k]!r}")
        print(f"  gated : {result['gated'][k]!r}")
        print(f"  always: {result['always'][k]!r}")
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
