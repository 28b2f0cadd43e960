"""A vinterp engine's own settings: one frozen object, checked once where the user gives them
(`EngineSettings.from_keywords`), carried to the workers in vLLM's `additional_config` and
read back there (`EngineSettings.of_config`), so the setting names live in this module only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vinterp.interventions.capture_buffers import (
    BufferSetting,
    RowsSetting,
    buffer_rows_setting,
    buffer_setting,
    buffer_site_ids,
)
from vinterp.interventions.feature_buffers import (
    SAE_STEERING_FEATURES,
    sae_steering_features_setting,
    sae_steering_host_ids,
    sae_steering_hosts_setting,
)
from vinterp.interventions.probe_buffers import probe_site_ids, probe_sites_setting
from vinterp.sites.modules import site_order

# Part of vLLM's compile-cache key: a model compiled without vinterp's site ops (or with an
# older layout of them) is never reused for an engine that needs them.
SITES_LAYOUT_VERSION = 14

# VINTERP_CHECK_APPLIED=1: every engine started without `check_applied` checks (the tests)
CHECK_APPLIED_ENV = "VINTERP_CHECK_APPLIED"

# The keys of `additional_config`; the first is present only in vinterp engines
_LAYOUT = "vinterp_sites"
_KEYS = {
    "site_paths": "vinterp_site_paths",
    "capture_buffers": "vinterp_capture_in_graph",
    "capture_rows": "vinterp_capture_rows",
    "check_applied": "vinterp_check_applied",
    "sae_steering_hosts": "vinterp_sae_steering_hosts",
    "sae_steering_features": "vinterp_sae_steering_features",
    "num_layers": "vinterp_num_layers",
    "probe_sites": "vinterp_probe_sites",
    "steering_in_graph": "vinterp_steering_in_graph",
}

# The keywords of `vinterp.LLM` that only a compiled model has (the HF backend drops them)
GRAPH_KEYWORDS = (
    "capture_in_graph",
    "capture_in_graph_rows",
    "check_applied",
    "sae_steering_hosts",
    "sae_steering_features",
    "probe_sites",
    "steering_in_graph",
)


@dataclass(frozen=True)
class EngineSettings:
    """What makes a vLLM engine a vinterp one (`vinterp.LLM`'s docstring says what each does):
    `capture_buffers` are the sites with capture buffers in the compiled model (True: every
    site), the SAE steering hosts among them; `steering_in_graph=False` leaves the steering
    formula out of the compiled model (an engine that only extracts)."""

    site_paths: Mapping[str, str] = field(default_factory=dict)
    capture_buffers: bool | tuple[str, ...] = False
    capture_rows: RowsSetting = None
    check_applied: bool = False
    sae_steering_hosts: tuple[str, ...] = ()
    sae_steering_features: int = SAE_STEERING_FEATURES
    num_layers: int | None = None
    probe_sites: tuple[str, ...] = ()
    steering_in_graph: bool = True

    @classmethod
    def from_keywords(
        cls,
        engine_kwargs: dict[str, Any],
        site_paths: Mapping[str, str] | None = None,
        config: Any = None,
    ) -> EngineSettings:
        """Takes vinterp's keywords out of `engine_kwargs` (the rest are vLLM's) and checks
        them, against the model's sites when `config` (its HF configuration) is given: a
        wrong one raises before any engine starts, naming the setting."""
        check_applied = engine_kwargs.pop("check_applied", None)
        if check_applied is None:
            check_applied = os.environ.get(CHECK_APPLIED_ENV, "") not in ("", "0")
        hosts = tuple(sae_steering_hosts_setting(engine_kwargs.pop("sae_steering_hosts", None)))
        buffers = buffer_setting(engine_kwargs.pop("capture_in_graph", False))
        settings = cls(
            dict(site_paths or {}),
            _with_host_buffers(buffers, hosts),
            buffer_rows_setting(engine_kwargs.pop("capture_in_graph_rows", None)),
            bool(check_applied),
            hosts,
            sae_steering_features_setting(
                engine_kwargs.pop("sae_steering_features", SAE_STEERING_FEATURES)
            ),
            engine_kwargs.pop("num_layers", None),
            tuple(probe_sites_setting(engine_kwargs.pop("probe_sites", None))),
            engine_kwargs.pop("steering_in_graph", True),
        )
        check_steering_in_graph(settings)
        if config is not None:
            order = site_order(config)
            buffer_site_ids(settings.capture_setting, order)
            sae_steering_host_ids(list(hosts), order)
            probe_site_ids(list(settings.probe_sites), order)
        return settings

    @property
    def capture_setting(self) -> BufferSetting:
        """`capture_buffers` as `interventions.capture_buffers` takes it."""
        buffers = self.capture_buffers
        return buffers if isinstance(buffers, bool) else list(buffers)

    def to_config(self) -> dict[str, Any]:
        """vLLM's `additional_config` (JSON; part of the compile-cache key) for these
        settings."""
        values = {
            "site_paths": dict(self.site_paths),
            "capture_buffers": self.capture_setting,
            "capture_rows": self.capture_rows,
            "check_applied": self.check_applied,
            "sae_steering_hosts": list(self.sae_steering_hosts),
            "sae_steering_features": self.sae_steering_features,
            "num_layers": self.num_layers,
            "probe_sites": list(self.probe_sites),
            "steering_in_graph": self.steering_in_graph,
        }
        return {_LAYOUT: SITES_LAYOUT_VERSION, **{_KEYS[k]: v for k, v in values.items()}}

    @classmethod
    def of_config(cls, additional_config: Mapping[str, Any] | None) -> EngineSettings | None:
        """The settings a vinterp engine was started with (its workers read them here); None
        for an engine without vinterp."""
        config = additional_config or {}
        if _LAYOUT not in config:
            return None
        values = {k: config[key] for k, key in _KEYS.items() if key in config}
        buffers = values.get("capture_buffers", False)
        return cls(
            values.get("site_paths") or {},
            buffers if isinstance(buffers, bool) else tuple(buffers),
            values.get("capture_rows"),
            bool(values.get("check_applied", False)),
            tuple(values.get("sae_steering_hosts") or ()),
            values.get("sae_steering_features", SAE_STEERING_FEATURES),
            values.get("num_layers"),
            tuple(values.get("probe_sites") or ()),
            bool(values.get("steering_in_graph", True)),
        )


def check_steering_in_graph(settings: EngineSettings) -> None:
    """`steering_in_graph` checked: a bool, and True where SAE steering hosts or probe sites
    are named (their formulas are part of the steering formula)."""
    value = settings.steering_in_graph
    if not isinstance(value, bool):
        raise TypeError(f"steering_in_graph={value!r}: give True or False")
    if value:
        return
    parts = {"sae_steering_hosts": settings.sae_steering_hosts, "probe_sites": settings.probe_sites}
    for name, sites in parts.items():
        if sites:
            raise ValueError(
                f"{name}: its formula is part of the steering formula, which "
                "steering_in_graph=False leaves out of the compiled model; drop one of the two"
            )


def _with_host_buffers(buffers: BufferSetting, hosts: tuple[str, ...]) -> bool | tuple[str, ...]:
    """The capture buffers of an engine whose SAE steering hosts are `hosts`: each host gets
    one, so capturing (and extracting) its features gathers the host's rows in the compiled
    model and such steps stay compiled; without it every step that captures features runs
    uncompiled (8B shape on an H200: 4.35x plain generation for a top-k capture at every
    position)."""
    if isinstance(buffers, bool) and (buffers or not hosts):
        return buffers
    return tuple(dict.fromkeys([*(buffers or []), *hosts]))
