"""What an extraction is asked for (`llm.extract` and `vinterp.extract` take the same keywords,
API.md section 5, "Activation datasets"), its checks, and the dataset it opens: the columns,
the shard size and the prompt tokens kept queued in the engine, all from `buffer_gb`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vinterp.engine.engine_limits import EngineLimits
from vinterp.extraction.packing import Packed
from vinterp.extraction.plan import PositionSpec, Shard, check_positions, plan_shards
from vinterp.extraction.prompts import PromptSource, prompt_source, tokenize
from vinterp.extraction.sae import check_sae_sites, site_columns
from vinterp.extraction.spec import EngineFacts, dataset_about, extraction_spec
from vinterp.sites.modules import site_order
from vinterp.sites.names import (
    HEAD_SITES,
    PATTERN,
    ROUTER_SITES,
    UnknownSiteError,
    parse_site,
    sae_site,
)
from vinterp.store import (
    COLUMN_DTYPE,
    ROW_COLUMNS,
    STORED_DTYPES,
    WRITER_THREADS,
    ActivationStore,
    Columns,
    ShardSizes,
    row_size,
)
from vinterp.wire.specs import Capture

BUFFER_GB = 2.0  # memory for captured rows in flight, host and device, unless told
# The share of `buffer_gb` for rows still on the workers' devices: those of the prompts queued
# in the engine and of finished shards whose take has not been sent. The rest is host memory
# for the shards in the writer's hands.
DEVICE_SHARE = 0.25
# Shards queued for a writer thread, their rows already asked for: the take's round trip to
# the workers overlaps the writes in progress, so a thread that frees finds rows on their way.
QUEUED_SHARDS = 2
# Full shards of host memory in hand at once: the bytes the writer holds (`WRITER_THREADS` being
# written, `QUEUED_SHARDS` queued, in full shards' bytes), as captured rows and as columns where
# these are copies.
SHARDS_IN_FLIGHT = 2 * (WRITER_THREADS + QUEUED_SHARDS)
# A shard holds the prompts of at most this many full engine steps, so that writing it
# overlaps the engine's next steps from early on and the last write after the engine is done
# is short.
STEPS_PER_SHARD = 4
# The prompts of the last steps' tokens go into shards this many times smaller: their rows
# leave the devices only as those steps end, so the run ends when their writes do. The
# second-last step counts too: its shards are still being written while the last one runs.
TAIL_STEPS = 2
TAIL_SPLIT = 4
# Engine steps' worth of prompt tokens kept queued in the engine while extracting: enough that
# it never waits for the next prompts, few enough that captures awaiting their take stay small.
QUEUED_STEPS = 4
# The fewest, whatever the memory: vLLM schedules the next step while one runs, and the feed
# hears that a step's prompts are done only after it ends, so with one step queued each step
# waits for that round trip and runs part-full (scripts/profile_bulk.py on an H200: 46 steps
# instead of 17 for the same prompts, the device idle between them).
MIN_QUEUED_STEPS = 2


@dataclass
class ExtractionJob:
    """An opened (or resumed) dataset and what its shards are run with."""

    store: ActivationStore
    source: PromptSource
    capture: Capture
    queued_tokens: int

    def shards(self, tokenizer: Any) -> Iterator[tuple[int, Shard]]:
        """(number, shard) from the first prompt not yet stored to the last: a pure function
        of the token ids and the manifest's shard sizes, so a resumed run cuts the same."""
        manifest = self.store.manifest
        spec = manifest.spec
        planned = plan_shards(
            tokenize(tokenizer, self.source, manifest.next_prompt),
            spec["positions"],
            spec["skip_first"],
            spec["max_prompt_len"],
            row_size(self.store.columns),
            manifest.sizes,
        )
        return enumerate(planned, len(manifest.shards))


@dataclass(frozen=True, kw_only=True)
class ExtractionRequest:
    """What an extraction is asked for (API.md section 5, "Activation datasets"): the
    keywords `llm.extract` and `vinterp.extract` both take, with the same defaults."""

    prompts: Any
    sites: str | list[str]
    out: str | Path
    positions: PositionSpec = "all_prompt"
    dtype: str | None = None
    skip_first: int = 0
    column: str = "text"
    buffer_gb: float = BUFFER_GB
    topk: int | None = None


def open_job(facts: EngineFacts, request: ExtractionRequest) -> ExtractionJob:
    """Check everything and open (or resume) the dataset in `request.out`."""
    skip_first, buffer_gb = request.skip_first, request.buffer_gb
    positions = check_positions(request.positions, skip_first)
    sites = expand_sites(facts.config, request.sites)
    topk = request.topk
    check_sae_sites(sites, {host: sae.d_sae for host, sae in facts.saes.items()}, topk)
    limits = facts.limits
    dtype = request.dtype or limits.dtype
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype: expected one of {STORED_DTYPES}, got {dtype!r}")
    if not buffer_gb > 0:
        raise ValueError(f"buffer_gb: expected a size > 0, got {buffer_gb!r}")
    check_window(request.prompts, limits)
    source = prompt_source(request.prompts, request.column, packing_tokenizer(facts, request))
    spec = extraction_spec(facts, source, sites, positions, skip_first, dtype, topk)
    columns = store_columns(sites, dtype, spec["hidden_size"], topk)
    about = dataset_about(source, columns)
    store = ActivationStore.open(
        request.out, spec, columns, shard_sizes(columns, buffer_gb, limits.step_tokens), about
    )
    queued = queued_tokens(limits, positions, columns, buffer_gb)
    return ExtractionJob(store, source, Capture(sites, positions=positions, topk=topk), queued)


def packing_tokenizer(facts: EngineFacts, request: ExtractionRequest) -> Any:
    """The tokenizer a `Packed` corpus is cut with (the checkpoint's, as the engine's); None
    for other prompts."""
    if not isinstance(request.prompts, Packed):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(facts.model_path))


def check_window(prompts: Any, limits: EngineLimits) -> None:
    """A packed corpus's windows fit the engine: ValueError otherwise (every window would be
    skipped as too long), before the corpus is read."""
    window = prompts.context_size if isinstance(prompts, Packed) else None
    if isinstance(prompts, PromptSource):
        window = prompts.window
    longest = limits.max_prompt_len
    if window is not None and longest is not None and window > longest:
        raise ValueError(
            f"context_size={window}: this engine takes prompts of at most {longest} tokens "
            "(max_model_len - 1); give a smaller context_size or start the engine with a "
            "larger max_model_len"
        )


def store_columns(
    sites: list[str], dtype: str, hidden_size: int, topk: int | None = None
) -> Columns:
    """The dataset's columns: each row's prompt index, position and token id, then one
    fixed-size column per site in the stored `dtype` (an SAE's features with `topk`: an
    indices and a values column, `topk` wide)."""
    prompt, position, token = ROW_COLUMNS
    columns: Columns = {prompt: ("int64", None), position: ("int32", None), token: ("int32", None)}
    for site in sites:
        columns |= site_columns(site, topk, COLUMN_DTYPE[dtype], hidden_size)
    return columns


def shard_bytes(columns: Columns, buffer_gb: float) -> int:
    """A shard's size: the host share of `buffer_gb` over the shards in flight (a row at
    least)."""
    host = int(buffer_gb * (1 - DEVICE_SHARE) * 2**30)
    return max(host // SHARDS_IN_FLIGHT, row_size(columns))


def shard_sizes(columns: Columns, buffer_gb: float, step_tokens: int | None) -> ShardSizes:
    """`shard_bytes`, at most `STEPS_PER_SHARD` engine steps' tokens, and the last
    `TAIL_STEPS` steps' prompts in shards `TAIL_SPLIT` times smaller (a row at least); by
    bytes alone where the engine's step size is unknown."""
    size = shard_bytes(columns, buffer_gb)
    if not step_tokens:
        return ShardSizes(size)
    tail_bytes = max(size // TAIL_SPLIT, row_size(columns))
    return ShardSizes(size, STEPS_PER_SHARD * step_tokens, TAIL_STEPS * step_tokens, tail_bytes)


def queued_tokens(
    limits: EngineLimits, positions: PositionSpec, columns: Columns, buffer_gb: float
) -> int:
    """Prompt tokens kept queued in the engine: `QUEUED_STEPS` steps' worth, fewer where the
    rows those steps store would pass the device share of `buffer_gb`, and never fewer than
    `MIN_QUEUED_STEPS` (the engine must never wait for the feed). A step stores a row per
    token at token positions; at last_prompt (or a list of positions) a row per sequence (or
    per listed position), so such steps are bounded by the sequences one step runs."""
    step_tokens = limits.step_tokens or 1
    step_rows = step_tokens
    if positions == "last_prompt" or isinstance(positions, list):
        per_prompt = 1 if positions == "last_prompt" else len(positions)
        step_rows = min(step_tokens, (limits.step_sequences or step_tokens) * per_prompt)
    device_rows = int(buffer_gb * DEVICE_SHARE * 2**30) // row_size(columns)
    steps = max(min(QUEUED_STEPS, device_rows // max(step_rows, 1)), MIN_QUEUED_STEPS)
    return steps * step_tokens


def engine_settings(
    sites: str | list[str], positions: PositionSpec = "all_prompt"
) -> dict[str, Any]:
    """`vinterp.LLM` keywords for an engine that extracts `sites` at `positions`: capture
    buffers at those sites, so capturing steps stay compiled (`vinterp extract` starts its
    engine this way); one step's tokens each, or one row per sequence for last_prompt. An SAE
    site's buffer is its host's: the worker encodes the gathered rows after the step. Such an
    engine never steers: no steering formula in its compiled model."""
    names = [sites] if isinstance(sites, str) else list(sites)
    hosts = [site if (sae := sae_site(site)) is None else sae.host for site in names]
    buffered = list(dict.fromkeys(hosts))
    rows = None if positions == "last_prompt" else "step"
    return {"capture_in_graph": buffered, "capture_in_graph_rows": rows, "steering_in_graph": False}


def layers_needed(config: Any, sites: str | list[str]) -> int | None:
    """The layers an extraction of `sites` runs, up to the deepest site's layer (the embedding
    alone needs one); None when a site lies past the last layer (`final_norm.output`)."""
    deepest = 0
    for site in expand_sites(config, sites):
        parsed = parse_site(site)
        if parsed.layer is None and parsed.module != "embed":
            return None
        deepest = max(deepest, (parsed.layer or 0) + 1)
    return deepest


def expand_sites(config: Any, sites: str | list[str]) -> list[str]:
    """Site names and patterns, expanded for a model of `config`, in forward order without
    repeats."""
    names = [sites] if isinstance(sites, str) else list(sites)
    Capture(names)  # ValueError for a name no capture takes
    order = site_order(config)
    try:
        expanded = {site: None for pattern in names for site in order.expand(pattern)}
    except UnknownSiteError as exc:
        raise ValueError(f"sites: {exc}") from None
    for site in expanded:  # rows of the hidden size, or an SAE's (extraction/sae.py checks those)
        part = parse_site(site).part
        if part in ROUTER_SITES or part in (*HEAD_SITES, PATTERN):
            kind = "a router" if part in ROUTER_SITES else "an attention head"
            raise ValueError(
                f"sites: {site} is {kind} site, which extract does not store; capture it "
                "with llm.generate(..., capture=vinterp.Capture(...))"
            )
    return sorted(expanded, key=order.__getitem__)
