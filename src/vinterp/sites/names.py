"""Standardized site names, their forward order and their glob patterns (API.md section 2).

`parse_site` is the one reader of the site-name grammar; everything else that needs a
name's layer or parts (specs, steering checks, the HF reference, raw hooks) asks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

LAYER_SITES = ("input", "attn.input", "attn.output", "mlp.input", "mlp.output", "output")
STEERABLE = ("input", "output", "attn.output", "mlp.output")  # parts of a layer
RAW_PREFIX = "raw."
# Layer indices are written as SiteOrder writes them (no leading zeros, ASCII digits), so a
# name that parses is one SiteOrder knows (or out of range).
_SITE_RE = re.compile(
    r"layers\.(?P<layer>0|[1-9][0-9]*|\*)\.(?:(?P<block>attn|mlp)\.)?(?P<io>input|output)"
    r"|(?P<module>embed|final_norm)\.output"
    r"|(?P<top>logits|samples)"
)
_RAW_RE = re.compile(r"raw\.(\w+(?:\.\w+)*)\.(input|output)")
SITES_HELP = (
    "sites are embed.output, layers.{i}.input|output, layers.{i}.attn.input|output, "
    "layers.{i}.mlp.input|output, final_norm.output, logits, samples"
)


class UnknownSiteError(KeyError, ValueError):
    """A site name that the model does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class SiteName:
    """The parts of a site name.

    `layers.3.attn.output`: kind "layer", layer 3, module "attn", value "output";
    `layers.3.output`: module "" (the block itself); `embed.output`: kind "model", module
    "embed"; `logits`: kind "model", module "", value "logits"; `raw.model.norm.output`:
    kind "raw", module "model.norm" (the engine's module path).
    """

    kind: Literal["layer", "model", "raw"]
    module: str
    value: str  # "input" | "output", or "logits" | "samples"
    layer: int | None = None  # None outside the layers and for `layers.*` in a pattern

    @property
    def part(self) -> str:
        """The name after `layers.{i}.` (`attn.output`), or the whole name of a model site."""
        return f"{self.module}.{self.value}" if self.module else self.value


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
    if match["io"]:
        layer = None if match["layer"] == "*" else int(match["layer"])
        return SiteName("layer", match["block"] or "", match["io"], layer)
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


def all_sites(num_layers: int) -> list[str]:
    """Every standardized site in forward order."""
    sites = ["embed.output"]
    for i in range(num_layers):
        sites.extend(f"layers.{i}.{s}" for s in LAYER_SITES)
    sites.extend(["final_norm.output", "logits", "samples"])
    return sites


RAW_POSITION = 1 << 30  # llm.raw sites: engine modules outside the standardized order


class SiteOrder:
    """Forward position of each site of a model with `num_layers` decoder blocks."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.sites = all_sites(num_layers)
        self.position = {name: i for i, name in enumerate(self.sites)}
        self._expanded: dict[str, tuple[str, ...]] = {}  # valid globs only: a few per model

    def __getitem__(self, site: str) -> int:
        if site in self.position:
            return self.position[site]
        if parse_site(site).kind == "raw":  # raises for a malformed name
            return RAW_POSITION
        raise UnknownSiteError(describe_unknown(site, self.num_layers))

    def expand(self, pattern: str) -> list[str]:
        """Sites matching a name or a glob over layer indices (`layers.*.output`), in order."""
        if pattern in self.position:  # a request's sites arrive expanded: no regex per site
            return [pattern]
        if pattern not in self._expanded:  # every request of a batch names the same glob
            regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
            found = tuple(s for s in self.sites if regex.match(s))
            if not found:
                raise UnknownSiteError(describe_unknown(pattern, self.num_layers))
            self._expanded[pattern] = found
        return list(self._expanded[pattern])


def describe_unknown(site: str, num_layers: int) -> str:
    """An error message that says what is wrong with a site name and what would be right."""
    try:
        parsed = parse_site(site, pattern=True)
    except UnknownSiteError as exc:
        return str(exc)
    if parsed.layer is not None and parsed.layer >= num_layers:
        return (
            f"site {site!r}: layer index {parsed.layer} is out of range; "
            f"this model has layers 0..{num_layers - 1}"
        )
    return f"unknown site {site!r}; {SITES_HELP}"
