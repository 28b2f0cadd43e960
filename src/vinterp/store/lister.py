"""Items numbered in the order they were handed out, finished in any order, listed in that
order: the shard writer's threads and the data-parallel driver's replicas both finish shards
out of order, and a manifest lists them only in order."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")

FAILED = object()  # an item that was not done: nothing from it on is listed


class InOrderLister(Generic[T]):
    """`done(index, item)` records item `index` as finished (`FAILED`: not done) and returns
    every item now next in order, from `next` on; a failed item stops the listing at it for
    good. Not thread-safe: its caller holds a lock where several threads report."""

    def __init__(self, first: int = 0) -> None:
        self.next = first  # the index of the next item to list
        self._finished: dict[int, T | object] = {}  # finished, not yet listed

    def done(self, index: int, item: T | object) -> list[T]:
        self._finished[index] = item
        ready: list[T] = []
        while self._finished.get(self.next, FAILED) is not FAILED:
            ready.append(self._finished.pop(self.next))  # type: ignore[arg-type]
            self.next += 1
        return ready

    @property
    def waiting(self) -> int:
        """Items finished and not listed (behind one not finished, or a failed one)."""
        return len(self._finished)
