"""The `vinterp` command: prepare the bundled model, run the demo."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vinterp.bench import extract_pipeline, serve_load, step_cost
from vinterp.bench.extraction import PROMPT_TOKENS
from vinterp.bench.peers.registry import PEERS
from vinterp.bench.workloads import ON_REQUEST, SELECTABLE
from vinterp.extraction.request import BUFFER_GB
from vinterp.models.tiny import SHAPES
from vinterp.serve.client_limits import ServeLimits

SHAPE_NAMES = tuple(SHAPES)

PEER_KEYS = tuple(peer.module for peer in PEERS)
# `vinterp bench` sizes (prompts, tokens, invokes, repeats); --quick for CI-sized runs.
FULL = {"prompts": 64, "max_tokens": 32, "invokes": 256, "repeats": 3}
QUICK = {"prompts": 16, "max_tokens": 8, "invokes": 32, "repeats": 2}
# serve_load: seconds of the mixed load, and of each server's plain + streaming comparison
SERVE_FULL = {
    "serve_seconds": serve_load.SECONDS,
    "serve_compare_seconds": serve_load.COMPARE_SECONDS,
}
SERVE_QUICK = {"serve_seconds": 60, "serve_compare_seconds": 30}
SERVE_USAGE = "%(prog)s [MODEL] [options below] [vLLM serve flags, --model MODEL among them]"


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
    from vinterp import demo

    demo.main(args.max_tokens, args.verbose)


# --capture-in-graph: the vinterp engines to time, by their capture_in_graph setting
CAPTURE_ROUTES = {"off": (False,), "on": (True,), "both": (False, True)}


def _bench(args: argparse.Namespace) -> None:
    import shlex
    import sys

    from tqdm import tqdm

    from vinterp.bench import extraction, harness, report
    from vinterp.bench import workloads as engine_workloads
    from vinterp.bench.peers import suite

    if args.setup_peers:
        _setup_peers(list(PEER_KEYS) if args.peers is None else args.peers)
        return
    if not args.verbose:
        _quiet_logs()
    model, load_format = _bench_model(args.model, args.load_format)
    peer_keys = args.peers
    if peer_keys is None:  # the peers load weights: none for a shape without them
        peer_keys = [] if load_format == "dummy" else list(PEER_KEYS)
    engine_kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if load_format:
        engine_kwargs["load_format"] = load_format
    if args.tensor_parallel_size:
        engine_kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.gpu_memory_utilization:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_memory_bytes:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    dtype = engine_workloads.resolve_dtype(model, args.dtype)
    quick = QUICK if args.quick else FULL
    size = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in quick.items()}
    workloads = args.workloads
    if workloads is None:  # a shape without weights: the rows that take load_format
        dummy = load_format == "dummy"
        workloads = list(engine_workloads.EXTRACTION if dummy else engine_workloads.WORKLOADS)
    bar = tqdm(total=len(workloads) + len(peer_keys) + bool(peer_keys), desc="bench")

    def progress(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update()

    rows = engine_workloads.run(
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
        **engine_kwargs,
    )
    rows += extraction.run(
        model,
        prompts=size["prompts"],
        prompt_tokens=args.prompt_tokens,
        repeats=size["repeats"],
        dtype=dtype,
        selected=set(workloads),
        extract_dir=args.extract_dir,
        progress=progress,
        **engine_kwargs,
    )
    if extract_pipeline.KEY in workloads:
        rows += extract_pipeline.run(args.extract_dir, repeats=size["repeats"])
        progress(extract_pipeline.KEY)
    if step_cost.KEY in workloads:
        rows += step_cost.run(repeats=size["repeats"])
        progress(step_cost.KEY)
    details = {}
    if serve_load.KEY in workloads:
        serve_rows, details[serve_load.KEY] = _serve_load(args, str(model), engine_kwargs)
        rows += serve_rows
        progress(serve_load.KEY)
    peer_rows = []
    if peer_keys:
        sizes = suite.QUICK if args.quick else suite.Sizes()
        peers = [peer for peer in PEERS if peer.module in peer_keys]
        logs = Path(args.out) / "peer-logs" if args.out else None
        peer_rows = suite.run(model, sizes, size["repeats"], peers, progress, logs)
    bar.close()
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    result = report.Report(harness.machine_info(dtype, model), command, rows, peer_rows, details)
    print(report.markdown(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"rows written to {args.json}")
    if args.out:
        print("written: " + ", ".join(str(p) for p in report.write(result, args.out)))


def _serve_load(args: argparse.Namespace, model: str, engine_kwargs: dict) -> tuple[list, dict]:
    """The serve_load workload: its servers get --serve-args plus the engine options the
    other rows' engines get."""
    import shlex

    flags = shlex.split(args.serve_args)
    for keyword, value in {**engine_kwargs, "dtype": args.dtype}.items():
        if value is not None:
            flags += [f"--{keyword.replace('_', '-')}", str(value)]
    size = SERVE_QUICK if args.quick else SERVE_FULL
    seconds, compare = (
        v if getattr(args, k) is None else getattr(args, k) for k, v in size.items()
    )
    clients = args.serve_clients or serve_load.default_clients()
    return serve_load.run(model, clients, seconds, compare, flags)


def _bench_model(name: str | None, load_format: str | None) -> tuple[str | Path, str | None]:
    """The checkpoint and load format of `vinterp bench --model`: a shape of
    vinterp.models.SHAPES (config and tokenizer only, random weights: load_format "dummy"),
    a checkpoint, or the bundled model."""
    import vinterp

    if name in vinterp.models.SHAPES:
        if load_format not in (None, "dummy"):
            raise SystemExit(f"--model {name} has no weights: it runs with --load-format dummy")
        return vinterp.models.shape_only(**vinterp.models.SHAPES[name]), "dummy"
    return name or vinterp.models.bundled(), load_format


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
    """`args.rest`: the model and vLLM's flags, read as `vllm serve` reads them."""
    from vinterp.serve import launch
    from vinterp.serve.client_limits import to_environment

    given = {
        "body_bytes": args.max_body_mb and args.max_body_mb << 20,
        "body_seconds": args.max_body_seconds,
        "nodes": args.max_trace_nodes,
        "invokes": args.max_trace_invokes,
        "max_tokens": args.max_trace_tokens,
        "traces_per_key": args.max_traces_per_key,
    }
    to_environment(ServeLimits(**{k: v for k, v in given.items() if v is not None}))

    model, rest = launch.split_model(args.rest)
    launch.serve(
        model, args.host, args.port, args.api_key, rest, args.capture_in_graph, args.probe_sites
    )


def _extract(args: argparse.Namespace) -> None:
    """Bad input (prompts, positions, sites, a folder of another spec, a full disk, more GPUs
    than Ray sees) ends the command with one line naming it; the prompts and positions are
    checked before any engine starts."""
    if not args.verbose:
        _quiet_logs()
    import vinterp
    from vinterp.errors import VinterpError
    from vinterp.extraction.plan import check_positions

    engine = {
        keyword: getattr(args, name)
        for name, keyword in EXTRACT_ENGINE_ARGS.items()
        if getattr(args, name) is not None
    }
    try:
        check_positions(args.positions, args.skip_first)
        model = args.model or vinterp.models.bundled()
        prompts = _prompts(model, args)
        vinterp.extract(
            model,
            prompts,
            args.sites,
            out=args.out,
            positions=args.positions,
            data_parallel_size=args.data_parallel,
            ray_address=args.ray_address,
            dtype=args.dtype,
            skip_first=args.skip_first,
            column=args.column,
            buffer_gb=args.buffer_gb,
            saes=dict(args.sae),
            topk=args.topk,
            stop_at_deepest=args.stop_at_deepest,
            **engine,
        )
    except (VinterpError, ValueError, TypeError, FileNotFoundError) as exc:
        raise SystemExit(f"vinterp extract: {exc}") from None


def _prompts(model: object, args: argparse.Namespace) -> object:
    """`--prompts`, checked (and packed with the model's tokenizer) before any engine starts."""
    from vinterp.extraction.prompts import prompt_source

    if args.context_size is None:
        return prompt_source(args.prompts, args.column)
    from transformers import AutoTokenizer

    from vinterp.extraction.packing import Packed

    packed = Packed(args.prompts, args.context_size, args.column, args.bos)
    return prompt_source(packed, tokenizer=AutoTokenizer.from_pretrained(str(model)))


# `vinterp extract` options that go to the engine (argparse name -> vinterp.LLM keyword)
EXTRACT_ENGINE_ARGS = {
    "max_model_len": "max_model_len",
    "tensor_parallel_size": "tensor_parallel_size",
    "engine_dtype": "engine_dtype",
}


def _sae(text: str) -> tuple[str, str]:
    """SITE=DIR: an SAE directory (SAELens's format) to attach at a host site."""
    site, equals, folder = text.partition("=")
    if not (equals and site and folder):
        raise argparse.ArgumentTypeError(
            f"expected SITE=DIR, e.g. layers.10.output=./sae, got {text!r}"
        )
    return site, folder


def _positions(text: str) -> str | list[int]:
    """all_prompt, last_prompt, or comma-separated prompt positions."""
    if text in ("all_prompt", "last_prompt"):
        return text
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            "expected all_prompt, last_prompt or positions like 0,5,9"
        ) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}")
    return value


def _workload_list(text: str) -> list[str]:
    if text.strip() == "none":  # peers only
        return []
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SELECTABLE]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown {unknown or 'empty list'}; choose from {', '.join(SELECTABLE)}"
        )
    return keys


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `vinterp` console script."""
    parser = argparse.ArgumentParser(prog="vinterp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="convert the bundled model once").set_defaults(run=_prepare)
    demo = commands.add_parser("demo", help="run the bundled model")
    demo.add_argument("--max-tokens", type=int, default=8)
    demo.add_argument("-v", "--verbose", action="store_true", help="vLLM's logs, progress bars")
    demo.set_defaults(run=_demo)
    bench = commands.add_parser(
        "bench", help="benchmarks against plain vLLM (same engine) and against peer tools"
    )
    bench.add_argument(
        "--model",
        default=None,
        help="HF checkpoint (default: bundled), or a model shape without weights (random "
        f"weights, --load-format dummy): {', '.join(SHAPE_NAMES)}",
    )
    bench.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    bench.add_argument("--invokes", type=int, default=None, help=f"default {FULL['invokes']}")
    bench.add_argument("--prompts", type=int, default=None, help=f"default {FULL['prompts']}")
    bench.add_argument("--max-tokens", type=int, default=None, help=f"default {FULL['max_tokens']}")
    bench.add_argument("--repeats", type=int, default=None, help=f"default {FULL['repeats']}")
    bench.add_argument(
        "--prompt-tokens",
        type=int,
        default=PROMPT_TOKENS,
        help=f"tokens per prompt of the extract_* rows (default {PROMPT_TOKENS})",
    )
    bench.add_argument(
        "--extract-dir",
        default=None,
        metavar="DIR",
        help="where the extract_* rows write (a fresh folder per run, deleted after it; "
        "default a temporary folder)",
    )
    bench.add_argument(
        "--load-format",
        default=None,
        help="vLLM's load_format for every engine, plain and vinterp ('dummy': random "
        "weights; the default for a model shape)",
    )
    bench.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="GPUs per engine for every engine, plain and vinterp (e.g. 4 for "
        "llama-3-70b-shape); the tp_* rows stay at 2",
    )
    bench.add_argument(
        "--dtype", default=None, help="engine dtype for vLLM and vinterp (default: checkpoint's)"
    )
    bench.add_argument(
        "--workloads",
        type=_workload_list,
        default=None,
        help="comma list of rows to run (default all but "
        f"{', '.join(ON_REQUEST)}; 'none' for none): {', '.join(SELECTABLE)}",
    )
    bench.add_argument(
        "--peers",
        type=_peer_list,
        default=None,
        help="comma list of peer tools (default all; none for a model shape; 'none' for none): "
        f"{', '.join(PEER_KEYS)}",
    )
    bench.add_argument(
        "--setup-peers",
        action="store_true",
        help="(re)build the peers' environments from the package index, then stop",
    )
    bench.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="every engine's share of its GPU (vLLM's option): lower it to time beside another run",
    )
    bench.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="every engine's KV cache in bytes (vLLM's option; the KV cache then ignores the "
        "share above): vLLM skips the memory profiling that another engine on the GPU upsets",
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
    bench.add_argument(
        "--serve-clients",
        type=_positive,
        default=None,
        help="serve_load: concurrent clients (default 16 on the CPU, 64 on a GPU)",
    )
    bench.add_argument(
        "--serve-seconds",
        type=_positive,
        default=None,
        help=f"serve_load: seconds of the mixed load (default {SERVE_FULL['serve_seconds']}, "
        f"--quick {SERVE_QUICK['serve_seconds']})",
    )
    bench.add_argument(
        "--serve-compare-seconds",
        type=int,
        default=None,
        help="serve_load: seconds of plain and streaming completions on each server, vinterp's "
        f"and plain vLLM's (default {SERVE_FULL['serve_compare_seconds']}, --quick "
        f"{SERVE_QUICK['serve_compare_seconds']}; 0: no plain vLLM server)",
    )
    bench.add_argument(
        "--serve-args",
        default="",
        metavar="FLAGS",
        help="serve_load: flags for both servers, e.g. --serve-args='--enforce-eager'",
    )
    bench.add_argument("--out", default=None, metavar="DIR", help="write bench.json/.md/.png")
    bench.add_argument("-v", "--verbose", action="store_true", help="vLLM's logs")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    bench.set_defaults(run=_bench)
    serve = commands.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with vinterp (other flags: vLLM's)",
        usage=SERVE_USAGE,
        description="The model (default: the bundled one) is given as to `vllm serve`: the "
        "positional argument (first, as `vllm serve MODEL`) or --model MODEL anywhere; a "
        "checkpoint here or a Hugging Face repo id. Every flag not listed here is vLLM's: "
        "vLLM's own parser reads it, and it is passed on unchanged.",
        allow_abbrev=False,  # a vLLM flag is never taken for an abbreviation of vinterp's
    )
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
    serve.add_argument(
        "--probe-sites",
        default=None,
        type=lambda text: [s for s in text.split(",") if s],
        metavar="SITES",
        help="score probes and gate steering at the comma-separated SITES inside the compiled "
        "model (as vinterp.LLM(probe_sites=[sites]))",
    )
    defaults = ServeLimits()
    for flag, field, what in (
        ("--max-body-mb", "body_bytes", "request body, MiB (larger: 413 before it is read)"),
        ("--max-body-seconds", "body_seconds", "seconds a request body may take to arrive (408)"),
        ("--max-trace-nodes", "nodes", "nodes of one trace"),
        ("--max-trace-invokes", "invokes", "invokes of one trace"),
        ("--max-trace-tokens", "max_tokens", "max_tokens of one trace invoke"),
        ("--max-traces-per-key", "traces_per_key", "traces one API key runs at once (more: 429)"),
    ):
        default = getattr(defaults, field)
        default = default >> 20 if field == "body_bytes" else default
        serve.add_argument(flag, type=_positive, default=None, help=f"{what}; default {default}")
    serve.set_defaults(run=_serve)
    extract = commands.add_parser(
        "extract", help="write activations of many prompts to a Hugging Face datasets folder"
    )
    extract.add_argument("--model", default=None, help="HF checkpoint (default: bundled)")
    extract.add_argument(
        "--prompts",
        required=True,
        help="a text file (one prompt per line), a .jsonl file, a .parquet file, or a folder "
        "of parquet files or saved by datasets' save_to_disk",
    )
    extract.add_argument(
        "--column",
        default="text",
        help="the .jsonl field or dataset column holding the prompt (default: text)",
    )
    extract.add_argument(
        "--context-size",
        type=_positive,
        default=None,
        metavar="N",
        help="pack the prompts into windows of N tokens as SAELens's activation store cuts "
        "them (BOS first in each window and between documents), not one prompt each",
    )
    extract.add_argument(
        "--no-bos",
        dest="bos",
        action="store_false",
        help="with --context-size: insert no BOS, only join and cut the documents' tokens",
    )
    extract.add_argument(
        "--sites",
        required=True,
        type=lambda text: [s for s in text.split(",") if s],
        help="comma-separated sites or patterns, e.g. layers.6.output,layers.*.mlp.output",
    )
    extract.add_argument(
        "--positions",
        type=_positions,
        default="all_prompt",
        help="all_prompt (default), last_prompt, or comma-separated positions",
    )
    extract.add_argument("--out", required=True, metavar="DIR", help="the dataset folder")
    extract.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="stored values (default: the engine's; bfloat16 keeps its 2-byte bits)",
    )
    extract.add_argument(
        "--skip-first", type=int, default=0, help="drop the first K positions (e.g. BOS)"
    )
    extract.add_argument(
        "--buffer-gb",
        type=float,
        default=BUFFER_GB,
        help="memory for captured rows in flight, host and device",
    )
    extract.add_argument(
        "--max-model-len", type=int, default=None, help="the engine's context (vLLM's option)"
    )
    extract.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="GPUs per engine (vLLM's option)"
    )
    extract.add_argument(
        "--engine-dtype", default=None, help="the engine's dtype (default: the checkpoint's)"
    )
    extract.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas, each of --tensor-parallel-size GPUs, as Ray actors (default 1)",
    )
    extract.add_argument(
        "--ray-address", default=None, help="a Ray cluster to run the replicas on (ray.init)"
    )
    extract.add_argument(
        "--sae",
        type=_sae,
        action="append",
        default=[],
        metavar="SITE=DIR",
        help="attach the SAE in DIR (SAELens's format) at SITE, e.g. layers.10.output=./sae; "
        "repeat for several sites",
    )
    extract.add_argument(
        "--topk",
        type=_positive,
        default=None,
        metavar="K",
        help="store each SAE features site (SITE.sae.features) as its K largest features per "
        "token: columns SITE.sae.features.indices and .values",
    )
    extract.add_argument(
        "--full-model",
        dest="stop_at_deepest",
        action="store_false",
        help="run every layer of the model (by default the engine runs only the layers up to "
        "the deepest site's: later layers are neither loaded nor computed)",
    )
    extract.add_argument("-v", "--verbose", action="store_true", help="vLLM's logs")
    extract.set_defaults(run=_extract)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    args.run(args)


if __name__ == "__main__":
    main()
