"""Engines that run the first N layers of a checkpoint (`vinterp.LLM(num_layers=N)`).

vLLM builds N layers from the config (`hf_overrides`); its loader would still hand the model
every later layer's weights, which the model has no parameter for. While a runner with the
setting loads its model, the checkpoint's weights of layers N and on are skipped, and the
model declares them unused, so vLLM does not even read a safetensors shard that holds only
those (`is_unused_checkpoint_weight`, vLLM's own filter for draft-model checkpoints).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from vinterp.engine.vllm_boundary import targets

# the layer index in a checkpoint weight's name: model.layers.N. (most families), h.N. (GPT-2)
LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_KEPT: ContextVar[int | None] = ContextVar("vinterp_kept_layers", default=None)


def beyond(kept: int) -> Callable[[str], bool]:
    """Whether a checkpoint weight belongs to a layer at or past `kept`."""

    def unused(name: str) -> bool:
        found = LAYER_NAME.search(name)
        return found is not None and int(found.group(1)) >= kept

    return unused


@contextmanager
def keeping_layers(kept: int | None) -> Iterator[None]:
    """While a model loads: skip the checkpoint's layers at or past `kept` (None: skip none)."""
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)


def patch_weight_loading() -> None:
    """Wrap vLLM's default loader's weight iterator (once) to honour `keeping_layers`."""
    loader = targets.resolve(targets.WEIGHT_LOADER)
    original = loader.get_all_weights
    if getattr(original, "_vinterp", False):
        return

    @functools.wraps(original)
    def get_all_weights(self: Any, model_config: Any, model: Any) -> Iterator[tuple[str, Any]]:
        kept = _KEPT.get()
        if kept is None:
            yield from original(self, model_config, model)
            return
        unused = beyond(kept)
        model.is_unused_checkpoint_weight = unused  # read by the loader to skip whole shards
        for name, weight in original(self, model_config, model):
            if not unused(name):
                yield name, weight

    get_all_weights._vinterp = True  # type: ignore[attr-defined]
    loader.get_all_weights = get_all_weights
