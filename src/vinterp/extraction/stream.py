"""Shards through one engine in this process: every prompt goes through one stream of requests
to the engine (prefill only), and each shard's captures are read, turned into columns and
written on the disk writers while the engine goes on (`run_shards`); also what a call did
(`ExtractionStats`) and returns (`Extraction`)."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from vinterp.api.requests import captured_tensors
from vinterp.engine.backend import Captured, StreamingBackend, StreamRequest
from vinterp.engine.outputs import Output
from vinterp.engine.sampling import sampling_kwargs
from vinterp.extraction.plan import TOKENS, PlannedPrompt, Shard
from vinterp.extraction.request import QUEUED_SHARDS
from vinterp.extraction.sae import index_values
from vinterp.store import (
    INDEX_DTYPE,
    ActivationStore,
    PendingShard,
    ShardEntry,
    ShardWriter,
    column_values,
    row_size,
)
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Capture

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

    began, tokens, row_bytes = time.perf_counter(), 0, row_size(store.columns)
    with ShardWriter(store, queued=QUEUED_SHARDS, commit=commit) as writer:

        def write_finished() -> None:
            nonlocal tokens
            while started and started[0][1].waiting == 0:
                number, entry = started[0]
                size = entry.shard.rows * row_bytes
                writer.put(partial(pending_shard, backend, entry, capture, store), number, size)
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
