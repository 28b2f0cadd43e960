"""vLLM general-plugin entry point (declared in pyproject.toml as `vllm.general_plugins`).

vLLM calls `register()` in every process it starts. Engines started by vinterp set
VINTERP_SITES=1 (inherited by their processes); only then is `load_model` patched to put
the sites into the model, so plain vLLM users who have vinterp installed are unaffected.
"""

from __future__ import annotations

import functools
import os
from typing import Any

ENV_FLAG = "VINTERP_SITES"


def _patch_load_model(runner_cls: Any) -> None:
    original = runner_cls.__dict__.get("load_model")
    if original is None or getattr(original, "_vinterp", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vinterp.engine.worker_ext import install_on_runner

        result = original(self, *args, **kwargs)
        install_on_runner(self)
        return result

    load_model._vinterp = True  # type: ignore[attr-defined]
    runner_cls.load_model = load_model


def register() -> None:
    """Patch the model runners' `load_model` when the engine was started by vinterp."""
    if os.environ.get(ENV_FLAG) != "1":
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        _patch_load_model(CPUModelRunner)
    else:  # both GPU runners: V2 (vLLM's default) and V1 (VLLM_USE_V2_MODEL_RUNNER=0)
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        _patch_load_model(GPUModelRunner)
        _patch_load_model(V2Runner)
