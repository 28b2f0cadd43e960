"""The `vinterp` command: prepare the bundled model, run the demo."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from vinterp.bench.fastpath import WORKLOADS
from vinterp.bench.peers.registry import PEERS

PEER_KEYS = tuple(peer.module for peer in PEERS)
# `vinterp bench` sizes (prompts, tokens, invokes, repeats); --quick for CI-sized runs.
FULL = {"prompts": 64, "max_tokens": 32, "invokes": 256, "repeats": 3}
QUICK = {"prompts": 16, "max_tokens": 8, "invokes": 32, "repeats": 2}

DEMO_PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
]


def _prepare(_: argparse.Namespace) -> None:
    from vinterp.models import bundled

    print(f"bundled model ready at {bundled()}")


def _quiet_logs() -> None:
    """vLLM's start-up log, in this process and the engine's (and the bench's peers')."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # inherited by the engine's processes


def _demo(args: argparse.Namespace) -> None:
    if not args.verbose:
        _quiet_logs()
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


# --capture-in-graph: the vinterp engines to time, by their capture_in_graph setting
CAPTURE_ROUTES = {"off": (False,), "on": (True,), "both": (False, True)}


def _bench(args: argparse.Namespace) -> None:
    import shlex
    import sys

    from tqdm import tqdm

    import vinterp
    from vinterp.bench import fastpath, harness, report
    from vinterp.bench.peers import suite

    if args.setup_peers:
        _setup_peers(args.peers)
        return
    if not args.verbose:
        _quiet_logs()
    model = args.model or vinterp.models.bundled()
    dtype = fastpath.resolve_dtype(model, args.dtype)
    quick = QUICK if args.quick else FULL
    size = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in quick.items()}
    workloads = list(fastpath.WORKLOADS) if args.workloads is None else args.workloads
    bar = tqdm(total=len(workloads) + len(args.peers) + bool(args.peers), desc="bench")

    def progress(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update()

    rows = fastpath.run(
        model,
        prompts=size["prompts"],
        max_tokens=size["max_tokens"],
        repeats=size["repeats"],
        dtype=dtype,
        workloads=workloads,
        invokes=size["invokes"],
        progress=progress,
        capture_in_graph=CAPTURE_ROUTES[args.capture_in_graph],
        together=args.engines == "together",
        **({"max_model_len": args.max_model_len} if args.max_model_len else {}),
    )
    peer_rows = []
    if args.peers:
        sizes = suite.QUICK if args.quick else suite.Sizes()
        peers = [peer for peer in PEERS if peer.module in args.peers]
        logs = Path(args.out) / "peer-logs" if args.out else None
        peer_rows = suite.run(model, sizes, size["repeats"], peers, progress, logs)
    bar.close()
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    result = report.Report(harness.machine_info(dtype, model), command, rows, peer_rows)
    print(report.markdown(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"rows written to {args.json}")
    if args.out:
        print("written: " + ", ".join(str(p) for p in report.write(result, args.out)))


def _setup_peers(names: list[str]) -> None:
    """(Re)build the environments of the selected peers from the package index."""
    from vinterp.bench.peers.envs import EnvError, ensure

    built: set[str] = set()
    for peer in PEERS:
        if peer.module not in names or peer.env is None or peer.env.name in built:
            continue
        built.add(peer.env.name)
        try:
            print(f"{peer.env.name}: ready at {ensure(peer.env, rebuild=True)}")
        except EnvError as exc:
            print(f"{peer.env.name}: FAILED: {exc}")


def _peer_list(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip() and k.strip() != "none"]
    unknown = [k for k in keys if k not in PEER_KEYS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(PEER_KEYS)}")
    return keys


def _serve(args: argparse.Namespace) -> None:
    from vinterp.serve.launch import serve

    serve(args.model, args.host, args.port, args.api_key, args.rest, args.capture_in_graph)


def _workload_list(text: str) -> list[str]:
    if text.strip() == "none":  # peers only
        return []
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
    bench = commands.add_parser(
        "bench", help="benchmarks against plain vLLM (same engine) and against peer tools"
    )
    bench.add_argument("--model", default=None, help="HF checkpoint (default: bundled)")
    bench.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    bench.add_argument("--invokes", type=int, default=None, help=f"default {FULL['invokes']}")
    bench.add_argument("--prompts", type=int, default=None, help=f"default {FULL['prompts']}")
    bench.add_argument("--max-tokens", type=int, default=None, help=f"default {FULL['max_tokens']}")
    bench.add_argument("--repeats", type=int, default=None, help=f"default {FULL['repeats']}")
    bench.add_argument(
        "--dtype", default=None, help="engine dtype for vLLM and vinterp (default: checkpoint's)"
    )
    bench.add_argument(
        "--workloads",
        type=_workload_list,
        default=None,
        help=f"comma list of rows to run (default all, 'none' for none): {', '.join(WORKLOADS)}",
    )
    bench.add_argument(
        "--peers",
        type=_peer_list,
        default=list(PEER_KEYS),
        help=f"comma list of peer tools (default all, 'none' for none): {', '.join(PEER_KEYS)}",
    )
    bench.add_argument(
        "--setup-peers",
        action="store_true",
        help="(re)build the peers' environments from the package index, then stop",
    )
    bench.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="every engine's (plain and vinterp); default the model's. On a GPU, 2048 starts "
        "faster than the bundled model's 8192",
    )
    bench.add_argument(
        "--capture-in-graph",
        choices=tuple(CAPTURE_ROUTES),
        default="off",
        help="the vinterp engine's capture_in_graph setting; 'both' times the vinterp rows on "
        "one engine of each, against the same plain vLLM",
    )
    bench.add_argument(
        "--engines",
        choices=("apart", "together"),
        default="apart",
        help="'apart' (default): one engine at a time; 'together': plain vLLM and the vinterp "
        "engines alive at once (GPU memory shared), every workload in each round, so slow "
        "drift of the machine reaches all alike",
    )
    bench.add_argument("--out", default=None, metavar="DIR", help="write bench.json/.md/.png")
    bench.add_argument("-v", "--verbose", action="store_true", help="vLLM's logs")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    bench.set_defaults(run=_bench)
    serve = commands.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with vinterp (other flags: vLLM's)"
    )
    serve.add_argument("model", nargs="?", default=None, help="HF checkpoint (default: bundled)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="required as Bearer token on every route")
    serve.add_argument(
        "--capture-in-graph",
        nargs="?",
        const=True,
        default=False,
        type=lambda text: [s for s in text.split(",") if s],
        metavar="SITES",
        help="capture inside the compiled model, at every site or at the comma-separated SITES "
        "(as vinterp.LLM(capture_in_graph=True or [sites]))",
    )
    serve.set_defaults(run=_serve)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    args.run(args)


if __name__ == "__main__":
    main()
