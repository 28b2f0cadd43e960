"""nnsight's vLLM backend: one invoke per prompt in one trace (each invoke is a request).
vLLM's Llama layers return (hidden, residual), whose sum is the residual stream."""

from __future__ import annotations

from typing import Any

import torch

from .protocol import Task


def version() -> str:
    import nnsight

    return nnsight.__version__


def load(task: Task) -> Any:
    from nnsight.modeling.vllm import VLLM

    return VLLM(task.model, dtype="float32", dispatch=True, enable_prefix_caching=False)


def extract(model: Any, task: Task) -> torch.Tensor:
    import nnsight

    rows = []
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in task.prompts:
            with tracer.invoke(prompt):
                layers = [layer.output[0] + layer.output[1] for layer in model.model.layers]
                rows.append(nnsight.save([h[-1] for h in layers]))
    return torch.stack([torch.stack(list(row)) for row in rows])


def steer(model: Any, task: Task, vector: torch.Tensor) -> torch.Tensor:
    import nnsight

    vector = vector.to(task.device)
    tokens = []
    sampling = {"temperature": 0.0, "max_tokens": task.max_tokens, "ignore_eos": True}
    with model.trace(**sampling) as tracer:
        for prompt in task.prompts:
            with tracer.invoke(prompt):
                ids = nnsight.save([])
                for _step in tracer.iter[: task.max_tokens]:
                    model.model.layers[task.layer].output[0][:] += vector
                    ids.append(model.samples.item())
                tokens.append(ids)
    return torch.tensor([list(row) for row in tokens])
