"""`with llm.trace(...)`: records the body as a graph, runs it at the `with` exit.

The body runs once, on symbolic values (api.values.Value). At exit the graph is planned
(static errors raised here, before anything is sent), run by the backend, and every saved
value replaces its symbolic stand-in in the caller's variables (and in lists/dicts there).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from vinterp.api.sae_sites import read_sae_site, write_sae_site
from vinterp.api.values import Value
from vinterp.engine.outputs import Output
from vinterp.engine.sampling import sampling_kwargs
from vinterp.engine.vllm_boundary.parallel import last_stage_start
from vinterp.errors import InterventionError, OutOfOrderError, TraceError
from vinterp.ir.graph import STEP_ZERO, Block, Graph, Invoke, Node, decode_arg, encode_arg, ref
from vinterp.ir.ops import lookup
from vinterp.ir.plan import Plan, PlanError, make_plan
from vinterp.runtime.executor import TraceResult
from vinterp.sites.modules import site_order
from vinterp.sites.names import PATTERN, SiteName, UnknownSiteError, parse_site, sae_site
from vinterp.sites.params import param_shape, parse_param
from vinterp.sites.raw import is_raw

Prompt = str | list[int]
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TraceHost(Protocol):
    """The model a trace is recorded against (`vinterp.api.front_end.TraceFrontEnd`)."""

    config: Any
    pipeline_parallel_size: int
    asynchronous: bool
    backend: Any  # a Backend, or an AsyncBackend when `asynchronous`
    saes: dict[str, Any]  # host site -> the `vinterp.SAE` attached there

    def tokenize(self, prompts: Prompt | list[Prompt]) -> list[list[int]]: ...

    def begin_trace(self, trace: Trace) -> None: ...

    def end_trace(self, trace: Trace) -> None: ...


def _user_line() -> str:
    """file:line of the innermost caller outside vinterp (where the user wrote the op)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class Trace:
    """One traced request batch: invokes (prompts), their interventions and saves."""

    def __init__(
        self, llm: TraceHost, prompt: Prompt | None = None, use_tqdm: bool = True, **sampling: Any
    ) -> None:
        self._llm = llm
        self._use_tqdm = use_tqdm
        self._sites = site_order(llm.config)
        self.graph = Graph()
        self._sampling = sampling
        self._implicit_prompt = prompt
        self._invoke: int | None = None
        self._block = STEP_ZERO
        self._errors: list[TraceError] = []
        self._saved: dict[int, tuple[Value, int]] = {}
        self._consts: dict[int, tuple[torch.Tensor, int]] = {}
        self._metas: dict[int, torch.Tensor | None] = {}
        self.outputs: list[Output] = []

    # -- contexts ---------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        if self._llm.asynchronous:
            raise TypeError("this model runs traces asynchronously: `async with model.trace(...)`")
        return self._enter()

    def _enter(self) -> Trace:
        self._llm.begin_trace(self)
        if self._implicit_prompt is not None:
            self._open_invoke(self._implicit_prompt, {})
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        plan, frame = self._close(exc_type is not None), sys._getframe(1)
        if plan is not None:
            with _as_trace_errors():
                result = self._llm.backend.run_trace(self.graph, plan, self._use_tqdm)
            self._finish(result, frame)

    async def __aenter__(self) -> Trace:
        if not self._llm.asynchronous:
            raise TypeError("this model runs traces synchronously: `with model.trace(...)`")
        return self._enter()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Runs the trace on the async engine; other tasks run meanwhile (their own traces
        too: the trace being recorded is per task)."""
        plan, frame = self._close(exc_type is not None), sys._getframe(1)
        if plan is not None:
            with _as_trace_errors():
                result = await self._llm.backend.run_trace(self.graph, plan, self._use_tqdm)
            self._finish(result, frame)

    def _close(self, failed: bool) -> Plan | None:
        """Stop recording; the plan to run, or None when the body raised."""
        self._llm.end_trace(self)
        self._invoke = None
        if failed:
            return None
        with _as_trace_errors():
            return self._plan()

    def invoke(self, prompt: Prompt, **sampling: Any) -> _InvokeContext:
        """One prompt in this trace; sampling options override the trace's."""
        return _InvokeContext(self, prompt, sampling)

    @property
    def iter(self) -> _IterIndex:
        """`tr.iter[a:b]`, `tr.iter[k]`, `tr.iter[:]`: a body applied at those steps."""
        return _IterIndex(self)

    def _open_invoke(self, prompt: Prompt, sampling: dict[str, Any]) -> None:
        if self._invoke is not None:
            raise TraceError("invokes cannot be nested; close one before opening the next")
        (ids,) = self._llm.tokenize(prompt)
        self.graph.invokes.append(Invoke(ids, sampling_kwargs({**self._sampling, **sampling})))
        self._invoke = len(self.graph.invokes) - 1

    # -- recording --------------------------------------------------------------------------
    def _add(
        self, kind: str, target: str, args: list[Any], kwargs: dict[str, Any], invoke: int
    ) -> int:
        node = Node(kind, target, args, kwargs, invoke, self._block, _user_line())
        return self.graph.add(node)

    def _to_ref(self, obj: Any) -> Any:
        if isinstance(obj, Value):
            if obj.recorder is not self:
                raise TraceError("a value from another trace cannot be used here")
            return ref(obj.node)
        if isinstance(obj, torch.Tensor):
            if id(obj) not in self._consts:
                self.graph.tensors.append(obj.detach().cpu())
                node = self.graph.add(Node("const", "", [len(self.graph.tensors) - 1], {}, -1))
                self._consts[id(obj)] = (obj, node)  # keep obj alive so its id stays unique
            return ref(self._consts[id(obj)][1])
        return None

    def _record_error(self, message: str, cls: type[TraceError] = TraceError) -> None:
        self._errors.append(cls(f"{_user_line()}: {message}"))

    def _current_invoke(self, what: str) -> int:
        if self._invoke is None:
            self._record_error(f"{what} must be inside `with tr.invoke(prompt):`")
            return -1
        return self._invoke

    def _site_meta(self, site: str, invoke: int) -> torch.Tensor | None:
        if invoke < 0 or is_raw(site):
            return None  # raw sites have the engine's native layout, unknown here
        try:
            self._sites[site]
        except UnknownSiteError as exc:
            self._record_error(str(exc))
            return None
        config = self._llm.config
        block = self.graph.blocks[self._block] if self._block != STEP_ZERO else None
        tokens = len(self.graph.invokes[invoke].prompt) if block is None or block.start == 0 else 1
        if site == "logits":
            return torch.empty(1, config.vocab_size, device="meta")
        if site == "samples":
            return torch.empty(1, dtype=torch.long, device="meta")
        parsed = parse_site(site)
        if parsed.part == PATTERN and self._sites.heads is not None:  # (heads, T_q, T_k)
            keys = len(self.graph.invokes[invoke].prompt) + (block.start if block else 0)
            return torch.empty(self._sites.heads.heads, tokens, keys, device="meta")
        row = self._sites.row_shape(site, config.hidden_size)
        ids = parsed.value == "experts"  # a router's expert ids
        return torch.empty(tokens, *row, dtype=torch.long if ids else None, device="meta")

    def _attached_sae(self, site: str) -> SiteName | None:
        """The parts of an SAE site (None for other sites); an SAE site without an SAE at its
        host is recorded as an error."""
        parsed = sae_site(site)
        if parsed is not None and parsed.host not in self._llm.saes:
            self._record_error(
                f"{site}: no sparse autoencoder is attached at {parsed.host}; call "
                f"llm.attach_sae({parsed.host!r}, vinterp.SAE.load(path)) before the trace"
            )
        return parsed

    def record_read(self, site: str) -> Value:
        sae = self._attached_sae(site)
        if sae is not None:
            return read_sae_site(self, site, sae)
        invoke = self._current_invoke(f"reading {site}")
        node = self._add("read", site, [], {}, invoke)
        meta = self._site_meta(site, invoke)
        self._metas[node] = meta
        return Value(self, node, meta, site)

    def record_write(self, site: str, value: Any, index: Any = None) -> int:
        """Record a write of `site`; the node that holds the site's new value."""
        sae = self._attached_sae(site)
        if sae is not None:
            return write_sae_site(self, site, sae, value, index).node
        invoke = self._current_invoke(f"writing {site}")
        args = [encode_arg(value, self._to_ref)]
        if index is not None:
            args.append(encode_arg(index, self._to_ref))
        site_meta = self._site_meta(site, invoke)
        try:
            value_meta, index_meta = self._meta_value(value), self._meta_value(index)
        except _UnknownShape:
            site_meta = None
        if site_meta is not None:
            try:
                if index is None:
                    torch.broadcast_to(torch.as_tensor(value_meta, device="meta"), site_meta.shape)
                else:
                    site_meta.clone()[index_meta] = value_meta
            except (RuntimeError, IndexError) as exc:
                self._record_error(
                    f"the write to {site} does not fit the site's shape "
                    f"{tuple(site_meta.shape)}: {exc}"
                )
        node = self._add("write", site, args, {}, invoke)
        self._metas[node] = site_meta
        return node

    def record_setitem(self, target: Value, index: Any, value: Any) -> None:
        site_value = target.site is not None and (
            self.graph.nodes[target.node].kind in ("read", "write") or sae_site(target.site)
        )
        if site_value:
            target.node = self.record_write(target.site, value, index)  # type: ignore[arg-type]
        else:
            target.node = self.record_call("op.index_put", (target, index, value), {}).node

    def record_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
        encoded_args = [encode_arg(a, self._to_ref) for a in args]
        encoded_kwargs = {k: encode_arg(v, self._to_ref) for k, v in kwargs.items()}
        invoke = self._invoke
        if invoke is None:
            invokes = [self.graph.nodes[v.node].invoke for v in _values_in((args, kwargs))]
            invoke = max(invokes, default=-1)
        node = self._add("call", name, encoded_args, encoded_kwargs, invoke)
        meta = self._infer_meta(name, args, kwargs)
        if isinstance(meta, tuple):  # e.g. topk -> (values, indices): one value per item
            self._metas[node] = None
            items = [
                self.record_call("op.getitem", (Value(self, node, None, None), i), {})
                for i in range(len(meta))
            ]
            for item, item_meta in zip(items, meta):
                item.meta = self._metas[item.node] = item_meta
            return type(meta)(items) if type(meta) is not tuple else tuple(items)
        self._metas[node] = meta
        return Value(self, node, meta, None)

    def record_model_call(self, function: str, value: Any) -> Value:
        return self.record_call(f"model.{function}", (value,), {})

    def record_param(self, name: str) -> Value:
        """A parameter's value in its HF shape (read-only: computing with it makes copies)."""
        try:
            parse_param(name, int(self._llm.config.num_hidden_layers))
        except UnknownSiteError as exc:
            self._record_error(str(exc))
        self._current_invoke(f"reading {name}")
        return self.record_call("model.param", (name,), {})

    def _meta_value(self, obj: Any) -> Any:
        """`obj` with symbolic values and tensors replaced by meta tensors (or _UnknownShape)."""

        def resolve(node_id: int) -> Any:
            meta = self._metas.get(node_id)
            if meta is None and self.graph.nodes[node_id].kind == "const":
                meta = self.graph.tensors[self.graph.nodes[node_id].args[0]].to("meta")
            if meta is None:
                raise _UnknownShape
            return meta

        return decode_arg(encode_arg(obj, self._to_ref), resolve)

    def _infer_meta(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            meta_args = self._meta_value(list(args))
            meta_kwargs = {k: self._meta_value(v) for k, v in kwargs.items()}
        except _UnknownShape:
            return None
        if name == "model.final_norm":
            return meta_args[0]
        if name == "model.param":
            try:
                return torch.empty(param_shape(self._llm.config, args[0]), device="meta")
            except UnknownSiteError:
                return None  # reported by _param
        if name == "model.lm_head":
            x = meta_args[0]
            return torch.empty(*x.shape[:-1], self._llm.config.vocab_size, device="meta")
        if name in ("model.sae_encode", "model.sae_decode"):
            sae = self._llm.saes.get(args[1])
            if sae is None:
                return None  # reported where the site was named
            width = sae.d_sae if name == "model.sae_encode" else sae.d_in
            return torch.empty(*meta_args[0].shape[:-1], width, device="meta")
        try:
            result = lookup(name)(*meta_args, **meta_kwargs)
        except (RuntimeError, IndexError, ValueError, TypeError) as exc:
            self._record_error(f"{name.split('.')[-1]} fails on these shapes: {exc}")
            return None
        except NotImplementedError:
            return None
        if isinstance(result, tuple) and all(isinstance(r, torch.Tensor) for r in result):
            return result
        return result if isinstance(result, torch.Tensor) else None

    def record_save(self, value: Value) -> None:
        self.graph.saves.append(value.node)
        self._saved[id(value)] = (value, value.node)

    def control_flow_error(self, what: str) -> TypeError:
        return TypeError(
            f"{_user_line()}: {what} of a traced value needs its value, which exists only when "
            "the engine runs; use torch.where(...) inside the trace, or save the value and "
            "decide after the `with` block"
        )

    # -- running ----------------------------------------------------------------------------
    def _plan(self) -> Plan:
        """The recorded graph's plan; the first recording error or a static one raised here,
        before anything reaches the engine."""
        if self._errors:
            raise self._errors[0]
        if not self.graph.invokes:
            raise TraceError("a trace needs a prompt: llm.trace(prompt) or tr.invoke(prompt)")
        num_layers, stages = self._sites.num_layers, self._llm.pipeline_parallel_size
        return make_plan(self.graph, self._sites, last_stage_start(num_layers, stages))

    def _finish(self, result: TraceResult, frame: Any) -> None:
        """Outputs and saves into the caller's variables, or the intervention's failure."""
        self.outputs = result.outputs
        if result.failure is not None:
            f = result.failure
            where = f"{f.line}: " if f.line else ""
            raise InterventionError(f"{where}{f.message} (invoke {f.invoke}, step {f.step})")
        replacements = {}
        for value, node in self._saved.values():
            in_block = self.graph.nodes[node].block != STEP_ZERO
            replacements[id(value)] = result.saved.get(node, [] if in_block else None)
        _rebind(frame, replacements)


@contextmanager
def _as_trace_errors() -> Iterator[None]:
    """Planning and worker-side plan errors as the user-facing trace errors."""
    try:
        yield
    except UnknownSiteError as exc:
        raise TraceError(str(exc)) from None
    except PlanError as exc:
        raise (OutOfOrderError if exc.out_of_order else TraceError)(str(exc)) from None


class _InvokeContext:
    def __init__(self, trace: Trace, prompt: Prompt, sampling: dict[str, Any]) -> None:
        self._trace, self._prompt, self._sampling = trace, prompt, sampling

    def __enter__(self) -> _InvokeContext:
        self._trace._open_invoke(self._prompt, self._sampling)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._trace._invoke = None


class _IterIndex:
    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    def __getitem__(self, steps: int | slice) -> Iterator[int]:
        if isinstance(steps, int):
            block = Block(steps, steps + 1)
        elif isinstance(steps, slice) and steps.step in (None, 1):
            block = Block(steps.start or 0, steps.stop)
        else:
            raise TypeError("tr.iter takes a step k or a slice a:b (no stride)")
        return self._run_body(block)

    def _run_body(self, block: Block) -> Iterator[int]:
        trace = self._trace
        if trace._block != STEP_ZERO:
            raise TraceError("tr.iter blocks cannot be nested")
        trace.graph.blocks.append(block)
        trace._block = len(trace.graph.blocks) - 1
        try:
            yield block.start  # the body is recorded once and applied at every step
        finally:
            trace._block = STEP_ZERO


class _UnknownShape(Exception):
    pass


def _values_in(obj: Any) -> list[Value]:
    if isinstance(obj, Value):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [v for item in obj for v in _values_in(item)]
    if isinstance(obj, dict):
        return [v for item in obj.values() for v in _values_in(item)]
    return []


def _substitute(obj: Any, replacements: dict[int, Any], depth: int = 0) -> Any:
    if isinstance(obj, Value):
        return replacements.get(id(obj), obj)
    if depth > 8:
        return obj
    if isinstance(obj, list):
        obj[:] = [_substitute(v, replacements, depth + 1) for v in obj]
    elif isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _substitute(obj[k], replacements, depth + 1)
    elif isinstance(obj, tuple):
        items = tuple(_substitute(v, replacements, depth + 1) for v in obj)
        if any(a is not b for a, b in zip(items, obj)):
            return type(obj)(items) if type(obj) is tuple else obj
    return obj


def _rebind(frame: Any, replacements: dict[int, Any]) -> None:
    """Put saved tensors where the body's variables (and their lists/dicts) held stand-ins."""
    local_vars = frame.f_locals
    changed = False
    for name, value in list(local_vars.items()):
        new = _substitute(value, replacements)
        if new is not value:
            local_vars[name] = new
            changed = True
    if changed and local_vars is not frame.f_globals:  # (re-reading f_locals would undo)
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
