"""Where the bench's round-to-round spread comes from on a GPU: the same generate call
(`vinterp bench`'s idle workload, 256 x 128) repeated on one vinterp engine, each run's wall
time next to the forward steps it took. Steps that vary with the time point at scheduling
(requests reaching the engine while it already steps); a constant step count with varying
time points at the host (each step's CPU work).

    REPS=12 python3 scripts/gpu_noise.py            # or under `taskset -c 2-9` to compare

MODEL (a checkpoint; default the bundled model) and DTYPE (default bfloat16) for other runs.
"""

from __future__ import annotations

import os
import statistics
import time

import vinterp
import vinterp.bench.harness
from vinterp.bench.fastpath import PROMPT_TEMPLATE

N, T = int(os.environ.get("N", 256)), int(os.environ.get("T", 128))
REPS = int(os.environ.get("REPS", 12))
MODEL, DTYPE = os.environ.get("MODEL"), os.environ.get("DTYPE", "bfloat16")


def main() -> None:
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(N)]
    settings = {"max_model_len": 512} if MODEL else {"max_model_len": 2048}
    if vinterp.bench.harness.device_kind() == "cuda":
        settings["gpu_memory_utilization"] = 0.2
    llm = vinterp.LLM(MODEL or vinterp.models.bundled(), dtype=DTYPE, **settings)
    walls, steps = [], []
    for i in range(REPS + 1):
        before = llm.step_stats()
        start = time.perf_counter()
        llm.generate(texts, max_tokens=T, ignore_eos=True, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.step_stats()
        ran = {k: after[k] - before[k] for k in after}
        print(f"run {i}: {wall:.3f} s, steps {ran}", flush=True)
        if i:  # the first run is the warm-up
            walls.append(wall)
            steps.append(ran.get("steps", 0))
    print(
        f"affinity {sorted(os.sched_getaffinity(0))}: wall median {statistics.median(walls):.3f} "
        f"s, range {min(walls):.3f}-{max(walls):.3f}; steps {min(steps)}-{max(steps)}; "
        f"correlation {statistics.correlation(walls, steps) if len(set(steps)) > 1 else 'n/a'}"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
