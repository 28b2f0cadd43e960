"""Capture inside the compiled model (`vinterp.LLM(capture_in_graph=True)`, or the sites a
user names: `capture_in_graph="layers.*.output"`): every such site gathers a fixed number of
rows into its own persistent buffer, so capturing steps keep vLLM's CUDA graphs.

At each site the compiled model runs

    rows_<site>[:] = x[index[site]]

where `index` (sites, max_rows) is written by the runner before a capturing step, outside the
graph: the batch rows each site records, the rest 0. After the step the runner copies the
first rows of each captured site's buffer into the capture store. The gathers run in every
step (a graph cannot skip them), which is the price of this route: a few small kernels per
site even when nothing is captured, against leaving graph replay for every capturing step.
Naming sites cuts that price (and the buffers' memory) to theirs. A step that needs more rows
than the buffers hold, captures a site without a buffer, or also runs a trace, takes the
uncompiled route instead.
"""

from __future__ import annotations

import torch
from torch import nn

from vinterp.interventions.applied import AppliedCounters
from vinterp.interventions.graph_recording import ops_recorded
from vinterp.interventions.host_to_device import upload
from vinterp.sites.names import (
    HEAD_SITES,
    PATTERN,
    ROUTER_SITES,
    SiteOrder,
    UnknownSiteError,
    is_pattern,
)
from vinterp.wire.tensors import is_int

BufferSetting = bool | list[str]  # every site / none, or site names and patterns


def buffer_setting(value: object) -> BufferSetting:
    """`capture_in_graph` as the engine's config carries it (JSON): True, False, or a list of
    site names and patterns."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(
        f"capture_in_graph={value!r}: give True (buffers at every site), False (none), or the "
        "sites to capture in the graph, e.g. 'layers.*.output' or ['embed.output', "
        "'layers.*.output']"
    )


RowsSetting = int | str | None  # rows per buffer: a number, "step", or None (one per sequence)


def buffer_rows_setting(value: object) -> RowsSetting:
    """`capture_in_graph_rows` checked: None (one row per sequence the engine runs at once:
    last_prompt and decoding), "step" (every token one engine step computes: all prompt
    positions), or a number of rows."""
    if value is None or value == "step" or (is_int(value) and value > 0):
        return value
    raise TypeError(
        f"capture_in_graph_rows={value!r}: give None (one row per sequence: last_prompt and "
        "decoding), 'step' (every token of an engine step: all prompt positions) or a number "
        "of rows > 0"
    )


def buffer_rows(setting: RowsSetting, max_num_seqs: int, step_tokens: int) -> int:
    """The rows each capture buffer holds for a `buffer_rows_setting`."""
    if setting is None:
        return max_num_seqs
    return step_tokens if setting == "step" else int(setting)


def buffer_site_ids(setting: BufferSetting, order: SiteOrder) -> frozenset[int]:
    """The sites that get capture buffers, on every worker (a pipeline stage holds some of
    them): True buffers every site of hidden-size rows; per-head and router sites get
    buffers when named, so True costs what it did on models without them. An unknown name
    raises `UnknownSiteError`, which says what would be right."""
    if setting is True:
        per_head = order.ids_of((*HEAD_SITES, PATTERN, *ROUTER_SITES))
        return frozenset(range(len(order.sites))) - per_head
    if not setting:
        return frozenset()
    sites = [site for pattern in setting for site in order.expand(pattern)]
    patterns = [site for site in sites if is_pattern(site)]
    if patterns:
        raise UnknownSiteError(
            f"capture_in_graph: {patterns[0]} cannot have a capture buffer (an attention "
            "pattern is computed from the keys of every earlier step, outside the compiled "
            "model); its captures run in uncompiled steps without one"
        )
    return frozenset(map(order.__getitem__, sites))


_NO_ROWS = torch.zeros(0, dtype=torch.int32)


class CaptureBuffers(nn.Module):
    def __init__(
        self,
        num_sites: int,
        chosen: frozenset[int],
        held: list[int],
        max_rows: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        counters: AppliedCounters | None = None,
        row_shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        """`row_shapes`: (shape, dtype) of the rows of sites that are not ((hidden_size,),
        dtype), e.g. a router's logits and expert ids, a per-head site's (heads, head_dim)."""
        super().__init__()
        self.max_rows = max_rows
        self.counters = counters  # with the check on (`interventions.applied`)
        index = torch.zeros(num_sites, max_rows, dtype=torch.int32, device=device)
        self.register_buffer("index", index, persistent=False)
        self.chosen = chosen  # the sites with buffers, on any worker: a capture elsewhere leaves
        self.site_ids = chosen.intersection(held)  # those this worker's model holds (PP: a stage)
        shapes = row_shapes or {}
        for site_id in sorted(self.site_ids):
            shape, row_dtype = shapes.get(site_id, ((hidden_size,), dtype))
            rows = torch.zeros(max_rows, *shape, dtype=row_dtype, device=device)
            self.register_buffer(f"rows_{site_id}", rows, persistent=False)
        self.active = False  # whether this step captures through the buffers
        self._written: dict[int, torch.Tensor] = {}  # per buffered site, what `index` holds

    def holds(self, site_id: int) -> bool:
        """Whether `site_id` has a buffer on this worker."""
        return site_id in self.site_ids

    def forward(
        self,
        site_id: int,
        site: torch.Tensor,
        x: torch.Tensor,
        plus: torch.Tensor | None = None,
    ) -> None:
        """Gather this step's rows of `x` (+ `plus`: the residual stream's other part) at
        `site_id` (`site`: the same id as a one-element tensor, which the graph indexes with, so
        that it is the same graph at every layer). A site without a buffer, and an uncompiled
        step that does not capture this way, skip it (never while a graph records)."""
        if site_id not in self.site_ids:
            return
        if not ops_recorded() and not self.active:
            return
        index = self.index.index_select(0, site)[0]
        rows = x.index_select(0, index)
        if plus is not None:
            rows = rows + plus.index_select(0, index)
        getattr(self, f"rows_{site_id}").copy_(rows)
        if self.counters is not None:
            self.counters.count_gather(site)

    def write(self, rows: dict[int, torch.Tensor]) -> None:
        """Set `index` for a step: the batch rows each site gathers, by site id (none: all rows
        0, so every gather stays inside any batch). Only the rows of this worker's buffered
        sites are written, each only when it changes (a decode step repeats the last one's):
        the whole (sites x rows) table would be tens of MB a step on an 8B model."""
        for site_id in self.site_ids:
            site_rows = rows.get(site_id)
            new = _NO_ROWS if site_rows is None else site_rows.to(torch.int32)
            before = self._written.get(site_id, _NO_ROWS)
            if torch.equal(new, before):
                continue
            padded = new  # zeros over the rows the last step named beyond this one's
            if len(new) < len(before):
                padded = torch.cat([new, torch.zeros(len(before) - len(new), dtype=torch.int32)])
            upload(self.index[site_id, : len(padded)], padded)
            self._written[site_id] = new

    def gathered(self, site_id: int, num_rows: int) -> torch.Tensor:
        """A copy of the rows a step gathered at `site_id` (the buffer is overwritten by the
        next step)."""
        return getattr(self, f"rows_{site_id}")[:num_rows].clone()
