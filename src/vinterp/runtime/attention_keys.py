"""Keys kept across steps for attention patterns, which vLLM's kernels never materialize.

A pattern row over all earlier positions needs their keys; vLLM's KV cache holds them in the
attention backend's own layout, so the runtime keeps its own copy, per request and layer, for
as long as a traced invoke reads that layer's pattern or a capture waits for its last prompt
token's row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from vinterp.interventions.specs import WorkerCapture
from vinterp.interventions.tables import RowSpan
from vinterp.sites.attention_pattern import Pattern, PatternMath

if TYPE_CHECKING:
    from vinterp.runtime.trace_dispatch import Slot

RequestCapture = tuple[str, RowSpan, WorkerCapture]  # a capturing request's id, rows and spec
# keep_row(site, capture id, position, row): a captured pattern row
KeepRow = Callable[[str, str, int, torch.Tensor], None]


class KeptKeys:
    """One request's keys at one layer, position by position, in a buffer that doubles when
    full (a step adds its keys without copying the earlier ones)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def put(self, first: int, own: torch.Tensor) -> torch.Tensor:
        """Keys of positions `first`.. (a request recomputed from an earlier position
        replaces them from there); all of them up to the last, a view."""
        end = first + len(own)
        if self.buffer is None or end > len(self.buffer):
            grown = own.new_empty((max(end, 2 * self.length), *own.shape[1:]))
            if self.buffer is not None:
                grown[:first] = self.buffer[:first]
            self.buffer = grown
        self.buffer[first:end] = own
        self.length = end
        return self.buffer[:end]


def kept_pattern(
    kept: dict[str, KeptKeys],
    site: str,
    query: torch.Tensor,
    key: torch.Tensor,
    start: int,
    end: int,
    first: int,
    math: PatternMath,
) -> Pattern:
    """One request's pattern at a site this step, rows start..end of the batch from position
    `first` on, over its keys of this step and those `kept` from earlier steps."""
    keys = kept.setdefault(site, KeptKeys()).put(first, key[start:end])
    positions = torch.arange(first, end - start + first, device=key.device)
    return Pattern(query[start:end], keys, positions, math)


def pattern_captures(captures: list[RequestCapture]) -> dict[str, list[RequestCapture]]:
    """Per pattern site, the capturing requests that compute prompt tokens in this step (they
    keep their keys until the last prompt token's row is captured)."""
    found: dict[str, list[RequestCapture]] = {}
    for req_id, span, capture in captures:
        if capture.patterns and span.first_position < span.prompt_len:
            for site in capture.patterns:
                found.setdefault(site, []).append((req_id, span, capture))
    return found


class KeyStore:
    """Every kept key: traced invokes' by (trace id, invoke), capturing requests' by id; and
    the queries of a traced prompt computed in chunks, for its pattern over the whole prompt."""

    def __init__(self) -> None:
        self.invokes: dict[tuple[str, int], dict[str, KeptKeys]] = {}
        self.captures: dict[str, dict[str, KeptKeys]] = {}
        self.queries: dict[tuple[str, int], dict[str, KeptKeys]] = {}

    def whole_prompt(
        self, trace_id: str, invoke: int, site: str, chunk: Pattern, final: bool
    ) -> Pattern | None:
        """A chunk's pattern rows kept until the prompt's last chunk, which gets the pattern
        of every prompt position (None before it)."""
        kept = self.queries.setdefault((trace_id, invoke), {}).setdefault(site, KeptKeys())
        queries = kept.put(int(chunk.positions[0]), chunk.query)
        if not final:
            return None
        del self.queries[(trace_id, invoke)][site]
        positions = torch.arange(len(queries), device=chunk.positions.device)
        return replace(chunk, query=queries, positions=positions)

    def of_invoke(self, trace_id: str, invoke: int) -> dict[str, KeptKeys]:
        return self.invokes.setdefault((trace_id, invoke), {})

    def of_capture(self, req_id: str) -> dict[str, KeptKeys]:
        return self.captures.setdefault(req_id, {})

    def drop_capture_site(self, req_id: str, site: str) -> None:
        """A capture's keys at `site` once its row is taken (and the request's, when none is
        left)."""
        kept = self.captures.get(req_id, {})
        kept.pop(site, None)
        if not kept:
            self.captures.pop(req_id, None)

    def forget_trace(self, trace_id: str) -> None:
        for store in (self.invokes, self.queries):
            for kept in [k for k in store if k[0] == trace_id]:
                del store[kept]

    def forget_request(self, req_id: str) -> None:
        self.captures.pop(req_id, None)

    def held(self) -> int:
        return len(self.invokes) + len(self.captures) + sum(map(len, self.queries.values()))


def read_patterns(
    keys: KeyStore,
    site: str,
    query: torch.Tensor,
    key: torch.Tensor,
    math: PatternMath,
    slots: Sequence[Slot],
    reading: Sequence[Slot],
    captures: Sequence[RequestCapture],
    keep_row: KeepRow,
) -> None:
    """A layer's q and k (T, heads, head_dim, whole heads): each traced invoke in `slots`
    (those that read this layer's pattern in some step) keeps its keys (its positions before
    this step's from earlier steps: vLLM's cache layout is the attention backend's own), and
    those `reading` it in this step get it over all of them; a prompt computed in chunks gets
    its pattern once its last chunk is in. Each capturing request keeps its keys until its
    last prompt token's row is captured (`keep_row`)."""
    wanted = {id(slot) for slot in reading}
    for slot in slots:
        kept = keys.of_invoke(slot.trace_id, slot.invoke)
        pattern = kept_pattern(kept, site, query, key, slot.start, slot.end, slot.first, math)
        if id(slot) not in wanted:
            continue
        chunk = slot.run.chunk(slot.invoke)
        if slot.step == 0 and (chunk.start > 0 or not chunk.final):  # a prompt in chunks
            whole = keys.whole_prompt(slot.trace_id, slot.invoke, site, pattern, chunk.final)
            if whole is None:
                continue
            pattern = whole
        slot.run.at_site(slot.invoke, slot.step, site, pattern)
    for req_id, span, capture in captures:
        kept = keys.of_capture(req_id)
        first, last = span.first_position, span.prompt_len - 1
        pattern = kept_pattern(kept, site, query, key, span.start, span.end, first, math)
        if last < first + span.end - span.start:  # the last prompt token is in this step
            keep_row(site, capture.capture_id, last, pattern.row(last - first, capture.heads))
            keys.drop_capture_site(req_id, site)
