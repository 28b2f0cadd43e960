"""Shards -> whole tensors, without an engine: the layouts vLLM uses for merged and vocab
layers and attention heads at TP sizes the CPU engine tests do not reach (replicated kv
heads, vocab padding)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
    pad_vocab_size,
)

from vinterp.engine.vllm_boundary.layers import vocab_rows
from vinterp.runtime.tensor_parallel import _column_parts, _rank_heads, _vocab_rows, _whole_heads


def shard_qkv(q, k, v, tp: int, kv_heads: int, head_dim: int):
    """Each rank's rows of a merged qkv weight, as vLLM's QKVParallelLinear lays them out."""
    replicas = max(1, tp // kv_heads)
    q_rows = q.shape[0] // tp
    kv_rows = max(1, kv_heads // tp) * head_dim
    shards = []
    for rank in range(tp):
        kv_index = rank // replicas
        shards.append(
            torch.cat(
                [
                    q[rank * q_rows : (rank + 1) * q_rows],
                    k[kv_index * kv_rows : (kv_index + 1) * kv_rows],
                    v[kv_index * kv_rows : (kv_index + 1) * kv_rows],
                ]
            )
        )
    layer = SimpleNamespace(output_partition_sizes=[q_rows, kv_rows, kv_rows])
    layer.num_kv_head_replicas = replicas
    return layer, shards


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_parts_come_back_whole_and_in_order(tp, kv_heads) -> None:
    head_dim, heads, hidden = 8, 4, 16
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(kv_heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden)
    layer, shards = shard_qkv(q, k, v, tp, kv_heads, head_dim)
    got_q, got_k, got_v = _column_parts(layer, shards, dim=0)
    assert torch.equal(got_q, q) and torch.equal(got_k, k) and torch.equal(got_v, v)
    # the same layout along the last axis: a merged layer's output activations
    outs = [s.t() for s in shards]
    assert torch.equal(
        torch.cat(_column_parts(layer, outs, dim=-1), dim=-1), torch.cat([q, k, v]).t()
    )


@pytest.mark.parametrize("tp,vocab", [(1, 500), (2, 500), (4, 1000), (2, 512)])
def test_vocab_rows_drop_padding(tp, vocab) -> None:
    padded = pad_vocab_size(vocab, 64)
    full = torch.randn(vocab, 3)
    per_rank = padded // tp
    rows = torch.cat([full, torch.full((padded - vocab, 3), float("nan"))])
    shards = [rows[r * per_rank : (r + 1) * per_rank] for r in range(tp)]
    layer = SimpleNamespace(
        num_embeddings_padded=padded,
        org_vocab_size_padded=padded,
        num_embeddings=vocab,
        org_vocab_size=vocab,
        _get_indices=VocabParallelEmbedding._get_indices,
    )
    assert torch.equal(_vocab_rows(layer, shards, 0, vocab_rows), full)
    logits = [s.t() for s in shards]  # (3, per_rank): vocab along the last axis
    assert torch.equal(_vocab_rows(layer, logits, -1, vocab_rows), full.t())


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (4, 2), (4, 1), (2, 4)])
def test_heads_come_back_whole_and_go_back_to_their_ranks(tp, kv_heads) -> None:
    """Per-head activations (T, heads, head_dim) are sharded as the qkv projection's rows."""
    tokens, heads, head_dim = 3, 4, 8
    q, k = torch.randn(tokens, heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    rows = [x.reshape(tokens, -1).t() for x in (q, k, k)]  # a "weight" row per output
    layer, shards = shard_qkv(*rows, tp, kv_heads, head_dim)
    parts = [shard.split(layer.output_partition_sizes) for shard in shards]
    q_shards = [p[0].t().reshape(tokens, -1, head_dim) for p in parts]
    k_shards = [p[1].t().reshape(tokens, -1, head_dim) for p in parts]
    assert torch.equal(_whole_heads(q_shards, heads), q)
    assert torch.equal(_whole_heads(k_shards, kv_heads), k)
    for rank in range(tp):
        local_q, local_k = q_shards[rank].shape[1], k_shards[rank].shape[1]
        assert torch.equal(_rank_heads(q, local_q, rank, tp), q_shards[rank])
        assert torch.equal(_rank_heads(k, local_k, rank, tp), k_shards[rank])
