"""Traces on a pipeline-parallel engine (PP=2) against `llm.generate` on the same engine:
every layer saved (values leave both stages), and patching across the stage split (values
travel from the first stage to the second with the step)."""

from __future__ import annotations

from pathlib import Path

from vinterp.bench.harness import Row, free_memory, target, timed

SAVE_LAYERS = "pp_save_layers"
PATCH = "pp_patch"
KEYS = (SAVE_LAYERS, PATCH)


def run(model: str | Path, prompts: int, repeats: int, dtype: str, selected: set[str]) -> list[Row]:
    import vinterp

    texts = [f"Fact number {i}: the capital of France is" for i in range(prompts)]
    llm = vinterp.LLM(model, dtype=dtype, pipeline_parallel_size=2)
    try:
        n = len(llm.layers)
        early, late = n // 4, 3 * n // 4  # on the first and the second stage

        def plain() -> None:
            llm.generate(texts, max_tokens=1, use_tqdm=False)

        def save_layers() -> None:
            with llm.trace(max_tokens=1, use_tqdm=False) as tr:
                for text in texts:
                    with tr.invoke(text):
                        rows = [layer.output[-1].save() for layer in llm.layers]
            assert len(rows) == n

        def patch() -> None:
            with llm.trace(max_tokens=1, use_tqdm=False) as tr:
                for text in texts:
                    with tr.invoke(text):
                        llm.layers[late].output[-1] = llm.layers[early].output[-1]

        baseline = timed(plain, repeats)
        size = f" ({prompts} invokes, PP=2, vs generate)"
        workloads = {
            SAVE_LAYERS: ("trace: save every layer's last row", save_layers),
            PATCH: (f"trace: patch layers[{late}] from layers[{early}]", patch),
        }
        return [
            Row(name + size, baseline, timed(fn, repeats), target(key), key, tokens=prompts)
            for key, (name, fn) in workloads.items()
            if key in selected
        ]
    finally:
        llm.shutdown()
        free_memory()
