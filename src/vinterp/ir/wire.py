"""The wire format of a graph: data only, validated on the way in.

Used unchanged in-process and by the server: op names must be on the whitelist (ir.ops),
sites must exist, references must point backwards, tensors are raw little-endian bytes with
a dtype and shape. Nothing is unpickled and nothing from the client is executed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vinterp.ir.graph import NODE_KINDS, STEP_ZERO, Block, Graph, Invoke, Node
from vinterp.ir.ops import ALL_OPS
from vinterp.sites.names import SiteOrder

WIRE_VERSION = 1
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_ARG_KEYS = ({"ref"}, {"slice"}, {"ellipsis"}, {"dtype"}, {"list", "items"}, {"tuple", "items"})
MAX_NODES = 1_000_000


class WireError(ValueError):
    """A serialized graph that is malformed or asks for something not allowed."""


def tensor_to_wire(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise WireError(f"tensor dtype {dtype} cannot travel; use one of {sorted(DTYPES)}")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": dtype, "shape": list(t.shape), "data": data}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tensor_from_wire(obj: Any) -> torch.Tensor:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError("a tensor is {dtype, shape, data}")
    dtype = DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise WireError(
            f"tensor dtype {obj['dtype']!r:.40} not allowed; use one of {sorted(DTYPES)}"
        )
    shape = obj["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise WireError(f"bad tensor shape {shape!r:.80}")
    data = obj["data"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not isinstance(data, (bytes, bytearray)) or len(data) != math.prod(shape) * itemsize:
        raise WireError(f"tensor data has the wrong length for shape {shape} and {obj['dtype']}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def to_wire(graph: Graph) -> dict[str, Any]:
    return {
        "version": WIRE_VERSION,
        "nodes": [
            [n.kind, n.target, n.args, n.kwargs, n.invoke, n.block, n.line] for n in graph.nodes
        ],
        "tensors": [tensor_to_wire(t) for t in graph.tensors],
        "blocks": [[b.start, b.stop] for b in graph.blocks],
        "invokes": [{"prompt": i.prompt, "sampling": i.sampling} for i in graph.invokes],
        "saves": list(graph.saves),
    }


def _check_arg(value: Any, node_id: int, depth: int = 0) -> None:
    if depth > 16:
        raise WireError(f"node {node_id}: arguments nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for v in value:
            _check_arg(v, node_id, depth + 1)
        return
    if not isinstance(value, dict) or set(value) not in _ARG_KEYS:
        raise WireError(f"node {node_id}: argument {value!r:.80} is not a wire value")
    if "ref" in value:
        r = value["ref"]
        if not isinstance(r, int) or not 0 <= r < node_id:
            raise WireError(f"node {node_id}: reference {r!r} must name an earlier node")
    elif "slice" in value:
        if not isinstance(value["slice"], list) or len(value["slice"]) != 3:
            raise WireError(f"node {node_id}: a slice has three parts")
        _check_arg(value["slice"], node_id, depth + 1)
    elif "dtype" in value:
        if value["dtype"] not in DTYPES:
            raise WireError(f"node {node_id}: dtype {value['dtype']!r} not allowed")
    elif "items" in value:
        if not isinstance(value["items"], list):
            raise WireError(f"node {node_id}: items must be a list")
        _check_arg(value["items"], node_id, depth + 1)


def _list(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key, [])
    if not isinstance(value, list):
        raise WireError(f"{key} must be a list")
    return value


def _block(raw: Any, index: int) -> Block:
    if not (isinstance(raw, list) and len(raw) == 2 and _is_int(raw[0]) and raw[0] >= 0):
        raise WireError(f"block {index}: a block is [start, stop] with start >= 0")
    if not (raw[1] is None or (_is_int(raw[1]) and raw[1] > raw[0])):
        raise WireError(f"block {index}: stop must be None or after start")
    return Block(raw[0], raw[1])


def _scalar_or_list(value: Any) -> bool:
    if isinstance(value, list):
        return all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _invoke(raw: Any, index: int) -> Invoke:
    if not isinstance(raw, dict) or set(raw) != {"prompt", "sampling"}:
        raise WireError(f"invoke {index}: an invoke is {{prompt, sampling}}")
    prompt, sampling = raw["prompt"], raw["sampling"]
    if not isinstance(prompt, list) or not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
        raise WireError(f"invoke {index}: the prompt must be a non-empty list of token ids")
    if not isinstance(sampling, dict) or not all(
        isinstance(k, str) and _scalar_or_list(v) for k, v in sampling.items()
    ):
        raise WireError(f"invoke {index}: sampling must map option names to plain values")
    return Invoke(list(prompt), dict(sampling))


def _node(raw: Any, node_id: int, graph: Graph, sites: SiteOrder) -> Node:
    if not isinstance(raw, list) or len(raw) != 7:
        raise WireError(
            f"node {node_id}: a node is [kind, target, args, kwargs, invoke, block, line]"
        )
    kind, target, args, kwargs, invoke, block, line = raw
    if not isinstance(kind, str) or kind not in NODE_KINDS:
        raise WireError(f"node {node_id}: unknown kind {kind!r:.40}")
    if not isinstance(target, str):
        raise WireError(f"node {node_id}: the target must be a string")
    if kind in ("read", "write"):
        sites[target]  # raises UnknownSiteError with a helpful message
    elif kind == "call" and target not in ALL_OPS:
        raise WireError(f"node {node_id}: operation {target!r:.60} is not allowed")
    if not isinstance(args, list):
        raise WireError(f"node {node_id}: args must be a list")
    if kind == "const" and not (
        len(args) == 1 and _is_int(args[0]) and 0 <= args[0] < len(graph.tensors)
    ):
        raise WireError(f"node {node_id}: const must name one of the graph's tensors")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise WireError(f"node {node_id}: kwargs must map names to values")
    _check_arg(args, node_id)
    _check_arg(list(kwargs.values()), node_id)
    if not (_is_int(block) and (block == STEP_ZERO or 0 <= block < len(graph.blocks))):
        raise WireError(f"node {node_id}: unknown iteration block {block!r:.40}")
    if not (_is_int(invoke) and -1 <= invoke < len(graph.invokes)):
        raise WireError(f"node {node_id}: unknown invoke {invoke!r:.40}")
    if not isinstance(line, str):
        raise WireError(f"node {node_id}: line must be a string")
    return Node(kind, target, list(args), dict(kwargs), invoke, block, line)


def from_wire(obj: Any, sites: SiteOrder) -> Graph:
    """Rebuild and validate a graph; raises WireError (or UnknownSiteError for a site name)
    naming the first problem, and nothing else, whatever the input."""
    if not isinstance(obj, dict) or obj.get("version") != WIRE_VERSION:
        raise WireError(f"not a vinterp graph of wire version {WIRE_VERSION}")
    nodes = _list(obj, "nodes")
    if len(nodes) > MAX_NODES:
        raise WireError(f"graph has {len(nodes)} nodes; the limit is {MAX_NODES}")
    graph = Graph(
        tensors=[tensor_from_wire(t) for t in _list(obj, "tensors")],
        blocks=[_block(b, i) for i, b in enumerate(_list(obj, "blocks"))],
        invokes=[_invoke(v, i) for i, v in enumerate(_list(obj, "invokes"))],
    )
    for node_id, raw in enumerate(nodes):
        graph.nodes.append(_node(raw, node_id, graph, sites))
    for s in _list(obj, "saves"):
        if not _is_int(s) or not 0 <= s < len(graph.nodes):
            raise WireError(f"save of unknown node {s!r:.40}")
        graph.saves.append(s)
    return graph
