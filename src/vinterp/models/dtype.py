"""The dtype a checkpoint was saved in: what engines load it as unless told otherwise."""

from __future__ import annotations

from typing import Any


def checkpoint_dtype(config: Any) -> str:
    """The checkpoint's own dtype name (HF `config`): what both backends, `vinterp serve` and
    the bench load by default."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")
