"""The graph, its wire format and forward-order planning, without an engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vinterp.ir.graph import Block, Graph, Invoke, Node, decode_arg, encode_arg, ref
from vinterp.ir.plan import PlanError, make_plan
from vinterp.runtime.executor import TraceRun
from vinterp.sites.names import SiteOrder, UnknownSiteError
from vinterp.wire.errors import WireError
from vinterp.wire.graph import from_wire, to_wire
from vinterp.wire.tensors import tensor_from_wire, tensor_to_wire

SITES = SiteOrder(4)


def _patching_graph() -> Graph:
    """Invoke 0 reads layer 2's output; invoke 1 writes it into its own layer 2 output."""
    g = Graph(invokes=[Invoke([1, 2, 3], {"max_tokens": 1}), Invoke([4, 5], {"max_tokens": 1})])
    read = g.add(Node("read", "layers.2.output", [], {}, 0))
    last = g.add(Node("call", "op.getitem", [ref(read), -1], {}, 0))
    g.tensors.append(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    const = g.add(Node("const", "", [0], {}, -1))
    scaled = g.add(Node("call", "op.mul", [ref(last), 2.0], {}, 1))
    g.add(Node("write", "layers.2.output", [ref(scaled), {"slice": [None, None, None]}], {}, 1))
    g.add(Node("call", "op.add", [ref(const), 1], {}, 1))
    g.saves = [last, 5]
    return g


def test_wire_round_trip_is_exact() -> None:
    graph = _patching_graph()
    back = from_wire(to_wire(graph), SITES)
    assert back.nodes == graph.nodes
    assert back.saves == graph.saves
    assert [i.prompt for i in back.invokes] == [[1, 2, 3], [4, 5]]
    assert torch.equal(back.tensors[0], graph.tensors[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensor_wire_keeps_dtype_and_values(dtype) -> None:
    t = (torch.arange(12) % 3).reshape(3, 4).to(dtype)
    assert torch.equal(tensor_from_wire(tensor_to_wire(t)), t)
    scalar = t[1, 1]  # 0-dim: what `.sum()` or `.item`-like reductions save
    back = tensor_from_wire(tensor_to_wire(scalar))
    assert back.shape == () and torch.equal(back, scalar)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda w: w["nodes"][1].__setitem__(1, "os.system"), "not allowed"),
        (lambda w: w["nodes"][1].__setitem__(2, [{"ref": 7}, -1]), "earlier node"),
        (lambda w: w["nodes"][0].__setitem__(1, "layers.9.output"), "out of range"),
        (lambda w: w["nodes"][0].__setitem__(0, "exec"), "unknown kind"),
        (lambda w: w["tensors"][0].__setitem__("data", b"123"), "3 bytes of data"),
        (lambda w: w["tensors"][0].__setitem__("dtype", "object"), "not allowed"),
        (lambda w: w["tensors"][0].update(shape=[0, 1 << 64], data=b""), "bad shape"),
        (lambda w: w["nodes"][1].__setitem__(2, [{"__reduce__": 1}]), "not a wire value"),
        (lambda w: w["nodes"][1].__setitem__(2, [{"dtype": ["float16"]}]), "dtype"),
        (lambda w: w["nodes"][1].__setitem__(2, [{"ref": True}]), "earlier node"),
        (lambda w: w["nodes"][0].__setitem__(1, "raw.x"), "raw.<module path>"),
        (lambda w: w["nodes"][1].__setitem__(1, "model.param"), "one parameter name"),
        (lambda w: w["nodes"][4][2].append(0), "a write's args"),
        (lambda w: w.__setitem__("version", True), "wire version"),
        (lambda w: w.__setitem__("version", 99), "wire version"),
        (lambda w: w.__setitem__("save", []), "unknown graph fields"),
    ],
)
def test_wire_rejects_what_is_not_allowed(mutate, message) -> None:
    """Each check names its problem (tests/test_wire_decoders.py mutates graphs at random)."""
    wire = to_wire(_patching_graph())
    mutate(wire)
    with pytest.raises(WireError, match=message):
        from_wire(wire, SITES)


@given(
    st.recursive(
        st.none() | st.integers() | st.floats(allow_nan=False) | st.booleans(),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.tuples(inner, inner)
            | st.builds(slice, inner, inner, inner)
        ),
        max_leaves=10,
    )
)
def test_arguments_round_trip(value) -> None:
    assert decode_arg(encode_arg(value, lambda obj: None), lambda r: None) == value


def test_plan_orders_invokes_by_dependency() -> None:
    plan = make_plan(_patching_graph(), SITES)
    assert plan.rounds == [[0], [1]]
    assert plan.schedule[(0, "layers.2.output")] == [0, 1]  # read, then the saved getitem
    assert plan.schedule[(1, "layers.2.output")] == [4]
    assert plan.schedule[(1, "embed.output")] == [5]  # needs only a user tensor


def test_plan_without_cross_invoke_values_is_one_round() -> None:
    g = Graph(invokes=[Invoke([1], {}), Invoke([2], {})])
    g.add(Node("read", "layers.1.output", [], {}, 0))
    g.add(Node("read", "layers.1.output", [], {}, 1))
    assert make_plan(g, SITES).rounds == [[0, 1]]


def test_plan_rejects_write_from_later_site() -> None:
    g = Graph(invokes=[Invoke([1], {})])
    late = g.add(Node("read", "layers.3.mlp.output", [], {}, 0, line="user.py:7"))
    g.add(Node("write", "layers.1.output", [ref(late)], {}, 0, line="user.py:8"))
    with pytest.raises(
        PlanError,
        match=r"user.py:8: the write to layers.1.output needs a value "
        r"from layers.3.mlp.output",
    ) as info:
        make_plan(g, SITES)
    assert info.value.out_of_order


def test_plan_allows_earlier_step_value_in_later_steps() -> None:
    g = Graph(invokes=[Invoke([1], {"max_tokens": 4})], blocks=[Block(1, 3)])
    late = g.add(Node("read", "layers.3.output", [], {}, 0))  # step 0
    g.add(Node("write", "layers.0.output", [ref(late)], {}, 0, block=0))  # steps 1..2
    assert make_plan(g, SITES).rounds == [[0]]


def test_plan_rejects_block_value_outside_block() -> None:
    g = Graph(invokes=[Invoke([1], {})], blocks=[Block(1, 3)])
    inside = g.add(Node("read", "layers.3.output", [], {}, 0, block=0))
    g.add(Node("call", "op.mul", [ref(inside), 2], {}, 0))
    with pytest.raises(PlanError, match="tr.iter block"):
        make_plan(g, SITES)


def test_site_order_and_globs() -> None:
    assert SITES["embed.output"] < SITES["layers.0.input"] < SITES["layers.0.attn.input"]
    assert SITES["layers.0.mlp.output"] < SITES["layers.0.output"] < SITES["layers.1.input"]
    assert SITES["layers.3.output"] < SITES["final_norm.output"] < SITES["logits"]
    assert SITES.expand("layers.*.output") == [f"layers.{i}.output" for i in range(4)]
    with pytest.raises(UnknownSiteError, match="unknown site 'layers.1.resid'"):
        SITES["layers.1.resid"]


def _cross_stage_graph() -> Graph:
    """Invoke 0 reads layer 0 and writes layer 3 from it; invoke 1 writes layer 2 from invoke
    0's layer-1 value. With stages split after layer 1, two values must travel forward."""
    g = Graph(invokes=[Invoke([1, 2], {}), Invoke([3, 4], {})])
    early = g.add(Node("read", "layers.0.output", [], {}, 0))
    doubled = g.add(Node("call", "op.mul", [ref(early), 2.0], {}, 0))
    g.add(Node("write", "layers.3.output", [ref(doubled)], {}, 0))
    source = g.add(Node("read", "layers.1.output", [], {}, 0))
    g.saves.append(source)
    g.add(Node("write", "layers.2.output", [ref(source)], {}, 1))
    return g


def test_stage_exports_are_the_values_a_later_stage_consumes() -> None:
    from vinterp.runtime.executor import TraceRun
    from vinterp.runtime.pipeline import exports_of

    order = SiteOrder(4)
    graph = _cross_stage_graph()
    run = TraceRun(graph, make_plan(graph, order), {})
    # stage 0 holds layers 0-1: invoke 0 sends its doubled value (not the raw read, which
    # only the mul on stage 0 consumes); invoke 1 needs invoke 0's layer-1 read
    assert exports_of(run, order["layers.1.output"]) == {0: [1], 1: [3]}
    assert exports_of(run, order["layers.2.output"]) == {0: [1]}  # a split after layer 2
    assert exports_of(run, order["layers.3.output"]) == {}  # nothing is consumed later


def test_plan_runs_model_functions_on_the_last_stage() -> None:
    order = SiteOrder(4)
    g = Graph(invokes=[Invoke([1, 2], {})])
    early = g.add(Node("read", "layers.0.output", [], {}, 0))
    lens = g.add(Node("call", "model.lm_head", [ref(early)], {}, 0))
    g.saves.append(lens)
    plan = make_plan(g, order)
    assert plan.schedule == {(0, "layers.0.output"): [0, 1]}
    staged = make_plan(g, order, last_stage_start=2)  # stages: layers 0-1 | 2-3
    assert staged.schedule[(0, "layers.2.input")] == [1]
    g.add(Node("write", "layers.1.output", [ref(lens)], {}, 0))
    make_plan(g, order)  # one device: the logit lens may steer a later layer
    with pytest.raises(PlanError, match="last pipeline stage") as info:
        make_plan(g, order, last_stage_start=2)
    assert info.value.out_of_order
    g.nodes[-1].target = "layers.2.output"  # on the last stage: allowed
    assert make_plan(g, order, last_stage_start=2).schedule[(0, "layers.2.output")] == [2]


def test_stage_values_travel_as_two_byte_tensors() -> None:
    """vLLM's CPU transport sends at most 8 tensors per step, tensors only: however many
    values cross, they go as one byte tensor and a byte index, and come back exact."""
    from vinterp.runtime.pipeline import DATA, INDEX, _from_bytes, _to_bytes

    values = {f"t:{k}:{k}": torch.randn(3, k + 1) for k in range(100)}
    values["t:0:500"] = torch.tensor(7)  # 0-dim, int
    values["t:0:501"] = torch.tensor([True, False])
    values["t:0:502"] = torch.randn(4).bfloat16()
    packed = _to_bytes(values)
    assert set(packed) == {DATA, INDEX}
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in packed.values())
    back = _from_bytes(packed[DATA], packed[INDEX])
    assert back.keys() == values.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in values.items())


def test_references_inside_slices_are_dependencies() -> None:
    """`x[a:b]` with traced bounds depends on the nodes of a and b (the planner orders by it)."""
    from vinterp.ir.graph import refs_in

    assert refs_in({"slice": [{"ref": 3}, None, {"ref": 5}]}) == [3, 5]
    assert refs_in([{"items": [{"slice": [None, {"ref": 7}, None]}]}]) == [7]


def test_an_invoke_works_at_the_steps_of_its_own_nodes_only() -> None:
    """Invoke 0 reads at step 0, invoke 1 in a tr.iter block over steps 2-3, invoke 2 has
    nothing; each generates 4 tokens (steps 0-3)."""
    g = Graph(invokes=[Invoke([1, 2], {"max_tokens": 4}) for _ in range(3)])
    g.blocks.append(Block(2, None))
    g.saves = [
        g.add(Node("read", "layers.1.output", [], {}, 0)),
        g.add(Node("read", "layers.3.output", [], {}, 1, block=0)),
    ]
    run = TraceRun(g, make_plan(g, SITES), {})
    works = {k: [s for s in range(6) if run.works_at(k, s)] for k in range(3)}
    assert works == {0: [0], 1: [2, 3], 2: []}


def _kernel_stand_in(weight: torch.Tensor):
    """What vLLM's CUDA norm and GEMM kernels accept: a contiguous (rows, H) matrix only."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            raise RuntimeError(f"kernel: expected a contiguous 2-D input, got {tuple(x.shape)}")
        return x @ weight.T

    return apply


@pytest.mark.parametrize(
    "index", [(-1,), (slice(-1, None),), (None,), (None, slice(None, None, 2))]
)
def test_model_functions_get_rows_whatever_the_value_s_shape(index) -> None:
    """`llm.unembed(layer.output[-1])` (1-D), `[-1:]` (2-D), a 3-D value and a strided view
    all reach the model functions as one contiguous (rows, H) matrix, as GPU kernels need."""
    from vinterp.runtime.executor import TraceRun

    order = SiteOrder(2)
    g = Graph(invokes=[Invoke([1, 2, 3, 4], {})])
    read = g.add(Node("read", "layers.1.output", [], {}, 0))
    key = index[0] if len(index) == 1 else index
    part = g.add(Node("call", "op.getitem", [ref(read), encode_arg(key, ref)], {}, 0))
    normed = g.add(Node("call", "model.final_norm", [ref(part)], {}, 0))
    lens = g.add(Node("call", "model.lm_head", [ref(normed)], {}, 0))
    g.saves.append(lens)
    norm_w, head_w = torch.randn(8, 8), torch.randn(5, 8)
    functions = {"final_norm": _kernel_stand_in(norm_w), "lm_head": _kernel_stand_in(head_w)}
    run = TraceRun(g, make_plan(g, order), functions)
    x = torch.randn(4, 8)
    run.at_site(0, 0, "layers.1.output", x)
    assert run.failure is None, run.failure
    part_value = x[index]
    want = part_value @ norm_w.T @ head_w.T
    got = run.results()[lens]
    assert got.shape == (*part_value.shape[:-1], 5)
    torch.testing.assert_close(got, want)
