"""vLLM general-plugin entry point (declared in pyproject.toml as `vllm.general_plugins`).

vLLM calls `register()` once per process (a forked worker inherits its parent's state), so
the decision cannot be made there: the patched `load_model` installs the sites only in
engines whose config carries vinterp's `additional_config` key. Plain vLLM engines — in
the same process as vinterp ones, or with vinterp merely installed — are unaffected.

vLLM does not catch a plugin's errors: an import of runner modules that a vLLM release moved
would end every vLLM process. On a vLLM outside the supported range (`SUPPORTED_VLLM`) the
plugin patches nothing and logs one warning; vinterp engines are refused at their start
(`check_vllm_version`), plain ones run as without vinterp.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vinterp.engine.config_keys import CONFIG_KEY

log = logging.getLogger(__name__)


def wants_sites(runner: Any) -> bool:
    return CONFIG_KEY in (runner.vllm_config.additional_config or {})


def _patch_load_model(runner_cls: Any) -> None:
    original = runner_cls.__dict__.get("load_model")
    if original is None or getattr(original, "_vinterp", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if wants_sites(self):
            from vinterp.engine.worker_ext import install_on_runner

            install_on_runner(self)
        return result

    load_model._vinterp = True  # type: ignore[attr-defined]
    runner_cls.load_model = load_model


def register() -> None:
    """Patch the model runners' `load_model` (it installs sites only for vinterp engines); on
    the CPU, let vLLM load the compiled model it saved. On a vLLM outside the supported range:
    nothing but a warning naming the range."""
    from vinterp.engine.vllm_engine import check_vllm_version

    try:
        check_vllm_version()
    except RuntimeError as unsupported:
        log.warning("vinterp's vLLM plugin patches nothing: %s", unsupported)
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        from vinterp.engine.cpu_compile_cache import patch_aot_loading

        _patch_load_model(CPUModelRunner)
        patch_aot_loading()
    else:  # both GPU runners: V2 (vLLM's default) and V1 (VLLM_USE_V2_MODEL_RUNNER=0)
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        _patch_load_model(GPUModelRunner)
        _patch_load_model(V2Runner)
