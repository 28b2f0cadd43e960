"""Shards written on a thread while the caller computes the next ones. The queue is bounded:
at most `queued` shards wait, so memory stays within a few shards whatever the dataset's
size, and a caller that outpaces the disk waits at most for one shard write."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np

from vinterp.store.directory import ActivationStore


@dataclass
class PendingShard:
    """Prompts [start, end) and how to build their columns; `build` runs on the writer
    thread, so turning captured tensors into arrays overlaps the next shard's compute too."""

    start: int
    end: int
    build: Callable[[], dict[str, np.ndarray]]
    counts: dict[str, int] = field(default_factory=dict)


_DONE = None  # the queue's end marker


class ShardWriter:
    """Commits queued shards to `store` in order; `close` (or leaving the `with` block) waits
    for them. A write error is raised in the caller at its next `put` or at `close`."""

    def __init__(self, store: ActivationStore, queued: int = 1) -> None:
        self.store = store
        self._queue: queue.Queue[PendingShard | None] = queue.Queue(maxsize=queued)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vinterp-shard-writer", daemon=True)
        self._thread.start()

    def put(self, shard: PendingShard) -> None:
        """Queue a shard; waits while the queue is full."""
        while True:
            self._raise()
            try:
                self._queue.put(shard, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Write what is queued, stop the thread, raise its error if it had one."""
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        self._raise()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # queued shards are complete: keep them
            self.close()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while self._write_next():
            pass

    def _write_next(self) -> bool:
        """Commit the next queued shard (False at the end marker). The captured data its
        `build` holds is let go before the write, so it is not held twice."""
        shard = self._queue.get()
        if shard is _DONE:
            return False
        if self._error is not None:
            return True  # keep draining, so a waiting `put` returns and sees the error
        start, end, counts, build = shard.start, shard.end, shard.counts, shard.build
        del shard
        try:
            values = build()
            del build
            self.store.commit(start, end, values, counts)
        except BaseException as exc:
            self._error = exc
        return True
