"""Capture inside the compiled model (`vinterp.LLM(capture_in_graph=True)`): every site
gathers a fixed number of rows into its own persistent buffer, so capturing steps keep
vLLM's CUDA graphs.

At each site the compiled model runs

    rows_<site>[:] = x[index[site]]

where `index` (sites, max_rows) is written by the runner before a capturing step, outside the
graph: the batch rows each site records, the rest 0. After the step the runner copies the
first rows of each captured site's buffer into the capture store. The gathers run in every
step (a graph cannot skip them), which is the price of this route: a few small kernels per
site even when nothing is captured, against leaving graph replay for every capturing step.
A step that needs more rows than the buffers hold, or that also runs a trace, takes the
uncompiled route instead.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vinterp.fastpath.tables import SiteCapture
from vinterp.fastpath.uploads import upload


class CaptureBuffers(nn.Module):
    def __init__(
        self,
        num_sites: int,
        site_ids: list[int],
        max_rows: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.max_rows = max_rows
        index = torch.zeros(num_sites, max_rows, dtype=torch.int32, device=device)
        self.register_buffer("index", index, persistent=False)
        self.site_ids = frozenset(site_ids)  # the sites this worker's model holds (PP: its stage's)
        for site_id in site_ids:
            rows = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            self.register_buffer(f"rows_{site_id}", rows, persistent=False)
        self.active = False  # whether this step captures through the buffers
        self._on_device = np.zeros(tuple(self.index.shape), dtype=np.int32)  # what `index` holds

    def forward(self, site_id: int, x: torch.Tensor, plus: torch.Tensor | None = None) -> None:
        """Gather this step's rows of `x` (+ `plus`: the residual stream's other part) at
        `site_id`. An uncompiled step that does not capture this way skips it."""
        if not torch.compiler.is_compiling() and not self.active:
            return
        index = self.index[site_id]
        rows = x.index_select(0, index)
        if plus is not None:
            rows = rows + plus.index_select(0, index)
        getattr(self, f"rows_{site_id}").copy_(rows)

    def write(self, tables: dict[int, SiteCapture]) -> None:
        """Set `index` for a step: each site's recorded rows by site id (none: all rows 0, so
        every gather stays inside any batch)."""
        if not tables and not self._on_device.any():
            return
        index = np.zeros_like(self._on_device)
        for site_id, capture in tables.items():
            index[site_id, : len(capture.rows)] = capture.rows.numpy()
        if not np.array_equal(index, self._on_device):  # a decode step repeats the last one's
            upload(self.index, torch.from_numpy(index))
            self._on_device = index

    def gathered(self, site_id: int, num_rows: int) -> torch.Tensor:
        """A copy of the rows a step gathered at `site_id` (the buffer is overwritten by the
        next step)."""
        return getattr(self, f"rows_{site_id}")[:num_rows].clone()
