"""A take of rows from a finished step does not wait for the step queued behind it: the rows
reach the front end's file while the compute stream is still busy (on a GPU only: off one,
nothing is ordered by streams)."""

from __future__ import annotations

import pytest
import torch

from vinterp.interventions.capture_files import FileHandoff, FileWriter
from vinterp.interventions.capture_store import CaptureStore
from vinterp.interventions.tables import SiteCapture
from vinterp.wire.tensors import tensor_from_wire

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUEUED_STEP_CYCLES = 4_000_000_000  # about two seconds of a GPU's clock


@pytest.mark.parametrize("through_files", (True, False))
def test_a_take_overtakes_the_queued_step(through_files) -> None:
    store, rows = CaptureStore(), 4096
    computed = torch.randn(rows, 128, device="cuda") * 3  # a step's rows
    wanted = computed.cpu()
    picked = torch.arange(rows - 1, -1, -1)  # taken in another order than gathered
    store.add_gathered(
        "layers.3.output", SiteCapture(picked, [("a", list(range(rows)))]), computed[picked.cuda()]
    )
    del computed
    torch.cuda._sleep(QUEUED_STEP_CYCLES)  # the next step, queued on the compute stream
    handoff = FileHandoff()
    try:
        encode = FileWriter().encoder(handoff.request() if through_files else None)
        block = store.take(["a"], encode)["layers.3.output"]
        if through_files:
            assert "file" in block["values"]
            values = handoff.tensor(block["values"], "rows")
        else:
            values = tensor_from_wire(block["values"], "rows")
        assert not torch.cuda.current_stream().query(), "the queued step ended before the take"
        assert torch.equal(values, wanted[picked])
    finally:
        torch.cuda.synchronize()
        handoff.close()
