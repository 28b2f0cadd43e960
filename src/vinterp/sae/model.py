"""`vinterp.SAE`: a sparse autoencoder's weights and SAELens's inference math, with no engine.

Encode and decode follow SAELens 6's `encode`/`decode` operation for operation (cast, run-time
normalisation, `- b_dec`, `@ W_enc + b_enc`, the activation; `@ W_dec + b_dec`, undo the
normalisation), so features equal SAELens's on the same rows. SAELens keeps a run-time
normalisation's statistics from its last `encode` for `decode`; here `decode` takes the input
they came from instead, so no call depends on the one before it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from vinterp.sae import format as fmt
from vinterp.wire.errors import WireError, short

LAYER_NORM_EPS = 1e-5  # SAELens's run_time_activation_ln_in
WIRE_KEYS = ("cfg", "weights", "digest")


@dataclass(eq=False, repr=False)
class SAE:
    """An SAE's weights and settings, checked on construction (shapes, dtypes, k)."""

    architecture: str
    W_enc: torch.Tensor  # (d_in, d_sae)
    b_enc: torch.Tensor  # (d_sae,)
    W_dec: torch.Tensor  # (d_sae, d_in)
    b_dec: torch.Tensor  # (d_in,)
    threshold: torch.Tensor | None = None  # (d_sae,), JumpReLU only
    k: int | None = None  # top-k only
    rescale_acts_by_decoder_norm: bool = False  # top-k only: ranks pre * |W_dec row|
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in fmt.ARCHITECTURES:
            raise fmt.unknown_architecture(self.architecture)
        if self.W_enc.dim() != 2:
            raise ValueError(f"W_enc must be (d_in, d_sae), not {tuple(self.W_enc.shape)}")
        d_in, d_sae = self.W_enc.shape
        shapes = {
            "b_enc": (d_sae,),
            "W_dec": (d_sae, d_in),
            "b_dec": (d_in,),
            "threshold": (d_sae,) if self.architecture == "jumprelu" else None,
        }
        for name, shape in shapes.items():
            tensor = getattr(self, name)
            if shape is None and tensor is not None:
                raise ValueError(f"a {self.architecture} SAE has no {name}")
            if shape is not None and (tensor is None or tuple(tensor.shape) != shape):
                found = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"{name} must be {shape} for W_enc {(d_in, d_sae)}; found {found}")
        for name, tensor in self._tensors().items():
            if tensor.dtype not in fmt.DTYPES.values():
                raise ValueError(f"{name} is {tensor.dtype}; use one of {', '.join(fmt.DTYPES)}")
            if (tensor.dtype, tensor.device) != (self.dtype, self.device):
                raise ValueError(
                    f"{name} is {tensor.dtype} on {tensor.device} but W_enc is {self.dtype} on "
                    f"{self.device}"
                )
        if self.architecture == "topk":
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 < self.k <= d_sae:
                raise ValueError(f"a topk SAE needs k in 1..{d_sae}, not {self.k!r}")
        elif self.k is not None or self.rescale_acts_by_decoder_norm:
            raise ValueError("k and rescale_acts_by_decoder_norm are for topk SAEs only")
        if self.normalize_activations not in fmt.NORMALIZATIONS:
            raise ValueError(
                f"normalize_activations {self.normalize_activations!r} is not one of "
                f"{', '.join(fmt.NORMALIZATIONS)}"
            )

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def __repr__(self) -> str:
        extra = f", k={self.k}" if self.k is not None else ""
        return (
            f"SAE({self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}{extra}, "
            f"{str(self.dtype).removeprefix('torch.')}, {self.device})"
        )

    # -- files and the wire ---------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> SAE:
        """An SAE directory in SAELens's format (what its `save_model` writes)."""
        cfg, tensors = fmt.read(path)
        return cls._from_parts(cfg, tensors)

    def save(self, path: str | Path) -> None:
        """Write SAELens's format: `SAE.load_from_disk(path)` in SAELens reads it back."""
        fmt.write(path, self.cfg(), self._tensors())

    def cfg(self) -> dict[str, Any]:
        """The cfg.json SAELens would write for this SAE."""
        return fmt.cfg_dict(
            architecture=self.architecture,
            d_in=self.d_in,
            d_sae=self.d_sae,
            dtype=self.dtype,
            apply_b_dec_to_input=self.apply_b_dec_to_input,
            normalize_activations=self.normalize_activations,
            metadata=self.metadata,
            k=self.k,
            rescale_acts_by_decoder_norm=self.rescale_acts_by_decoder_norm,
        )

    @property
    def digest(self) -> str:
        """sha256 of what the SAE computes (settings, weights' dtypes, shapes and bytes), not
        of its metadata or device: the same SAE saved, loaded or sent has the same digest.
        Hashed once and kept while no weight is replaced or changed in place (each tensor's
        version counter): an 8B model's SAE takes about 0.5 s to hash, which every
        extraction would otherwise pay."""
        settings = {k: v for k, v in self.cfg().items() if k not in ("metadata", "device")}
        tensors = self._tensors()
        text = json.dumps(settings, sort_keys=True)
        held = [(t, t._version) for t in tensors.values()]  # held: no id is reused meanwhile
        cached = self.__dict__.get("_digest")
        if cached is not None and cached[0] == text and _same_tensors(cached[1], held):
            return cached[2]
        h = hashlib.sha256()
        h.update(text.encode())
        for name, tensor in tensors.items():
            tensor = tensor.detach().to("cpu").contiguous()
            h.update(f"\n{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
            h.update(tensor.reshape(-1).view(torch.uint8).numpy())
        self.__dict__["_digest"] = (text, held, h.hexdigest())
        return self.__dict__["_digest"][2]

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe: the cfg, the safetensors file base64-encoded, and the digest."""
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in self._tensors().items()}
        return {
            "cfg": self.cfg(),
            "weights": base64.b64encode(save_safetensors(cpu)).decode("ascii"),
            "digest": self.digest,
        }

    @classmethod
    def from_wire(cls, wire: Any) -> SAE:
        """Inverse of `to_wire`, for data from anyone: raises only WireError (a ValueError)."""
        if not isinstance(wire, dict) or sorted(wire) != sorted(WIRE_KEYS):
            raise WireError(f"an SAE on the wire is a JSON object with keys {', '.join(WIRE_KEYS)}")
        if not isinstance(wire["weights"], str) or not isinstance(wire["digest"], str):
            raise WireError("SAE: weights (base64 safetensors) and digest must be strings")
        try:
            tensors = load_safetensors(base64.b64decode(wire["weights"], validate=True))
        except (binascii.Error, ValueError, SafetensorError) as e:
            raise WireError(f"SAE: weights are not a base64 safetensors file ({e})") from None
        try:
            sae = cls._from_parts(wire["cfg"], tensors)
        except ValueError as e:
            raise WireError(f"SAE: {e}") from None
        if sae.digest != wire["digest"]:
            raise WireError("SAE: the weights and cfg do not match the digest sent with them")
        return sae

    @classmethod
    def _from_parts(cls, cfg: Any, tensors: dict[str, torch.Tensor]) -> SAE:
        settings = fmt.settings(cfg)
        d_in, d_sae, dtype = settings.pop("d_in"), settings.pop("d_sae"), settings.pop("dtype")
        sae = cls(**settings, **fmt.weights(tensors, settings["architecture"], dtype))
        if (sae.d_in, sae.d_sae) != (d_in, d_sae):
            raise ValueError(
                f"the cfg says d_in {d_in}, d_sae {d_sae} but W_enc is {tuple(sae.W_enc.shape)}"
            )
        return sae

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = fmt.WEIGHT_NAMES + (("threshold",) if self.threshold is not None else ())
        return {name: getattr(self, name) for name in names}

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SAE:
        """A copy with the weights on `device` and/or in `dtype` (float32/64, float16, bfloat16)."""
        moved = {name: t.to(device=device, dtype=dtype) for name, t in self._tensors().items()}
        return replace(self, **moved)

    # -- the math ---------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features (..., d_sae) of rows x (..., d_in)."""
        return self._encode(x)[0]

    def decode(self, f: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction (..., d_in) of features f (..., d_sae). With a run-time
        normalisation (constant_norm_rescale, layer_norm) the reconstruction is mapped back
        with the statistics of the rows x that f was encoded from, which must be given."""
        if x is None:
            if self.normalize_activations in fmt.RUN_TIME_NORMALIZATIONS:
                raise ValueError(
                    f"this SAE normalises its input at run time ({self.normalize_activations}): "
                    "decode(f, x) needs the rows x that f was encoded from"
                )
            return self._decode(f, lambda out: out)
        return self._decode(f, self._normalize(self._input(x))[1])

    def error(self, x: torch.Tensor) -> torch.Tensor:
        """x - decode(encode(x)): what the SAE does not reconstruct."""
        f, undo = self._encode(x)
        return x - self._decode(f, undo)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest features of each row: indices (..., k) int64 and values (..., k),
        largest first."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= self.d_sae:
            raise ValueError(f"k must be in 1..{self.d_sae} (this SAE's features), not {short(k)}")
        values, indices = self.encode(x).topk(k, dim=-1)
        return indices, values

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_in:
            raise ValueError(f"x {tuple(x.shape)} does not end in this SAE's d_in {self.d_in}")
        return x.to(self.dtype)

    def _normalize(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """The normalised rows and the map that undoes it (SAELens's run-time functions)."""
        if self.normalize_activations == "constant_norm_rescale":
            coeff = (self.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, lambda out: out / coeff
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            return x / (std + LAYER_NORM_EPS), lambda out: out * std + mu
        return x, lambda out: out

    def _encode(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        sae_in, undo = self._normalize(self._input(x))
        if self.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        pre = sae_in @ self.W_enc + self.b_enc
        if self.architecture == "standard":
            return pre.relu(), undo
        if self.architecture == "jumprelu":
            return pre.relu() * (pre > self.threshold).to(pre.dtype), undo
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        values, indices = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, indices, values.relu()), undo

    def _decode(
        self, f: torch.Tensor, undo: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if f.dim() == 0 or f.shape[-1] != self.d_sae:
            raise ValueError(f"f {tuple(f.shape)} does not end in this SAE's d_sae {self.d_sae}")
        f = f.to(self.dtype)
        if self.rescale_acts_by_decoder_norm:
            f = f * (1 / self.W_dec.norm(dim=-1))
        return undo(f @ self.W_dec + self.b_dec)

    # -- checks for the callers that attach an SAE ------------------------------------------

    def check_feature(self, index: Any) -> int:
        """`index` as an int if it names one of the SAE's features, else a ValueError."""
        try:
            feature = operator.index(index)
        except TypeError:
            raise ValueError(f"a feature index is an integer, not {short(index)}") from None
        if isinstance(index, bool) or not 0 <= feature < self.d_sae:
            raise ValueError(
                f"feature {feature} is out of range; this SAE has {self.d_sae} features "
                f"(0..{self.d_sae - 1})"
            )
        return feature

    def check_width(self, d_in_of_site: int, site: str) -> None:
        """A ValueError unless the site's hidden size is the SAE's d_in."""
        if d_in_of_site != self.d_in:
            raise ValueError(
                f"the SAE's d_in {self.d_in} differs from the hidden size {d_in_of_site} of {site}"
            )


def _same_tensors(old: list[tuple[torch.Tensor, int]], new: list[tuple[torch.Tensor, int]]) -> bool:
    """The same tensor objects at the same versions (none replaced or changed in place)."""
    return len(old) == len(new) and all(a is b and va == vb for (a, va), (b, vb) in zip(old, new))
