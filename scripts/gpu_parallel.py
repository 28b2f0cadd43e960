"""Tensor and pipeline parallelism on the lent two-GPU machine: the same results at TP=2, PP=2
and TP=1 (vLLM defaults: compiled, CUDA graphs).

    python3 scripts/gpu_parallel.py --out DIR [--model llama1b|tiny|PATH] [--dtype bfloat16]
                                    [--stages tp1,tp2,pp2] [--keep DIR]

One engine at a time, each running the same workload: greedy tokens of the 8 prompts with and
without a middle-layer steering; every layer's output and the logits saved by one trace;
`llm.lm_head.weight[t]` for a token in the vocabulary's upper half (held by TP rank 1); a
patching trace whose value is read on layer 1 (PP stage 0) of one invoke and written at the
second-to-last layer (the last stage) of another. Then TP=2 and PP=2 are compared with TP=1
(tokens equal for at least 7 of 8 prompts, saves and patched logits within bf16's 2e-2
relative error; the numbers are printed either way) and the lm_head row with the checkpoint's,
bit for bit. Stages are kept under --keep, so they can run in separate calls. On this CPU:
`--model tiny --dtype float32`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from gpu_check import (  # noqa: E402
    MIN_EQUAL,
    PROMPTS,
    REL_TOL,
    N,
    equal,
    kept_stage,
    log,
    model_path,
    rel_err,
)

LAYOUTS: dict[str, dict[str, int]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}


def checkpoint_row(path: Path, token: int) -> torch.Tensor:
    """Row `token` of the checkpoint's output embedding (the input embedding where tied)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in f.keys():
                    found[name] = f.get_slice(name)[token]
    return found.get("lm_head.weight", found.get("model.embed_tokens.weight"))


def workload(llm: Any, norm: float | None) -> dict[str, Any]:
    """Everything one engine runs; the steering vector's norm is `norm`, else the middle
    layer's residual norm at the first prompt's last token (TP=1's is reused by the others)."""
    import vinterp

    layers = len(llm.layers)
    mid = layers // 2
    upper = int(llm.config.vocab_size) * 3 // 4
    with llm.trace(PROMPTS[0], max_tokens=1):
        saves = [layer.output.save() for layer in llm.layers]
        logits = llm.logits.save()
        row = llm.lm_head.weight[upper].save()
    if norm is None:
        norm = float(saves[mid][-1].float().norm())
    unit = torch.randn(int(llm.config.hidden_size), generator=torch.Generator().manual_seed(0))
    steering = vinterp.Steering({f"layers.{mid}.output": unit / unit.norm() * norm}, scale=4.0)

    def tokens(**kwargs: Any) -> list[list[int]]:
        return [list(o.token_ids) for o in llm.generate(PROMPTS, max_tokens=16, **kwargs)]

    with llm.trace(max_tokens=1) as tr:
        with tr.invoke(PROMPTS[0]):
            source = llm.layers[1].output[-1]
        with tr.invoke(PROMPTS[7]):
            llm.layers[layers - 2].output[-1] = source
            patched = llm.logits.save()
        with tr.invoke(PROMPTS[7]):
            unpatched = llm.logits.save()
    cpu = lambda t: t.float().cpu()  # noqa: E731
    return {
        "norm": norm,
        "upper_token": upper,
        "saves": [cpu(s) for s in saves],
        "logits": cpu(logits),
        "lm_head_row": row.cpu(),
        "patched_logits": cpu(patched),
        "unpatched_logits": cpu(unpatched),
        "tokens": {"unsteered": tokens(), "steered": tokens(steering=steering)},
    }


def run_layout(path: Path, dtype: str, norm: float | None, layout: dict[str, int]) -> Any:
    """Start vinterp.LLM with `layout`, run the workload, shut it down and free GPU memory."""
    import vinterp
    from vinterp.bench.harness import free_memory

    llm = vinterp.LLM(path, dtype=dtype, **layout)
    try:
        return workload(llm, norm)
    finally:
        llm.shutdown()
        free_memory()


def compare(path: Path, results: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(check, numbers, ok) rows: every layout against the checkpoint, the others against TP=1."""
    checks: list[tuple[str, str, bool]] = []
    add = lambda *row: checks.append(row)  # noqa: E731
    for tag, r in results.items():
        t = r["tokens"]
        differ = N - equal(t["steered"], t["unsteered"])
        add(f"{tag} steered differs from unsteered", f"{differ}/{N}", differ > 0)
        want = checkpoint_row(path, r["upper_token"]).to(r["lm_head_row"].dtype)
        same = torch.equal(r["lm_head_row"], want)
        add(f"{tag} lm_head.weight[{r['upper_token']}] == checkpoint row", str(same), same)
        moved = float((r["patched_logits"] - r["unpatched_logits"]).abs().max())
        add(f"{tag} cross-stage patch changes logits (max abs)", f"{moved:.3g}", moved > 0)
    base = results.get("tp1")
    for tag, r in results.items():
        if base is None or r is base:
            continue
        for name in ("unsteered", "steered"):
            k = equal(r["tokens"][name], base["tokens"][name])
            add(f"tokens {name}: {tag} == tp1", f"{k}/{N}", k >= MIN_EQUAL)
        errs = [rel_err(a, b) for a, b in zip(r["saves"], base["saves"])]
        worst = max(range(len(errs)), key=errs.__getitem__)
        add(
            f"{tag} layer outputs: max rel err (layer)",
            f"{errs[worst]:.2e} ({worst})",
            errs[worst] < REL_TOL,
        )
        for name in ("logits", "patched_logits"):
            err = rel_err(r[name], base[name])
            add(f"{tag} {name}: rel err", f"{err:.2e}", err < REL_TOL)
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama1b", help="llama1b, tiny or a checkpoint path")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", default=",".join(LAYOUTS))
    parser.add_argument("--keep", type=Path, default=Path("/tmp/gpu_parallel"))
    args = parser.parse_args()
    stages = [s for s in args.stages.split(",") if s]  # none: compare the kept stages
    if unknown := set(stages) - set(LAYOUTS):
        parser.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    import vinterp
    from vinterp.bench.harness import machine_info

    if args.model == "tiny":
        path = vinterp.models.tiny("llama")
    elif args.model == "llama1b":
        path = model_path("llama1b")
    else:
        path = Path(args.model)
    args.keep.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    results: dict[str, Any] = {}
    for tag, layout in LAYOUTS.items():
        file = args.keep / f"{path.name}-{args.dtype}-{tag}.pt"
        norm = results["tp1"]["norm"] if "tp1" in results else None
        run = partial(run_layout, path, args.dtype, norm, layout)
        result = kept_stage(file, tag in stages, f"{tag}: {layout or 'one worker'}", errors, run)
        if result is not None:
            results[tag] = result
    checks = compare(path, results)
    log(f"\n{'check':<58} {'numbers':>18}  ok")
    for check, numbers, ok in checks:
        log(f"{check:<58} {numbers:>18}  {'ok' if ok else 'NOT OK'}")
    failed = [c for c, _, ok in checks if not ok]
    log(f"\n{len(checks) - len(failed)}/{len(checks)} checks ok; engine errors: {sorted(errors)}")
    doc = {
        "machine": machine_info(args.dtype, path),
        "checks": [{"check": c, "numbers": n, "ok": ok} for c, n, ok in checks],
        "tokens": {tag: r["tokens"] for tag, r in results.items()},
        "errors": errors,
    }
    (args.out / "gpu_parallel.json").write_text(json.dumps(doc, indent=2) + "\n")
    log(f"written {args.out / 'gpu_parallel.json'}")


if __name__ == "__main__":
    main()
