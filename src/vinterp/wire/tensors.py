"""Tensors as data: raw little-endian bytes with a dtype and shape, checked on the way in.

Every tensor decoder (graph constants, worker payloads, the base64 JSON form) ends here, so
a shape torch cannot hold or bytes that do not fill it fail the same way everywhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vinterp.wire.errors import WireError, short

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
MAX_DIMS = 64
# Bound on the product of a shape's sizes, zeros counted as ones: an empty tensor of shape
# (0, 2**40, 2**40) has no data to check it against, and torch's strides would overflow.
MAX_EXTENT = 2**48


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON true must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_shape(shape: Any, what: str) -> list[int]:
    """A shape from anyone: at most MAX_DIMS sizes >= 0 whose tensor torch can hold."""
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(is_int(d) and d >= 0 for d in shape)
        or math.prod(max(d, 1) for d in shape) > MAX_EXTENT
    ):
        raise WireError(
            f"{what}: bad shape {short(shape)}; a shape is a list of at most {MAX_DIMS} "
            f"sizes >= 0 whose product (zeros counted as ones) is at most 2**48"
        )
    return shape


def tensor_to_wire(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as wire data: its dtype, shape and raw bytes (copied to the CPU)."""
    t = t.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise WireError(f"tensor dtype {dtype} cannot travel; use one of {sorted(DTYPES)}")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": dtype, "shape": list(t.shape), "data": data}


def byte_size(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of a wire dtype and a checked shape."""
    return math.prod(shape) * DTYPES[dtype].itemsize


def tensor_from_wire(obj: Any, what: str = "tensor") -> torch.Tensor:
    """Inverse of `tensor_to_wire`, for data from anyone: raises only WireError."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError(f"{what}: a tensor is {{dtype, shape, data}}")
    dtype = obj["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"{what}: dtype {short(dtype)} not allowed; use one of {sorted(DTYPES)}")
    shape = check_shape(obj["shape"], what)
    data = obj["data"]
    if not isinstance(data, (bytes, bytearray)):
        raise WireError(f"{what}: data must be bytes, not {type(data).__name__}")
    if len(data) != byte_size(dtype, shape):
        raise WireError(
            f"{what}: {len(data)} bytes of data; shape {shape} in {dtype} needs "
            f"{byte_size(dtype, shape)}"
        )
    if not data:
        return torch.empty(shape, dtype=DTYPES[dtype])
    return torch.frombuffer(bytearray(data), dtype=DTYPES[dtype]).reshape(shape)
