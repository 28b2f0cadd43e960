"""Full logical tensors from vLLM's tensor-parallel shards.

Under tensor parallelism a column-parallel layer holds a slice of its outputs on each rank
(merged layers — qkv, gate_up — a slice of each part), a row-parallel layer a slice of its
inputs, an attention layer some of the heads (each kv head on several ranks when there are
fewer kv heads than ranks), and a vocab-parallel embedding a block of vocabulary rows plus
padding. A trace must read the same tensor at any TP size (nnsight once returned another
token's lm_head row on the rank that did not own it), so every value leaves here whole and in
HF order. The gathers are collectives: every rank of the group runs them, in the same order,
which holds because all TP ranks run the same trace graph on the same steps.

The group and the kinds of vLLM's sharded layers come from the engine (`ParallelLayout`):
runtime/ does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vinterp.sites.names import UnknownSiteError
from vinterp.sites.params import parse_param


@dataclass(frozen=True)
class ParallelLayout:
    """This worker's place in the engine's parallel groups and how its layers are sharded, as
    the engine reports them (`engine.vllm_boundary.parallel`)."""

    tp_size: int = 1
    tp_rank: int = 0
    # every TP rank's tensor stacked on a new first axis (a collective); unused at tp_size 1
    stack_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    # "column", "row", "vocab" or None: how vLLM shards a layer
    layer_kind: Callable[[nn.Module], str | None] = lambda layer: None
    # the real (unpadded) rows of rank `rank`'s block of a vocab-parallel layer
    vocab_rows: Callable[[nn.Module, int, int], int] | None = None
    is_last_stage: bool = True
    pipeline_size: int = 1


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


def _vocab_rows(
    layer: nn.Module,
    shards: list[torch.Tensor],
    dim: int,
    real_rows: Callable[[nn.Module, int, int], int],
) -> torch.Tensor:
    """The real vocabulary rows of a vocab-parallel tensor, padding dropped, along `dim`."""
    pieces = [
        shard.narrow(dim, 0, real_rows(layer, rank, len(shards)))
        for rank, shard in enumerate(shards)
    ]
    return torch.cat(pieces, dim=dim)


def _local_weight(layer: nn.Module) -> torch.Tensor:
    """This rank's weight. vLLM's CPU GEMMs keep only a packed copy (the parameter is
    emptied): multiplying the identity gives it back exactly (one non-zero term per sum)."""
    weight = layer.weight.detach()
    if weight.numel() == 0 and hasattr(layer, "cpu_linear"):
        eye = torch.eye(layer.input_size_per_partition, dtype=layer.params_dtype)
        weight = layer.cpu_linear(eye, layer.weight, None).t().contiguous()
    return weight


class TensorParallel:
    """Whole values from this rank's shards (and back), for one worker's `ParallelLayout`."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout

    def per_rank(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's `local` (same shape on each), in rank order."""
        if self.layout.tp_size == 1 or self.layout.stack_ranks is None:
            return [local]
        return list(self.layout.stack_ranks(local.unsqueeze(0).contiguous()).unbind(0))

    def full_heads(self, local: torch.Tensor, heads: int) -> torch.Tensor:
        """A per-head site's (T, heads, head_dim) from this rank's slice of its heads."""
        return _whole_heads(self.per_rank(local), heads)

    def own_heads(self, whole: torch.Tensor, local: int) -> torch.Tensor:
        """This rank's `local` heads of a per-head site's whole (T, heads, head_dim) value."""
        return _rank_heads(whole, local, self.layout.tp_rank, self.layout.tp_size)

    def _vocab(self, layer: nn.Module, local: torch.Tensor, dim: int) -> torch.Tensor:
        assert self.layout.vocab_rows is not None  # a layout that names vocab layers has it
        return _vocab_rows(layer, self.per_rank(local), dim, self.layout.vocab_rows)

    def full_output(self, layer: nn.Module, local: torch.Tensor) -> torch.Tensor:
        """A layer's output as one device would compute it (column-parallel: gathered, merged
        parts in HF order q|k|v, gate|up; others: unchanged)."""
        if self.layout.layer_kind(layer) != "column" or getattr(layer, "gather_output", False):
            return local
        if getattr(layer, "tp_size", 1) == 1:
            return local
        return torch.cat(_column_parts(layer, self.per_rank(local), dim=-1), dim=-1)

    def full_input(self, layer: nn.Module, local: torch.Tensor) -> torch.Tensor:
        """A layer's input as one device would see it (row-parallel: gathered)."""
        if self.layout.layer_kind(layer) != "row" or getattr(layer, "tp_size", 1) == 1:
            return local
        if not getattr(layer, "input_is_parallel", True):  # the layer splits a whole input
            return local
        return torch.cat(self.per_rank(local), dim=-1)

    def full_logits(self, lm_head: nn.Module, local: torch.Tensor) -> torch.Tensor:
        """`x @ lm_head.weight.T` computed on this rank's vocab block -> the whole vocabulary."""
        if self.layout.layer_kind(lm_head) != "vocab":
            return local
        return self._vocab(lm_head, local, dim=-1)

    def full_weight(self, layer: nn.Module, part: int | None = None) -> torch.Tensor:
        """A layer's weight in its HF shape; `part` picks q/k/v or gate/up of a merged layer."""
        weight = _local_weight(layer)
        kind = self.layout.layer_kind(layer)
        if kind == "vocab":
            return self._vocab(layer, weight, dim=0)
        sharded = getattr(layer, "tp_size", 1) > 1
        if kind == "row" and sharded:
            return torch.cat(self.per_rank(weight), dim=1)
        if kind == "column":
            parts = _column_parts(layer, self.per_rank(weight) if sharded else [weight], dim=0)
            return parts[part] if part is not None else torch.cat(parts, dim=0)
        return weight

    def full_raw(self, module: nn.Module, which: str, value: Any) -> Any:
        """A raw site's native value (a tensor, or vLLM's (output, bias) pair) made whole."""
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return [self.full_raw(module, which, value[0]), *value[1:]]
        if not isinstance(value, torch.Tensor):
            return value
        if which == "output":
            return self.full_output(module, value)
        return self.full_input(module, value)


class VLLMParams:
    """Reads HF-named parameters from a vLLM model: packed layers split, shards gathered."""

    def __init__(self, model: nn.Module, modules: Any, tp: TensorParallel) -> None:
        self.modules, self.tp = modules, tp
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
                return self.tp.full_weight(self.modules.lm_head)
            embed = self.modules.embed  # or the owner of an embedding method (Gemma 3)
            return self.tp.full_weight(
                embed if self.modules.embed_method == "forward" else embed.embed_tokens
            )
        layer = self.modules.layers[param.layer]
        block, proj = param.module.split(".")
        try:
            return self.tp.full_weight(layer.get_submodule(param.module))
        except AttributeError:
            pass
        if proj in self.packed:
            packed_name, part = self.packed[proj]
            try:
                return self.tp.full_weight(layer.get_submodule(f"{block}.{packed_name}"), part)
            except AttributeError:
                pass
        raise UnknownSiteError(
            f"parameter {name!r}: the engine's model has no module for {param.module!r} "
            "(read it with llm.raw on the engine's own module names)"
        )
