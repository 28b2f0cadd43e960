"""Captured rows kept in the worker until the client takes them (one store per worker), and
the block format they travel in.

Each site is gathered once per step for all requests (one copy, not one per request) and
stays on the device until taken. A take sends one block per site for all the ids taken, so
its cost grows with sites and steps, not with how many requests capture.

On a GPU a take arrives while a later step is queued on the compute stream. Each step's rows
carry the event recorded after they were gathered, and a take joins them on a stream of its
own after those events (`device_order.after`), so the rows of a finished step reach the host
while the queued step computes instead of after it.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import accumulate, chain
from typing import Any

import torch

from vinterp.interventions.device_order import StepEvent, after, step_event
from vinterp.interventions.host_to_device import on_device
from vinterp.interventions.tables import SiteCapture
from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire

Encoder = Callable[[torch.Tensor], Any]  # a site's values -> what travels to the front end
# per capture id, per site, for each step: (the step's gathered rows, first row, positions,
# the event after which the rows are computed: None off a GPU)
_Chunk = tuple[torch.Tensor, int, list[int], StepEvent]


class CaptureStore:
    def __init__(self) -> None:
        self._chunks: dict[str, dict[str, list[_Chunk]]] = defaultdict(lambda: defaultdict(list))

    def held(self) -> int:
        """How many capture ids have rows here, untaken."""
        return len(self._chunks)

    def record_site(self, site: str, capture: SiteCapture, value: torch.Tensor) -> None:
        """Gather this step's recorded rows of a site's whole value."""
        gathered = value.detach().index_select(0, capture.rows_on(value.device))
        self.add_gathered(site, capture, gathered)

    def add_gathered(self, site: str, capture: SiteCapture, gathered: torch.Tensor) -> None:
        """Keep a site's rows of one step, already gathered in `capture.rows`' order."""
        start, ready = 0, step_event(gathered)
        for capture_id, positions in capture.parts:
            self._chunks[capture_id][site].append((gathered, start, positions, ready))
            start += len(positions)

    def take(
        self, capture_ids: list[str], encode: Encoder = tensor_to_wire
    ) -> dict[str, dict[str, Any]]:
        """{site: block} of the rows of `capture_ids` (see `site_block`), removed here;
        `encode` turns each site's values into what travels (`capture_files.FileWriter`)."""
        owned: dict[str, list[tuple[str, list[_Chunk]]]] = defaultdict(list)
        for cid in capture_ids:
            for site, chunks in self._chunks.pop(cid, {}).items():
                owned[site].append((cid, chunks))
        layouts: dict[tuple, _Layout] = {}  # sites recorded for the same requests share one
        return {site: site_block(chunks, layouts, encode) for site, chunks in owned.items()}


class _Layout:
    """Where one site's rows come from, for a set of ids: which rows of each step, in what
    order, and each id's positions ("parts"). Sites recorded in the same steps for the same
    requests (every site of one `Capture`) share it, so it is worked out once per take."""

    def __init__(self, owned: list[tuple[str, list[_Chunk]]], steps: list[int]) -> None:
        starts: list[int] = []
        lengths: list[int] = []
        positions: list[int] = []
        counts: list[int] = []
        for _, chunks in owned:  # Python per id; its chunks go through C iterators
            _, firsts, chunk_positions, _ = zip(*chunks)
            starts += firsts
            sizes = list(map(len, chunk_positions))
            lengths += sizes
            counts.append(sum(sizes))
            positions += chain.from_iterable(chunk_positions)
        lo, hi, rows = _joined(_longs(steps), _longs(starts), _longs(lengths))
        self.lo, self.hi = lo.tolist(), hi.tolist()  # each site's pieces are cut by these
        owner = torch.arange(len(owned)).repeat_interleave(_longs(counts))
        keep = _latest_in_order(owner, _longs(positions))
        if keep is not None:
            rows, positions = rows[keep], [positions[i] for i in keep.tolist()]
            counts = torch.bincount(owner[keep], minlength=len(owned)).tolist()
        joined_rows = int((hi - lo).sum())
        self.rows = None if torch.equal(rows, torch.arange(joined_rows)) else rows
        ends = list(accumulate(counts))
        self.parts = [[cid, positions[a:b]] for (cid, _), a, b in zip(owned, [0, *ends], ends)]

    def values(self, gathered: list[torch.Tensor]) -> torch.Tensor:
        """One site's rows, from its steps' gathered tensors (in first-met order). Rows of
        different widths (attention patterns over prompts of different lengths) are padded
        with zeros to the widest; the front end cuts each back to its prompt."""
        pieces = [g[a:b] for g, a, b in zip(gathered, self.lo, self.hi)]
        width = max(p.shape[-1] for p in pieces)
        if any(p.shape[-1] < width for p in pieces):
            pieces = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in pieces]
        values = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if self.rows is None:
            return values
        return values.index_select(0, on_device(self.rows, values.device))


def site_block(
    owned: list[tuple[str, list[_Chunk]]], layouts: dict[tuple, _Layout], encode: Encoder
) -> dict[str, Any]:
    """One site's rows for several ids: "values", one wire tensor grouped by id in `owned`'s
    order, and "parts", [[capture id, positions]], each id's positions in order. A position
    recorded twice (a preempted request recomputed) keeps its latest row. `layouts`: the
    layouts of this take's other sites, by what they were recorded from."""
    tensors = [chunk[0] for _, chunks in owned for chunk in chunks]
    gathered = dict(zip(map(id, tensors), tensors))  # each step's rows, in the order first met
    ready = {id(chunk[3]): chunk[3] for _, chunks in owned for chunk in chunks}
    # A step's tables give every site of a request one positions list (built in that step):
    # the same lists at the same starts mean the same rows of the same steps.
    key = (
        tuple(chunk[1] for _, chunks in owned for chunk in chunks),
        tuple(id(chunk[2]) for _, chunks in owned for chunk in chunks),
    )
    if key not in layouts:
        step_of = {k: i for i, k in enumerate(gathered)}
        layouts[key] = _Layout(owned, list(map(step_of.__getitem__, map(id, tensors))))
    layout = layouts[key]
    steps = list(gathered.values())
    with after(list(ready.values()), steps):
        return {"values": encode(layout.values(steps)), "parts": layout.parts}


def _joined(
    step: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which rows of each step the chunks use (lo, hi: a chunk's rows are contiguous), and
    where each chunk's each row lands once the steps' used rows are joined in step order."""
    zeros = starts.new_zeros(int(step.max()) + 1)  # only a start (include_self=False)
    lo = zeros.scatter_reduce(0, step, starts, "amin", include_self=False)
    hi = zeros.scatter_reduce(0, step, starts + lengths, "amax", include_self=False)
    step_first = (hi - lo).cumsum(0) - (hi - lo) - lo  # where a step's row 0 would land
    chunk_first = step_first[step] + starts - (lengths.cumsum(0) - lengths)
    rows = chunk_first.repeat_interleave(lengths) + torch.arange(int(lengths.sum()))
    return lo, hi, rows


def _latest_in_order(owner: torch.Tensor, position: torch.Tensor) -> torch.Tensor | None:
    """The entries to keep, sorted by (owner, position), the latest recorded of equal ones;
    None when they already are (the usual case: no request was recomputed)."""
    key = owner * (int(position.max()) + 1) + position
    if bool((key[1:] > key[:-1]).all()):
        return None
    order = torch.sort(key, stable=True).indices
    key = key[order]
    latest = torch.ones_like(key, dtype=torch.bool)
    latest[:-1] = key[1:] != key[:-1]
    return order[latest]


def _longs(values: Iterable[int]) -> torch.Tensor:
    """An int64 tensor from Python ints (through an array: a few times faster than a list)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def merge_captures(
    per_worker: list[dict[str, dict[str, Any]]],
    decode: Callable[[Any, str], torch.Tensor] = tensor_from_wire,
) -> dict[str, dict[str, Any]]:
    """{capture id: {site: {"positions", "values"}}} from every worker's blocks (PP stages
    hold different sites; other TP ranks send {}). Each block is decoded once (`decode`:
    inline wire tensors, or `capture_files.FileHandoff.tensor`); an id's rows are a view of
    it."""
    merged: dict[str, dict[str, Any]] = defaultdict(dict)
    for blocks in per_worker:
        for site, block in blocks.items():
            values = decode(block["values"], f"captured rows at {site}")
            parts = block["parts"]
            for (cid, positions), rows in zip(
                parts, torch.split(values, [len(p) for _, p in parts])
            ):
                merged[cid][site] = {"positions": positions, "values": rows}
    return dict(merged)
