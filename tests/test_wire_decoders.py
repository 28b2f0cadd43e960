"""Every decoder of data from another process or a client returns a value or raises its own
error with a message, whatever it is given (never AttributeError, TypeError, KeyError...),
and none of them runs code or unpickles on the way (`no_code_from_data`).

Random bytes never get past a decoder's first check (DESIGN.md lesson 12), so these tests
start from valid inputs — graphs recorded by real traces, specs, captures, saved values — and
mutate their structure: drop, duplicate, swap and graft subtrees, rename ops and sites, nudge
indices and references out of range, put values of other JSON types anywhere. Most mutants
get deep into the decoders (checked by `test_mutants_get_past_the_first_checks`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import marshal
import math
import pickle
import random
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import vinterp
from vinterp.api.requests import Prepared
from vinterp.engine.vllm_boundary.parallel import last_stage_start
from vinterp.interventions.specs import decode_request
from vinterp.ir.graph import NODE_KINDS
from vinterp.ir.ops import ALL_OPS
from vinterp.ir.plan import PlanError, make_plan
from vinterp.serve.client_limits import ServeLimits
from vinterp.serve.fields import parse_field
from vinterp.serve.routes import BadRequest, decode_trace
from vinterp.sites.names import SiteOrder
from vinterp.wire.errors import WireError
from vinterp.wire.graph import from_wire, to_wire
from vinterp.wire.json_form import (
    captures_from_json,
    captures_to_json,
    payload_to_json,
    saved_from_json,
    saved_to_json,
)
from vinterp.wire.tensors import DTYPES, tensor_to_wire

NUM_LAYERS, HIDDEN = 4, 256  # the tiny llama's
ORDER = SiteOrder(NUM_LAYERS)
CONFIG = SimpleNamespace(num_hidden_layers=NUM_LAYERS, hidden_size=HIDDEN)
V = torch.randn(HIDDEN)
NAMES = (
    *sorted(ALL_OPS)[::9],
    *("os.system", "Tensor.__reduce__", "model.params"),
    *SiteOrder(NUM_LAYERS + 1).sites,
    *("layers.01.output", "layers.*.output", "layers.1.output\n", "layers.-1.input"),
    *("raw.model.norm.output", "raw.x", "raw.", "raw.model.layers.0.output"),
    *("lm_head.weight", "layers.3.mlp.up_proj.weight", "layers.9.self_attn.q_proj.weight"),
    *("layers.0.mlp.q_proj.weight", "embed", *NODE_KINDS, "exec", *DTYPES, "int8", "object"),
    *("last_prompt", "all", "memory", "filesystem", "decode", "max_tokens", "vectors"),
    *("tensor", "__b64__", "AAAA", "AAAAAAAA", "not base64!", "", "calm", "never-registered"),
    *("self", "cls"),
)
ODD_VALUES = (
    *(None, True, False, 0, 1, -1, 2, 3, 2**31, 2**63, -(2**70), 0.5, -0.0, math.nan, math.inf),
    *("", [], {}, [[[]]], [0, 1], [2**62, 2**62, 2**62], [0, 2**40, 2**40], [0, 2**64], [1] * 99),
    *({"ref": 0}, {"ref": 10**9}, {"ref": True}, {"ref": "0"}, {"slice": [None, None, None]}),
    *({"slice": 3}, {"slice": [{"ref": 2}, None, {}]}, {"dtype": "float32"}, {"dtype": ["a"]}),
    *({"ellipsis": True}, {"list": True, "items": [{"ref": -1}]}, {"tuple": True, "items": {}}),
    *({"tensor": {}}, {"__b64__": "AAAA"}, {"__b64__": 7}, {"__b64__": "A"}),
)
KEYS = ("self", "cls", "", "x", "ref", "items", "tensor", "__b64__", "vectors", "sites", "scale")
BYTES_VALUES = (b"", b"\0" * 3, bytearray(8))  # only the in-process wire carries bytes


# -- the mutator ---------------------------------------------------------------------------
def _places(value: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """Every place in a nested structure: (path to the container, key or index)."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return []
    places = []
    for key, child in items:
        places.append((path, key))
        places.extend(_places(child, (*path, key)))
    return places


def _at(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def _nudged(old: Any, rnd: random.Random) -> Any:
    """A near miss of a value: off-by-one indices, truncated bytes, edited names."""
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return old + rnd.choice([-2, -1, 1, 2, 1 << 40])
    if isinstance(old, (bytes, bytearray)):
        return rnd.choice([old[:-1], old + b"\0", old[::-1]])
    if isinstance(old, str):
        return rnd.choice([old[:-1], old + "x", old.upper(), old + "=", old + ".output"])
    if isinstance(old, float):
        return rnd.choice([-old, old * 1e300, math.nan])
    return [old]


def _retyped(old: Any, rnd: random.Random) -> Any:
    """A value of another JSON type where the decoder expects `old`'s."""
    return rnd.choice([None, True, 0, -1, 1.5, "x", [], {}, [old], {"x": old}, [[old]]])


def _pick_place(root: Any, rnd: random.Random) -> tuple[tuple, Any]:
    """A place chosen evenly among kinds of places (the path with list indices as `*`, and
    the value's type; the value itself and its top-level fields are one kind), so a rare
    field (a dtype inside an argument) is hit as often as a common one (a prompt's token)."""
    kinds: dict[tuple, list[tuple[tuple, Any]]] = {}
    for path, key in _places(root):
        value = _at(root, path)[key]
        kind = (*("*" if isinstance(k, int) else k for k in (*path, key)), type(value).__name__)
        kinds.setdefault(kind if len(path) > 1 else ("top",), []).append((path, key))
    return rnd.choice(kinds[rnd.choice(sorted(kinds, key=str))])


OPS = ("retype",) * 3 + ("odd", "graft", "rename", "nudge", "delete", "dup", "rekey", "swap")


def mutated(value: Any, rnd: random.Random, odd_values: tuple[Any, ...]) -> tuple[Any, list]:
    """A copy of `value` with one to four structural changes, and what they were."""
    root, done = [copy.deepcopy(value)], []  # in a list, so the value itself can be replaced
    for _ in range(rnd.choice([1, 1, 1, 2, 3, 4])):
        if not root:
            return None, [*done, "deleted everything"]
        path, key = _pick_place(root, rnd)
        parent = _at(root, path)
        old = parent[key]
        op = rnd.choice(OPS)
        if op == "retype":
            parent[key] = _retyped(copy.deepcopy(old), rnd)
        elif op == "odd":
            parent[key] = copy.deepcopy(rnd.choice(odd_values))
        elif op == "graft":  # a valid-looking value from elsewhere
            other_path, other_key = rnd.choice(_places(root))
            parent[key] = copy.deepcopy(_at(root, other_path)[other_key])
        elif op == "rename":
            parent[key] = rnd.choice(NAMES)
        elif op == "nudge":
            parent[key] = _nudged(old, rnd)
        elif op == "delete":
            del parent[key]
        elif op == "dup" and isinstance(parent, list):
            parent.insert(rnd.randrange(len(parent) + 1), copy.deepcopy(old))
        elif op in ("dup", "rekey") and isinstance(parent, dict):  # a new or renamed field
            if op == "rekey":
                del parent[key]
            parent[rnd.choice(rnd.choice([KEYS, NAMES]))] = copy.deepcopy(old)
        elif isinstance(parent, list):  # swap, or rekey in a list: two items change places
            other = rnd.randrange(len(parent))
            parent[key], parent[other] = parent[other], old
        else:  # swap in a dict: the value one level deeper
            parent[key] = rnd.choice([[old], {"items": old}, {"ref": old}, {"tensor": old}])
        done.append(f"{op} at {[*path, key][1:]}")
    return (root[0] if root else None), done


class CodeFromData(BaseException):
    """A decoder reached pickle, marshal, eval, exec or compile (not an Exception, so no
    decoder's error handling can swallow it)."""


_GUARDED = threading.local()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Python's audit events while a decoder runs: unpickling a class, unmarshalling, and
    running or compiling code that comes from no file (a string: what eval and exec run;
    imports run code from their modules' files)."""
    if not getattr(_GUARDED, "on", False):
        return
    if event in ("pickle.find_class", "marshal.loads", "marshal.load"):
        raise CodeFromData(f"{event}{args!r:.200}")
    if event == "exec" and str(getattr(args[0], "co_filename", "<?>")).startswith("<"):
        raise CodeFromData(f"exec of {args[0]!r:.200}")
    if event == "compile" and str(args[1]).startswith("<"):
        raise CodeFromData(f"compile of {args[0]!r:.200}")


sys.addaudithook(_audit)  # cannot be removed: it acts only inside no_code_from_data


def _refuse(name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise CodeFromData(f"{name} called")

    return refused


@contextlib.contextmanager
def no_code_from_data() -> Iterator[None]:
    """Every way to run code or unpickle fails while the block runs: pickle's and torch's
    loaders refuse, and the audit hook catches what reaches the interpreter by other routes
    (eval, exec, compile of a string, an unpickled class)."""
    with pytest.MonkeyPatch.context() as patch:
        for module, name in (
            (pickle, "loads"),
            (pickle, "load"),
            (pickle, "Unpickler"),
            (marshal, "loads"),
            (torch, "load"),
            (numpy, "load"),
        ):
            patch.setattr(module, name, _refuse(f"{module.__name__}.{name}"))
        _GUARDED.on = True
        try:
            yield
        finally:
            _GUARDED.on = False


def returns_or_raises(
    decode: Callable[..., Any], *args: Any, errors: tuple[type[Exception], ...] = (WireError,)
) -> Any:
    """The decoder's result, or None when it raised one of its own errors with a message;
    any other exception fails the test, as does running code or unpickling on the way."""
    try:
        with no_code_from_data():
            return decode(*args)
    except errors as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return None


@pytest.mark.parametrize(
    "reach",
    [
        lambda: pickle.loads(pickle.dumps(1)),
        lambda: pickle.Unpickler(io.BytesIO(pickle.dumps(SimpleNamespace()))).load(),
        lambda: eval("1 + 1"),
        lambda: exec("x = 1", {}),
        lambda: compile("1", "<client>", "eval"),
        lambda: torch.load(io.BytesIO()),
        lambda: marshal.loads(marshal.dumps(1)),
    ],
)
def test_the_guard_catches_every_way_to_run_code(reach: Callable[[], Any]) -> None:
    with pytest.raises(CodeFromData), no_code_from_data():
        reach()


# -- valid inputs --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph_wires(engines, tiny_llama) -> list[dict[str, Any]]:
    """Wire forms of graphs recorded by real traces (run on the HF backend): every node
    kind, argument encoding, tensor dtype, blocks, cross-invoke values, raw sites."""
    llm = engines.hf(tiny_llama)
    v = torch.randn(HIDDEN)
    with llm.trace(max_tokens=3, use_tqdm=False) as big:
        with big.invoke("The capital of France is"):
            clean = llm.layers[1].output[-1].save()
            llm.logits.softmax(dim=-1).topk(2).indices.save()
            llm.lm_head(llm.final_norm(llm.layers[0].output[-1])).save()
            llm.lm_head.weight[0].save()
            llm.layers[0].self_attn.q_proj.weight[:2, ...].save()
            llm.layers[2].mlp.input[torch.tensor([0, 1])].save()
            torch.cat([clean, clean]).reshape([2, -1]).save()
            llm.raw.model.norm.output.save()
        with big.invoke("Once upon a time", temperature=0.0):
            llm.layers[1].output[-1] = clean
            llm.layers[0].mlp.output = llm.layers[0].mlp.output * 0.5 + v
            llm.layers[0].attn.output[..., :4].to(torch.float16).save()
            mask = llm.embed.output > 0
            llm.layers[0].input = torch.where(mask, llm.layers[0].input, torch.zeros(HIDDEN))
            first = torch.tensor([True] + [False] * (HIDDEN - 1))
            llm.layers[3].attn.input.masked_fill(first, 0.0).save()
            for _ in big.iter[1:3]:
                llm.layers[1].output = llm.layers[1].output + torch.ones(HIDDEN).double()
                llm.samples.save()
            llm.final_norm.output.norm(dim=-1, keepdim=True).save()
    with llm.trace("Hello", max_tokens=1, use_tqdm=False) as small:
        llm.layers[2].output.save()
    return [to_wire(big.graph), to_wire(small.graph)]


FIELD = {
    "steering": [
        vinterp.Steering(
            {"layers.1.output": torch.randn(HIDDEN), "layers.2.mlp.output": torch.randn(HIDDEN)},
            scale=2.5,
            phase="decode",
            positions=[0, 2],
            norm_match=True,
        ).to_json(),
        "calm",
    ],
    "capture": vinterp.Capture(["layers.*.output", "embed.output"], positions=[0, 1]).to_json(),
}
V_WIRE = tensor_to_wire(V)
WORKER_PAYLOAD = (
    Prepared(
        [1, 2, 3],
        {},
        steering=[
            vinterp.Steering({"layers.1.output": V}, phase="prefill", positions=[1]),
            vinterp.Steering({"layers.2.mlp.output": V, "layers.0.input": -V}, norm_match=True),
        ],
        steering_names=["calm"],
        capture=vinterp.Capture(["layers.*.output"], positions="all"),
        capture_sites=["layers.0.output", "embed.output"],
        capture_id="c0ffee",
    )
    .specs()
    .to_wire()
)
SAVED = saved_to_json(
    [
        torch.randn(2, 3),
        [torch.arange(4), torch.tensor([True, False])],
        torch.tensor(1.5).bfloat16(),
        torch.empty(0, 4, dtype=torch.float64),
        3,
        None,
    ]
)
CAPTURES = captures_to_json({"layers.0.output": torch.randn(3, 8), "embed.output": torch.empty(0)})


# -- the properties --------------------------------------------------------------------------
def _decode_and_plan(wire: Any, stages: int) -> None:
    graph = returns_or_raises(from_wire, wire, ORDER)
    if graph is not None:
        plan = last_stage_start(NUM_LAYERS, stages)
        returns_or_raises(make_plan, graph, ORDER, plan, errors=(PlanError,))


@settings(max_examples=400, deadline=None)
@given(rnd=st.randoms(use_true_random=False), stages=st.sampled_from([1, 2]))
def test_mutated_graphs_decode_or_raise_wire_errors(graph_wires, rnd, stages) -> None:
    """The in-process path (engine workers): from_wire, then planning, on raw bytes."""
    wire, done = mutated(rnd.choice(graph_wires), rnd, ODD_VALUES + BYTES_VALUES)
    note(done)
    _decode_and_plan(wire, stages)


@settings(max_examples=300, deadline=None)
@given(rnd=st.randoms(use_true_random=False), stages=st.sampled_from([1, 2]))
def test_mutated_trace_requests_get_clear_errors(graph_wires, rnd, stages) -> None:
    """The server's path for POST /v1/vinterp/trace: JSON (base64 bytes) -> graph -> plan."""
    body, done = mutated({"graph": payload_to_json(rnd.choice(graph_wires))}, rnd, ODD_VALUES)
    note(done)
    limit = ServeLimits()
    errors = (BadRequest, WireError, PlanError)
    returns_or_raises(decode_trace, body, CONFIG, stages, limit, errors=errors)


@settings(max_examples=800, deadline=None)
@given(rnd=st.randoms(use_true_random=False))
def test_mutated_vinterp_fields_get_clear_errors(rnd) -> None:
    """The `vinterp` body field of completions: steering and capture specs in JSON."""
    value, done = mutated(FIELD, rnd, ODD_VALUES)
    note(done)
    returns_or_raises(parse_field, value, CONFIG, {"calm"})


@settings(max_examples=400, deadline=None)
@given(rnd=st.randoms(use_true_random=False))
def test_mutated_worker_payloads_decode_or_raise_wire_errors(rnd) -> None:
    """What a vLLM worker decodes from a request's extra args (steering and capture)."""
    value, done = mutated(WORKER_PAYLOAD, rnd, ODD_VALUES + BYTES_VALUES)
    note(done)
    returns_or_raises(decode_request, value, ORDER, HIDDEN, {})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p["steering"][0]["vectors"].update({"layers.4.output": V_WIRE}), "out of range"),
        (
            lambda p: p["steering"][0]["vectors"].update({"layers.1.mlp.input": V_WIRE}),
            "cannot be steered",
        ),
        (lambda p: p["steering"][0].update(scale=math.inf), "finite number"),
        (lambda p: p["steering"][0].update(positions=[-1]), "positions are >= 0"),
        (lambda p: p["capture"].update(sites=["layers.7.output"]), "out of range"),
        (lambda p: p["capture"].update(positions="first"), "capture.positions"),
    ],
)
def test_bad_worker_payloads_name_the_problem(change, message) -> None:
    payload = copy.deepcopy(WORKER_PAYLOAD)
    change(payload)
    with pytest.raises(WireError, match=re.escape(message)):
        decode_request(payload, ORDER, HIDDEN, {})
    hidden = copy.deepcopy(WORKER_PAYLOAD)
    hidden["steering"][1]["vectors"]["layers.0.input"] = WORKER_PAYLOAD["steering"][0]["vectors"][
        "layers.1.output"
    ] | {"shape": [HIDDEN // 2], "data": b"\0" * (HIDDEN * 2)}
    with pytest.raises(WireError, match="hidden size is 256"):
        decode_request(hidden, ORDER, HIDDEN, {})


@settings(max_examples=300, deadline=None)
@given(rnd=st.randoms(use_true_random=False), captures=st.booleans())
def test_mutated_saved_values_and_captures_get_clear_errors(rnd, captures) -> None:
    """What a Client decodes from the server's answers."""
    value, done = mutated(CAPTURES if captures else SAVED, rnd, ODD_VALUES)
    note(done)
    returns_or_raises(captures_from_json if captures else saved_from_json, value)


def test_mutants_get_past_the_first_checks(graph_wires) -> None:
    """The mutants above are worth running: most of them reach a node, tensor, invoke or
    save check or decode in full (and then reach the planner); few stop at the header
    (random data would almost all stop there)."""
    outcomes: Counter[str] = Counter()
    for seed in range(400):
        rnd = random.Random(seed)
        wire, _ = mutated(rnd.choice(graph_wires), rnd, ODD_VALUES + BYTES_VALUES)
        try:
            from_wire(wire, ORDER)
            outcomes["decoded"] += 1
        except WireError as exc:
            outcomes[str(exc).split(" ")[0]] += 1
    deep = sum(outcomes[first] for first in ("node", "tensor", "block", "invoke", "save"))
    header = sum(outcomes.values()) - deep - outcomes["decoded"]
    assert outcomes["decoded"] >= 30, outcomes
    assert deep + outcomes["decoded"] >= 320, outcomes
    assert header <= 50, outcomes


@pytest.mark.parametrize(
    "field, message",
    [
        ({"steering": vinterp.Steering({"layers.9.output": V}).to_json()}, "layer 9 is out of"),
        ({"steering": vinterp.Steering({"layers.1.output": V[:3]}).to_json()}, "hidden size is"),
        ({"steering": ["calm", "never-registered"]}, "no steering named 'never-registered'"),
        ({"capture": {"sites": ["layers.9.output"]}}, "layer index 9 is out of range"),
        ({"capture": {"sites": ["layers.1.output"], "sink": "logging"}}, "use 'memory'"),
        ({"steering": {"vectors": {}, "self": 1}}, "unknown fields"),
        ([], "expected {steering"),
    ],
)
def test_bad_fields_name_the_problem(field, message) -> None:
    """Cases the mutations above rarely build: specs that are valid JSON but do not fit the
    served model; each is a WireError (FieldError) that names the problem."""
    with pytest.raises(WireError, match=re.escape(message)):
        parse_field(field, CONFIG, {"calm"})
