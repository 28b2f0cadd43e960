"""What makes a steering of SAE features unfit for the SAEs attached (API.md section 5,
"Sparse autoencoders"): one check, run by the front ends before a request is queued and by
the workers (and the HF backend) on what they receive."""

from __future__ import annotations

from collections.abc import Mapping

from vinterp.sae.model import SAE
from vinterp.wire.specs import Steering, feature_host


def feature_steering_misfit(
    steering: Steering, saes: Mapping[str, SAE], field_name: str = "steering"
) -> str | None:
    """The first problem with `steering.features` (None: it fits): a host without an SAE, a
    feature out of range, a clamp of a top-k SAE's feature."""
    for site, chosen in steering.features.items():
        where = f"{field_name}.features[{site!r}]"
        host = feature_host(site)
        sae = saes.get(host)
        if sae is None:
            return (
                f"{where}: no sparse autoencoder is attached at {host}; call "
                f"llm.attach_sae({host!r}, sae) first"
            )
        if steering.mode == "clamp" and sae.architecture == "topk":
            return (
                f"{where}: the SAE at {host} is a top-k SAE, whose features each depend on all "
                "of them; it cannot be clamped: use mode='add', or write the features in a trace"
            )
        for feature in chosen:
            try:
                sae.check_feature(feature)
            except ValueError as exc:
                return f"{where}: {exc}"
    return None
