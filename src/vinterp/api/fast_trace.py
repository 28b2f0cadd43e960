"""Steering and capture expressed as trace writes and saves.

The HF backend runs them this way (the reference), and so does any trace on HF while a
global steering is set. On vLLM the same specs run on the fast path; tests compare the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vinterp.api.specs import Steering
from vinterp.sites.names import parse_site

if TYPE_CHECKING:
    from vinterp.api.fast import Prepared
    from vinterp.api.llm import LLM
    from vinterp.api.trace import Trace
    from vinterp.engine.outputs import Output


def site_point(llm: LLM, site: str) -> tuple[Any, str]:
    """(object, attribute) whose attribute is the named standardized site."""
    parsed = parse_site(site)
    point: Any = llm if parsed.layer is None else llm.layers[parsed.layer]
    if parsed.module:
        point = getattr(point, parsed.module)
    return point, parsed.value


def record_steering(llm: LLM, tr: Trace, spec: Steering, prompt_len: int) -> None:
    """Record `site += scale * v` (per spec phase and positions) in the open invoke."""

    def write_all() -> None:
        for site, vector in spec.vectors.items():
            point, which = site_point(llm, site)
            value = getattr(point, which)
            if positions is None:
                setattr(point, which, value + _addend(spec, vector, value))
            else:
                rows = value[positions]
                value[positions] = rows + _addend(spec, vector, rows)

    positions = None if spec.positions is None else [p for p in spec.positions if p < prompt_len]
    if positions is not None or spec.phase == "prefill":
        if spec.phase != "decode" and positions != []:
            write_all()  # prompt positions exist at step 0 only
    else:
        for _ in tr.iter[1:] if spec.phase == "decode" else tr.iter[:]:
            write_all()


def _addend(spec: Steering, vector: torch.Tensor, value: Any) -> Any:
    if spec.norm_match:
        unit = spec.scale * vector / vector.norm().clamp_min(1e-12)
        return value.norm(dim=-1, keepdim=True) * unit
    return spec.scale * vector


def record_capture(llm: LLM, tr: Trace, sites: list[str]) -> dict[str, list[Any]]:
    """Save every capture site at step 0 (the prompt) and at each later step."""
    saved: dict[str, list[Any]] = {}
    for site in sites:
        point, which = site_point(llm, site)
        saved[site] = [getattr(point, which).save()]
    for _ in tr.iter[1:]:
        for site in sites:
            point, which = site_point(llm, site)
            saved[site].append(getattr(point, which).save())
    return saved


def capture_rows(req: Prepared, saved: dict[str, list[Any]]) -> dict[str, Any]:
    """Trace saves -> the rows the fast path would have recorded, keyed by position."""
    from vinterp.fastpath.specs import CaptureSpec

    assert req.capture is not None
    positions = req.capture.positions
    spec = CaptureSpec(
        req.capture_id,
        tuple(req.capture_sites),
        frozenset(positions) if isinstance(positions, list) else positions,
    )
    rows = {}
    for site, (prompt_value, *per_step) in saved.items():
        values = (
            torch.cat([prompt_value, *[v.reshape(1, -1) for v in per_step[0]]])
            if per_step
            else prompt_value
        )
        keep = [p for p in range(values.shape[0]) if spec.wants(p, len(req.prompt))]
        rows[site] = {"positions": keep, "values": values[keep]}
    return rows


def generate_with_trace(llm: LLM, requests: list[Prepared], use_tqdm: bool) -> list[Output]:
    """Run prepared requests as one trace (HF backend): steering writes, capture saves."""
    from vinterp.api.fast import deliver

    saved: dict[int, dict[str, list[Any]]] = {}
    with llm.trace(use_tqdm=use_tqdm) as tr:
        for k, req in enumerate(requests):
            with tr.invoke(req.prompt, **req.sampling):
                named = [llm.steering.named[n] for n in req.steering_names]
                for spec in req.steering + named:
                    record_steering(llm, tr, spec, len(req.prompt))
                if req.capture is not None:
                    saved[k] = record_capture(llm, tr, req.capture_sites)
    outputs = tr.outputs
    for k, site_saves in saved.items():
        deliver(
            requests[k], outputs[k], capture_rows(requests[k], site_saves), k, str(llm.model_path)
        )
    return outputs
