"""`llm.extract` and `vinterp extract` on the CPU engine: rows read back through `datasets`
equal trace saves of the same tokens, a run killed with SIGKILL and run again gives exactly
the uninterrupted dataset, and bad input is refused before anything runs."""

from __future__ import annotations

import errno
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
from vinterp.engine.vllm_boundary.engine_core_calls import collective_rpc_later
from vinterp.extraction import request as request_module
from vinterp.extraction.packing import windows
from vinterp.extraction.request import engine_settings
from vinterp.store import SpecMismatchError, StoreError, files

pytestmark = [pytest.mark.engine("tiny"), pytest.mark.usefixtures("in_process")]

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
SITES = ["layers.1.output", "layers.3.output"]
# Shards of about two prompts of the tiny model (2 sites x 256 floats a row), so the runs
# below write several.
SMALL_BUFFER_GB = 1.6e-4


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def extract_args(model: Any, prompts: Path, out: Path) -> list[str]:
    return [
        "extract",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--sites",
        ",".join(SITES),
        "--skip-first",
        "1",
        "--out",
        str(out),
        "--buffer-gb",
        str(SMALL_BUFFER_GB),
    ]


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def columns(out: Path) -> dict[str, torch.Tensor]:
    return columns_of(datasets.load_from_disk(str(out)))


def columns_of(dataset: Any) -> dict[str, torch.Tensor]:
    return dataset.with_format("torch")[:]


def test_a_killed_run_resumes_to_exactly_the_uninterrupted_dataset(
    engines: Any, tiny_llama: Any, prompts_file: Path, tmp_path: Path
) -> None:
    engines.release()  # one engine at a time: the killed run starts its own
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [
            *(sys.executable, "-c", KILLED_RUN),
            *extract_args(tiny_llama, prompts_file, killed),
            *("--engine-dtype", "float32"),  # the checkpoint's, named: resumed by `llm` below
        ],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # the engine dies with it
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    left = manifest(killed)
    assert not left["complete"] and len(left["shards"]) < 3
    unlisted = killed / f"data-{len(left['shards']):05d}.arrow"
    assert unlisted.exists()  # complete-looking, but not listed

    llm = engines.vllm(tiny_llama, **engine_settings(SITES))  # the engine `vinterp extract` starts
    kwargs = {"skip_first": 1, "buffer_gb": SMALL_BUFFER_GB, "use_tqdm": False}
    resumed = llm.extract(prompts_file, SITES, out=killed, **kwargs).dataset
    whole = tmp_path / "whole"
    run = llm.extract(prompts_file, SITES, out=whole, **kwargs)
    uninterrupted = run.dataset
    assert run.stats.rows == len(uninterrupted) and run.stats.shards >= 4
    assert run.stats.bytes == manifest(whole)["totals"]["bytes"] and run.stats.seconds > 0
    assert len(manifest(whole)["shards"]) >= 4
    assert manifest(killed)["shards"] == manifest(whole)["shards"]
    assert len(resumed) == len(uninterrupted) == sum(len(llm.encode(p)) - 1 for p in PROMPTS)
    got, want = columns(killed), columns(whole)
    assert set(got) == set(want) == {"prompt", "position", "token", *SITES}
    for name in want:
        assert torch.equal(got[name], want[name]), name


def fill_the_disk_after_the_first_shard(monkeypatch: Any) -> None:
    """Every shard file after the first fails to write, as on a full disk."""
    write_atomic = files.write_atomic

    def disk_full(path: Path, write: Any) -> int:
        if path.name.startswith("data-") and path.name != "data-00000.arrow":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_atomic(path, write)

    monkeypatch.setattr(files, "write_atomic", disk_full)


def test_a_failed_run_leaves_the_engine_as_it_was(
    engines: Any, tiny_llama: Any, prompts_file: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """The disk fills up at the second shard: a StoreError naming it; the requests still
    queued are aborted and the workers hold none of the run's rows, so the next calls answer
    as before; the same run, once there is room, finishes the dataset an unbroken run gives."""
    llm = engines.vllm(tiny_llama, **engine_settings(SITES))
    before = [o.token_ids for o in llm.generate(PROMPTS, max_tokens=3, use_tqdm=False)]
    fill_the_disk_after_the_first_shard(monkeypatch)
    kwargs = {"skip_first": 1, "buffer_gb": SMALL_BUFFER_GB, "use_tqdm": False}
    out = tmp_path / "full"
    with pytest.raises(StoreError, match="data-00001.arrow.*No space left on device"):
        llm.extract(PROMPTS * 3, SITES, out=out, **kwargs)
    monkeypatch.undo()
    native = llm.backend.native
    assert not native.llm_engine.has_unfinished_requests()
    assert [held["captures"] for held in native.collective_rpc("vinterp_held_state")] == [0]
    assert list(llm.backend._handoff.directory.iterdir()) == []
    assert [o.token_ids for o in llm.generate(PROMPTS, max_tokens=3, use_tqdm=False)] == before

    assert len(manifest(out)["shards"]) == 1
    resumed = columns_of(llm.extract(PROMPTS * 3, SITES, out=out, **kwargs).dataset)
    whole = columns_of(llm.extract(PROMPTS * 3, SITES, out=tmp_path / "whole", **kwargs).dataset)
    assert manifest(out)["shards"] == manifest(tmp_path / "whole")["shards"]
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name


def test_a_packed_corpus_is_extracted_window_by_window_and_resumes(
    engines: Any, tiny_llama: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """A corpus of parquet files packed into 24-token windows: a row per window token, its
    `prompt` the window's number, its tokens the window's; the rows equal those of the same
    windows given as token-id prompts; a run the disk stops at its second shard continues to
    exactly that dataset."""
    llm = engines.vllm(tiny_llama, **engine_settings(SITES))
    (tmp_path / "corpus").mkdir()
    texts = datasets.Dataset.from_dict({"text": PROMPTS * 4})
    texts.select(range(12)).to_parquet(str(tmp_path / "corpus" / "0.parquet"))
    texts.select(range(12, 32)).to_parquet(str(tmp_path / "corpus" / "1.parquet"))
    packed = vinterp.Packed(tmp_path / "corpus", 24)
    kwargs = {"buffer_gb": SMALL_BUFFER_GB, "use_tqdm": False}
    fill_the_disk_after_the_first_shard(monkeypatch)
    with pytest.raises(StoreError, match="data-00001.arrow"):
        llm.extract(packed, SITES, out=tmp_path / "packed", **kwargs)
    monkeypatch.undo()
    assert len(manifest(tmp_path / "packed")["shards"]) == 1
    got = columns_of(llm.extract(packed, SITES, out=tmp_path / "packed", **kwargs).dataset)
    cut = list(windows(PROMPTS * 4, llm.tokenizer, 24))
    assert len(cut) >= 8 and manifest(tmp_path / "packed")["spec"]["prompts"]["count"] == len(cut)
    assert got["token"].tolist() == [t for window in cut for t in window]
    assert got["prompt"].tolist() == [i for i, window in enumerate(cut) for _ in window]
    want = columns_of(llm.extract(cut, SITES, out=tmp_path / "ids", **kwargs).dataset)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    "settings", [engine_settings(SITES), {}], ids=["extraction engine", "default engine"]
)
def test_rows_equal_trace_saves_of_the_same_tokens(
    engines: Any, tiny_llama: Any, tmp_path: Path, settings: dict[str, Any]
) -> None:
    """On the engine `vinterp extract` starts (SITES captured in the compiled graph, the
    other layers in uncompiled steps) and on a default one."""
    llm = engines.vllm(tiny_llama, **settings)
    prompts = PROMPTS[:3]
    llm.extract(prompts, "layers.*.output", out=tmp_path, buffer_gb=SMALL_BUFFER_GB)
    rows = columns(tmp_path)
    for index, prompt in enumerate(prompts):
        with llm.trace(prompt, max_tokens=1, use_tqdm=False):
            saves = [llm.layers[i].output.save() for i in range(4)]
        mine = rows["prompt"] == index
        ids = llm.encode(prompt)
        assert rows["position"][mine].tolist() == list(range(len(ids)))
        assert rows["token"][mine].tolist() == ids
        for i, saved in enumerate(saves):
            got = rows[f"layers.{i}.output"][mine]
            assert got.dtype == torch.float32 and got.shape == saved.shape
            assert ((got - saved).abs().max() / saved.abs().max()).item() <= 1e-6


def test_the_extraction_engine_steers_in_uncompiled_steps_as_the_reference_does(
    engines: Any, tiny_llama: Any
) -> None:
    """Its compiled model holds no steering formula (`steering_in_graph=False`): unsteered
    steps stay compiled, a steered request's steps run uncompiled and give the tokens the
    transformers reference gives under the same steering."""
    llm = engines.vllm(tiny_llama, **engine_settings(SITES))
    vector = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(3))
    steering = vinterp.Steering({"layers.1.output": vector}, scale=8.0)
    sampling = {"max_tokens": 4, "ignore_eos": True, "use_tqdm": False}
    before = llm.step_stats()
    plain = llm.generate(PROMPTS[:2], **sampling)
    middle = llm.step_stats()
    assert middle["uncompiled_steps"] == before["uncompiled_steps"]
    steered = llm.generate(PROMPTS[:2], steering=steering, **sampling)
    after = llm.step_stats()
    ran = {key: after[key] - middle[key] for key in ("steps", "uncompiled_steps")}
    assert ran["uncompiled_steps"] == ran["steps"] > 0
    want = engines.hf(tiny_llama).generate(PROMPTS[:2], steering=steering, **sampling)
    assert [o.token_ids for o in steered] == [o.token_ids for o in want]
    assert [o.token_ids for o in steered] != [o.token_ids for o in plain]


def test_rows_equal_the_transformers_backends_with_one_prompt_queued_at_a_time(
    engines: Any, tiny_llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs come back while later prompts are still being queued (one at a time here),
    on the vLLM engine and on the transformers reference alike."""
    monkeypatch.setattr(request_module, "QUEUED_STEPS", 0)
    kwargs = {"buffer_gb": 1.0, "use_tqdm": False}  # every prompt in one shard
    got = columns_of(
        engines.vllm(tiny_llama).extract(PROMPTS, SITES, out=tmp_path / "v", **kwargs).dataset
    )
    want = columns_of(
        engines.hf(tiny_llama).extract(PROMPTS, SITES, out=tmp_path / "h", **kwargs).dataset
    )
    assert len(manifest(tmp_path / "v")["shards"]) == 1
    for name in ("prompt", "position", "token"):
        assert torch.equal(got[name], want[name]), name
    for site in SITES:
        assert float((got[site] - want[site]).norm() / want[site].norm()) <= 1e-4, site


def test_a_worker_call_sent_without_waiting_gets_the_answer_collective_rpc_gets(
    engines: Any, tiny_llama: Any
) -> None:
    native = engines.vllm(tiny_llama).backend.llm
    later = collective_rpc_later(native, "vinterp_step_stats")
    assert later(timeout=60) == native.collective_rpc("vinterp_step_stats")


def test_positions_skip_first_dtype_and_too_long_prompts(
    engines: Any, tiny_llama: Any, tmp_path: Path
) -> None:
    llm = engines.vllm(tiny_llama)
    too_long = "1 2 3 " * 400  # past the tiny model's 512 tokens
    prompts = [PROMPTS[0], too_long, "The", PROMPTS[2]]
    lengths = [len(llm.encode(p)) for p in prompts]
    assert lengths[1] >= 512 and lengths[2] == 1

    last = llm.extract(
        prompts, "layers.2.output", out=tmp_path / "last", positions="last_prompt", dtype="float16"
    ).dataset
    assert last.features["layers.2.output"].feature.dtype == "float16"
    assert last["prompt"][:] == [0, 2, 3]
    assert last["position"][:] == [lengths[0] - 1, 0, lengths[3] - 1]
    totals = manifest(tmp_path / "last")["totals"]
    assert totals["skipped_too_long"] == 1 and totals["rows"] == 3

    out = tmp_path / "list"
    listed = llm.extract(
        prompts, "layers.2.output", out=out, positions=[0, 1, 5], skip_first=1
    ).dataset
    assert lengths[0] > 5 and lengths[3] > 5
    assert listed["prompt"][:] == [0, 0, 3, 3] and listed["position"][:] == [1, 5, 1, 5]
    assert manifest(tmp_path / "list")["totals"]["prompts_without_rows"] == 1  # "The"


def test_another_spec_in_the_same_folder_is_refused(
    engines: Any, tiny_llama: Any, tmp_path: Path
) -> None:
    llm = engines.vllm(tiny_llama)
    llm.extract(PROMPTS[:2], "layers.1.output", out=tmp_path, use_tqdm=False)
    steps = llm.step_stats()["steps"]
    again = llm.extract(PROMPTS[:2], "layers.1.output", out=tmp_path, use_tqdm=False)
    assert llm.step_stats()["steps"] == steps and len(again.dataset) > 0  # complete: nothing run
    assert again.stats.rows == 0 and again.stats.seconds == 0
    with pytest.raises(SpecMismatchError, match=r"(?s)another spec.*sites: \['layers.1.output'\]"):
        llm.extract(PROMPTS[:2], "layers.2.output", out=tmp_path)
    with pytest.raises(SpecMismatchError, match="prompts.sha256"):
        llm.extract(PROMPTS[2:4], "layers.1.output", out=tmp_path)


@pytest.mark.parametrize(
    ("prompts", "sites", "error"),
    [
        (PROMPTS, "layers.4.output", "layer index 4 is out of range; this model has layers 0..3"),
        (PROMPTS, "layers.1.outptu", "cannot be captured"),
        (PROMPTS, "logits", "cannot be captured"),
        (["a", "b", ""], "layers.1.output", "prompt 2 of the list of 3 prompts is empty"),
        ([[3, 4], []], "layers.1.output", "prompt 1 of the list of 2 prompts has no token ids"),
        (
            vinterp.Packed(PROMPTS, 100_000),
            "layers.1.output",
            "context_size=100000: this engine takes prompts of at most",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_runs(
    engines: Any, tiny_llama: Any, tmp_path: Path, prompts: list[str], sites: str, error: str
) -> None:
    llm = engines.vllm(tiny_llama)
    steps = llm.step_stats()["steps"]
    with pytest.raises(ValueError, match=error):
        llm.extract(prompts, sites, out=tmp_path / "out")
    assert not (tmp_path / "out").exists() and llm.step_stats()["steps"] == steps
