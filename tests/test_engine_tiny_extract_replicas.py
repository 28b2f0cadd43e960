"""Data-parallel extraction on the CPU engine: two replicas as Ray actors (Ray started on this
machine), each loading an SAE from its directory, write the dataset (residual rows and the
SAE's top-k features) one engine writes, shard for shard; a replica that dies ends the run
with an error naming it, and the same call with one engine continues to exactly that
dataset; an extraction of an early layer runs only the layers up to it. The tiny model keeps
two engines at once bearable on two cores."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import datasets
import psutil
import pytest
import torch

import vinterp
from vinterp.bench.bench_sae import random_sae
from vinterp.extraction.replicas import ReplicaError

pytestmark = pytest.mark.engine("tiny", releases=True)  # the replicas start their own

BASE = [
    "The capital of France is Paris.",
    "Once upon a time there was a small model",
    "Numbers 0 1 2 3 4 5",
    "def hello(world): return world + 1",
    "Researchers read the residual stream",
    "features for probes and sparse autoencoders",
]
PROMPTS = [f"{text} ({i})" for i in range(40) for text in BASE]
FEATURES = "layers.1.output.sae.features"
SITES = ["layers.1.output", "layers.3.output", FEATURES]
TOPK = 8
COLUMNS = {*SITES[:2], *(f"{FEATURES}.{c}" for c in ("indices", "values"))}


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def columns(out: Path) -> dict[str, torch.Tensor]:
    return datasets.load_from_disk(str(out)).with_format("torch")[:]


def assert_same_dataset(got: Path, want: Path) -> None:
    assert manifest(got)["shards"] == manifest(want)["shards"]
    a, b = columns(got), columns(want)
    assert set(a) == set(b) == {"prompt", "position", "token", *COLUMNS}
    for name in b:
        if name.endswith(".values"):  # the worker encodes each step's rows: a replica's steps
            # batch other rows, and the encoder's matmul may round their last bits otherwise
            assert torch.allclose(a[name], b[name], rtol=1e-5, atol=0), name
        else:
            assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def kwargs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Shards of ~2 prompts; the SAE given as a directory (each replica loads it)."""
    sae = tmp_path_factory.mktemp("sae") / "sae"
    random_sae(256, seed=0).save(sae)
    saes = {"layers.1.output": sae}
    return {"skip_first": 1, "buffer_gb": 1.6e-4, "use_tqdm": False, "saes": saes, "topk": TOPK}


@pytest.fixture(scope="module")
def one_engine(
    engines: Any, tiny_llama: Any, kwargs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The dataset of one engine in this process."""
    engines.release()  # one engine at a time
    out = tmp_path_factory.mktemp("one") / "acts"
    run = vinterp.extract(tiny_llama, PROMPTS, SITES, out=out, **kwargs)
    assert run.stats.rows == len(run.dataset) > 0 and len(manifest(out)["shards"]) >= 6
    return out


def test_two_replicas_write_the_dataset_one_engine_writes(
    one_engine: Path, tiny_llama: Any, kwargs: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "two"
    run = vinterp.extract(tiny_llama, PROMPTS, SITES, out=out, data_parallel_size=2, **kwargs)
    assert_same_dataset(out, one_engine)
    assert run.stats.rows == len(run.dataset) and run.stats.shards == len(manifest(out)["shards"])
    assert manifest(out)["complete"]


def replica_processes() -> list[psutil.Process]:
    """The replicas' actor processes (Ray titles them after the actor's class)."""
    return [
        process
        for process in psutil.process_iter(["cmdline"])
        if any("ExtractReplica" in part for part in process.info["cmdline"] or ())
    ]


def test_a_replica_that_dies_ends_the_run_naming_it_and_the_dataset_resumes(
    one_engine: Path, tiny_llama: Any, kwargs: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    failure: list[BaseException] = []

    def run() -> None:
        try:
            vinterp.extract(tiny_llama, PROMPTS, SITES, out=out, data_parallel_size=2, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and thread.is_alive():
        if (out / "manifest.json").exists() and manifest(out)["shards"]:
            break
        time.sleep(0.2)
    victims = replica_processes()
    assert len(victims) == 2, "two replicas run"
    engine = victims[1].children(recursive=True)  # its engine core and worker
    assert engine
    victims[1].kill()  # the actor alone: its engine processes end with it
    gone, alive = psutil.wait_procs(engine, timeout=60)
    assert not alive, alive
    thread.join(600)
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], ReplicaError), failure
    message = str(failure[0])
    assert "extraction replica" in message and "of 2 failed" in message, message
    assert "stay valid" in message and "run again continues" in message
    left = manifest(out)
    assert not left["complete"] and 0 < len(left["shards"]) < len(manifest(one_engine)["shards"])
    vinterp.extract(tiny_llama, PROMPTS, SITES, out=out, **kwargs)  # one engine, here
    assert_same_dataset(out, one_engine)


def test_an_extraction_of_an_early_layer_runs_only_the_layers_up_to_it(
    one_engine: Path,
    engines: Any,
    tiny_llama: Any,
    kwargs: dict[str, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`vinterp.extract` of layer 1 of the 4 starts an engine of layers 0 and 1 (the
    checkpoint's layers 2 and 3 neither built nor loaded): its rows are bit for bit those of
    the whole model (captured in the compiled graph on both engines), and equal the
    transformers reference's."""
    site = "layers.1.output"
    early = {k: v for k, v in kwargs.items() if k not in ("saes", "topk")}
    with caplog.at_level(logging.INFO, logger="vinterp.extraction.launch"):
        run = vinterp.extract(tiny_llama, PROMPTS, site, out=tmp_path / "early", **early)
    assert "runs layers 0..1 of 4" in caplog.text
    got, whole = columns(tmp_path / "early"), columns(one_engine)
    assert set(got) == {"prompt", "position", "token", site} and len(run.dataset) > 0
    for name in got:
        assert torch.equal(got[name], whole[name]), name
    first = PROMPTS[:6]
    engines.hf(tiny_llama).extract(first, site, out=tmp_path / "hf", **early)
    reference = columns(tmp_path / "hf")[site]
    mine = got[site][got["prompt"] < len(first)]
    assert mine.shape == reference.shape
    assert float((mine - reference).norm() / reference.norm()) <= 1e-4
