"""Forward-order planning: when each node can run, which invokes must run first, and where.

Every value's producer site is known from the graph, so an impossible order (a write that
needs a value the forward computes later) is found before anything is sent, and invokes that
consume other invokes' values are put in later engine rounds instead of hoping the scheduler
batches them together.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from vinterp.ir.graph import STEP_ZERO, Graph, Node, node_inputs
from vinterp.ir.positions import prompt_dependence, refusal
from vinterp.sites.names import RAW_POSITION, SiteOrder, is_pattern, is_read_only
from vinterp.sites.params import parse_param

ANY_TIME = -1  # anchor of values that need no site (user tensors)
MODEL_MODULE_CALLS = ("model.final_norm", "model.lm_head")
FIRST_SITE = "embed.output"


class PlanError(ValueError):
    """A graph that cannot run in forward order; `line` is the user's file:line."""

    def __init__(self, message: str, line: str = "", out_of_order: bool = False) -> None:
        super().__init__(f"{line}: {message}" if line else message)
        self.line = line
        self.out_of_order = out_of_order


@dataclass
class Plan:
    anchors: list[int]
    rounds: list[list[int]]
    schedule: dict[tuple[int, str], list[int]] = field(default_factory=dict)


def _same_step_context(graph: Graph, consumer: int, producer: int) -> bool:
    """Whether the producer's value is made in the same forward step as the consumer runs."""
    c, p = graph.nodes[consumer].block, graph.nodes[producer].block
    if c == p:
        return True
    return p == STEP_ZERO and graph.blocks[c].contains(0)


def make_plan(graph: Graph, sites: SiteOrder, last_stage_start: int | None = None) -> Plan:
    """`last_stage_start`: under pipeline parallelism, the first layer of the last stage.
    Model functions and parameter reads run where their module is (final norm and lm_head on
    the last stage, a layer's weights with the layer), so they are anchored there."""
    anchors: list[int] = []
    staged = last_stage_start is not None
    last_stage = sites[f"layers.{last_stage_start}.input"] if staged else ANY_TIME
    depends_on: dict[int, set[int]] = defaultdict(set)
    for node_id, node in enumerate(graph.nodes):
        if node.kind == "const":
            anchors.append(ANY_TIME)
            continue
        site_pos = sites[node.target] if node.kind in ("read", "write") else ANY_TIME
        if node.kind == "write" and is_read_only(node.target):
            raise PlanError(
                f"{node.target} is read-only: the expert ids follow from the router's logits; "
                "write layers.{i}.mlp.router.output to change the routing",
                node.line,
            )
        if site_pos == RAW_POSITION:
            if node.kind == "write":
                raise PlanError("llm.raw sites are read-only; write a standardized site", node.line)
            anchors.append(RAW_POSITION)
            continue
        inputs_at = ANY_TIME
        latest_input = None
        for producer in node_inputs(node):
            p_node = graph.nodes[producer]
            if anchors[producer] == RAW_POSITION:
                raise PlanError(
                    "values of llm.raw sites can only be saved (index them after the trace)",
                    node.line,
                )
            if p_node.block != STEP_ZERO and p_node.block != node.block:
                raise PlanError(
                    "a value from a tr.iter block can only be used inside that block "
                    "(save it there to get one tensor per step)",
                    node.line,
                )
            if p_node.invoke not in (-1, node.invoke):
                if p_node.invoke > node.invoke:
                    raise PlanError("an invoke cannot use a value of a later invoke", node.line)
                depends_on[node.invoke].add(p_node.invoke)
            if _same_step_context(graph, node_id, producer) and anchors[producer] > inputs_at:
                inputs_at, latest_input = anchors[producer], producer
        if staged and node.kind == "call":
            owner = _owner_position(node, sites, last_stage)
            if owner > inputs_at:
                inputs_at, latest_input = owner, node_id
        if node.kind == "write" and inputs_at > site_pos:
            producer_site = sites.sites[inputs_at]
            hint = " (llm.final_norm, llm.lm_head and its weight are on the last pipeline stage)"
            owned_late = staged and inputs_at == last_stage
            raise PlanError(
                f"the write to {node.target} needs a value from {producer_site}, which the "
                f"forward pass computes later (node {latest_input})" + (hint if owned_late else ""),
                node.line,
                out_of_order=True,
            )
        anchors.append(max(site_pos, inputs_at))
    _check_positions(graph, sites)
    plan = Plan(anchors=anchors, rounds=_rounds(len(graph.invokes), depends_on))
    for node_id, node in enumerate(graph.nodes):
        if node.kind in ("read", "write") or node_id in graph.saves:
            if node.kind == "const":
                continue
            at = anchors[node_id]
            if at == RAW_POSITION:
                site = node.target
            else:
                site = FIRST_SITE if at == ANY_TIME else sites.sites[at]
            plan.schedule.setdefault((node.invoke, site), []).append(node_id)
    return plan


def _check_positions(graph: Graph, sites: SiteOrder) -> None:
    """Refuse a first-step write that needs a later position of its prompt than it writes:
    vLLM may compute the prompt in chunks, in position order (`ir.positions`)."""

    def row_ndim(site: str) -> int | None:
        if site in ("logits", "samples") or is_pattern(site) or sites[site] == RAW_POSITION:
            return None
        return len(sites.row_shape(site, 0))

    deps = prompt_dependence(graph, row_ndim)
    for node_id, node in enumerate(graph.nodes):
        why = refusal(graph, deps, node_id, row_ndim)
        if why is not None:
            raise PlanError(
                f"the write to {node.target} in the prompt's step needs a later position than "
                f"it writes ({why}). vLLM computes a long prompt in chunks, in position order "
                "(chunked prefill; max_num_batched_tokens sets the chunk), so a position already "
                "computed cannot take it. Compute the value in an earlier invoke of the same "
                "prompt and write it in a later one, or write it in tr.iter[1:] (the generated "
                "tokens)",
                node.line,
                out_of_order=True,
            )


def _owner_position(node: Node, sites: SiteOrder, last_stage: int) -> int:
    """Where the module a model function or parameter read needs first exists in the forward
    (pipeline stages hold only their own modules); ANY_TIME for plain operations."""
    if node.target in MODEL_MODULE_CALLS:
        return last_stage
    if node.target == "model.param":
        param = parse_param(str(node.args[0]), sites.num_layers)
        if param.layer is not None:
            return sites[f"layers.{param.layer}.input"]
        return sites["embed.output"] if param.module == "embed" else last_stage
    return ANY_TIME


def _rounds(num_invokes: int, depends_on: dict[int, set[int]]) -> list[list[int]]:
    """Group invokes into engine rounds: an invoke runs after every invoke it consumes."""
    level = [0] * num_invokes
    for invoke in range(num_invokes):  # dependencies always point to earlier invokes
        level[invoke] = max((level[d] + 1 for d in depends_on.get(invoke, ())), default=0)
    rounds: list[list[int]] = [[] for _ in range(max(level, default=-1) + 1)]
    for invoke, lv in enumerate(level):
        rounds[lv].append(invoke)
    return rounds
