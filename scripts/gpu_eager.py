"""What an uncompiled (Python at the sites) step costs on a GPU, and what it does to tokens:
the step clock and a torch profile of a capturing run's uncompiled forwards, and a capture's
greedy tokens against an idle run's. Such steps run on the kernels of vLLM's eager mode
(engine/eager_kernels.py, thirteenth session); the eleventh session's numbers for the native
ops they ran before are in docs/GPU.md.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \\
        python3 scripts/gpu_eager.py
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from gpu_steps import describe, install_step_clock, take_step_log  # noqa: E402

import vinterp  # noqa: E402
from vinterp.bench.fastpath import PROMPT_TEMPLATE, vinterp_workloads  # noqa: E402

N, T = int(os.environ.get("N", 256)), int(os.environ.get("T", 128))
REPS = int(os.environ.get("REPS", 3))


def install_profile(worker: Any) -> None:
    """A torch profile of each uncompiled forward while `worker.vinterp_profile` is a list."""
    import torch

    runtime = worker.model_runner._vinterp_runtime
    model = worker.model_runner.get_model()
    worker.vinterp_profile = None
    saved: dict[str, Any] = {}

    def before(module: Any, args: Any, kwargs: Any) -> None:
        if runtime.python_step and worker.vinterp_profile is not None:
            torch.cuda.synchronize()
            saved["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            saved["prof"].__enter__()
            saved["t"] = time.perf_counter()

    def after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if "prof" in saved:
            torch.cuda.synchronize()
            wall = time.perf_counter() - saved.pop("t")
            prof = saved.pop("prof")
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            worker.vinterp_profile.append(f"forward {wall * 1e3:.1f} ms\n{table}")

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def set_profile(worker: Any, profile: bool) -> list[str]:
    done = worker.vinterp_profile or []
    worker.vinterp_profile = [] if profile else None
    return done


def main() -> None:
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(N)]
    llm = vinterp.LLM(vinterp.models.bundled(), dtype="bfloat16", max_model_len=2048)
    rpc = llm._engine.llm.collective_rpc
    rpc(install_step_clock)
    rpc(install_profile)
    chosen = {k: kw for k, _, kw in vinterp_workloads(llm) if k in ("idle", "capture_one")}

    def run(key: str, label: str) -> list[Any]:
        rpc(take_step_log)
        start = time.perf_counter()
        outputs = llm.generate(texts, max_tokens=T, ignore_eos=True, use_tqdm=False, **chosen[key])
        wall = time.perf_counter() - start
        print(f"{label} {key:12s} {describe(rpc(take_step_log)[0], wall)}", flush=True)
        return outputs

    tokens = {}
    for rep in range(REPS + 1):
        for key in chosen:
            tokens[key] = [o.token_ids for o in run(key, f"round {rep}")]
    same = sum(a == b for a, b in zip(tokens["idle"], tokens["capture_one"]))
    print(f"capture_one's tokens equal idle's in {same}/{N}")
    rpc(set_profile, args=(True,))
    run("capture_one", "profiled")
    print("\n".join(rpc(set_profile, args=(False,))[0]), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
