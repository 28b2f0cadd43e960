"""Steering buffers and tables, capture tables and the capture store, without an engine."""

from __future__ import annotations

import torch

from vinterp.fastpath.capture_store import CaptureStore
from vinterp.fastpath.specs import CaptureSpec, SteerSpec
from vinterp.fastpath.steer_buffers import SteerBuffers
from vinterp.fastpath.steer_tables import RequestSteering, SteeredRequest, SteeringState
from vinterp.fastpath.tables import RowSpan, build_capture_tables
from vinterp.sites.names import SiteOrder
from vinterp.wire.tensors import tensor_from_wire

SITE = "layers.1.output"
ORDER = SiteOrder(2)
H = 4


def steer(phase: str, scale: float = 2.0, **kwargs) -> SteerSpec:
    return SteerSpec({SITE: torch.ones(H)}, scale, phase, kwargs.get("positions"), False)


def request(req_id: str, positions: range, prompt_len: int, specs: list) -> SteeredRequest:
    """`req_id` computing `positions` this step, steered by `specs`."""
    return SteeredRequest(
        req_id, positions.start, len(positions), RequestSteering(tuple(specs), prompt_len)
    )


def buffers(max_rows: int = 8) -> SteerBuffers:
    return SteerBuffers(len(ORDER.sites), H, 16, 8, max_rows, torch.float32, "cpu")


def steered(state: SteeringState, requests, layout, num_tokens, x, site=SITE) -> torch.Tensor:
    """Plan and write one step, then apply the buffers to x at `site` (reference: by hand)."""
    assert not state.plan(requests)
    state.write(layout, num_tokens)
    return state.buffers(ORDER[site], x)


def test_steering_rows_follow_phase_positions_and_requests() -> None:
    state = SteeringState(buffers(), ORDER)
    # request a: prompt of 3 being prefilled (rows 0..2); request b: decoding position 5 (row 3)
    a = request("a", range(0, 3), 3, [steer("decode")])
    b = request("b", range(5, 6), 5, [steer("decode")])
    out = steered(state, [a, b], [("a", 0, 3), ("b", 3, 4)], 4, torch.zeros(4, H))
    assert out[:3].abs().sum() == 0 and torch.equal(out[3], torch.full((H,), 2.0))
    both = request("a", range(0, 3), 3, [steer("all"), steer("prefill", 1.0)])
    out = steered(state, [both], [("a", 0, 3)], 4, torch.zeros(4, H))
    assert torch.equal(out[:3], torch.full((3, H), 3.0)) and out[3].abs().sum() == 0
    only_1 = request("a", range(0, 3), 3, [steer("all", positions=frozenset({1}))])
    out = steered(state, [only_1], [("a", 0, 3)], 3, torch.zeros(3, H))
    assert out[:, 0].tolist() == [0.0, 2.0, 0.0]
    # other sites, and a step with no steering, add exactly nothing
    assert torch.equal(state.buffers(ORDER["layers.0.output"], torch.ones(3, H)), torch.ones(3, H))
    assert not state.plan([])
    state.write([("a", 0, 3)], 3)
    assert torch.equal(state.buffers(ORDER[SITE], torch.ones(3, H)), torch.ones(3, H))


def test_norm_match_scales_with_each_rows_norm() -> None:
    state = SteeringState(buffers(), ORDER)
    spec = SteerSpec({SITE: torch.tensor([3.0, 4.0, 0.0, 0.0])}, 0.5, "all", None, True)
    x = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 10.0]])
    out = steered(state, [request("a", range(2), 2, [spec])], [("a", 0, 2)], 2, x)
    unit = torch.tensor([0.6, 0.8, 0.0, 0.0])
    assert torch.allclose(out, x + 0.5 * torch.tensor([[2.0], [10.0]]) * unit)


def test_tables_too_large_for_the_buffers_run_uncompiled_with_larger_ones() -> None:
    state = SteeringState(buffers(max_rows=2), ORDER)
    requests = [request(str(i), range(i, i + 1), 0, [steer("all", float(i + 1))]) for i in range(3)]
    assert state.plan(requests)  # 3 vectors + the zero row do not fit 2 rows
    state.write([(str(i), i, i + 1) for i in range(3)], 3)
    out = state.buffers(ORDER[SITE], torch.zeros(3, H))
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert not state.plan([])
    state.write([], 3)
    assert state.buffers.overflow is None


def test_buffer_updates_reach_a_compiled_function_without_recompiling() -> None:
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    steer_buffers = buffers()
    state = SteeringState(steer_buffers, ORDER)
    fn = torch.compile(lambda x: steer_buffers(ORDER[SITE], x), backend=backend, fullgraph=True)
    x = torch.zeros(2, H)
    assert torch.equal(fn(x), x)
    for scale in (1.0, 5.0):
        state.plan([request("a", range(2), 0, [steer("all", scale)])])
        state.write([("a", 0, 2)], 2)
        assert torch.equal(fn(x), torch.full((2, H), scale))
    state.plan([])
    state.write([], 2)
    assert torch.equal(fn(x), x)
    assert len(compiles) == 1


def test_capture_gathers_each_request_rows_once_per_site() -> None:
    last = CaptureSpec("a", (SITE,), "last_prompt")
    every = CaptureSpec("b", (SITE, "layers.0.output"), "all")
    spans = [RowSpan(0, 3, 0, 3), RowSpan(3, 5, 0, 2)]
    tables = build_capture_tables([(spans[0], last), (spans[1], every)])
    assert tables[SITE].rows.tolist() == [2, 3, 4]
    assert tables[SITE].parts == [("a", [2]), ("b", [0, 1])]
    assert tables["layers.0.output"].rows.tolist() == [3, 4]
    assert last.wants_any(0, 3, 3) and not last.wants_any(3, 4, 3)
    assert CaptureSpec("c", (SITE,), "all_generated").wants_any(2, 4, 3)


def test_store_orders_positions_and_keeps_the_latest_recompute() -> None:
    spec = CaptureSpec("a", (SITE,), "all")
    store = CaptureStore()
    first = build_capture_tables([(RowSpan(0, 2, 0, 3), spec)])  # positions 0, 1
    store.record_site(SITE, first[SITE], torch.tensor([[0.0], [1.0]]))
    again = build_capture_tables([(RowSpan(1, 4, 0, 3), spec)])  # preempted: 0, 1, 2 again
    store.record_site(SITE, again[SITE], torch.tensor([[9.0], [10.0], [11.0], [12.0]]))
    taken = store.take(["a"])["a"][SITE]
    assert taken["positions"] == [0, 1, 2]
    assert tensor_from_wire(taken["values"]).flatten().tolist() == [10.0, 11.0, 12.0]
    assert store.take(["a"]) == {"a": {}}


def test_decode_steps_follow_the_batch_as_it_changes() -> None:
    """Steps that repeat the last one's combination ids copy nothing; every other step
    (requests reordered, finished, unsteered) gets exactly its own rows steered."""
    state = SteeringState(buffers(), ORDER)
    spec = steer("all")
    steps = [
        (["a", "b", "c"], {"a", "c"}),
        (["a", "b", "c"], {"a", "c"}),  # a decode step like the last
        (["b", "a", "c"], {"a", "c"}),  # reordered
        (["b", "c"], {"c"}),  # a finished
        (["b", "c"], set()),  # nothing steered
        (["c", "b"], {"b"}),
    ]
    for step, (order, steered_ids) in enumerate(steps):
        requests = [request(r, range(10 + step, 11 + step), 5, [spec]) for r in sorted(steered_ids)]
        state.plan(requests)
        state.write([(r, i, i + 1) for i, r in enumerate(order)], len(order))
        if step == 1:  # not copied again: the value planted after step 0 is still there
            assert int(state.buffers.token_combo[1]) == 7
            state.buffers.token_combo[1] = 0
        out = state.buffers(ORDER[SITE], torch.zeros(len(order), H))
        assert out[:, 0].tolist() == [2.0 if r in steered_ids else 0.0 for r in order], step
        if step == 0:
            state.buffers.token_combo[1] = 7


def test_identical_specs_decode_to_one_and_different_ones_stay_apart() -> None:
    from vinterp.wire.tensors import tensor_to_wire

    def wire(vector: torch.Tensor, scale: float = 2.0) -> dict:
        return {
            "vectors": {SITE: tensor_to_wire(vector)},
            "scale": scale,
            "phase": "all",
            "positions": None,
            "norm_match": False,
        }

    v = torch.randn(H, generator=torch.Generator().manual_seed(1))
    nudged = v.clone()
    nudged[2] += 1e-3

    def decoded(wire: dict) -> SteerSpec:
        return SteerSpec.from_wire(wire, ORDER, H)

    assert decoded(wire(v)) is decoded(wire(v.clone()))
    assert decoded(wire(v)) is not decoded(wire(nudged))
    assert decoded(wire(v)) is not decoded(wire(v, scale=3.0))
    state = SteeringState(buffers(), ORDER)
    same = [request(r, range(4, 5), 2, [decoded(wire(v))]) for r in "abc"]
    state.plan(same)
    assert state.plan_ is not None and len(state.plan_.key) == 2  # none, and the one spec
