"""Standardized site names, their forward order and their glob patterns (API.md section 2).

`parse_site` is the one reader of the site-name grammar; everything else that needs a
name's layer or parts (specs, steering checks, the HF reference, raw hooks) asks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# The parts of a mixture-of-experts layer's router: its logits (T, experts) and the ids of
# the experts it picks per token (T, top_k), between the MLP's input and its output.
ROUTER_SITES = ("mlp.router.output", "mlp.router.experts")
# Attention per head, between the attention's input and output: queries, keys and values as
# attention uses them (after rotary embedding and any q/k norm; k and v with the kv heads),
# and each head's output before the output projection; (T, heads, head_dim) each.
HEAD_SITES = ("attn.q", "attn.k", "attn.v", "attn.heads")
# The attention probabilities of a step's queries over every key they attend to, (heads, T_q,
# T_k): computed from q and the keys when a trace reads them (`sites.attention_pattern`).
PATTERN = "attn.pattern"
LAYER_SITES = ("input", "attn.input", "attn.output", "mlp.input", "mlp.output", "output")
STEERABLE = ("input", "output", "attn.output", "mlp.output")  # parts of a layer
READ_ONLY_PARTS = ("mlp.router.experts", PATTERN)  # parts a trace reads but never writes
RAW_PREFIX = "raw."
# A sparse autoencoder attached at a layer site of hidden-size rows (`llm.attach_sae`) adds
# two sites after it: `<host>.sae.features` (T, d_sae) and `<host>.sae.error` (T, H), the
# reconstruction error; they are computed from the host's value (`interventions.sae_registry`).
SAE_HOSTS = LAYER_SITES
SAE_PARTS = ("features", "error")
# Layer indices are written as SiteOrder writes them (no leading zeros, ASCII digits), so a
# name that parses is one SiteOrder knows (or out of range).
_SITE_RE = re.compile(
    r"layers\.(?P<layer>0|[1-9][0-9]*|\*)\."
    r"(?P<part>(?:(?:attn|mlp)\.)?(?:input|output)|mlp\.router\.(?:output|experts)"
    r"|attn\.(?:q|k|v|heads|pattern))"
    r"(?:\.sae\.(?P<sae>features|error))?"
    r"|(?P<module>embed|final_norm)\.output"
    r"|(?P<top>logits|samples)"
)
_RAW_RE = re.compile(r"raw\.(\w+(?:\.\w+)*)\.(input|output)")
SITES_HELP = (
    "sites are embed.output, layers.{i}.input|output, layers.{i}.attn.input|output, "
    "layers.{i}.mlp.input|output, final_norm.output, logits, samples; per attention head "
    "layers.{i}.attn.q|k|v|heads|pattern; on mixture-of-experts models also "
    "layers.{i}.mlp.router.output|experts; with a sparse autoencoder attached at one of "
    "layers.{i}.input|output|attn.input|attn.output|mlp.input|mlp.output, that site "
    "followed by .sae.features|.sae.error"
)


class UnknownSiteError(KeyError, ValueError):
    """A site name that the model does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class SiteName:
    """The parts of a site name.

    `layers.3.attn.output`: kind "layer", layer 3, module "attn", value "output";
    `layers.3.output`: module "" (the block itself); `layers.3.mlp.router.experts`: module
    "mlp.router", value "experts"; `embed.output`: kind "model", module
    "embed"; `logits`: kind "model", module "", value "logits"; `raw.model.norm.output`:
    kind "raw", module "model.norm" (the engine's module path);
    `layers.3.output.sae.features`: as `layers.3.output` with sae "features".
    """

    kind: Literal["layer", "model", "raw"]
    module: str
    value: str  # "input", "output", "experts", "q", "k", "v", "pattern", "heads"; "logits", …
    layer: int | None = None  # None outside the layers and for `layers.*` in a pattern
    sae: str = ""  # "features" or "error" at a sparse autoencoder's site, else ""

    @property
    def part(self) -> str:
        """The name after `layers.{i}.` (`attn.output`, `output.sae.features`), or the whole
        name of a model site."""
        part = f"{self.module}.{self.value}" if self.module else self.value
        return f"{part}.sae.{self.sae}" if self.sae else part

    @property
    def host(self) -> str:
        """The name of the site an SAE site is computed from (`layers.3.output`); `*` for a
        glob's layer."""
        layer = "*" if self.layer is None else self.layer
        return f"layers.{layer}.{self.module + '.' if self.module else ''}{self.value}"


def parse_site(name: str, pattern: bool = False) -> SiteName:
    """The parts of a site name, for any model (the layer range is SiteOrder's to check);
    `pattern` also accepts `layers.*.…`. UnknownSiteError saying what names look like."""
    if name.startswith(RAW_PREFIX):
        raw = _RAW_RE.fullmatch(name)
        if raw is None:
            raise UnknownSiteError(
                f"raw site {name!r} must look like raw.<module path>.input or .output"
            )
        return SiteName("raw", raw.group(1), raw.group(2))
    match = _SITE_RE.fullmatch(name)
    if match is None or (match["layer"] == "*" and not pattern):
        raise UnknownSiteError(f"unknown site {name!r}; {SITES_HELP}")
    if match["part"]:
        layer = None if match["layer"] == "*" else int(match["layer"])
        module, _, value = match["part"].rpartition(".")
        if match["sae"] and match["part"] not in SAE_HOSTS:
            raise UnknownSiteError(
                f"site {name!r}: a sparse autoencoder's sites follow a site of hidden-size "
                f"rows: layers.{{i}}.{'|'.join(SAE_HOSTS)}"
            )
        return SiteName("layer", module, value, layer, match["sae"] or "")
    if match["module"]:
        return SiteName("model", match["module"], "output")
    return SiteName("model", "", match["top"])


def is_steerable(site: str) -> bool:
    """Whether steering may add at this site (a part of the residual stream of a layer)."""
    try:
        parsed = parse_site(site)
    except UnknownSiteError:
        return False
    return parsed.kind == "layer" and parsed.part in STEERABLE


def is_read_only(site: str) -> bool:
    """Whether a trace may only read this site (a router's expert ids follow from its logits)."""
    parsed = parse_site(site, pattern=True)
    return parsed.kind == "layer" and parsed.part in READ_ONLY_PARTS


def sae_site(site: str) -> SiteName | None:
    """The parts of an SAE site (`layers.3.output.sae.features`, a glob too); None for any
    other name, valid or not."""
    try:
        parsed = parse_site(site, pattern=True)
    except UnknownSiteError:
        return None
    return parsed if parsed.sae else None


def is_pattern(site: str) -> bool:
    """Whether a site name (or glob) names attention patterns."""
    return site.endswith("." + PATTERN)


@dataclass(frozen=True)
class Heads:
    """A model's attention heads, for the per-head sites: query heads, key/value heads
    (fewer under grouped-query attention) and the size of each."""

    heads: int
    kv_heads: int
    head_dim: int

    def of(self, part: str) -> int:
        """How many heads the part has: the kv heads for attn.k and attn.v."""
        return self.kv_heads if part in ("attn.k", "attn.v") else self.heads


@dataclass(frozen=True)
class Router:
    """A mixture-of-experts model's routers: the layers that have one, how many experts each
    chooses among and how many it picks per token."""

    layers: tuple[int, ...]
    experts: int
    top_k: int


def all_sites(
    num_layers: int, router: Router | None = None, heads: Heads | None = None
) -> list[str]:
    """Every standardized site in forward order (router sites at the layers that route,
    per-head sites and the attention pattern where the model has them)."""
    routed = frozenset(router.layers) if router else frozenset()
    per_head = (*HEAD_SITES[:3], PATTERN, HEAD_SITES[3]) if heads else ()
    attn = (LAYER_SITES[1], *per_head, LAYER_SITES[2])
    sites = ["embed.output"]
    for i in range(num_layers):
        mlp = (LAYER_SITES[3], *(ROUTER_SITES if i in routed else ()), LAYER_SITES[4])
        parts = (LAYER_SITES[0], *attn, *mlp, LAYER_SITES[5])
        sites.extend(f"layers.{i}.{s}" for s in parts)
    sites.extend(["final_norm.output", "logits", "samples"])
    return sites


RAW_POSITION = 1 << 30  # llm.raw sites: engine modules outside the standardized order


class SiteOrder:
    """Forward position of each site of a model with `num_layers` decoder blocks."""

    def __init__(
        self, num_layers: int, router: Router | None = None, heads: Heads | None = None
    ) -> None:
        self.num_layers = num_layers
        self.router = router
        self.heads = heads
        self.sites = all_sites(num_layers, router, heads)
        self.position = {name: i for i, name in enumerate(self.sites)}
        self._expanded: dict[str, tuple[str, ...]] = {}  # valid globs only: a few per model

    def __getitem__(self, site: str) -> int:
        """A site's forward position; an SAE site has its host's (it is computed there)."""
        if site in self.position:
            return self.position[site]
        parsed = parse_site(site)  # raises for a malformed name
        if parsed.kind == "raw":
            return RAW_POSITION
        if parsed.sae and parsed.host in self.position:
            return self.position[parsed.host]
        raise UnknownSiteError(describe_unknown(site, self))

    def expand(self, pattern: str) -> list[str]:
        """Sites matching a name or a glob over layer indices (`layers.*.output`), in order;
        an SAE site's glob expands over its host's (whether an SAE is attached there is the
        front end's and the workers' to check)."""
        if pattern in self.position:  # a request's sites arrive expanded: no regex per site
            return [pattern]
        sae = sae_site(pattern)
        if sae is not None:
            return [f"{host}.sae.{sae.sae}" for host in self.expand(sae.host)]
        if pattern not in self._expanded:  # every request of a batch names the same glob
            regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
            found = tuple(s for s in self.sites if regex.match(s))
            if not found:
                raise UnknownSiteError(describe_unknown(pattern, self))
            self._expanded[pattern] = found
        return list(self._expanded[pattern])

    def ids_of(self, parts: tuple[str, ...]) -> frozenset[int]:
        """The ids of every layer's sites among `parts` (e.g. HEAD_SITES)."""
        parsed = map(parse_site, self.sites)
        return frozenset(i for i, p in enumerate(parsed) if p.kind == "layer" and p.part in parts)

    def row_shape(self, site: str, hidden_size: int) -> tuple[int, ...]:
        """The shape of one token's row of a layer or embedding site: (hidden size,); at a
        router (experts,) for its logits or (top_k,) for their ids; at a per-head site
        (heads, head_dim), kv heads for k and v."""
        part = parse_site(site).part
        if self.router is not None and part in ROUTER_SITES:
            return (self.router.experts if part == "mlp.router.output" else self.router.top_k,)
        if self.heads is not None and part in HEAD_SITES:
            return (self.heads.of(part), self.heads.head_dim)
        return (hidden_size,)


def describe_unknown(site: str, order: SiteOrder) -> str:
    """An error message that says what is wrong with a site name and what would be right."""
    try:
        parsed = parse_site(site, pattern=True)
    except UnknownSiteError as exc:
        return str(exc)
    if parsed.layer is not None and parsed.layer >= order.num_layers:
        return (
            f"site {site!r}: layer index {parsed.layer} is out of range; "
            f"this model has layers 0..{order.num_layers - 1}"
        )
    if parsed.kind == "layer" and parsed.part in (*HEAD_SITES, PATTERN):
        return (
            f"site {site!r}: this model has no per-head attention sites "
            "(attn.q|k|v|heads|pattern): "
            "OPT's q is scaled before attention in transformers and inside it in vLLM, and "
            "models without a site map of vinterp's have none (API.md section 2)"
        )
    router = order.router
    if parsed.kind == "layer" and parsed.part in ROUTER_SITES:
        if router is None:
            return (
                f"site {site!r}: this model has no router; router sites exist on "
                "mixture-of-experts models only"
            )
        return (
            f"site {site!r}: layer {parsed.layer} has a dense MLP; the layers with a router "
            f"are {', '.join(map(str, router.layers))}"
        )
    return f"unknown site {site!r}; {SITES_HELP}"
