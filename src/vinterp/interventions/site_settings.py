"""Engine settings that name sites (`sae_steering_hosts`, `probe_sites`): as the engine's
config carries them (JSON), and the ids of the sites they name."""

from __future__ import annotations

from vinterp.sites.names import STEERABLE, SiteOrder, UnknownSiteError, is_steerable


def site_list_setting(name: str, value: object, compiled: str) -> list[str]:
    """`value` as a list of site names or globs (None: none); `compiled` says what runs at
    those sites in the compiled model, for the error a wrong type gets."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(
        f"{name}={value!r}: give the sites whose {compiled} runs in the compiled model, e.g. "
        "'layers.10.output' or ['layers.4.output', 'layers.*.mlp.output']"
    )


def steerable_site_ids(
    name: str, setting: list[str], order: SiteOrder, refusal: str
) -> frozenset[int]:
    """The ids of the sites `setting` names (names or globs); one that is not a site of the
    residual stream raises UnknownSiteError: "{name}: {site} {refusal} layers.{i}.<parts>"."""
    sites = [site for pattern in setting for site in order.expand(pattern)]
    for site in sites:
        if not is_steerable(site):
            raise UnknownSiteError(f"{name}: {site} {refusal} layers.{{i}}.{'|'.join(STEERABLE)}")
    return frozenset(map(order.__getitem__, sites))
