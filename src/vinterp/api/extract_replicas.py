"""Data-parallel extraction: N engine replicas, each of T GPUs, as Ray actors, writing one
dataset. Ray is what vLLM itself runs on across machines, so on a Ray cluster the same call
spreads over its nodes (each replica writes its shards where the dataset lives: a folder every
node sees).

The driver opens the dataset and plans the shards exactly as one engine would; each replica
pulls numbered shards from its own work queue, runs them through the same stream and disk
writers as `llm.extract` (`run_shards`) and reports every written shard; the driver lists
them in the manifest in order. So the dataset is the one a single engine writes, shard for
shard, and a run killed at any point (the driver, or a replica) resumes to exactly it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vinterp.api.extract import (
    BUFFER_GB,
    EngineFacts,
    Extraction,
    ExtractionJob,
    ExtractionRequest,
    ExtractionStats,
    engine_settings,
    expand_sites,
    extract_on,
    finish,
    load_dataset,
    open_job,
    progress_bar,
    run_shards,
)
from vinterp.api.extract_plan import TOKENS, PositionSpec, Shard
from vinterp.api.extract_sae import check_sae_sites, load_saes
from vinterp.engine.cpu_settings import core_groups
from vinterp.errors import VinterpError
from vinterp.sae import SAE
from vinterp.sites.names import sae_site
from vinterp.store import ActivationStore, Columns, Manifest, ShardEntry

# Prompt tokens sent to a replica and not yet reported written, in units of the tokens its
# stream keeps queued in its engine: its stream asks for the next shard (and waits for it)
# whenever fewer are queued, so the driver keeps more than that in its work queue. Few
# enough that a dead replica leaves little to redo.
AHEAD = 2
MIN_SHARDS_AHEAD = 2
POLL_S = 0.5  # how often the driver looks whether a replica has died


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
        job: dict[str, Any],
        work: Any,
        results: Any,
        replica: int,
    ) -> ExtractionStats:
        """Run the shards `work` (a Ray queue) gives until it gives None, putting (replica,
        entries) into `results` for every shard written; the files go into `root`, the
        listing is the driver's."""
        store = ActivationStore(Path(root), manifest, columns)

        def shards() -> Iterator[tuple[int, Shard]]:
            while (item := work.get()) is not None:
                yield item

        return run_shards(
            self.llm.backend,
            shards(),
            store,
            job["capture"],
            job["queued_tokens"],
            commit=lambda entries: results.put((replica, entries)),
        )

    def shutdown(self) -> None:
        self.llm.shutdown()


def extract(
    model: str | Path,
    prompts: Any,
    sites: str | list[str],
    out: str | Path,
    positions: PositionSpec = "all_prompt",
    *,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    ray_address: str | None = None,
    dtype: str | None = None,
    skip_first: int = 0,
    column: str = "text",
    buffer_gb: float = BUFFER_GB,
    saes: Mapping[str, SAE | str | Path] | None = None,
    topk: int | None = None,
    use_tqdm: bool = True,
    engine_dtype: str | None = None,
    **engine_kwargs: Any,
) -> Extraction:
    """The activations at `sites` of every prompt's `positions` of `model`, written to the
    dataset `out` as `llm.extract` writes them (API.md section 5), on `data_parallel_size`
    engine replicas of `tensor_parallel_size` GPUs each. One replica without `ray_address`
    runs in this process; otherwise the replicas are Ray actors, on the cluster at
    `ray_address` or on one started here. `saes` ({host site: SAE or its directory}) are
    checked here, before any engine starts, and attached in every replica (a directory is
    loaded there); `dtype` (the stored values') and `topk` as in `llm.extract`;
    `engine_dtype` is the engine's (default: the checkpoint's)."""
    check_replicas(data_parallel_size, tensor_parallel_size, 1, on_gpus=False)
    names = [sites] if isinstance(sites, str) else list(sites)
    loaded = check_saes(model, names, saes or {}, topk)
    request = ExtractionRequest(
        prompts, names, positions, out, dtype, skip_first, column, buffer_gb, topk
    )
    kwargs = {**engine_kwargs, "tensor_parallel_size": tensor_parallel_size}
    if engine_dtype is not None:
        kwargs["dtype"] = engine_dtype
    if data_parallel_size == 1 and ray_address is None:
        from vinterp.api.llm import LLM

        with LLM(model, **engine_settings(names, positions), **kwargs) as llm:
            for site, sae in loaded.items():
                llm.attach_sae(site, sae)
            return extract_on(llm, request, use_tqdm)
    sent = {  # directories travel as absolute paths: a replica may run elsewhere
        site: sae if isinstance(sae, SAE) else str(Path(sae).resolve())
        for site, sae in (saes or {}).items()
    }
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    try:
        return _extract(
            ray,
            str(model),
            request,
            data_parallel_size,
            tensor_parallel_size,
            use_tqdm,
            kwargs,
            sent,
        )
    finally:
        if started_ray:
            ray.shutdown()


def check_saes(
    model: str | Path, sites: list[str], saes: Mapping[str, SAE | str | Path], topk: int | None
) -> dict[str, SAE]:
    """The SAEs loaded and checked, with the SAE sites and `topk`, against the model's
    config: ValueError before any engine starts."""
    from transformers import AutoConfig

    if not saes and topk is None and not any(sae_site(site) for site in sites):
        return {}
    config = AutoConfig.from_pretrained(str(model))
    loaded = load_saes(config, saes)
    widths = {site: sae.d_sae for site, sae in loaded.items()}
    check_sae_sites(expand_sites(config, sites), widths, topk)
    return loaded


def _extract(
    ray: Any,
    model: str,
    request: ExtractionRequest,
    replicas: int,
    tensor_parallel: int,
    use_tqdm: bool,
    engine_kwargs: dict[str, Any],
    saes: dict[str, SAE | str],
) -> Extraction:
    from ray.util.queue import Empty, Queue
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
                stats = _run(ray, (Queue, Empty), handles, job, tokenizer, on_shard)
            finish(job.store, stats, use_tqdm)
        return Extraction(load_dataset(request.out), stats)
    finally:
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.get(handle.shutdown.remote(), timeout=60)
            ray.kill(handle)


def _run(
    ray: Any, queues: Any, handles: list[Any], job: ExtractionJob, tokenizer: Any, on_shard: Any
) -> ExtractionStats:
    """Feed every replica its shards (AHEAD times its queued tokens unreported, at least
    MIN_SHARDS_AHEAD shards), list what they write in order, end with the first replica that
    failed."""
    queue, empty = queues
    store = job.store
    results = queue()
    works = [queue() for _ in handles]
    setup = {"capture": job.capture, "queued_tokens": job.queued_tokens}
    runs = [
        handle.run.remote(str(store.root), store.manifest, store.columns, setup, work, results, r)
        for r, (handle, work) in enumerate(zip(handles, works))
    ]
    planned = job.shards(tokenizer)
    sent: list[deque[Shard]] = [deque() for _ in handles]  # per replica, in its order
    ahead = [0] * len(handles)  # per replica, the tokens of `sent`
    wanted = AHEAD * job.queued_tokens
    written: dict[int, ShardEntry] = {}  # by first prompt, not yet listed
    shards: dict[int, Shard] = {}  # by first prompt, sent and not yet listed
    stats, began, more = ExtractionStats(), time.perf_counter(), True
    ended = [False] * len(handles)
    while True:
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
            sent[r].append(item[1])
            ahead[r] += _tokens(item[1])
            shards[item[1].start] = item[1]
            if _wants(ahead[r], len(sent[r]), wanted):
                hungry.append(r)
        with contextlib.suppress(empty):
            replica, entries = results.get(timeout=POLL_S)
            for entry in entries:
                ahead[replica] -= _tokens(sent[replica].popleft())
                written[entry.start] = entry
        while store.manifest.next_prompt in written:
            entry = written.pop(store.manifest.next_prompt)
            store.add([entry])
            shard = shards.pop(entry.start)
            stats.shards, stats.rows, stats.bytes = (
                stats.shards + 1,
                stats.rows + entry.rows,
                stats.bytes + entry.bytes,
            )
            stats.tokens += shard.counts[TOKENS]
            on_shard(shard, stats.tokens)
        finished, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        for ref in finished:
            r = runs.index(ref)
            if not ended[r]:
                ended[r] = True
                _raise_if_failed(ray, ref, r, len(handles), store)
        if all(ended) and results.empty() and not written:
            break
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
