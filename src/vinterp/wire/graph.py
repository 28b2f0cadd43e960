"""The wire format of a graph: data only, validated on the way in.

Used unchanged in-process and by the server: op names must be on the whitelist (ir.ops),
sites and parameters must exist, references must point backwards, tensors are raw
little-endian bytes with a dtype and shape (wire.tensors). Nothing is unpickled and nothing
from the client is executed.
"""

from __future__ import annotations

from typing import Any

from vinterp.ir.graph import NODE_KINDS, STEP_ZERO, Block, Graph, Invoke, Node
from vinterp.ir.ops import ALL_OPS, SAE_FUNCTIONS
from vinterp.sites.names import SAE_HOSTS, SiteOrder, UnknownSiteError, parse_site
from vinterp.sites.params import parse_param
from vinterp.wire.errors import WireError, short
from vinterp.wire.tensors import DTYPES, is_int, tensor_from_wire, tensor_to_wire

WIRE_VERSION = 1
KEYS = ("version", "nodes", "tensors", "blocks", "invokes", "saves")
_ARG_KEYS = ({"ref"}, {"slice"}, {"ellipsis"}, {"dtype"}, {"list", "items"}, {"tuple", "items"})
MAX_NODES = 1_000_000
MAX_ARG_DEPTH = 16


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
    if depth > MAX_ARG_DEPTH:
        raise WireError(f"node {node_id}: arguments nested more than {MAX_ARG_DEPTH} deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for v in value:
            _check_arg(v, node_id, depth + 1)
        return
    if not isinstance(value, dict) or set(value) not in _ARG_KEYS:
        raise WireError(f"node {node_id}: argument {short(value)} is not a wire value")
    if "ref" in value:
        r = value["ref"]
        if not is_int(r) or not 0 <= r < node_id:
            raise WireError(f"node {node_id}: reference {short(r)} must name an earlier node")
    elif "slice" in value:
        if not isinstance(value["slice"], list) or len(value["slice"]) != 3:
            raise WireError(f"node {node_id}: a slice is [start, stop, step]")
        _check_arg(value["slice"], node_id, depth + 1)
    elif "dtype" in value:
        if not isinstance(value["dtype"], str) or value["dtype"] not in DTYPES:
            raise WireError(
                f"node {node_id}: dtype {short(value['dtype'])} not allowed; "
                f"use one of {sorted(DTYPES)}"
            )
    elif "items" in value:
        if not isinstance(value["items"], list):
            raise WireError(f"node {node_id}: items must be a list")
        _check_arg(value["items"], node_id, depth + 1)


def _list(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key, [])
    if not isinstance(value, list):
        raise WireError(f"{key} must be a list, not {type(value).__name__}")
    return value


def _block(raw: Any, index: int) -> Block:
    if not (isinstance(raw, list) and len(raw) == 2 and is_int(raw[0]) and raw[0] >= 0):
        raise WireError(f"block {index}: a block is [start, stop] with start >= 0")
    if not (raw[1] is None or (is_int(raw[1]) and raw[1] > raw[0])):
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
    if not isinstance(prompt, list) or not prompt or not all(is_int(t) and t >= 0 for t in prompt):
        raise WireError(f"invoke {index}: the prompt must be a non-empty list of token ids")
    if not isinstance(sampling, dict) or not all(
        isinstance(k, str) and _scalar_or_list(v) for k, v in sampling.items()
    ):
        raise WireError(f"invoke {index}: sampling must map option names to plain values")
    return Invoke(list(prompt), dict(sampling))


def _check_target(kind: str, target: str, args: list[Any], node_id: int, sites: SiteOrder) -> None:
    """The site a read or write names, the op a call names and the parameter a
    `model.param` call reads exist; a write has its value (and index)."""
    try:
        if kind in ("read", "write"):
            sites[target]
            if parse_site(target).sae:
                raise WireError(
                    f"node {node_id}: {target} is computed from its host site: read the host "
                    "and call model.sae_encode / model.sae_decode (what vinterp's trace records)"
                )
        elif kind == "call" and target in SAE_FUNCTIONS:
            arity = 2 if target == "model.sae_encode" else 3
            if len(args) != arity or not isinstance(args[1], str):
                form = "value, host site name" + (", host value" if arity == 3 else "")
                raise WireError(f"node {node_id}: {target} takes [{form}]")
            sites[args[1]]
            if parse_site(args[1]).part not in SAE_HOSTS:
                raise WireError(
                    f"node {node_id}: {args[1]} cannot hold a sparse autoencoder; hosts are "
                    f"layers.{{i}}.{'|'.join(SAE_HOSTS)}"
                )
        elif kind == "call" and target == "model.param":
            if len(args) != 1 or not isinstance(args[0], str):
                raise WireError(f"node {node_id}: model.param takes one parameter name")
            parse_param(args[0], sites.num_layers)
    except UnknownSiteError as exc:
        raise WireError(f"node {node_id}: {exc}") from None
    if kind == "call" and target not in ALL_OPS:
        raise WireError(f"node {node_id}: operation {short(target)} is not allowed")
    if kind == "write" and len(args) not in (1, 2):
        raise WireError(f"node {node_id}: a write's args are [value] or [value, index]")


def _node(raw: Any, node_id: int, graph: Graph, sites: SiteOrder) -> Node:
    if not isinstance(raw, list) or len(raw) != 7:
        raise WireError(
            f"node {node_id}: a node is [kind, target, args, kwargs, invoke, block, line]"
        )
    kind, target, args, kwargs, invoke, block, line = raw
    if not isinstance(kind, str) or kind not in NODE_KINDS:
        raise WireError(f"node {node_id}: unknown kind {short(kind)}; kinds are {NODE_KINDS}")
    if not isinstance(target, str):
        raise WireError(f"node {node_id}: the target must be a string")
    if not isinstance(args, list):
        raise WireError(f"node {node_id}: args must be a list")
    _check_target(kind, target, args, node_id, sites)
    if kind == "const" and not (
        len(args) == 1 and is_int(args[0]) and 0 <= args[0] < len(graph.tensors)
    ):
        raise WireError(f"node {node_id}: const must name one of the graph's tensors")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise WireError(f"node {node_id}: kwargs must map names to values")
    _check_arg(args, node_id)
    _check_arg(list(kwargs.values()), node_id)
    if not (is_int(block) and (block == STEP_ZERO or 0 <= block < len(graph.blocks))):
        raise WireError(f"node {node_id}: unknown iteration block {short(block)}")
    if not (is_int(invoke) and -1 <= invoke < len(graph.invokes)):
        raise WireError(f"node {node_id}: unknown invoke {short(invoke)}")
    if not isinstance(line, str):
        raise WireError(f"node {node_id}: line must be a string")
    return Node(kind, target, list(args), dict(kwargs), invoke, block, line)


def from_wire(obj: Any, sites: SiteOrder) -> Graph:
    """Rebuild and validate a graph; raises WireError naming the first problem, and nothing
    else, whatever the input."""
    version = obj.get("version") if isinstance(obj, dict) else None
    if not is_int(version) or version != WIRE_VERSION:
        raise WireError(f"not a vinterp graph of wire version {WIRE_VERSION}")
    unknown = set(obj) - set(KEYS)
    if unknown:
        raise WireError(f"unknown graph fields {short(sorted(map(str, unknown)))}; fields: {KEYS}")
    nodes = _list(obj, "nodes")
    if len(nodes) > MAX_NODES:
        raise WireError(f"graph has {len(nodes)} nodes; the limit is {MAX_NODES}")
    graph = Graph(
        tensors=[tensor_from_wire(t, f"tensor {i}") for i, t in enumerate(_list(obj, "tensors"))],
        blocks=[_block(b, i) for i, b in enumerate(_list(obj, "blocks"))],
        invokes=[_invoke(v, i) for i, v in enumerate(_list(obj, "invokes"))],
    )
    for node_id, raw in enumerate(nodes):
        graph.nodes.append(_node(raw, node_id, graph, sites))
    for s in _list(obj, "saves"):
        if not is_int(s) or not 0 <= s < len(graph.nodes):
            raise WireError(f"save of unknown node {short(s)}")
        graph.saves.append(s)
    return graph
