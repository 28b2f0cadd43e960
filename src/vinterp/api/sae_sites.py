"""SAE sites in the front end: where `llm.attach_sae` may attach an SAE, and the SAE sites of a
trace (`llm.layers[i].output.sae.features`, `.sae.error`), recorded as what they mean on the
host site's value, so every backend runs them with the same two model
functions (`sae_encode`, `sae_decode`: `interventions.sae_registry`) and nothing new on the wire:

- features f = encode(x); error e = x - decode(f) (decode also takes x: an SAE that
  normalises its input at run time maps the reconstruction back with x's statistics);
- a write of features f' writes the host x' = x + (decode(f') - decode(f)): the features'
  contribution is replaced and the error term kept (x' - decode(f') = e);
- a write of error e' writes the host x' = decode(f) + e'.
"""

from __future__ import annotations

from typing import Any, Protocol

from vinterp.api.values import Value
from vinterp.sae import SAE
from vinterp.sites.modules import site_order
from vinterp.sites.names import SAE_HOSTS, SiteName, UnknownSiteError, parse_site, sae_site


def check_attachable(config: Any, site: str, sae: Any) -> None:
    """Refuse an SAE the site cannot hold, before any engine sees it: ValueError naming the
    problem (a site that does not exist or has no hidden-size rows, a width that differs)."""
    if not isinstance(sae, SAE):
        raise TypeError(f"attach_sae takes a vinterp.SAE, got {type(sae).__name__}")
    try:
        site_order(config)[site]
        parsed = parse_site(site)
    except UnknownSiteError as exc:
        raise ValueError(f"attach_sae: {exc}") from None
    if parsed.kind != "layer" or parsed.part not in SAE_HOSTS:
        raise ValueError(
            f"attach_sae: {site} cannot hold a sparse autoencoder; it attaches at a site of "
            f"hidden-size rows: layers.{{i}}.{'|'.join(SAE_HOSTS)}"
        )
    sae.check_width(int(config.hidden_size), site)


def check_sae_capture(saes: dict[str, Any], capture: Any, sites: list[str]) -> None:
    """A capture's SAE sites need an SAE at their host, and `topk` no more features than it
    has: ValueError naming the field."""
    for site in sites:
        parsed = sae_site(site)
        if parsed is None:
            continue
        sae = saes.get(parsed.host)
        if sae is None:
            raise ValueError(
                f"capture.sites: {site} needs a sparse autoencoder at {parsed.host}; call "
                f"llm.attach_sae({parsed.host!r}, sae) first"
            )
        if capture.topk is not None and capture.topk > sae.d_sae:
            raise ValueError(
                f"capture.topk: {capture.topk} is more than the {sae.d_sae} "
                f"features of the SAE at {parsed.host}"
            )


class SaeRecorder(Protocol):
    """The trace recording (`vinterp.api.trace.Trace`)."""

    def record_read(self, site: str) -> Value: ...

    def record_write(self, site: str, value: Any, index: Any = None) -> int: ...

    def record_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value: ...


def _encode(trace: SaeRecorder, x: Value, host: str) -> Value:
    return trace.record_call("model.sae_encode", (x, host), {})


def _decode(trace: SaeRecorder, features: Any, host: str, x: Value) -> Value:
    return trace.record_call("model.sae_decode", (features, host, x), {})


def read_sae_site(trace: SaeRecorder, site: str, parsed: SiteName) -> Value:
    """The value of an SAE site, from a read of its host."""
    x = trace.record_read(parsed.host)
    features = _encode(trace, x, parsed.host)
    if parsed.sae == "features":
        value = features
    else:
        reconstruction = _decode(trace, features, parsed.host, x)
        value = trace.record_call("op.sub", (x, reconstruction), {})
    value.site = site  # so that `value[i] = v` writes the site
    return value


def write_sae_site(
    trace: SaeRecorder, site: str, parsed: SiteName, value: Any, index: Any = None
) -> Value:
    """Write an SAE site through its host (module docstring); the site's new value."""
    host = parsed.host
    x = trace.record_read(host)
    features = _encode(trace, x, host)
    reconstruction = _decode(trace, features, host, x)
    if parsed.sae == "features":
        old = features
    else:
        old = trace.record_call("op.sub", (x, reconstruction), {})
    # `site[...] = value` also for a whole write: broadcast and cast as a site write is
    new = trace.record_call("op.index_put", (old, Ellipsis if index is None else index, value), {})
    if parsed.sae == "features":
        change = trace.record_call("op.sub", (_decode(trace, new, host, x), reconstruction), {})
        written = trace.record_call("op.add", (x, change), {})
    else:
        written = trace.record_call("op.add", (reconstruction, new), {})
    trace.record_write(host, written)
    new.site = site
    return new
