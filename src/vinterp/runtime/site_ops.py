"""The custom ops placed at every standardized site inside vLLM's model.

They are opaque to torch.compile, so they survive compilation and run our Python at each
site on every step; with nothing to do they return copies of their inputs (custom ops may
not return aliases). `site` handles a plain activation; `stream` handles vLLM's residual
stream, carried as (hidden, residual) whose sum is the HF block output.

Defined with `torch.library.Library` rather than `torch.library.custom_op`: a model has a
few hundred sites per step and custom_op's Python wrapper costs ~50 us per call, which alone
made an idle vinterp engine ~5% slower than plain vLLM (`vinterp bench`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SiteHandler = Callable[[int, torch.Tensor], torch.Tensor | None]
StreamHandler = Callable[
    [int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None
]


class _Handlers:
    site: SiteHandler | None = None
    stream: StreamHandler | None = None


HANDLERS = _Handlers()


def site(x: torch.Tensor, site_id: int) -> torch.Tensor:
    handler = HANDLERS.site
    out = handler(site_id, x) if handler is not None else None
    return x.clone() if out is None else out


def stream(
    hidden: torch.Tensor, residual: torch.Tensor, site_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    handler = HANDLERS.stream
    out = handler(site_id, hidden, residual) if handler is not None else None
    return (hidden.clone(), residual.clone()) if out is None else out


def _site_fake(x: torch.Tensor, site_id: int) -> torch.Tensor:
    return torch.empty_like(x)


def _stream_fake(
    hidden: torch.Tensor, residual: torch.Tensor, site_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(hidden), torch.empty_like(residual)


LIBRARY = torch.library.Library("vinterp", "DEF")  # kept alive: dropping it unregisters
LIBRARY.define("site(Tensor x, int site_id) -> Tensor")
LIBRARY.define("stream(Tensor hidden, Tensor residual, int site_id) -> (Tensor, Tensor)")
for _name, _impl, _fake in (("site", site, _site_fake), ("stream", stream, _stream_fake)):
    LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"vinterp::{_name}", _fake, lib=LIBRARY)
