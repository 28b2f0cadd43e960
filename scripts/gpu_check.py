"""Check vinterp under CUDA graphs against an eager engine, on the lent GPU machine.

    python scripts/gpu_check.py --model bundled|llama1b --out DIR [--runner v1|v2]
                                [--stages plain,plain_eager,A,B,C] [--keep DIR]
                                [--check-applied]

Each stage's results are kept under --keep (default /tmp/gpu_check/MODEL-RUNNER), so the
stages can run in separate calls (each engine start costs a minute or more) and be compared
by the last one.

One engine at a time: plain vLLM (no vinterp) compiled and with enforce_eager=True (vLLM's own
graphs-vs-eager difference, the yardstick for A vs B), then vinterp compiled with CUDA graphs
(A), then vinterp with enforce_eager=True (B), then (stage C, not by default) vinterp with
CUDA graphs and `capture_in_graph=True`, all in bfloat16. A, B and C run the same workload
(steering, capture, traces, timings); the script prints a comparison table (A and C against
B) and writes DIR/gpu_check.json.
bf16 tolerance: captures and saves within 2e-2 relative error, greedy tokens equal for at least
7 of 8 prompts (one late token may flip); the numbers are printed either way.
With --check-applied every vinterp engine counts on the GPU what its site ops applied, inside
the replayed graphs, and raises where a step applied less than it asked for (an engine error
in the table); its timings then include a wait per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPE = "bfloat16"
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def fibonacci(n):",
    "The three primary colors are",
    "Researchers read the residual stream to",
    "Numbers 0 1 2 3 4 5",
    "A good recipe for bread needs",
    "The capital of Italy is",
]
N = len(PROMPTS)
REL_TOL = 2e-2
MIN_EQUAL = 7  # of 8 prompts
LAST = "layers.*.output last_prompt"
STEERED = ("steered", "named", "global", "norm_match", "decode")


def log(msg: str) -> None:
    print(msg, flush=True)


def model_path(name: str) -> Path:
    import vinterp

    if name == "bundled":
        return vinterp.models.bundled()
    # A random Llama of ~1B parameters (head size 64) with the tiny models' vocab and tokenizer.
    return vinterp.models.tiny(
        "llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,  # room for --max-model-len (the tiny default is 512)
    )


def capture_specs(site: str) -> dict[str, Any]:
    import vinterp

    return {
        LAST: vinterp.Capture(["layers.*.output"], positions="last_prompt"),
        f"{site} all": vinterp.Capture(site, positions="all"),
    }


def run_captures(llm: Any, site: str) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Per capture kind, per prompt: {site: float32 CPU tensor}."""
    return {
        name: [
            {s: t.float().cpu() for s, t in o.captures.items()}
            for o in llm.generate(PROMPTS, max_tokens=8, capture=cap)
        ]
        for name, cap in capture_specs(site).items()
    }


def run_steering(llm: Any, st: Any) -> dict[str, list[list[int]]]:
    """Greedy 16-token ids of the 8 prompts, unsteered and steered every supported way."""
    import vinterp

    def gen(prompts: list[Any], **kwargs: Any) -> list[list[int]]:
        return [list(o.token_ids) for o in llm.generate(prompts, max_tokens=16, **kwargs)]

    tokens = {"unsteered": gen(PROMPTS)}
    before = llm.step_stats()
    tokens["steered"] = gen(PROMPTS, steering=st)
    after = llm.step_stats()
    log(
        f"  steered generate: {after['steps'] - before['steps']} steps, "
        f"{after['uncompiled_steps'] - before['uncompiled_steps']} of them uncompiled"
    )
    mixed = [vinterp.Request(p, steering=st) if i % 2 == 0 else p for i, p in enumerate(PROMPTS)]
    tokens["mixed"] = gen(mixed)
    llm.steering.register("s", st)
    tokens["named"] = gen(PROMPTS, steering="s")
    llm.steering.set(st)
    tokens["global"] = gen(PROMPTS)
    llm.steering.clear()
    tokens["cleared"] = gen(PROMPTS)
    norm_match = st.model_copy(update={"scale": 0.5, "norm_match": True})
    tokens["norm_match"] = gen(PROMPTS, steering=norm_match)
    tokens["decode"] = gen(PROMPTS, steering=st.model_copy(update={"phase": "decode"}))
    return tokens


def run_traces(llm: Any, mid: int, v: torch.Tensor) -> dict[str, Any]:
    """Saves of a read trace, a written one, a tr.iter[:] trace and a patching trace."""
    with llm.trace(PROMPTS[0], max_tokens=1):
        h = llm.layers[mid].output.save()
        logits = llm.logits.save()
    with llm.trace(PROMPTS[0], max_tokens=1):
        llm.layers[mid].output[-1] += 8.0 * v
        written = llm.logits.save()
    with llm.trace(PROMPTS[1], max_tokens=4) as tr:
        for _ in tr.iter[:]:
            llm.layers[mid].output = llm.layers[mid].output + v
            samples = llm.samples.save()
    with llm.trace(max_tokens=1) as tr:
        with tr.invoke("The capital of France is"):
            clean = llm.layers[mid].output[-1].save()
        with tr.invoke("The capital of Italy is"):
            llm.layers[mid].output[-1] = clean
            patched = llm.logits.save()
    saved = {"h": h, "logits": logits, "written_logits": written, "patched_logits": patched}
    return {**{k: t.float().cpu() for k, t in saved.items()}, "samples": [int(s) for s in samples]}


def run_timings(llm: Any, st: Any, site: str) -> dict[str, float]:
    """Wall seconds of 64 prompts x 64 tokens after one warm-up (informational)."""
    from vinterp.bench.fastpath import PROMPT_TEMPLATE
    from vinterp.bench.harness import best_time

    texts = [PROMPT_TEMPLATE.format(i=i) for i in range(64)]
    kinds = {"none": {}, "steering": {"steering": st}, LAST: {"capture": capture_specs(site)[LAST]}}
    return {
        name: best_time(lambda kw=kw: llm.generate(texts, max_tokens=64, ignore_eos=True, **kw), 1)
        for name, kw in kinds.items()
    }


def workload(llm: Any, norm: float | None) -> dict[str, Any]:
    """Everything one engine runs; the steering vector's norm is `norm`, else the mean
    residual norm at the middle layer's last prompt token (engine A's is reused by B)."""
    import vinterp

    mid = len(llm.layers) // 2
    site = f"layers.{mid}.output"
    result: dict[str, Any] = {"captures": run_captures(llm, site)}
    if norm is None:
        norm = float(torch.cat([c[site] for c in result["captures"][LAST]]).norm(dim=-1).mean())
    unit = torch.randn(int(llm.config.hidden_size), generator=torch.Generator().manual_seed(0))
    v = unit / unit.norm() * norm
    log(f"  steering vector: unit x mean residual norm {norm:.3f} at {site}")
    st = vinterp.Steering({site: v}, scale=8.0)
    result.update(norm=norm, tokens=run_steering(llm, st), traces=run_traces(llm, mid, v))
    result["timing_s"] = run_timings(llm, st, site)
    return result


def vinterp_engine(path: Path, norm: float | None, **engine_kwargs: Any) -> dict[str, Any]:
    """Start vinterp.LLM, run the workload, shut the engine down and free GPU memory."""
    import vinterp
    from vinterp.bench.harness import free_memory

    start = time.perf_counter()
    llm = vinterp.LLM(path, dtype=DTYPE, **engine_kwargs)
    log(f"  started in {time.perf_counter() - start:.1f} s")
    try:
        return workload(llm, norm)
    finally:
        llm.shutdown()
        free_memory()


def plain_tokens(path: Path, **engine_kwargs: Any) -> list[list[int]]:
    """Greedy 16-token ids of the 8 prompts from plain vLLM (no vinterp in the engine)."""
    import vllm
    from transformers import AutoTokenizer

    from vinterp.bench.fastpath import plain_vllm

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [{"prompt_token_ids": tokenizer(p).input_ids} for p in PROMPTS]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16)
    with plain_vllm(path, DTYPE, **engine_kwargs) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def equal(a: list[Any], b: list[Any]) -> int:
    return sum(x == y for x, y in zip(a, b))


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(a: dict[str, Any], b: dict[str, Any], tag_a: str = "A") -> list[tuple[str, str, bool]]:
    """(check, numbers, ok) rows for engine A (CUDA graphs; or C) against B (eager)."""
    checks: list[tuple[str, str, bool]] = []
    add = lambda *row: checks.append(row)  # noqa: E731
    for name in a["tokens"]:
        k = equal(a["tokens"][name], b["tokens"][name])
        add(f"tokens {name}: {tag_a} == B", f"{k}/{N}", k >= MIN_EQUAL)
    for name in STEERED:
        diff = [N - equal(r["tokens"][name], r["tokens"]["unsteered"]) for r in (a, b)]
        add(f"{name} differs from unsteered ({tag_a}, B)", f"{diff[0]}, {diff[1]}", min(diff) > 0)
    for tag, r in ((tag_a, a), ("B", b)):
        t = r["tokens"]
        for half, rows in (("unsteered", slice(1, None, 2)), ("steered", slice(0, None, 2))):
            k = equal(t["mixed"][rows], t[half][rows])
            add(f"{tag} mixed batch: {half} half == {half} run", f"{k}/{N // 2}", k == N // 2)
        k = equal(t["cleared"], t["unsteered"])
        add(f"{tag} after steering.clear() == unsteered", f"{k}/{N}", k == N)
        written = float((r["traces"]["written_logits"] - r["traces"]["logits"]).abs().max())
        add(f"{tag} trace write changes logits (max abs)", f"{written:.3g}", written > 0)
    for name, ca in a["captures"].items():
        pairs = [(x.get(s), y[s]) for x, y in zip(ca, b["captures"][name]) for s in y]
        same = all(x is not None and x.shape == y.shape for x, y in pairs)
        err = max((rel_err(x, y) for x, y in pairs), default=math.inf)
        numbers, ok = f"{same}, {err:.2e}", same and err < REL_TOL
        add(f"{tag_a} capture {name}: shapes, max rel err", numbers, ok)
    for name in ("h", "logits", "written_logits", "patched_logits"):
        err = rel_err(a["traces"][name], b["traces"][name])
        add(f"{tag_a} trace save {name}: rel err", f"{err:.2e}", err < REL_TOL)
    k = equal(a["traces"]["samples"], b["traces"]["samples"])
    add(f"trace tr.iter[:] samples: {tag_a} == B", f"{k}/4", k == 4)
    return checks


def stage(name: str, errors: dict[str, str], fn: Callable[[], Any]) -> Any:
    """Run one engine's part; on failure log the traceback, record it and return None."""
    log(f"== {name}")
    try:
        return fn()
    except Exception:
        errors[name] = traceback.format_exc()
        log(errors[name])
        return None


def kept_stage(
    file: Path, run: bool, name: str, errors: dict[str, str], fn: Callable[[], Any]
) -> Any:
    """Run a stage and keep its result in `file`; when not run, what an earlier call kept
    there (None if nothing)."""
    if run:
        result = stage(name, errors, fn)
        if result is not None:
            torch.save(result, file)
        return result
    return torch.load(file) if file.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bundled", "llama1b"), default="bundled")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runner", choices=("v1", "v2"), default=None, help="default: vLLM's")
    parser.add_argument("--stages", default="plain,plain_eager,A,B")
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument(
        "--check-applied", action="store_true", help="vinterp engines check what they applied"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="every engine's (the prompts are short; the bundled model's own is 8192)",
    )
    args = parser.parse_args()
    keep = args.keep or Path(f"/tmp/gpu_check/{args.model}-{args.runner or 'default'}")
    keep.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(","))
    if args.runner == "v1":  # before vllm is imported (vinterp imports it lazily)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if args.check_applied:
        os.environ["VINTERP_CHECK_APPLIED"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    from vinterp.bench.harness import machine_info

    path = model_path(args.model)
    errors: dict[str, str] = {}

    def kept(tag: str, name: str, fn: Callable[[], Any]) -> Any:
        return kept_stage(keep / f"{tag}.pt", tag in stages, name, errors, fn)

    sized = {"max_model_len": args.max_model_len}
    plain = kept("plain", "plain vLLM", lambda: plain_tokens(path, **sized))
    plain_eager = kept(
        "plain_eager",
        "plain vLLM, enforce_eager",
        lambda: plain_tokens(path, enforce_eager=True, **sized),
    )
    a = kept("A", "A: vinterp, CUDA graphs", lambda: vinterp_engine(path, None, **sized))
    norm = a["norm"] if a else None
    b = kept(
        "B",
        "B: vinterp, enforce_eager",
        lambda: vinterp_engine(path, norm, enforce_eager=True, **sized),
    )

    c = kept(
        "C",
        "C: vinterp, CUDA graphs, capture_in_graph=True",
        lambda: vinterp_engine(path, norm, capture_in_graph=True, **sized),
    )

    checks = compare(a, b) if a and b else []
    if c and b:  # B's own rows are already there
        checks += [row for row in compare(c, b, "C") if row not in checks]
    if plain and plain_eager:  # vLLM's own graphs-vs-eager difference: the yardstick for A vs B
        k = equal(plain, plain_eager)
        checks.append(("plain vLLM: graphs == enforce_eager", f"{k}/{N}", k >= MIN_EQUAL))
    engines = (("A", a), ("B", b), ("C", c))
    for tag, r in engines:
        if plain and r:
            k = equal(r["tokens"]["unsteered"], plain)
            checks.append((f"{tag} unsteered == plain vLLM", f"{k}/{N}", k >= MIN_EQUAL))
    log(f"\n{'check':<58} {'numbers':>18}  ok")
    for check, numbers, ok in checks:
        log(f"{check:<58} {numbers:>18}  {'ok' if ok else 'NOT OK'}")
    timing = {tag: r["timing_s"] for tag, r in engines if r}
    log(f"\n{'64 prompts x 64 tokens':<40} " + " ".join(f"{t:>9}" for t in timing))
    for name in next(iter(timing.values()), {}):
        log(f"{name:<40} " + " ".join(f"{timing[t][name]:8.3f}s" for t in timing))
    failed = [c for c, _, ok in checks if not ok]
    log(f"\n{len(checks) - len(failed)}/{len(checks)} checks ok; engine errors: {sorted(errors)}")
    doc = {
        "machine": {
            **machine_info(DTYPE, path),
            "runner": args.runner or "vllm default",
            "check_applied": args.check_applied,
        },
        "checks": [{"check": c, "numbers": n, "ok": ok} for c, n, ok in checks],
        "timing_s": timing,
        "norm": norm,
        "tokens": {
            "plain": plain,
            "plain_eager": plain_eager,
            **{t: r["tokens"] for t, r in engines if r},
        },
        "errors": errors,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")
    log(f"written {args.out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
