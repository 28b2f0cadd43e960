"""Whether extraction's disk pipeline keeps up with a GPU, without a GPU: a synthetic producer
hands the shard writer shards of the real size at the row rate an H200 extracts the 8B shape
(layers 4, 12, 20, 28 at every position: 34.4 GB in 23.7 s, `vinterp bench` on 2026-11-28),
each shard's rows handed over as the workers hand them (a copy into fresh host memory when
its take is waited for). The pipeline keeps up when its time is that of the slower of its two
ends: the producer alone and the store alone writing the same shards to the same disk."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from vinterp.bench.harness import Row, target, timed_interleaved
from vinterp.bench.peers.timing import Timing
from vinterp.extraction.request import BUFFER_GB, QUEUED_SHARDS, shard_bytes, store_columns
from vinterp.store import (
    ActivationStore,
    Columns,
    PendingShard,
    ShardSizes,
    ShardWriter,
    column_values,
    row_size,
)

KEY = "extract_pipeline"
GPU_ROW_RATE = 34.4e9 / 23.7  # bytes of site values per second: the H200's 8B-shape rate
SITES = [f"layers.{i}.output" for i in (4, 12, 20, 28)]
HIDDEN, DTYPE = 4096, "bfloat16"
GB = 1e9


def _source_rows(per_shard: int) -> torch.Tensor:
    """One shard's rows of every site side by side, as the workers' block holds them."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(per_shard, len(SITES) * HIDDEN, generator=generator).to(torch.bfloat16)


def _columns_of(rows: torch.Tensor, start: int) -> dict[str, np.ndarray]:
    """A shard's columns from its handed-over rows (what `shard_columns` does per prompt)."""
    count = len(rows)
    values = {
        "prompt": np.arange(start, start + count, dtype=np.int64),
        "position": np.zeros(count, np.int32),
        "token": np.zeros(count, np.int32),
    }
    for k, site in enumerate(SITES):
        values[site] = column_values(rows[:, k * HIDDEN : (k + 1) * HIDDEN], DTYPE)
    return values


def _shards(total_bytes: float, columns: Columns) -> list[int]:
    """Rows per shard for `total_bytes` of site values at the extraction's shard size."""
    per_shard = max(shard_bytes(columns, BUFFER_GB) // row_size(columns), 1)
    payload = len(SITES) * HIDDEN * 2
    rows = int(total_bytes // payload)
    return [min(per_shard, rows - start) for start in range(0, rows, per_shard)]


def _write(
    root: Path, columns: Columns, shards: list[int], source: torch.Tensor, rate: float | None
) -> None:
    """The shards through one `ShardWriter`; with `rate`, each is put once the producer has
    made its rows (at `rate` bytes of site values a second) and its take copies them."""
    sizes = ShardSizes(shard_bytes(columns, BUFFER_GB))
    store = ActivationStore.open(root, {"bench": KEY}, columns, sizes)
    payload = len(SITES) * HIDDEN * 2
    began, made, start = time.perf_counter(), 0, 0
    with ShardWriter(store, queued=QUEUED_SHARDS) as writer:
        for count in shards:
            rows = source[:count]
            take: Callable[[], torch.Tensor] = partial(lambda r: r, rows)
            if rate is not None:
                made += count * payload
                time.sleep(max(began + made / rate - time.perf_counter(), 0.0))
                take = rows.clone  # the handoff: a copy into fresh memory
            build = partial(_columns_of, start=start)
            writer.put(partial(PendingShard, start, start + count, take, build))
            start += count


def _producer(shards: list[int], rate: float) -> None:
    """The producer alone: the same schedule, nothing written."""
    payload = len(SITES) * HIDDEN * 2
    began, made = time.perf_counter(), 0
    for count in shards:
        made += count * payload
        time.sleep(max(began + made / rate - time.perf_counter(), 0.0))


def run(
    root: str | Path | None = None,
    total_gb: float = 4.0,
    rate: float = GPU_ROW_RATE,
    repeats: int = 3,
) -> list[Row]:
    """The pipeline's time against max(producer alone, store alone), per repeat, writing
    `total_gb` of site values under `root` (a temporary folder by default)."""
    columns = store_columns(SITES, DTYPE, HIDDEN)
    shards = _shards(total_gb * GB, columns)
    source = _source_rows(max(shards))
    scratch = Path(tempfile.mkdtemp(prefix="vinterp-bench-pipeline-", dir=root))
    runs: list[Path] = []

    def into_fresh_folder(rate_: float | None) -> None:
        runs.append(Path(tempfile.mkdtemp(dir=scratch)) / "acts")
        _write(runs[-1], columns, shards, source, rate_)

    def remove() -> None:
        shutil.rmtree(runs.pop().parent, ignore_errors=True)

    try:
        times = timed_interleaved(
            {
                "producer": partial(_producer, shards, rate),
                "store": partial(into_fresh_folder, None),
                "pipeline": partial(into_fresh_folder, rate),
            },
            repeats,
            {"store": remove, "pipeline": remove},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    slower = Timing(tuple(map(max, times["producer"].times, times["store"].times)))
    written = sum(shards) * len(SITES) * HIDDEN * 2
    return [
        Row(
            f"extraction pipeline, synthetic producer at {rate / GB:.2f} GB/s, {written / GB:.1f} "
            f"GB in {len(shards)} shards (vs max(producer alone, store alone))",
            slower,
            times["pipeline"],
            target(KEY),
            KEY,
            extras={
                "producer_s": times["producer"].median,
                "store_alone_s": times["store"].median,
                "gb_per_s": written / GB / times["pipeline"].median,
            },
        )
    ]
