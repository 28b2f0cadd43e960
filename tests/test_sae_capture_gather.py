"""SAE sites captured through the compiled model's capture buffers, without an engine: the host
gathers the rows of every table computed from it (its own and its SAE sites', for different
requests), and the kept rows equal the uncompiled route's and the SAE applied by hand."""

from __future__ import annotations

import torch

from vinterp.interventions.capture_buffers import CaptureBuffers
from vinterp.interventions.capture_store import merge_captures
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.interventions.specs import WorkerCapture
from vinterp.interventions.tables import RowSpan, build_capture_tables, gather_plan
from vinterp.interventions.worker_state import WorkerInterventions
from vinterp.sae import SAE
from vinterp.sites.names import SiteOrder

ORDER = SiteOrder(2)
HOST = "layers.1.output"
FEATURES, ERROR = f"{HOST}.sae.features", f"{HOST}.sae.error"
H, D_SAE, TOPK = 8, 24, 3


def make_sae() -> SAE:
    g = torch.Generator().manual_seed(0)
    return SAE(
        "standard",
        torch.randn(H, D_SAE, generator=g),
        torch.randn(D_SAE, generator=g) * 0.5,
        torch.randn(D_SAE, H, generator=g),
        torch.randn(H, generator=g) * 0.3,
    )


def interventions(sae: SAE) -> WorkerInterventions:
    saes = SaeRegistry("cpu", torch.float32)
    saes.attach(HOST, sae)
    return WorkerInterventions(True, ORDER, H, saes)


# three requests of one step: a (rows 0..3, its prompt), b (rows 4..5) and c (row 6, decoding)
CAPTURES = [
    (RowSpan(0, 4, 0, 4), WorkerCapture("a", (HOST,), "all")),
    (RowSpan(4, 6, 0, 2), WorkerCapture("b", (FEATURES, ERROR), "all", topk=TOPK)),
    (RowSpan(6, 7, 5, 3), WorkerCapture("c", (HOST, FEATURES), "all", topk=TOPK)),
]


def kept(state: WorkerInterventions) -> dict:
    return merge_captures([state.store.take(["a", "b", "c"])])


def test_the_host_gathers_every_table_computed_from_it_and_keeps_what_the_handlers_keep() -> None:
    sae = make_sae()
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    host_id = ORDER[HOST]

    by_handlers = interventions(sae)  # the uncompiled route: Python at the host
    by_handlers.begin_capture_step(CAPTURES)
    by_handlers.record(HOST, x)

    in_graph = interventions(sae)
    in_graph.begin_capture_step(CAPTURES)
    rows = in_graph.gather_rows()
    assert list(rows) == [host_id] and rows[host_id].tolist() == list(range(7))  # each once
    buffers = CaptureBuffers(
        len(ORDER.sites), frozenset({host_id}), [host_id], 8, H, x.dtype, "cpu"
    )
    buffers.write(rows)
    buffers.active = True
    buffers(host_id, torch.tensor([host_id]), x)
    assert in_graph.keep_gathered(buffers) == [host_id]

    got, want = kept(in_graph), kept(by_handlers)
    assert {cid: set(sites) for cid, sites in got.items()} == {
        "a": {HOST},
        "b": {f"{FEATURES}.indices", f"{FEATURES}.values", ERROR},
        "c": {HOST, f"{FEATURES}.indices", f"{FEATURES}.values"},
    }
    for cid, sites in want.items():
        for site, block in sites.items():
            assert got[cid][site]["positions"] == block["positions"]
            assert torch.equal(got[cid][site]["values"], block["values"]), (cid, site)
    indices, values = sae.topk(x[4:6], TOPK)  # by hand
    assert torch.equal(got["b"][f"{FEATURES}.indices"]["values"], indices)
    torch.testing.assert_close(got["b"][f"{FEATURES}.values"]["values"], values)
    torch.testing.assert_close(
        got["b"][ERROR]["values"], x[4:6] - sae.decode(sae.encode(x[4:6]), x[4:6])
    )
    torch.testing.assert_close(got["c"][f"{FEATURES}.values"]["values"], sae.topk(x[6:7], TOPK)[1])
    torch.testing.assert_close(got["a"][HOST]["values"], x[:4])


def test_a_table_shared_by_the_host_and_its_sae_site_is_gathered_once() -> None:
    plan = gather_plan(build_capture_tables(CAPTURES[2:]), ORDER)
    assert list(plan.rows) == [ORDER[HOST]] and plan.rows[ORDER[HOST]].tolist() == [6]
    assert plan.picks == {HOST: (ORDER[HOST], None), FEATURES: (ORDER[HOST], None)}
