"""The custom ops placed at every standardized site inside vLLM's model.

They are opaque to torch.compile, so they survive compilation and run our Python at each
site on every step; with nothing to do they return copies of their inputs (custom ops may
not return aliases). `site` handles a plain activation; `stream` handles vLLM's residual
stream, carried as (hidden, residual) whose sum is the HF block output.
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


@torch.library.custom_op("vinterp::site", mutates_args=())
def site(x: torch.Tensor, site_id: int) -> torch.Tensor:
    handler = HANDLERS.site
    out = handler(site_id, x) if handler is not None else None
    return x.clone() if out is None else out


@site.register_fake
def _site_fake(x: torch.Tensor, site_id: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("vinterp::stream", mutates_args=())
def stream(
    hidden: torch.Tensor, residual: torch.Tensor, site_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    handler = HANDLERS.stream
    out = handler(site_id, hidden, residual) if handler is not None else None
    return (hidden.clone(), residual.clone()) if out is None else out


@stream.register_fake
def _stream_fake(
    hidden: torch.Tensor, residual: torch.Tensor, site_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(hidden), torch.empty_like(residual)
