"""Full logical tensors from vLLM's tensor-parallel shards.

Under tensor parallelism a column-parallel layer holds a slice of its outputs on each rank
(merged layers — qkv, gate_up — a slice of each part), a row-parallel layer a slice of its
inputs, an attention layer some of the heads (each kv head on several ranks when there are
fewer kv heads than ranks), and a vocab-parallel embedding a block of vocabulary rows plus
padding. A trace must read the same tensor at any TP size (nnsight once returned another
token's lm_head row on the rank that did not own it), so every value leaves here whole and in
HF order. The gathers are collectives: every rank of the group runs them, in the same order,
which holds because all TP ranks run the same trace graph on the same steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vinterp.sites.names import UnknownSiteError
from vinterp.sites.params import parse_param


def _tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def per_rank(local: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's `local` (same shape on each), in rank order."""
    if _tp_size() == 1:
        return [local]
    from vllm.distributed import tensor_model_parallel_all_gather

    stacked = tensor_model_parallel_all_gather(local.unsqueeze(0).contiguous(), dim=0)
    return list(stacked.unbind(0))


def _column_kind(layer: nn.Module) -> str | None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(layer, ColumnParallelLinear):
        return "column"
    if isinstance(layer, RowParallelLinear):
        return "row"
    if isinstance(layer, VocabParallelEmbedding):
        return "vocab"
    return None


def _column_parts(layer: nn.Module, shards: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """A column-parallel layer's logical outputs (one for plain layers; q/k/v, gate/up for
    merged ones), each whole, from every rank's output slice along `dim`."""
    sizes = list(getattr(layer, "output_partition_sizes", [shards[0].shape[dim]]))
    replicas = [1] * len(sizes)
    if getattr(layer, "num_kv_head_replicas", 1) > 1:  # QKV with fewer kv heads than ranks
        replicas = [1] + [layer.num_kv_head_replicas] * (len(sizes) - 1)
    pieces = [shard.split(sizes, dim=dim) for shard in shards]
    return [
        torch.cat([pieces[r][j] for r in range(0, len(shards), replicas[j])], dim=dim)
        for j in range(len(sizes))
    ]


def _head_replicas(tp: int, local: int, heads: int) -> int:
    """How many consecutive ranks hold the same heads: 1, or for kv heads fewer than the
    ranks, ranks / kv heads (vLLM replicates each kv head)."""
    return max(1, tp * local // heads)


def _whole_heads(shards: list[torch.Tensor], heads: int) -> torch.Tensor:
    """(T, heads, head_dim) from every rank's (T, local heads, head_dim), one copy of each
    head."""
    replicas = _head_replicas(len(shards), shards[0].shape[1], heads)
    return torch.cat(shards[::replicas], dim=1)


def _rank_heads(whole: torch.Tensor, local: int, rank: int, tp: int) -> torch.Tensor:
    """The `local` heads of whole (T, heads, head_dim) values that rank `rank` holds."""
    first = rank // _head_replicas(tp, local, whole.shape[1]) * local
    return whole[:, first : first + local]


def full_heads(local: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-head site's (T, heads, head_dim) from this rank's slice of its heads."""
    return _whole_heads(per_rank(local), heads)


def own_heads(whole: torch.Tensor, local: int) -> torch.Tensor:
    """This rank's `local` heads of a per-head site's whole (T, heads, head_dim) value."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return _rank_heads(whole, local, get_tensor_model_parallel_rank(), _tp_size())


def _vocab_rows(layer: nn.Module, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The real vocabulary rows of a vocab-parallel tensor, padding dropped, along `dim`."""
    pieces = []
    for rank, shard in enumerate(shards):
        indices = layer._get_indices(
            layer.num_embeddings_padded,
            layer.org_vocab_size_padded,
            layer.num_embeddings,
            layer.org_vocab_size,
            rank,
            len(shards),
        )
        pieces.append(shard.narrow(dim, 0, indices.num_org_elements))
    return torch.cat(pieces, dim=dim)


def full_output(layer: nn.Module, local: torch.Tensor) -> torch.Tensor:
    """A layer's output as one device would compute it (column-parallel: gathered, merged
    parts in HF order q|k|v, gate|up; others: unchanged)."""
    if _column_kind(layer) != "column" or getattr(layer, "gather_output", False):
        return local
    if getattr(layer, "tp_size", 1) == 1:
        return local
    return torch.cat(_column_parts(layer, per_rank(local), dim=-1), dim=-1)


def full_input(layer: nn.Module, local: torch.Tensor) -> torch.Tensor:
    """A layer's input as one device would see it (row-parallel: gathered)."""
    if _column_kind(layer) != "row" or getattr(layer, "tp_size", 1) == 1:
        return local
    if not getattr(layer, "input_is_parallel", True):  # the layer splits a whole input itself
        return local
    return torch.cat(per_rank(local), dim=-1)


def full_logits(lm_head: nn.Module, local: torch.Tensor) -> torch.Tensor:
    """`x @ lm_head.weight.T` computed on this rank's vocab block -> the whole vocabulary."""
    if _column_kind(lm_head) != "vocab":
        return local
    return _vocab_rows(lm_head, per_rank(local), dim=-1)


def _local_weight(layer: nn.Module) -> torch.Tensor:
    """This rank's weight. vLLM's CPU GEMMs keep only a packed copy (the parameter is
    emptied): multiplying the identity gives it back exactly (one non-zero term per sum)."""
    weight = layer.weight.detach()
    if weight.numel() == 0 and hasattr(layer, "cpu_linear"):
        eye = torch.eye(layer.input_size_per_partition, dtype=layer.params_dtype)
        weight = layer.cpu_linear(eye, layer.weight, None).t().contiguous()
    return weight


def full_weight(layer: nn.Module, part: int | None = None) -> torch.Tensor:
    """A layer's weight in its HF shape; `part` picks q/k/v or gate/up of a merged layer."""
    weight = _local_weight(layer)
    kind = _column_kind(layer)
    if kind == "vocab":
        return _vocab_rows(layer, per_rank(weight), dim=0)
    sharded = getattr(layer, "tp_size", 1) > 1
    if kind == "row" and sharded:
        return torch.cat(per_rank(weight), dim=1)
    if kind == "column":
        parts = _column_parts(layer, per_rank(weight) if sharded else [weight], dim=0)
        return parts[part] if part is not None else torch.cat(parts, dim=0)
    return weight


def full_raw(module: nn.Module, which: str, value: Any) -> Any:
    """A raw site's native value (a tensor, or vLLM's (output, bias) pair) made whole."""
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return [full_raw(module, which, value[0]), *value[1:]]
    if not isinstance(value, torch.Tensor):
        return value
    return full_output(module, value) if which == "output" else full_input(module, value)


class VLLMParams:
    """Reads HF-named parameters from a vLLM model: packed layers split, shards gathered."""

    def __init__(self, model: nn.Module, modules: Any) -> None:
        self.modules = modules
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.packed = {  # HF projection -> (engine module name, part)
            proj: (name, index)
            for name, projs in packed.items()
            for index, proj in enumerate(projs)
        }

    def read(self, name: str) -> torch.Tensor:
        param = parse_param(name, len(self.modules.layers))
        if param.layer is None:
            if param.module == "lm_head":
                return full_weight(self.modules.lm_head)
            embed = self.modules.embed  # or the owner of an embedding method (Gemma 3)
            return full_weight(
                embed if self.modules.embed_method == "forward" else embed.embed_tokens
            )
        layer = self.modules.layers[param.layer]
        block, proj = param.module.split(".")
        try:
            return full_weight(layer.get_submodule(param.module))
        except AttributeError:
            pass
        if proj in self.packed:
            packed_name, part = self.packed[proj]
            try:
                return full_weight(layer.get_submodule(f"{block}.{packed_name}"), part)
            except AttributeError:
                pass
        raise UnknownSiteError(
            f"parameter {name!r}: the engine's model has no module for {param.module!r} "
            "(read it with llm.raw on the engine's own module names)"
        )
