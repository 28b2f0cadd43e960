"""SAELens's on-disk SAE format (6.x, and the pre-6.0 configs SAELens still reads): `cfg.json`
(the config's `to_dict()`: its fields plus `architecture` and `metadata`) beside
`sae_weights.safetensors` (`W_enc (d_in, d_sae)`, `b_enc`, `W_dec (d_sae, d_in)`, `b_dec`, and
`threshold` for JumpReLU).

Reading turns a cfg into `SAE` keyword fields and checks every value's type, because the same
code decodes SAEs sent over the wire by anyone. What SAELens would compute differently from
`vinterp.SAE`, or what vinterp does not implement, is refused with a ValueError that names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vinterp.wire.errors import short

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "topk", "jumprelu")
# Applied at run time from each input's own statistics, as SAELens's SAE does.
RUN_TIME_NORMALIZATIONS = ("constant_norm_rescale", "layer_norm")
# Identity at inference in SAELens: its trainer folds these into the weights before the final
# save, and `SAE.load_from_disk` applies nothing for them.
FOLDED_NORMALIZATIONS = ("none", "expected_average_only_in", "covariance_whitening")
NORMALIZATIONS = FOLDED_NORMALIZATIONS + RUN_TIME_NORMALIZATIONS
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
WEIGHT_NAMES = ("W_enc", "b_enc", "W_dec", "b_dec")
# The version this writer's layout belongs to: SAELens reads a cfg without a version as the
# pre-6.0 layout and rewrites it.
FORMAT_VERSION = "6.0.0"
_PRE_6_METADATA = ("model_name", "hook_name", "hook_head_index", "context_size", "prepend_bos")


def unknown_architecture(architecture: Any) -> ValueError:
    return ValueError(
        f"unknown SAE architecture {short(architecture)}; vinterp supports "
        f"{', '.join(ARCHITECTURES)}"
    )


def read(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The raw cfg and tensors of an SAE directory."""
    path = Path(path)
    if not (path / CFG_FILENAME).is_file() or not (path / WEIGHTS_FILENAME).is_file():
        raise FileNotFoundError(
            f"{path} is not an SAE directory in SAELens's format: it needs {CFG_FILENAME} and "
            f"{WEIGHTS_FILENAME}"
        )
    cfg = json.loads((path / CFG_FILENAME).read_text())
    return cfg, load_file(path / WEIGHTS_FILENAME)


def write(path: str | Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, path / WEIGHTS_FILENAME)
    (path / CFG_FILENAME).write_text(json.dumps(cfg))


def settings(cfg: Any) -> dict[str, Any]:
    """`SAE` keyword fields from a cfg, plus `d_in`, `d_sae` and `dtype` for checking the
    weights against."""
    if not isinstance(cfg, dict):
        raise ValueError(f"an SAE cfg is a JSON object, not {type(cfg).__name__}")
    if _is_pre_6(cfg):
        cfg = _upgrade_pre_6(cfg)
    architecture = cfg.get("architecture")
    if architecture not in ARCHITECTURES:
        raise unknown_architecture(architecture)
    out: dict[str, Any] = {
        "architecture": architecture,
        "d_in": _positive_int(cfg, "d_in"),
        "d_sae": _positive_int(cfg, "d_sae"),
        "apply_b_dec_to_input": _bool(cfg, "apply_b_dec_to_input", True),
        "normalize_activations": cfg.get("normalize_activations", "none"),
        "metadata": cfg.get("metadata", {}),
    }
    dtype = cfg.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in DTYPES:
        raise ValueError(f"SAE cfg dtype {short(dtype)} is not one of {', '.join(DTYPES)}")
    out["dtype"] = DTYPES[dtype.removeprefix("torch.")]
    if out["normalize_activations"] not in NORMALIZATIONS:
        raise ValueError(
            f"SAE cfg normalize_activations {short(out['normalize_activations'])} is not one of "
            f"{', '.join(NORMALIZATIONS)}"
        )
    reshape = cfg.get("reshape_activations", "none")
    if reshape != "none":
        raise ValueError(
            f"SAE cfg reshape_activations {short(reshape)} is not supported: vinterp feeds an SAE "
            "(..., d_in) rows, so it must be 'none'"
        )
    if not isinstance(out["metadata"], dict):
        raise ValueError("SAE cfg metadata must be a JSON object")
    if architecture == "topk":
        out["k"] = _positive_int(cfg, "k")
        out["rescale_acts_by_decoder_norm"] = _bool(cfg, "rescale_acts_by_decoder_norm", False)
    return out


def weights(
    tensors: dict[str, torch.Tensor], architecture: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The named weights cast to the cfg's dtype (as SAELens's loader does); a `scaling_factor`
    of ones (written by some SAELens 5.x versions) is dropped, any other is refused."""
    tensors = dict(tensors)
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not (
        scale.is_floating_point() and torch.allclose(scale.float(), torch.ones_like(scale.float()))
    ):
        raise ValueError(
            "the SAE has a non-unit scaling_factor (SAELens 5.x's fine-tuning scale); vinterp "
            "does not apply it, and SAELens 6 no longer loads it either"
        )
    names = WEIGHT_NAMES + (("threshold",) if architecture == "jumprelu" else ())
    missing = [n for n in names if n not in tensors]
    unexpected = [short(n) for n in sorted(set(tensors) - set(names))]
    if missing or unexpected:
        raise ValueError(
            f"a {architecture} SAE has the tensors {', '.join(names)}; "
            + "; ".join(
                f"{what}: {', '.join(found)}"
                for what, found in (("missing", missing), ("unexpected", unexpected))
                if found
            )
        )
    for name in names:
        if not tensors[name].is_floating_point():
            raise ValueError(f"SAE tensor {name} is {tensors[name].dtype}, not floating point")
    return {name: tensors[name].to(dtype) for name in names}


def cfg_dict(
    *,
    architecture: str,
    d_in: int,
    d_sae: int,
    dtype: torch.dtype,
    apply_b_dec_to_input: bool,
    normalize_activations: str,
    metadata: dict[str, Any],
    k: int | None,
    rescale_acts_by_decoder_norm: bool,
) -> dict[str, Any]:
    """What SAELens's `cfg.to_dict()` writes for these settings (its field order)."""
    cfg: dict[str, Any] = {
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": str(dtype).removeprefix("torch."),
        "device": "cpu",
        "apply_b_dec_to_input": apply_b_dec_to_input,
        "normalize_activations": normalize_activations,
        "reshape_activations": "none",
        "metadata": {"sae_lens_version": FORMAT_VERSION, **metadata},
    }
    if architecture == "topk":
        cfg["k"] = k
        cfg["rescale_acts_by_decoder_norm"] = rescale_acts_by_decoder_norm
    cfg["architecture"] = architecture
    return cfg


def _is_pre_6(cfg: dict[str, Any]) -> bool:
    """SAELens's test (`handle_config_defaulting`): no version, or one before 6.0."""
    metadata = cfg.get("metadata")
    version = cfg.get("sae_lens_version") or (
        metadata.get("sae_lens_version") if isinstance(metadata, dict) else None
    )
    if not isinstance(version, str):
        return True
    major = version.split(".", 1)[0]
    return not major.isdigit() or int(major) < 6


def _upgrade_pre_6(cfg: dict[str, Any]) -> dict[str, Any]:
    """The pre-6.0 defaults SAELens's `handle_pre_6_0_config` applies, those that change the
    math; an activation function other than ReLU or top-k is refused (SAELens 6 drops it)."""
    renames = {"hook_point": "hook_name", "activation_fn_str": "activation_fn"}
    cfg = {renames.get(key, key): value for key, value in cfg.items()}
    cfg.setdefault("architecture", "standard")
    activation = cfg.get("activation_fn", "relu")
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if activation == "topk" and isinstance(kwargs, dict) and kwargs.get("k") is not None:
        cfg["architecture"], cfg["k"] = "topk", kwargs["k"]
    elif activation not in ("relu", None) and cfg["architecture"] == "standard":
        raise ValueError(
            f"SAE cfg activation_fn {short(activation)} is not supported; vinterp's standard SAE "
            "applies ReLU"
        )
    normalize = cfg.get("normalize_activations")
    if isinstance(normalize, bool) or normalize is None:
        cfg["normalize_activations"] = "expected_average_only_in" if normalize else "none"
    hook = cfg.get("hook_name")
    cfg.setdefault("reshape_activations", "hook_z" if "hook_z" in str(hook or "") else "none")
    cfg["metadata"] = {key: cfg[key] for key in _PRE_6_METADATA if key in cfg}
    return cfg


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"SAE cfg {key} must be a positive integer, not {short(value)}")
    return value


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"SAE cfg {key} must be true or false, not {short(value)}")
    return value
