"""The activation dataset on disk (vinterp.store) and the extract plan, without an engine:
shards readable by `datasets.load_from_disk`, resume after a kill at each step of a commit,
refusal of another spec, write errors that leave no shard looking complete."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest

from vinterp.api.extract_plan import NO_ROWS, TOO_LONG, check_positions, plan_shards, selected
from vinterp.api.prompt_source import prompt_source
from vinterp.store import (
    ActivationStore,
    PendingShard,
    ShardWriter,
    SpecMismatchError,
    StoreError,
    files,
)

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
    return ActivationStore.open(root, spec, COLUMNS, shard_bytes=1000)


def loaded(root: Path) -> dict[str, np.ndarray]:
    return datasets.load_from_disk(str(root)).with_format("numpy")[:]


def test_shards_load_through_datasets_in_prompt_order(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.commit(0, 3, rows(0, 3), {"n": 1})
    store.commit(3, 5, rows(3, 5), {"n": 2})
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
    store.commit(0, 2, rows(0, 2), {})
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
    again.commit(2, 5, rows(2, 5), {})
    assert np.array_equal(loaded(tmp_path)["site"], rows(0, 5)["site"])


def test_another_spec_is_refused_naming_what_differs(tmp_path: Path) -> None:
    open_store(tmp_path).commit(0, 1, rows(0, 1), {})
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
    store.commit(0, 2, rows(0, 2), {})
    before = (tmp_path / "manifest.json").read_text()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(StoreError, match="No space left on device.*continues after them"):
        store.commit(2, 4, rows(2, 4), {})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".", "data-"))) == [
        "data-00000.arrow"
    ]
    assert (tmp_path / "manifest.json").read_text() == before
    resumed = open_store(tmp_path)
    resumed.commit(2, 4, rows(2, 4), {})
    assert np.array_equal(loaded(tmp_path)["prompt"], rows(0, 4)["prompt"])


def test_a_shard_that_does_not_follow_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="does not follow prompt 0"):
        store.commit(1, 2, rows(1, 2), {})


def test_writer_commits_in_order_and_waits_while_its_queue_is_full(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    release = threading.Event()

    def slow(start: int, end: int) -> dict[str, np.ndarray]:
        release.wait(10)
        return rows(start, end)

    with ShardWriter(store, queued=1) as writer:
        writer.put(PendingShard(0, 1, lambda: slow(0, 1)))  # taken by the thread, blocked
        writer.put(PendingShard(1, 2, lambda: rows(1, 2)))  # fills the queue
        third = threading.Thread(target=writer.put, args=(PendingShard(2, 4, lambda: rows(2, 4)),))
        third.start()
        third.join(0.3)
        assert third.is_alive()  # bounded: the caller waits for the writer
        release.set()
        third.join(10)
    assert [s.end for s in store.manifest.shards] == [1, 2, 4]
    assert np.array_equal(loaded(tmp_path)["prompt"], rows(0, 4)["prompt"])


def test_a_write_error_reaches_the_caller(tmp_path: Path) -> None:
    store = open_store(tmp_path)

    def broken() -> dict[str, np.ndarray]:
        raise RuntimeError("column build failed")

    writer = ShardWriter(store)
    writer.put(PendingShard(0, 1, broken))
    with pytest.raises(RuntimeError, match="column build failed"):
        writer.close()
    assert store.manifest.shards == []


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


def test_shards_are_cut_from_the_prompt_lengths_alone() -> None:
    lengths = [3, 5, 2, 40, 1, 4, 4, 30, 2]
    tokenized = [(i, list(range(n))) for i, n in enumerate(lengths)]
    plan = list(plan_shards(tokenized, "all_prompt", 1, 29, row_bytes=1, shard_bytes=5))
    assert [(s.start, s.end) for s in plan] == [(0, 1), (1, 5), (5, 6), (6, 9)]
    assert [s.rows for s in plan] == [2, 5, 3, 4]
    assert sum(s.counts[TOO_LONG] for s in plan) == 2  # 40 and 30 tokens
    assert sum(s.counts[NO_ROWS] for s in plan) == 1  # one token, skipped by skip_first
    # A restart after any shard cuts the same shards as the uninterrupted run.
    for k, shard in enumerate(plan):
        rest = plan_shards(tokenized[shard.start :], "all_prompt", 1, 29, 1, 5)
        assert [(s.start, s.end) for s in rest] == [(s.start, s.end) for s in plan[k:]]
    # A prompt with more rows than a shard holds is a shard alone.
    big = list(plan_shards([(0, [1] * 3), (1, [1] * 20), (2, [1])], "all_prompt", 0, None, 1, 8))
    assert [(s.start, s.end) for s in big] == [(0, 1), (1, 2), (2, 3)]


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
    with pytest.raises(TypeError, match="prompt 0: expected a string"):
        prompt_source([[1, 2]])
