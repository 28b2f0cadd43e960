"""What each forward step of a run costs on a GPU, and which of them ran uncompiled:
`vinterp bench`'s workloads (256 x 128) on one engine, every step's start time, scheduled
tokens, new requests and graph route logged in the worker.

    VLLM_ALLOW_INSECURE_SERIALIZATION=1 WORKLOADS=idle,capture_one REPS=3 \\
        python3 scripts/gpu_steps.py

The step clock is installed through `collective_rpc` with a function of this script (hence
the insecure-serialization switch: a local script, never a server). With the engine core in
its own process (vLLM's default, as in the bench) the requests reach it while it already
steps; VLLM_ENABLE_V1_MULTIPROCESSING=0 puts them all in its first steps.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import vinterp
from vinterp.bench.fastpath import PROMPT_TEMPLATE, vinterp_workloads

N, T = int(os.environ.get("N", 256)), int(os.environ.get("T", 128))
REPS = int(os.environ.get("REPS", 3))
KEYS = os.environ.get("WORKLOADS", "idle,capture_one").split(",")
DTYPE = os.environ.get("DTYPE", "bfloat16")


def install_step_clock(worker: Any) -> None:
    """In the worker: log (start, uncompiled, tokens, requests, new requests) per step."""
    runner = worker.model_runner
    runtime = runner._vinterp_runtime
    original = runner.execute_model
    log: list[tuple[float, bool, int, int, int]] = []

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        output = original(scheduler_output, *args, **kwargs)
        if not kwargs.get("dummy_run", False) and scheduler_output.total_num_scheduled_tokens:
            log.append(
                (
                    start,
                    runtime.python_step,
                    scheduler_output.total_num_scheduled_tokens,
                    len(scheduler_output.num_scheduled_tokens),
                    len(scheduler_output.scheduled_new_reqs),
                )
            )
        return output

    runner.execute_model = execute_model
    worker.vinterp_step_log = log


def take_step_log(worker: Any) -> list[tuple[float, bool, int, int, int]]:
    taken = list(worker.vinterp_step_log)
    worker.vinterp_step_log.clear()
    return taken


def describe(log: list[tuple[float, bool, int, int, int]], wall: float) -> str:
    """A run's steps: how many, how many uncompiled and their time, the first steps."""
    spans = [b[0] - a[0] for a, b in zip(log, log[1:])]
    python = [s for s, step in zip(spans, log) if step[1]]
    compiled = [s for s, step in zip(spans, log) if not step[1]]
    first = [(round(s * 1e3, 1), step[2], step[4], step[1]) for s, step in zip(spans, log)][:8]
    head = ", ".join(f"{ms}ms/{tok}tok/{new}new{'/U' if u else ''}" for ms, tok, new, u in first)
    return (
        f"wall {wall:.3f} s, steps {len(log)}, uncompiled {len(python)} taking "
        f"{sum(python):.3f} s, compiled step median {statistics.median(compiled) * 1e3:.1f} ms, "
        f"first steps [{head}]"
    )


def main() -> None:
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(N)]
    llm = vinterp.LLM(vinterp.models.bundled(), dtype=DTYPE, max_model_len=2048)
    rpc = llm._engine.llm.collective_rpc
    rpc(install_step_clock)
    chosen = {key: kwargs for key, _, kwargs in vinterp_workloads(llm) if key in KEYS}
    for rep in range(REPS + 1):  # the first round warms up
        for key, kwargs in chosen.items():
            rpc(take_step_log)
            start = time.perf_counter()
            llm.generate(texts, max_tokens=T, ignore_eos=True, use_tqdm=False, **kwargs)
            wall = time.perf_counter() - start
            print(f"round {rep} {key:20s} {describe(rpc(take_step_log)[0], wall)}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
