"""nnsight's `LanguageModel` on HF transformers: saves inside `model.trace`, steering as an
edit of one layer's output on every step of `model.generate`. The trace stops after the
last layer, so no LM head runs for extraction."""

from __future__ import annotations

from typing import Any

import torch

from .batching import PAD
from .protocol import Task


def version() -> str:
    import nnsight

    return nnsight.__version__


def load(task: Task) -> Any:
    from nnsight import LanguageModel

    model = LanguageModel(task.model, dtype=torch.float32, device_map=task.device, dispatch=True)
    model.generation_config.eos_token_id = None  # exactly max_tokens, like ignore_eos
    model.generation_config.pad_token_id = PAD
    return model


def _chunks(task: Task) -> list[list[list[int]]]:
    return [task.prompts[i : i + task.batch] for i in range(0, len(task.prompts), task.batch)]


@torch.no_grad()
def extract(model: Any, task: Task) -> torch.Tensor:
    import nnsight

    rows = []
    for chunk in _chunks(task):  # nnsight pads on the left: the last token is at -1
        with model.trace(chunk) as tracer:
            saved = nnsight.save([layer.output[:, -1] for layer in model.model.layers])
            tracer.stop()
        rows.append(torch.stack(saved, dim=1))
    return torch.cat(rows)


@torch.no_grad()
def steer(model: Any, task: Task, vector: torch.Tensor) -> torch.Tensor:
    vector = vector.to(task.device)
    tokens = []
    for chunk in _chunks(task):
        with model.generate(chunk, max_new_tokens=task.max_tokens, do_sample=False) as tracer:
            for _step in tracer.iter[: task.max_tokens]:  # one forward per new token
                model.model.layers[task.layer].output += vector
            ids = tracer.result.save()
        tokens.append(ids[:, -task.max_tokens :])
    return torch.cat(tokens)
