"""Where vinterp's time goes on a GPU: `vinterp bench`'s workloads timed interleaved on one
engine (so drift between blocks of runs cancels), then one run of each selected workload
under cProfile.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 PROF=steer,capture_one,capture_layers_last REPS=5 \\
        python3 scripts/gpu_profile.py

With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core (scheduler and worker hooks) runs in
this process, so the profile sees vinterp's per-step work. N and T set prompts and tokens,
WORKLOADS the bench keys to time (the first one is the reference of the ratios), DTYPE and
MAX_MODEL_LEN the engine's (the peer bench's engine: DTYPE=float32 MAX_MODEL_LEN=0, the model's).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats

import vinterp
from vinterp.bench.fastpath import PROMPT_TEMPLATE, vinterp_workloads
from vinterp.bench.harness import timed_interleaved

N, T = int(os.environ.get("N", 256)), int(os.environ.get("T", 128))
REPS = int(os.environ.get("REPS", 5))
KEYS = os.environ.get("WORKLOADS", "idle,steer,capture_one,capture_layers_last").split(",")
DTYPE = os.environ.get("DTYPE", "bfloat16")
MAX_MODEL_LEN = int(os.environ.get("MAX_MODEL_LEN", 2048)) or None


def main() -> None:
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(N)]
    llm = vinterp.LLM(vinterp.models.bundled(), dtype=DTYPE, max_model_len=MAX_MODEL_LEN)
    chosen = {key: kwargs for key, _, kwargs in vinterp_workloads(llm) if key in KEYS}

    def run(key: str) -> None:
        llm.generate(texts, max_tokens=T, ignore_eos=True, use_tqdm=False, **chosen[key])

    timings = timed_interleaved({key: lambda key=key: run(key) for key in chosen}, REPS)
    reference = timings[KEYS[0]].median
    for key, timing in timings.items():
        print(
            f"{key:20s} median {timing.median:.3f} s  x{timing.median / reference:.3f} of "
            f"{KEYS[0]}  runs {[round(t, 3) for t in timing.times]}"
        )
    for key in filter(None, os.environ.get("PROF", "").split(",")):
        profile = cProfile.Profile()
        profile.enable()
        run(key)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(
            int(os.environ.get("TOP", 30))
        )
        print(f"==== profile {key}\n{out.getvalue()}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
