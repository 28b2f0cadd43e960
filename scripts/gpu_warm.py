"""Fill vLLM's compile cache for `vinterp bench`'s engines on a fresh GPU machine: one
process per engine kind, all at once. A cold compile takes 2-5 minutes per kind (docs/GPU.md),
so in sequence they pass a 10-minute call; later starts load the cache in seconds.

    python3 scripts/gpu_warm.py --dtype bfloat16 --max-model-len 2048

The engines get the bench's settings (compile cache keys ignore memory settings) and a fixed
KV cache size, which skips vLLM's memory profiling: starts running at once on one GPU would
otherwise measure each other's allocations.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

KINDS = ("plain", "vinterp", "in_graph")  # plain vLLM; vinterp default; capture_in_graph=True
GPU_SHARE = 0.2  # of the GPU's memory, per engine
KV_CACHE_BYTES = 2 << 30


def start(kind: str, model: str, dtype: str, max_model_len: int) -> None:
    """Start one engine of `kind`, generate a token, stop."""
    from vinterp.bench.workloads import plain_vllm, vinterp_engine

    settings = {
        "max_model_len": max_model_len,
        "gpu_memory_utilization": GPU_SHARE,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    began = time.perf_counter()
    if kind == "plain":
        engine = plain_vllm(model, dtype, **settings)
    else:
        engine = vinterp_engine(model, dtype, capture_in_graph=kind == "in_graph", **settings)
    with engine as llm:
        llm.generate(["The capital of France is"], use_tqdm=False)
    print(f"warm: {kind} started and ran in {time.perf_counter() - began:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF checkpoint (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {KINDS}")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's kind
    args = parser.parse_args()
    if args.one:
        start(args.one, args.model, args.dtype, args.max_model_len)
        return
    import vinterp

    model = args.model or str(vinterp.models.bundled())  # converted once, before the children
    common = ["--model", model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    children = [
        subprocess.Popen([sys.executable, __file__, *common, "--one", kind])
        for kind in args.kinds.split(",")
    ]
    failed = [child.args[-1] for child in children if child.wait() != 0]
    if failed:
        sys.exit(f"warm: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
