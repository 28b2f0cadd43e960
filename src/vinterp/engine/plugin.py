"""vLLM general-plugin entry point (declared in pyproject.toml as `vllm.general_plugins`).

vLLM calls `register()` once per process (a forked worker inherits its parent's state), so
the decision cannot be made there: the patched `load_model` installs the sites only in
engines whose config carries vinterp's `additional_config` key. Plain vLLM engines — in
the same process as vinterp ones, or with vinterp merely installed — are unaffected.

vLLM does not catch a plugin's errors: an import of runner modules that a vLLM release moved
would end every vLLM process. So the plugin first checks the release and the classes it patches
(`vllm_boundary.targets`): where they do not fit it patches nothing and logs one warning. The
whole boundary is checked where a vinterp engine starts (`check_boundary`, in the front end
and in each worker), so plain vLLM processes pay nothing for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vinterp.engine.settings import EngineSettings
from vinterp.engine.vllm_boundary import targets
from vinterp.engine.vllm_boundary.engine_config import runner_additional_config
from vinterp.engine.vllm_boundary.load_model import patch_load_model

log = logging.getLogger(__name__)


def vinterp_settings(runner: Any) -> EngineSettings | None:
    """The vinterp settings of the runner's engine; None for a plain vLLM engine."""
    return EngineSettings.of_config(runner_additional_config(runner))


def load_with_sites(load: Callable[[], Any], runner: Any) -> Any:
    """A runner's `load_model`: vLLM's own, then (in a vinterp engine) the sites installed."""
    settings = vinterp_settings(runner)
    if settings is None:
        return load()
    from vinterp.engine.vllm_boundary.kept_layers import keeping_layers
    from vinterp.engine.worker_ext import install_on_runner

    with keeping_layers(settings.num_layers):
        result = load()
    install_on_runner(runner, settings)
    return result


def register() -> None:
    """Patch the model runners' `load_model` (it installs sites only for vinterp engines); on
    the CPU, let vLLM load the compiled model it saved. Where this vLLM does not fit the hooks:
    nothing but a warning that says why."""
    platform = targets.current_platform_name()
    # both GPU runners: V2 (vLLM's default) and V1 (VLLM_USE_V2_MODEL_RUNNER=0)
    patched = [targets.CPU_RUNNER] if platform == "cpu" else [targets.V1_RUNNER, targets.V2_RUNNER]
    version = targets.vllm_version()
    problem = targets.version_problem(version)
    try:
        runners = [targets.resolve(where) for where in patched]
    except (ImportError, AttributeError) as exc:
        problem = problem or targets.boundary_message(version, [f"a runner is gone ({exc})"])
    if problem is not None:
        log.warning("vinterp's vLLM plugin patches nothing: %s", problem)
        return
    for runner in runners:
        patch_load_model(runner, load_with_sites)
    from vinterp.engine.vllm_boundary.kept_layers import patch_weight_loading

    patch_weight_loading()
    if platform == "cpu":
        from vinterp.engine.vllm_boundary.cpu_compile_cache import patch_aot_loading

        patch_aot_loading()
