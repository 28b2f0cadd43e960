"""The JSON form of specs and captures (API.md section 6): what an HTTP client sends in the
`vinterp` extra body field and gets back in the response. Tensors travel as base64 bytes
with a dtype and shape; decoding checks every field and raises only WireError."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import torch

from vinterp.wire.errors import WireError, short
from vinterp.wire.tensors import (
    DTYPES,
    byte_size,
    check_shape,
    tensor_from_wire,
    tensor_to_wire,
)

JSON_DTYPES = ("float32", "float16", "bfloat16")
MAX_TENSOR_BYTES = 64 << 20  # one steering vector or captured site is far smaller
MAX_DEPTH = 64  # of nested lists and dicts: no real payload comes near it


def tensor_to_json(t: torch.Tensor, dtypes: tuple[str, ...] = JSON_DTYPES) -> dict[str, Any]:
    """A tensor in one of `dtypes` (others become float32)."""
    if str(t.dtype).removeprefix("torch.") not in dtypes:
        t = t.float()
    wire = tensor_to_wire(t)
    return {**wire, "data": base64.b64encode(wire["data"]).decode("ascii")}


def tensor_from_json(
    obj: Any, what: str = "tensor", dtypes: tuple[str, ...] = JSON_DTYPES
) -> torch.Tensor:
    """Inverse of `tensor_to_json`, for data from anyone: raises only WireError."""
    if not isinstance(obj, dict) or set(obj) != {"data", "dtype", "shape"}:
        raise WireError(f"{what}: a tensor is {{data (base64), dtype, shape}}")
    dtype = obj["dtype"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise WireError(f"{what}: dtype {short(dtype)} not allowed; use one of {dtypes}")
    shape = check_shape(obj["shape"], what)
    if byte_size(dtype, shape) > MAX_TENSOR_BYTES:
        raise WireError(f"{what}: {byte_size(dtype, shape)} bytes; the limit is {MAX_TENSOR_BYTES}")
    if not isinstance(obj["data"], str):
        raise WireError(f"{what}: data must be a base64 string")
    try:
        data = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, ValueError):
        raise WireError(f"{what}: data is not valid base64") from None
    return tensor_from_wire({"dtype": dtype, "shape": shape, "data": data}, what)


def captures_to_json(captures: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {site: tensor_to_json(value) for site, value in captures.items()}


def captures_from_json(obj: Any) -> dict[str, torch.Tensor]:
    """`{site: (P, H) tensor}` from a response's `vinterp.captures` field."""
    if not isinstance(obj, dict):
        raise WireError("captures: expected {site: tensor}")
    return {
        str(site): tensor_from_json(value, f"captures[{site!r}]") for site, value in obj.items()
    }


def saved_to_json(value: Any) -> Any:
    """A trace's saved value (tensor, list of them, or plain number) as JSON, any wire dtype."""
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_to_json(value, tuple(DTYPES))}
    if isinstance(value, list):
        return [saved_to_json(v) for v in value]
    return value


def saved_from_json(obj: Any, what: str = "saved", depth: int = 0) -> Any:
    """Inverse of `saved_to_json`: raises only WireError."""
    if depth > MAX_DEPTH:
        raise WireError(f"{what}: nested more than {MAX_DEPTH} deep")
    if isinstance(obj, dict):
        if set(obj) != {"tensor"}:
            raise WireError(f"{what}: expected {{tensor: ...}}")
        return tensor_from_json(obj["tensor"], what, tuple(DTYPES))
    if isinstance(obj, list):
        return [saved_from_json(v, what, depth + 1) for v in obj]
    return obj


def payload_to_json(payload: Any) -> Any:
    """A wire payload (nested lists/dicts with raw tensor bytes) as JSON-ready data: bytes
    become {"__b64__": base64 text}."""
    if isinstance(payload, (bytes, bytearray)):
        return {"__b64__": base64.b64encode(payload).decode("ascii")}
    if isinstance(payload, dict):
        return {k: payload_to_json(v) for k, v in payload.items()}
    if isinstance(payload, list):
        return [payload_to_json(v) for v in payload]
    return payload


def payload_from_json(obj: Any, depth: int = 0) -> Any:
    """Inverse of `payload_to_json`, for data from anyone: raises only WireError (the
    structure itself is checked by the wire decoder that reads the result)."""
    if depth > MAX_DEPTH:
        raise WireError(f"payload nested more than {MAX_DEPTH} deep")
    if isinstance(obj, dict):
        if set(obj) == {"__b64__"}:
            if not isinstance(obj["__b64__"], str):
                raise WireError("bytes must be a base64 string")
            try:
                return base64.b64decode(obj["__b64__"], validate=True)
            except (binascii.Error, ValueError):
                raise WireError("bytes are not valid base64") from None
        return {k: payload_from_json(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [payload_from_json(v, depth + 1) for v in obj]
    return obj


def payload_to_text(payload: Any) -> str:
    """A worker payload as JSON text: the only form vLLM's OpenAI server passes on to
    `SamplingParams.extra_args` (`vllm_xargs`)."""
    return json.dumps(payload_to_json(payload))


def payload_from_text(text: str) -> Any:
    """Inverse of `payload_to_text` (the text comes from vinterp's own server code)."""
    return payload_from_json(json.loads(text))
