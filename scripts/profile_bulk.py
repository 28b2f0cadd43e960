"""Where the time of bulk work goes: extraction to disk and SAE features, at a reduced size, on
one vinterp engine, with probes in the front end and in vLLM's engine-core process.

    python3 scripts/profile_bulk.py --model llama-3-8b-shape --prompts 1024 --json OUT.json

One engine serves every phase: capture buffers at the extracted layers and the SAE's host,
compiled SAE clamping at the host, the bench's SAE attached. Phases, each timed on its own:
the engine's own prefill of the same prompts (no capture: the model's floor), extraction of
the spaced layers at every prompt position (the default twice, for the spread, then one
factor changed each: a deeper prompt queue, fsync off, a shorter GIL switch interval, the
dataset on /dev/shm), the store alone writing as many rows, extraction of the SAE's top-k
features, and generation with no intervention, with the SAE's features clamped and with its
top-k captured at every position.

Per phase it prints: wall seconds; engine steps, tokens, device busy and idle (CUDA events
around `execute_model`, in the engine-core process), host ms per step in vinterp's hooks, how
long the engine core sat with no request (the feed was late); the feed's time in `put` (waiting
for the writers), in vLLM's `step` and `add_request`; the writers' seconds waiting for rows,
mapping the worker's files, building columns, serializing, fsync and committing; the worker's
file writes (GB/s); the GIL (a 1 ms sleeper's overshoot) and a 5 ms stack sampler's top
frames per thread kind. The SAE's fixed costs (load, digest, attach) come first.

The `mid` engine (`--engines plain,mid`) runs layers 0..L of an L = layers/2 extraction, as
`vinterp extract` starts it: its own prefill (no capture: the floor), extraction of layer L at
every prompt position (twice), alternating with the same without the tail's smaller shards
(twice), then with the tail cut finer and with fsync off; per extraction the seconds before
the first engine step (set-up, feed) and after the last (last writes, commit, reload), and the
call's parts (open_job, finish, load_dataset). Datasets are kept while the disk has room for
two more (`bench.extraction.RunFolders`): a removal's discards stalled the next phase's first
fsyncs on the lent H200. The `plain_mid` engine is plain vLLM cut to the same layers 0..L
(`hf_overrides`, random weights): its prefill is the floor without vinterp.

Probes only: nothing here changes what vinterp does, except the variants named above.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernel_trace import summary, trace_events  # this folder's

HERE = Path(__file__).resolve().parent
PROBES = HERE / "profile_probes"


class Totals:
    """Calls and seconds per label, summed from every thread of this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def add(self, label: str, seconds: float) -> None:
        with self.lock:
            entry = self.data[label]
            entry[0] += 1
            entry[1] += seconds

    def snapshot(self) -> dict[str, tuple[int, float]]:
        with self.lock:
            return {k: (v[0], v[1]) for k, v in self.data.items()}


TOTALS = Totals()


def wrap(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS.add(label, time.perf_counter() - began)

    setattr(owner, name, run)


class Samplers:
    """A 1 ms sleeper (the GIL's hold-ups: its overshoot) and a 5 ms stack sampler."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.gil: list[tuple[float, float]] = []
        self.stacks: list[tuple[float, str, str]] = []  # (t, thread kind, frame key)
        threading.Thread(target=self._gil, daemon=True, name="profile-gil").start()
        threading.Thread(target=self._stacks, daemon=True, name="profile-stacks").start()

    def _gil(self) -> None:
        while not self.stop.is_set():
            began = time.perf_counter()
            time.sleep(0.001)
            self.gil.append((began, time.perf_counter() - began - 0.001))

    def _stacks(self) -> None:
        names = {}
        while not self.stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            for thread in threading.enumerate():
                names[thread.ident] = thread.name
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "?")
                if name.startswith("profile-"):
                    continue
                self.stacks.append((now, thread_kind(name), frame_key(frame)))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        over = sorted(o for t, o in self.gil if t0 <= t < t1)
        gil = {}
        if over:
            gil = {
                "p50_ms": over[len(over) // 2] * 1e3,
                "p99_ms": over[int(len(over) * 0.99)] * 1e3,
                "total_s": sum(over),
                "over_5ms": sum(o > 0.005 for o in over),
            }
        tops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for t, kind, key in self.stacks:
            if t0 <= t < t1:
                tops[kind][key] += 1
        stacks = {kind: [(k, n * 5) for k, n in c.most_common(6)] for kind, c in tops.items()}
        return {"gil": gil, "stacks_ms": stacks}


def thread_kind(name: str) -> str:
    if name == "MainThread":
        return "feed"
    if name.startswith("vinterp-shard-writer"):
        return "writers"
    return "other"


OWN = ("vinterp", "vllm")


def frame_key(frame: Any) -> str:
    """The innermost frame, and the innermost of vinterp's or vLLM's below it."""
    inner = frame
    own = None
    while frame is not None:
        file = frame.f_code.co_filename
        if any(f"/{p}/" in file for p in OWN) and "profile_" not in file:
            own = frame
            break
        frame = frame.f_back
    label = f"{Path(inner.f_code.co_filename).stem}.{inner.f_code.co_name}"
    if own is not None and own is not inner:
        label += f" <- {Path(own.f_code.co_filename).stem}.{own.f_code.co_name}:{own.f_lineno}"
    return label


def core_records(folder: Path) -> list[dict[str, Any]]:
    records = []
    for path in folder.glob("core-*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def core_window(records: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    steps = [r for r in records if r["kind"] == "step" and t0 <= r["t"] < t1]
    steps.sort(key=lambda r: r["t"])
    busy = [r for r in steps if r["tokens"]]
    out: dict[str, Any] = {
        "steps": len(busy),
        "tokens": sum(r["tokens"] for r in busy),
        "uncompiled": sum(r["uncompiled"] for r in busy),
        "host_ms_per_step": _mean([r["host_ms"] for r in busy]),
    }
    hooks: collections.Counter = collections.Counter()
    for r in busy:
        hooks.update(r.get("hooks_ms", {}))
    out["hooks_ms_per_step"] = {k: v / max(len(busy), 1) for k, v in hooks.items()}
    if busy:  # the call's seconds before its first step and after its last one's end
        last = busy[-1]
        last_ms = max(last["host_ms"], last.get("gpu_ms") or 0.0)
        out["before_first_step_s"] = busy[0]["t"] - t0
        out["after_last_step_s"] = t1 - (last["t"] + last_ms / 1e3)
    if busy and busy[0].get("gpu_ms") is not None:
        out["gpu_busy_s"] = sum(r["gpu_ms"] for r in busy) / 1e3
        gaps = [
            r["gpu_idle_before_ms"] for r in busy[1:] if r.get("gpu_idle_before_ms") is not None
        ]
        out["gpu_idle_between_s"] = sum(gaps) / 1e3
        out["gpu_idle_gap_ms_p50"] = sorted(gaps)[len(gaps) // 2] if gaps else None
    idle = [r["s"] for r in records if r["kind"] == "idle" and t0 <= r["t"] < t1]
    out["core_no_work_s"] = sum(idle)
    writes = [r for r in records if r["kind"] == "file_write" and t0 <= r["t"] < t1]
    if writes:
        size, seconds = sum(w["bytes"] for w in writes), sum(w["s"] for w in writes)
        out["worker_file_writes"] = {"n": len(writes), "gb": size / 1e9, "thread_s": seconds}
    takes = [r["s"] for r in records if r["kind"] == "take_rpc" and t0 <= r["t"] < t1]
    out["take_rpc"] = {"n": len(takes), "s": sum(takes)}
    errors = [r for r in records if r["kind"] == "probe_error"]
    if errors:
        out["probe_errors"] = errors[:3]
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Phases:
    def __init__(self, samplers: Samplers, probe_dir: Path) -> None:
        self.samplers, self.probe_dir = samplers, probe_dir
        self.done: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str, **facts: Any):
        before = TOTALS.snapshot()
        info: dict[str, Any] = {"phase": name, **facts}
        t0, wall0 = time.perf_counter(), time.time()
        print(f"-- {name}", flush=True)
        try:
            yield info
        except Exception as exc:  # the other phases still run
            import traceback

            traceback.print_exc()
            info["error"] = repr(exc)
        finally:
            t1 = time.perf_counter()
            after = TOTALS.snapshot()
            info["seconds"] = t1 - t0
            info["t"] = [t0, t1]
            info["wall"] = [wall0, time.time()]
            info["front_end"] = {
                k: (n - before.get(k, (0, 0.0))[0], s - before.get(k, (0, 0.0))[1])
                for k, (n, s) in after.items()
                if n != before.get(k, (0, 0.0))[0]
            }
            info |= self.samplers.window(t0, t1)
            self.done.append(info)
            print(f"   {name}: {info['seconds']:.2f} s", flush=True)

    def finish(self) -> None:
        time.sleep(2.5)  # the engine core flushes its probes once a second
        records = core_records(self.probe_dir)
        for info in self.done:
            info["core"] = core_window(records, *info["t"])


def install_front_end_probes() -> None:
    from vinterp.engine import vllm_engine
    from vinterp.extraction import stream as extract
    from vinterp.interventions import capture_files
    from vinterp.store import directory, files, hf_format, writer

    wrap(writer.ShardWriter, "put", "feed.put (waits for a writer's room, sends the take)")
    wrap(writer.ShardWriter, "_write", "writer.shard (take + build + write)")
    wrap(vllm_engine, "merge_captures", "writer.take.merge (file wait + map)")
    wrap(capture_files.FileHandoff, "_wait", "writer.take.file_wait (worker's file)")
    wrap(capture_files.FileHandoff, "tensor", "writer.take.map_file")
    wrap(extract, "shard_columns", "writer.build_columns")
    wrap(extract, "column_values", "writer.build.column_values")
    wrap(extract, "index_values", "writer.build.index_values")
    wrap(directory.ActivationStore, "write", "writer.store_write (serialize+write+fsync)")
    wrap(hf_format, "write_shard", "writer.serialize_write (arrow)")
    wrap(files, "sync_folder", "writer.fsync_folder")
    wrap(directory.ActivationStore, "add", "writer.commit (manifest+state, under the lock)")
    wrap(os, "fsync", "fsync (all)")
    from vinterp.extraction import local

    wrap(local, "open_job", "call.open_job (checks, spec, store open)")
    wrap(local, "finish", "call.finish (mark complete)")
    wrap(local, "load_dataset", "call.load_dataset (datasets.load_from_disk)")
    wrap(writer.ShardWriter, "__exit__", "call.writers_exit (last writes + commit)")


def probe_engine_loop(llm: Any) -> None:
    engine = llm.backend.llm.llm_engine
    wrap(engine, "step", "feed.vllm_step (waits for the engine core)")
    wrap(engine, "add_request", "feed.add_request")


@contextlib.contextmanager
def no_fsync():
    import vinterp.store.files as files_module

    real = files_module.os

    class NoSync:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def fsync(fd: int) -> None:
            return None

    files_module.os = NoSync()
    try:
        yield
    finally:
        files_module.os = real


@contextlib.contextmanager
def tail_shards(steps: int, split: int):
    """The tail of `steps` engine steps' prompts in shards `split` times smaller (0 steps: no
    tail), for the datasets opened meanwhile."""
    import vinterp.extraction.request as request

    old = request.TAIL_STEPS, request.TAIL_SPLIT
    request.TAIL_STEPS, request.TAIL_SPLIT = steps, split
    try:
        yield
    finally:
        request.TAIL_STEPS, request.TAIL_SPLIT = old


@contextlib.contextmanager
def switch_interval(seconds: float):
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def gpu_sampler(path: Path) -> subprocess.Popen | None:
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(
        [
            "nvidia-smi",
            "--query-gpu=timestamp,utilization.gpu,memory.used",
            "--format=csv,noheader",
            "-lms",
            "100",
        ],
        stdout=open(path, "w"),
        stderr=subprocess.DEVNULL,
    )


def gpu_utilisation(path: Path, phases: list[dict[str, Any]]) -> None:
    from datetime import datetime

    samples = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [p.strip() for p in line.split(",")]
        with contextlib.suppress(ValueError, IndexError):
            when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, float(parts[1].split()[0])))
    for info in phases:
        w0, w1 = info["wall"]
        inside = [u for t, u in samples if w0 <= t < w1]
        if inside:
            info["smi_util_mean"] = sum(inside) / len(inside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="a SHAPES name, a checkpoint; default bundled"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--sae-prompts", type=int, default=256)
    parser.add_argument("--gen-prompts", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--root", default=None, help="dataset folder (default: a temp dir)")
    parser.add_argument("--skip", default="", help="phases (name up to ':') to skip, commas")
    parser.add_argument(
        "--engines",
        default="plain,layers,bulk",
        help="plain (plain vLLM's times), layers (buffers at every layer: "
        "generation rows, every layer at last_prompt), mid (layers 0..L extracting layer L), "
        "bulk (the profile)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--kernels",
        default=None,
        help="a folder: the plain_mid and mid engines each profile one prefill of "
        "--kernel-prompts prompts with the torch profiler; its op table goes to FOLDER/ENGINE.txt",
    )
    parser.add_argument("--kernel-prompts", type=int, default=64)
    parser.add_argument("--records", default=None, help="copy the engine-core records here")
    args = parser.parse_args()

    probe_dir = Path(tempfile.mkdtemp(prefix="vinterp-profile-"))
    os.environ["VINTERP_PROFILE_DIR"] = str(probe_dir)  # the engine core's probes
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(PROBES), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    skip = set(filter(None, args.skip.split(",")))
    engines = set(args.engines.split(","))
    samplers = Samplers()
    phases = Phases(samplers, probe_dir)
    smi_log = probe_dir / "smi.csv"
    smi = gpu_sampler(smi_log)

    import torch

    import vinterp
    from vinterp.bench import bench_sae
    from vinterp.bench.extraction import (
        RunFolders,
        prompt_texts,
        spaced_layers,
        time_store_alone,
    )
    from vinterp.bench.workloads import checkpoint_config, plain_vllm
    from vinterp.cli import _bench_model
    from vinterp.engine.plain_vllm import greedy_params
    from vinterp.extraction.request import store_columns
    from vinterp.sae import SAE

    install_front_end_probes()
    model, load_format = _bench_model(args.model, None)
    config = checkpoint_config(model)
    cuda = shutil.which("nvidia-smi") is not None
    layers = spaced_layers(int(config.num_hidden_layers), 4 if cuda else 2)
    sites = [f"layers.{i}.output" for i in layers]
    host = bench_sae.host_site(config)
    features = f"{host}.sae.features"
    root = Path(args.root or tempfile.mkdtemp(prefix="vinterp-profile-data-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args), "sites": sites, "host": host}
    common: dict[str, Any] = {"max_model_len": args.max_model_len}
    if load_format:
        common["load_format"] = load_format
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    texts = prompt_texts(tokenizer, args.prompts, args.prompt_tokens)
    sae_texts, gen = texts[: args.sae_prompts], texts[: args.gen_prompts]
    warm = texts[: max(len(texts) // 16, 8)]
    sampling = {"max_tokens": args.gen_tokens, "ignore_eos": True}

    one = greedy_params(1)
    gen_params = greedy_params(args.gen_tokens, ignore_eos=True)

    def plain_engine(
        label: str, rows: list[tuple[str, list[str], Any]], profiled: bool, **kwargs: Any
    ) -> None:
        """Plain vLLM with `kwargs`: started (timed), warmed, then each (name, prompts,
        params) row's generate timed as the phase `label: name`; `profiled`: then the
        kernel table of one prefill (--kernels)."""
        if profiled:
            kwargs |= kernel_profiler(args, label)
        with phases.phase(f"{label}: engine start", kwargs=str(kwargs)):
            context = plain_vllm(model, args.dtype, **kwargs)
            plain = context.__enter__()
        plain.generate(warm, one, use_tqdm=False)
        plain.generate(gen[:8], gen_params, use_tqdm=False)
        for name, prompts, params in rows:
            with phases.phase(f"{label}: {name}", prompts=len(prompts)):
                plain.generate(prompts, params, use_tqdm=False)
        if profiled:
            kernel_table(
                args,
                label,
                plain,
                lambda: plain.generate(texts[: args.kernel_prompts], one, use_tqdm=False),
            )
        context.__exit__(None, None, None)

    if "plain" in engines:
        plain_engine(
            "plain",
            [
                ("prefill", texts, one),
                ("prefill again", texts, one),
                ("prefill of the SAE prompts", sae_texts, one),
                ("generation", gen, gen_params),
                ("generation again", gen, gen_params),
            ],
            False,
            **common,
        )
    if "plain_mid" in engines:
        # random weights (they time as real ones do): vLLM's loader refuses a checkpoint's
        # layers beyond the cut
        plain_engine(
            "plain_mid",
            [("prefill", texts, one), ("prefill again", texts, one)],
            args.kernels is not None,
            **{
                **common,
                "load_format": "dummy",
                "hf_overrides": {"num_hidden_layers": middle_layer(config) + 1},
            },
        )

    def prefill(llm: Any, name: str, prompts: list[str]) -> None:
        with phases.phase(name, prompts=len(prompts)):
            llm.generate(prompts, max_tokens=1, use_tqdm=False)

    runs = RunFolders(root, "run-")

    def extract(
        llm: Any, name: str, prompts: list[str], out: Path | None = None, **kwargs: Any
    ) -> None:
        """One timed extraction into `out`, removed after it, or into a kept run folder."""
        if name.split(":")[0] in skip:
            return
        folder = out or runs.new()
        with phases.phase(name, prompts=len(prompts)) as info:
            result = llm.extract(
                prompts,
                kwargs.pop("sites", sites),
                positions=kwargs.pop("positions", "all_prompt"),
                out=folder,
                use_tqdm=False,
                **kwargs,
            )
            stats = result.stats
            info["stats"] = {
                "rows": stats.rows,
                "gb": stats.bytes / 1e9,
                "seconds": stats.seconds,
                "gb_per_s": stats.gb_per_s,
                "engine_waited_s": stats.engine_waited_s,
                "writers_waited_s": stats.writers_waited_s,
                "shards": stats.shards,
            }
        if out is None:
            runs.done()
        else:
            shutil.rmtree(out, ignore_errors=True)

    def generations(llm: Any, label: str, rows: list[tuple[str, dict[str, Any]]]) -> None:
        for name, kwargs in rows:
            llm.generate(gen[:8], use_tqdm=False, **sampling, **kwargs)  # warm
            before = llm.step_stats()
            with phases.phase(f"{label}: {name}", prompts=len(gen), tokens=args.gen_tokens) as info:
                llm.generate(gen, use_tqdm=False, **sampling, **kwargs)
            after = llm.step_stats()
            info["uncompiled_steps"] = after.get("uncompiled", 0) - before.get("uncompiled", 0)

    if "mid" in engines:
        mid_engine(args, model, common, texts, warm, config, phases, extract, prefill)
    vector = vinterp.Steering({host: torch.full((int(config.hidden_size),), 0.01)}, scale=4.0)
    if "layers" in engines:
        kwargs = {**common, "capture_in_graph": "layers.*.output"}
        with phases.phase("layers: engine start", kwargs=str(kwargs)):
            llm = vinterp.LLM(model, dtype=args.dtype, **kwargs)
        probe_engine_loop(llm)
        llm.extract(
            warm, "layers.*.output", positions="last_prompt", out=root / "warm", use_tqdm=False
        )
        shutil.rmtree(root / "warm", ignore_errors=True)
        generations(
            llm,
            "layers",
            [
                ("gen none", {}),
                ("gen steer one vector", {"steering": vector}),
                ("gen none again", {}),
            ],
        )
        extract(
            llm,
            "layers: extract every layer at last_prompt",
            texts,
            sites="layers.*.output",
            positions="last_prompt",
        )
        extract(
            llm,
            "layers: extract every layer at last_prompt again",
            texts,
            sites="layers.*.output",
            positions="last_prompt",
        )
        llm.shutdown()

    if "bulk" not in engines:
        runs.close()
        return finish(args, results, phases, samplers, smi, smi_log, probe_dir)
    with phases.phase("sae.fixed: save a random SAE (bench set-up, not a user's cost)"):
        sae_dir = Path(tempfile.mkdtemp(prefix="vinterp-profile-sae-"))
        bench_sae.random_sae(int(config.hidden_size)).save(sae_dir)
    with phases.phase("sae.fixed: SAE.load") as info:
        sae = SAE.load(sae_dir)
        info["d_sae"] = sae.d_sae
    with phases.phase("sae.fixed: digest"):
        _ = sae.digest
    with phases.phase("sae.fixed: digest again"):
        _ = sae.digest

    engine_kwargs: dict[str, Any] = {
        **common,
        "capture_in_graph": list(dict.fromkeys([*sites, host])),
        "capture_in_graph_rows": "step",
        "sae_steering_hosts": host,
    }
    with phases.phase("bulk: engine start", kwargs=str(engine_kwargs)):
        llm = vinterp.LLM(model, dtype=args.dtype, **engine_kwargs)
    probe_engine_loop(llm)
    with phases.phase("sae.fixed: attach_sae"):
        llm.attach_sae(host, sae)
    llm.generate(warm, max_tokens=1, use_tqdm=False)
    llm.extract(warm, sites, out=root / "warm", use_tqdm=False)
    shutil.rmtree(root / "warm", ignore_errors=True)

    prefill(llm, "prefill (no capture)", texts)
    extract(llm, "extract.default", texts)
    prefill(llm, "prefill (no capture) again", texts)
    extract(llm, "extract.default again", texts)
    extract(llm, "extract.queue_x4: buffer_gb=16", texts, buffer_gb=16.0)
    if "extract.no_fsync" not in skip:
        with no_fsync():
            extract(llm, "extract.no_fsync", texts)
    with switch_interval(0.0005):
        extract(llm, "extract.switch_0.5ms", texts)
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 40e9:
        extract(
            llm,
            "extract.dev_shm: dataset on /dev/shm",
            texts,
            Path(tempfile.mkdtemp(dir="/dev/shm")) / "x",
        )
    rows = args.prompts * args.prompt_tokens
    columns = store_columns(sites, args.dtype, int(config.hidden_size))
    with phases.phase("store alone (as many rows, 8 writers)", rows=rows):
        time_store_alone(root, columns, rows, 1)

    prefill(llm, "sae: prefill of the SAE prompts", sae_texts)
    extract(
        llm,
        f"sae: extract top-{bench_sae.TOPK} {features}",
        sae_texts,
        sites=[features],
        topk=bench_sae.TOPK,
    )
    from vinterp.extraction.request import ExtractionRequest, open_job
    from vinterp.extraction.spec import EngineFacts

    with phases.phase("sae.fixed: open_job (spec, SAE facts, checkpoint identity)"):
        open_job(
            EngineFacts.of(llm),
            ExtractionRequest(
                prompts=sae_texts, sites=[features], out=root / "j", topk=bench_sae.TOPK
            ),
        )
    shutil.rmtree(root / "j", ignore_errors=True)

    steer = vinterp.Steering({features: bench_sae.CLAMPED}, mode="clamp")
    cap = vinterp.Capture([features], positions="all", topk=bench_sae.TOPK)
    generations(
        llm,
        "bulk",
        [
            ("gen none", {}),
            ("gen steer one vector", {"steering": vector}),
            ("gen clamp 4 SAE features", {"steering": steer}),
            (f"gen capture top-{bench_sae.TOPK} SAE features, all positions", {"capture": cap}),
            ("gen none again", {}),
        ],
    )
    llm.shutdown()
    runs.close()
    finish(args, results, phases, samplers, smi, smi_log, probe_dir)


def mid_engine(
    args: Any,
    model: Any,
    common: dict[str, Any],
    texts: list[str],
    warm: list[str],
    config: Any,
    phases: Phases,
    extract: Any,
    prefill: Any,
) -> None:
    """Extraction of layer L = layers/2 on an engine of layers 0..L, as `vinterp extract`
    starts it (the bench's extract_mid_depth row), with its own no-capture prefill."""
    import vinterp
    from vinterp.extraction.request import engine_settings

    middle = middle_layer(config)
    site = f"layers.{middle}.output"
    kwargs = {**common, **engine_settings([site]), "num_layers": middle + 1}
    if args.kernels:
        kwargs |= kernel_profiler(args, "mid")
    with phases.phase("mid: engine start", kwargs=str(kwargs)) as info:
        llm = vinterp.LLM(model, dtype=args.dtype, **kwargs)
    if "error" in info:
        return
    probe_engine_loop(llm)
    root = Path(tempfile.mkdtemp(prefix="vinterp-profile-mid-"))
    llm.generate(warm, max_tokens=1, use_tqdm=False)
    llm.extract(warm, site, out=root / "warm", use_tqdm=False)
    shutil.rmtree(root / "warm", ignore_errors=True)
    prefill(llm, "mid: prefill (no capture)", texts)
    for again in ("", " again"):
        extract(llm, f"mid: extract.default{again}", texts, sites=site)
        with tail_shards(0, 1):
            extract(llm, f"mid: extract.no_tail{again}", texts, sites=site)
    prefill(llm, "mid: prefill (no capture) again", texts)
    with tail_shards(2, 8):
        extract(llm, "mid: extract.tail_8", texts, sites=site)
    with no_fsync():
        extract(llm, "mid: extract.no_fsync", texts, sites=site)
    if args.kernels:
        prompts = texts[: args.kernel_prompts]
        kernel_table(
            args,
            "mid",
            llm.backend.llm,
            lambda: llm.generate(prompts, max_tokens=1, use_tqdm=False),
        )
    llm.shutdown()
    shutil.rmtree(root, ignore_errors=True)


def middle_layer(config: Any) -> int:
    """L of the mid engines: the layer halfway down the model, their deepest."""
    return int(config.num_hidden_layers) // 2


def kernel_folder(args: Any, label: str) -> Path:
    """Where engine `label`'s workers write their profiler traces and op tables."""
    return Path(args.kernels).resolve() / label


def kernel_profiler(args: Any, label: str) -> dict[str, Any]:
    """Engine arguments that let `kernel_table` profile engine `label`'s workers."""
    folder = kernel_folder(args, label)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"profiler": "torch", "torch_profiler_dir": str(folder)}
    return {"profiler_config": config | {"torch_profiler_with_stack": False}}


def kernel_table(args: Any, label: str, engine: Any, run: Callable[[], Any]) -> None:
    """Profile `run()` on `engine` (a `vllm.LLM` started with `kernel_profiler`); its workers'
    op tables (vLLM writes them on stop) and the device timeline of their traces
    (`kernel_trace.py`) go to --kernels/LABEL.txt."""
    folder = kernel_folder(args, label)
    engine.start_profile()
    run()
    engine.stop_profile()
    tables = sorted(folder.glob("*profiler_out*.txt"))
    text = "\n".join(table.read_text() for table in tables)
    for trace in sorted(folder.glob("*.pt.trace.json*")):
        text += f"\n== device timeline of {trace.name}\n{summary(trace_events(trace))}\n"
    (folder.parent / f"{label}.txt").write_text(text or "no table written\n")
    print(f"   kernels of {label}: {len(tables)} table(s)", flush=True)


def finish(
    args: Any,
    results: dict[str, Any],
    phases: Phases,
    samplers: Samplers,
    smi: Any,
    smi_log: Path,
    probe_dir: Path,
) -> None:
    samplers.stop.set()
    if smi is not None:
        smi.terminate()
    phases.finish()
    gpu_utilisation(smi_log, phases.done)
    results["phases"] = phases.done
    if args.records:
        with open(args.records, "w") as file:
            for record in core_records(probe_dir):
                file.write(json.dumps(record) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print_table(phases.done)


RATIOS = (  # (row, phase, plain phase)
    ("4 layers every prompt position", "extract.default", "plain: prefill"),
    ("4 layers again", "extract.default again", "plain: prefill"),
    ("every layer at last_prompt", "layers: extract every layer at last_prompt", "plain: prefill"),
    (
        "every layer at last_prompt again",
        "layers: extract every layer at last_prompt again",
        "plain: prefill",
    ),
    ("SAE top-k extraction", "sae: extract top-", "plain: prefill of the SAE prompts"),
    ("plain vLLM, layers 0..L", "plain_mid: prefill", "plain: prefill"),
    ("mid: layers 0..L, no capture", "mid: prefill (no capture)", "plain: prefill"),
    ("mid: extract layer L", "mid: extract.default", "plain: prefill"),
    ("mid: extract layer L again", "mid: extract.default again", "plain: prefill"),
    ("mid: extract, no tail shards", "mid: extract.no_tail", "plain: prefill"),
    ("mid: extract, no tail shards again", "mid: extract.no_tail again", "plain: prefill"),
    ("mid: extract, tail shards 8x smaller", "mid: extract.tail_8", "plain: prefill"),
    ("mid: extract, fsync off", "mid: extract.no_fsync", "plain: prefill"),
    ("generation, no intervention", "layers: gen none", "plain: generation"),
    ("generation, one steering vector", "layers: gen steer", "plain: generation"),
    ("generation, clamp 4 SAE features", "bulk: gen clamp", "plain: generation"),
    ("generation, top-k SAE capture", "bulk: gen capture", "plain: generation"),
)


def ratio_lines(done: list[dict[str, Any]]) -> list[str]:
    """Each row's seconds over plain vLLM's (the mean of its plain phases of that name)."""

    def seconds(prefix: str, plain: bool) -> float | None:
        if plain:
            found = [d["seconds"] for d in done if d["phase"] in (prefix, prefix + " again")]
        else:
            found = [
                d["seconds"]
                for d in done
                if d["phase"].startswith(prefix)
                and ("again" not in d["phase"] or prefix.endswith("again"))
            ]
        if not found:
            return None
        return sum(found) / len(found) if plain else found[0]

    lines = []
    for row, phase, base in RATIOS:
        ours, plain = seconds(phase, False), seconds(base, True)
        if ours is not None and plain:
            lines.append(f"{row:36s} {ours:7.2f} s / plain {plain:6.2f} s = {ours / plain:.2f}x")
    return lines


def print_table(done: list[dict[str, Any]]) -> None:
    print("\n=== ratios to plain vLLM (same run) ===")
    print("\n".join(ratio_lines(done)))
    print("\n=== profile ===")
    for info in done:
        core = info.get("core", {})
        line = f"{info['phase'][:58]:58s} {info['seconds']:7.2f} s"
        if "error" in info:
            line += f" ERROR {info['error'][:200]}"
        if core.get("steps"):
            line += f" | steps {core['steps']} tok {core['tokens']} unc {core['uncompiled']}"
            if "gpu_busy_s" in core:
                line += f" gpu {core['gpu_busy_s']:.2f}s idle {core['gpu_idle_between_s']:.2f}s"
            line += f" host/step {core['host_ms_per_step']:.1f}ms"
            line += f" nowork {core['core_no_work_s']:.2f}s"
            line += f" head {core['before_first_step_s']:.2f}s"
            line += f" tail {core['after_last_step_s']:.2f}s"
        if "smi_util_mean" in info:
            line += f" smi {info['smi_util_mean']:.0f}%"
        print(line)
        if "stats" in info:
            s = info["stats"]
            print(
                f"    {s['gb']:.2f} GB {s['gb_per_s']:.2f} GB/s"
                f" engine_waited {s['engine_waited_s']:.2f}s"
                f" writers_waited {s['writers_waited_s']:.2f}s shards {s['shards']}"
            )
        if core.get("hooks_ms_per_step"):
            print(
                "    hooks ms/step "
                + ", ".join(f"{k} {v:.2f}" for k, v in core["hooks_ms_per_step"].items())
            )
        if core.get("worker_file_writes"):
            w = core["worker_file_writes"]
            print(
                f"    worker files {w['n']} {w['gb']:.2f} GB in {w['thread_s']:.2f} thread-s;"
                f" take rpc {core['take_rpc']['n']} {core['take_rpc']['s']:.2f}s"
            )
        for label, (n, s) in sorted(info.get("front_end", {}).items()):
            print(f"    {label}: {n} calls {s:.2f} s")
        if info.get("gil"):
            g = info["gil"]
            print(
                f"    GIL sleeper overshoot p50 {g['p50_ms']:.2f} ms p99 {g['p99_ms']:.2f} ms"
                f" total {g['total_s']:.2f} s >5ms {g['over_5ms']}"
            )
        for kind, top in info.get("stacks_ms", {}).items():
            if kind == "other":
                continue
            print(f"    [{kind}] " + "; ".join(f"{k} {ms}ms" for k, ms in top[:4]))
        if "uncompiled_steps" in info:
            print(f"    uncompiled steps (engine count): {info['uncompiled_steps']}")


if __name__ == "__main__":
    main()
