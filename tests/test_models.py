"""The bundled and tiny checkpoints, without an engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

import vinterp
from vinterp.models.bundled import gguf_path
from vinterp.models.tiny import tiny_config


def test_bundled_checkpoint_is_float32_hf_dir() -> None:
    path = vinterp.models.bundled()
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.decode(tokenizer("The capital of France is").input_ids) == (
        "The capital of France is"
    )


def test_bundled_is_converted_once() -> None:
    path = vinterp.models.bundled()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert vinterp.models.bundled() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_bundled_weights_equal_dequantized_gguf() -> None:
    """The checkpoint holds the GGUF's own values, not a re-initialized model."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.7.ffn_down.weight")
    expected = dequantize(tensor.data, tensor.tensor_type).reshape(576, 1536)
    with safe_open(vinterp.models.bundled() / "model.safetensors", "pt") as f:
        actual = f.get_tensor("model.layers.7.mlp.down_proj.weight").numpy()
    np.testing.assert_array_equal(actual, expected.astype(np.float32))


def test_tiny_is_cached_by_config_and_deterministic(tmp_path, monkeypatch) -> None:
    first = vinterp.models.tiny("llama")
    assert vinterp.models.tiny("llama") == first
    wider = vinterp.models.tiny("llama", num_hidden_layers=2)
    assert wider != first and AutoConfig.from_pretrained(wider).num_hidden_layers == 2
    monkeypatch.setenv("VINTERP_CACHE_DIR", str(tmp_path))
    rebuilt = vinterp.models.tiny("llama")
    assert rebuilt.parent == tmp_path
    with (
        safe_open(first / "model.safetensors", "pt") as a,
        safe_open(rebuilt / "model.safetensors", "pt") as b,
    ):
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_tiny_llama_shape_and_tokenizer() -> None:
    path = vinterp.models.tiny("llama")
    config = AutoConfig.from_pretrained(path)
    assert config.head_dim == 64
    assert config.hidden_size // config.num_attention_heads == 64
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) <= config.vocab_size
    ids = tokenizer("The capital of France is").input_ids
    assert len(ids) < len("The capital of France is")  # merges learned, not bytes only
    assert tokenizer.decode(ids) == "The capital of France is"


def test_tiny_rejects_unknown_arch() -> None:
    with pytest.raises(ValueError, match="unknown tiny architecture 'nope'"):
        tiny_config("nope")
