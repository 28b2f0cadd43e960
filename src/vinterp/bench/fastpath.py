"""Steering, capture and traces against plain vLLM (no vinterp in the engine), same machine,
same run, same dtype and engine settings. One engine is alive at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vinterp.bench import pipeline, trace_invokes
from vinterp.bench.harness import (
    REFERENCE,
    Row,
    Timing,
    device_kind,
    free_memory,
    target,
    timed,
    timed_interleaved,
)

PROMPT_TEMPLATE = "Write a short story about a robot number {i} who learns to paint."
EAGER = "eager"
IN_GRAPH = " [capture_in_graph]"  # rows of an engine started with capture_in_graph=True
# Rows at TP=2 (vinterp and plain vLLM, both TP=2): their keys and the one-worker rows they repeat
TENSOR_PARALLEL = {
    "tp_idle": "idle",
    "tp_steer": "steer",
    "tp_capture_layers_last": "capture_layers_last",
}
# Row keys `vinterp bench --workloads` selects from, in the order they run.
WORKLOADS = (
    EAGER,
    "idle",
    "steer",
    "capture_one",
    "capture_layers_last",
    "capture_layers_all",
    trace_invokes.KEY,
    *pipeline.KEYS,
    *TENSOR_PARALLEL,
)


def resolve_dtype(model: str | Path, dtype: str | None = None) -> str:
    """`dtype`, or else the checkpoint's own: what `vinterp.LLM` picks when given none."""
    if dtype:
        return dtype
    from vinterp.api.llm import checkpoint_dtype

    return checkpoint_dtype(checkpoint_config(model))


def checkpoint_config(model: str | Path) -> Any:
    """The checkpoint's HF config (read without loading weights)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model))


def attention_heads(model: str | Path) -> int:
    """The checkpoint's attention heads (TP=2 needs an even number: the bundled model has 9)."""
    return int(checkpoint_config(model).num_attention_heads)


@contextmanager
def plain_vllm(
    model: str | Path, dtype: str, enforce_eager: bool = False, **engine_kwargs: Any
) -> Iterator[Any]:
    """A `vllm.LLM` without vinterp's plugin or site ops, with vinterp's engine settings
    (and `engine_kwargs`); shut down (and memory freed) when the block ends."""
    import vllm

    from vinterp.engine.platform_settings import configure_engine_environment

    world = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get(
        "pipeline_parallel_size", 1
    )
    configure_engine_environment(world)
    llm = vllm.LLM(
        model=str(model),
        dtype=dtype,
        enable_prefix_caching=False,
        seed=0,
        enforce_eager=enforce_eager,
        **engine_kwargs,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        free_memory()


def plain_vllm_time(
    model: str | Path,
    prompts: list[str],
    max_tokens: int,
    repeats: int,
    dtype: str,
    enforce_eager: bool = False,
    **engine_kwargs: Any,
) -> Timing:
    """Wall times of plain vLLM generating `max_tokens` greedy tokens per prompt."""
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with plain_vllm(model, dtype, enforce_eager, **engine_kwargs) as llm:
        return timed(lambda: llm.generate(prompts, params, use_tqdm=False), repeats)


def vinterp_workloads(llm: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, name, generate kwargs) of the fast-path rows (also scripts/gpu_profile.py's)."""
    import vinterp

    vector = torch.randn(int(llm.config.hidden_size), generator=torch.Generator().manual_seed(0))
    site = f"layers.{len(llm.layers) // 3}.output"
    return [
        ("idle", "vinterp engine, no intervention", {}),
        ("steer", f"steering {site}", {"steering": vinterp.Steering({site: vector}, scale=4.0)}),
        ("capture_one", f"capture {site} last_prompt", {"capture": vinterp.Capture(site)}),
        (
            "capture_layers_last",
            "capture layers.*.output last_prompt",
            {"capture": vinterp.Capture("layers.*.output", positions="last_prompt")},
        ),
        (
            "capture_layers_all",
            "capture layers.*.output all positions",
            {"capture": vinterp.Capture("layers.*.output", positions="all")},
        ),
    ]


def run(
    model: str | Path,
    prompts: int = 64,
    max_tokens: int = 32,
    repeats: int = 3,
    dtype: str | None = None,
    workloads: list[str] | None = None,
    invokes: int = 256,
    progress: Callable[[str], None] = lambda _: None,
    capture_in_graph: tuple[bool, ...] = (False,),
    **engine_kwargs: Any,
) -> list[Row]:
    """Rows for the selected `workloads` keys (default all), each engine shut down before
    the next starts; `progress(key)` is called as each selected key is done or skipped.
    The vinterp rows run on one engine per `capture_in_graph` value (both capture routes
    against the same plain-vLLM time); the in-graph engine's row names say so.
    `engine_kwargs` (e.g. max_model_len) go to every engine, plain and vinterp alike."""
    import vinterp

    selected = set(WORKLOADS if workloads is None else workloads)
    dtype = resolve_dtype(model, dtype)
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(prompts)]
    size = f" ({prompts}x{max_tokens})"
    rows: list[Row] = []
    tokens = prompts * max_tokens

    def done(*keys: str) -> None:
        for key in selected.intersection(keys):
            progress(key)

    baseline = Timing((0.0,))
    if selected - {trace_invokes.KEY, *pipeline.KEYS, *TENSOR_PARALLEL}:  # to plain vLLM
        baseline = plain_vllm_time(model, texts, max_tokens, repeats, dtype, **engine_kwargs)
    if EAGER in selected and device_kind() == "cuda":
        eager = plain_vllm_time(
            model, texts, max_tokens, repeats, dtype, enforce_eager=True, **engine_kwargs
        )
        name = "plain vLLM enforce_eager=True" + size
        rows.append(Row(name, baseline, eager, REFERENCE, EAGER, tokens))
    elif EAGER in selected:
        print("plain vLLM enforce_eager=True: skipped (no CUDA GPU: on CPU eager = compiled path)")
    done(EAGER)
    if selected & set(pipeline.KEYS) and device_kind() == "cuda" and torch.cuda.device_count() < 2:
        print("PP=2 rows: skipped (one GPU)")
    elif selected & set(pipeline.KEYS):
        rows += pipeline.run(model, min(prompts, 64), repeats, dtype, selected)
    done(*pipeline.KEYS)
    if (
        selected & set(TENSOR_PARALLEL)
        and device_kind() == "cuda"
        and torch.cuda.device_count() < 2
    ):
        print("TP=2 rows: skipped (one GPU)")
    elif selected & set(TENSOR_PARALLEL) and (heads := attention_heads(model)) % 2:
        print(f"TP=2 rows: skipped (the model's {heads} attention heads do not split over 2)")
    elif selected & set(TENSOR_PARALLEL):
        rows += tensor_parallel_rows(
            model, texts, max_tokens, repeats, dtype, selected, **engine_kwargs
        )
    done(*TENSOR_PARALLEL)
    if not selected & set(WORKLOADS[1:]) - {*pipeline.KEYS, *TENSOR_PARALLEL}:
        return rows
    for in_graph in capture_in_graph:
        llm = vinterp.LLM(model, dtype=dtype, capture_in_graph=in_graph, **engine_kwargs)
        last = in_graph == capture_in_graph[-1]
        try:
            timed = vinterp_rows(
                llm, texts, max_tokens, repeats, baseline, selected, invokes, done if last else None
            )
        finally:
            llm.shutdown()
            free_memory()
        rows += [replace(r, name=r.name + IN_GRAPH) for r in timed] if in_graph else timed
    return rows


def vinterp_rows(
    llm: Any,
    texts: list[str],
    max_tokens: int,
    repeats: int,
    baseline: Timing,
    selected: set[str],
    invokes: int = 256,
    done: Callable[..., None] | None = None,
) -> list[Row]:
    """The selected fast-path rows (timed interleaved on `llm`) and the trace row, each
    against `baseline`, plain vLLM's time for the same prompts."""
    chosen = [
        (key, name, kwargs) for key, name, kwargs in vinterp_workloads(llm) if key in selected
    ]

    def generate(kwargs: dict[str, Any]) -> Callable[[], object]:
        return lambda: llm.generate(
            texts, max_tokens=max_tokens, ignore_eos=True, use_tqdm=False, **kwargs
        )

    timings = timed_interleaved({key: generate(kw) for key, _, kw in chosen}, repeats)
    size, tokens = f" ({len(texts)}x{max_tokens})", len(texts) * max_tokens
    rows = []
    done = done or (lambda *_: None)
    for key, name, _ in chosen:
        rows.append(Row(name + size, baseline, timings[key], target(key), key, tokens))
        done(key)
    if trace_invokes.KEY in selected:
        rows.append(trace_invokes.run(llm, invokes=invokes, repeats=repeats))
        done(trace_invokes.KEY)
    return rows


def tensor_parallel_rows(
    model: str | Path,
    texts: list[str],
    max_tokens: int,
    repeats: int,
    dtype: str,
    selected: set[str],
    **engine_kwargs: Any,
) -> list[Row]:
    """The selected `TENSOR_PARALLEL` rows: vinterp at TP=2 against plain vLLM at TP=2."""
    import vinterp

    tp = {"tensor_parallel_size": 2, **engine_kwargs}
    baseline = plain_vllm_time(model, texts, max_tokens, repeats, dtype, **tp)
    llm = vinterp.LLM(model, dtype=dtype, **tp)
    try:
        chosen = {TENSOR_PARALLEL[key] for key in selected & set(TENSOR_PARALLEL)}
        rows = vinterp_rows(llm, texts, max_tokens, repeats, baseline, chosen)
    finally:
        llm.shutdown()
        free_memory()
    return [
        replace(r, name=f"{r.name} TP=2", key=f"tp_{r.key}", target=target(f"tp_{r.key}"))
        for r in rows
    ]
