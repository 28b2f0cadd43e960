"""Steering buffers and tables, capture tables and the capture store, without an engine."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vinterp.interventions import capture_store
from vinterp.interventions.capture_buffers import CaptureBuffers, buffer_setting, buffer_site_ids
from vinterp.interventions.capture_store import CaptureStore, merge_captures
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import WorkerCapture, WorkerSteering, worker_steering
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.interventions.steer_tables import RequestSteering, SteeredRequest, SteeringPlanner
from vinterp.interventions.tables import RowSpan, SiteCapture, build_capture_tables
from vinterp.sites.names import (
    HEAD_SITES,
    PATTERN,
    ROUTER_SITES,
    Heads,
    Router,
    SiteOrder,
    UnknownSiteError,
)
from vinterp.wire.specs import Steering
from vinterp.wire.tensors import tensor_from_wire

SITE = "layers.1.output"
ORDER = SiteOrder(2)
H = 4


def steering(vectors, scale, phase, positions, norm_match) -> WorkerSteering:
    """A worker's steering, built from the user's spec."""
    positions = None if positions is None else sorted(positions)
    spec = Steering(vectors, scale=scale, phase=phase, positions=positions, norm_match=norm_match)
    return WorkerSteering(spec)


def steer(phase: str, scale: float = 2.0, **kwargs) -> WorkerSteering:
    return steering({SITE: torch.ones(H)}, scale, phase, kwargs.get("positions"), False)


def request(req_id: str, positions: range, prompt_len: int, specs: list) -> SteeredRequest:
    """`req_id` computing `positions` this step, steered by `specs`."""
    return SteeredRequest(
        req_id, positions.start, len(positions), RequestSteering(tuple(specs), prompt_len)
    )


def site_index(site: str) -> tuple[int, torch.Tensor]:
    """The site's id, and as the one-element tensor the model's site ops index with."""
    return ORDER[site], torch.tensor([ORDER[site]])


def buffers(max_rows: int = 8) -> SteerBuffers:
    return SteerBuffers(len(ORDER.sites), H, 16, 8, max_rows, torch.float32, "cpu")


def steered(state: SteeringPlanner, requests, layout, num_tokens, x, site=SITE) -> torch.Tensor:
    """Plan and write one step, then apply the buffers to x at `site` (reference: by hand)."""
    assert not state.plan(requests)
    state.write(lambda: layout, num_tokens)
    return state.buffers(*site_index(site), x)


def test_steering_rows_follow_phase_positions_and_requests() -> None:
    state = SteeringPlanner(buffers(), ORDER, SaeRegistry("cpu", torch.float32))
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
    assert torch.equal(
        state.buffers(*site_index("layers.0.output"), torch.ones(3, H)), torch.ones(3, H)
    )
    assert not state.plan([])
    state.write(lambda: [("a", 0, 3)], 3)
    assert torch.equal(state.buffers(*site_index(SITE), torch.ones(3, H)), torch.ones(3, H))


def test_norm_match_scales_with_each_rows_norm() -> None:
    state = SteeringPlanner(buffers(), ORDER, SaeRegistry("cpu", torch.float32))
    spec = steering({SITE: torch.tensor([3.0, 4.0, 0.0, 0.0])}, 0.5, "all", None, True)
    x = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 10.0]])
    out = steered(state, [request("a", range(2), 2, [spec])], [("a", 0, 2)], 2, x)
    unit = torch.tensor([0.6, 0.8, 0.0, 0.0])
    assert torch.allclose(out, x + 0.5 * torch.tensor([[2.0], [10.0]]) * unit)


def ablation(direction, scale: float = 1.0, positions=None) -> WorkerSteering:
    return WorkerSteering(
        Steering({SITE: direction}, mode="ablate", scale=scale, positions=positions)
    )


def test_ablation_removes_the_component_along_the_direction_and_adds_with_the_rest() -> None:
    state = SteeringPlanner(buffers(), ORDER, SaeRegistry("cpu", torch.float32))
    direction = torch.tensor([0.0, 3.0, 4.0, 0.0])  # unit (0, .6, .8, 0)
    x = torch.tensor([[1.0, 2.0, -1.0, 5.0], [0.0, 0.6, 0.8, 0.0], [7.0, 0.0, 0.0, 1.0]])
    # prompt positions 0 and 2 ablated, 1 not; a plain vector added to every position
    specs = [ablation(direction, positions=[0, 2]), steer("all", 0.5)]
    out = steered(state, [request("a", range(3), 3, specs)], [("a", 0, 3)], 3, x)
    unit = direction / 5
    by_hand = torch.stack([x[0] - (x[0] @ unit) * unit, x[1], x[2] - (x[2] @ unit) * unit]) + 0.5
    assert torch.allclose(out, by_hand, atol=1e-6)
    assert torch.allclose((out - 0.5)[[0, 2]] @ unit, torch.zeros(2), atol=1e-6)
    half = steered(
        state, [request("a", range(2), 2, [ablation(direction, 0.5)])], [("a", 0, 2)], 2, x[:2]
    )
    assert torch.allclose(half[1], 0.5 * x[1], atol=1e-6)  # x[1] lies along d: half is left


def test_two_ablations_at_one_site_subtract_both_projections_in_larger_tables() -> None:
    state = SteeringPlanner(buffers(), ORDER, SaeRegistry("cpu", torch.float32))
    first, second = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])
    both = request("a", range(1), 1, [ablation(first), ablation(second, 2.0)])
    assert state.plan([both])  # one slot per row in the persistent buffers
    state.write(lambda: [("a", 0, 1)], 1)
    x = torch.tensor([[2.0, 3.0, 1.0, 4.0]])
    out = state.buffers(*site_index(SITE), x)
    unit = second / second.norm()
    assert torch.allclose(out[0], x[0] - 2.0 * first - 2.0 * (x[0] @ unit) * unit, atol=1e-6)


def test_an_ablation_names_a_direction() -> None:
    with pytest.raises(ValueError, match="zero vector has no direction"):
        Steering({SITE: torch.zeros(H)}, mode="ablate")
    with pytest.raises(ValueError, match="norm_match"):
        Steering({SITE: torch.ones(H)}, mode="ablate", norm_match=True)
    with pytest.raises(ValueError, match="SAE feature site"):
        Steering({f"{SITE}.sae.features": {1: 2.0}}, mode="ablate")
    spec = Steering({SITE: torch.ones(H)}, mode="ablate", scale=0.5)
    assert Steering.from_json(spec.to_json()).mode == "ablate"


def test_tables_too_large_for_the_buffers_run_uncompiled_with_larger_ones() -> None:
    state = SteeringPlanner(buffers(max_rows=2), ORDER, SaeRegistry("cpu", torch.float32))
    requests = [request(str(i), range(i, i + 1), 0, [steer("all", float(i + 1))]) for i in range(3)]
    assert state.plan(requests)  # 3 vectors + the zero row do not fit 2 rows
    state.write(lambda: [(str(i), i, i + 1) for i in range(3)], 3)
    out = state.buffers(*site_index(SITE), torch.zeros(3, H))
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert not state.plan([])
    state.write(lambda: [], 3)
    assert state.buffers.overflow is None


def test_buffer_updates_reach_a_compiled_function_without_recompiling() -> None:
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    steer_buffers = buffers()
    state = SteeringPlanner(steer_buffers, ORDER, SaeRegistry("cpu", torch.float32))
    fn = torch.compile(
        lambda x: steer_buffers(*site_index(SITE), x), backend=backend, fullgraph=True
    )
    x = torch.zeros(2, H)
    assert torch.equal(fn(x), x)
    for scale in (1.0, 5.0):
        state.plan([request("a", range(2), 0, [steer("all", scale)])])
        state.write(lambda: [("a", 0, 2)], 2)
        assert torch.equal(fn(x), torch.full((2, H), scale))
    state.plan([])
    state.write(lambda: [], 2)
    assert torch.equal(fn(x), x)
    assert len(compiles) == 1


def _graph_form(gm: torch.fx.GraphModule) -> list[tuple]:
    """A graph with its inputs' names left out: what vLLM compares to compile a graph once
    for every layer whose graph is alike."""
    number = {node: i for i, node in enumerate(gm.graph.nodes)}

    def args(a):
        return str(torch.fx.node.map_arg(a, lambda node: f"%{number[node]}"))

    return [
        (n.op, None if n.op == "placeholder" else str(n.target), args(n.args), args(n.kwargs))
        for n in gm.graph.nodes
    ]


def test_the_site_ops_of_every_layer_compile_to_one_graph() -> None:
    """Two layers with steering and a capture buffer at their outputs: the same graph but for
    its inputs, so vLLM compiles it once, not once per layer (site ids as constants made
    every layer's graph its own)."""
    from vinterp.engine.site_ops import SiteCalls
    from vinterp.engine.vllm_boundary.site_modules import _add_sites

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(_graph_form(gm))
        return gm.forward

    sites = (ORDER["layers.0.output"], ORDER["layers.1.output"])
    steer_buffers = buffers()
    capture = CaptureBuffers(
        len(ORDER.sites), frozenset(sites), [*sites], 4, H, torch.float32, "cpu"
    )
    layers = [torch.nn.Linear(H, H) for _ in sites]
    for layer, site in zip(layers, sites):
        _add_sites(layer, steer_buffers, capture, SiteCalls(), "forward", {"output_id": site})
    run = torch.compile(lambda layer, x: layer(x), backend=backend, fullgraph=True, dynamic=True)
    x = torch.ones(3, H)
    outputs = [run(layer, x) for layer in layers]
    assert len(graphs) == 2 and graphs[0] == graphs[1]
    planner = SteeringPlanner(
        steer_buffers, ORDER, SaeRegistry("cpu", torch.float32)
    )  # steering one layer reaches that one only
    spec = steering({"layers.1.output": torch.ones(H)}, 1.0, "all", None, False)
    assert not planner.plan([request("a", range(3), 0, [spec])])
    planner.write(lambda: [("a", 0, 3)], 3)
    assert torch.equal(run(layers[0], x), outputs[0])
    assert torch.equal(run(layers[1], x), outputs[1] + 1.0)


def test_capture_buffers_gather_each_steps_rows_in_one_compiled_graph() -> None:
    """In-graph capture: the compiled function gathers the rows `write` names at each site
    (the stream's two parts summed), follows new rows without recompiling, and after a
    capturing step the index is emptied, so a smaller batch stays in range."""
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    site, stream = ORDER[SITE], ORDER["layers.0.output"]
    other_stage, unchosen = ORDER["embed.output"], ORDER["layers.0.mlp.output"]
    chosen = frozenset({site, stream, other_stage})
    held = [site, stream, unchosen]  # this worker's sites (a pipeline stage)
    bufs = CaptureBuffers(len(ORDER.sites), chosen, held, 4, H, torch.float32, "cpu")
    assert bufs.site_ids == {site, stream}
    assert not hasattr(bufs, f"rows_{unchosen}") and not hasattr(bufs, f"rows_{other_stage}")

    def model(x: torch.Tensor) -> torch.Tensor:
        bufs(site, torch.tensor([site]), x)
        bufs(stream, torch.tensor([stream]), x, plus=2 * x)
        bufs(unchosen, torch.tensor([unchosen]), x)  # no buffer: nothing to gather
        return x + 1

    fn = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.arange(6 * H, dtype=torch.float32).reshape(6, H)
    for rows in ([5, 0, 2], [1, 4, 3, 0]):
        bufs.write({site: torch.tensor(rows), stream: torch.tensor(rows[:2])})
        fn(x)
        assert torch.equal(bufs.gathered(site, len(rows)), x[rows])
        assert torch.equal(bufs.gathered(stream, 2), 3 * x[rows[:2]])
    assert len(compiles) == 1
    bufs.write({})
    assert bufs.index.abs().sum() == 0
    bufs.active = True  # uncompiled, as an enforce_eager engine runs it
    model(x[:1])  # one token: every gather reads row 0
    assert torch.equal(bufs.gathered(site, 1), x[:1])


def test_capture_buffer_sites_follow_the_setting() -> None:
    """True: every site of hidden-size rows (per-head and router sites when named); names and
    patterns: those sites; a wrong type or name: an error that says what to give."""
    assert buffer_site_ids(buffer_setting(True), ORDER) == set(range(len(ORDER.sites)))
    moe = SiteOrder(2, Router((1,), experts=4, top_k=2), Heads(4, 2, 64))
    parts = (*HEAD_SITES, PATTERN, *ROUTER_SITES)
    own_width = {s for s in moe.sites if s.split(".", 2)[-1] in parts}
    assert len(own_width) == 2 * 5 + 2
    chosen = buffer_site_ids(buffer_setting(True), moe)
    assert {moe.sites[k] for k in chosen} == set(moe.sites) - own_width
    named = buffer_site_ids(buffer_setting(["layers.*.attn.k", "layers.1.mlp.router.output"]), moe)
    assert {moe.sites[k] for k in named} == {
        "layers.0.attn.k",
        "layers.1.attn.k",
        "layers.1.mlp.router.output",
    }
    assert buffer_site_ids(buffer_setting(False), ORDER) == set()
    layers = buffer_site_ids(buffer_setting("layers.*.output"), ORDER)
    assert layers == {ORDER["layers.0.output"], ORDER["layers.1.output"]}
    both = buffer_site_ids(buffer_setting(["embed.output", "layers.1.output"]), ORDER)
    assert both == {ORDER["embed.output"], ORDER["layers.1.output"]}
    for wrong in ([], 3, [1], None):
        with pytest.raises(TypeError, match="layers"):
            buffer_setting(wrong)
    with pytest.raises(UnknownSiteError, match="layers.7"):
        buffer_site_ids(["layers.7.output"], ORDER)
    with pytest.raises(UnknownSiteError, match="layers.0.attn.pattern cannot have a capture"):
        buffer_site_ids(["layers.*.attn.pattern"], moe)


@given(
    st.sampled_from(["last_prompt", "all_prompt", "all_generated", "all", "set"]),
    st.integers(0, 12),
    st.integers(0, 6),
    st.integers(1, 10),
    st.frozensets(st.integers(0, 20)),
)
def test_capture_count_is_the_number_of_wanted_positions(kind, first, length, prompt_len, chosen):
    spec = WorkerCapture("a", (SITE,), chosen if kind == "set" else kind)
    wanted = sum(spec.wants(p, prompt_len) for p in range(first, first + length))
    assert spec.count(first, first + length, prompt_len) == wanted


@given(
    st.sampled_from(["last_prompt", "all_prompt", "all_generated", "all", "set"]),
    st.integers(0, 24),
    st.integers(1, 10),
    st.frozensets(st.integers(0, 20)),
)
def test_capture_ends_after_its_last_wanted_position(kind, end, prompt_len, chosen):
    """A request stops being watched for captures exactly when no later position is wanted
    (positions past 64 stand for "unbounded": 'all' and 'all_generated' never end)."""
    spec = WorkerCapture("a", (SITE,), chosen if kind == "set" else kind)
    later = [p for p in range(end, 64) if spec.wants(p, prompt_len)]
    assert spec.ended(end, prompt_len) == (not later)


def test_capture_gathers_each_request_rows_once_per_site() -> None:
    last = WorkerCapture("a", (SITE,), "last_prompt")
    every = WorkerCapture("b", (SITE, "layers.0.output"), "all")
    spans = [RowSpan(0, 3, 0, 3), RowSpan(3, 5, 0, 2)]
    tables = build_capture_tables([(spans[0], last), (spans[1], every)])
    assert tables[SITE].rows.tolist() == [2, 3, 4]
    assert tables[SITE].parts == [("a", [2]), ("b", [0, 1])]
    assert tables["layers.0.output"].rows.tolist() == [3, 4]
    both = (SITE, "layers.0.output")  # sites the same requests capture share one table
    spans = [RowSpan(0, 3, 0, 3), RowSpan(3, 5, 0, 2), RowSpan(5, 6, 4, 4)]
    specs = [WorkerCapture(cid, both, "all") for cid in "xyz"]
    shared = build_capture_tables(list(zip(spans, specs)))
    assert shared[SITE] is shared["layers.0.output"]
    assert shared[SITE].rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert shared[SITE].rows_on(torch.device("cpu")) is shared[SITE].rows_on(torch.device("cpu"))
    assert last.count(0, 3, 3) == 1 and last.count(3, 4, 3) == 0
    assert WorkerCapture("c", (SITE,), "all_generated").count(2, 5, 3) == 2


def test_store_orders_positions_and_keeps_the_latest_recompute() -> None:
    spec = WorkerCapture("a", (SITE,), "all")
    store = CaptureStore()
    first = build_capture_tables([(RowSpan(0, 2, 0, 3), spec)])  # positions 0, 1
    store.record_site(SITE, first[SITE], torch.tensor([[0.0], [1.0]]))
    again = build_capture_tables([(RowSpan(1, 4, 0, 3), spec)])  # preempted: 0, 1, 2 again
    store.record_site(SITE, again[SITE], torch.tensor([[9.0], [10.0], [11.0], [12.0]]))
    block = store.take(["a"])[SITE]
    assert block["parts"] == [["a", [0, 1, 2]]]
    assert tensor_from_wire(block["values"]).flatten().tolist() == [10.0, 11.0, 12.0]
    assert store.take(["a"]) == {}


Step = list[tuple[str, str, list[int]]]  # one step: (site, capture id, positions) in batch order


def recorded(stores: dict[str, CaptureStore], steps: list[Step]) -> list[tuple]:
    """Record `steps` (each site in `stores[site]`) from values whose
    rows all differ and are gathered out of order; the (site, SiteCapture, value) recorded."""
    done = []
    for k, step in enumerate(steps):
        for site in dict.fromkeys(site for site, _, _ in step):
            parts = [(cid, positions) for s, cid, positions in step if s == site]
            n = sum(len(positions) for _, positions in parts)
            value = torch.arange((n + 2) * H, dtype=torch.float32).reshape(n + 2, H)
            value += 1000 * k + 100 * len(done)
            capture = SiteCapture(torch.randperm(n + 2)[:n], parts)
            stores[site].record_site(site, capture, value)
            done.append((site, capture, value))
    return done


def reference(done: list[tuple], capture_ids: list[str]) -> dict:
    """take + merge_captures by plain loops: per id and site its positions in order, each with
    the row that the last step recording it gathered."""
    latest: dict = {}
    for site, capture, value in done:
        row = 0
        for cid, positions in capture.parts:
            for position in positions:
                if cid in capture_ids:
                    latest.setdefault(cid, {}).setdefault(site, {})[position] = value[
                        capture.rows[row]
                    ].tolist()
                row += 1
    return {
        cid: {site: (sorted(rows), [rows[p] for p in sorted(rows)]) for site, rows in sites.items()}
        for cid, sites in latest.items()
    }


def as_lists(merged: dict) -> dict:
    return {
        cid: {site: (rows["positions"], rows["values"].tolist()) for site, rows in sites.items()}
        for cid, sites in merged.items()
    }


def random_steps(seed: int) -> list[Step]:
    """Batches of ids in changing order, some at only some sites, positions often repeated.
    With an odd seed an id's positions in a step are one list at every site, as
    build_capture_tables records them (sites then share a layout in a take)."""
    rng = random.Random(seed)
    ids, sites = ["a", "b", "c", "d"], [SITE, "layers.0.output"]
    steps: list[Step] = []
    for _ in range(rng.randint(1, 6)):
        step: Step = []
        for cid in rng.sample(ids, rng.randint(1, len(ids))):
            shared = sorted(rng.sample(range(8), rng.randint(1, 3)))
            for site in sites:
                if cid != "d" or site == SITE:
                    own = sorted(rng.sample(range(8), rng.randint(1, 3)))
                    step.append((site, cid, shared if seed % 2 else own))
        steps.append(step)
    return steps


PREEMPTED: list[Step] = [
    [(SITE, "a", [0, 1, 2]), (SITE, "b", [0, 1]), (SITE, "c", [0, 1, 2, 3])]
    + [("layers.0.output", "a", [0, 1, 2]), ("layers.0.output", "b", [0, 1])],
    [(SITE, "b", [2]), (SITE, "a", [3]), (SITE, "c", [4])]
    + [("layers.0.output", "b", [2]), ("layers.0.output", "a", [3])]
    + [("layers.0.output", "d", [7, 9])],
    [(SITE, "b", [0, 1, 2]), (SITE, "a", [4])]  # b preempted and recomputed
    + [("layers.0.output", "b", [0, 1, 2]), ("layers.0.output", "a", [4])],
    [(SITE, "a", [5]), (SITE, "b", [3]), (SITE, "c", [2])]
    + [("layers.0.output", "a", [5]), ("layers.0.output", "b", [3])],
]


@pytest.mark.parametrize("one_store", [False, True])
@pytest.mark.parametrize("steps", [PREEMPTED] + [random_steps(seed) for seed in range(30)])
def test_take_gives_each_id_its_latest_rows_in_position_order(
    steps: list[Step], one_store: bool
) -> None:
    """One block per site for the ids taken, expanded in the front end, against plain loops:
    ids taken in any order and in several takes, latest row of a recomputed position. The
    sites are in one store (one worker: sites may share a layout) or in one each (PP)."""
    one = CaptureStore()
    stores = {SITE: one if one_store else CaptureStore(), "layers.0.output": one}
    done = recorded(stores, steps)
    for capture_ids, left in ((["c", "a"], ["c", "a"]), (["d", "b", "a"], ["d", "b"])):
        taken = [store.take(capture_ids) for store in stores.values()]
        for blocks in taken:
            for block in blocks.values():
                owners = [cid for cid, _ in block["parts"]]
                assert owners == [cid for cid in left if cid in owners]
        assert as_lists(merge_captures([*taken, {}])) == reference(done, left)
    assert all(store.take(["a", "b", "c", "d"]) == {} for store in stores.values())


def test_sites_of_one_capture_share_one_layout_per_take(monkeypatch) -> None:
    """Every site of a Capture is recorded for the same requests in the same steps: a take
    works out where their rows come from once, not once per site, and each site still gets
    its own values."""
    built = []
    original = capture_store._Layout.__init__

    def counting(self, *args):
        built.append(args)
        original(self, *args)

    monkeypatch.setattr(capture_store._Layout, "__init__", counting)
    both = (SITE, "layers.0.output")
    store = CaptureStore()
    for step, spans in enumerate(
        [[RowSpan(0, 3, 0, 3), RowSpan(3, 5, 0, 2)], [RowSpan(0, 1, 3, 3)]]
    ):
        specs = [WorkerCapture("a", both, "all"), WorkerCapture("b", both, "all")][: len(spans)]
        tables = build_capture_tables(list(zip(spans, specs)))
        for k, site in enumerate(both):
            value = torch.full((5, H), 10.0 * step + k) + torch.arange(5.0)[:, None]
            store.record_site(site, tables[site], value)
    merged = merge_captures([store.take(["b", "a"])])
    assert len(built) == 1
    assert merged["a"][SITE]["positions"] == [0, 1, 2, 3]
    assert merged["a"][SITE]["values"][:, 0].tolist() == [0.0, 1.0, 2.0, 10.0]
    assert merged["a"]["layers.0.output"]["values"][:, 0].tolist() == [1.0, 2.0, 3.0, 11.0]
    assert merged["b"]["layers.0.output"]["values"][:, 0].tolist() == [4.0, 5.0]


def test_decode_steps_follow_the_batch_as_it_changes() -> None:
    """Steps that repeat the last one's combination ids copy nothing; every other step
    (requests reordered, finished, unsteered) gets exactly its own rows steered."""
    state = SteeringPlanner(buffers(), ORDER, SaeRegistry("cpu", torch.float32))
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
        state.write(partial(list, [(r, i, i + 1) for i, r in enumerate(order)]), len(order))
        if step == 1:  # not copied again: the value planted after step 0 is still there
            assert int(state.buffers.token_combo[1]) == 7
            state.buffers.token_combo[1] = 0
        out = state.buffers(*site_index(SITE), torch.zeros(len(order), H))
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

    def decoded(wire: dict) -> WorkerSteering:
        return worker_steering(Steering.from_wire(wire), ORDER, H, {})

    assert decoded(wire(v)) is decoded(wire(v.clone()))
    assert decoded(wire(v)) is not decoded(wire(nudged))
    assert decoded(wire(v)) is not decoded(wire(v, scale=3.0))
    state = SteeringPlanner(buffers(), ORDER, SaeRegistry("cpu", torch.float32))
    same = [request(r, range(4, 5), 2, [decoded(wire(v))]) for r in "abc"]
    state.plan(same)
    assert state.plan_ is not None and len(state.plan_.key) == 2  # none, and the one spec


def test_sites_run_eagerly_while_a_cuda_graph_records_them_keep_every_op(monkeypatch) -> None:
    """vLLM's fused mixture-of-experts op is opaque to torch.compile and calls the router's
    gate inside it, so the router site runs eagerly, also while a CUDA graph records the step
    (when nothing is captured or steered): its gathers and steering must be recorded then, or
    every replay skips them. The capture is simulated here (the CPU has no CUDA graphs)."""
    from vinterp.engine.site_ops import SiteCalls
    from vinterp.engine.vllm_boundary.site_modules import _add_sites
    from vinterp.interventions import graph_recording

    experts, top_k = 6, 2
    order = SiteOrder(2, Router((1,), experts, top_k))
    logits_id, experts_id = (order[f"layers.1.mlp.router.{s}"] for s in ("output", "experts"))
    shapes = {logits_id: ((experts,), torch.float32), experts_id: ((top_k,), torch.long)}
    sites = [logits_id, experts_id]
    capture = CaptureBuffers(
        len(order.sites), frozenset(sites), sites, 4, H, torch.float32, "cpu", row_shapes=shapes
    )
    steer = SteerBuffers(len(order.sites), H, 16, 8, 8, torch.float32, "cpu")
    called = []
    calls = SiteCalls(site=lambda site_id, x: called.append(site_id), uncompiled=True)
    gate = torch.nn.Linear(H, experts, bias=False)
    io = {"output_id": logits_id, "experts_id": experts_id, "top_k": top_k}
    _add_sites(gate, steer, capture, calls, "forward", io)
    planner = SteeringPlanner(steer, order, SaeRegistry("cpu", torch.float32))
    spec = steering({"layers.1.output": torch.ones(H)}, 1.0, "all", None, False)
    assert not planner.plan([request("a", range(3), 0, [spec])])
    planner.write(lambda: [("a", 0, 3)], 3)
    layer_id = order["layers.1.output"]
    layer = torch.tensor([layer_id])
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    capture.write({site_id: torch.tensor([2, 0]) for site_id in sites})
    capture.active = steer.active = False  # the engine's state while vLLM captures its graphs

    monkeypatch.setattr(graph_recording, "_cuda_graphs_possible", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with torch.no_grad():
        logits = gate(x)
        steered = steer(layer_id, layer, x)
    assert torch.equal(capture.gathered(logits_id, 2), logits[[2, 0]])
    picked = torch.topk(logits[[2, 0]].softmax(-1), top_k).indices
    assert torch.equal(capture.gathered(experts_id, 2).sort(-1).values, picked.sort(-1).values)
    assert torch.equal(steered, x + 1.0)
    assert called == []  # Python handlers are never recorded into a graph

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    capture.write({})
    with torch.no_grad():  # an eager step that captures and steers nothing skips the ops
        gate(x + 1)
        assert torch.equal(steer(layer_id, layer, x), x)
    assert torch.equal(capture.gathered(logits_id, 2), logits[[2, 0]])


def test_capture_buffers_write_only_what_changed_and_clear_what_a_longer_step_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step naming fewer rows than the last zeroes the rest (a smaller batch stays in range);
    a step repeating the last one's rows (decoding) uploads nothing; sites without a buffer on
    this worker are never written."""
    from vinterp.interventions import capture_buffers

    site, stream, other = ORDER["layers.0.output"], ORDER["layers.1.output"], ORDER["embed.output"]
    bufs = CaptureBuffers(
        len(ORDER.sites), frozenset({site, stream}), [site, stream], 6, H, torch.float32, "cpu"
    )
    uploads = []
    real = capture_buffers.upload
    monkeypatch.setattr(
        capture_buffers, "upload", lambda dst, src: (uploads.append(len(src)), real(dst, src))
    )
    bufs.write({site: torch.tensor([5, 0, 2, 3]), other: torch.tensor([1])})
    assert bufs.index[site].tolist() == [5, 0, 2, 3, 0, 0] and bufs.index[other].abs().sum() == 0
    bufs.write({site: torch.tensor([1]), stream: torch.tensor([4, 4])})
    assert bufs.index[site].tolist() == [1, 0, 0, 0, 0, 0]
    assert bufs.index[stream].tolist() == [4, 4, 0, 0, 0, 0]
    count = len(uploads)
    bufs.write({site: torch.tensor([1]), stream: torch.tensor([4, 4])})  # the same again
    assert len(uploads) == count
    bufs.write({})
    assert bufs.index.abs().sum() == 0


@given(
    st.one_of(
        st.sampled_from(["last_prompt", "all_prompt", "all_generated", "all"]),
        st.lists(st.integers(0, 40), max_size=12),
    ),
    st.integers(0, 30),
    st.integers(0, 20),
    st.integers(1, 30),
)
def test_the_positions_a_capture_wants_in_a_step_are_those_it_selects_one_by_one(
    positions: object, first: int, count: int, prompt_len: int
) -> None:
    """`WorkerCapture.wanted` (a range for named selectors) picks exactly the positions of the
    step's window that `wants` picks one at a time, in order."""
    selector = positions if isinstance(positions, str) else frozenset(positions)
    cap = WorkerCapture("c", ("layers.0.output",), selector)
    window = range(first, first + count)
    assert list(cap.wanted(first, count, prompt_len)) == [
        p for p in window if cap.wants(p, prompt_len)
    ]


def test_an_engine_without_steering_in_its_graph_steers_in_uncompiled_steps(monkeypatch) -> None:
    """`steering_in_graph=False`: what a graph records at a site is the value unchanged, even
    with a steered request's tables loaded; every step that steers is planned uncompiled and
    steered there as on an engine with the formula; an unsteered step stays compiled."""
    from vinterp.interventions import graph_recording

    buffers = SteerBuffers(len(ORDER.sites), H, 16, 8, 8, torch.float32, "cpu", in_graph=False)
    planner = SteeringPlanner(buffers, ORDER, SaeRegistry("cpu", torch.float32))
    site_id, site = site_index(SITE)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    assert not planner.plan([])
    assert planner.plan([request("a", range(3), 3, [steer("all")])])  # uncompiled
    planner.write(lambda: [("a", 0, 3)], 3)
    assert torch.equal(buffers(site_id, site, x), x + 2.0)

    monkeypatch.setattr(graph_recording, "_cuda_graphs_possible", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert torch.equal(buffers(site_id, site, x), x)  # nothing recorded
    with_formula = SteerBuffers(len(ORDER.sites), H, 16, 8, 8, torch.float32, "cpu")
    compiled = SteeringPlanner(with_formula, ORDER, SaeRegistry("cpu", torch.float32))
    assert not compiled.plan([request("a", range(3), 3, [steer("all")])])
    compiled.write(lambda: [("a", 0, 3)], 3)
    assert torch.equal(with_formula(site_id, site, x), x + 2.0)  # recorded, and steered
