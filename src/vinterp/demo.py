"""`vinterp demo`: each tool once on the bundled model, printed so a newcomer sees it work.

Greedy generation; a trace that patches a residual-stream cell from one prompt into another
and moves the answer; a capture that reads the residual stream of contrasting prompts; and
generation steered along the direction that capture gives. Only the public API is used, so
the file also reads as an example.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import vinterp

GREEDY_PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
]

CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
# The patching grid of examples/activation_patching.py: the answer rides on the country token
# up to layer 22 and on the last token from layer 23 on. Layer 15 at both positions and layer 25
# at the last one show where it is.
PATCH_MIDDLE, PATCH_LATE = 15, 25

# Sentiment direction: mean residual at the last prompt token of POSITIVE minus NEGATIVE.
STEER_SITE = "layers.12.output"
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
STEER_PROMPT = "Yesterday I went to the park and"
# The direction's norm is about a third of the residual's at this layer: at scale 1 the text
# stays fluent and changes mood; at 2 it drifts off topic, at 4 it repeats words.
STEER_SCALE = 1.0
STEER_TOKENS = 20


def main(max_tokens: int = 8, verbose: bool = False, backend: str = "vllm") -> None:
    """Start the bundled model, run the demo, stop it; `backend="hf"` runs the transformers
    reference instead of vLLM."""
    start = time.perf_counter()
    with vinterp.LLM(backend=backend) as llm:
        print(f"engine started in {time.perf_counter() - start:.1f} s")
        run(llm, max_tokens, verbose)


def run(llm: vinterp.LLM, max_tokens: int = 8, verbose: bool = False) -> dict[str, Any]:
    """Print each tool's effect; return what was printed, for tests."""
    return {
        "greedy": greedy(llm, max_tokens, verbose),
        "patched": patch(llm),
        "steered": capture_and_steer(llm),
    }


def greedy(llm: vinterp.LLM, max_tokens: int, verbose: bool = False) -> list[str]:
    """Plain generation: what the model says before anything is changed."""
    outputs = llm.generate(GREEDY_PROMPTS, max_tokens=max_tokens, temperature=0.0, use_tqdm=verbose)
    print("\n== generate: greedy completions")
    for prompt, out in zip(GREEDY_PROMPTS, outputs):
        print(f"  {prompt!r} -> {out.text!r}")
    return [out.text for out in outputs]


def patch(llm: vinterp.LLM) -> dict[str, str]:
    """Activation patching in one trace: the France prompt's residual stream is read in its
    invoke and written into one cell of the Italy prompt in each later invoke."""
    tokens = [
        [llm.tokenizer.decode(t) for t in llm.tokenizer(p).input_ids] for p in (CLEAN, CORRUPTED)
    ]
    country = next(i for i, (a, b) in enumerate(zip(*tokens)) if a != b)
    last = len(tokens[1]) - 1
    cells = {
        f"layers[{PATCH_MIDDLE}].output at {tokens[1][country]!r}": (PATCH_MIDDLE, country),
        f"layers[{PATCH_MIDDLE}].output at {tokens[1][last]!r}": (PATCH_MIDDLE, last),
        f"layers[{PATCH_LATE}].output at {tokens[1][last]!r}": (PATCH_LATE, last),
    }
    with llm.trace(max_tokens=1, use_tqdm=False) as tr:
        with tr.invoke(CLEAN):
            clean = {layer: llm.layers[layer].output for layer in (PATCH_MIDDLE, PATCH_LATE)}
            clean_logits = llm.logits.save()
        with tr.invoke(CORRUPTED):
            corrupted_logits = llm.logits.save()
        patched_logits = {}
        for label, (layer, pos) in cells.items():
            with tr.invoke(CORRUPTED):
                llm.layers[layer].output[pos] = clean[layer][pos]
                patched_logits[label] = llm.logits.save()

    def top(logits: torch.Tensor) -> tuple[str, float]:
        probs = torch.softmax(logits.flatten().float(), -1)
        return llm.tokenizer.decode(int(probs.argmax())), float(probs.max())

    rows = {
        f"clean     {CLEAN!r}": top(clean_logits),
        f"corrupted {CORRUPTED!r}": top(corrupted_logits),
    }
    rows |= {f"patched   {label}": top(logits) for label, logits in patched_logits.items()}
    width = max(map(len, rows))
    print("\n== trace: activation patching, one position of the France prompt's residual stream")
    print("   written into the Italy prompt (next token and its probability)")
    for label, (token, prob) in rows.items():
        print(f"  {label:<{width}} -> {token!r} ({prob:.2f})")
    print(
        f"  At layer {PATCH_MIDDLE} the answer sits on the country token; by layer {PATCH_LATE}"
        " it has moved to the last one."
    )
    return {label: token for label, (token, _) in rows.items()}


def capture_and_steer(llm: vinterp.LLM) -> dict[str, str]:
    """Capture the residual stream of positive and negative prompts, take the difference of
    their means as a direction, and add it (or its negative) while generating."""
    capture = vinterp.Capture(STEER_SITE, positions="last_prompt")
    outputs = llm.generate(POSITIVE + NEGATIVE, max_tokens=1, capture=capture, use_tqdm=False)
    rows = torch.cat([out.captures[STEER_SITE] for out in outputs])  # (prompts, hidden)
    direction = rows[: len(POSITIVE)].mean(0) - rows[len(POSITIVE) :].mean(0)
    shape = tuple(outputs[0].captures[STEER_SITE].shape)
    print(f"\n== capture: {STEER_SITE} at the last prompt token of {len(outputs)} prompts")
    print(f"  out.captures[{STEER_SITE!r}].shape: {shape} (positions, hidden) per prompt")
    print(
        f"  direction = mean(positive prompts) - mean(negative prompts): norm"
        f" {direction.norm():.0f}, the residual's {rows.norm(dim=-1).mean():.0f}"
    )
    runs = {
        f"scale {-STEER_SCALE:+g}": -STEER_SCALE,
        "unsteered": None,
        f"scale {STEER_SCALE:+g}": STEER_SCALE,
    }
    requests = [
        vinterp.Request(
            STEER_PROMPT,
            steering=None if s is None else vinterp.Steering({STEER_SITE: direction}, scale=s),
        )
        for s in runs.values()
    ]
    steered = llm.generate(requests, max_tokens=STEER_TOKENS, temperature=0.0, use_tqdm=False)
    width = max(map(len, runs))
    print(f"\n== steering: {STEER_PROMPT!r} with {STEER_SITE} += scale x direction")
    for label, out in zip(runs, steered):
        print(f"  {label:<{width}}: {out.text!r}")
    return {label: out.text for label, out in zip(runs, steered)}
