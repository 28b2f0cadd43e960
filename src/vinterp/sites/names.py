"""Standardized site names, their forward order and their glob patterns (API.md section 2)."""

from __future__ import annotations

import re

LAYER_SITES = ("input", "attn.input", "attn.output", "mlp.input", "mlp.output", "output")
_LAYER_RE = re.compile(
    r"^layers\.(\d+)\.(input|output|attn\.input|attn\.output|mlp\.input|mlp\.output)$"
)


class UnknownSiteError(KeyError, ValueError):
    """A site name that the model does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


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

    def __getitem__(self, site: str) -> int:
        if site.startswith("raw."):
            from vinterp.sites.raw import parse_raw

            parse_raw(site)
            return RAW_POSITION
        try:
            return self.position[site]
        except KeyError:
            raise UnknownSiteError(describe_unknown(site, self.num_layers)) from None

    def expand(self, pattern: str) -> list[str]:
        """Sites matching a name or a glob over layer indices (`layers.*.output`), in order."""
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        found = [s for s in self.sites if regex.match(s)]
        if not found:
            raise UnknownSiteError(describe_unknown(pattern, self.num_layers))
        return found


def describe_unknown(site: str, num_layers: int) -> str:
    """An error message that says what is wrong with a site name and what would be right."""
    match = _LAYER_RE.match(site)
    if match and int(match.group(1)) >= num_layers:
        return (
            f"site {site!r}: layer index {match.group(1)} is out of range; "
            f"this model has layers 0..{num_layers - 1}"
        )
    return (
        f"unknown site {site!r}; sites are embed.output, layers.{{i}}.input|output, "
        "layers.{i}.attn.input|output, layers.{i}.mlp.input|output, final_norm.output, "
        "logits, samples"
    )
