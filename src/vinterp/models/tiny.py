"""Tiny random-weight checkpoints for architecture coverage and parallelism tests.

Head size is 64 because vLLM's CPU attention only accepts some head sizes (DESIGN.md lesson 8).
The tokenizer is a real byte-level BPE trained on a fixed text, so prompts are real strings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from vinterp.models.cache import cached_checkpoint

SEED = 0
VOCAB_SIZE = 512
# Large enough init that greedy tokens are decided by clear margins, not float noise.
INIT_RANGE = 0.2

_TOKENIZER_TEXT = """
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
Once upon a time there was a small model that wanted to know what it was thinking.
Researchers read the residual stream, patch activations, steer with vectors and capture
features for probes and sparse autoencoders. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.
def hello(world): return world + 1  # code, too
"""

# A small pre-norm decoder; every architecture below starts from it.
_DECODER: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _arch(model_type: str, architecture: str, **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, "architectures": [architecture], **_DECODER, **extra}


_BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _arch("llama", "LlamaForCausalLM"),
    "mistral": _arch("mistral", "MistralForCausalLM", sliding_window=None),
    "qwen2": _arch("qwen2", "Qwen2ForCausalLM", use_sliding_window=False),
    "qwen3": _arch("qwen3", "Qwen3ForCausalLM", use_sliding_window=False),
    "phi3": _arch("phi3", "Phi3ForCausalLM", original_max_position_embeddings=512),
    # Sandwich norms, scaled embeddings, soft-capped logits, alternating sliding windows.
    "gemma2": _arch(
        "gemma2",
        "Gemma2ForCausalLM",
        sliding_window=256,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=None,  # vLLM's CPU kernel caps differently (API.md section 2)
        tie_word_embeddings=True,
    ),
    "gemma3_text": _arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        sliding_window=256,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=True,
    ),
    # Learned position embeddings, LayerNorm, a single residual stream between blocks.
    "gpt2": _arch("gpt2", "GPT2LMHeadModel", n_inner=512),
    "opt": _arch(
        "opt", "OPTForCausalLM", ffn_dim=512, word_embed_proj_dim=256, do_layer_norm_before=True
    ),
    # Parallel attention + MLP blocks; vLLM runs it through its Transformers backend.
    "gpt_neox": _arch("gpt_neox", "GPTNeoXForCausalLM", rotary_pct=0.25),
    # Mixture-of-experts MLPs: a router picks the top 2 experts per token.
    "mixtral": _arch(
        "mixtral",
        "MixtralForCausalLM",
        sliding_window=None,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # With a gated shared expert beside the routed ones; top-k weights not renormalized.
    "qwen2_moe": _arch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        use_sliding_window=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        norm_topk_prob=False,
    ),
    "qwen3_moe": _arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        use_sliding_window=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        norm_topk_prob=True,
    ),
    "olmoe": _arch(
        "olmoe",
        "OlmoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
}

ARCHITECTURES = tuple(_BASE_CONFIGS)


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The config dict `tiny(arch, **overrides)` builds (without writing anything)."""
    if arch not in _BASE_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")
    config = dict(_BASE_CONFIGS[arch])
    config.update(
        vocab_size=VOCAB_SIZE,
        initializer_range=INIT_RANGE,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    config.update(overrides)
    return config


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_TOKENIZER_TEXT.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def _builder(config_dict: dict[str, Any], weights: bool = True):
    """Writes the config, the tiny tokenizer and (with `weights`) random weights."""

    def build(out_dir: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config_dict_ = dict(config_dict)
        config = AutoConfig.for_model(config_dict_.pop("model_type"), **config_dict_)
        if weights:
            torch.manual_seed(SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.save_pretrained(out_dir, safe_serialization=True)
        else:
            config.save_pretrained(out_dir)
        _build_tokenizer().save_pretrained(out_dir)

    return build


def _cached(kind: str, arch: str, overrides: dict[str, Any], weights: bool) -> Path:
    """The cached directory of `arch` with `overrides`, named by its config's hash."""
    config = tiny_config(arch, **overrides)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return cached_checkpoint(f"{kind}-{arch}-{digest}", _builder(config, weights))


def tiny(arch: str = "llama", **overrides: Any) -> Path:
    """Local HF checkpoint of a tiny random `arch` model, cached by its config's hash."""
    return _cached("tiny", arch, overrides, weights=True)


# Llama 3 8B's shape (no weights): for engines started with load_format="dummy"
LLAMA_3_8B: dict[str, Any] = {
    "arch": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "initializer_range": 0.02,
    "dtype": "bfloat16",
}
LLAMA_3_70B: dict[str, Any] = {
    **LLAMA_3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
# Shapes by the name `vinterp bench --model` takes
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b-shape": LLAMA_3_8B,
    "llama-3-70b-shape": LLAMA_3_70B,
}


def shape_only(arch: str = "llama", **overrides: Any) -> Path:
    """Local directory of a model's shape without weights: config.json and the tiny
    tokenizer (its ids lie below any vocabulary size), cached by the config's hash. Engines
    load it with random weights (vLLM's `load_format="dummy"`, transformers' `from_config`),
    so it is for timing, not for values. `shape_only(**LLAMA_3_8B)`: Llama 3 8B."""
    return _cached("shape", arch, overrides, weights=False)
