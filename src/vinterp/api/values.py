"""Symbolic values: what site reads and operations on them return inside a trace.

Each operation appends a node to the trace's graph and computes its shape on meta tensors,
so shapes are known at trace time and shape mismatches are found before anything runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vinterp.ir.ops import TENSOR_METHODS, name_of_torch_function

if TYPE_CHECKING:
    from vinterp.api.trace import Trace


class Value:
    """A tensor that will exist when the engine runs the trace."""

    __slots__ = ("_trace", "_node", "_meta", "_site")

    def __init__(self, trace: Trace, node: int, meta: torch.Tensor | None, site: str | None):
        self._trace, self._node, self._meta, self._site = trace, node, meta, site

    # -- what is known at trace time ------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        if self._meta is None:
            raise TypeError("the shape of this value is not known at trace time")
        return self._meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype if self._meta is not None else torch.float32

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def save(self) -> Value:
        """Keep this value: after the `with` block the name holds a CPU tensor."""
        self._trace._save(self)
        return self

    # -- recording ------------------------------------------------------------------------
    def _call(self, name: str, *args: Any, **kwargs: Any) -> Value:
        return self._trace._call(name, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in TENSOR_METHODS:
            return lambda *args, **kwargs: self._call(f"Tensor.{name}", self, *args, **kwargs)
        raise AttributeError(
            f"traced values have no attribute {name!r} (tensor methods allowed in a trace: "
            "see vinterp.ir.ops.TENSOR_METHODS)"
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        trace = next(a._trace for a in _flatten((args, kwargs)) if isinstance(a, Value))
        name = name_of_torch_function(func)
        if name is None:
            method = getattr(func, "__name__", "")
            if getattr(torch.Tensor, method, None) is func and method in TENSOR_METHODS:
                name = f"Tensor.{method}"
        if name is None:
            raise TypeError(f"{getattr(func, '__name__', func)} cannot be used inside a trace")
        return trace._call(name, args, kwargs)

    def __setitem__(self, index: Any, value: Any) -> None:
        self._trace._setitem(self, index, value)

    def __bool__(self) -> bool:
        raise self._trace._control_flow_error("bool()")

    def __int__(self) -> int:
        raise self._trace._control_flow_error("int()")

    def __float__(self) -> float:
        raise self._trace._control_flow_error("float()")

    def __index__(self) -> int:
        raise self._trace._control_flow_error("use as an index")

    def __iter__(self) -> Any:
        raise self._trace._control_flow_error("iteration")

    def __repr__(self) -> str:
        shape = tuple(self._meta.shape) if self._meta is not None else "?"
        return f"<vinterp.Value node {self._node} shape {shape}>"


def _binary(op: str, reflected: bool = False) -> Any:
    if reflected:
        return lambda self, other: self._trace._call(f"op.{op}", (other, self), {})
    return lambda self, other: self._trace._call(f"op.{op}", (self, other), {})


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_"):
    _dunder = _op.rstrip("_")
    setattr(Value, f"__{_dunder}__", _binary(_op))
    setattr(Value, f"__r{_dunder}__", _binary(_op, reflected=True))
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Value, f"__{_op}__", _binary(_op))
for _op in ("neg", "pos", "abs", "invert"):
    setattr(
        Value, f"__{_op}__", (lambda o: lambda self: self._trace._call(f"op.{o}", (self,), {}))(_op)
    )
Value.__getitem__ = lambda self, index: self._trace._call("op.getitem", (self, index), {})  # type: ignore[method-assign]
Value.__hash__ = object.__hash__  # type: ignore[method-assign]


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _flatten(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in _flatten(item)]
    if isinstance(obj, slice):
        return _flatten([obj.start, obj.stop, obj.step])
    return [obj]
