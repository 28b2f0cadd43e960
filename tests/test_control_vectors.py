"""Control vectors from GGUF files (llama.cpp's and repeng's form), written here with the gguf
package's own writer: the steering they give, and one clear line for a file that holds none or
does not fit the model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import vinterp
from vinterp.wire.specs import steering_misfit

WIDTH = 64


def write_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "controlvector") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "controlvector":
        writer.add_string("controlvector.model_hint", "llama")
        writer.add_uint32("controlvector.layer_count", len(tensors))
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def directions(layers: list[int], seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {layer: rng.standard_normal(WIDTH).astype(np.float32) for layer in layers}


def test_each_direction_steers_its_layers_output_times_the_coefficient(tmp_path: Path) -> None:
    """direction.N is added at layers.N.output (as llama.cpp and repeng apply it), times the
    coefficient given as `scale`; all-zero directions (llama.cpp's unused layers) are left
    out; the other Steering fields pass through."""
    found = directions([3, 1, 5])
    tensors = {f"direction.{n}": v for n, v in found.items()}
    tensors["direction.2"] = np.zeros(WIDTH, np.float32)
    path = write_gguf(tmp_path / "calm.gguf", tensors)
    steering = vinterp.Steering.from_gguf(path, scale=-1.5, phase="decode")
    assert list(steering.vectors) == ["layers.1.output", "layers.3.output", "layers.5.output"]
    for n in (1, 3, 5):
        assert torch.equal(steering.vectors[f"layers.{n}.output"], torch.from_numpy(found[n]))
    assert steering.scale == -1.5 and steering.phase == "decode" and steering.mode == "add"
    assert steering_misfit(steering, 6, WIDTH) is None


@pytest.mark.parametrize(
    ("tensors", "arch", "error"),
    [
        (
            {"token_embd.weight": np.ones((4, WIDTH), np.float32)},
            "llama",
            "holds no control vector",
        ),
        ({"direction.1": np.zeros(WIDTH, np.float32)}, "controlvector", "nonzero direction"),
        ({"direction.1": np.ones((2, WIDTH), np.float32)}, "controlvector", "one finite vector"),
    ],
)
def test_a_file_without_a_usable_control_vector_is_one_clear_error(
    tmp_path: Path, tensors: dict[str, np.ndarray], arch: str, error: str
) -> None:
    path = write_gguf(tmp_path / "x.gguf", tensors, arch)
    with pytest.raises(ValueError, match=error) as raised:
        vinterp.Steering.from_gguf(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "vector.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        vinterp.Steering.from_gguf(path)


def test_a_control_vector_for_another_model_names_what_does_not_fit(tmp_path: Path) -> None:
    """Layers past the model's or another width are refused before anything runs, by the same
    check every steering passes (`steering_misfit`)."""
    path = write_gguf(
        tmp_path / "big.gguf", {f"direction.{n}": v for n, v in directions([7]).items()}
    )
    steering = vinterp.Steering.from_gguf(path)
    assert "layer 7 is out of range" in steering_misfit(steering, 4, WIDTH)
    assert "4096" in steering_misfit(steering, 8, 4096)
