"""The `vinterp` command: prepare the bundled model, run the demo."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from vinterp.bench.fastpath import WORKLOADS

DEMO_PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
]


def _prepare(_: argparse.Namespace) -> None:
    from vinterp.models import bundled

    print(f"bundled model ready at {bundled()}")


def _demo(args: argparse.Namespace) -> None:
    if not args.verbose:  # vLLM's start-up log, in this process and the engine's
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")  # inherited by the engine's processes
    import vinterp

    start = time.perf_counter()
    llm = vinterp.LLM()
    print(f"engine started in {time.perf_counter() - start:.1f} s")
    outputs = llm.generate(
        DEMO_PROMPTS, max_tokens=args.max_tokens, temperature=0.0, use_tqdm=args.verbose
    )
    print("\n== greedy completions")
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        print(f"{prompt!r} -> {out.text!r}")
    _demo_trace(llm, Path(args.out))
    _demo_steer_and_capture(llm)
    llm.shutdown()


def _demo_trace(llm: object, out_dir: Path) -> None:
    """Logit lens over the layers (printed, and drawn), then activation patching."""
    import torch

    top = lambda logits: llm.tokenizer.decode(int(logits.argmax()))  # noqa: E731
    prompt = "The capital of France is"
    print(f"\n== trace: logit lens on {prompt!r} (top token per layer)")
    with llm.trace(prompt, max_tokens=1, use_tqdm=False) as tr:
        lens = [torch.softmax(llm.unembed(layer.output), -1).max(-1) for layer in llm.layers]
        probs = [p.save() for p, _ in lens]
        tokens = [t.save() for _, t in lens]
    names = [[llm.tokenizer.decode(int(t)) for t in row] for row in tokens]
    print("  " + " | ".join(f"{i}:{row[-1]!r}" for i, row in enumerate(names) if i % 3 == 2))
    print(f"  completion: {tr.outputs[0].text!r}")
    _draw_lens(llm, prompt, torch.stack(probs), names, out_dir)
    layer = len(llm.layers) // 2
    print(f"\n== trace: patch layers[{layer}].output[-1] from France into Italy")
    with llm.trace(max_tokens=1, use_tqdm=False) as tr:
        with tr.invoke("The capital of France is"):
            clean = llm.layers[layer].output[-1].save()
        with tr.invoke("The capital of Italy is"):
            llm.layers[layer].output[-1] = clean
            patched = llm.logits.save()
    print(f"  Italy prompt, patched: top token {top(patched)!r} (saved {tuple(clean.shape)})")


def _bench(args: argparse.Namespace) -> None:
    import vinterp
    from vinterp.bench import fastpath, harness

    model = args.model or vinterp.models.bundled()
    dtype = fastpath.resolve_dtype(model, args.dtype)
    rows = fastpath.run(
        model,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        dtype=dtype,
        workloads=args.workloads,
        invokes=args.invokes,
    )
    print(harness.header())
    for row in rows:
        print(row.line())
    if args.json:
        harness.write_json(args.json, rows, harness.machine_info(dtype, model))
        print(f"rows written to {args.json}")


def _serve(args: argparse.Namespace) -> None:
    from vinterp.serve.launch import serve

    serve(args.model, args.host, args.port, args.api_key, args.rest)


def _workload_list(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown {unknown or 'empty list'}; choose from {', '.join(WORKLOADS)}"
        )
    return keys


def _draw_lens(llm: object, prompt: str, probs: object, names: list, out_dir: Path) -> None:
    try:
        from vinterp import plot

        path = plot.heatmap(
            probs.flip(0),  # last layer on top
            row_labels=[f"layer {i}" for i in reversed(range(len(names)))],
            col_labels=[llm.tokenizer.decode(t) for t in llm.tokenizer(prompt).input_ids],
            title=f"Logit lens: top token and its probability, {prompt!r}",
            path=out_dir / "logit_lens.png",
            cell_text=names[::-1],
        )
    except ImportError:  # matplotlib is the optional `plot` extra
        print("  (pip install 'vinterp[plot]' to draw the logit lens)")
        return
    print(f"  picture: {path}")


def _demo_steer_and_capture(llm: object) -> None:
    """A steering vector from a contrast of two prompts, then a capture for a probe."""
    import vinterp

    layer = 10
    cap = vinterp.Capture(f"layers.{layer}.output", positions="last_prompt")
    happy, sad = llm.generate(
        ["I feel wonderful and happy", "I feel terrible and sad"],
        max_tokens=1,
        capture=cap,
        use_tqdm=False,
    )
    site = f"layers.{layer}.output"
    direction = happy.captures[site][0] - sad.captures[site][0]
    print(f"\n== capture: {site} at the last prompt token -> {tuple(happy.captures[site].shape)}")
    steering = vinterp.Steering({site: direction}, scale=4.0)
    prompt = "Today the weather is"
    plain, steered = (
        llm.generate(prompt, max_tokens=12, steering=s, use_tqdm=False)[0] for s in (None, steering)
    )
    print(f"== steering {site} with (happy - sad) x 4:")
    print(f"  plain:   {prompt}{plain.text!r}")
    print(f"  steered: {prompt}{steered.text!r}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `vinterp` console script."""
    parser = argparse.ArgumentParser(prog="vinterp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="convert the bundled model once").set_defaults(run=_prepare)
    demo = commands.add_parser("demo", help="run the bundled model")
    demo.add_argument("--max-tokens", type=int, default=8)
    demo.add_argument("--out", default="vinterp-demo", help="where the picture goes")
    demo.add_argument("-v", "--verbose", action="store_true", help="vLLM's logs, progress bars")
    demo.set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="benchmarks against plain vLLM, same engine")
    bench.add_argument("--model", default=None, help="HF checkpoint (default: bundled)")
    bench.add_argument("--invokes", type=int, default=256)
    bench.add_argument("--prompts", type=int, default=64)
    bench.add_argument("--max-tokens", type=int, default=32)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument(
        "--dtype", default=None, help="engine dtype for vLLM and vinterp (default: checkpoint's)"
    )
    bench.add_argument(
        "--workloads",
        type=_workload_list,
        default=None,
        help=f"comma list of rows to run (default all): {', '.join(WORKLOADS)}",
    )
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    bench.set_defaults(run=_bench)
    serve = commands.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with vinterp (other flags: vLLM's)"
    )
    serve.add_argument("model", nargs="?", default=None, help="HF checkpoint (default: bundled)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="required as Bearer token on every route")
    serve.set_defaults(run=_serve)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    args.run(args)


if __name__ == "__main__":
    main()
