"""The IR op priority of an engine's uncompiled steps: what vLLM gives an uncompiled engine,
after the user's own providers (engine/eager_kernels.py). The platform rule here is CUDA's
(vllm/platforms/cuda.py): "native" when Inductor compiles, else "vllm_c" then "native"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config.compilation import CompilationMode
from vllm.config.kernel import IrOpPriorityConfig
from vllm.platforms import current_platform

from vinterp.engine.eager_kernels import _eager_ir_priority


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
