"""The whitelist of operations a trace may contain, by wire name.

A graph names its operations with these strings only; the worker looks them up here and
nowhere else, so a graph from an untrusted client can never call anything not listed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _index_put(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """`x[index] = value` without touching x (engine buffers are reused in place)."""
    out = x.clone()
    out[index] = value
    return out


OPERATORS: dict[str, Callable[..., Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "matmul": operator.matmul,
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": operator.abs,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "and_": operator.and_,
    "or_": operator.or_,
    "invert": operator.invert,
    "getitem": operator.getitem,
    "index_put": _index_put,
}

TORCH_FUNCTIONS = (
    "abs",
    "add",
    "allclose",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "argsort",
    "bmm",
    "cat",
    "clamp",
    "clone",
    "cos",
    "cosine_similarity",
    "cumsum",
    "diag",
    "div",
    "dot",
    "einsum",
    "exp",
    "flatten",
    "flip",
    "full_like",
    "gather",
    "index_select",
    "isclose",
    "log",
    "log_softmax",
    "logsumexp",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mul",
    "multinomial",
    "narrow",
    "ne",
    "norm",
    "ones_like",
    "outer",
    "rand_like",
    "randn_like",
    "relu",
    "reshape",
    "roll",
    "rsqrt",
    "sigmoid",
    "sign",
    "sin",
    "softmax",
    "sort",
    "sqrt",
    "square",
    "squeeze",
    "stack",
    "std",
    "sub",
    "sum",
    "tanh",
    "tensordot",
    "topk",
    "transpose",
    "tril",
    "triu",
    "unsqueeze",
    "var",
    "where",
    "zeros_like",
)
FUNCTIONAL = (
    "cosine_similarity",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "normalize",
    "relu",
    "silu",
    "softmax",
)
TENSOR_METHODS = (
    "abs",
    "add",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "argsort",
    "bfloat16",
    "chunk",
    "clamp",
    "clone",
    "contiguous",
    "cos",
    "cumsum",
    "detach",
    "diag",
    "div",
    "double",
    "exp",
    "expand",
    "flatten",
    "flip",
    "float",
    "gather",
    "half",
    "index_select",
    "log",
    "log_softmax",
    "logsumexp",
    "masked_fill",
    "matmul",
    "max",
    "mean",
    "min",
    "mul",
    "narrow",
    "neg",
    "norm",
    "permute",
    "pow",
    "repeat",
    "reshape",
    "roll",
    "round",
    "rsqrt",
    "select",
    "sigmoid",
    "sign",
    "sin",
    "softmax",
    "sort",
    "split",
    "sqrt",
    "square",
    "squeeze",
    "std",
    "sub",
    "sum",
    "t",
    "tanh",
    "to",
    "topk",
    "transpose",
    "type_as",
    "unsqueeze",
    "var",
    "view",
    "where",
    "zero_",
)

# Applied with the served model's own modules (see runtime.executor.ModelFunctions), and
# the sparse autoencoders attached at its sites: sae_encode(x, host site name),
# sae_decode(features, host site name, x).
MODEL_FUNCTIONS = ("final_norm", "lm_head", "param", "sae_encode", "sae_decode")
SAE_FUNCTIONS = ("model.sae_encode", "model.sae_decode")


def _registry() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {f"op.{k}": v for k, v in OPERATORS.items()}
    table.update({f"torch.{n}": getattr(torch, n) for n in TORCH_FUNCTIONS})
    table.update({f"F.{n}": getattr(F, n) for n in FUNCTIONAL})
    table.update(
        {f"Tensor.{n}": getattr(torch.Tensor, n) for n in TENSOR_METHODS}  # unbound methods
    )
    return table


CALLABLES: dict[str, Callable[..., Any]] = _registry()
_NAME_OF_TORCH_FUNC: dict[Any, str] = {}
for _name, _fn in CALLABLES.items():
    if _name.startswith(("torch.", "F.")):
        _NAME_OF_TORCH_FUNC.setdefault(_fn, _name)
ALL_OPS = frozenset(CALLABLES) | {f"model.{n}" for n in MODEL_FUNCTIONS}


def name_of_torch_function(func: Any) -> str | None:
    """Wire name of a `torch.*` / `F.*` function, or None if it is not whitelisted."""
    return _NAME_OF_TORCH_FUNC.get(func)


def lookup(name: str) -> Callable[..., Any]:
    """The callable for a whitelisted wire name (KeyError for anything else)."""
    return CALLABLES[name]
