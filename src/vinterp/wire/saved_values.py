"""A trace's saved values as they cross vLLM's RPC from a worker to the front end: tensors as
wire tensors (vLLM's own encoding does not round-trip tensors nested in containers)."""

from __future__ import annotations

from typing import Any

import torch

from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire


def encode_saved(value: Any) -> Any:
    """A saved value (a tensor, a list of them per generation step, or a plain value)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_to_wire(value)}
    if isinstance(value, list):
        return [encode_saved(v) for v in value]
    return value


def decode_saved(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return tensor_from_wire(value["tensor"])
    if isinstance(value, list):
        return [decode_saved(v) for v in value]
    return value
