"""vLLM's parallel groups and sharded layers, as the worker runtime needs them.

runtime/ works on a `ParallelLayout` (plain values and callables); this module fills it from
vLLM's distributed state and layer classes, and answers the pipeline questions the front end
and the site installer ask.
"""

from __future__ import annotations

from typing import Any

import torch

from vinterp.engine.vllm_boundary.layers import layer_kind, vocab_rows
from vinterp.runtime.pipeline import DATA, INDEX
from vinterp.runtime.tensor_parallel import ParallelLayout


def _stack_ranks(local: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(local, dim=0)


def worker_layout() -> ParallelLayout:
    """This worker's groups, read once when its sites are installed."""
    from vllm.distributed import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    stage = get_pp_group()
    return ParallelLayout(
        tp_size=get_tensor_model_parallel_world_size(),
        tp_rank=get_tensor_model_parallel_rank(),
        stack_ranks=_stack_ranks,
        layer_kind=layer_kind,
        vocab_rows=vocab_rows,
        is_last_stage=bool(stage.is_last_rank),
        pipeline_size=int(stage.world_size),
    )


def is_first_stage() -> bool:
    from vllm.distributed import get_pp_group

    return bool(get_pp_group().is_first_rank)


def is_last_stage() -> bool:
    from vllm.distributed import get_pp_group

    return bool(get_pp_group().is_last_rank)


def last_stage_start(num_layers: int, pipeline_size: int) -> int | None:
    """The first layer of the last pipeline stage (vLLM's own split), None without stages."""
    if pipeline_size == 1:
        return None
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, pipeline_size - 1, pipeline_size)[0]


def stage_starts(num_layers: int, pipeline_size: int) -> tuple[int, ...]:
    """The first layer of each pipeline stage (vLLM's own split); (0,) without stages."""
    if pipeline_size == 1:
        return (0,)
    from vllm.distributed.utils import get_pp_indices

    return tuple(get_pp_indices(num_layers, r, pipeline_size)[0] for r in range(pipeline_size))


def received_trace_values(received: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Take vinterp's values (bytes, index) out of the IntermediateTensors a stage received
    (vLLM's V1 runner copies every key it gets into its own buffers). The keys are known
    before the data: only a step that carries values waits for their transfer."""
    arrived = object.__getattribute__(received, "tensors")
    if DATA not in arrived:
        return None
    tensors = received.tensors  # waits for the transfer (and its TP all-gather)
    return tensors.pop(DATA), tensors.pop(INDEX)
