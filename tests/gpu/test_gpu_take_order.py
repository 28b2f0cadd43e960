"""A take of rows from a finished step does not wait for the step queued behind it: the rows
reach the front end (as a file, or inline) while the compute stream is still busy (on a GPU
only: off one, nothing is ordered by streams)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vinterp.interventions.capture_files import FileHandoff, FileWriter
from vinterp.interventions.capture_store import CaptureStore
from vinterp.interventions.tables import SiteCapture
from vinterp.wire.tensors import tensor_from_wire

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUEUED_STEP_CYCLES = 4_000_000_000  # about two seconds of a GPU's clock
ROWS = 4096
SITE = "layers.3.output"
WRITER = FileWriter()


def taken(handoff: FileHandoff | None, queued_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's rows kept and taken back (with a long step queued behind them, or not): the
    rows as computed, and as the front end reads them."""
    store = CaptureStore()
    computed = torch.randn(ROWS, 128, device="cuda") * 3
    picked = torch.arange(ROWS - 1, -1, -1)  # taken in another order than gathered
    store.add_gathered(
        SITE, SiteCapture(picked, [("a", list(range(ROWS)))]), computed[picked.cuda()]
    )
    wanted = computed.cpu()[picked]
    if queued_step:
        torch.cuda._sleep(QUEUED_STEP_CYCLES)
    block: Any = store.take(["a"], WRITER.encoder(handoff and handoff.request()))[SITE]["values"]
    if handoff is None:
        return wanted, tensor_from_wire(block, "rows")
    assert "file" in block
    return wanted, handoff.tensor(block, "rows")


@pytest.mark.parametrize("through_files", (True, False))
def test_a_take_overtakes_the_queued_step(through_files) -> None:
    handoff = FileHandoff() if through_files else None
    try:
        # A first take sets up what later ones reuse (the writer's thread, its stream and
        # staging buffer, the side stream), and that waited for the device on an H200: it is
        # done before the test's queued step.
        taken(handoff, queued_step=False)
        torch.cuda.synchronize()
        wanted, got = taken(handoff, queued_step=True)
        assert not torch.cuda.current_stream().query(), "the queued step ended before the take"
        assert torch.equal(got, wanted)
    finally:
        torch.cuda.synchronize()
        if handoff is not None:
            handoff.close()
