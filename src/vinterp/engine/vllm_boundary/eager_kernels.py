"""An uncompiled step runs on the kernels of vLLM's eager mode, not on the compiler's ops.

A compiled engine builds its layers for Inductor: CustomOps disabled (`forward_native`) and
vLLM IR ops on their "native" torch implementation, which the compiler fuses. A step that
leaves the compiled code (a trace, a capture outside the graphs) would run those native ops
one by one: on an H100 the bundled model's prefill forward took 49-53 ms that way against
20.5 ms on vLLM's CUDA kernels (docs/GPU.md), and its values came from other
kernels than an `enforce_eager=True` engine's. For such a step the model's CustomOps take the
method vLLM dispatches them to in an uncompiled engine (the platform kernel), and the IR ops
the priority vLLM gives an uncompiled engine; both go back after the forward.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict
from typing import Any

from torch import nn


class EagerKernels:
    """The switch for one worker's model, worked out once at engine start."""

    def __init__(self, model: nn.Module, vllm_config: Any) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(vllm_config):
            self.custom_ops = _switched_custom_ops(model, vllm_config)
        self.priority = _eager_ir_priority(vllm_config)
        self._on: contextlib.ExitStack | None = None

    def enter(self) -> None:
        for op, _, eager in self.custom_ops:
            op._forward_method = eager
        self._on = contextlib.ExitStack()
        if self.priority is not None:
            self._on.enter_context(self.priority.set_priority())

    def exit(self) -> None:
        if self._on is None:
            return
        for op, compiled, _ in self.custom_ops:
            op._forward_method = compiled
        self._on.close()
        self._on = None


def _switched_custom_ops(model: nn.Module, vllm_config: Any) -> list[tuple[Any, Any, Any]]:
    """(op, its method now, its eager method) for each CustomOp whose eager method differs.

    The eager method is the one vLLM dispatches to with an uncompiled engine's `custom_ops`
    (its base "all" where the compiler's is "none"; the user's "+op" / "-op" kept)."""
    from vllm.model_executor.custom_op import CustomOp

    config = vllm_config.compilation_config
    saved = (
        config.custom_ops,
        copy.copy(config.enabled_custom_ops),
        copy.copy(config.disabled_custom_ops),
    )
    config.custom_ops = ["all" if op == "none" else op for op in config.custom_ops]
    try:
        switched = []
        for module in model.modules():
            if isinstance(module, CustomOp):
                eager = module.dispatch_forward(compile_native=False)
                if eager != module._forward_method:
                    switched.append((module, module._forward_method, eager))
        return switched
    finally:  # dispatching counts the ops it enabled
        config.custom_ops, config.enabled_custom_ops, config.disabled_custom_ops = saved


def _eager_ir_priority(vllm_config: Any) -> Any:
    """The IR op priority of this engine were it uncompiled (the user's own choices first), or
    None where it is the engine's."""
    from vllm.config.compilation import CompilationMode
    from vllm.config.kernel import IrOpPriorityConfig
    from vllm.platforms import current_platform

    uncompiled = copy.copy(vllm_config)
    uncompiled.compilation_config = copy.copy(vllm_config.compilation_config)
    uncompiled.compilation_config.mode = CompilationMode.NONE
    compiled_defaults = asdict(current_platform.get_default_ir_op_priority(vllm_config))
    eager_defaults = asdict(current_platform.get_default_ir_op_priority(uncompiled))
    now = asdict(vllm_config.kernel_config.ir_op_priority)
    eager = {}
    for op, providers in now.items():
        users = [p for p in providers or [] if p not in compiled_defaults.get(op, [])]
        eager[op] = users + [p for p in eager_defaults.get(op, []) if p not in users]
    if eager == now:
        return None
    return IrOpPriorityConfig(**eager)
