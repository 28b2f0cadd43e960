"""A traced prompt longer than one engine step (issue 52) on a GPU: a 32k-token prompt on the 8B
shape, computed by vLLM in chunks (chunked prefill), against an `enforce_eager` engine and
against plain vLLM's prefill of the same prompt.

    python3 scripts/gpu_long_prompt.py --model llama-3-8b-shape --tokens 32768 --layer 16 \\
        --json $OUT/long_prompt.json

Saves `layers[L].output[-1]` and the last token's attention-pattern row at layer L, on the
compiled engine (vLLM's defaults) and on an `enforce_eager` one; times the trace against plain
vLLM's prefill (`max_tokens=1`) of the same token ids, each engine alone on the card. On the CPU
(a rehearsal): `--model tiny --tokens 400 --max-num-batched-tokens 128`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def model_and_format(name: str) -> tuple[str, dict[str, Any]]:
    """A shape of vinterp.models.SHAPES (random weights), `tiny`, or a checkpoint path."""
    import vinterp

    if name in vinterp.models.SHAPES:
        return str(vinterp.models.shape_only(**vinterp.models.SHAPES[name])), {
            "load_format": "dummy"
        }
    if name == "tiny":
        return str(vinterp.models.tiny("llama")), {}
    return name, {}


def traced(llm: Any, ids: list[int], layer: int) -> tuple[dict[str, Any], float]:
    """The saves of one trace over `ids` and its wall time."""
    began = time.perf_counter()
    with llm.trace(ids, max_tokens=1, use_tqdm=False):
        last = llm.layers[layer].output[-1].save()
        pattern = llm.layers[layer].attn.pattern[:, -1].save()
    return {"last": last.float().cpu(), "pattern": pattern.float().cpu()}, (
        time.perf_counter() - began
    )


def rel(got: Any, want: Any) -> float:
    return float((got - want).norm() / want.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b-shape")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layer", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument(
        "--kv-cache-gb", type=float, default=None, help="a fixed KV cache (beside another engine)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()

    import torch

    import vinterp
    from vinterp.bench.workloads import plain_vllm

    model, load = model_and_format(args.model)
    settings: dict[str, Any] = {**load, "max_model_len": args.tokens + 16}
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.gpu_memory_utilization:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_gb:
        settings["kv_cache_memory_bytes"] = int(args.kv_cache_gb * 2**30)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    ids = torch.randint(
        100, vocab - 100, (args.tokens,), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.tolist()
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "layer": args.layer}
    saves: dict[str, dict[str, Any]] = {}
    for mode, eager in (("compiled", False), ("eager", True)):
        llm = vinterp.LLM(model, dtype=args.dtype, enforce_eager=eager, **settings)
        try:
            step = llm.engine.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
            result["max_num_batched_tokens"] = step
            times = []
            for _ in range(args.repeats if mode == "compiled" else 1):
                saves[mode], seconds = traced(llm, ids, args.layer)
                times.append(seconds)
            result[f"{mode}_trace_s"] = min(times)
        finally:
            llm.shutdown()
        print(json.dumps({mode: result[f"{mode}_trace_s"]}), flush=True)
    with plain_vllm(model, args.dtype, **settings) as plain:
        from vllm import SamplingParams

        prompt = {"prompt_token_ids": ids}
        once = SamplingParams(max_tokens=1)
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            plain.generate([prompt], once, use_tqdm=False)
            times.append(time.perf_counter() - began)
        result["plain_prefill_s"] = min(times)
    result["trace_vs_plain"] = result["compiled_trace_s"] / result["plain_prefill_s"]
    for name in ("last", "pattern"):
        got, want = saves["compiled"][name], saves["eager"][name]
        result[f"{name}_shape"] = list(got.shape)
        result[f"{name}_rel_to_eager"] = rel(got, want)
        result[f"{name}_finite"] = bool(torch.isfinite(got).all())
    result["pattern_row_sums_to_one"] = float(saves["compiled"]["pattern"].sum(-1).mean())
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
