"""Steering, capture and traces against plain vLLM (no vinterp in the engine), same machine,
same run, same dtype and engine settings. One engine is alive at a time unless the bench is
asked to keep them together (`time_engines`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from vinterp.bench import extract_pipeline, pipeline, serve_load, step_cost, trace_invokes
from vinterp.bench.bench_sae import (
    CLAMPED,
    TOPK,
    attach_saved,
    host_site,
    saved_sae,
)
from vinterp.bench.harness import (
    REFERENCE,
    Row,
    Timing,
    device_kind,
    free_memory,
    target,
    timed_interleaved,
)
from vinterp.engine.plain_vllm import greedy_params, shutdown_plain_vllm, start_plain_vllm

PROMPT_TEMPLATE = "Write a short story about a robot number {i} who learns to paint."
EAGER = "eager"
IN_GRAPH = " [capture_in_graph]"  # rows of an engine started with capture_in_graph=True
# Rows at TP=2 (vinterp and plain vLLM, both TP=2): their keys and the one-worker rows they repeat
TENSOR_PARALLEL = {
    "tp_idle": "idle",
    "tp_steer": "steer",
    "tp_capture_layers_last": "capture_layers_last",
}
# The generate rows on a vinterp engine (`vinterp_workloads`), by key
VINTERP_KEYS = (
    "idle",
    "steer",
    "ablate",
    "capture_one",
    "capture_layers_last",
    "capture_layers_all",
    "capture_qk",
    "capture_pattern",
    "capture_router",
    "sae_capture_topk",
    "sae_clamp",
    "probe",
    "probe_gated",
)
# rows on an engine of their own, started with `probe_sites` (the probe's site)
PROBE_KEYS = ("probe", "probe_gated")
SAE_CAPTURE = "sae_capture_topk"  # its engine gets the bench's SAE (bench_sae)
# every request clamps features of the bench's SAE (its engine's steering tables hold them)
SAE_CLAMP = "sae_clamp"
PATTERN_HEADS = [0, 1, 2, 3]  # the capture_pattern row's heads
# Rows of one-worker engines, and all row keys `vinterp bench --workloads` selects from
ONE_WORKER = (EAGER, *VINTERP_KEYS, trace_invokes.KEY)
# Extraction rows (timed by bench/extraction.py, on engines of their own): layers at every
# prompt position, every layer at the last prompt token, and HF transformers' hooks doing the same
EXTRACT_LAYERS_ALL = "extract_layers_all"
EXTRACT_LAYERS_LAST = "extract_layers_last"
EXTRACT_HF = "extract_hf_hooks"
EXTRACT_SAE = "extract_sae_topk"  # an SAE's top-k features at every prompt position
# the middle layer at every prompt position, on an engine that stops there (`num_layers`)
EXTRACT_MID_DEPTH = "extract_mid_depth"
EXTRACTION = (EXTRACT_LAYERS_ALL, EXTRACT_LAYERS_LAST, EXTRACT_SAE, EXTRACT_MID_DEPTH, EXTRACT_HF)
WORKLOADS = (*ONE_WORKER, *pipeline.KEYS, *TENSOR_PARALLEL, *EXTRACTION)
# Rows run only when `--workloads` names them (the serve load test takes 15 minutes or more),
# and every row `--workloads` selects from
ON_REQUEST = (serve_load.KEY, extract_pipeline.KEY, step_cost.KEY)  # engine-free: the last two
SELECTABLE = (*WORKLOADS, *ON_REQUEST)
# Share of a GPU's memory for the engines the bench keeps alive at once (split equally)
SHARED_GPU_MEMORY = 0.8


def resolve_dtype(model: str | Path, dtype: str | None = None) -> str:
    """`dtype`, or else the checkpoint's own: what `vinterp.LLM` picks when given none."""
    if dtype:
        return dtype
    from vinterp.models.dtype import checkpoint_dtype

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
    llm = start_plain_vllm(model, dtype, enforce_eager, **engine_kwargs)
    try:
        yield llm
    finally:
        shutdown_plain_vllm(llm)
        del llm
        free_memory()


@contextmanager
def vinterp_engine(
    model: str | Path, dtype: str, saes: dict[str, Path] | None = None, **engine_kwargs: Any
) -> Iterator[Any]:
    """A `vinterp.LLM` with the SAE directories `saes` attached at their sites, shut down
    (and memory freed) when the block ends."""
    import vinterp

    llm = vinterp.LLM(model, dtype=dtype, **engine_kwargs)
    try:
        attach_saved(llm, saes or {})
        yield llm
    finally:
        llm.shutdown()
        free_memory()


@dataclass(frozen=True)
class Workload:
    """One timed call on an engine; `name` (unique in a run) names its row and its times."""

    key: str
    name: str
    call: Callable[[], object]
    target: float = REFERENCE


@dataclass(frozen=True)
class Engine:
    """An engine of the bench: how it starts, its workloads, and rows it times on its own
    once the interleaved rounds are done (the trace row, against its own baseline)."""

    start: Callable[[], AbstractContextManager[Any]]
    workloads: Callable[[Any], list[Workload]]
    after: Callable[[Any], list[Row]] = lambda _: []


def time_engines(
    engines: list[Engine], repeats: int, together: bool
) -> tuple[dict[str, Workload], dict[str, Timing], list[Row]]:
    """Every engine's workloads (by name), their times, and the engines' `after` rows.

    `together`: all engines alive at once and every workload of every engine in each round, so
    that slow drift of the machine reaches plain vLLM and vinterp alike. Otherwise one engine
    at a time, its workloads interleaved with each other only: the default, since on the
    lent GPUs the noise changed within seconds (pairing did not narrow it) and engines alive
    together ran ~30% slower (docs/notes/gpu-log.md), and on the CPU machine two engines
    share two cores (DESIGN.md lesson 8)."""
    workloads: dict[str, Workload] = {}
    timings: dict[str, Timing] = {}
    rows: list[Row] = []

    def timed_on(llms: list[Any], members: list[Engine]) -> None:
        chosen = [w for engine, llm in zip(members, llms) for w in engine.workloads(llm)]
        workloads.update((w.name, w) for w in chosen)
        timings.update(timed_interleaved({w.name: w.call for w in chosen}, repeats))
        for engine, llm in zip(members, llms):
            rows.extend(engine.after(llm))

    if together:
        with ExitStack() as stack:
            timed_on([stack.enter_context(engine.start()) for engine in engines], engines)
    else:
        for engine in engines:
            with engine.start() as llm:
                timed_on([llm], [engine])
    return workloads, timings, rows


def compare(
    baseline: str, workloads: dict[str, Workload], timings: dict[str, Timing], tokens: int
) -> list[Row]:
    """A row for every workload but `baseline` (a workload's name), timed against it."""
    return [
        Row(w.name, timings[baseline], timings[w.name], w.target, w.key, tokens)
        for w in workloads.values()
        if w.name != baseline
    ]


def plain_engine(
    model: str | Path,
    texts: list[str],
    max_tokens: int,
    dtype: str,
    name: str,
    enforce_eager: bool = False,
    **engine_kwargs: Any,
) -> Engine:
    """Plain vLLM generating `max_tokens` greedy tokens per prompt, as workload `name`."""
    params = greedy_params(max_tokens, ignore_eos=True)
    key = EAGER if enforce_eager else "plain"
    return Engine(
        lambda: plain_vllm(model, dtype, enforce_eager, **engine_kwargs),
        lambda llm: [Workload(key, name, lambda: llm.generate(texts, params, use_tqdm=False))],
    )


def vinterp_workloads(llm: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, name, generate kwargs) of the steering and capture rows; the per-head rows on
    models with per-head sites, the router row on mixture-of-experts models, the SAE row on
    an engine with the bench's SAE attached."""
    import vinterp
    from vinterp.sites.modules import heads_of, router_of

    vector = torch.randn(int(llm.config.hidden_size), generator=torch.Generator().manual_seed(0))
    layer = len(llm.layers) // 3
    site = f"layers.{layer}.output"
    attention = f"layers.{layer}.attn"
    per_head = [
        (
            "capture_qk",
            f"capture {attention}.q and .k all positions",
            {"capture": vinterp.Capture([f"{attention}.q", f"{attention}.k"], positions="all")},
        ),
        (
            "capture_pattern",
            f"capture {attention}.pattern of heads 0-3 last_prompt",
            {"capture": vinterp.Capture(f"{attention}.pattern", heads=PATTERN_HEADS)},
        ),
    ]
    router = [
        (
            "capture_router",
            "capture layers.*.mlp.router.output all positions",
            {"capture": vinterp.Capture("layers.*.mlp.router.output", positions="all")},
        )
    ]
    return [
        ("idle", "vinterp engine, no intervention", {}),
        ("steer", f"steering {site}", {"steering": vinterp.Steering({site: vector}, scale=4.0)}),
        (
            "ablate",
            f"ablating a direction at {site}",
            {"steering": vinterp.Steering({site: vector}, mode="ablate")},
        ),
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
        *(per_head if heads_of(llm.config) is not None else []),
        *(router if router_of(llm.config) is not None else []),
        *sae_workloads(llm),
        *probe_workloads(llm, vector),
    ]


def probe_sites(config: Any) -> tuple[str, str]:
    """Where the probe rows probe (the steering rows' site) and steer (one layer later): the
    probe engine's `probe_sites`."""
    layer = int(config.num_hidden_layers) // 3
    return f"layers.{layer}.output", f"layers.{layer + 1}.output"


def probe_workloads(llm: Any, vector: torch.Tensor) -> list[tuple[str, str, dict[str, Any]]]:
    """A probe of one output at the steering rows' site, scored at every token of every
    request; and the steering row's vector added one layer later only where that probe's
    score is above 0 (about half the tokens)."""
    import vinterp

    site, later = probe_sites(llm.config)
    probe = vinterp.Probe(site, vector / vector.norm(), name="bench")
    gated = vinterp.Steering(
        {later: vector}, scale=4.0, when=vinterp.When(probe="bench", above=0.0)
    )
    return [
        ("probe", f"probe at {site}, scores at every token", {"probes": [probe]}),
        (
            "probe_gated",
            f"steering {later} where the probe at {site} is above 0",
            {"probes": [probe], "steering": gated},
        ),
    ]


def sae_workloads(llm: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """The SAE rows where the bench's SAE is attached: its top-TOPK features captured at
    every position (the worker encodes each captured row), and its features clamped in every
    request (compiled steering tables)."""
    import vinterp

    host = host_site(llm.config)
    sae = llm.saes.get(host)
    if sae is None:
        return []
    features = f"{host}.sae.features"
    capture = vinterp.Capture(features, positions="all", topk=TOPK)
    clamp = vinterp.Steering({features: CLAMPED}, mode="clamp")
    return [
        (
            SAE_CAPTURE,
            f"capture top-{TOPK} of {features} (SAE of {sae.d_sae}), all positions",
            {"capture": capture},
        ),
        (
            SAE_CLAMP,
            f"clamp {len(CLAMPED)} features of {features} (SAE of {sae.d_sae})",
            {"steering": clamp},
        ),
    ]


def vinterp_generations(
    llm: Any, texts: list[str], max_tokens: int, selected: set[str], suffix: str = ""
) -> list[Workload]:
    """The selected workloads on `llm`, each named with the size and `suffix`."""

    def generate(kwargs: dict[str, Any]) -> Callable[[], object]:
        return lambda: llm.generate(
            texts, max_tokens=max_tokens, ignore_eos=True, use_tqdm=False, **kwargs
        )

    size = f" ({len(texts)}x{max_tokens})"
    return [
        Workload(key, name + size + suffix, generate(kwargs), target(key))
        for key, name, kwargs in vinterp_workloads(llm)
        if key in selected
    ]


def vinterp_bench_engine(
    start: Callable[[], AbstractContextManager[Any]],
    texts: list[str],
    max_tokens: int,
    selected: set[str],
    invokes: int,
    repeats: int,
    suffix: str = "",
) -> Engine:
    """A vinterp engine of the bench: its selected generate workloads, then its trace row;
    row names end with `suffix`."""
    return Engine(
        start,
        lambda llm: vinterp_generations(llm, texts, max_tokens, selected, suffix),
        lambda llm: [
            replace(r, name=r.name + suffix) for r in trace_rows(llm, selected, invokes, repeats)
        ],
    )


def trace_rows(llm: Any, selected: set[str], invokes: int, repeats: int) -> list[Row]:
    """The trace row, when selected (timed against `llm.generate` of its own prompts)."""
    if trace_invokes.KEY not in selected:
        return []
    return [trace_invokes.run(llm, invokes=invokes, repeats=repeats)]


def gpu_share(engines: int, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`engine_kwargs` with each of `engines` engines alive at once given an equal share of
    the GPU's memory (vLLM's default, 0.9 of it, would leave none for the second)."""
    return {"gpu_memory_utilization": round(SHARED_GPU_MEMORY / engines, 3), **engine_kwargs}


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
    together: bool = False,
    **engine_kwargs: Any,
) -> list[Row]:
    """Rows for the selected `workloads` keys (default all); `progress(key)` is called as each
    selected key is done or skipped. The vinterp rows run on one engine per
    `capture_in_graph` value (both capture routes against the same plain-vLLM time); the
    in-graph engine's row names say so. `together` keeps the one-worker engines alive at once
    and interleaves their rounds (`time_engines`); the TP and PP rows start their engines one
    at a time. `engine_kwargs` (e.g. max_model_len) go to every
    engine, plain and vinterp alike."""
    selected = set(WORKLOADS if workloads is None else workloads)
    dtype = resolve_dtype(model, dtype)
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(prompts)]
    rows: list[Row] = []

    def done(*keys: str) -> None:
        for key in selected.intersection(keys):
            progress(key)

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
    rows += one_worker_rows(
        model,
        texts,
        max_tokens,
        repeats,
        dtype,
        selected,
        invokes,
        capture_in_graph,
        together,
        **engine_kwargs,
    )
    done(*ONE_WORKER)
    return rows


def one_worker_rows(
    model: str | Path,
    texts: list[str],
    max_tokens: int,
    repeats: int,
    dtype: str,
    selected: set[str],
    invokes: int,
    capture_in_graph: tuple[bool, ...],
    together: bool,
    **engine_kwargs: Any,
) -> list[Row]:
    """Plain vLLM (and, on a GPU, plain vLLM with enforce_eager), then the selected vinterp
    rows on one engine per `capture_in_graph` value, the probe rows on an engine with
    `probe_sites`, all against plain vLLM's times."""
    vinterp_keys = selected & {*VINTERP_KEYS, trace_invokes.KEY}
    eager = EAGER in selected and device_kind() == "cuda"
    if EAGER in selected and not eager:
        print("plain vLLM enforce_eager=True: skipped (no CUDA GPU: on CPU eager = compiled path)")
    if not (eager or vinterp_keys):
        return []
    probe_keys = selected & set(PROBE_KEYS)  # on an engine of their own, with probe_sites
    routes = capture_in_graph if vinterp_keys - probe_keys else ()
    timed_plain = eager or bool(selected & set(VINTERP_KEYS))  # the trace row times its own
    if together and device_kind() == "cuda":
        engines_alive = timed_plain + eager + len(routes) + bool(probe_keys)
        engine_kwargs = gpu_share(engines_alive, engine_kwargs)
    size = f" ({len(texts)}x{max_tokens})"
    plain = "plain vLLM" + size
    engines: list[Engine] = []
    if timed_plain:
        engines.append(plain_engine(model, texts, max_tokens, dtype, plain, **engine_kwargs))
    if eager:
        name = "plain vLLM enforce_eager=True" + size
        engines.append(plain_engine(model, texts, max_tokens, dtype, name, True, **engine_kwargs))
    config = checkpoint_config(model)
    with_sae = bool(selected & {SAE_CAPTURE, SAE_CLAMP})
    if (
        with_sae
    ):  # the SAE's host named at start: compiled feature steering and a capture buffer there
        engine_kwargs = {**engine_kwargs, "sae_steering_hosts": host_site(config)}
    with saved_sae(int(config.hidden_size)) if with_sae else nullcontext() as sae:
        saes = {host_site(config): sae} if sae is not None else None
        plain_keys = selected - probe_keys
        for in_graph in routes:
            start = partial(
                vinterp_engine, model, dtype, saes, capture_in_graph=in_graph, **engine_kwargs
            )
            suffix = IN_GRAPH if in_graph else ""
            engines.append(
                vinterp_bench_engine(start, texts, max_tokens, plain_keys, invokes, repeats, suffix)
            )
        if probe_keys:  # probe_sites adds ops at two sites: not for the other rows
            start = partial(
                vinterp_engine, model, dtype, probe_sites=probe_sites(config), **engine_kwargs
            )
            engines.append(vinterp_bench_engine(start, texts, max_tokens, probe_keys, 0, repeats))
        workloads, timings, extra = time_engines(engines, repeats, together)
    return compare(plain, workloads, timings, len(texts) * max_tokens) + extra


def tensor_parallel_rows(
    model: str | Path,
    texts: list[str],
    max_tokens: int,
    repeats: int,
    dtype: str,
    selected: set[str],
    **engine_kwargs: Any,
) -> list[Row]:
    """The selected `TENSOR_PARALLEL` rows: vinterp at TP=2 against plain vLLM at TP=2, one
    engine at a time."""
    tp = {**engine_kwargs, "tensor_parallel_size": 2}
    chosen = {TENSOR_PARALLEL[key] for key in selected & set(TENSOR_PARALLEL)}
    plain = f"plain vLLM ({len(texts)}x{max_tokens}) TP=2"
    engines = [
        plain_engine(model, texts, max_tokens, dtype, plain, **tp),
        Engine(
            lambda: vinterp_engine(model, dtype, **tp),
            lambda llm: [
                replace(w, key=f"tp_{w.key}", name=w.name + " TP=2", target=target(f"tp_{w.key}"))
                for w in vinterp_generations(llm, texts, max_tokens, chosen)
            ],
        ),
    ]
    workloads, timings, _ = time_engines(engines, repeats, together=False)
    return compare(plain, workloads, timings, len(texts) * max_tokens)
