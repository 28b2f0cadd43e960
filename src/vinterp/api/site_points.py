"""`llm.embed`, `llm.layers[i].attn`, ...: attribute paths that name standardized sites.

Reading `.output` / `.input` inside a trace records a read; assigning to them records a
replacement write. Outside a trace they explain where to use them.
"""

from __future__ import annotations

from typing import Any, Protocol

from vinterp.api.trace import Trace
from vinterp.sites.params import is_param_prefix


class TraceSource(Protocol):
    """The model whose module tree this is (`vinterp.api.front_end.TraceFrontEnd`)."""

    config: Any

    def active_trace(self) -> Trace: ...


class SitePoint:
    """A module position with `.input` and/or `.output` sites (e.g. `layers.3.mlp`), and
    the sites named in `_parts` (e.g. `layers.3.attn.q`)."""

    _parts: tuple[str, ...] = ()

    def __init__(self, llm: TraceSource, prefix: str) -> None:
        object.__setattr__(self, "_llm", llm)
        object.__setattr__(self, "_prefix", prefix)

    def _site(self, which: str) -> str:
        return f"{self._prefix}.{which}"

    @property
    def input(self) -> Any:
        return self._llm.active_trace().record_read(self._site("input"))

    @input.setter
    def input(self, value: Any) -> None:
        self._llm.active_trace().record_write(self._site("input"), value)

    @property
    def output(self) -> Any:
        return self._llm.active_trace().record_read(self._site("output"))

    @output.setter
    def output(self, value: Any) -> None:
        self._llm.active_trace().record_write(self._site("output"), value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._parts:
            return self._llm.active_trace().record_read(self._site(name))
        if name == "weight" and is_param_prefix(self._prefix):
            return self._llm.active_trace().record_param(f"{self._prefix}.weight")
        if is_param_prefix(f"{self._prefix}.{name}"):
            return ParamPoint(self._llm, f"{self._prefix}.{name}")
        parts = ".input, .output" + "".join(f", .{part}" for part in self._parts)
        parts += ", .attn, .mlp" if self._prefix.count(".") == 1 else ""
        raise AttributeError(f"{self._prefix} has no site {name!r}; it has {parts}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("input", "output"):
            object.__setattr__(self, name, value)  # goes through the property setter
        elif name in self._parts:
            self._llm.active_trace().record_write(self._site(name), value)
        elif name == "weight":
            raise AttributeError(PARAMS_READ_ONLY_MESSAGE)
        else:
            raise AttributeError(f"cannot set {name!r} on {self._prefix}; set .input or .output")

    def __repr__(self) -> str:
        return f"<site {self._prefix}>"


# what writing a parameter (`.weight`, or any attribute of a ParamPoint) raises
PARAMS_READ_ONLY_MESSAGE = (
    "parameters are read-only in a trace; compute with the value (w * 2) or write a site"
)


class ParamPoint:
    """`llm.layers[i].self_attn.q_proj`, `...mlp.up_proj`: a module whose `.weight` a trace
    reads, named as in the HF module tree."""

    def __init__(self, llm: TraceSource, path: str) -> None:
        object.__setattr__(self, "_llm", llm)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name == "weight" and is_param_prefix(self._path) and self._path.count(".") == 3:
            return self._llm.active_trace().record_param(f"{self._path}.weight")
        if is_param_prefix(f"{self._path}.{name}"):
            return ParamPoint(self._llm, f"{self._path}.{name}")
        raise AttributeError(f"{self._path} has no parameter module {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(PARAMS_READ_ONLY_MESSAGE)

    def __repr__(self) -> str:
        return f"<parameters {self._path}>"


class ModulePoint(SitePoint):
    """A site position that is also a function inside a trace (`llm.final_norm(x)`)."""

    def __init__(self, llm: TraceSource, prefix: str, function: str) -> None:
        super().__init__(llm, prefix)
        object.__setattr__(self, "_function", function)

    def __call__(self, value: Any) -> Any:
        return self._llm.active_trace().record_model_call(self._function, value)


class RouterPoint(SitePoint):
    """`llm.layers[i].mlp.router` of a mixture-of-experts model: `.output` is the router's
    logits, `.experts` the ids of the experts it picks (read-only: a write is refused at the
    trace's exit, as it is over the wire)."""

    _parts = ("experts",)


class AttnPoint(SitePoint):
    """`llm.layers[i].attn`: besides `.input` and `.output`, per head `.q`, `.k`, `.v` (as
    attention uses them, after rotary embedding) and `.heads` (each head's output, before the
    output projection), (T, heads, head_dim); `.pattern`, the attention probabilities
    (heads, T_q, T_k), read-only."""

    _parts = ("q", "k", "v", "pattern", "heads")


class MlpPoint(SitePoint):
    def __init__(self, llm: TraceSource, prefix: str) -> None:
        super().__init__(llm, prefix)
        object.__setattr__(self, "router", RouterPoint(llm, f"{prefix}.router"))


class Layer(SitePoint):
    def __init__(self, llm: TraceSource, index: int) -> None:
        super().__init__(llm, f"layers.{index}")
        object.__setattr__(self, "attn", AttnPoint(llm, f"layers.{index}.attn"))
        object.__setattr__(self, "mlp", MlpPoint(llm, f"layers.{index}.mlp"))
        object.__setattr__(self, "self_attn", ParamPoint(llm, f"layers.{index}.self_attn"))


class Layers:
    """`llm.layers`: indexable like the model's layer list (negative indices count back)."""

    def __init__(self, llm: TraceSource) -> None:
        self._llm = llm

    def __len__(self) -> int:
        return int(self._llm.config.num_hidden_layers)

    def __getitem__(self, index: int) -> Layer:
        if not isinstance(index, int):
            raise TypeError(f"layer index must be an int, got {type(index).__name__}")
        if index < 0:
            index += len(self)
        return Layer(self._llm, index)  # out-of-range indices are reported at trace exit

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))


class RawPoint:
    """`llm.raw.<module path>`: any engine module; `.input` / `.output` read it (save-only)."""

    def __init__(self, llm: TraceSource, path: str = "") -> None:
        object.__setattr__(self, "_llm", llm)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("input", "output"):
            if not self._path:
                raise AttributeError("name a module: llm.raw.<module path>.output")
            return self._llm.active_trace().record_read(f"raw.{self._path}.{name}")
        return RawPoint(self._llm, f"{self._path}.{name}" if self._path else name)

    def __getitem__(self, index: int) -> RawPoint:
        return RawPoint(self._llm, f"{self._path}.{int(index)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("llm.raw sites are read-only; write a standardized site instead")

    def __repr__(self) -> str:
        return f"<raw module {self._path or '(root)'}>"
