"""Where converted and generated checkpoints live, and how a finished one is recognised."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import platformdirs

_DONE_MARKER = ".vinterp-complete"


def cache_root() -> Path:
    """The user cache directory (override with VINTERP_CACHE_DIR)."""
    root = os.environ.get("VINTERP_CACHE_DIR") or platformdirs.user_cache_dir("vinterp")
    return Path(root)


def cached_checkpoint(name: str, build: Callable[[Path], None]) -> Path:
    """Return the cached checkpoint `name`, building it with `build(tmp_dir)` if missing.

    The build writes into a temporary sibling that is renamed into place only once complete,
    so an interrupted conversion never leaves a half-written checkpoint that later loads.
    """
    target = cache_root() / name
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / _DONE_MARKER).touch()
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
