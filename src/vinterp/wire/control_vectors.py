"""Control vectors in the GGUF form llama.cpp reads and repeng writes: a file whose
`general.architecture` is "controlvector" and whose float tensors `direction.N` are added to
the output of decoder layer N (0-based), each times the coefficient the user picks."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ARCHITECTURE = "controlvector"
DIRECTION = re.compile(r"direction\.(\d+)")


def read_control_vector(path: str | Path) -> dict[str, torch.Tensor]:
    """{`layers.N.output`: direction N} of a control-vector GGUF file, in layer order; layers
    whose direction is all zeros (llama.cpp's files fill unused layers so) are left out.
    ValueError naming the file for anything else: not a GGUF file, another architecture, no
    direction tensors, or a direction that is not one finite vector."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture != ARCHITECTURE:
        raise ValueError(
            f"{path}: holds no control vector (general.architecture is {architecture!r}, not "
            f"{ARCHITECTURE!r}); give a file written by llama.cpp's cvector-generator or "
            "repeng's ControlVector.export_gguf"
        )
    directions: dict[int, torch.Tensor] = {}
    for tensor in reader.tensors:
        match = DIRECTION.fullmatch(tensor.name)
        if match is None:
            continue
        values = torch.from_numpy(tensor.data.copy()).to(torch.float32)
        if values.dim() != 1 or not torch.isfinite(values).all():
            raise ValueError(
                f"{path}: {tensor.name} must be one finite vector, got shape {tuple(values.shape)}"
            )
        if bool(values.any()):
            directions[int(match.group(1))] = values
    if not directions:
        raise ValueError(f"{path}: holds no direction.N tensor with a nonzero direction")
    return {f"layers.{layer}.output": directions[layer] for layer in sorted(directions)}
