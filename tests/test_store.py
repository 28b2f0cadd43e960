"""The activation dataset on disk (vinterp.store) and the extract plan, without an engine:
shards readable by `datasets.load_from_disk`, resume after a kill at each step of a commit,
refusal of another spec, write errors that leave no shard looking complete, site values read
back bit for bit in their stored dtype (bfloat16 as its bits in a uint16 column)."""

from __future__ import annotations

import errno
import json
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from vinterp import cli
from vinterp.engine.outputs import Output
from vinterp.extraction.plan import (
    NO_ROWS,
    TOKENS,
    TOO_LONG,
    PlannedPrompt,
    check_positions,
    plan_shards,
    selected,
)
from vinterp.extraction.prompts import prompt_source
from vinterp.extraction.request import expand_sites
from vinterp.extraction.stream import joined, shard_columns
from vinterp.store import (
    COLUMN_DTYPE,
    FAILED,
    STORED_DTYPES,
    ActivationStore,
    InOrderLister,
    PendingShard,
    ShardSizes,
    ShardWriter,
    SpecMismatchError,
    StoreError,
    column_values,
    files,
    site_shards,
    site_tensor,
)
from vinterp.wire.specs import Capture

H = 3
COLUMNS = {"prompt": ("int64", None), "position": ("int32", None), "site": ("float32", H)}
SPEC = {"sites": ["site"], "positions": "all_prompt", "prompts": {"count": 10}}


def rows(start: int, end: int) -> dict[str, np.ndarray]:
    """Two rows per prompt, values that name their prompt and position."""
    prompt = np.repeat(np.arange(start, end, dtype=np.int64), 2)
    position = np.tile(np.arange(2, dtype=np.int32), end - start)
    site = (prompt[:, None] * 10 + position[:, None] + np.arange(H) / 10).astype(np.float32)
    return {"prompt": prompt, "position": position, "site": site}


def open_store(root: Path, spec: dict = SPEC) -> ActivationStore:
    return ActivationStore.open(root, spec, COLUMNS, sizes=ShardSizes(1000))


def commit(
    store: ActivationStore, start: int, end: int, values: dict[str, np.ndarray], counts: dict
) -> None:
    """Write the shard of prompts [start, end) and list it, as the shard writer does."""
    store.add([store.write(len(store.manifest.shards), start, end, values, counts)])


def loaded(root: Path) -> dict[str, np.ndarray]:
    return datasets.load_from_disk(str(root)).with_format("numpy")[:]


def test_shards_load_through_datasets_in_prompt_order(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    commit(store, 0, 3, rows(0, 3), {"n": 1})
    commit(store, 3, 5, rows(3, 5), {"n": 2})
    store.finish()
    got, want = loaded(tmp_path), rows(0, 5)
    for name in COLUMNS:
        assert np.array_equal(got[name], want[name])
    ds = datasets.load_from_disk(str(tmp_path))
    assert ds.data.schema.types[:2] == [pa.int64(), pa.int32()]
    assert ds.features["site"].length == H and ds.features["site"].feature.dtype == "float32"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and manifest["totals"]["rows"] == 10
    assert manifest["totals"]["n"] == 3 and manifest["totals"]["prompts_done"] == 5


def test_reopen_continues_after_the_last_listed_shard_and_removes_leftovers(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    commit(store, 0, 2, rows(0, 2), {})
    # A kill after the next shard's file was renamed into place, before the manifest listed
    # it, and one in the middle of writing the shard after: both are leftovers.
    (tmp_path / "data-00001.arrow").write_bytes(b"complete-looking but unlisted")
    files.tmp_path(tmp_path / "data-00002.arrow").write_bytes(b"torn")
    (tmp_path / "state.json").write_text(json.dumps({"stale": True}))
    again = open_store(tmp_path)
    assert again.manifest.next_prompt == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "data-00000.arrow",
        "dataset_info.json",
        "manifest.json",
        "state.json",
    ]
    commit(again, 2, 5, rows(2, 5), {})
    assert np.array_equal(loaded(tmp_path)["site"], rows(0, 5)["site"])


def test_the_shard_sizes_a_dataset_began_with_are_kept_on_reopen(tmp_path: Path) -> None:
    """A restart must cut the shards of the first run, whatever sizes the caller gives now;
    a manifest written before the tail sizes existed reopens without them."""
    sizes = ShardSizes(1000, 64, 32, 250)
    commit(ActivationStore.open(tmp_path, SPEC, COLUMNS, sizes), 0, 1, rows(0, 1), {})
    again = ActivationStore.open(tmp_path, SPEC, COLUMNS, ShardSizes(7))
    assert again.manifest.sizes == sizes
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for key in ("shard_tokens", "tail_tokens", "tail_shard_bytes"):
        del manifest[key]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert ActivationStore.open(tmp_path, SPEC, COLUMNS, sizes).manifest.sizes == ShardSizes(1000)


def test_another_spec_is_refused_naming_what_differs(tmp_path: Path) -> None:
    commit(open_store(tmp_path), 0, 1, rows(0, 1), {})
    other = {**SPEC, "sites": ["other"], "prompts": {"count": 11}}
    with pytest.raises(SpecMismatchError) as info:
        open_store(tmp_path, other)
    message = str(info.value)
    assert "sites: ['site'] in the directory, ['other'] now" in message
    assert "prompts.count: 10 in the directory, 11 now" in message
    assert "positions" not in message


def test_a_folder_with_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpecMismatchError, match="not empty"):
        open_store(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_an_unwritable_path_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot write the dataset") as info:
        open_store(tmp_path / "file" / "dataset")
    assert isinstance(info.value, OSError)


def test_a_full_disk_leaves_no_shard_looking_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path)
    commit(store, 0, 2, rows(0, 2), {})
    before = (tmp_path / "manifest.json").read_text()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(StoreError, match="No space left on device.*continues after them"):
        commit(store, 2, 4, rows(2, 4), {})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".", "data-"))) == [
        "data-00000.arrow"
    ]
    assert (tmp_path / "manifest.json").read_text() == before
    resumed = open_store(tmp_path)
    commit(resumed, 2, 4, rows(2, 4), {})
    assert np.array_equal(loaded(tmp_path)["prompt"], rows(0, 4)["prompt"])


def test_a_large_file_is_sent_to_disk_in_slices_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each full slice's writeback is asked for once, in order, the slices together covering
    every byte but the short last one's (the fsync sends it); the file holds what was written,
    whatever sizes its writes came in."""
    monkeypatch.setattr(files, "WRITEBACK_BYTES", 1000)
    asked: list[tuple[int, int]] = []
    real = files.os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == files.os.POSIX_FADV_DONTNEED
        asked.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(files.os, "posix_fadvise", record)
    data = np.random.default_rng(0).integers(0, 256, 4321, dtype=np.uint8).tobytes()

    def write(file: Any) -> None:
        at = 0
        for size in (7, 1493, 1, 2498, 322):  # 4321 bytes
            file.write(data[at : at + size])
            at += size

    assert files.write_atomic(tmp_path / "big", write) == len(data)
    assert (tmp_path / "big").read_bytes() == data
    offsets = [offset for offset, _ in asked]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(offset + length == nxt for (offset, length), nxt in zip(asked, offsets[1:]))
    assert all(length >= 1000 for _, length in asked)
    assert len(data) - 1000 < sum(length for _, length in asked) <= len(data)


def test_a_file_system_that_cannot_start_writeback_still_gets_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "WRITEBACK_BYTES", 100)
    asked: list[int] = []

    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append(offset)
        raise OSError(errno.ESPIPE, "Illegal seek")

    monkeypatch.setattr(files.os, "posix_fadvise", refuse)
    data = bytes(range(256)) * 4
    assert files.write_atomic(tmp_path / "f", lambda file: file.write(data)) == len(data)
    assert (tmp_path / "f").read_bytes() == data
    assert asked == [0]  # refused once, then not asked again


def test_a_shard_that_does_not_follow_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="does not follow prompt 0"):
        commit(store, 1, 2, rows(1, 2), {})


def pending(
    start: int, end: int, build: Callable[[], dict[str, np.ndarray]], taken: list[int] | None = None
) -> PendingShard:
    """A shard whose take records its start in `taken` (if given) and whose build calls
    `build`."""

    def take() -> int:
        if taken is not None:
            taken.append(start)
        return start

    return PendingShard(start, end, take, lambda _rows: build())


def test_writer_commits_in_order_and_waits_while_its_queue_is_full(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    release = threading.Event()

    def slow(start: int, end: int) -> dict[str, np.ndarray]:
        release.wait(10)
        return rows(start, end)

    made: list[int] = []  # the shards whose rows were asked for (`put`'s `make` ran)

    def make(start: int, end: int, build: Callable[[], Any]) -> PendingShard:
        made.append(start)
        return pending(start, end, build)

    with ShardWriter(store, threads=1, queued=1) as writer:
        writer.put(partial(make, 0, 1, lambda: slow(0, 1)))  # taken by the writer, blocked
        writer.put(partial(make, 1, 2, lambda: rows(1, 2)))  # fills the queue
        free = writer.stats.caller_waited_s  # two puts into free room
        third = threading.Thread(target=writer.put, args=(partial(make, 2, 4, lambda: rows(2, 4)),))
        third.start()
        third.join(0.3)
        assert third.is_alive()  # bounded: the caller waits for the writer
        assert made == [0, 1]  # and the third shard's rows are not asked for meanwhile
        release.set()
        third.join(10)
    assert free < 0.1 and writer.stats.caller_waited_s >= 0.3 + free
    assert [s.end for s in store.manifest.shards] == [1, 2, 4]
    assert (writer.stats.shards, writer.stats.rows) == (3, len(rows(0, 4)["prompt"]))
    assert writer.stats.bytes == sum(s.bytes for s in store.manifest.shards)
    assert np.array_equal(loaded(tmp_path)["prompt"], rows(0, 4)["prompt"])


def test_the_writers_room_is_counted_in_bytes(tmp_path: Path) -> None:
    """Room for `threads + queued` full shards holds four times as many quarter shards (the
    tail's); a shard larger than the whole room goes in alone."""
    store = open_store(tmp_path)  # full shards of 1000 bytes: room for 2000 with one writer
    release = threading.Event()
    made: list[int] = []

    def make(start: int, build: Callable[[], Any]) -> PendingShard:
        made.append(start)
        return pending(start, start + 1, build)

    def blocked() -> dict[str, np.ndarray]:
        release.wait(10)
        return rows(0, 1)

    with ShardWriter(store, threads=1, queued=1) as writer:
        writer.put(partial(make, 0, blocked), size=1000)
        for k in range(1, 5):
            writer.put(partial(make, k, partial(rows, k, k + 1)), size=250)
        fifth = threading.Thread(
            target=writer.put, args=(partial(make, 5, partial(rows, 5, 6)),), kwargs={"size": 250}
        )
        fifth.start()
        fifth.join(0.3)
        assert fifth.is_alive() and made == [0, 1, 2, 3, 4]  # 1000 + 4 x 250: full
        release.set()
        fifth.join(10)
        writer.put(partial(make, 6, partial(rows, 6, 7)), size=5000)  # alone, once all are done
    assert made == list(range(7))
    assert [s.end for s in store.manifest.shards] == list(range(1, 8))


def test_the_writers_wait_for_rows_is_counted(tmp_path: Path) -> None:
    store = open_store(tmp_path)

    def late_rows() -> int:
        time.sleep(0.3)  # the take's round trip: the rows are not there yet
        return 0

    with ShardWriter(store, threads=2) as writer:
        writer.put(lambda: PendingShard(0, 1, late_rows, lambda _rows: rows(0, 1)))
        writer.put(lambda: pending(1, 2, lambda: rows(1, 2)))
    assert 0.3 <= writer.stats.rows_waited_s < 0.3 + 0.2
    assert writer.stats.caller_waited_s < 0.1


def test_a_write_error_reaches_the_caller(tmp_path: Path) -> None:
    store = open_store(tmp_path)

    def broken() -> dict[str, np.ndarray]:
        raise RuntimeError("column build failed")

    writer = ShardWriter(store)
    writer.put(partial(pending, 0, 1, broken))
    with pytest.raises(RuntimeError, match="column build failed"):
        writer.close()
    assert store.manifest.shards == []


def test_the_lister_lists_in_order_and_never_past_a_failed_item() -> None:
    """The one in-order lister of the shard writer and the data-parallel driver."""
    lister: InOrderLister[str] = InOrderLister(3)
    assert lister.done(4, "b") == [] and lister.waiting == 1
    assert lister.done(3, "a") == ["a", "b"] and lister.next == 5
    assert lister.done(6, "d") == []
    assert lister.done(5, FAILED) == []
    assert lister.done(7, "e") == [] and lister.next == 5 and lister.waiting == 3


def test_shards_finished_out_of_order_are_listed_in_order(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    later_written = threading.Event()

    def first() -> dict[str, np.ndarray]:  # finishes after the two shards put after it
        assert later_written.wait(10)
        return rows(0, 1)

    def last() -> dict[str, np.ndarray]:
        deadline = time.monotonic() + 10
        while not (tmp_path / "data-00001.arrow").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        later_written.set()
        return rows(2, 4)

    with ShardWriter(store, threads=3) as writer:
        writer.put(partial(pending, 0, 1, first))
        writer.put(partial(pending, 1, 2, lambda: rows(1, 2)))
        writer.put(partial(pending, 2, 4, last))
    assert [(s.file, s.end) for s in store.manifest.shards] == [
        ("data-00000.arrow", 1),
        ("data-00001.arrow", 2),
        ("data-00002.arrow", 4),
    ]
    assert np.array_equal(loaded(tmp_path)["prompt"], rows(0, 4)["prompt"])


def test_after_a_failed_shard_nothing_later_is_listed_and_a_reopen_removes_it(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    first_listed = threading.Event()

    def broken() -> dict[str, np.ndarray]:
        assert first_listed.wait(10)  # shard 0 is listed before this one fails
        raise RuntimeError("column build failed")

    def first() -> dict[str, np.ndarray]:
        threading.Timer(0.2, first_listed.set).start()
        return rows(0, 1)

    with pytest.raises(RuntimeError, match="column build failed"):  # noqa: PT012
        with ShardWriter(store, threads=3) as writer:
            writer.put(partial(pending, 0, 1, first))
            writer.put(partial(pending, 1, 2, broken))
            writer.put(partial(pending, 2, 3, lambda: rows(2, 3)))
            writer.close()
    assert [s.end for s in store.manifest.shards] == [1]
    reopened = open_store(tmp_path)  # shard 2 may have been written: unlisted, it goes
    assert sorted(p.name for p in tmp_path.glob("data-*")) == ["data-00000.arrow"]
    commit(reopened, 1, 3, rows(1, 3), {})
    assert np.array_equal(loaded(tmp_path)["prompt"], rows(0, 3)["prompt"])


def test_the_first_failure_in_order_is_raised_when_a_later_shard_fails_first(
    tmp_path: Path,
) -> None:
    """Shards 1 and 2 both fail, 2 first (shard 1's rows came later): shard 1 is still built
    and written (it was put before the failed one), and its failure is the one raised."""
    store = open_store(tmp_path)
    second_failed = threading.Event()

    def full_disk(start: int) -> dict[str, np.ndarray]:
        if start == 2:
            threading.Timer(0.2, second_failed.set).start()
        raise OSError(errno.ENOSPC, f"No space left on device (shard {start})")

    def late_rows() -> int:  # the take's round trip outlasts shard 2's failure
        assert second_failed.wait(10)
        return 1

    with pytest.raises(OSError, match=r"\(shard 1\)"):  # noqa: PT012
        with ShardWriter(store, threads=3) as writer:
            writer.put(partial(pending, 0, 1, lambda: rows(0, 1)))
            writer.put(lambda: PendingShard(1, 2, late_rows, lambda _rows: full_disk(1)))
            writer.put(partial(pending, 2, 3, partial(full_disk, 2)))
            writer.close()
    assert [s.end for s in store.manifest.shards] == [1]


def test_shards_put_after_a_failed_one_are_taken_not_built(tmp_path: Path) -> None:
    """Their captured rows are taken and let go, so a failed run leaves nothing behind."""
    store = open_store(tmp_path)
    go = threading.Event()
    built: list[int] = []
    taken: list[int] = []

    def broken() -> dict[str, np.ndarray]:
        assert go.wait(10)
        raise RuntimeError("disk full")

    def build(start: int, end: int) -> dict[str, np.ndarray]:
        built.append(start)
        return rows(start, end)

    writer = ShardWriter(store, threads=1, queued=3)
    writer.put(partial(pending, 0, 1, broken, taken))
    for start in (1, 2):  # put while the first shard is still being written
        writer.put(partial(pending, start, start + 1, partial(build, start, start + 1), taken))
    go.set()
    with pytest.raises(RuntimeError, match="disk full"):
        writer.close()
    assert built == [] and taken == [0, 1, 2]
    assert store.manifest.shards == [] and not list(tmp_path.glob("data-*"))


def test_after_a_manifest_that_cannot_be_saved_later_shards_are_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing a written shard fails (the disk filled between its file and the manifest):
    the shards after it are taken, as after a failed write, never built."""
    store = open_store(tmp_path)

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "save", full_disk)
    built: list[int] = []
    taken: list[int] = []
    writer = ShardWriter(store, threads=1, queued=3)

    def build(start: int) -> dict[str, np.ndarray]:
        built.append(start)
        return rows(start, start + 1)

    for start in (0, 1, 2):
        writer.put(partial(pending, start, start + 1, partial(build, start), taken))
    with pytest.raises(StoreError, match="No space left on device"):
        writer.close()
    assert built == [0] and taken == [0, 1, 2]
    assert store.manifest.shards == []


# -- site values in their stored dtype -----------------------------------------------------

# Per stored dtype: the signed integer type of its width, and the bit patterns of +-0, the
# smallest and largest subnormals, +-the largest finite value, +-inf and NaNs of several
# payloads (signs and quiet/signalling).
SPECIAL_BITS = {
    "float32": (
        torch.int32,
        [0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000]
        + [0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC12345],
    ),
    "float16": (
        torch.int16,
        [0, 0x8000, 1, 0x83FF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7E5A],
    ),
    "bfloat16": (
        torch.int16,
        [0, 0x8000, 1, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FD3],
    ),
}


def special_values(dtype: str, rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """(rows, width) values of `dtype`: the special bit patterns, then random bits."""
    kind, special = SPECIAL_BITS[dtype]
    nbits = torch.iinfo(kind).bits
    raw = np.random.default_rng(seed).integers(0, 1 << nbits, rows * width, dtype=np.uint64)
    raw[: len(special)] = special[: rows * width]
    signed = torch.from_numpy(raw.astype(f"u{nbits // 8}").view(f"i{nbits // 8}"))
    return signed.view(getattr(torch, dtype)).reshape(rows, width)


def bits(values: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaN payloads included)."""
    return values.contiguous().view(SPECIAL_BITS[str(values.dtype)[6:]][0])


def site_store(root: Path, dtype: str, width: int, sites: tuple[str, ...] = ("a", "b")):
    columns = {"prompt": ("int64", None)} | {s: (COLUMN_DTYPE[dtype], width) for s in sites}
    spec = {"sites": list(sites), "dtype": dtype, "hidden_size": width}
    return ActivationStore.open(root, spec, columns, sizes=ShardSizes(1000))


def site_rows(start: int, values: dict[str, torch.Tensor], dtype: str) -> dict[str, np.ndarray]:
    count = len(next(iter(values.values())))
    prompt = np.arange(start, start + count, dtype=np.int64)
    return {"prompt": prompt} | {site: column_values(v, dtype) for site, v in values.items()}


@pytest.mark.parametrize("dtype", STORED_DTYPES)
def test_site_values_round_trip_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    width, rows = 16, 64
    a, b = special_values(dtype, rows, width, 0), special_values(dtype, rows, width, 1)
    store = site_store(tmp_path, dtype, width)
    commit(store, 0, rows, site_rows(0, {"a": a, "b": b}, dtype), {})
    store.finish()
    for site, want in {"a": a, "b": b}.items():
        got = site_tensor(tmp_path, site)
        assert got.dtype == getattr(torch, dtype) and got.shape == (rows, width)
        assert torch.equal(bits(got), bits(want))
    assert torch.isnan(site_tensor(tmp_path, "a")).any() and torch.isinf(a).any()
    # The column holds exactly the value's bytes: 2 a value for float16 and bfloat16.
    ds = datasets.load_from_disk(str(tmp_path))
    assert ds.features["a"].feature.dtype == COLUMN_DTYPE[dtype]
    column = ds.data.column("a").combine_chunks().flatten().to_numpy()
    assert column.dtype == np.dtype(COLUMN_DTYPE[dtype]) and column.itemsize == a.element_size()
    assert np.array_equal(column.view(f"i{a.element_size()}"), bits(a).numpy().reshape(-1))
    values_bytes = 2 * rows * width * a.element_size()
    assert values_bytes <= store.manifest.shards[0].bytes < values_bytes + 4096


def test_bfloat16_column_is_the_uint16_bits_of_one_conversion() -> None:
    wide = torch.tensor(
        [[0.0, -0.0, 1e-40, -3e-39, 3.3e38, -3.4e38, 1 / 3, 65504.0, 1e-45, 2.5]],
        dtype=torch.float32,
    )
    wide = torch.cat(
        [wide, torch.tensor([[float("inf"), float("-inf"), float("nan")] * 3 + [7.0]])]
    )
    for dtype in ("bfloat16", "float16"):
        column = column_values(wide, dtype)
        want = wide.to(getattr(torch, dtype))
        assert column.dtype == np.dtype(COLUMN_DTYPE[dtype]) and column.shape == wide.shape
        assert np.array_equal(column.view(np.int16), bits(want).numpy())
    bf16 = special_values("bfloat16", 3, 4)
    assert column_values(bf16, "bfloat16").ctypes.data == bf16.data_ptr()  # no copy
    with pytest.raises(ValueError, match="expected one of"):
        column_values(wide, "float64")


SITE = "layers.1.output"


def test_extract_shard_columns_store_bfloat16_bits(tmp_path: Path) -> None:
    """The extract path: captured bfloat16 rows become a shard of the stored bits."""
    columns = {"prompt": ("int64", None), "position": ("int32", None), "token": ("int32", None)}
    store = ActivationStore.open(
        tmp_path,
        {"sites": [SITE], "dtype": "bfloat16", "hidden_size": 4},
        columns | {SITE: (COLUMN_DTYPE["bfloat16"], 4)},
        sizes=ShardSizes(1000),
    )
    positions = np.array([1, 2], np.int32)
    prompts = [PlannedPrompt(0, [5, 6, 7], positions), PlannedPrompt(3, [8, 9], positions[:1])]
    captured = [special_values("bfloat16", 3, 4, 0), special_values("bfloat16", 2, 4, 1)]
    rows = {
        f"c{k}": {SITE: {"positions": list(range(len(c))), "values": c}}
        for k, c in enumerate(captured)
    }
    outputs = [Output(p.ids, [0], "") for p in prompts]
    values = shard_columns(
        prompts, outputs, ["c0", "c1"], Capture([SITE], positions="all_prompt"), store, rows
    )
    assert values[SITE].dtype == np.uint16
    assert values["token"].tolist() == [6, 7, 9] and values["prompt"].tolist() == [0, 0, 3]
    commit(store, 0, 4, values, {})
    want = torch.cat([captured[0][1:], captured[1][1:]])  # skip_first drops leading rows
    assert torch.equal(bits(site_tensor(tmp_path, SITE)), bits(want))


def test_site_tensor_of_several_shards_is_their_concatenation(tmp_path: Path) -> None:
    store = site_store(tmp_path, "bfloat16", 8)
    sizes = [5, 0, 3, 7]  # the second shard has no rows
    a = [special_values("bfloat16", n, 8, seed) for seed, n in enumerate(sizes)]
    b = [special_values("bfloat16", n, 8, seed + 10) for seed, n in enumerate(sizes)]
    for k in range(len(sizes)):
        commit(store, k, k + 1, site_rows(k, {"a": a[k], "b": b[k]}, "bfloat16"), {})
    store.finish()
    want = torch.cat(a)
    assert torch.equal(bits(site_tensor(tmp_path, "a")), bits(want))
    assert torch.equal(bits(site_tensor(str(tmp_path), "b")), bits(torch.cat(b)))
    ds = datasets.load_from_disk(str(tmp_path)).with_format("torch")
    assert torch.equal(bits(site_tensor(ds, "a")), bits(want))
    with pytest.raises(ValueError, match="in stored order.*pass the directory"):
        site_tensor(ds.select([0, 2]), "a")
    with pytest.raises(ValueError, match="in stored order"):
        site_tensor(ds.shuffle(seed=0, keep_in_memory=True), "a")


def test_site_tensor_of_one_shard_maps_the_file_copy_on_write(tmp_path: Path) -> None:
    store = site_store(tmp_path, "float16", 4)
    values = special_values("float16", 6, 4)
    commit(store, 0, 1, site_rows(0, {"a": values, "b": values}, "float16"), {})
    got = site_tensor(tmp_path, "a")
    assert torch.equal(bits(got), bits(values))
    got.zero_()  # a private page: the file keeps its values
    assert torch.equal(bits(site_tensor(tmp_path, "a")), bits(values))


def mapped_files(tensor: torch.Tensor) -> set[str]:
    """The files whose memory maps hold the tensor's first byte (/proc/self/maps)."""
    address = tensor.data_ptr()
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end and len(fields) == 6:
            found.add(fields[5])
    return found


def test_site_shards_are_the_shard_files_mapped_without_a_copy(tmp_path: Path) -> None:
    store = site_store(tmp_path, "bfloat16", 8)
    parts = [special_values("bfloat16", n, 8, seed) for seed, n in enumerate([4, 6, 5])]
    for k, part in enumerate(parts):
        commit(store, k, k + 1, site_rows(k, {"a": part, "b": part}, "bfloat16"), {})
    shards = site_shards(tmp_path, "a")
    assert [bits(s).tolist() for s in shards] == [bits(p).tolist() for p in parts]
    for k, shard in enumerate(shards):
        assert mapped_files(shard) == {str(tmp_path / f"data-{k:05d}.arrow")}
    shards[1].zero_()  # a private page: the file keeps its values
    assert torch.equal(bits(site_shards(tmp_path, "a")[1]), bits(parts[1]))
    assert torch.equal(bits(site_tensor(tmp_path, "a")), bits(torch.cat(parts)))


def test_site_tensor_of_an_empty_dataset_has_no_rows(tmp_path: Path) -> None:
    site_store(tmp_path, "bfloat16", 4)
    got = site_tensor(tmp_path, "a")
    assert got.shape == (0, 4) and got.dtype == torch.bfloat16


def test_site_tensor_of_an_unknown_site_names_the_sites(tmp_path: Path) -> None:
    site_store(tmp_path, "float32", 4, ("layers.1.output", "layers.2.output"))
    with pytest.raises(KeyError, match="no site 'layers.3.output'.*layers.1.output, layers.2"):
        site_tensor(tmp_path, "layers.3.output")
    with pytest.raises(StoreError, match="cannot read"):
        site_tensor(tmp_path / "missing", "layers.1.output")
    with pytest.raises(TypeError, match="expected a dataset directory"):
        site_tensor(42, "layers.1.output")


# -- the extract plan ----------------------------------------------------------------------


def test_positions_selected_per_prompt() -> None:
    assert selected("all_prompt", 1, 4).tolist() == [1, 2, 3]
    assert selected("last_prompt", 0, 4).tolist() == [3]
    assert selected("last_prompt", 4, 4).tolist() == []
    assert selected(check_positions([5, 0, 2, 2], 1), 1, 4).tolist() == [2]
    with pytest.raises(ValueError, match="below skip_first"):
        check_positions([0], 1)
    with pytest.raises(ValueError, match="extract reads prompts only"):
        check_positions("all_generated", 0)
    with pytest.raises(ValueError, match="skip_first"):
        check_positions("all_prompt", -1)


def test_router_sites_are_refused_with_what_to_use_instead() -> None:
    config = AutoConfig.for_model("mixtral", num_hidden_layers=2)
    llm = SimpleNamespace(config=config)
    assert expand_sites(llm.config, ["layers.*.output"]) == ["layers.0.output", "layers.1.output"]
    with pytest.raises(ValueError, match="router site, which extract does not store; capture"):
        expand_sites(llm.config, ["layers.1.output", "layers.*.mlp.router.output"])


def test_shards_are_cut_from_the_prompt_lengths_alone() -> None:
    lengths = [3, 5, 2, 40, 1, 4, 4, 30, 2]
    tokenized = [(i, list(range(n))) for i, n in enumerate(lengths)]
    plan = list(plan_shards(tokenized, "all_prompt", 1, 29, 1, ShardSizes(5)))
    assert [(s.start, s.end) for s in plan] == [(0, 1), (1, 5), (5, 6), (6, 9)]
    assert [s.rows for s in plan] == [2, 5, 3, 4]
    assert sum(s.counts[TOO_LONG] for s in plan) == 2  # 40 and 30 tokens
    assert sum(s.counts[NO_ROWS] for s in plan) == 1  # one token, skipped by skip_first
    # A restart after any shard cuts the same shards as the uninterrupted run.
    for k, shard in enumerate(plan):
        rest = plan_shards(tokenized[shard.start :], "all_prompt", 1, 29, 1, ShardSizes(5))
        assert [(s.start, s.end) for s in rest] == [(s.start, s.end) for s in plan[k:]]
    # A prompt with more rows than a shard holds is a shard alone.
    one_each = [(0, [1] * 3), (1, [1] * 20), (2, [1])]
    big = list(plan_shards(one_each, "all_prompt", 0, None, 1, ShardSizes(8)))
    assert [(s.start, s.end) for s in big] == [(0, 1), (1, 2), (2, 3)]


def test_shards_of_last_prompt_rows_are_also_cut_by_their_tokens() -> None:
    """One row per prompt fits any byte budget: the token bound keeps such shards to a few
    engine steps' prompts, and a restart cuts the same shards."""
    tokenized = [(i, list(range(n))) for i, n in enumerate([4, 4, 3, 9, 2, 2, 2])]
    args = ("last_prompt", 0, None, 1)
    assert [(s.start, s.end) for s in plan_shards(tokenized, *args, ShardSizes(1000))] == [(0, 7)]
    plan = list(plan_shards(tokenized, *args, ShardSizes(1000, 8)))
    assert [(s.start, s.end) for s in plan] == [(0, 2), (2, 3), (3, 4), (4, 7)]
    assert [s.counts[TOKENS] for s in plan] == [8, 3, 9, 6]  # 9 tokens: a shard alone
    for k, shard in enumerate(plan):
        rest = plan_shards(tokenized[shard.start :], *args, ShardSizes(1000, 8))
        assert [(s.start, s.end) for s in rest] == [(s.start, s.end) for s in plan[k:]]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), max_size=40),
    sizes=st.tuples(st.integers(1, 30), st.integers(1, 40), st.integers(1, 10)),
)
def test_the_last_prompts_go_into_smaller_shards(
    lengths: list[int], sizes: tuple[int, int, int]
) -> None:
    """Prompts whose own and later computed tokens number at most `tail_tokens` are in
    shards of `tail_bytes` (a longer prompt alone), never beside earlier prompts; the plan
    reads no further ahead than the tail, and a restart after any shard cuts the same."""
    shard_bytes, tail_tokens, tail_bytes = sizes
    longest = 10  # prompts of 11 and 12 tokens are skipped: not computed, not counted
    tokenized = [(i, list(range(n))) for i, n in enumerate(lengths)]
    plan_sizes = ShardSizes(shard_bytes, None, tail_tokens, tail_bytes)
    read: list[int] = []

    def stream(items: list[tuple[int, list[int]]]) -> Any:
        for item in items:
            read.append(item[0])
            yield item

    planned = plan_shards(stream(tokenized), "all_prompt", 0, longest, 1, plan_sizes)
    plan = []
    for shard in planned:
        ahead = sum(n for n in lengths[shard.end : read[-1]] if n <= longest)
        assert ahead <= tail_tokens  # the prompts read past this shard: the tail at most
        plan.append(shard)
    assert [(s.start, s.end) for s in plan] == list(
        zip([0, *[s.end for s in plan[:-1]]], [s.end for s in plan])
    ) and (not plan or plan[-1].end == len(lengths))
    later = [sum(n for n in lengths[i:] if n <= longest) for i in range(len(lengths))]
    for shard in plan:
        tail = {later[p.index] <= tail_tokens for p in shard.prompts}
        assert len(tail) <= 1  # never both
        budget = tail_bytes if tail == {True} else shard_bytes
        assert shard.rows <= budget or len(shard.prompts) == 1
    for k, shard in enumerate(plan):
        rest = plan_shards(tokenized[shard.start :], "all_prompt", 0, longest, 1, plan_sizes)
        assert [(s.start, s.end) for s in rest] == [(s.start, s.end) for s in plan[k:]]


def test_rows_lying_in_order_in_one_block_are_joined_without_a_copy() -> None:
    block = torch.arange(40.0).reshape(10, 4)
    parts = [block[0:3], block[3:3], block[3:10]]
    got = joined(parts)
    assert torch.equal(got, block) and got.data_ptr() == block.data_ptr()
    for gapped in ([block[0:3], block[4:10]], [block[3:10], block[0:3]], [block[:, :2]]):
        got = joined(gapped)
        assert torch.equal(got, torch.cat(gapped)) and got.data_ptr() != block.data_ptr()


def test_prompt_sources(tmp_path: Path) -> None:
    texts = ["one", "two words", "three"]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    sources = [
        prompt_source(texts),
        prompt_source(tmp_path / "p.txt"),
        prompt_source(str(tmp_path / "p.jsonl"), column="body"),
        prompt_source(datasets.Dataset.from_dict({"text": texts})),
    ]
    assert {(s.count, s.sha256) for s in sources} == {(3, sources[0].sha256)}
    assert list(sources[1].from_index(1)) == [(1, "two words"), (2, "three")]
    assert prompt_source(["one", "two"]).sha256 != sources[0].sha256


def test_bad_prompt_sources_are_refused_with_the_index(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prompt 1 of the list of 3 prompts is empty"):
        prompt_source(["a", "", "c"])
    (tmp_path / "p.txt").write_text("a\nb\n\nd\n")
    with pytest.raises(ValueError, match="prompt 2 of .*p.txt is empty"):
        prompt_source(tmp_path / "p.txt")
    (tmp_path / "p.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object with a 'text' field"):
        prompt_source(tmp_path / "p.jsonl")
    with pytest.raises(FileNotFoundError, match="give a list of strings"):
        prompt_source("The capital of France is")
    with pytest.raises(ValueError, match="holds no prompts"):
        prompt_source([])
    with pytest.raises(TypeError, match="prompt 0: expected a string or a list of token ids"):
        prompt_source([("a", "tuple")])


@pytest.mark.parametrize(
    ("lines", "options", "error"),
    [
        ("a\n\nb\n", [], r"prompt 1 of \S+ is empty"),
        ("a\nb\n", ["--positions", "3", "--skip-first", "5"], "below skip_first=5"),
        (None, [], "prompts: no file"),
    ],
    ids=["empty prompt", "positions", "no prompts file"],
)
def test_vinterp_extract_names_bad_input_in_one_line_before_an_engine_starts(
    tmp_path: Path, lines: str | None, options: list[str], error: str
) -> None:
    """The model folder does not exist: an engine start would fail on it first."""
    prompts = tmp_path / "prompts.txt"
    if lines is not None:
        prompts.write_text(lines)
    args = ["extract", "-v", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts)]
    args += ["--sites", "layers.1.output", "--out", str(tmp_path / "out"), *options]
    with pytest.raises(SystemExit) as stopped:
        cli.main(args)
    message = str(stopped.value.code)
    assert message.startswith("vinterp extract: ") and re.search(error, message), message
    assert not (tmp_path / "out").exists()
