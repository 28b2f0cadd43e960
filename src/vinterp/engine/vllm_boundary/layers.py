"""vLLM's layer classes and the fields of them vinterp reads: how a layer is sharded, which
layers stand in for another pipeline stage's, and the math of an attention layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from vinterp.sites.attention_pattern import PatternMath


def layer_kind(layer: nn.Module) -> str | None:
    """How vLLM shards `layer`: "column", "row", "vocab" or None."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(layer, ColumnParallelLinear):
        return "column"
    if isinstance(layer, RowParallelLinear):
        return "row"
    if isinstance(layer, VocabParallelEmbedding):
        return "vocab"
    return None


def vocab_rows(layer: nn.Module, rank: int, tp_size: int) -> int:
    """The real vocabulary rows of rank `rank`'s block of a vocab-parallel layer (vLLM pads
    each block; `_get_indices` is its own account of the padding)."""
    indices = layer._get_indices(  # noqa: SLF001 (declared in targets.py)
        layer.num_embeddings_padded,
        layer.org_vocab_size_padded,
        layer.num_embeddings,
        layer.org_vocab_size,
        rank,
        tp_size,
    )
    return int(indices.num_org_elements)


def is_missing_layer(module: nn.Module) -> bool:
    """Whether `module` stands in for a layer another pipeline stage holds."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return isinstance(module, PPMissingLayer)


def is_attention_layer(module: Any) -> bool:
    """Whether `module` is vLLM's Attention layer (the per-head sites' source)."""
    from vllm.model_executor.layers.attention import Attention

    return isinstance(module, Attention)


def attention_math(attention: nn.Module) -> PatternMath:
    """The scale, soft-cap and sliding window vLLM's attention layer was built with (the
    implementation keeps the scale and cap; a cap of 0 is none)."""
    impl = attention.impl
    return PatternMath(
        float(impl.scale), getattr(impl, "logits_soft_cap", None) or None, attention.sliding_window
    )
