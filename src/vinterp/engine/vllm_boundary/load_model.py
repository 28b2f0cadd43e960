"""The one patch of vLLM's model runners: `load_model`, wrapped so that vinterp decides per
engine, after vLLM loaded the model and before it compiles it, whether to install the sites."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# load(call_the_original, runner) -> what load_model returns
LoadModel = Callable[[Callable[[], Any], Any], Any]


def patch_load_model(runner_cls: Any, load: LoadModel) -> None:
    """Run `load` in place of `runner_cls.load_model` (once per class, whoever asks again)."""
    original = runner_cls.__dict__.get("load_model")
    if original is None or getattr(original, "_vinterp", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        return load(lambda: original(self, *args, **kwargs), self)

    load_model._vinterp = True  # type: ignore[attr-defined]
    runner_cls.load_model = load_model
