"""Extraction of an SAE's top-k features on the CPU engine (tiny Llama, a random 4x SAE at
layers.1.output): the stored indices and values equal `sae.topk` of a dense extraction of the
host site; `vinterp extract --sae --topk` killed with SIGKILL and resumed in-process gives
exactly the uninterrupted dataset; another SAE or k in the same folder is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from killed_extract import KILLED_RUN

import vinterp
from vinterp.bench.bench_sae import random_sae
from vinterp.extraction.request import engine_settings
from vinterp.store import SpecMismatchError

pytestmark = [pytest.mark.engine("tiny"), pytest.mark.usefixtures("in_process")]

HOST = "layers.1.output"
FEATURES = f"{HOST}.sae.features"
DENSE = "layers.3.output"
SITES = [FEATURES, DENSE]
K = 8
PROMPTS = [
    "The capital of France is Paris.",
    "Once upon a time there was a small model",
    "Numbers 0 1 2 3 4 5",
    "def hello(world): return world + 1",
    "Researchers read the residual stream",
    "The capital of Italy is Rome.",
    "features for probes and sparse autoencoders",
    "The capital of Spain is",
]
KWARGS = {"skip_first": 1, "buffer_gb": 1.6e-4, "topk": K, "use_tqdm": False}  # ~1 prompt a shard


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sae") / "sae"
    random_sae(256, seed=0).save(path)
    return path


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def columns(out: Path) -> dict[str, torch.Tensor]:
    return datasets.load_from_disk(str(out)).with_format("torch")[:]


def test_a_killed_run_resumes_to_the_uninterrupted_top_k_dataset_equal_to_the_sae(
    engines: Any, tiny_llama: Any, sae_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    engines.release()  # one engine at a time: the killed run starts its own
    killed = tmp_path / "killed"
    args = ["extract", "--model", str(tiny_llama), "--prompts", str(prompts), "--out", str(killed)]
    args += ["--sites", ",".join(SITES), "--sae", f"{HOST}={sae_dir}", "--topk", str(K)]
    args += ["--skip-first", "1", "--buffer-gb", str(KWARGS["buffer_gb"])]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # the engine dies with it
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not manifest(killed)["complete"] and len(manifest(killed)["shards"]) < 3

    sae = vinterp.SAE.load(sae_dir)
    llm = engines.vllm(tiny_llama, **engine_settings(SITES))  # as `vinterp extract` starts it
    llm.attach_sae(HOST, sae)
    llm.extract(prompts, SITES, out=killed, **KWARGS)
    whole = tmp_path / "whole"
    before = llm.step_stats()
    llm.extract(prompts, SITES, out=whole, **KWARGS)
    after = llm.step_stats()  # the host's capture buffer gathered: the steps stayed compiled
    assert after["uncompiled_steps"] == before["uncompiled_steps"]
    assert after["graph_capture_steps"] > before["graph_capture_steps"]
    assert manifest(killed)["shards"] == manifest(whole)["shards"]
    assert len(manifest(whole)["shards"]) >= 4
    assert manifest(whole)["spec"]["sae_digest"] == {HOST: sae.digest}
    got, want = columns(killed), columns(whole)
    assert set(want) == {
        "prompt",
        "position",
        "token",
        DENSE,
        *(f"{FEATURES}.{c}" for c in ("indices", "values")),
    }
    for name in want:
        assert torch.equal(got[name], want[name]), name

    llm.extract(prompts, HOST, out=tmp_path / "dense", skip_first=1, use_tqdm=False)
    dense = columns(tmp_path / "dense")
    assert torch.equal(dense["position"], want["position"])
    indices, values = want[f"{FEATURES}.indices"], want[f"{FEATURES}.values"]
    want_indices, want_values = sae.topk(dense[HOST], K)
    assert indices.shape == values.shape == (len(dense[HOST]), K)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
    assert torch.equal(indices.sort().values, want_indices.sort().values)
    assert (values[:, 0] > 0).all()  # features that fire, not an empty encoding

    with pytest.raises(SpecMismatchError, match=r"topk: 8 in the directory, 4 now"):
        llm.extract(prompts, SITES, out=whole, **{**KWARGS, "topk": 4})
    llm.attach_sae(HOST, random_sae(256, seed=1))
    try:
        with pytest.raises(SpecMismatchError, match=rf"sae_digest.{HOST}: '{sae.digest}'"):
            llm.extract(prompts, SITES, out=whole, **KWARGS)
    finally:
        llm.attach_sae(HOST, sae)


def test_sae_sites_are_refused_before_anything_runs(
    engines: Any, tiny_llama: Any, sae_dir: Path, tmp_path: Path
) -> None:
    llm = engines.vllm(tiny_llama, **engine_settings(SITES))
    llm.attach_sae(HOST, vinterp.SAE.load(sae_dir))
    steps = llm.step_stats()["steps"]
    with pytest.raises(ValueError, match="needs a sparse autoencoder at layers.2.output"):
        llm.extract(PROMPTS, "layers.2.output.sae.features", out=tmp_path / "a", topk=K)
    with pytest.raises(ValueError, match="give topk=k"):
        llm.extract(PROMPTS, FEATURES, out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert llm.step_stats()["steps"] == steps
