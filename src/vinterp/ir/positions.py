"""Which prompt positions each value of a trace's first step depends on.

vLLM may compute a prompt over several engine steps (chunked prefill, a busy engine, a
resumed preempted request), in position order. A write in the first step that needs a value
of a later position than the ones it writes would have to reach back into positions already
computed, so such a trace is refused before it runs. The dependence is derived from the
operations' rules, without shapes: where a rule does not know, it assumes the value needs every
position so far (a refusal, never a wrong value).

A dependence is `None` (no position of the invoke's own prompt: constants, parameters, other
invokes' values), `Rows` (row i of the first axis depends on position `rows[i]` alone) or
`UpTo` (every position up to `last`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vinterp.ir.graph import STEP_ZERO, Graph, Node, decode_arg, node_inputs, refs_in


@dataclass(frozen=True)
class Rows:
    rows: range
    ndim: int | None  # None: unknown (rules that need it give UpTo)


@dataclass(frozen=True)
class UpTo:
    last: int


Dependence = Rows | UpTo | None

# Operations whose result keeps its input's rows (same shape or per-row).
_ROWWISE = {
    *(f"Tensor.{m}" for m in (
        "abs", "bfloat16", "clone", "contiguous", "cos", "detach", "double", "exp", "float",
        "half", "log", "neg", "round", "rsqrt", "sigmoid", "sign", "sin", "sqrt", "square",
        "tanh", "to", "zero_",
    )),
    *(f"torch.{m}" for m in (
        "abs", "clone", "cos", "exp", "log", "relu", "rsqrt", "sigmoid", "sign", "sin", "sqrt",
        "square", "tanh", "full_like", "ones_like", "zeros_like", "rand_like", "randn_like",
    )),
    "F.gelu", "F.relu", "F.silu", "op.neg", "op.pos", "op.abs", "op.invert",
}  # fmt: skip
# Broadcasting operations of several tensors.
_ELEMENTWISE = {
    *(f"op.{m}" for m in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "eq", "ne", "lt", "le", "gt",
        "ge", "and_", "or_",
    )),
    *(f"torch.{m}" for m in ("add", "sub", "mul", "div", "maximum", "minimum", "where", "ne",
                              "clamp")),
    *(f"Tensor.{m}" for m in ("add", "sub", "mul", "div", "pow", "where", "masked_fill", "clamp",
                              "type_as")),
}  # fmt: skip
# name -> (index of `dim` among the positional arguments, its default); "keep" operations keep
# the shape, "reduce" ones drop the axis (unless keepdim), "pairs" return (values, indices).
_KEEP = {
    "softmax": (1, None), "log_softmax": (1, None), "cumsum": (1, None), "argsort": (1, -1),
    "normalize": (2, 1), "topk": (2, -1), "sort": (1, -1),
}  # fmt: skip
_REDUCE = {
    "sum": (1, None), "mean": (1, None), "amax": (1, None), "amin": (1, None),
    "norm": (2, None), "std": (1, None), "var": (1, None), "logsumexp": (1, None),
    "argmax": (1, None), "argmin": (1, None), "max": (1, None), "min": (1, None),
    "cosine_similarity": (2, 1),
}  # fmt: skip
_PAIRS = {"topk", "sort", "max", "min"}  # with a dim, a (values, indices) pair
_MATMUL = {"op.matmul", "torch.matmul", "Tensor.matmul", "F.linear"}


def prompt_dependence(graph: Graph, row_ndim: Any) -> list[Dependence]:
    """Per node, its dependence on its own invoke's prompt positions in step 0; `row_ndim(site)`
    gives the number of axes of one token's row at a site (None: not a token site)."""
    deps: list[Dependence] = []
    pairs: set[int] = set()  # nodes whose value is a (values, indices) pair
    for node_id, node in enumerate(graph.nodes):
        deps.append(_dependence(graph, node, deps, pairs, row_ndim))
        if node.kind == "call" and _is_pair(node):
            pairs.add(node_id)
    return deps


def last_position(dep: Dependence) -> int:
    """The highest position a dependence needs (-1: none)."""
    if dep is None:
        return -1
    if isinstance(dep, UpTo):
        return dep.last
    return max(dep.rows, default=-1)


def in_step_zero(graph: Graph, node: Node) -> bool:
    """Whether the node runs in an invoke's first step (outside blocks, or in one from 0)."""
    return node.block == STEP_ZERO or graph.blocks[node.block].contains(0)


def written_positions(index: Any, length: int, row_ndim: int) -> range | None:
    """The positions a write's index (decoded: an int, a slice, a tuple; None: the whole
    site) writes, or None where they are not known before it runs."""
    every = range(length)
    if index is None:
        return every
    if isinstance(index, tuple):
        if not index:
            return every
        if index[0] is Ellipsis:
            rest = [i for i in index[1:] if i is not None]
            return every if len(rest) < row_ndim + 1 else None
        index = index[0]
    if isinstance(index, bool):
        return None
    if isinstance(index, int):
        return every[index : index + 1 or None] if -length <= index < length else None
    if isinstance(index, slice) and all(
        isinstance(v, int) or v is None for v in (index.start, index.stop, index.step)
    ):
        return every[index]
    return None


def _dependence(
    graph: Graph, node: Node, deps: list[Dependence], pairs: set[int], row_ndim: Any
) -> Dependence:
    if node.kind == "const" or not in_step_zero(graph, node):
        return None
    length = len(graph.invokes[node.invoke].prompt) if node.invoke >= 0 else 0
    if node.kind in ("read", "write"):
        ndim = row_ndim(node.target)
        if ndim is None:  # logits, samples, attention patterns: known once the prompt is done
            return UpTo(length - 1)
        return Rows(range(length), ndim + 1)
    own = [deps[i] if graph.nodes[i].invoke == node.invoke else None for i in node_inputs(node)]
    if all(d is None for d in own):
        return None

    def own_dep(encoded: Any) -> Dependence:
        refs = [r for r in refs_in(encoded) if graph.nodes[r].invoke == node.invoke]
        if not refs:
            return None
        if _is_ref(encoded):
            return deps[encoded["ref"]]
        return UpTo(max(last_position(deps[r]) for r in refs))

    if any(own_dep(v) is not None for v in node.kwargs.values()):
        rule = None  # a prompt-dependent keyword argument: no rule follows it
    else:
        rule = _rule(node, [own_dep(a) for a in node.args], pairs)
    return rule if rule is not None else UpTo(max(last_position(d) for d in own))


def _rule(node: Node, args: list[Dependence], pairs: set[int]) -> Dependence:
    """The rows an operation keeps, or None where no rule applies (UpTo its inputs)."""
    target = node.target
    first = args[0] if args else None
    if target.startswith("model.") and target != "model.param":  # per row (sae_decode: and x's)
        return (
            first if isinstance(first, Rows) and all(a in (None, first) for a in args[1:]) else None
        )
    if target == "op.index_put":  # `x[index] = value` over whole rows keeps x's rows
        whole = node.args[1] if len(node.args) > 1 else None
        if isinstance(whole, dict) and "items" in whole:
            whole = whole["items"][0] if whole["items"] else None
        keeps = whole == {"ellipsis": True} or whole == {"slice": [None, None, None]}
        return first if keeps and isinstance(first, Rows) and args[2] in (None, first) else None
    if target == "op.getitem":
        if node.args and _is_ref(node.args[0]) and node.args[0]["ref"] in pairs:
            return first  # an item of a (values, indices) pair: the pair's rows
        return _getitem(first, node.args[1] if len(node.args) > 1 else None)
    if target in _ROWWISE or target in _ELEMENTWISE:
        rows = {a for a in args if a is not None}  # every prompt-dependent input alike
        only = rows.pop() if len(rows) == 1 else None
        return only if isinstance(only, Rows) and only.ndim is not None else None
    if not isinstance(first, Rows) or first.ndim is None:
        return None
    if target in _MATMUL:
        return first if first.ndim >= 2 and all(a is None for a in args[1:]) else None
    name = target.split(".", 1)[1]
    if name in _KEEP or name in _REDUCE:
        position, default = (_KEEP | _REDUCE)[name]
        dim = _literal_arg(node, position, "dim", default)
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if dim is None or not all(isinstance(d, int) for d in dims):
            return None
        if any(d % first.ndim == 0 for d in dims):
            return None  # over positions
        keep = name in _KEEP or bool(_literal_arg(node, -1, "keepdim", False))
        return Rows(first.rows, first.ndim if keep else first.ndim - len(dims))
    if name in ("unsqueeze",):
        dim = _literal_arg(node, 1, "dim", None)
        if isinstance(dim, int) and dim % (first.ndim + 1) != 0:
            return Rows(first.rows, first.ndim + 1)
    if name in ("reshape", "view"):
        shape = [a for a in node.args[1:]]
        if len(shape) == 1 and isinstance(shape[0], dict) and "items" in shape[0]:
            shape = shape[0]["items"]
        if shape and shape[0] == len(first.rows) and all(isinstance(s, int) for s in shape):
            return Rows(first.rows, len(shape))
    if name in ("transpose",):
        dims = [_literal_arg(node, 1, "dim0", None), _literal_arg(node, 2, "dim1", None)]
        if all(isinstance(d, int) and d % first.ndim != 0 for d in dims):
            return first
    return None


def _getitem(x: Dependence, encoded: Any) -> Dependence:
    """x[index] for a literal index; the first axis of x holds `x.rows`."""
    if not isinstance(x, Rows) or x.ndim is None:
        return None
    items = encoded["items"] if isinstance(encoded, dict) and "tuple" in encoded else [encoded]
    if not items:
        return x
    head, rest = items[0], items[1:]
    if isinstance(head, dict) and head.get("ellipsis"):
        used = [i for i in rest if i is not None]
        if len(used) >= x.ndim or not all(_literal(i) for i in used):
            return None
        return Rows(x.rows, x.ndim - sum(isinstance(i, int) for i in used))
    if not all(_literal(i) for i in items) or any(i is None for i in rest):
        return None
    dropped = sum(isinstance(i, int) for i in rest)
    if isinstance(head, int) and not isinstance(head, bool):
        if not -len(x.rows) <= head < len(x.rows):
            return None
        return UpTo(x.rows[head])
    if isinstance(head, dict) and "slice" in head:
        return Rows(x.rows[slice(*head["slice"])], x.ndim - dropped)
    return None


def _literal(item: Any) -> bool:
    """An index item given as a plain int, slice of ints, Ellipsis or None (no tensors)."""
    if item is None or (isinstance(item, int) and not isinstance(item, bool)):
        return True
    if isinstance(item, dict) and item.get("ellipsis"):
        return True
    return (
        isinstance(item, dict)
        and "slice" in item
        and all(v is None or isinstance(v, int) for v in item["slice"])
    )


def _literal_arg(node: Node, position: int, name: str, default: Any) -> Any:
    """A literal argument by keyword or position (a node reference gives None)."""
    if name in node.kwargs:
        value = node.kwargs[name]
    elif 0 <= position < len(node.args):
        value = node.args[position]
    else:
        return default
    if isinstance(value, dict) and "items" in value:
        value = value["items"]
    if isinstance(value, dict):
        return None
    return value


def _is_pair(node: Node) -> bool:
    name = node.target.split(".", 1)[-1]
    if name not in _PAIRS:
        return False
    return name in ("topk", "sort") or _literal_arg(node, 1, "dim", None) is not None


def _is_ref(encoded: Any) -> bool:
    return isinstance(encoded, dict) and "ref" in encoded


def refusal(graph: Graph, deps: list[Dependence], node_id: int, row_ndim: Any) -> str | None:
    """Why a write in step 0 cannot run over a prompt computed in chunks (None: it can)."""
    node = graph.nodes[node_id]
    if node.kind != "write" or not in_step_zero(graph, node):
        return None
    ndim = row_ndim(node.target)
    if ndim is None:
        return None

    def own(encoded: Any) -> Dependence:
        refs = [r for r in refs_in(encoded) if graph.nodes[r].invoke == node.invoke]
        return UpTo(max(last_position(deps[r]) for r in refs)) if refs else None

    length = len(graph.invokes[node.invoke].prompt)
    value = node.args[0]
    needed = deps[value["ref"]] if _is_ref(value) and own(value) is not None else own(value)
    if len(node.args) > 1 and own(node.args[1]) is not None:
        return "its index depends on the prompt's own values"
    index = decode_arg(node.args[1], lambda _: object()) if len(node.args) > 1 else None
    written = written_positions(index, length, ndim)
    if needed is None or (written is not None and not written):
        return None
    if written is None:
        return "it writes positions known only when it runs, from a value of the prompt"
    if isinstance(needed, Rows) and len(needed.rows) == len(written):
        late = [(r, w) for r, w in zip(needed.rows, written) if r > w]
    else:
        top, first = last_position(needed), min(written)
        late = [(top, first)] if top > first else []
    if not late:
        return None
    source, target = late[0]
    return f"position {target} gets a value computed from position {source}"
