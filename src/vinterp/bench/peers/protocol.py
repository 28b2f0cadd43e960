"""The files between the bench and a peer process: a task directory holds `task.json` and
`vector.safetensors`; the peer writes `result.json` and `output.safetensors` next to them.
JSON and safetensors only: nothing a peer writes is unpickled."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

EXTRACT = "extract"  # every layer's output at the last prompt token -> (prompts, layers, hidden)
STEER = "steer"  # greedy tokens with `vector` added to one layer's output -> (prompts, tokens)
WORKLOADS = (EXTRACT, STEER)
OUTPUT_KEY = {EXTRACT: "residuals", STEER: "tokens"}


@dataclass(frozen=True)
class Task:
    workload: str
    model: str
    prompts: list[list[int]]  # token ids, so every tool reads the same tokens
    layer: int  # the steered layer
    max_tokens: int
    repeats: int
    batch: int  # prompts per forward pass where the tool batches by hand
    device: str  # where the HF-based tools run: the GPU when there is one, as vLLM does


@dataclass(frozen=True)
class Result:
    """What a peer process reports: its times (warm-up excluded) and the last run's output,
    or the error that stopped it."""

    times: list[float]
    version: str
    error: str | None = None
    output: torch.Tensor | None = None


def write_task(directory: Path, task: Task, vector: torch.Tensor) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "task.json").write_text(json.dumps(asdict(task)))
    save_file({"vector": vector.contiguous()}, str(directory / "vector.safetensors"))


def read_task(directory: Path) -> tuple[Task, torch.Tensor]:
    task = Task(**json.loads((directory / "task.json").read_text()))
    return task, load_file(str(directory / "vector.safetensors"))["vector"]


def write_result(directory: Path, task: Task, result: Result) -> None:
    meta: dict[str, Any] = {"times": result.times, "version": result.version}
    meta["error"] = result.error
    if result.output is not None:
        tensor = result.output.detach().cpu().contiguous()
        save_file({OUTPUT_KEY[task.workload]: tensor}, str(directory / "output.safetensors"))
    (directory / "result.json").write_text(json.dumps(meta))


def read_result(directory: Path, workload: str) -> Result | None:
    """The peer's result, or None when it wrote none (it crashed before the end)."""
    meta_file = directory / "result.json"
    if not meta_file.exists():
        return None
    meta = json.loads(meta_file.read_text())
    out_file = directory / "output.safetensors"
    output = load_file(str(out_file))[OUTPUT_KEY[workload]] if out_file.exists() else None
    return Result(meta["times"], meta["version"], meta["error"], output)
