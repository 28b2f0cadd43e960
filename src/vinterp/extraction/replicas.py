"""Data-parallel extraction: N engine replicas, each of T GPUs, as Ray actors, writing one
dataset. Ray is what vLLM itself runs on across machines, so on a Ray cluster the same call
spreads over its nodes (each replica writes its shards where the dataset lives: a folder every
node sees).

The driver opens the dataset and plans the shards exactly as one engine would; each replica
pulls numbered shards from its own work queue, runs them through the same stream and disk
writers as `llm.extract` (`run_shards`) and reports every written shard, then that it ended;
the driver lists them in the manifest in order (the `InOrderLister` the disk writers list
with). So the dataset is the one a single engine writes, shard for shard, and a run killed at
any point (the driver, or a replica) resumes to exactly it. `vinterp.extract`
(extraction/launch.py) starts the replicas through `run_replicas`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vinterp.engine.cpu_settings import core_groups
from vinterp.errors import VinterpError
from vinterp.extraction.local import load_dataset
from vinterp.extraction.plan import TOKENS, PositionSpec, Shard
from vinterp.extraction.progress import finish, progress_bar
from vinterp.extraction.request import ExtractionJob, ExtractionRequest, engine_settings, open_job
from vinterp.extraction.spec import EngineFacts
from vinterp.extraction.stream import Extraction, ExtractionStats, run_shards
from vinterp.sae import SAE
from vinterp.store import ActivationStore, Columns, InOrderLister, Manifest, ShardEntry
from vinterp.wire.specs import Capture

# Prompt tokens sent to a replica and not yet reported written, in units of the tokens its
# stream keeps queued in its engine: its stream asks for the next shard (and waits for it)
# whenever fewer are queued, so the driver keeps more than that in its work queue. Few
# enough that a dead replica leaves little to redo.
AHEAD = 2
MIN_SHARDS_AHEAD = 2
ENDED = None  # a replica's last report: it ran its last shard, or failed


class ReplicaError(VinterpError, RuntimeError):
    """A data-parallel replica died or failed; the shards listed before stay valid."""


def check_replicas(data_parallel: int, tensor_parallel: int, gpus: float, on_gpus: bool) -> None:
    """ValueError for sizes below 1, or for more GPUs than Ray sees (where the engines run on
    GPUs)."""
    for name, size in (
        ("data_parallel_size", data_parallel),
        ("tensor_parallel_size", tensor_parallel),
    ):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {size!r}")
    needed = data_parallel * tensor_parallel
    if on_gpus and needed > gpus:
        raise ValueError(
            f"data_parallel_size={data_parallel} x tensor_parallel_size={tensor_parallel} "
            f"needs {needed} GPUs; Ray sees {gpus:g}"
        )


class ExtractReplica:
    """One engine replica (the class of a Ray actor): a `vinterp.LLM` with capture buffers at
    the extracted sites and the SAEs (directories, loaded here) attached."""

    def __init__(
        self,
        model: str,
        sites: list[str],
        positions: PositionSpec,
        cores: list[int] | None,
        engine_kwargs: dict[str, Any],
        saes: dict[str, SAE | str],
    ) -> None:
        from vinterp.api.llm import LLM

        if cores is not None:
            os.sched_setaffinity(0, cores)
        self.llm = LLM(model, **engine_settings(sites, positions), **engine_kwargs)
        for site, sae in saes.items():
            self.llm.attach_sae(site, sae if isinstance(sae, SAE) else SAE.load(sae))

    def facts(self) -> EngineFacts:
        return EngineFacts.of(self.llm)

    def run(
        self,
        root: str,
        manifest: Manifest,
        columns: Columns,
        capture: Capture,
        queued_tokens: int,
        work: Any,
        results: Any,
        replica: int,
    ) -> ExtractionStats:
        """Run the shards `work` (a Ray queue) gives until it gives None, putting (replica,
        entries) into `results` for every shard written, and (replica, ENDED) last, however
        the run ends (the driver blocks on `results`); the files go into `root`, the listing
        is the driver's."""
        store = ActivationStore(Path(root), manifest, columns)

        def shards() -> Iterator[tuple[int, Shard]]:
            while (item := work.get()) is not None:
                yield item

        try:
            return run_shards(
                self.llm.backend,
                shards(),
                store,
                capture,
                queued_tokens,
                commit=lambda entries: results.put((replica, entries)),
            )
        finally:
            with contextlib.suppress(Exception):  # the run's own error is the one raised
                results.put((replica, ENDED))

    def shutdown(self) -> None:
        self.llm.shutdown()


def run_replicas(
    ray: Any,
    model: str,
    request: ExtractionRequest,
    replicas: int,
    tensor_parallel: int,
    use_tqdm: bool,
    engine_kwargs: dict[str, Any],
    saes: dict[str, SAE | str],
) -> Extraction:
    """`request` on `replicas` Ray actors of `tensor_parallel` GPUs each (`ray` initialized):
    open (or resume) the dataset, run its shards, mark it complete, stop the actors."""
    from ray.util.queue import Queue
    from transformers import AutoTokenizer

    from vinterp.engine.platform_settings import gpu_platform

    gpus = float(ray.cluster_resources().get("GPU", 0))
    on_gpus = gpus > 0 or gpu_platform()
    check_replicas(replicas, tensor_parallel, gpus, on_gpus)
    actor = ray.remote(ExtractReplica).options(num_gpus=tensor_parallel if on_gpus else 0)
    sites, positions = request.sites, request.positions
    cores = core_groups(replicas)  # CPU engines: the replicas' workers on cores of their own
    handles = [
        actor.remote(model, sites, positions, None if on_gpus else cores[r], engine_kwargs, saes)
        for r in range(replicas)
    ]
    try:
        facts = ray.get(handles[0].facts.remote())
        job = open_job(facts, request)
        stats = ExtractionStats()
        if not job.store.manifest.complete:
            tokenizer = AutoTokenizer.from_pretrained(facts.model_path)
            with progress_bar(job, use_tqdm) as on_shard:
                stats = _run(ray, Queue, handles, job, tokenizer, on_shard)
            finish(job.store, stats, use_tqdm)
        return Extraction(load_dataset(request.out), stats)
    finally:
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.get(handle.shutdown.remote(), timeout=60)
            ray.kill(handle)


def _run(
    ray: Any, queue: Any, handles: list[Any], job: ExtractionJob, tokenizer: Any, on_shard: Any
) -> ExtractionStats:
    """Feed every replica its shards (AHEAD times its queued tokens unreported, at least
    MIN_SHARDS_AHEAD shards), list what they write in order, end with the first replica that
    failed. No polling: the driver blocks in `ray.wait` on the results queue's next report
    and on the replicas' runs at once, so it wakes for a report (a replica's ENDED one
    included) and for a replica killed outright, before it could report its end."""
    store = job.store
    results = queue()
    works = [queue() for _ in handles]
    runs = [
        handle.run.remote(
            str(store.root),
            store.manifest,
            store.columns,
            job.capture,
            job.queued_tokens,
            work,
            results,
            r,
        )
        for r, (handle, work) in enumerate(zip(handles, works))
    ]
    planned = job.shards(tokenizer)
    sent: list[deque[tuple[int, Shard]]] = [deque() for _ in handles]  # per replica, in order
    ahead = [0] * len(handles)  # per replica, the tokens of `sent`
    wanted = AHEAD * job.queued_tokens
    # (entry, shard) by shard number, listed in the manifest in order
    lister: InOrderLister[tuple[ShardEntry, Shard]] = InOrderLister(len(store.manifest.shards))
    stats, began, more = ExtractionStats(), time.perf_counter(), True
    ended = [False] * len(handles)  # its ENDED report read
    running = dict(enumerate(runs))  # the runs not seen to return
    report = None  # the results queue's next item, asked for
    try:
        while not all(ended):
            hungry = [r for r in range(len(handles)) if _wants(ahead[r], len(sent[r]), wanted)]
            while more and hungry:
                r = hungry.pop(0)
                item = next(planned, None)
                if item is None:
                    more = False
                    for work in works:
                        work.put(None)
                    break
                works[r].put(item)
                sent[r].append(item)
                ahead[r] += _tokens(item[1])
                if _wants(ahead[r], len(sent[r]), wanted):
                    hungry.append(r)
            if report is None:
                report = results.actor.get.remote()
            ready, _ = ray.wait([report, *running.values()], num_returns=1)
            if report not in ready:  # a run returned (its ENDED report is queued) or died
                r = runs.index(ready[0])
                del running[r]
                _raise_if_failed(ray, ready[0], r, len(handles), store)
                continue
            replica, entries = ray.get(report)
            report = None
            if entries is ENDED:
                ended[replica] = True
                running.pop(replica, None)
                _raise_if_failed(ray, runs[replica], replica, len(handles), store)
                continue
            listed = []
            for entry in entries:
                number, shard = sent[replica].popleft()
                ahead[replica] -= _tokens(shard)
                listed += lister.done(number, (entry, shard))
            if listed:
                store.add([entry for entry, _ in listed])
            for entry, shard in listed:
                stats.shards, stats.rows, stats.bytes = (
                    stats.shards + 1,
                    stats.rows + entry.rows,
                    stats.bytes + entry.bytes,
                )
                stats.tokens += shard.counts[TOKENS]
                on_shard(shard, stats.tokens)
    finally:
        if report is not None:  # a report asked for and not read: not waited for
            with contextlib.suppress(Exception):
                ray.cancel(report)
    for replica_stats in ray.get(runs):
        stats.engine_waited_s += replica_stats.engine_waited_s
        stats.writers_waited_s += replica_stats.writers_waited_s
    stats.seconds = time.perf_counter() - began
    return stats


def _tokens(shard: Shard) -> int:
    """A shard's prompt tokens (1 for one whose prompts the engine skips)."""
    return max(shard.counts[TOKENS], 1)


def _wants(ahead: int, shards: int, wanted: int) -> bool:
    return ahead < wanted or shards < MIN_SHARDS_AHEAD


def _raise_if_failed(
    ray: Any, ref: Any, replica: int, replicas: int, store: ActivationStore
) -> None:
    try:
        ray.get(ref)
    except Exception as exc:
        listed = len(store.manifest.shards)
        raise ReplicaError(
            f"extraction replica {replica} of {replicas} failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; the {listed} shards listed in "
            f"{store.root} stay valid, and the same call run again continues after them"
        ) from exc
