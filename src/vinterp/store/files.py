"""Durable files: a file appears under its name only once it is complete (written to a hidden
temporary beside it, flushed to disk, then renamed over the name), so a process killed at any
moment leaves the old file or the new one, never a torn one.

A large file's bytes go to the disk while it is still being written: every `WRITEBACK_BYTES`
the kernel is asked to start writing the slice out (`posix_fadvise(DONTNEED)` starts the
writeback of a range's dirty pages without waiting for it, on Linux), so the fsync at the end
waits for the last slice, not the whole file. An extraction's last shards are written after
the engine's last step, so their write-and-fsync is time the run waits for."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP_SUFFIX = ".tmp"
WRITEBACK_BYTES = 8 << 20


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> int:
    """Write `path` through `write(file)`; returns its size. On any failure the temporary is
    removed and `path` keeps its old content (or stays absent)."""
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as file:
            write(EarlyWriteback(file))
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


class EarlyWriteback:
    """`file` (opened for writing from its start) whose bytes the kernel starts writing to
    disk every `WRITEBACK_BYTES` written; anything else is the file's own."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._written = 0  # bytes written through this object
        self._kicked = 0  # bytes whose writeback was asked for
        self._kicks = hasattr(os, "posix_fadvise")  # not on every platform

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITEBACK_BYTES):
            part = view[start : start + WRITEBACK_BYTES]
            self._file.write(part)
            self._written += len(part)
            if self._written - self._kicked >= WRITEBACK_BYTES:
                self._kick()
        return len(view)

    def _kick(self) -> None:
        """Ask the kernel to start writing the bytes not yet asked for (a file system that
        cannot, e.g. a pipe's, ends the asking; the bytes are written all the same)."""
        if not self._kicks:
            return
        self._file.flush()
        try:
            os.posix_fadvise(
                self._file.fileno(),
                self._kicked,
                self._written - self._kicked,
                os.POSIX_FADV_DONTNEED,
            )
        except OSError:
            self._kicks = False
        self._kicked = self._written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)
