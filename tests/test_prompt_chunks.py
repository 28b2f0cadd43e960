"""A traced prompt computed in chunks, and a request computed again after a preemption, give
what one step gives: the worker's trace dispatch driven by a small causal model (no engine)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vinterp.interventions.specs import WorkerRequest
from vinterp.ir.graph import Block, Graph, Invoke, Node, ref
from vinterp.ir.plan import PlanError, make_plan
from vinterp.runtime.executor import TraceRun
from vinterp.runtime.request_tracking import TrackedRequest
from vinterp.runtime.trace_dispatch import TraceDispatch
from vinterp.sites.names import Heads, SiteOrder

ORDER = SiteOrder(2)
SITES = ["embed.output", "layers.0.output", "layers.1.output"]
PROMPT = 40
STEPS = 6
H = 8


def _graph() -> Graph:
    """Step 0: a write at position 20 from position 5 of an earlier site, a mean over the
    prompt, saves before and after the write; steps 1..: a write of every generated row."""
    g = Graph(invokes=[Invoke(list(range(PROMPT)), {"max_tokens": STEPS})], blocks=[Block(1, None)])
    r0 = g.add(Node("read", "layers.0.output", [], {}, 0))
    early = g.add(Node("call", "op.getitem", [ref(r0), 5], {}, 0))
    r1 = g.add(Node("read", "layers.1.output", [], {}, 0))
    row = g.add(Node("call", "op.getitem", [ref(r1), 20], {}, 0))
    value = g.add(Node("call", "op.add", [ref(row), ref(early)], {}, 0))
    w = g.add(Node("write", "layers.1.output", [ref(value), 20], {}, 0))
    mean = g.add(Node("call", "Tensor.mean", [ref(w), 0], {}, 0))
    after = g.add(Node("read", "layers.1.output", [], {}, 0))
    gen = g.add(Node("read", "layers.0.output", [], {}, 0, block=0))
    doubled = g.add(Node("call", "op.mul", [ref(gen), 2.0], {}, 0, block=0))
    g.add(Node("write", "layers.0.output", [ref(doubled)], {}, 0, block=0))
    last = g.add(Node("read", "layers.1.output", [], {}, 0, block=0))
    g.saves = [r0, mean, after, gen, last]
    return g


class CausalToy:
    """Each site's row at position p: the previous site's row plus the mean of that site's
    rows at positions <= p (kept like a KV cache, as the trace left them)."""

    def __init__(self, dispatch: TraceDispatch) -> None:
        self.dispatch = dispatch
        self.kept: dict[str, torch.Tensor] = {}
        weights = torch.Generator().manual_seed(0)
        self.embedding = torch.randn(PROMPT + STEPS, H, generator=weights)

    def forward(self, first: int, count: int) -> None:
        x = self.embedding[first : first + count]
        for k, site in enumerate(SITES):
            if k:
                before = self.kept[SITES[k - 1]][:first]
                history = torch.cat([before, x])
                x = x + history.cumsum(0)[first:] / torch.arange(1, first + count + 1)[first:, None]
            new = self.dispatch.at_site(site, x)
            x = x if new is None else new
            self.kept[site] = torch.cat([self.kept.get(site, x.new_zeros(0, H))[:first], x])

    def forget(self, keep: int) -> None:
        """A preemption: the cache holds only the first `keep` positions (prefix cache)."""
        self.kept = {site: rows[:keep] for site, rows in self.kept.items()}


def _run(chunks: list[int], preempt_at: int | None = None, cached: int = 0) -> dict:
    """The trace over the prompt in `chunks`, then its generated steps; with `preempt_at`, the
    request is preempted after that many generated steps and computed again from `cached`."""
    dispatch = TraceDispatch(ORDER, torch.device("cpu"), {}, None, True, torch.nn.Module())
    graph = _graph()
    run = dispatch.traces["t"] = TraceRun(graph, make_plan(graph, ORDER), {})
    toy = CausalToy(dispatch)
    specs = WorkerRequest([], [], None, ("t", 0))

    def step(first: int, count: int) -> None:
        dispatch.clear_step()
        dispatch.add_slot(TrackedRequest(PROMPT, first, specs), 0, 0, count)
        toy.forward(first, count)

    first = 0
    for count in chunks:
        step(first, count)
        first += count
    for generated in range(1, STEPS):
        if generated - 1 == preempt_at:
            toy.forget(cached)
            step(cached, first - cached + 1)  # the recompute ends with the next position
        else:
            step(first, 1)
        first += 1
    assert run.failure is None, run.failure
    return run.results()


def _chunks(sizes: list[int]) -> list[int]:
    out, left = [], PROMPT
    for size in sizes:
        if left == 0:
            break
        out.append(min(size, left))
        left -= out[-1]
    return [*out, left] if left else out


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for node, value in want.items():
        if isinstance(value, list):
            assert len(got[node]) == len(value)
            for g, w in zip(got[node], value):
                torch.testing.assert_close(g, w)
        else:
            torch.testing.assert_close(got[node], value)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, PROMPT), min_size=1, max_size=8))
def test_any_chunking_of_the_prompt_gives_the_one_step_values(sizes) -> None:
    _same(_run(_chunks(sizes)), _run([PROMPT]))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, STEPS - 2), st.integers(0, PROMPT), st.integers(1, PROMPT))
def test_a_preempted_request_recomputed_keeps_the_writes(preempt_at, cached, chunk) -> None:
    """Recomputing after a preemption (from the start, or from a prefix-cache hit) replays the
    trace's written rows: later generated steps equal the unpreempted run's."""
    _same(_run(_chunks([chunk] * PROMPT), preempt_at, cached), _run([PROMPT]))


def test_without_the_replay_the_recomputed_request_differs() -> None:
    """The check above can fail: the rows the trace wrote change the positions after them."""
    plain = _run([PROMPT])
    dispatch_replay = TraceDispatch._replay
    try:
        TraceDispatch._replay = lambda self, site, x: None  # type: ignore[method-assign]
        got = _run([PROMPT], preempt_at=1, cached=0)
    finally:
        TraceDispatch._replay = dispatch_replay  # type: ignore[method-assign]
    gen = _graph().saves[-1]
    assert not torch.allclose(torch.stack(got[gen]), torch.stack(plain[gen]))


@pytest.mark.parametrize(
    "late",
    [
        lambda g, r: [Node("call", "op.getitem", [ref(r), -1], {}, 0)],  # out[0] = y[-1]
        lambda g, r: [Node("call", "Tensor.mean", [ref(r), 0], {}, 0)],  # out[0] = y.mean(0)
        lambda g, r: [Node("call", "Tensor.flip", [ref(r), 0], {}, 0)],  # out[0] = y.flip(0)
    ],
)
def test_a_write_from_a_later_position_is_refused(late) -> None:
    g = Graph(invokes=[Invoke(list(range(PROMPT)), {"max_tokens": 1})])
    r = g.add(Node("read", "layers.0.output", [], {}, 0))
    for node in late(g, r):
        value = g.add(node)
    g.add(Node("write", "layers.1.output", [ref(value), 0], {}, 0))
    with pytest.raises(PlanError, match="position 0") as info:
        make_plan(g, ORDER)
    assert info.value.out_of_order


def test_an_indexed_pattern_computes_only_the_rows_it_picks() -> None:
    """`llm.layers[i].attn.pattern[:, -1]` of a long prompt: the last query's row of every
    head, never the whole (heads, T, T) pattern (at 32k tokens it would not fit a GPU)."""
    from vinterp.sites.attention_pattern import Pattern, PatternMath

    class RowsOnly(Pattern):
        def full(self) -> torch.Tensor:
            raise AssertionError("the whole pattern was computed")

    g = Graph(invokes=[Invoke(list(range(PROMPT)), {"max_tokens": 1})])
    read = g.add(Node("read", "layers.1.attn.pattern", [], {}, 0))
    index = {"tuple": True, "items": [{"slice": [None, None, None]}, -1]}
    row = g.add(Node("call", "op.getitem", [ref(read), index], {}, 0))
    g.saves = [row]
    order = SiteOrder(2, heads=Heads(heads=4, kv_heads=2, head_dim=8))
    run = TraceRun(g, make_plan(g, order), {})
    gen = torch.Generator().manual_seed(1)
    query, keys = torch.randn(PROMPT, 4, 8, generator=gen), torch.randn(PROMPT, 2, 8, generator=gen)
    pattern = RowsOnly(query, keys, torch.arange(PROMPT), PatternMath(scale=8**-0.5))
    run.at_site(0, 0, "layers.1.attn.pattern", pattern)
    assert run.failure is None, run.failure
    want = Pattern(query, keys, torch.arange(PROMPT), PatternMath(scale=8**-0.5)).full()[:, -1]
    torch.testing.assert_close(run.results()[row], want)
