"""What `llm.extract` captures from each prompt and how prompts are cut into shards: pure
functions of the token ids, so a restarted run cuts exactly the shards of the first one."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from vinterp.store.manifest import ShardSizes
from vinterp.wire.tensors import is_int

PositionSpec = str | list[int]
EXTRACT_POSITIONS = ("all_prompt", "last_prompt")
TOO_LONG = "skipped_too_long"  # per-shard count of prompts the engine cannot take
NO_ROWS = "prompts_without_rows"  # prompts whose every selected position was skipped
TOKENS = "prompt_tokens"  # tokens the engine computed


def check_positions(positions: PositionSpec, skip_first: int) -> PositionSpec:
    """The positions spec as stored (a list sorted, without duplicates); ValueError otherwise."""
    if not is_int(skip_first) or skip_first < 0:
        raise ValueError(f"skip_first: expected an int >= 0, got {skip_first!r}")
    if isinstance(positions, str):
        if positions not in EXTRACT_POSITIONS:
            raise ValueError(
                f"positions: expected one of {EXTRACT_POSITIONS} or a list of prompt positions, "
                f"got {positions!r} (extract reads prompts only)"
            )
        return positions
    if (
        not isinstance(positions, (list, tuple))
        or not positions
        or not all(is_int(p) and p >= 0 for p in positions)
    ):
        raise ValueError(f"positions: expected a non-empty list of ints >= 0, got {positions!r}")
    kept = sorted({p for p in positions if p >= skip_first})
    if not kept:
        raise ValueError(
            f"positions: every position in {positions} is below skip_first={skip_first}"
        )
    return kept


def selected(positions: PositionSpec, skip_first: int, length: int) -> np.ndarray:
    """The positions of a prompt of `length` tokens that become rows, in order."""
    if positions == "all_prompt":
        return np.arange(skip_first, length, dtype=np.int32)
    if positions == "last_prompt":
        return np.arange(max(length - 1, skip_first), length, dtype=np.int32)
    return np.asarray([p for p in positions if skip_first <= p < length], dtype=np.int32)


@dataclass
class PlannedPrompt:
    """A prompt that gives rows: its index in the input, its token ids and the positions
    that become rows."""

    index: int
    ids: list[int]
    positions: np.ndarray


@dataclass
class Shard:
    """Prompts [start, end): those that give rows, and the counts of the others."""

    start: int
    end: int
    prompts: list[PlannedPrompt] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {TOO_LONG: 0, NO_ROWS: 0, TOKENS: 0})

    @property
    def rows(self) -> int:
        return sum(len(p.positions) for p in self.prompts)


def plan_shards(
    tokenized: Iterable[tuple[int, list[int]]],
    positions: PositionSpec,
    skip_first: int,
    max_prompt_len: int | None,
    row_bytes: int,
    sizes: ShardSizes,
) -> Iterator[Shard]:
    """Consecutive prompts grouped while their rows fit the byte budget and their tokens
    `sizes.tokens` (a prompt over either is a shard alone); the prompts of the tail (see
    `ShardSizes`) in shards of their own. Prompts longer than `max_prompt_len` are skipped and
    counted."""
    shard: Shard | None = None
    was_tail = False

    def skipped(ids: list[int]) -> bool:
        return max_prompt_len is not None and len(ids) > max_prompt_len

    def computed(ids: list[int]) -> int:
        return 0 if skipped(ids) else len(ids)

    for index, ids, tail in marked_tail(tokenized, computed, sizes.tail_tokens):
        if shard is None:
            shard = Shard(index, index)
        too_long = skipped(ids)
        rows = np.zeros(0, np.int32) if too_long else selected(positions, skip_first, len(ids))
        budget = sizes.tail_bytes if tail and sizes.tail_bytes else sizes.bytes
        over_bytes = (shard.rows + len(rows)) * row_bytes > budget
        over_tokens = sizes.tokens is not None and shard.counts[TOKENS] + len(ids) > sizes.tokens
        if shard.prompts and (over_bytes or over_tokens or tail != was_tail):
            yield shard
            shard = Shard(index, index)
        was_tail = tail
        shard.end = index + 1
        if too_long:
            shard.counts[TOO_LONG] += 1
        elif not len(rows):
            shard.counts[NO_ROWS] += 1
        else:
            shard.prompts.append(PlannedPrompt(index, ids, rows))
            shard.counts[TOKENS] += len(ids)
    if shard is not None:
        yield shard


def marked_tail(
    tokenized: Iterable[tuple[int, list[int]]],
    computed: Callable[[list[int]], int],
    tail_tokens: int | None,
) -> Iterator[tuple[int, list[int], bool]]:
    """(index, ids, in the tail) per prompt: in the tail when it and the prompts after it
    hold at most `tail_tokens` computed tokens. Reads at most that many tokens ahead, so a
    corpus stays a stream; a function of the prompts from here to the end, so a restart at a
    shard's first prompt marks the same ones."""
    if tail_tokens is None:
        yield from ((index, ids, False) for index, ids in tokenized)
        return
    ahead: deque[tuple[int, list[int]]] = deque()
    held = 0
    for index, ids in tokenized:
        ahead.append((index, ids))
        held += computed(ids)
        while held > tail_tokens:
            first, first_ids = ahead.popleft()
            held -= computed(first_ids)
            yield first, first_ids, False
    yield from ((index, ids, True) for index, ids in ahead)
