"""What runs at every standardized site inside vLLM's model.

Up to three parts, so that graph replay never skips an intervention (router and per-head
sites have no steering: their values are not the residual stream):
- steering, as plain tensor ops on persistent buffers (`interventions.steer_buffers`): compiled
  into the model and replayed in CUDA graphs, so it holds in every step;
- with `capture_in_graph`, capture the same way (`interventions.capture_buffers`), after steering;
- Python handlers (traces, captures, raw hooks), called only in the steps that vinterp runs
  uncompiled (the runner hooks decide per step, before vLLM picks the graph mode). Under
  torch.compile the handler branch is not traced at all: the compiled model holds nothing
  but the steering ops, and no Python runs at a site in a compiled or replayed step.
Each model runner has its own `SiteCalls` (its runtime's handlers and whether the current
step calls them), reached through the site modules of its model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.graph_recording import ops_recorded
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.sites.attention_pattern import PatternMath

# A site's id as an int (what Python decides with) and as its module's one-element buffer
# (what the compiled graph indexes with: an input, so every layer's graph is the same one)
Site = tuple[int, torch.Tensor]
SiteHandler = Callable[[int, torch.Tensor], torch.Tensor | None]
StreamHandler = Callable[
    [int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None
]
PatternHandler = Callable[[int, torch.Tensor, torch.Tensor, PatternMath], None]


@dataclass
class SiteCalls:
    """One runner's site handlers and whether the current step calls them: it runs
    uncompiled (bound and set by the runner hooks, before each step from the runtime's
    `StepMode`)."""

    site: SiteHandler | None = None
    stream: StreamHandler | None = None
    pattern: PatternHandler | None = None
    uncompiled: bool = False


def _calling(calls: SiteCalls | None) -> bool:
    return not ops_recorded() and calls is not None and calls.uncompiled


def plain_site(
    steer: SteerBuffers,
    capture: CaptureBuffers | None,
    calls: SiteCalls | None,
    site_id: int,
    site: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    """A (tokens, H) site: steering, capture into buffers, then (in uncompiled steps) the
    Python handler. `site` is `site_id` as the module's one-element tensor: the tensor ops index
    with it, so that every layer's graph is one graph to compile."""
    x = steer(site_id, site, x)
    if capture is not None:
        capture(site_id, site, x)
    if _calling(calls):
        out = calls.site(site_id, x)  # type: ignore[union-attr]
        if out is not None:
            x = out
    return x


def stream_site(
    steer: SteerBuffers,
    capture: CaptureBuffers | None,
    calls: SiteCalls | None,
    site_id: int,
    site: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's residual stream as (hidden, residual), whose sum is the HF block output:
    steering goes into the residual part, norm-matched against the sum."""
    residual = steer(site_id, site, residual, norm_of=hidden + residual)
    if capture is not None:
        capture(site_id, site, hidden, plus=residual)
    if _calling(calls):
        out = calls.stream(site_id, hidden, residual)  # type: ignore[union-attr]
        if out is not None:
            hidden, residual = out
    return hidden, residual


def chosen_experts(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids of the experts a router picks per token: the top-k of the softmax of its
    logits, in the order of their weights (the model's renormalization does not change them)."""
    return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1).indices


def router_site(
    capture: CaptureBuffers | None,
    calls: SiteCalls | None,
    logits_site: Site,
    experts_site: Site,
    top_k: int,
    logits: torch.Tensor,
) -> torch.Tensor:
    """A router's (tokens, experts) logits: captured, then (in uncompiled steps) the Python
    handler, which may replace them; the experts they pick are then captured and handed to the
    handler (read-only). The compiled model computes those ids only for a capture buffer."""
    logits_id, experts_id = logits_site[0], experts_site[0]
    if capture is not None:
        capture(*logits_site, logits)
    calling = _calling(calls)
    if calling:
        out = calls.site(logits_id, logits)  # type: ignore[union-attr]
        if out is not None:
            logits = out
    if calling or (capture is not None and capture.holds(experts_id)):
        experts = chosen_experts(logits, top_k)
        if capture is not None:
            capture(*experts_site, experts)
        if calling:
            calls.site(experts_id, experts)  # type: ignore[union-attr]
    return logits


def head_site(
    capture: CaptureBuffers | None,
    calls: SiteCalls | None,
    site_id: int,
    site: torch.Tensor,
    x: torch.Tensor,
    heads: int,
    head_dim: int,
) -> torch.Tensor:
    """A per-head site: vLLM's flat (tokens, heads * head_dim) attention tensor, seen as the
    (tokens, heads, head_dim) view; captured, then (in uncompiled steps) the Python handler,
    whose replacement goes on flat."""
    view = x.view(x.shape[0], heads, head_dim)
    if capture is not None:
        capture(site_id, site, view)
    if _calling(calls):
        out = calls.site(site_id, view)  # type: ignore[union-attr]
        if out is not None:
            return out.reshape(x.shape)
    return x


def pattern_site(
    calls: SiteCalls | None,
    site_id: int | None,
    math: PatternMath | None,
    query: torch.Tensor,
    key: torch.Tensor,
    query_heads: tuple[int, int],
    key_heads: tuple[int, int],
) -> None:
    """The attention pattern (in uncompiled steps only): q and k as attention takes them,
    (tokens, heads, head_dim) views, for the handler to keep keys and compute what is read."""
    if site_id is None or math is None or not _calling(calls):
        return
    handler = calls.pattern  # type: ignore[union-attr]
    if handler is not None:
        q = query.view(query.shape[0], *query_heads)
        handler(site_id, q, key.view(key.shape[0], *key_heads), math)
