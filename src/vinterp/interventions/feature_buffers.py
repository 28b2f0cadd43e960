"""Steering in an SAE's feature basis inside the compiled model: clamp (set) or add to features.

A clamp of feature j to v at a host x is x + u(x) * (v - f_j(x)) * d_j (what a trace's write
of the features gives: decode(f') - decode(f)), an add x + u(x) * v * d_j; f_j is the SAE's
feature j of x (`SAE.encode`, its run-time normalisation included), d_j the row of the
decoder that `SAE.decode` applies to feature j, u(x) the scale by which decode undoes the
normalisation (1 without one). For standard and JumpReLU SAEs f_j needs encoder column j
only, so each host with steered features this step gets a slot holding just their columns:

    pre = norm(x) @ enc[s].T + bias[s]  (norm(x): normalised, minus b_dec if the SAE does)
    f = relu(pre) * (pre > threshold[s])
    c = where(clamp[row], value[row] - f, value[row])
    delta = u(x) * (c @ dec[s])

with s = site_slot[site] and row the token's table row at the site (the additive steering's
rows, `steer_buffers`). Slot 0 and row 0 are zero, so an unsteered token adds exactly 0.
Computed in float32 from persistent buffers of fixed shapes (allocated before graph capture).
Only the hosts named at engine start (`sae_steering_hosts`) carry the formula in the compiled
model, so every other site costs what it costs without an SAE; a step that steers features at
another host, or more features than the buffers hold, runs uncompiled with tables of the same
form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vinterp.interventions.host_to_device import upload
from vinterp.interventions.site_settings import site_list_setting, steerable_site_ids
from vinterp.sae import SAE
from vinterp.sae.model import LAYER_NORM_EPS
from vinterp.sites.names import SiteOrder

# `norm` codes: how a slot's SAE normalises its input at run time
NORMS = {"none": 0, "constant_norm_rescale": 1, "layer_norm": 2}
# The engine setting `sae_steering_features` by default: the features per host the compiled
# tables hold (the union a step steers at one host)
SAE_STEERING_FEATURES = 32


def sae_steering_features_setting(value: object) -> int:
    """The engine setting `sae_steering_features`, checked: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"sae_steering_features: the SAE features per host that steering's compiled tables "
            f"hold, an int >= 1 (default {SAE_STEERING_FEATURES}), not {value!r}"
        )
    return value


def sae_steering_hosts_setting(value: object) -> list[str]:
    """The engine setting `sae_steering_hosts`: the hosts whose SAE feature steering is
    compiled."""
    return site_list_setting("sae_steering_hosts", value, "SAE feature steering (clamp or add)")


def sae_steering_host_ids(setting: list[str], order: SiteOrder) -> frozenset[int]:
    """The ids of the `sae_steering_hosts` sites; a name that is not a site, or a site with no
    steering (an SAE host must be one), raises UnknownSiteError saying which are."""
    refusal = "cannot host feature steering; the hosts are"
    return steerable_site_ids("sae_steering_hosts", setting, order, refusal)


@dataclass
class FeatureTables:
    """The tensors the feature steering formula reads (module docstring)."""

    site_slot: torch.Tensor  # (sites,) int64
    norm: torch.Tensor  # (slots,) int64, NORMS
    enc: torch.Tensor  # (slots, R, H): encoder columns of the slot's features
    b_in: torch.Tensor  # (slots, H): subtracted from the normalised input (b_dec or 0)
    bias: torch.Tensor  # (slots, R): b_enc
    threshold: torch.Tensor  # (slots, R)
    dec: torch.Tensor  # (slots, R, H)
    value: torch.Tensor  # (rows, R)
    clamp: torch.Tensor  # (rows, R) bool

    @classmethod
    def zeros(
        cls, sites: int, slots: int, features: int, rows: int, hidden: int, device: torch.device
    ) -> FeatureTables:
        def z(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            z(sites, dtype=torch.long),
            z(slots, dtype=torch.long),
            z(slots, features, hidden),
            z(slots, hidden),
            z(slots, features),
            z(slots, features),
            z(slots, features, hidden),
            z(rows, features),
            z(rows, features, dtype=torch.bool),
        )

    def fill_slot(self, slot: int, sae: SAE, features: list[int]) -> None:
        """Slot `slot` holds `features` of `sae`, in that order (host-side tables; only those
        columns and rows are copied from the SAE's device)."""
        idx = torch.tensor(features, dtype=torch.long, device=sae.device)

        def to_cpu(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", torch.float32)

        n = len(features)
        self.norm[slot] = NORMS[sae.normalize_activations]
        if sae.architecture != "topk":  # a top-k SAE is only added to: no encoder needed
            self.enc[slot, :n] = to_cpu(sae.W_enc[:, idx].T)
            self.bias[slot, :n] = to_cpu(sae.b_enc[idx])
        if sae.apply_b_dec_to_input:
            self.b_in[slot] = to_cpu(sae.b_dec)
        if sae.threshold is not None:
            self.threshold[slot, :n] = to_cpu(sae.threshold[idx])
        dec = to_cpu(sae.W_dec[idx])
        if sae.rescale_acts_by_decoder_norm:
            dec = dec / dec.norm(dim=-1, keepdim=True)
        self.dec[slot, :n] = dec

    def fits(self, buffers: FeatureBuffers) -> bool:
        """Whether these (host) tables fit the persistent buffers: as many slots and features
        (the tables are built that wide), no more rows."""
        return self.enc.shape == buffers.enc.shape and len(self.value) <= len(buffers.value)

    def upload_to(self, buffers: FeatureTables) -> None:
        """Copy into the persistent buffers (their first rows: later rows are never read)."""
        for name in self.__dataclass_fields__:
            mine = getattr(self, name)
            upload(getattr(buffers, name)[: len(mine)], mine)

    def to(self, device: torch.device) -> FeatureTables:
        return FeatureTables(*(getattr(self, n).to(device) for n in self.__dataclass_fields__))


def feature_delta(
    t: FeatureTables, site: torch.Tensor, x: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """What the steered features add to the host rows x (T, H) at `site` (a one-element
    tensor), float32 (module docstring). Plain tensor ops: compiled and replayed as recorded."""
    s = t.site_slot[site]
    kind = t.norm[s]
    x = x.float()
    mean = x.mean(dim=-1, keepdim=True)
    std = (x - mean).std(dim=-1, keepdim=True)
    rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-30) / x.shape[-1] ** 0.5
    layer, rescale = kind == NORMS["layer_norm"], kind == NORMS["constant_norm_rescale"]
    shift = torch.where(layer, mean, 0.0)
    spread = torch.where(layer, std + LAYER_NORM_EPS, torch.where(rescale, rms, 1.0))
    undo = torch.where(layer, std, torch.where(rescale, rms, 1.0))
    pre = ((x - shift) / spread - t.b_in[s]) @ t.enc[s][0].T + t.bias[s]
    f = pre.relu() * (pre > t.threshold[s])
    value = t.value[rows]
    c = torch.where(t.clamp[rows], value - f, value)
    return (c @ t.dec[s][0]) * undo


class FeatureBuffers(nn.Module):
    """The persistent FeatureTables of the compiled `hosts`: `features` (R) per host slot, a slot
    per host (slot 0 stays zero), one value row per additive steering row."""

    def __init__(
        self,
        num_sites: int,
        hosts: frozenset[int],
        hidden_size: int,
        features: int,
        max_rows: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.hosts = hosts
        zeros = FeatureTables.zeros(
            num_sites, len(hosts) + 1, features, max_rows, hidden_size, device
        )
        for name in FeatureTables.__dataclass_fields__:
            self.register_buffer(name, getattr(zeros, name), persistent=False)

    @property
    def features(self) -> int:
        return self.enc.shape[1]

    def tables(self) -> FeatureTables:
        return FeatureTables(*(getattr(self, n) for n in FeatureTables.__dataclass_fields__))
