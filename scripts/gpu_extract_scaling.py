"""Data-parallel extraction's scaling on one GPU machine (issue 51): `vinterp.extract` of the
same prompts on N = 1, 2, 4 ... engine replicas of one GPU each (N=1 in this process, more as
Ray actors), against the store alone writing as many rows with as many writers as the most replicas.

    python3 scripts/gpu_extract_scaling.py --replicas 1,2,4 --root /tmp/dp --json $OUT/dp.json

`vinterp extract` takes a checkpoint; a model shape without weights (load_format "dummy")
runs through the Python entry, hence this script. The prompts, sites (four evenly spaced
layers at every prompt position) and engine settings are the `extract_layers_all` row's of
`vinterp bench`, so an engine that row compiled on this machine loads from the cache. Each
run's dataset (34 GB for the 8B shape) is deleted before the next.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

GB = 1e9


def model_and_format(name: str) -> tuple[str, dict[str, Any]]:
    """A shape of vinterp.models.SHAPES (random weights) or a checkpoint path."""
    import vinterp

    if name in vinterp.models.SHAPES:
        return str(vinterp.models.shape_only(**vinterp.models.SHAPES[name])), {
            "load_format": "dummy"
        }
    return name, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b-shape", help="a shape or a checkpoint")
    parser.add_argument("--replicas", default="1,2,4", help="comma list of N")
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--root", default="/tmp/dp", help="where each run writes")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    replicas = [int(n) for n in args.replicas.split(",")]

    from transformers import AutoConfig, AutoTokenizer

    import vinterp
    from vinterp.bench.extraction import (
        EXTRACT_LAYERS_ALL,
        SPACED_LAYERS,
        extractions,
        prompt_texts,
        time_store_alone,
    )
    from vinterp.bench.workloads import resolve_dtype
    from vinterp.extraction.request import store_columns
    from vinterp.store import WRITER_THREADS

    model, load = model_and_format(args.model)
    config = AutoConfig.from_pretrained(model)
    texts = prompt_texts(AutoTokenizer.from_pretrained(model), args.prompts, args.prompt_tokens)
    case = extractions(config, SPACED_LAYERS["cuda"])[EXTRACT_LAYERS_ALL]
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for n in replicas:
        out = root / f"n{n}"
        shutil.rmtree(out, ignore_errors=True)
        began = time.perf_counter()
        result = vinterp.extract(
            model,
            texts,
            case.sites,
            out=out,
            positions=case.positions,
            data_parallel_size=n,
            use_tqdm=False,
            max_model_len=args.max_model_len,
            **load,
        )
        stats = result.stats
        runs.append(
            {
                "replicas": n,
                "seconds": stats.seconds,  # first shard sent to last listed (starts may overlap)
                "wall_s": time.perf_counter() - began,  # engine starts included
                "rows": stats.rows,
                "gb": stats.bytes / GB,
                "gb_per_s": stats.gb_per_s,
                "tokens_per_s": stats.tokens / stats.seconds,
                "engine_waited_s": stats.engine_waited_s,
                "writers_waited_s": stats.writers_waited_s,
            }
        )
        print(json.dumps(runs[-1]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    # the store alone with the writers of the most replicas (each runs WRITER_THREADS)
    layers = [f"layers.{i}.output" for i in case.layers]
    columns = store_columns(layers, resolve_dtype(model), int(config.hidden_size))
    writers = max(replicas) * WRITER_THREADS
    alone = time_store_alone(root, columns, runs[-1]["rows"], 1, writers).median
    base = runs[0]["tokens_per_s"]
    for run in runs:
        run["speedup"] = run["tokens_per_s"] / base
        print(
            f"N={run['replicas']}: {run['seconds']:.1f} s ({run['wall_s']:.0f} s with starts), "
            f"{run['speedup']:.2f}x N={runs[0]['replicas']}, {run['gb_per_s']:.2f} GB/s; waited: "
            f"engines {run['engine_waited_s']:.1f} s, writers {run['writers_waited_s']:.1f} s"
        )
    print(f"store alone, {runs[-1]['rows']} rows on {writers} writers: {alone:.1f} s")
    if args.json:
        about = {"model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens}
        Path(args.json).write_text(
            json.dumps(
                {
                    **about,
                    "sites": case.sites,
                    "runs": runs,
                    "store_alone_s": alone,
                    "writers": writers,
                }
            )
        )


if __name__ == "__main__":
    main()
