"""Both peer workloads on the same prompts and model: vinterp first (the reference), then
every peer, each in its own process; each output is checked against vinterp's."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vinterp.bench.workloads import PROMPT_TEMPLATE

from . import runner
from .check import verdict
from .protocol import EXTRACT, STEER, Result, Task, write_task
from .registry import PEERS, VINTERP, Peer
from .row import PeerRow
from .timing import Timing

BATCH = 64  # prompts per forward pass for the tools that batch by hand
STEER_NORM = 4.0  # the steering vector's scale (a random unit-variance vector times this)


@dataclass(frozen=True)
class Sizes:
    extract_prompts: int = 256
    steer_prompts: int = 64
    steer_tokens: int = 32


QUICK = Sizes(extract_prompts=32, steer_prompts=8, steer_tokens=8)


def tasks(model: str | Path, sizes: Sizes, repeats: int) -> tuple[list[Task], torch.Tensor]:
    """The extraction and steering tasks (token ids from the model's tokenizer) and the
    steering vector, added to the output of the layer a third of the way up."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(model))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = [tokenizer(PROMPT_TEMPLATE.format(i=i)).input_ids for i in range(sizes.extract_prompts)]
    layer = config.num_hidden_layers // 3
    vector = STEER_NORM * torch.randn(
        config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    common = {
        "model": str(model),
        "layer": layer,
        "repeats": repeats,
        "batch": BATCH,
        "device": "cuda" if torch.cuda.is_available() else "cpu",  # where vLLM's engine runs
    }
    return [
        Task(EXTRACT, prompts=ids, max_tokens=1, **common),
        Task(STEER, prompts=ids[: sizes.steer_prompts], max_tokens=sizes.steer_tokens, **common),
    ], vector


def run(
    model: str | Path,
    sizes: Sizes,
    repeats: int,
    peers: Sequence[Peer] = PEERS,
    progress: Callable[[str], None] = lambda _: None,
    log_dir: Path | None = None,
) -> list[PeerRow]:
    """A row per (workload, tool), vinterp's first; `progress(tool)` after each tool. Each
    tool's process output goes to `log_dir/<module>.log` (default: a temporary directory)."""
    from vinterp.engine.platform_settings import configure_engine_environment

    configure_engine_environment(1)  # the vLLM-based peers get vinterp's engine settings
    task_list, vector = tasks(model, sizes, repeats)
    references: dict[str, Result] = {}
    rows: list[PeerRow] = []
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vinterp-bench-peers-") as tmp:
        for peer in (VINTERP, *peers):
            directories = [(Path(tmp) / peer.module / task.workload, task) for task in task_list]
            for directory, task in directories:
                write_task(directory, task, vector)
            log = (log_dir or Path(tmp)) / f"{peer.module}.log"
            results = runner.run(peer, [(d, task.workload) for d, task in directories], log)
            for task, result in zip(task_list, results):
                if peer is VINTERP:
                    references[task.workload] = result
                rows.append(_row(task.workload, peer, result, references.get(task.workload)))
            progress(peer.name)
    order = {task.workload: i for i, task in enumerate(task_list)}
    return sorted(rows, key=lambda row: order[row.workload])  # stable: vinterp first


def _row(workload: str, peer: Peer, result: Result, reference: Result | None) -> PeerRow:
    timing = Timing(tuple(result.times)) if result.times else None
    if result.error:
        check = f"error: {result.error}"
    elif peer is VINTERP:
        check = "reference"
    elif reference is None or reference.output is None:
        check = "unchecked (vinterp did not run)"
    else:
        check = verdict(workload, reference.output, result.output)
    ref_median = Timing(tuple(reference.times)).median if reference and reference.times else None
    return PeerRow(workload, peer.name, result.version, timing, check, ref_median)
