"""SAE sites without an engine: their names, their forward position (the host's), and the wire
checks that keep a graph from reading them directly or calling the SAE at a wrong host."""

from __future__ import annotations

import pytest

from vinterp.ir.graph import Graph, Invoke, Node, ref
from vinterp.sites.names import SiteName, SiteOrder, UnknownSiteError, parse_site, sae_site
from vinterp.wire.errors import WireError
from vinterp.wire.graph import from_wire, to_wire


def test_sae_sites_parse_to_their_host() -> None:
    parsed = parse_site("layers.10.output.sae.features")
    assert parsed == SiteName("layer", "", "output", 10, "features")
    assert parsed.part == "output.sae.features" and parsed.host == "layers.10.output"
    assert parse_site("layers.2.mlp.output.sae.error").host == "layers.2.mlp.output"
    assert sae_site("layers.*.attn.output.sae.features").host == "layers.*.attn.output"
    assert sae_site("layers.10.output") is None and sae_site("nonsense") is None


def test_an_sae_site_is_at_its_host_in_the_forward_order() -> None:
    order = SiteOrder(4)
    assert order["layers.3.output.sae.features"] == order["layers.3.output"]
    assert order.expand("layers.*.input.sae.error") == [
        f"layers.{i}.input.sae.error" for i in range(4)
    ]
    with pytest.raises(UnknownSiteError, match="layer index 7 is out of range"):
        order["layers.7.output.sae.features"]


@pytest.mark.parametrize(
    "name", ["layers.1.attn.q.sae.features", "layers.1.mlp.router.output.sae.error"]
)
def test_sae_sites_follow_hidden_size_sites_only(name) -> None:
    with pytest.raises(UnknownSiteError, match="hidden-size rows"):
        parse_site(name)


def _graph(*nodes: Node) -> dict:
    return to_wire(Graph(nodes=list(nodes), invokes=[Invoke([1, 2], {})]))


def test_the_wire_refuses_direct_reads_of_sae_sites() -> None:
    wire = _graph(Node("read", "layers.1.output.sae.features", [], {}, 0))
    with pytest.raises(WireError, match="computed from its host site"):
        from_wire(wire, SiteOrder(4))


@pytest.mark.parametrize(
    "args, message",
    [
        ([ref(0)], "takes \\[value, host site name\\]"),
        ([ref(0), "embed.output"], "cannot hold a sparse autoencoder"),
        ([ref(0), "layers.9.output"], "layer index 9 is out of range"),
    ],
)
def test_the_wire_checks_the_host_of_sae_calls(args, message) -> None:
    read = Node("read", "layers.1.output", [], {}, 0)
    wire = _graph(read, Node("call", "model.sae_encode", args, {}, 0))
    with pytest.raises(WireError, match=message):
        from_wire(wire, SiteOrder(4))
    decode = Node("call", "model.sae_decode", [ref(0), "layers.1.output", ref(0)], {}, 0)
    good = _graph(read, decode)
    assert from_wire(good, SiteOrder(4)).nodes[1].target == "model.sae_decode"
