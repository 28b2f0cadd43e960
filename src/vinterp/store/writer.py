"""Shards written by several disk writers while the caller computes the next ones.

One bounded queue of (shard, its pending take) feeds `threads` writers. A shard enters the
queue only when the shards in hand (queued or being written) and it hold at most the bytes of
`threads + queued` full shards (the manifest's shard size; any shard when none is in hand), and
its take — the request for its captured rows — is sent only then, so the rows reach host
memory only when there is room for them, and smaller shards (the tail's) flow as many at once
as fit. Each writer waits for its shard's rows, builds the columns and writes the file;
whichever writer finishes a shard lists every shard that is now next in order in the manifest
(the commit point, through an `InOrderLister`). A caller that outpaces the disk waits in
`put`."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from vinterp.store.directory import ActivationStore
from vinterp.store.lister import FAILED, InOrderLister
from vinterp.store.manifest import ShardEntry

# Disk writers. Each first waits for its shard's rows (a take's round trip to the workers and
# their copy from the device, a few tenths of a second on a GPU), so enough must be in hand
# that the disk stays busy meanwhile; the shard size shrinks with the count, so memory stays
# the same.
WRITER_THREADS = 8


@dataclass
class PendingShard:
    """Prompts [start, end): `take()` waits for the shard's captured rows (sent for when the
    shard was put), `build(rows)` turns them into columns. Both run on a writer thread, so
    they overlap the next shards' compute. After an earlier shard failed, `take()` still runs
    (the workers let the rows go) and nothing is built or written."""

    start: int
    end: int
    take: Callable[[], Any]
    build: Callable[[Any], dict[str, np.ndarray]]
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class WriterStats:
    """What the writers did: shards, rows and bytes written, how long the caller waited in
    `put` for room (the disk held up the engine's feed) and how long the writers waited for
    rows in `take` (the engine, or the take's round trip, held up the disk)."""

    shards: int = 0
    rows: int = 0
    bytes: int = 0
    caller_waited_s: float = 0.0
    rows_waited_s: float = 0.0


class ShardWriter:
    """Writes put shards to `store` on `threads` writers and lists them in order through
    `commit` (default: the store's manifest); `close` (or leaving the `with` block) waits for
    them. An error is raised in the caller at its next `put` or at `close`; shards listed
    before it stay valid, and the shards after it are taken (their rows let go) but neither
    built nor written."""

    def __init__(
        self,
        store: ActivationStore,
        threads: int = WRITER_THREADS,
        queued: int = 1,
        commit: Callable[[list[ShardEntry]], None] | None = None,
    ) -> None:
        self.store = store
        self.commit = commit or store.add
        self.stats = WriterStats()
        self._room = threading.Condition()  # guards everything below
        self._full = store.manifest.sizes.bytes  # a full shard's bytes of rows
        self._in_hand, self._in_hand_bytes, self._bound = 0, 0, (threads + queued) * self._full
        self._next = 0  # the next put's index, in put order
        self._number = len(store.manifest.shards)  # the next shard's number (its file name)
        self._lister: InOrderLister[ShardEntry] = InOrderLister()  # by put index
        self._error: BaseException | None = None
        self._error_at = -1  # the failed shard's number (the first in order is raised)
        self._queue: queue.SimpleQueue[tuple[int, int, int, PendingShard] | None] = (
            queue.SimpleQueue()
        )
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"vinterp-shard-writer-{k}", daemon=True)
            for k in range(threads)
        ]
        for writer in self._writers:
            writer.start()

    def put(
        self, make: Callable[[], PendingShard], number: int | None = None, size: int | None = None
    ) -> None:
        """Queue the shard `make()` gives, of `size` bytes of rows (default: a full shard's),
        once there is room for it: `make` runs only then (it sends the take), so rows are asked
        for only when there is room for them. `number` names its file (default: the next after
        the last put); shards are listed in the order they were put."""
        size = self._full if size is None else size
        began = time.perf_counter()
        with self._room:
            self._room.wait_for(lambda: self._fits(size) or self._error is not None)
            if self._error is not None:  # raised once every shard put before it is done, so
                # an earlier shard that fails later is the one raised (the first in put order)
                self._room.wait_for(lambda: self._lister.next >= self._error_at)
            self._raise()
            self._in_hand, self._in_hand_bytes = self._in_hand + 1, self._in_hand_bytes + size
        self.stats.caller_waited_s += time.perf_counter() - began
        try:
            shard = make()
        except BaseException:
            self._free(size)
            raise
        number = self._number if number is None else number
        self._queue.put((self._next, number, size, shard))
        self._next, self._number = self._next + 1, number + 1

    def _fits(self, size: int) -> bool:
        return self._in_hand == 0 or self._in_hand_bytes + size <= self._bound

    def _free(self, size: int) -> None:
        with self._room:
            self._in_hand, self._in_hand_bytes = self._in_hand - 1, self._in_hand_bytes - size
            self._room.notify_all()

    def close(self) -> None:
        """Write and list what was put, stop the writers, raise the first error if any."""
        for _ in self._writers:
            self._queue.put(None)
        for writer in self._writers:
            writer.join()
        with self._room:
            self._raise()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # shards written before the error: keep them
            self.close()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            index, number, size, shard = item
            try:
                entry = self._write(index, number, shard)
            except BaseException as exc:
                self._done(index, size, FAILED, exc)
            else:
                self._done(index, size, entry, None)
            del shard, item

    def _write(self, index: int, number: int, shard: PendingShard) -> ShardEntry | object:
        """Wait for one shard's rows, build its columns and write its file; after a failure of
        a shard put before it, only take its rows (so the workers hold none) and return
        FAILED. Shards put before a failed one are still written: they stay listable, and
        the first failure in put order is the one raised."""
        began = time.perf_counter()
        rows = shard.take()
        waited = time.perf_counter() - began
        with self._room:
            self.stats.rows_waited_s += waited
            failed = self._error is not None and self._error_at < index
        if failed:
            return FAILED
        values = shard.build(rows)
        del rows  # the captured data is not held while the file is written
        return self.store.write(number, shard.start, shard.end, values, shard.counts)

    def _done(
        self, index: int, size: int, entry: ShardEntry | object, error: BaseException | None
    ) -> None:
        """Shard `index` (in put order, `size` bytes) is finished (written, failed or dropped):
        list every shard now next in order, free its room, keep the first error in put order."""
        with self._room:
            if error is not None and (self._error is None or index < self._error_at):
                self._error, self._error_at = error, index
            ready = self._lister.done(index, entry)
            listed = self._lister.next  # the index after the last of `ready`
            if ready and (self._error is None or self._error_at >= listed):
                try:
                    self.commit(ready)
                except BaseException as exc:
                    self._error, self._error_at = exc, listed - len(ready)
                else:
                    self.stats.shards += len(ready)
                    self.stats.rows += sum(e.rows for e in ready)
                    self.stats.bytes += sum(e.bytes for e in ready)
            self._free(size)  # the condition's lock is reentrant
