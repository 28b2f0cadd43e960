"""Per-step fast-path tables and the capture store, without an engine."""

from __future__ import annotations

import torch

from vinterp.fastpath.capture_store import CaptureStore
from vinterp.fastpath.specs import CaptureSpec, SteerSpec
from vinterp.fastpath.tables import RowSpan, build_tables
from vinterp.ir.wire import tensor_from_wire

SITE = "layers.1.output"


def steer(phase: str, scale: float = 2.0) -> SteerSpec:
    return SteerSpec({SITE: torch.ones(4)}, scale, phase, None, False)


def test_steering_rows_follow_phase_and_requests() -> None:
    # request A: prompt of 3 being prefilled (rows 0..2); request B: decoding position 5 (row 3)
    a, b = RowSpan(0, 3, 0, 3), RowSpan(3, 4, 5, 5)
    tables = build_tables([(a, [steer("decode")], None), (b, [steer("decode")], None)])
    out = torch.zeros(4, 4)
    tables.steer[SITE].add_to(out)
    assert out[:3].abs().sum() == 0 and torch.equal(out[3], torch.full((4,), 2.0))
    tables = build_tables([(a, [steer("all"), steer("prefill", 1.0)], None)])
    out = torch.zeros(4, 4)
    tables.steer[SITE].add_to(out)
    assert torch.equal(out[:3], torch.full((3, 4), 3.0)) and out[3].abs().sum() == 0


def test_capture_gathers_each_request_rows_once_per_site() -> None:
    last = CaptureSpec("a", (SITE,), "last_prompt")
    every = CaptureSpec("b", (SITE, "layers.0.output"), "all")
    spans = [RowSpan(0, 3, 0, 3), RowSpan(3, 5, 0, 2)]
    tables = build_tables([(spans[0], [], last), (spans[1], [], every)])
    assert tables.capture[SITE].rows.tolist() == [2, 3, 4]
    assert tables.capture[SITE].parts == [("a", [2]), ("b", [0, 1])]
    assert tables.capture["layers.0.output"].rows.tolist() == [3, 4]


def test_store_orders_positions_and_keeps_the_latest_recompute() -> None:
    spec = CaptureSpec("a", (SITE,), "all")
    store = CaptureStore()
    first = build_tables([(RowSpan(0, 2, 0, 3), [], spec)])  # positions 0, 1
    store.record_site(SITE, first.capture[SITE], torch.tensor([[0.0], [1.0]]))
    again = build_tables([(RowSpan(1, 4, 0, 3), [], spec)])  # preempted: 0, 1, 2 again
    store.record_site(SITE, again.capture[SITE], torch.tensor([[9.0], [10.0], [11.0], [12.0]]))
    taken = store.take(["a"])["a"][SITE]
    assert taken["positions"] == [0, 1, 2]
    assert tensor_from_wire(taken["values"]).flatten().tolist() == [10.0, 11.0, 12.0]
    assert store.take(["a"]) == {"a": {}}
