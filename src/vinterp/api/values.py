"""Symbolic values: what site reads and operations on them return inside a trace.

Each operation appends a node to the trace's graph and computes its shape on meta tensors,
so shapes are known at trace time and shape mismatches are found before anything runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from vinterp.ir.ops import TENSOR_METHODS, name_of_torch_function


class Recorder(Protocol):
    """The trace a value belongs to (`vinterp.api.trace.Trace`): what values record into."""

    def record_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def record_save(self, value: Value) -> None: ...

    def record_setitem(self, target: Value, index: Any, value: Any) -> None: ...

    def record_read(self, site: str) -> Value: ...

    def record_write(self, site: str, value: Any, index: Any = None) -> int: ...

    def control_flow_error(self, what: str) -> TypeError: ...


class Value:
    """A tensor that will exist when the engine runs the trace: the node of the trace's
    graph that computes it, its shape as a meta tensor (None: unknown at trace time), and the
    site it was read from (None for computed values)."""

    __slots__ = ("recorder", "node", "meta", "site")

    def __init__(
        self, recorder: Recorder, node: int, meta: torch.Tensor | None, site: str | None
    ) -> None:
        self.recorder, self.node, self.meta, self.site = recorder, node, meta, site

    # -- what is known at trace time ------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        if self.meta is None:
            raise TypeError("the shape of this value is not known at trace time")
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype if self.meta is not None else torch.float32

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def sae(self) -> SaeSites:
        """The sites of the sparse autoencoder attached at this value's site
        (`llm.layers[i].output.sae.features`, `.sae.error`)."""
        if self.site is None:
            raise AttributeError(
                "`.sae` follows a site of hidden-size rows: llm.layers[i].output.sae.features"
            )
        return SaeSites(self.recorder, self.site)

    def save(self) -> Value:
        """Keep this value: after the `with` block the name holds a CPU tensor."""
        self.recorder.record_save(self)
        return self

    # -- recording ------------------------------------------------------------------------
    def _call(self, name: str, *args: Any, **kwargs: Any) -> Value:
        return self.recorder.record_call(name, args, kwargs)

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
        trace = next(a.recorder for a in _flatten((args, kwargs)) if isinstance(a, Value))
        name = name_of_torch_function(func)
        if name is None:
            method = getattr(func, "__name__", "")
            if getattr(torch.Tensor, method, None) is func and method in TENSOR_METHODS:
                name = f"Tensor.{method}"
        if name is None:
            raise TypeError(f"{getattr(func, '__name__', func)} cannot be used inside a trace")
        return trace.record_call(name, args, kwargs)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.recorder.record_setitem(self, index, value)

    def __bool__(self) -> bool:
        raise self.recorder.control_flow_error("bool()")

    def __int__(self) -> int:
        raise self.recorder.control_flow_error("int()")

    def __float__(self) -> float:
        raise self.recorder.control_flow_error("float()")

    def __index__(self) -> int:
        raise self.recorder.control_flow_error("use as an index")

    def __iter__(self) -> Any:
        raise self.recorder.control_flow_error("iteration")

    def __repr__(self) -> str:
        shape = tuple(self.meta.shape) if self.meta is not None else "?"
        return f"<vinterp.Value node {self.node} shape {shape}>"


class SaeSites:
    """`<site>.sae`: `.features` (T, d_sae) and `.error` (T, H) of the SAE attached at the
    site, read and written like sites (`vinterp.api.sae_sites` says what a write does)."""

    __slots__ = ("_recorder", "_host")

    def __init__(self, recorder: Recorder, host: str) -> None:
        object.__setattr__(self, "_recorder", recorder)
        object.__setattr__(self, "_host", host)

    def __getattr__(self, name: str) -> Any:
        if name not in ("features", "error"):
            raise AttributeError(f"{self._host}.sae has .features and .error, not {name!r}")
        return self._recorder.record_read(f"{self._host}.sae.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("features", "error"):
            raise AttributeError(f"{self._host}.sae has .features and .error, not {name!r}")
        self._recorder.record_write(f"{self._host}.sae.{name}", value)


def _binary(op: str, reflected: bool = False) -> Any:
    if reflected:
        return lambda self, other: self.recorder.record_call(f"op.{op}", (other, self), {})
    return lambda self, other: self.recorder.record_call(f"op.{op}", (self, other), {})


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_"):
    _dunder = _op.rstrip("_")
    setattr(Value, f"__{_dunder}__", _binary(_op))
    setattr(Value, f"__r{_dunder}__", _binary(_op, reflected=True))
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Value, f"__{_op}__", _binary(_op))
for _op in ("neg", "pos", "abs", "invert"):
    setattr(
        Value,
        f"__{_op}__",
        (lambda o: lambda self: self.recorder.record_call(f"op.{o}", (self,), {}))(_op),
    )
Value.__getitem__ = lambda self, index: self.recorder.record_call("op.getitem", (self, index), {})  # type: ignore[method-assign]
Value.__hash__ = object.__hash__  # type: ignore[method-assign]


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _flatten(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in _flatten(item)]
    if isinstance(obj, slice):
        return _flatten([obj.start, obj.stop, obj.step])
    return [obj]
