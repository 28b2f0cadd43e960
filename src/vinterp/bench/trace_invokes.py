"""Many invokes in one trace, each saving one layer's last token, against `llm.generate`."""

from __future__ import annotations

from typing import Any

from vinterp.bench.harness import Row, target, timed

KEY = "trace"


def run(llm: Any, invokes: int = 256, layer: int | None = None, repeats: int = 3) -> Row:
    """Time one trace of `invokes` invokes against `llm.generate` of the same prompts;
    `layer` defaults to the middle one (15 on the bundled model)."""
    layer = len(llm.layers) // 2 if layer is None else layer
    prompts = [f"Fact number {i}: the capital of France is" for i in range(invokes)]

    def plain() -> None:
        llm.generate(prompts, max_tokens=1, use_tqdm=False)

    def traced() -> None:
        with llm.trace(max_tokens=1, use_tqdm=False) as tr:
            saved = []
            for prompt in prompts:
                with tr.invoke(prompt):
                    saved.append(llm.layers[layer].output[-1].save())
        assert len(saved) == invokes and saved[0].shape == (llm.config.hidden_size,)

    return Row(
        f"trace {invokes} invokes, save layers[{layer}][-1] (vs generate)",
        timed(plain, repeats),
        timed(traced, repeats),
        target(KEY),
        KEY,
        tokens=invokes,
    )
