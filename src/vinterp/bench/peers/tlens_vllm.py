"""TransformerLens 4.x's vLLM bridge (`RemoteBridge.boot_vllm`): the same calls as the
`TransformerBridge` peer (`tlens`), with vLLM driving the forward pass."""

from __future__ import annotations

from typing import Any

import torch

from .protocol import Task
from .tlens import extract, steer, version

__all__ = ["extract", "load", "steer", "version"]


def load(task: Task) -> Any:
    from transformer_lens.model_bridge.remote_bridge import RemoteBridge

    return RemoteBridge.boot_vllm(task.model, dtype=torch.float32, enable_batching=True)
