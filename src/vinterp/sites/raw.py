"""`llm.raw.<module path>.input|output`: an engine module's own values, in native layout.

Read-only and save-only: native layouts differ per engine (tuples, merged qkv, padded
shards), so vinterp does not compute on them inside a trace. Hooks are installed for the
trace that names them and removed after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from vinterp.sites.names import RAW_PREFIX, UnknownSiteError, parse_site

RawCallback = Callable[[str, Any], None]


def is_raw(site: str) -> bool:
    return site.startswith(RAW_PREFIX)


def parse_raw(site: str) -> tuple[str, str]:
    """(module path, "input"|"output") of a raw site name, or UnknownSiteError."""
    parsed = parse_site(site)
    if parsed.kind != "raw":
        raise UnknownSiteError(f"{site!r} is not a raw site (raw.<module path>.input|output)")
    return parsed.module, parsed.value


def install_raw_hooks(model: nn.Module, sites: list[str], callback: RawCallback) -> list[Any]:
    """Hook the named modules of `model`; raises UnknownSiteError naming a missing path."""
    modules = dict(model.named_modules())
    for site in sites:
        path, _ = parse_raw(site)
        if path not in modules:
            near = [name for name in modules if name.endswith(path.rsplit(".", 1)[-1])][:3]
            raise UnknownSiteError(
                f"raw site {site!r}: the engine's model has no module {path!r}"
                + (f" (similar: {', '.join(near)})" if near else "")
            )
    handles = []
    for site in sites:
        path, which = parse_raw(site)
        module = modules[path]
        if which == "output":
            hook = (lambda s: lambda mod, args, out: callback(s, out))(site)
            handles.append(module.register_forward_hook(hook))
        else:
            hook = (lambda s: lambda mod, args: callback(s, args[0] if len(args) == 1 else args))(
                site
            )
            handles.append(module.register_forward_pre_hook(hook))
    return handles


def raw_sites_of(graph: Any) -> list[str]:
    return sorted({n.target for n in graph.nodes if n.kind == "read" and is_raw(n.target)})
