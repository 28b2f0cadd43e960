"""The intervention graph: what a trace recorded, as plain data.

Arguments are stored already encoded for the wire (see `encode_arg`): node references,
Python literals, slices, dtypes and nested tuples/lists. Tensors live in `Graph.tensors` and
are referenced by `const` nodes, so one user tensor used by many invokes is stored once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

NODE_KINDS = ("read", "write", "call", "const")
STEP_ZERO = -1  # Node.block for nodes outside any iteration block


@dataclass
class Node:
    """One recorded operation.

    kind: read (a site's value), write (replace a site's value; args = (value,) or
    (value, index)), call (a whitelisted op), const (a user tensor; args = (tensor_index,)).
    """

    kind: str
    target: str
    args: list[Any]
    kwargs: dict[str, Any]
    invoke: int
    block: int = STEP_ZERO
    line: str = ""


@dataclass
class Block:
    """Steps an iteration block runs at: start..stop-1 (stop None = to the end)."""

    start: int
    stop: int | None

    def contains(self, step: int) -> bool:
        return step >= self.start and (self.stop is None or step < self.stop)


@dataclass
class Invoke:
    """One prompt of a trace and its sampling settings."""

    prompt: list[int]
    sampling: dict[str, Any]


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    invokes: list[Invoke] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def step_of(self, node_id: int) -> Block | None:
        block = self.nodes[node_id].block
        return None if block == STEP_ZERO else self.blocks[block]


def ref(node_id: int) -> dict[str, int]:
    return {"ref": node_id}


def refs_in(value: Any) -> list[int]:
    """Node ids an encoded argument refers to."""
    if isinstance(value, dict):
        if "ref" in value:
            return [value["ref"]]
        return [r for item in value.get("items", value.get("slice", [])) for r in refs_in(item)]
    if isinstance(value, list):
        return [r for item in value for r in refs_in(item)]
    return []


def node_inputs(node: Node) -> list[int]:
    return refs_in(node.args) + refs_in(list(node.kwargs.values()))


def encode_arg(value: Any, to_ref: Any) -> Any:
    """Encode a Python argument; `to_ref(obj)` turns symbolic values and tensors into refs."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, slice):
        return {"slice": [encode_arg(v, to_ref) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, list, torch.Size)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: True, "items": [encode_arg(v, to_ref) for v in value]}
    encoded = to_ref(value)
    if encoded is None:
        raise TypeError(f"cannot use a {type(value).__name__} inside a trace")
    return encoded


def decode_arg(value: Any, resolve: Any) -> Any:
    """Inverse of `encode_arg`; `resolve(node_id)` gives a referenced node's value."""
    if isinstance(value, dict):
        if "ref" in value:
            return resolve(value["ref"])
        if "slice" in value:
            return slice(*(decode_arg(v, resolve) for v in value["slice"]))
        if "ellipsis" in value:
            return Ellipsis
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        items = [decode_arg(v, resolve) for v in value["items"]]
        return items if "list" in value else tuple(items)
    return value
