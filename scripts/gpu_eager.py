"""Experiment: what an uncompiled (Python at the sites) step costs on a GPU, with vLLM's
compile-time op choices (native torch ops, as inductor wants them) and with its eager-mode
choices (vLLM's CUDA kernels, as `enforce_eager=True` runs them).

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


def install_switch(worker: Any) -> None:
    """Around the forward of an uncompiled step: CustomOps on their CUDA kernels and vLLM IR
    ops on vllm_c; a torch profile of that forward when `worker.vinterp_profile` is set."""
    import torch
    from vllm import ir
    from vllm.ir.op import IrOp
    from vllm.model_executor.custom_op import CustomOp

    runner = worker.model_runner
    runtime = runner._vinterp_runtime
    model = runner.get_model()
    custom = [
        m
        for m in model.modules()
        if isinstance(m, CustomOp) and type(m).forward_cuda is not CustomOp.forward_cuda
    ]
    ir_ops = [op for op in vars(ir.ops).values() if isinstance(op, IrOp)]
    worker.vinterp_switch = False
    worker.vinterp_profile = None
    saved: dict[str, Any] = {}

    def before(module: Any, args: Any, kwargs: Any) -> None:
        if not runtime.python_step:
            return
        if worker.vinterp_switch:
            saved["custom"] = [(m, m._forward_method) for m in custom]
            for m in custom:
                m._forward_method = m.forward_cuda
            saved["ir"] = [(op, op._priority_impls) for op in ir_ops]
            for op in ir_ops:
                providers = [p for p in ("vllm_c",) if p in op.impls and op.impls[p].supported]
                op._priority_impls = op._filter_priority_impls([*providers, "native"])
        if worker.vinterp_profile is not None:
            torch.cuda.synchronize()
            saved["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            saved["prof"].__enter__()
            saved["t"] = time.perf_counter()

    def after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if not runtime.python_step:
            return
        if "prof" in saved:
            torch.cuda.synchronize()
            wall = time.perf_counter() - saved.pop("t")
            prof = saved.pop("prof")
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            worker.vinterp_profile.append(f"forward {wall * 1e3:.1f} ms\n{table}")
        for m, method in saved.pop("custom", []):
            m._forward_method = method
        for op, impls in saved.pop("ir", []):
            op._priority_impls = impls

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def set_mode(worker: Any, switch: bool, profile: bool) -> list[str]:
    done = worker.vinterp_profile or []
    worker.vinterp_switch = switch
    worker.vinterp_profile = [] if profile else None
    return done


def main() -> None:
    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(N)]
    llm = vinterp.LLM(vinterp.models.bundled(), dtype="bfloat16", max_model_len=2048)
    rpc = llm._engine.llm.collective_rpc
    rpc(install_step_clock)
    rpc(install_switch)
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
        for switch in (False, True):
            rpc(set_mode, args=(switch, False))
            for key in chosen:
                out = run(key, f"round {rep} {'cuda-kernels' if switch else 'native-ops  '}")
                tokens[switch, key] = [o.token_ids for o in out]
    for key in chosen:
        same = sum(a == b for a, b in zip(tokens[False, key], tokens[True, key]))
        print(f"{key}: tokens equal with and without the switch in {same}/{N}")
    for switch in (False, True):
        same = sum(a == b for a, b in zip(tokens[switch, "idle"], tokens[switch, "capture_one"]))
        print(f"switch={switch}: capture_one's tokens equal idle's in {same}/{N}")
    for switch in (False, True):
        rpc(set_mode, args=(switch, True))
        run("capture_one", f"profiled switch={switch}")
        print("\n".join(rpc(set_mode, args=(switch, False))[0]), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
