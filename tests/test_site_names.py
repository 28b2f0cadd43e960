"""The site-name grammar (sites.names.parse_site) and what it decides: the forward order's
errors, which sites a Steering or a Capture accepts, where the HF reference reads a site,
which layers of a mixture-of-experts model have router sites, and which models have per-head
attention sites of which shapes."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import vinterp
from vinterp.models.tiny import tiny_config
from vinterp.sites.modules import heads_of, router_of, site_order
from vinterp.sites.names import (
    HEAD_SITES,
    Heads,
    Router,
    SiteName,
    SiteOrder,
    UnknownSiteError,
    all_sites,
    is_read_only,
    parse_site,
)
from vinterp.sites.raw import parse_raw

# The grammar as written before parse_site (an independent reference, not the code under
# test): the sets of steerable and capturable names must not change.
OLD_STEERABLE = re.compile(r"^layers\.(\d+)\.(input|output|attn\.output|mlp\.output)$")
OLD_CAPTURABLE = re.compile(
    r"^(embed\.output|final_norm\.output|"
    r"layers\.(\d+|\*)\.(input|output|attn\.input|attn\.output|mlp\.input|mlp\.output))$"
)
NAMES = [
    *all_sites(12),
    *(f"layers.*.{part}" for part in ("input", "attn.output", "mlp.input", "output")),
    *("layers.1*.output", "layers.*.*", "layers.1", "layers.x.output", "layers.1.resid"),
    *("embed.input", "final_norm.input", "lm_head.output", "logits.output", "embed", ""),
    *("raw.model.norm.output", "raw.model.layers.0.mlp.input", "raw.x", "raw."),
]
# Names the old regexes accepted that are no site (SiteOrder writes no leading zeros, `$`
# let a trailing newline through, `\d` any Unicode digit): a steering on them passed the
# checks and then failed in the engine's worker. They are refused now.
NOT_SITES = ["layers.01.output", "layers.1.output\n", "layers.\u0661.output", "layers.00.input"]


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("layers.3.attn.output", SiteName("layer", "attn", "output", 3)),
        ("layers.0.input", SiteName("layer", "", "input", 0)),
        ("embed.output", SiteName("model", "embed", "output")),
        ("logits", SiteName("model", "", "logits")),
        ("raw.model.layers.0.mlp.input", SiteName("raw", "model.layers.0.mlp", "input")),
    ],
)
def test_parse_site_gives_the_parts(name, parsed) -> None:
    assert parse_site(name) == parsed
    if parsed.kind == "layer":
        assert f"layers.{parsed.layer}.{parsed.part}" == name


def test_patterns_only_where_asked() -> None:
    assert parse_site("layers.*.mlp.output", pattern=True) == SiteName("layer", "mlp", "output")
    with pytest.raises(UnknownSiteError, match="unknown site 'layers.\\*.output'; sites are"):
        parse_site("layers.*.output")


def test_steerable_and_capturable_sites_are_unchanged() -> None:
    for name in NAMES:
        assert _steerable(name) == bool(OLD_STEERABLE.match(name)), name
        assert _capturable(name) == bool(OLD_CAPTURABLE.match(name)), name
    for name in NOT_SITES:
        assert not _steerable(name) and not _capturable(name), name
        with pytest.raises(UnknownSiteError, match="unknown site"):
            SiteOrder(4)[name]


def _steerable(name: str) -> bool:
    try:
        vinterp.Steering({name: torch.ones(2)})
    except ValueError as exc:
        assert "cannot be steered; use layers.{i}.input|output" in str(exc)
        return False
    return True


def _capturable(name: str) -> bool:
    try:
        vinterp.Capture([name])
    except ValueError as exc:
        assert "cannot be captured; use embed.output, final_norm.output" in str(exc)
        return False
    return True


@pytest.mark.parametrize(
    "name, message",
    [
        ("layers.9.output", "site 'layers.9.output': layer index 9 is out of range; this model"),
        ("layers.1.resid", "unknown site 'layers.1.resid'; sites are embed.output, layers.{i}"),
        ("raw.x", "raw site 'raw.x' must look like raw.<module path>.input or .output"),
        ("layers.01.output", "unknown site 'layers.01.output'; sites are"),
    ],
)
def test_unknown_sites_say_what_is_right(name, message) -> None:
    with pytest.raises(UnknownSiteError) as info:
        SiteOrder(4)[name]
    assert str(info.value).startswith(message)


def test_raw_sites_have_a_module_path() -> None:
    assert SiteOrder(4)["raw.model.norm.output"] > SiteOrder(4)["samples"]
    assert parse_raw("raw.model.norm.output") == ("model.norm", "output")
    with pytest.raises(UnknownSiteError, match="not a raw site"):
        parse_raw("layers.0.output")


ROUTER = Router(layers=(1, 3), experts=8, top_k=2)


def test_router_sites_sit_between_the_mlp_input_and_output_of_routing_layers() -> None:
    assert parse_site("layers.3.mlp.router.experts") == SiteName(
        "layer", "mlp.router", "experts", 3
    )
    order = SiteOrder(4, ROUTER)
    layer_1 = [s for s in order.sites if s.startswith("layers.1.")]
    assert layer_1[3:7] == [
        "layers.1.mlp.input",
        "layers.1.mlp.router.output",
        "layers.1.mlp.router.experts",
        "layers.1.mlp.output",
    ]
    assert order.expand("layers.*.mlp.router.output") == [
        "layers.1.mlp.router.output",
        "layers.3.mlp.router.output",
    ]
    assert order.row_shape("layers.1.mlp.router.output", 256) == (8,)
    assert order.row_shape("layers.1.mlp.router.experts", 256) == (2,)
    assert order.row_shape("layers.1.mlp.output", 256) == (256,)
    assert is_read_only("layers.1.mlp.router.experts")
    assert not is_read_only("layers.1.mlp.router.output")


@pytest.mark.parametrize(
    "order, name, message",
    [
        (SiteOrder(4), "layers.1.mlp.router.output", "this model has no router"),
        (SiteOrder(4), "layers.*.mlp.router.experts", "this model has no router"),
        (SiteOrder(4, ROUTER), "layers.0.mlp.router.output", "layer 0 has a dense MLP"),
        (SiteOrder(4, ROUTER), "layers.1.mlp.router.input", "unknown site"),
        (SiteOrder(4, ROUTER), "layers.1.attn.experts", "unknown site"),
    ],
)
def test_router_sites_on_a_model_without_them_say_why(order, name, message) -> None:
    with pytest.raises(UnknownSiteError, match=message):
        order.expand(name) if "*" in name else order[name]


def test_router_sites_are_captured_not_steered() -> None:
    assert not _steerable("layers.1.mlp.router.output")
    assert _capturable("layers.*.mlp.router.output") and _capturable("layers.1.mlp.router.experts")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_router_layers_are_those_transformers_builds_a_router_in(arch) -> None:
    """Qwen's MoE models keep dense MLPs in `mlp_only_layers` and off `decoder_sparse_step`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {"mlp_only_layers": [0], "decoder_sparse_step": 2} if "qwen" in arch else {}
    config_dict = tiny_config(arch, num_hidden_layers=4, **overrides)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = AutoModelForCausalLM.from_config(config)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate"))
    router = router_of(config)
    assert router is not None and router.layers == routed
    assert routed == ((1, 3) if "qwen" in arch else (0, 1, 2, 3))
    experts = model.model.layers[routed[0]].mlp.gate.weight.shape[0]
    assert (router.experts, router.top_k) == (experts, config.num_experts_per_tok)
    assert router_of(AutoConfig.for_model("llama")) is None


HEADS = Heads(heads=8, kv_heads=2, head_dim=32)


def test_head_sites_sit_between_the_attention_input_and_output() -> None:
    assert parse_site("layers.2.attn.heads") == SiteName("layer", "attn", "heads", 2)
    order = SiteOrder(3, ROUTER, HEADS)
    layer_1 = [s for s in order.sites if s.startswith("layers.1.")]
    assert layer_1 == [
        "layers.1.input",
        "layers.1.attn.input",
        "layers.1.attn.q",
        "layers.1.attn.k",
        "layers.1.attn.v",
        "layers.1.attn.pattern",
        "layers.1.attn.heads",
        "layers.1.attn.output",
        "layers.1.mlp.input",
        "layers.1.mlp.router.output",
        "layers.1.mlp.router.experts",
        "layers.1.mlp.output",
        "layers.1.output",
    ]
    assert order.expand("layers.*.attn.k") == [f"layers.{i}.attn.k" for i in range(3)]
    assert [order.row_shape(f"layers.0.{part}", 256) for part in HEAD_SITES] == [
        (8, 32),
        (2, 32),
        (2, 32),
        (8, 32),
    ]
    ids = order.ids_of(HEAD_SITES)
    assert sorted(order.sites[i] for i in ids) == sorted(
        f"layers.{i}.{part}" for i in range(3) for part in HEAD_SITES
    )
    assert not any(is_read_only(f"layers.0.{part}") for part in HEAD_SITES)
    assert is_read_only("layers.0.attn.pattern") and is_read_only("layers.*.attn.pattern")


@pytest.mark.parametrize("name", ["layers.1.attn.q", "layers.*.attn.heads"])
def test_head_sites_on_a_model_without_them_say_why(name) -> None:
    order = SiteOrder(4)
    with pytest.raises(UnknownSiteError, match="no per-head attention sites.*OPT's q is scaled"):
        order.expand(name) if "*" in name else order[name]
    with pytest.raises(UnknownSiteError, match="unknown site"):
        SiteOrder(4, heads=HEADS)["layers.1.attn.o"]


def test_head_sites_are_captured_not_steered_nor_extracted() -> None:
    from transformers import AutoConfig

    from vinterp.extraction.request import expand_sites

    for part in HEAD_SITES:
        assert not _steerable(f"layers.1.{part}") and _capturable(f"layers.*.{part}")
    llm = SimpleNamespace(config=AutoConfig.for_model("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match="attn.k is an attention head site, which extract"):
        expand_sites(llm.config, ["layers.1.output", "layers.*.attn.k"])


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "gemma3_text", "phi3", "gpt2", "gpt_neox", "mixtral", "olmoe"]
)
def test_head_counts_are_those_of_the_transformers_model(arch) -> None:
    """Each model's config names its heads its own way (gpt2's n_head, no kv heads or head
    size in some): the counts equal what transformers' attention module holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = tiny_config(arch)
    if arch in ("gpt2", "gpt_neox"):  # their configs name no head size and no kv heads
        del config_dict["head_dim"], config_dict["num_key_value_heads"]
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    attention = AutoModelForCausalLM.from_config(config).get_submodule(
        {"gpt2": "transformer.h.0.attn", "gpt_neox": "gpt_neox.layers.0.attention"}.get(
            arch, "model.layers.0.self_attn"
        )
    )
    heads = heads_of(config)
    assert heads is not None and site_order(config).heads == heads
    head_dim = getattr(attention, "head_dim", None) or attention.head_size
    groups = getattr(attention, "num_key_value_groups", 1)
    assert (heads.heads // heads.kv_heads, heads.head_dim) == (groups, head_dim)
    assert (heads.heads, heads.kv_heads) == (4, 4 if arch in ("gpt2", "gpt_neox") else 2)


def test_opt_has_no_head_sites() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model("opt", num_hidden_layers=2)
    assert heads_of(config) is None
    assert "layers.0.attn.q" not in site_order(config).sites
