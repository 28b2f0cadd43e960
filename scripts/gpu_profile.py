"""Where vinterp's time goes on a GPU: idle, steering and capture timed interleaved on one
engine (so drift between blocks of runs cancels), then one run of each selected workload
under cProfile.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 PROF=steer,cap1,caplast REPS=5 \\
        python3 scripts/gpu_profile.py

With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core (scheduler and worker hooks) runs in
this process, so the profile sees vinterp's per-step work. N and T set prompts and tokens.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from typing import Any

import torch

import vinterp

N, T = int(os.environ.get("N", 256)), int(os.environ.get("T", 128))
REPS = int(os.environ.get("REPS", 5))


def main() -> None:
    texts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(N)]
    llm = vinterp.LLM(vinterp.models.bundled(), dtype="bfloat16", max_model_len=2048)
    v = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    site = "layers.10.output"
    workloads: dict[str, dict[str, Any]] = {
        "idle": {},
        "steer": {"steering": vinterp.Steering({site: v}, scale=4.0)},
        "cap1": {"capture": vinterp.Capture(site)},
        "caplast": {"capture": vinterp.Capture("layers.*.output", positions="last_prompt")},
    }

    def generate(kwargs: dict[str, Any]) -> None:
        llm.generate(texts, max_tokens=T, ignore_eos=True, use_tqdm=False, **kwargs)

    for kwargs in workloads.values():
        generate(kwargs)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in workloads}
    for _ in range(REPS):
        for key, kwargs in workloads.items():
            start = time.perf_counter()
            generate(kwargs)
            times[key].append(time.perf_counter() - start)
    idle = sorted(times["idle"])[REPS // 2]
    for key, runs in times.items():
        median = sorted(runs)[REPS // 2]
        print(f"{key:8s} median {median:.3f} s  x{median / idle:.3f} of idle  runs {runs}")
    for key in filter(None, os.environ.get("PROF", "").split(",")):
        profile = cProfile.Profile()
        profile.enable()
        generate(workloads[key])
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
        print(f"==== profile {key}\n{out.getvalue()}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
