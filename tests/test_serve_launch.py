"""How `vinterp serve` starts vLLM's server, without starting it: the arguments that make it
a vinterp engine, and the plugin allowlist that brings in vinterp's routes (vLLM loads an
endpoint plugin only when VLLM_PLUGINS names it, and that list then limits every plugin)."""

from __future__ import annotations

import json
import os
from importlib.metadata import entry_points

import pytest

from vinterp.serve.launch import allow_routes_plugin, vllm_serve_argv
from vinterp.serve.routes import PLUGIN_NAME

SITES = "layers.*.output"


def test_argv_makes_a_vinterp_engine_and_passes_vllm_flags_through() -> None:
    argv = vllm_serve_argv("m", "127.0.0.1", 8123, "k", ["--max-model-len", "512"])
    assert argv[0] == "m" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--api-key") + 1] == "k"
    settings = json.loads(argv[argv.index("--additional-config") + 1])
    assert "vinterp_sites" in settings and not settings["vinterp_capture_in_graph"]
    on = vllm_serve_argv("m", "h", 1, None, [], capture_in_graph=True)
    assert json.loads(on[on.index("--additional-config") + 1])["vinterp_capture_in_graph"]
    assert argv[-2:] == ["--max-model-len", "512"]
    assert "--api-key" not in vllm_serve_argv("m", "h", 1, None, [])


@pytest.mark.parametrize(
    "flags, setting",
    [
        ([], False),
        (["--capture-in-graph"], True),
        (["--capture-in-graph", "embed.output,layers.*.output"], ["embed.output", SITES]),
    ],
)
def test_the_capture_in_graph_flag_reaches_the_engine_config(monkeypatch, flags, setting) -> None:
    """`vinterp serve [--capture-in-graph [SITES]]`: what the workers read (the server is not
    started: vLLM's serve command is replaced by one that keeps its arguments)."""
    import vinterp.serve.launch as launch
    from vinterp.cli import main

    seen = []
    monkeypatch.setattr(
        launch, "serve", lambda model, host, port, key, rest, capture: seen.append((rest, capture))
    )
    main(["serve", "m", *flags, "--max-model-len", "64"])
    ((rest, capture),) = seen
    assert rest == ["--max-model-len", "64"]
    argv = vllm_serve_argv("m", "h", 1, None, rest, capture)
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config["vinterp_capture_in_graph"] == setting


@pytest.mark.parametrize(
    "before, must_hold",
    [
        (None, {"vinterp", PLUGIN_NAME}),  # unset: every installed general plugin stays
        ("", {"vinterp", PLUGIN_NAME}),  # an empty allowlist still gets vinterp's two
        ("other", {"other", "vinterp", PLUGIN_NAME}),  # the user's list is extended
    ],
)
def test_plugin_allowlist_names_the_routes_and_keeps_the_rest(monkeypatch, before, must_hold):
    monkeypatch.setenv("VLLM_PLUGINS", before or "")  # restored (or removed) afterwards
    if before is None:
        monkeypatch.delenv("VLLM_PLUGINS")
    allow_routes_plugin()
    allowed = os.environ["VLLM_PLUGINS"].split(",")
    assert must_hold <= set(allowed) and len(allowed) == len(set(allowed))
    if before is None:
        assert {ep.name for ep in entry_points(group="vllm.general_plugins")} <= set(allowed)
    assert PLUGIN_NAME in {ep.name for ep in entry_points(group="vllm.endpoint_plugins")}
