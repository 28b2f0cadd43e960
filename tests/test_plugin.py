"""The vLLM plugin patches the runners in every process, whatever ran there first.

vLLM loads general plugins once per process and forked workers inherit that state, so a
decision taken at plugin load (e.g. from an environment flag) would be stale for a vinterp
engine started after a plain vLLM engine in the same process: its model would run without
sites. The patched `load_model` must therefore exist in every process and decide per engine.
"""

import logging
import subprocess
import sys

import pytest
import vllm

from vinterp.engine import plugin

CHECK = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from types import SimpleNamespace
from vinterp.engine.plugin import wants_sites
assert getattr(CPUModelRunner.__dict__["load_model"], "_vinterp", False), "load_model not patched"
plain = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={}))
ours = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"vinterp_sites": 5}))
assert not wants_sites(plain) and wants_sites(ours)
print("ok")
"""


def test_plugin_patches_runners_in_a_process_without_vinterp_engines() -> None:
    env_free = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300
    )
    assert env_free.returncode == 0, env_free.stderr[-2000:]
    assert env_free.stdout.strip().endswith("ok")


def test_vllm_releases_outside_the_supported_range_are_refused_before_a_start() -> None:
    from vinterp.engine.vllm_engine import check_vllm_version, vinterp_engine_settings

    for version in ("0.32.0", "0.32.1+cpu", "0.32.2.dev3", "0.33.0", "0.33.1"):
        check_vllm_version(version)
    for version in ("0.34.0", "0.31.2", "1.0.0", "unknown"):
        with pytest.raises(RuntimeError, match=r"supports vLLM >= 0\.32, < 0\.34"):
            check_vllm_version(version)
    assert vinterp_engine_settings()["enable_prefix_caching"] is False  # this vLLM passes


def test_plugin_patches_nothing_on_a_vllm_outside_the_supported_range(monkeypatch, caplog) -> None:
    """vLLM lets a plugin's error end the process: on an unsupported release whose runner
    modules moved, register() must return with one warning naming the range, not raise."""
    # the runner modules register() imports, as a release that moved them would have them
    for module in (
        "vllm.v1.worker.cpu_model_runner",
        "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.worker.gpu.model_runner",
    ):
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    with pytest.raises(ImportError):  # a supported release reaches the moved modules
        plugin.register()
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    warnings = [r for r in caplog.records if r.name == plugin.__name__]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "vLLM 0.34.0 is not supported" in warnings[0].getMessage()
    assert ">= 0.32, < 0.34" in warnings[0].getMessage()
