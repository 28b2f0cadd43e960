"""`llm.extract` on an engine in this process: open (or resume) the dataset, run its shards,
mark it complete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vinterp.extraction.progress import finish, progress_bar
from vinterp.extraction.request import ExtractionRequest, open_job
from vinterp.extraction.spec import EngineFacts
from vinterp.extraction.stream import Extraction, ExtractionStats, run_shards


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
