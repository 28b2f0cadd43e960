"""What an extraction shows and logs: a bar of prompts, tokens/s and GB written while it runs,
and a closing line once the dataset is complete."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

from vinterp.extraction.plan import TOO_LONG, Shard
from vinterp.extraction.request import ExtractionJob
from vinterp.extraction.stream import ExtractionStats
from vinterp.store import ActivationStore

log = logging.getLogger(__name__)


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
