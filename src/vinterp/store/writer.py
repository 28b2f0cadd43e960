"""Shards built and written on threads while the caller computes the next ones. Several shards
are written at once (each file on its own thread: building the columns, copying them into
the file and waiting for the disk overlap), and listed in the manifest in order by one
committer thread. At most `threads + queued` shards are in hand at once, so memory stays
within a few shards whatever the dataset's size, and a caller that outpaces the disk waits."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np

from vinterp.store.directory import ActivationStore
from vinterp.store.manifest import ShardEntry

# Shards written at once. Each first waits for its captured rows (a take's round trip to the
# workers and their copy from the device, a few tenths of a second on a GPU), so enough must
# be in hand that the disk stays busy meanwhile; the shard size shrinks with the count, so
# host memory stays the same.
WRITER_THREADS = 8


@dataclass
class PendingShard:
    """Prompts [start, end) and how to build their columns; `build` runs on a writer thread,
    so turning captured tensors into arrays overlaps the next shards' compute too. `drop`,
    when given, runs instead of `build` once an earlier shard has failed: it lets the
    shard's captured rows go without building or writing them."""

    start: int
    end: int
    build: Callable[[], dict[str, np.ndarray]]
    counts: dict[str, int] = field(default_factory=dict)
    drop: Callable[[], object] | None = None


_DONE = None  # the queue's end marker


class ShardWriter:
    """Writes queued shards to `store` on `threads` threads and lists them in order; `close`
    (or leaving the `with` block) waits for them. An error is raised in the caller at its next
    `put` or at `close`; shards listed before it stay valid, the shards put after it are
    dropped (`PendingShard.drop`), never written."""

    def __init__(
        self, store: ActivationStore, threads: int = WRITER_THREADS, queued: int = 1
    ) -> None:
        self.store = store
        self._next = len(store.manifest.shards)  # the number of the next shard put
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vinterp-shard-writer")
        self._slots = threading.Semaphore(threads + queued)  # shards in hand at most
        self._queue: queue.Queue[Future[ShardEntry] | None] = queue.Queue()  # in order
        self._error: BaseException | None = None  # the first, in shard order
        self._failed = threading.Event()  # a shard failed: those not yet begun are dropped
        self.waited_s = 0.0  # how long `put` waited for a free slot: the writers held the caller
        self._thread = threading.Thread(target=self._run, name="vinterp-shard-lister", daemon=True)
        self._thread.start()

    def put(self, make: Callable[[], PendingShard]) -> None:
        """Start writing the shard `make()` gives, once fewer than `threads + queued` shards
        are in hand: `make` runs only then, so a shard's rows are asked for (and reach host
        memory) only when there is room for them."""
        began = time.perf_counter()
        while not self._slots.acquire(timeout=0.1):
            self._raise()
        self.waited_s += time.perf_counter() - began
        try:
            self._raise()
            shard = make()
        except BaseException:
            self._slots.release()
            raise
        self._queue.put(self._pool.submit(self._write, self._next, shard))
        self._next += 1

    def close(self) -> None:
        """Write and list what was put, stop the threads, raise the first error if any."""
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        self._pool.shutdown(wait=True)
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

    def _fail(self, exc: BaseException) -> None:
        """Keep the first error (in shard order); the shards not yet begun are dropped."""
        self._error = self._error or exc
        self._failed.set()

    def _write(self, index: int, shard: PendingShard) -> ShardEntry | None:
        """Build and write one shard's file (on a pool thread), or only drop it after an
        error. The captured data `build` holds is let go before the write, so it is not held
        twice."""
        start, end, counts = shard.start, shard.end, shard.counts
        build, drop = shard.build, shard.drop
        del shard
        if self._failed.is_set():
            del build
            if drop is not None:
                drop()
            return None
        try:
            values = build()
            del build
            return self.store.write(index, start, end, values, counts)
        except BaseException:
            self._failed.set()
            raise

    def _run(self) -> None:
        """List the shards in order, those already written together with one manifest save.
        After an error nothing more is listed; what is put is still waited for (dropped)."""
        while (written := self._queue.get()) is not _DONE:
            batch = [written]
            while self._queue.qsize():  # only this thread takes from the queue
                head = self._queue.queue[0]
                if head is _DONE or not head.done():
                    break
                batch.append(self._queue.get())
            entries = []
            for future in batch:
                try:
                    entry = future.result()
                except BaseException as exc:
                    self._fail(exc)
                    continue
                if self._error is None and entry is not None:
                    entries.append(entry)
            try:
                if entries:
                    self.store.add(entries)
            except BaseException as exc:
                self._fail(exc)
            for _ in batch:
                self._slots.release()
