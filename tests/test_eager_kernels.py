"""What an engine's uncompiled steps switch to (engine/eager_kernels.py): the CustomOp methods
and the IR op priority vLLM gives an uncompiled engine, the user's own choices kept. The
platform rule for IR ops here is CUDA's (vllm/platforms/cuda.py): "native" when Inductor
compiles, else "vllm_c" then "native"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode
from vllm.config.kernel import IrOpPriorityConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import current_platform

from vinterp.engine.vllm_boundary.eager_kernels import _eager_ir_priority, _switched_custom_ops


def cuda_rule(vllm_config: object) -> IrOpPriorityConfig:
    compiled = vllm_config.compilation_config.mode != CompilationMode.NONE
    return IrOpPriorityConfig.with_default(["native"] if compiled else ["vllm_c", "native"])


def engine_config(**priority: list[str]) -> SimpleNamespace:
    merged = {op: [*p, "native"] for op, p in priority.items()}  # as vLLM appends its default
    return SimpleNamespace(
        compilation_config=SimpleNamespace(mode=CompilationMode.VLLM_COMPILE),
        kernel_config=SimpleNamespace(
            ir_op_priority=IrOpPriorityConfig.with_default(["native"], **merged)
        ),
    )


@pytest.fixture
def cuda_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(current_platform, "get_default_ir_op_priority", cuda_rule)


def test_uncompiled_steps_get_the_eager_kernels_after_the_users_choice(cuda_platform) -> None:
    config = engine_config(rms_norm=["oink"])
    eager = _eager_ir_priority(config)
    assert eager.rms_norm == ["oink", "vllm_c", "native"]
    assert eager.fused_add_rms_norm == ["vllm_c", "native"]
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE  # left as it was
    assert config.kernel_config.ir_op_priority.rms_norm == ["oink", "native"]


def test_no_switch_where_the_platform_has_one_priority(monkeypatch) -> None:
    monkeypatch.setattr(
        current_platform,
        "get_default_ir_op_priority",
        lambda _config: IrOpPriorityConfig.with_default(["native"]),
    )
    assert _eager_ir_priority(engine_config()) is None


def test_custom_ops_take_the_uncompiled_dispatch_except_those_the_user_disabled() -> None:
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["-silu_and_mul"]))
    assert "none" in config.compilation_config.custom_ops  # the compiler's base
    with set_current_vllm_config(config):
        silu, norm = SiluAndMul(), RMSNorm(8)
        switched = {
            type(op).__name__: eager
            for op, _, eager in _switched_custom_ops(nn.Sequential(silu, norm), config)
        }
    assert norm._forward_method.__name__ == "forward_native"  # compiled engines keep theirs
    assert switched["RMSNorm"].__name__ not in ("forward_native", "forward")  # the platform's
    assert switched.get("SiluAndMul", silu.forward_native).__name__ == "forward_native"
    assert config.compilation_config.custom_ops == ["-silu_and_mul", "none"]
    assert not config.compilation_config.enabled_custom_ops  # nothing counted as enabled
