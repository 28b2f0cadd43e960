"""Durable files: a file appears under its name only once it is complete (written to a hidden
temporary beside it, flushed to disk, then renamed over the name), so a process killed at any
moment leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP_SUFFIX = ".tmp"
# What a model directory's content hash reads: weights, configuration, tokenizer.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".tiktoken", ".gguf")


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> int:
    """Write `path` through `write(file)`; returns its size. On any failure the temporary is
    removed and `path` keeps its old content (or stays absent)."""
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)
    return path.stat().st_size


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, lambda file: file.write(json.dumps(obj, indent=1).encode()))


def sync_folder(folder: Path) -> None:
    """Make a rename in `folder` survive a power cut, not only a killed process."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def content_hash(folder: Path) -> str:
    """sha256 over the names and bytes of the model files directly in `folder`; read once per
    process while their sizes and modification times stay the same (gigabytes of weights)."""
    paths = [p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES]
    return hash_files(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths))


@functools.lru_cache(maxsize=16)
def hash_files(stats: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, size, _ in stats:
        digest.update(f"{Path(name).name}\0{size}\0".encode())
        with open(name, "rb") as file:
            while block := file.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()
