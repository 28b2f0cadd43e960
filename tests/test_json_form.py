"""The JSON form of specs and captures (API.md section 6), without an engine."""

from __future__ import annotations

import json

import pytest
import torch

import vinterp
from vinterp.wire.errors import WireError
from vinterp.wire.json_form import (
    captures_to_json,
    saved_from_json,
    tensor_from_json,
    tensor_to_json,
)

STEERING = vinterp.Steering(
    {"layers.3.output": torch.randn(8), "layers.1.mlp.output": torch.randn(8)},
    scale=2.5,
    phase="decode",
    norm_match=True,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_round_trip_through_json_text(dtype) -> None:
    t = torch.randn(3, 5).to(dtype)
    back = tensor_from_json(json.loads(json.dumps(tensor_to_json(t))))
    assert back.dtype == dtype and torch.equal(back, t)


def test_specs_and_captures_round_trip() -> None:
    st_back = vinterp.Steering.from_json(json.loads(json.dumps(STEERING.to_json())))
    assert st_back.model_dump(exclude={"vectors"}) == STEERING.model_dump(exclude={"vectors"})
    for site, vector in STEERING.vectors.items():
        assert torch.equal(st_back.vectors[site], vector)
    cap = vinterp.Capture(["layers.*.output", "embed.output"], positions="all")
    assert vinterp.Capture.from_json(json.loads(json.dumps(cap.to_json()))) == cap
    captures = {"layers.0.output": torch.randn(4, 8), "embed.output": torch.randn(4, 8)}
    back = vinterp.captures_from_json(json.loads(json.dumps(captures_to_json(captures))))
    assert back.keys() == captures.keys()
    assert all(torch.equal(back[s], captures[s]) for s in captures)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.__setitem__("data", "not base64!"), "base64"),
        (lambda t: t.__setitem__("dtype", "int64"), "not allowed"),
        (lambda t: t.__setitem__("shape", [1 << 40]), "limit"),
        (lambda t: t.__setitem__("shape", [3]), "bytes of data"),
        (lambda t: t.pop("shape"), "a tensor is"),
        (lambda t: t.update(shape=[0, 1 << 40, 1 << 40], data=""), "bad shape"),
        (lambda t: t.__setitem__("shape", [1] * 100), "bad shape"),
    ],
)
def test_bad_tensors_name_the_problem(mutate, message) -> None:
    obj = tensor_to_json(torch.randn(8))
    mutate(obj)
    with pytest.raises(WireError, match=message):
        tensor_from_json(obj)


@pytest.mark.parametrize(
    "decode, obj, message",
    [
        (vinterp.Capture.from_json, {"sites": ["embed.output"], "self": 1}, "unknown fields"),
        (vinterp.Capture.from_json, {"sites": {"a": 1}}, "capture.sites: Input should be"),
        (vinterp.Capture.from_json, {"sites": ["logits"]}, "capture.sites: 'logits' cannot"),
        (vinterp.Capture.from_json, {"sites": ["x"], "sink": "filesystem"}, "capture.sites"),
        (vinterp.Capture.from_json, {"sites": ["embed.output"], "sink": "filesystem"}, "path"),
        (vinterp.Steering.from_json, {**STEERING.to_json(), "cls": 1}, "unknown fields"),
        (vinterp.Steering.from_json, {**STEERING.to_json(), "positions": "a"}, "positions"),
        (vinterp.Steering.from_json, {"vectors": []}, r"steering.vectors: expected"),
        (vinterp.Steering.from_json, [], "expected {vectors, scale"),
    ],
)
def test_bad_specs_name_the_field(decode, obj, message) -> None:
    with pytest.raises(WireError, match=message):
        decode(obj)


def test_saved_values_nested_too_deeply_are_refused() -> None:
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(WireError, match="nested more than"):
        saved_from_json(deep)
