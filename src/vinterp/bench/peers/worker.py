"""A peer process: `python -m peers.worker MODULE TASK_DIR...` loads the tool's module and
the model once (not timed), then times each task's workload (warm-up excluded) and writes
its result into its directory. A run is timed until its output is on the host, so a
GPU tool's queued kernels are counted.

A tool module has `version() -> str`, `load(task) -> state`, `extract(state, task) ->
(prompts, layers, hidden)` float tensor, `steer(state, task, vector) -> (prompts, tokens)`
int tensor, and optionally `close(state)` (an engine to shut down)."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from .protocol import EXTRACT, Result, Task, read_task, write_result
from .timing import measure


def main(module_name: str, directories: list[Path]) -> None:
    tasks = [read_task(directory) for directory in directories]
    version, state, tool = "?", None, None
    try:
        tool = importlib.import_module(f"{__package__}.{module_name}")
        version = tool.version()
        state = tool.load(tasks[0][0])
        for directory, (task, vector) in zip(directories, tasks):
            write_result(directory, task, _run(tool, state, task, vector, version))
    except Exception as exc:  # the rows say why this tool could not run
        traceback.print_exc()
        for directory, (task, _) in zip(directories, tasks):
            if not (directory / "result.json").exists():
                write_result(directory, task, Result([], version, error=_message(exc)))
    finally:
        if state is not None and hasattr(tool, "close"):
            tool.close(state)


def _run(tool: Any, state: Any, task: Task, vector: torch.Tensor, version: str) -> Result:
    def run() -> torch.Tensor:  # timed until the output is on the host
        if task.workload == EXTRACT:
            return tool.extract(state, task).cpu()
        return tool.steer(state, task, vector).cpu()

    try:
        timing, output = measure(run, task.repeats)
    except Exception as exc:  # this workload failed; the next may still run
        traceback.print_exc()
        return Result([], version, error=_message(exc))
    return Result(list(timing.times), version, output=output)


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


if __name__ == "__main__":
    main(sys.argv[1], [Path(arg) for arg in sys.argv[2:]])
