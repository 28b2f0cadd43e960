"""Activation extraction rows of `vinterp bench`: `llm.extract` streaming rows to a Hugging
Face `datasets` directory on disk, timed against plain vLLM's prefill of the same prompts
(`vllm.LLM.generate(prompts, SamplingParams(max_tokens=1))`) in the same run; and the same
extraction with HF transformers and forward hooks into host memory, against the same
prefill time. One engine is alive at a time; the HF model loads after the last engine is
shut down. Each extraction row also says how long the store alone takes to write as many
rows to the same disk (no engine): an extraction can be no faster than that or the prefill.
The SAE row stores the top-k features of the bench's SAE (`bench_sae`) and gives the
dataset's size against the dense rows of its host site."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vinterp.bench.bench_sae import EXPANSION, TOPK, host_site, saved_sae
from vinterp.bench.harness import (
    REFERENCE,
    Row,
    Timing,
    device_kind,
    free_memory,
    target,
    timed_interleaved,
)
from vinterp.bench.peers.batching import batches
from vinterp.bench.workloads import (
    EXTRACT_HF,
    EXTRACT_LAYERS_ALL,
    EXTRACT_LAYERS_LAST,
    EXTRACT_MID_DEPTH,
    EXTRACT_SAE,
    EXTRACTION,
    PROMPT_TEMPLATE,
    plain_vllm,
    vinterp_engine,
)
from vinterp.engine.plain_vllm import greedy_params
from vinterp.extraction.request import BUFFER_GB, engine_settings, shard_bytes, store_columns
from vinterp.extraction.stream import ExtractionStats
from vinterp.sites.names import parse_site
from vinterp.store import (
    COLUMN_DTYPE,
    WRITER_THREADS,
    ActivationStore,
    Columns,
    PendingShard,
    ShardSizes,
    ShardWriter,
    row_size,
)

KEYS = EXTRACTION
PROMPT_TOKENS = 256  # `vinterp bench --prompt-tokens`
# extract_layers_all: how many evenly spaced layers, per device kind
SPACED_LAYERS = {"cuda": 4, "cpu": 2}
# The HF peer's batch sizes: each is tried once (on the warm-up prompts), the fastest is timed
HF_BATCHES = (8, 16, 32, 64)
WARM_UP_SHARE = 16  # warm-ups and batch trials run on this share of the prompts
GB = 1e9


@dataclass(frozen=True)
class ExtractionCase:
    """One extraction row: what `llm.extract` is asked for, and the same in layer indices
    for the HF peer (or the host layer of an SAE's features, kept `topk` per token)."""

    key: str
    name: str
    sites: list[str]
    positions: str  # all_prompt or last_prompt
    layers: list[int]
    topk: int | None = None
    num_layers: int | None = None  # the engine's layers (None: the model's)

    def columns(self, dtype: str, hidden: int) -> Columns:
        """The dataset's columns (for the store-alone time)."""
        sites = self.sites if self.topk else [f"layers.{i}.output" for i in self.layers]
        return store_columns(sites, dtype, hidden, self.topk)


def spaced_layers(n_layers: int, count: int) -> list[int]:
    """`count` layers evenly spaced over `n_layers`, each in the middle of its share."""
    count = min(count, n_layers)
    return [(2 * i + 1) * n_layers // (2 * count) for i in range(count)]


def extractions(config: Any, spaced: int) -> dict[str, ExtractionCase]:
    """The extraction rows of a model of `config`, `spaced` layers in extract_layers_all."""
    n_layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    layers = spaced_layers(n_layers, spaced)
    host = host_site(config)
    features = f"{host}.sae.features"
    middle = n_layers // 2  # layer 16 of 32: 17 layers run
    return {
        EXTRACT_LAYERS_ALL: ExtractionCase(
            EXTRACT_LAYERS_ALL,
            f"extract layers {','.join(map(str, layers))}.output, every prompt position",
            [f"layers.{i}.output" for i in layers],
            "all_prompt",
            layers,
        ),
        EXTRACT_LAYERS_LAST: ExtractionCase(
            EXTRACT_LAYERS_LAST,
            "extract layers.*.output last_prompt",
            ["layers.*.output"],
            "last_prompt",
            list(range(n_layers)),
        ),
        EXTRACT_SAE: ExtractionCase(
            EXTRACT_SAE,
            f"extract top-{TOPK} of {features} (SAE of {EXPANSION * hidden}), every prompt "
            "position",
            [features],
            "all_prompt",
            [parse_site(host).layer],
            TOPK,
        ),
        EXTRACT_MID_DEPTH: ExtractionCase(
            EXTRACT_MID_DEPTH,
            f"extract layers.{middle}.output of {n_layers} layers, every prompt position, the "
            f"engine stopped there",
            [f"layers.{middle}.output"],
            "all_prompt",
            [middle],
            num_layers=middle + 1,
        ),
    }


def prompt_texts(tokenizer: Any, prompts: int, tokens: int) -> list[str]:
    """`prompts` different texts of `tokens` tokens each (a token fewer where the tokenizer
    merges across the cut): PROMPT_TEMPLATE for numbers i, i+1, ... joined until long
    enough, then cut at `tokens` tokens."""
    texts = []
    for i in range(prompts):
        parts: list[str] = []
        k = i
        while len(ids := tokenizer(" ".join(parts)).input_ids) < tokens:
            parts.append(PROMPT_TEMPLATE.format(i=k))
            k += 1
        texts.append(_cut(tokenizer, ids, tokens))
    return texts


def _cut(tokenizer: Any, ids: list[int], tokens: int) -> str:
    """The text of the first `tokens` of `ids` that encodes to at most `tokens` tokens."""
    special = len(tokenizer("").input_ids)  # BOS and the like, added again on encoding
    keep = tokens - special
    while True:
        text = tokenizer.decode(ids[special : special + keep], skip_special_tokens=True)
        if len(tokenizer(text).input_ids) <= tokens:
            return text
        keep -= 1


def payload_bytes(dataset: Any, sites: list[str]) -> int:
    """Bytes of the site values in an extracted dataset (rows x width x itemsize per site
    column, as the Arrow schema stores them; the prompt/position/token columns not
    counted)."""
    schema = dataset.data.schema
    total = 0
    for name in schema.names:
        if name in ("prompt", "position", "token"):
            continue
        kind = schema.field(name).type
        total += dataset.num_rows * kind.list_size * kind.value_type.bit_width // 8
    return total


@contextmanager
def scratch(root: str | Path | None) -> Any:
    """The directory the timed extractions write under: `root` (kept), or a temporary one
    (removed at the end)."""
    if root is not None:
        Path(root).mkdir(parents=True, exist_ok=True)
        yield Path(root)
        return
    made = Path(tempfile.mkdtemp(prefix="vinterp-bench-extract-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


class RunFolders:
    """A fresh folder under `root` for each timed run. After a run (untimed), the runs so far
    are deleted only when the disk could not hold two more of the largest: deleting a run's
    gigabytes held the next run's first fsyncs for up to a second on the lent H200 machine
    (an ext4 root mounted with `discard`), a cost of the bench's cleanup that a single
    extraction does not pay. `close` deletes what is left."""

    SPARE = 1 << 30  # bytes the disk keeps free besides two runs

    def __init__(self, root: Path, prefix: str) -> None:
        self.root, self.prefix = root, prefix
        self.runs: list[Path] = []
        self.largest = 0

    def new(self) -> Path:
        self.runs.append(Path(tempfile.mkdtemp(prefix=self.prefix, dir=self.root)))
        return self.runs[-1]

    def done(self) -> None:
        size = sum(f.stat().st_size for f in self.runs[-1].rglob("*") if f.is_file())
        self.largest = max(self.largest, size)
        if shutil.disk_usage(self.root).free < 2 * self.largest + self.SPARE:
            self.close()

    def close(self) -> None:
        while self.runs:
            shutil.rmtree(self.runs.pop(), ignore_errors=True)


def run(
    model: str | Path,
    prompts: int,
    prompt_tokens: int,
    repeats: int,
    dtype: str,
    selected: set[str],
    extract_dir: str | Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
    **engine_kwargs: Any,
) -> list[Row]:
    """Rows for the selected `KEYS`: plain vLLM's prefill first, then one vinterp engine per
    selected extraction (capture buffers at its sites), then the HF peer (on the extractions
    selected, or both when only the peer is). `engine_kwargs` (e.g. load_format) go to every
    vLLM engine; load_format="dummy" gives the HF peer a model built from the config."""
    from transformers import AutoConfig, AutoTokenizer

    chosen = [key for key in KEYS if key in selected]
    if not chosen:
        return []
    config = AutoConfig.from_pretrained(str(model))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    texts = prompt_texts(tokenizer, prompts, prompt_tokens)
    ids = tokenizer(texts).input_ids
    tokens = sum(map(len, ids))
    hidden = int(config.hidden_size)
    every = extractions(config, SPACED_LAYERS[device_kind()])
    ours = [every[key] for key in chosen if key in every]
    size = f" ({len(texts)}x{prompt_tokens} prompt tokens)"
    rows: list[Row] = []
    with scratch(extract_dir) as root:
        plain = plain_prefill(model, dtype, texts, repeats, **engine_kwargs)
        times: dict[str, Timing] = {}
        for x in ours:
            with saved_sae(hidden, root) if x.topk else nullcontext() as sae:
                saes = {host_site(config): sae} if sae is not None else {}
                timing, written, count, stats = time_extract(
                    model, dtype, texts, x, repeats, root, saes, **engine_kwargs
                )
            times[x.key] = timing
            alone = time_store_alone(root, x.columns(dtype, hidden), count, repeats)
            extras = {
                "gb_written": written / GB,
                "gb_per_s": written / GB / timing.median,
                "store_alone_s": alone.median,
                "engine_waited_s": stats.engine_waited_s,
                "writers_waited_s": stats.writers_waited_s,
            }
            if x.topk:
                extras |= dense_size(written, count, hidden, dtype)
            rows.append(Row(x.name + size, plain, timing, target(x.key), x.key, tokens, extras))
            progress(x.key)
    if EXTRACT_HF in selected:
        dense = [x for x in every.values() if not x.topk]  # the peer extracts residuals
        peer = [x for x in ours if not x.topk] or dense
        dummy = engine_kwargs.get("load_format") == "dummy"
        rows += hf_rows(model, dtype, ids, peer, repeats, plain, times, dummy, size)
        progress(EXTRACT_HF)
    return rows


def dense_size(written: int, rows: int, hidden: int, dtype: str) -> dict[str, float]:
    """The dense rows of the host site that the same rows would take (rows x hidden x the
    stored dtype's size, as `extract_layers_all` stores a site), and `written` over that."""
    dense = rows * hidden * np.dtype(COLUMN_DTYPE[dtype]).itemsize
    return {"dense_gb": dense / GB, "size_vs_dense": written / dense}


def warm_up(prompts: list[Any]) -> list[Any]:
    """The prompts of a warm-up run, and of the HF peer's batch-size trials: the first
    1/WARM_UP_SHARE of them (at least HF_BATCHES' largest), so that a run of minutes on a
    lent GPU is not paid twice."""
    return prompts[: max(len(prompts) // WARM_UP_SHARE, max(HF_BATCHES))]


def plain_prefill(
    model: str | Path, dtype: str, texts: list[str], repeats: int, **engine_kwargs: Any
) -> Timing:
    """Plain vLLM's prefill of `texts`: `generate(texts, SamplingParams(max_tokens=1))`."""
    params = greedy_params(1)
    with plain_vllm(model, dtype, **engine_kwargs) as llm:
        call = partial(llm.generate, texts, params, use_tqdm=False)
        warm = partial(llm.generate, warm_up(texts), params, use_tqdm=False)
        return timed_interleaved({"plain": call}, repeats, warm={"plain": warm})["plain"]


def time_extract(
    model: str | Path,
    dtype: str,
    texts: list[str],
    x: ExtractionCase,
    repeats: int,
    root: Path,
    saes: dict[str, Path],
    **engine_kwargs: Any,
) -> tuple[Timing, int, int, ExtractionStats]:
    """Times of `llm.extract` of `texts` on a vinterp engine with capture buffers at the
    sites (and the SAE directories `saes` attached), each run into a fresh directory under
    `root` (`RunFolders`: deleted, untimed, when the disk needs the room); the bytes of site
    values one run wrote, its rows, and the statistics of the timed run of median time."""
    written: list[int] = []
    count: list[int] = []
    stats: list[ExtractionStats] = []
    runs = RunFolders(root, "run-")
    kwargs = {**engine_settings(x.sites, x.positions), **engine_kwargs}
    if x.num_layers is not None:
        kwargs["num_layers"] = x.num_layers
    with vinterp_engine(model, dtype, saes, **kwargs) as llm:

        def extract(prompts: list[str] = texts) -> None:
            out = runs.new() / "acts"
            result = llm.extract(
                prompts, x.sites, out=out, positions=x.positions, topk=x.topk, use_tqdm=False
            )
            written.append(payload_bytes(result.dataset, x.sites))
            count.append(result.dataset.num_rows)
            stats.append(result.stats)

        warm = {x.key: partial(extract, warm_up(texts))}
        try:
            timing = timed_interleaved({x.key: extract}, repeats, {x.key: runs.done}, warm)[x.key]
        finally:
            runs.close()
    timed = stats[-len(timing.times) :]
    median = sorted(range(len(timed)), key=lambda k: timing.times[k])[len(timed) // 2]
    return timing, written[-1], count[-1], timed[median]


def time_store_alone(
    root: Path, columns: Columns, rows: int, repeats: int, threads: int = WRITER_THREADS
) -> Timing:
    """Times of the store writing `rows` rows of `columns` into a fresh directory under
    `root` (`RunFolders`) at `llm.extract`'s shard size, on `threads` writers (an engine's, or
    as many as data-parallel replicas have), from one shard of random values made beforehand:
    the disk's and Arrow's share of an extraction, with no engine."""
    size = shard_bytes(columns, BUFFER_GB)
    per_shard = max(size // row_size(columns), 1)
    random = np.random.default_rng(0)
    block = {}
    for name, (dtype, width) in columns.items():
        shape = (per_shard, width) if width else (per_shard,)
        count = int(np.prod(shape))
        block[name] = np.frombuffer(random.bytes(count * np.dtype(dtype).itemsize), dtype)
        block[name] = block[name].reshape(shape)
    runs = RunFolders(root, "store-")

    def write(rows: int = rows) -> None:
        spec = {"bench": "store alone"}
        store = ActivationStore.open(runs.new(), spec, columns, ShardSizes(size))
        with ShardWriter(store, threads) as writer:
            for index, start in enumerate(range(0, rows, per_shard)):
                n = min(per_shard, rows - start)
                shard = {name: values[:n] for name, values in block.items()}
                writer.put(partial(PendingShard, index, index + 1, partial(dict, shard), dict))

    warm = {"store": partial(write, min(rows, per_shard))}
    try:
        return timed_interleaved({"store": write}, repeats, {"store": runs.done}, warm)["store"]
    finally:
        runs.close()


def hf_rows(
    model: str | Path,
    dtype: str,
    ids: list[list[int]],
    peer: list[ExtractionCase],
    repeats: int,
    plain: Timing,
    ours: dict[str, Timing],
    dummy: bool,
    size: str,
) -> list[Row]:
    """The HF peer's row per extraction, each at its fastest batch size of HF_BATCHES; its
    extras give vinterp's throughput over HF's where vinterp's row ran. The model is freed
    (with the GPU memory it held) before this returns."""
    device = "cuda" if device_kind() == "cuda" else "cpu"
    models = [hf_model(model, dtype, device, dummy)]
    rows = []
    try:
        for x in peer:
            batch = tune_batch(models[0], warm_up(ids), x, device)
            timing, collected = time_hf(models[0], ids, x, batch, device, repeats)
            extras = {"hf_batch": float(batch), "gb_collected": collected / GB}
            if x.key in ours:
                extras["vinterp_throughput_x_hf"] = timing.median / ours[x.key].median
            name = f"HF transformers + forward hooks, to host memory (batch {batch}): {x.name}"
            name += size + (" (unchecked: random weights)" if dummy else "")
            rows.append(Row(name, plain, timing, REFERENCE, EXTRACT_HF, sum(map(len, ids)), extras))
    finally:
        models.clear()
        free_memory()
    return rows


def time_hf(
    hf: Any, ids: list[list[int]], x: ExtractionCase, batch: int, device: str, repeats: int
) -> tuple[Timing, int]:
    """Times of the HF extraction at `batch`, and the bytes of the rows one run collected
    (each run's rows are dropped before the next)."""
    collected: list[int] = []

    def extract(prompts: list[list[int]] = ids) -> None:
        rows = hf_extract(hf, prompts, x, batch, device)
        collected.append(sum(t.numel() * t.element_size() for t in rows.values()))

    warm = {x.key: partial(extract, warm_up(ids))}
    return timed_interleaved({x.key: extract}, repeats, warm=warm)[x.key], collected[-1]


def hf_model(model: str | Path, dtype: str, device: str, dummy: bool) -> Any:
    """The transformers model in the engine's dtype on `device`: built from the config
    (random weights) for a shape without weights, else loaded from the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if dummy:
        config = AutoConfig.from_pretrained(str(model))
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype).to(device)
    return hf.eval()


def tune_batch(hf: Any, ids: list[list[int]], x: ExtractionCase, device: str) -> int:
    """The fastest of HF_BATCHES, each run once (a batch that runs out of memory is
    skipped)."""
    best: tuple[int, float] | None = None
    for batch in HF_BATCHES:
        start = time.perf_counter()
        try:
            hf_extract(hf, ids, x, batch, device)
        except torch.OutOfMemoryError:
            free_memory()
            continue
        seconds = time.perf_counter() - start
        if best is None or seconds < best[1]:
            best = (batch, seconds)
    if best is None:
        raise RuntimeError(f"HF peer: out of memory at every batch size {HF_BATCHES}")
    return best[0]


@torch.inference_mode()
def hf_extract(
    hf: Any, ids: list[list[int]], x: ExtractionCase, batch: int, device: str
) -> dict[int, torch.Tensor]:
    """The layers' outputs (forward hooks) at the extraction's positions, in host memory:
    (rows, hidden) per layer, rows in prompt order. Right-padded batches through the base
    model (no LM head)."""
    from vinterp.sites.modules import find_site_modules

    layers = find_site_modules(hf, hf.config.model_type).layers
    seen: dict[int, torch.Tensor] = {}

    def keep(i: int, _module: Any, _args: Any, out: Any) -> None:
        seen[i] = out[0] if isinstance(out, tuple) else out

    hooks = [layers[i].register_forward_hook(partial(keep, i)) for i in x.layers]
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in x.layers}
    try:
        for batch_ids, mask, last in batches(ids, batch, "right", device):
            hf.base_model(input_ids=batch_ids, attention_mask=mask)
            real = mask.bool()
            picked, last = torch.arange(len(last), device=device), last.to(device)
            for i in x.layers:
                h = seen[i]
                rows[i].append((h[real] if x.positions == "all_prompt" else h[picked, last]).cpu())
    finally:
        for hook in hooks:
            hook.remove()
    return {i: torch.cat(rows.pop(i)) for i in x.layers}  # each layer's batches freed as joined
