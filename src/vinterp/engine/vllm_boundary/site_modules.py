"""Puts the sites into a loaded vLLM model (before it is compiled).

Each site module's class is swapped for a subclass whose method (usually `forward`) runs
the site functions around the original, so module names and weights stay as vLLM built them
(`llm.raw.<path>` still names vLLM's modules) and torch.compile traces the sites as part of
the module, reaching the steering buffers through `self` like any weight. Layouts, detected
from the loaded modules:
- most sites hold the module's (tokens, H) tensor (a tuple output's first element);
- blocks whose forward takes a `residual` pass (hidden, residual) between blocks, their sum
  being the HF residual stream (layer 0's input is the embedding alone);
- a mixture-of-experts router (its gate linear) returns (logits, bias): its sites are the
  logits and the experts they pick (`site_ops.router_site`);
- vLLM's attention layer (`vllm...layers.attention.Attention`, inside each architecture's
  attention module) takes q, k, v after rotary embedding, writes k and v into the paged KV
  cache and returns the heads' outputs, all flat (tokens, heads * head_dim): the per-head
  sites are its inputs and output (`site_ops.head_site`), so a written k or v is what the
  cache keeps for later steps; the pattern site hands q and k, with the scale, soft-cap and
  window the layer was built with, to the runtime (`site_ops.pattern_site`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vinterp.engine.site_ops import (
    Site,
    SiteCalls,
    head_site,
    pattern_site,
    plain_site,
    router_site,
    stream_site,
)
from vinterp.engine.vllm_boundary.layers import (
    attention_math,
    is_attention_layer,
    is_missing_layer,
)
from vinterp.engine.vllm_boundary.parallel import is_first_stage, is_last_stage
from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.sites.attention_pattern import PatternMath
from vinterp.sites.modules import SiteModules
from vinterp.sites.names import SiteOrder, UnknownSiteError

_HIDDEN_KWARGS = ("hidden_states", "x")
BUFFERS_NAME = "vinterp_steer"
CAPTURE_NAME = "vinterp_capture"


@dataclass
class SiteIO:
    """The sites of one method of one module: on its input, its output, or the residual
    stream of a block that takes and returns (hidden, residual)."""

    input_id: int | None = None
    output_id: int | None = None
    stream: bool = False
    experts_id: int | None = None  # a router: output_id are its logits, these its expert ids
    top_k: int = 0
    q_id: int | None = None  # vLLM's attention layer: q, k, v in, the heads (output_id) out
    k_id: int | None = None
    v_id: int | None = None
    pattern_id: int | None = None  # and the pattern, computed from q and k when a trace reads it
    pattern_math: PatternMath | None = None


# SiteIO fields that hold a site id the compiled ops index tables with
_INDEXED_IDS = ("input_id", "output_id", "experts_id", "q_id", "k_id", "v_id")


def _site(module: nn.Module, field: str) -> Site:
    """The site id in SiteIO `field`, with the module's one-element buffer of it (`_add_sites`)."""
    return getattr(module._vinterp_io, field), getattr(module, f"vinterp_{field}")


def _call_with_sites(module: nn.Module, io: SiteIO, inner: Any, args: Any, kwargs: Any) -> Any:
    steer, capture = getattr(module, BUFFERS_NAME), getattr(module, CAPTURE_NAME)
    # the compiled model never reaches the handlers: it does not even look them up
    calls = None if torch.compiler.is_compiling() else module._vinterp_calls
    if io.stream:
        positions, hidden, residual = args
        site_in = _site(module, "input_id")
        if residual is None:
            hidden = plain_site(steer, capture, calls, *site_in, hidden)
        else:
            hidden, residual = stream_site(steer, capture, calls, *site_in, hidden, residual)
        hidden, residual = inner(module, positions, hidden, residual, **kwargs)
        return stream_site(steer, capture, calls, *_site(module, "output_id"), hidden, residual)
    if io.q_id is not None:
        return _attention_with_sites(module, io, inner, args, kwargs, capture, calls)
    if io.input_id is not None:
        site_in = _site(module, "input_id")
        key = next((k for k in _HIDDEN_KWARGS if k in kwargs), None)
        if key is not None:
            kwargs = {**kwargs, key: plain_site(steer, capture, calls, *site_in, kwargs[key])}
        else:
            args = (plain_site(steer, capture, calls, *site_in, args[0]), *args[1:])
    out = inner(module, *args, **kwargs)
    if io.output_id is None:
        return out
    if io.experts_id is not None:
        logits = out[0] if isinstance(out, tuple) else out
        sites = (_site(module, "output_id"), _site(module, "experts_id"))
        logits = router_site(capture, calls, *sites, io.top_k, logits)
        return (logits, *out[1:]) if isinstance(out, tuple) else logits
    site_out = _site(module, "output_id")
    if isinstance(out, tuple):
        return (plain_site(steer, capture, calls, *site_out, out[0]), *out[1:])
    return plain_site(steer, capture, calls, *site_out, out)


def _attention_with_sites(
    module: nn.Module,
    io: SiteIO,
    inner: Any,
    args: Any,
    kwargs: Any,
    capture: CaptureBuffers | None,
    calls: SiteCalls | None,
) -> Any:
    """vLLM's attention layer, called as `attn(q, k, v)` by every architecture's attention."""
    query, key, value, *rest = args
    shapes = _head_shapes(module)
    query = head_site(capture, calls, *_site(module, "q_id"), query, *shapes["q"])
    key = head_site(capture, calls, *_site(module, "k_id"), key, *shapes["k"])
    value = head_site(capture, calls, *_site(module, "v_id"), value, *shapes["v"])
    pattern_site(calls, io.pattern_id, io.pattern_math, query, key, shapes["q"], shapes["k"])
    out = inner(module, query, key, value, *rest, **kwargs)
    return head_site(capture, calls, *_site(module, "output_id"), out, *shapes["heads"])


def _head_shapes(attention: nn.Module) -> dict[str, tuple[int, int]]:
    """(heads, head_dim) at each per-head site of a vLLM attention layer: this worker's own
    heads (under tensor parallelism a slice of them)."""
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    return {
        "q": (heads, attention.head_size),
        "k": (kv_heads, attention.head_size),
        "v": (kv_heads, attention.head_size_v),
        "heads": (heads, attention.head_size_v),
    }


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _site_class(cls: type, method: str) -> type:
    """`cls` with `method` running its sites (one subclass per class and method)."""
    if (cls, method) not in _SUBCLASSES:
        inner = getattr(cls, method)

        def with_sites(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _call_with_sites(self, self._vinterp_io, inner, args, kwargs)

        attrs = {method: with_sites, "_vinterp_base": cls}
        _SUBCLASSES[cls, method] = type(cls.__name__, (cls,), attrs)
    return _SUBCLASSES[cls, method]


def _add_sites(
    module: nn.Module,
    steer: SteerBuffers,
    capture: CaptureBuffers | None,
    calls: SiteCalls,
    method: str,
    io: dict[str, Any],
) -> None:
    if getattr(module, "_vinterp_io", None) is None:
        module.__class__ = _site_class(type(module), method)
        module._vinterp_io = SiteIO()
        module._vinterp_calls = calls
        module.add_module(BUFFERS_NAME, steer)
        module.add_module(CAPTURE_NAME, capture)
    for key, value in io.items():
        setattr(module._vinterp_io, key, value)
        if key in _INDEXED_IDS:
            # a buffer, so that dynamo makes it an input of the graph: with the id as a Python
            # int, each layer's graph would hold its own constants, and vLLM, which compiles a
            # graph once for all layers whose graphs are alike, would compile every layer apart;
            # one element, not 0-dim: indexing with a 0-dim tensor reads it as an int
            device = steer.token_combo.device
            site = torch.tensor([value], dtype=torch.long, device=device)
            module.register_buffer(f"vinterp_{key}", site, persistent=False)


def _passes_residual(layer: nn.Module) -> bool:
    return "residual" in inspect.signature(layer.forward).parameters


def _placements(modules: SiteModules, order: SiteOrder) -> list[tuple[nn.Module, str, dict]]:
    """(module, method, its SiteIO fields) for every site this worker's model runs: a
    pipeline stage runs its own layers, the embedding only on the first stage and the final
    norm only on the last (other stages may build them all the same: tied embeddings, or
    models that build both everywhere)."""
    placed: list[tuple[nn.Module, str, dict]] = []
    if is_first_stage() and not is_missing_layer(modules.embed):
        placed.append((modules.embed, modules.embed_method, {"output_id": order["embed.output"]}))
    for i, layer in enumerate(modules.layers):
        if not modules.holds_layer(layer):
            continue
        placed += [
            (modules.attn(layer), "forward", {"input_id": order[f"layers.{i}.attn.input"]}),
            (modules.attn(layer), "forward", {"output_id": order[f"layers.{i}.attn.output"]}),
            (modules.mlp_input(layer), "forward", {"input_id": order[f"layers.{i}.mlp.input"]}),
            (modules.mlp_output(layer), "forward", {"output_id": order[f"layers.{i}.mlp.output"]}),
            *_heads_placement(modules, order, i, layer),
            *_router_placement(modules, order, i, layer),
            (
                layer,
                "forward",
                {
                    "input_id": order[f"layers.{i}.input"],
                    "output_id": order[f"layers.{i}.output"],
                    "stream": _passes_residual(layer),
                },
            ),
        ]
    if is_last_stage() and not is_missing_layer(modules.final_norm):
        placed.append((modules.final_norm, "forward", {"output_id": order["final_norm.output"]}))
    return placed


def _router_placement(
    modules: SiteModules, order: SiteOrder, i: int, layer: nn.Module
) -> list[tuple[nn.Module, str, dict]]:
    """Layer i's router, if it has one: its logits and expert ids."""
    router = order.router
    if router is None or i not in router.layers:
        return []
    io = {
        "output_id": order[f"layers.{i}.mlp.router.output"],
        "experts_id": order[f"layers.{i}.mlp.router.experts"],
        "top_k": router.top_k,
    }
    return [(modules.router(layer), "forward", io)]


def _heads_placement(
    modules: SiteModules, order: SiteOrder, i: int, layer: nn.Module
) -> list[tuple[nn.Module, str, dict]]:
    """Layer i's attention layer, if the model has per-head sites: q, k, v, the pattern and
    the heads."""
    if order.heads is None:
        return []
    attention = _attention_layer(modules, layer)
    io: dict[str, Any] = {
        f"{part}_id": order[f"layers.{i}.attn.{part}"] for part in ("q", "k", "v", "pattern")
    }
    io["output_id"] = order[f"layers.{i}.attn.heads"]
    io["pattern_math"] = attention_math(attention)
    return [(attention, "forward", io)]


def _attention_layer(modules: SiteModules, layer: nn.Module) -> nn.Module:
    """vLLM's attention layer inside a layer's attention module (its `attn`)."""
    found = getattr(modules.attn(layer), "attn", None)
    if not is_attention_layer(found):
        raise UnknownSiteError(
            f"the per-head attention sites need vLLM's Attention layer at "
            f"{modules.attn_name}.attn; {type(modules.attn(layer)).__name__} has none"
        )
    return found


def _row_shapes(
    modules: SiteModules, order: SiteOrder, dtype: torch.dtype
) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the rows of the router and per-head sites: a router's logits in the
    gate's output dtype, its expert ids as int64; the heads of this worker's attention layer
    in the model's dtype."""
    router = order.router
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    for i, layer in enumerate(modules.layers):
        if not modules.holds_layer(layer):
            continue  # another pipeline stage's layer
        if router is not None and i in router.layers:
            logits_dtype = getattr(modules.router(layer), "out_dtype", None) or dtype
            shapes[order[f"layers.{i}.mlp.router.output"]] = ((router.experts,), logits_dtype)
            shapes[order[f"layers.{i}.mlp.router.experts"]] = ((router.top_k,), torch.long)
        if order.heads is not None:
            for part, shape in _head_shapes(_attention_layer(modules, layer)).items():
                shapes[order[f"layers.{i}.attn.{part}"]] = (shape, dtype)
    return shapes


def held_site_ids(modules: SiteModules, order: SiteOrder) -> frozenset[int]:
    """The sites this worker's model runs (a pipeline stage: its own)."""
    placed = _placements(modules, order)
    return frozenset(v for _, _, io in placed for k, v in io.items() if k.endswith("_id"))


def install_vllm_sites(
    modules: SiteModules,
    order: SiteOrder,
    steer: SteerBuffers,
    calls: SiteCalls,
    capture_rows: int = 0,
    capture_sites: frozenset[int] = frozenset(),
) -> CaptureBuffers | None:
    """Give every site module of a vLLM model its sites, all reading `steer` and calling
    the runner's `calls`; with `capture_sites`, also capture buffers of `capture_rows` rows
    for those of them this model holds (returned)."""
    placed = _placements(modules, order)
    capture = None
    if capture_sites:
        add = steer.add
        capture = CaptureBuffers(
            len(order.sites),
            capture_sites,
            sorted(held_site_ids(modules, order)),
            capture_rows,
            add.shape[1],
            add.dtype,
            add.device,
            steer.counters,
            _row_shapes(modules, order, add.dtype),
        )
    for module, method, io in placed:
        _add_sites(module, steer, capture, calls, method, io)
    return capture
