"""The JSON form of specs and captures (API.md section 6), without an engine."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vinterp
from vinterp.ir.wire import WireError
from vinterp.wire.json_form import captures_to_json, tensor_from_json, tensor_to_json

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
    ],
)
def test_bad_tensors_name_the_problem(mutate, message) -> None:
    obj = tensor_to_json(torch.randn(8))
    mutate(obj)
    with pytest.raises(WireError, match=message):
        tensor_from_json(obj)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_steering_json_fails_only_with_clear_errors(data) -> None:
    """One value of a valid steering's JSON replaced: a spec, a WireError or a ValueError
    (pydantic's validation error) — never TypeError/KeyError/AttributeError."""
    obj = copy.deepcopy(STEERING.to_json())
    vector = data.draw(st.sampled_from(sorted(obj["vectors"])))
    target = data.draw(st.sampled_from([obj, obj["vectors"], obj["vectors"][vector]]))
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(_json)
    try:
        vinterp.Steering.from_json(obj)
    except (WireError, ValueError):
        pass
