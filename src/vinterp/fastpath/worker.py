"""The fast path inside a worker: global and named steering, per-step tables, capture store.

Called from the site ops' handlers (runtime.vllm_runtime) before any traced intervention at
the same site, so traces and captures see the steered values, as the model computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from vinterp.fastpath.capture_store import CaptureStore
from vinterp.fastpath.specs import SteerSpec, decode_request
from vinterp.fastpath.tables import RowSpan, StepTables, build_tables
from vinterp.sites.names import SiteOrder


class FastPath:
    def __init__(self, order: SiteOrder, captures_here: bool) -> None:
        self.order = order
        self.captures_here = captures_here  # TP: one rank records, the others skip the copies
        self.global_steering: list[SteerSpec] = []
        self.named: dict[str, SteerSpec] = {}
        self.store = CaptureStore()
        self.tables = StepTables()

    def set_global(self, wires: list[dict[str, Any]]) -> None:
        self.global_steering = [SteerSpec.from_wire(w) for w in wires]

    def register(self, name: str, wire: dict[str, Any] | None) -> None:
        if wire is None:
            self.named.pop(name, None)
        else:
            self.named[name] = SteerSpec.from_wire(wire)

    def begin_step(self, requests: list[tuple[RowSpan, dict[str, Any] | None]]) -> None:
        if not self.global_steering and not any(extra for _, extra in requests):
            self.tables = StepTables()
            return
        entries = []
        for span, extra in requests:
            specs = list(self.global_steering)
            capture = None
            if extra:
                fast = decode_request(extra, self.order)
                specs += [self.named[n] for n in fast.steering_names if n in self.named]
                specs += fast.steering
                capture = fast.capture if self.captures_here else None
            if specs or capture is not None:
                entries.append((span, specs, capture))
        self.tables = build_tables(entries)

    def on_plain(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        out = None
        steer = self.tables.steer.get(site)
        if steer is not None:
            out = x.clone()
            steer.add_to(out)
        captures = self.tables.capture.get(site)
        if captures:
            self.store.record_site(site, captures, x if out is None else out)
        return out

    def on_stream(
        self, site: str, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = None
        steer = self.tables.steer.get(site)
        if steer is not None:
            rows = steer.rows().to(hidden.device)
            new_h, new_r = hidden.clone(), residual.clone()
            new_r[rows] = hidden[rows] + residual[rows]  # fold the stream into residual rows,
            new_h[rows] = 0  # as a traced write does, so both give the same numbers
            steer.add_to(new_r)
            out = (new_h, new_r)
        captures = self.tables.capture.get(site)
        if captures:
            h, r = out if out is not None else (hidden, residual)
            self.store.record_site(site, captures, h + r)
        return out

    def take_captures(self, capture_ids: list[str]) -> dict[str, Any]:
        return self.store.take(capture_ids) if self.captures_here else {}
