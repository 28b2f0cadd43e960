"""Engine settings that name sites (`sae_steering_hosts`, `probe_sites`), as the engine's
config carries them (JSON)."""

from __future__ import annotations


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
