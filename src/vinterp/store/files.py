"""Durable files: a file appears under its name only once it is complete (written to a hidden
temporary beside it, flushed to disk, then renamed over the name), so a process killed at any
moment leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP_SUFFIX = ".tmp"


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
