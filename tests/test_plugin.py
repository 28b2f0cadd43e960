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
from vinterp.engine.vllm_boundary.kept_layers import beyond

CHECK = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from types import SimpleNamespace
from vinterp.engine.plugin import vinterp_settings
from vinterp.engine.settings import EngineSettings
assert getattr(CPUModelRunner.__dict__["load_model"], "_vinterp", False), "load_model not patched"
plain = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={}))
config = EngineSettings(num_layers=3).to_config()
ours = SimpleNamespace(vllm_config=SimpleNamespace(additional_config=config))
assert vinterp_settings(plain) is None and vinterp_settings(ours).num_layers == 3
print("ok")
"""


def test_plugin_patches_runners_in_a_process_without_vinterp_engines() -> None:
    env_free = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300
    )
    assert env_free.returncode == 0, env_free.stderr[-2000:]
    assert env_free.stdout.strip().endswith("ok")


def test_only_verified_vllm_releases_start_vinterp_engines(monkeypatch) -> None:
    from vinterp.engine.settings import EngineSettings
    from vinterp.engine.vllm_boundary.targets import TRY_VLLM_ENV, version_problem
    from vinterp.engine.vllm_engine import vinterp_engine_arguments

    monkeypatch.delenv(TRY_VLLM_ENV, raising=False)
    for version in ("0.32.0", "0.32.1+cpu", "0.32.2.dev3"):
        assert version_problem(version) is None
    for version in ("0.33.0", "0.34.0", "0.31.2", "1.0.0", "unknown"):
        problem = version_problem(version)
        assert problem is not None and f"vLLM {version} is not supported" in problem
        assert "verified on vLLM 0.32" in problem and TRY_VLLM_ENV in problem
    monkeypatch.setenv(TRY_VLLM_ENV, "0.33")  # a release being verified
    assert version_problem("0.33.0") is None and version_problem("0.34.0") is not None
    # this vLLM passes
    assert vinterp_engine_arguments(EngineSettings())["enable_prefix_caching"] is False


def test_every_declared_target_fits_this_vllm() -> None:
    from vinterp.engine.vllm_boundary.targets import boundary_problems

    assert boundary_problems("cpu") == [] and boundary_problems("gpu") == []


@pytest.mark.parametrize("change", ["removed", "re-signed", "field gone"])
def test_a_moved_target_stops_a_vinterp_engine_before_it_starts(monkeypatch, change) -> None:
    """A vLLM whose internals moved: one error naming the version, the hook and the verified
    releases, raised before any engine process starts (here: by vinterp.LLM itself)."""
    from vllm.forward_context import ForwardContext
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import vinterp
    from vinterp.engine.vllm_boundary import targets

    if change == "removed":
        monkeypatch.delattr(GPUModelRunner, "_prepare_inputs")
        expected = "GPUModelRunner._prepare_inputs is gone"
    elif change == "re-signed":

        def without_force_eager(self, num_tokens, num_reqs, eager=False):  # type: ignore[no-untyped-def]
            raise AssertionError("never called")

        monkeypatch.setattr(
            GPUModelRunner, "_determine_batch_execution_and_padding", without_force_eager
        )
        expected = "_determine_batch_execution_and_padding no longer takes force_eager"
    else:
        fields = dict(ForwardContext.__dataclass_fields__)
        del fields["skip_compiled"]
        monkeypatch.setattr(ForwardContext, "__dataclass_fields__", fields)
        monkeypatch.setattr(ForwardContext, "__annotations__", {})
        monkeypatch.delattr(ForwardContext, "skip_compiled", raising=False)
        expected = "ForwardContext no longer has skip_compiled"
    targets.forget_checks()
    try:
        with pytest.raises(targets.VLLMBoundaryError) as raised:
            vinterp.LLM(vinterp.models.tiny("llama"))
        message = str(raised.value)
        assert expected in message
        assert f"vLLM {vllm.__version__} does not fit" in message
        assert "verified on vLLM 0.32" in message
    finally:
        targets.forget_checks()


def test_plugin_patches_nothing_on_a_vllm_outside_the_supported_range(monkeypatch, caplog) -> None:
    """vLLM lets a plugin's error end the process: on an unsupported release whose runner
    modules moved, register() must return with one warning naming the verified releases, not
    raise."""
    from vinterp.engine.vllm_boundary import targets

    # the runner modules register() imports, as a release that moved them would have them
    for module in (
        "vllm.v1.worker.cpu_model_runner",
        "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.worker.gpu.model_runner",
    ):
        monkeypatch.setitem(sys.modules, module, None)
    for version in ("0.32.0", "0.34.0"):  # a verified release whose modules moved; another
        monkeypatch.setattr(vllm, "__version__", version)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=plugin.__name__):
            plugin.register()
        warnings = [r for r in caplog.records if r.name == plugin.__name__]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert f"vLLM {version}" in warnings[0].getMessage()
        assert "verified on vLLM 0.32" in warnings[0].getMessage()
    targets.forget_checks()


def test_sae_hosts_named_at_start_get_capture_buffers() -> None:
    """An engine told its SAE hosts (`sae_steering_hosts`) buffers their rows in the compiled
    model too, so capturing or extracting their features keeps the steps compiled; other
    buffers stay as asked, and True (every site) stays True."""
    from vinterp.engine.settings import EngineSettings

    def buffers(**kwargs: object) -> object:
        config = EngineSettings.from_keywords(dict(kwargs)).to_config()
        return EngineSettings.of_config(config).capture_buffers  # what the workers read

    host = "layers.3.output"
    assert buffers() is False
    assert buffers(sae_steering_hosts=host) == (host,)
    both = buffers(capture_in_graph="layers.1.output", sae_steering_hosts=["layers.*.mlp.output"])
    assert both == ("layers.1.output", "layers.*.mlp.output")
    assert buffers(capture_in_graph=True, sae_steering_hosts=host) is True
    assert buffers(capture_in_graph=[host], sae_steering_hosts=[host]) == (host,)


def test_engine_settings_reach_the_workers_as_given_and_bad_ones_fail_at_once() -> None:
    """Every setting goes through vLLM's `additional_config` (JSON) and back unchanged; a
    wrong one is refused where it is given, naming it; vLLM's own keywords are left."""
    import json

    from transformers import AutoConfig

    from vinterp.engine.settings import EngineSettings
    from vinterp.models import tiny

    given = {
        "capture_in_graph": ["layers.1.output"],
        "capture_in_graph_rows": "step",
        "check_applied": True,
        "sae_steering_hosts": "layers.0.output",
        "sae_steering_features": 8,
        "num_layers": 2,
        "max_model_len": 256,
    }
    kwargs = dict(given)
    config = AutoConfig.from_pretrained(str(tiny("llama")))
    settings = EngineSettings.from_keywords(kwargs, {"layers": "model.layers"}, config)
    assert kwargs == {"max_model_len": 256}
    wire = json.loads(json.dumps(settings.to_config()))
    assert EngineSettings.of_config(wire) == settings
    assert settings.capture_buffers == ("layers.1.output", "layers.0.output")
    assert EngineSettings.of_config({}) is None
    for bad, named in [
        ({"capture_in_graph": 3}, "capture_in_graph"),
        ({"capture_in_graph_rows": 0}, "capture_in_graph_rows"),
        ({"sae_steering_features": 0}, "sae_steering_features"),
        ({"sae_steering_hosts": "layers.9.output"}, "layers.9.output"),
    ]:
        with pytest.raises((TypeError, ValueError), match=named):
            EngineSettings.from_keywords(bad, config=config)


def test_steering_in_graph_is_a_bool_and_excludes_the_formulas_that_are_part_of_it() -> None:
    """Off, it reaches the workers; a non-bool, or off beside SAE steering hosts or probe
    sites (their formulas are part of the steering formula), is refused naming the setting."""
    from vinterp.engine.settings import EngineSettings

    assert EngineSettings.from_keywords({}).steering_in_graph is True
    off = EngineSettings.from_keywords({"steering_in_graph": False})
    assert EngineSettings.of_config(off.to_config()).steering_in_graph is False
    for bad, named in [
        ({"steering_in_graph": "no"}, "steering_in_graph='no': give True or False"),
        ({"steering_in_graph": False, "sae_steering_hosts": "layers.0.output"}, "sae_steering"),
        ({"steering_in_graph": False, "probe_sites": "layers.0.output"}, "probe_sites"),
    ]:
        with pytest.raises((TypeError, ValueError), match=named):
            EngineSettings.from_keywords(bad)


def test_an_engine_of_the_first_layers_skips_the_checkpoints_later_ones() -> None:
    unused = beyond(2)
    kept = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"]
    skipped = ["model.layers.2.self_attn.q_proj.weight", "model.layers.17.mlp.down_proj.weight"]
    shared = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert not any(map(unused, kept + shared)) and all(map(unused, skipped))
    assert unused("h.3.attn.c_attn.weight") and not unused("h.1.mlp.c_fc.bias")  # GPT-2
    assert not unused("model.layers.12")  # a name, not a layer's weight
