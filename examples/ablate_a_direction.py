"""Directional ablation: a sentiment direction found from captures, projected out at every layer.

The direction is examples/steering.py's: the mean residual stream (layer 12, last prompt
token) of positive prompts minus that of negative ones, read with `vinterp.Capture`. Ablating it
(`vinterp.Steering(..., mode="ablate")`, x - (x . u) u at every layer's output) removes what
the model writes along it: the plot shows, per layer, how far apart positive and negative
held-out prompts lie along the direction with and without the ablation, and the report how
much the next-word sentiment of those prompts still follows their context.

    .venv/bin/python examples/ablate_a_direction.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import torch

import vinterp
from vinterp import plot

LAYER = 12
# examples/steering.py, the script beside this one: its contrasting prompts, its sentiment
# words and how it finds the direction
STEERING = runpy.run_path(str(Path(__file__).with_name("steering.py")))
POSITIVE, NEGATIVE, GOOD, BAD = (STEERING[name] for name in ("POSITIVE", "NEGATIVE", "GOOD", "BAD"))
# held out: the direction is not fitted on them
HELD_OUT_POSITIVE = ["I loved the movie, it was", "We had a fantastic trip, the hotel was"]
HELD_OUT_NEGATIVE = ["I hated the movie, it was", "We had a miserable trip, the hotel was"]


def run(llm: vinterp.LLM, out_dir: Path, layer: int = LAYER) -> dict[str, Any]:
    """Find the direction, ablate it at every layer, plot the separation along it per layer,
    return the numbers behind the plot."""
    site = f"layers.{layer}.output"
    direction = STEERING["contrast_direction"](llm, site, POSITIVE, NEGATIVE)
    layers = range(int(llm.config.num_hidden_layers))
    ablate = vinterp.Steering({f"layers.{i}.output": direction for i in layers}, mode="ablate")
    good, bad = ([llm.tokenizer(w).input_ids[0] for w in words] for words in (GOOD, BAD))
    plain = _read(llm, direction, good, bad, None)
    ablated = _read(llm, direction, good, bad, ablate)
    png = plot.line(
        list(layers),
        {"plain model": plain["separation"], "direction ablated": ablated["separation"]},
        xlabel="layer",
        ylabel="positive minus negative prompts, along the direction",
        title=f"Sentiment direction from {site}, ablated at every layer",
        path=Path(out_dir) / "ablate_a_direction.png",
    )
    result = {
        "site": site,
        "layer": layer,
        "direction": direction,
        "separation": plain["separation"],
        "ablated_separation": ablated["separation"],
        "sentiment_gap": plain["gap"],
        "ablated_sentiment_gap": ablated["gap"],
        "png": png,
    }
    _report(result)
    return result


def _read(
    llm: vinterp.LLM,
    direction: torch.Tensor,
    good: list[int],
    bad: list[int],
    steering: vinterp.Steering | None,
) -> dict[str, Any]:
    """Per layer, the mean projection of the held-out positive prompts' last residual on the
    unit direction minus the negative ones'; and the mean next-word log-odds (good vs bad
    words) of the positive prompts minus the negative ones', all under `steering`."""
    unit = direction / direction.norm()
    capture = vinterp.Capture("layers.*.output", positions="last_prompt")
    prompts = HELD_OUT_POSITIVE + HELD_OUT_NEGATIVE
    outs = llm.generate(prompts, max_tokens=1, capture=capture, steering=steering)
    n = len(HELD_OUT_POSITIVE)
    separation = []
    for i in range(int(llm.config.num_hidden_layers)):
        along = torch.stack([o.captures[f"layers.{i}.output"][-1] @ unit for o in outs])
        separation.append(float(along[:n].mean() - along[n:].mean()))
    odds = _log_odds(llm, prompts, good, bad, steering)
    return {"separation": separation, "gap": float(odds[:n].mean() - odds[n:].mean())}


def _log_odds(
    llm: vinterp.LLM,
    prompts: list[str],
    good: list[int],
    bad: list[int],
    steering: vinterp.Steering | None,
) -> torch.Tensor:
    """examples/steering.py's `log_odds` of `prompts` with `steering` set globally (a trace
    takes no per-request steering)."""
    if steering is not None:
        llm.steering.set(steering)
    try:
        return STEERING["log_odds"](llm, prompts, good, bad)
    finally:
        llm.steering.clear()


def _report(result: dict[str, Any]) -> None:
    plain, ablated = result["separation"], result["ablated_separation"]
    print(f"direction from {result['site']}: norm {float(result['direction'].norm()):.1f}")
    print(
        f"separation along it, largest over layers: {max(plain):.2f} plain, "
        f"{max(map(abs, ablated)):.2g} ablated"
    )
    print(
        f"next-word sentiment gap (positive minus negative context): "
        f"{result['sentiment_gap']:.2f} plain, {result['ablated_sentiment_gap']:.2f} ablated"
    )
    print(f"wrote {result['png']}")


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
