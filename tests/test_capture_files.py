"""Captured rows handed from workers to the front end as files (`interventions.capture_files`):
the same rows as the inline route, in every dtype, and clear errors when a file cannot be
written or read."""

from __future__ import annotations

import pytest
import torch

from vinterp.interventions import capture_files
from vinterp.interventions.capture_files import INLINE_BYTES, FileHandoff, FileWriter
from vinterp.interventions.capture_store import CaptureStore, merge_captures
from vinterp.interventions.tables import SiteCapture
from vinterp.wire.errors import WireError


@pytest.fixture
def handoff(tmp_path, monkeypatch):
    monkeypatch.setenv(capture_files.DIR_ENV, str(tmp_path / "handoff"))
    made = FileHandoff()
    yield made
    made.close()


def big(dtype: torch.dtype, rows: int = 600, width: int = 1000) -> torch.Tensor:
    """A block over the inline limit."""
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert values.numel() * values.element_size() >= INLINE_BYTES
    return values


def store_of(values: dict[str, torch.Tensor]) -> CaptureStore:
    """Two requests' rows at each site, recorded in one step."""
    store = CaptureStore()
    rows = next(iter(values.values())).shape[0]
    half = rows // 2
    capture = SiteCapture(
        torch.arange(rows), [("a", list(range(half))), ("b", list(range(rows - half)))]
    )
    for site, value in values.items():
        store.record_site(site, capture, value)
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_through_files_equal_the_inline_rows(handoff, dtype) -> None:
    values = {"layers.0.output": big(dtype), "layers.1.output": big(dtype) * 3}
    inline = merge_captures([store_of(values).take(["a", "b"])])
    writer = FileWriter()
    blocks = store_of(values).take(["a", "b"], writer.encoder(handoff.request()))
    assert all("file" in block["values"] for block in blocks.values())  # not inline
    through_files = merge_captures([blocks], handoff.tensor)
    for cid in ("a", "b"):
        for site in values:
            got, want = through_files[cid][site], inline[cid][site]
            assert got["positions"] == want["positions"]
            assert got["values"].dtype == dtype
            assert torch.equal(got["values"], want["values"])
    assert list(handoff.directory.iterdir()) == []  # each file is removed once mapped


def test_small_blocks_another_host_and_no_directory_travel_inline(handoff) -> None:
    writer = FileWriter()
    small = torch.ones(2, 3)
    assert "data" in writer.encoder(handoff.request())(small)
    elsewhere = {**handoff.request(), "host": "another-machine/boot"}
    assert "data" in writer.encoder(elsewhere)(big(torch.float32))
    assert "data" in writer.encoder(None)(big(torch.float32))
    gone = {**handoff.request(), "directory": str(handoff.directory / "missing")}
    assert "data" in writer.encoder(gone)(big(torch.float32))


def test_a_file_the_worker_could_not_write_is_a_clear_error(handoff, monkeypatch) -> None:
    writer = FileWriter()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(capture_files.os, "posix_fallocate", full)  # the room taken first
    block = writer.encoder(handoff.request())(big(torch.float32))
    with pytest.raises(OSError, match="No space left on device.*VINTERP_CAPTURE_DIR"):
        handoff.tensor(block, "captured rows at layers.0.output")
    assert list(handoff.directory.iterdir()) == []  # no partial file is left behind


def test_file_blocks_naming_other_paths_or_sizes_are_refused(handoff) -> None:
    writer = FileWriter()
    block = writer.encoder(handoff.request())(big(torch.float32))
    handoff.tensor(dict(block), "rows")  # waits for the write; the file is then removed
    outside = {**block, "file": "../escape.rows"}
    with pytest.raises(WireError, match="handoff directory"):
        handoff.tensor(outside, "rows")
    block = writer.encoder(handoff.request())(big(torch.float32))
    wrong = {**block, "shape": [block["shape"][0] + 1, block["shape"][1]]}
    with pytest.raises(WireError, match="bytes"):
        handoff.tensor(wrong, "rows")
