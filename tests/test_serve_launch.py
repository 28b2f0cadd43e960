"""How `vinterp serve` starts vLLM's server, without starting it: its command line, read as
`vllm serve` reads it (vLLM's own parser: a flag's value is never the model), the model checked
before anything starts, the arguments that make it a vinterp engine, and the plugin allowlist
that brings in vinterp's routes (vLLM loads an endpoint plugin only when VLLM_PLUGINS names it,
and that list then limits every plugin)."""

from __future__ import annotations

import json
import os
from importlib.metadata import entry_points

import pytest

import vinterp.serve.launch as launch
from vinterp.cli import main
from vinterp.engine.settings import EngineSettings
from vinterp.models import bundled
from vinterp.serve.launch import allow_routes_plugin, check_model, vllm_serve_argv
from vinterp.serve.routes import PLUGIN_NAME

SITES = "layers.*.output"


def test_argv_makes_a_vinterp_engine_and_passes_vllm_flags_through() -> None:
    plain = EngineSettings()
    argv = vllm_serve_argv("m", "127.0.0.1", 8123, "k", ["--max-model-len", "512"], plain)
    assert argv[0] == "m" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--api-key") + 1] == "k"
    settings = json.loads(argv[argv.index("--additional-config") + 1])
    assert "vinterp_sites" in settings and not settings["vinterp_capture_in_graph"]
    on = vllm_serve_argv("m", "h", 1, None, [], EngineSettings(capture_buffers=True))
    assert json.loads(on[on.index("--additional-config") + 1])["vinterp_capture_in_graph"]
    assert argv[-2:] == ["--max-model-len", "512"]
    assert "--api-key" not in vllm_serve_argv("m", "h", 1, None, [], plain)


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
    seen = []
    monkeypatch.setattr(
        launch,
        "serve",
        lambda model, host, port, key, rest, capture, probes: seen.append((rest, capture, probes)),
    )
    main(["serve", "m", *flags, "--max-model-len", "64"])
    ((rest, capture, probes),) = seen
    assert rest == ["--max-model-len", "64"] and probes is None
    settings = EngineSettings.from_keywords({"capture_in_graph": capture})
    argv = vllm_serve_argv("m", "h", 1, None, rest, settings)
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config["vinterp_capture_in_graph"] == setting


def test_the_probe_sites_flag_reaches_the_engine_config(monkeypatch) -> None:
    """`vinterp serve --probe-sites SITES`: the sites whose probes and gates are compiled."""
    seen = []
    monkeypatch.setattr(launch, "serve", lambda *args: seen.append(args))
    main(["serve", "m", "--probe-sites", "layers.1.output,layers.2.output"])
    ((*_, probes),) = seen
    settings = EngineSettings.from_keywords({"probe_sites": probes})
    argv = vllm_serve_argv("m", "h", 1, None, [], settings)
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config["vinterp_probe_sites"] == ["layers.1.output", "layers.2.output"]


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


@pytest.mark.parametrize(
    "argv, model, rest, port",
    [
        # a vLLM flag's value is never the model: the bundled one, the flag passed on
        (["--dtype", "bfloat16"], None, ["--dtype", "bfloat16"], 8000),
        (["--tensor-parallel-size", "2"], None, ["--tensor-parallel-size", "2"], 8000),
        (["-tp", "2", "--enforce-eager"], None, ["-tp", "2", "--enforce-eager"], 8000),
        (["/path/model", "--port", "9000"], "/path/model", [], 9000),
        (["M", "--dtype", "bfloat16", "--port", "9000"], "M", ["--dtype", "bfloat16"], 9000),
        # vLLM's parser takes the positional after flags and their values too
        (["--dtype", "bfloat16", "M"], "M", ["--dtype", "bfloat16"], 8000),
        (["--model", "/x"], "/x", [], 8000),
        (["--port", "9000", "--model=/x", "--enforce-eager"], "/x", ["--enforce-eager"], 9000),
        (["--enforce-eager", "--model", "org/name"], "org/name", ["--enforce-eager"], 8000),
        (["M", "--tokenizer", "M"], "M", ["--tokenizer", "M"], 8000),
    ],
)
def test_the_command_line_is_read_as_vllm_serve_reads_it(monkeypatch, argv, model, rest, port):
    seen = []
    monkeypatch.setattr(launch, "serve", lambda *args: seen.append(args))
    main(["serve", *argv])
    ((got_model, _, got_port, _, got_rest, _, _),) = seen
    assert (got_model, got_rest, got_port) == (model, rest, port)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["M", "--model", "X"], "the model is given twice"),
        (["--model", "X", "--model", "Y"], "the model is given twice"),
        (["M", "N"], "unrecognized arguments: N"),
        (["--not-a-vllm-flag"], "unrecognized arguments: --not-a-vllm-flag"),
        (["--tokenizer", "M", "M"], "M is the model and a flag's value: give the model first"),
    ],
)
def test_a_command_line_vllm_would_refuse_ends_before_anything_starts(
    monkeypatch, capsys, argv, error
):
    monkeypatch.setattr(launch, "serve", lambda *args: pytest.fail("started"))
    with pytest.raises(SystemExit) as ended:
        main(["serve", *argv])
    assert ended.value.code == 2 and f"vinterp serve: error: {error}" in capsys.readouterr().err


def test_flags_alone_serve_the_bundled_model_with_them(monkeypatch) -> None:
    """`vinterp serve --dtype bfloat16` as far as vLLM's own serve command, which is replaced
    by one that keeps its arguments: the bundled model, the flag once, not the checkpoint's."""
    monkeypatch.setenv("VLLM_PLUGINS", "")  # allow_routes_plugin sets it; restored afterwards
    seen = []
    monkeypatch.setattr(launch, "run_vllm_serve", lambda argv, prog: seen.append(argv))
    main(["serve", "--dtype", "bfloat16", "--port", "9000"])
    (argv,) = seen
    assert argv[0] == str(bundled()) and argv[argv.index("--port") + 1] == "9000"
    assert argv[-2:] == ["--dtype", "bfloat16"] and argv.count("--dtype") == 1


@pytest.mark.parametrize(
    "model",
    [
        "/nonexistent/vinterp-model",
        "./no-such-checkpoint",
        "../no-such-checkpoint",
        "~/no-such-vinterp-checkpoint",
        "no/such/checkpoint",
    ],
)
def test_a_missing_local_model_is_one_line_naming_it(monkeypatch, model) -> None:
    """Exit status 1 with that line (SystemExit with a text), no traceback, nothing started."""
    monkeypatch.setattr(launch, "run_vllm_serve", lambda *args: pytest.fail("started"))
    monkeypatch.setattr(launch, "allow_routes_plugin", lambda: pytest.fail("started"))
    with pytest.raises(SystemExit) as ended:
        main(["serve", model, "--dtype", "bfloat16"])
    assert ended.value.code == f"vinterp serve: no model at {model} (no such file or folder)"
    with pytest.raises(SystemExit) as ended:
        main(["serve", "--port", "9000", "--model", model])
    assert ended.value.code == f"vinterp serve: no model at {model} (no such file or folder)"


def test_a_folder_without_a_checkpoint_is_one_line_naming_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(launch, "run_vllm_serve", lambda *args: pytest.fail("started"))
    monkeypatch.setattr(launch, "allow_routes_plugin", lambda: pytest.fail("started"))
    with pytest.raises(SystemExit) as ended:
        main(["serve", str(tmp_path)])
    assert isinstance(ended.value.code, str) and "\n" not in ended.value.code
    assert ended.value.code.startswith(f"vinterp serve: cannot load the model {tmp_path}: ")


def test_what_is_a_local_path_and_what_a_hub_id(monkeypatch, tmp_path) -> None:
    """A Hugging Face repo id (`name`, `org/name`) is not refused though it is no folder here
    (vLLM fetches it), even when a folder `org` is here; an existing path is served as is,
    `~` expanded."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    for hub_id in ("gpt2", "Qwen/Qwen3-0.6B", "org/name", "my_model-v1.2"):
        assert check_model(hub_id) == hub_id
    assert check_model("org") == "org" and check_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert check_model("~/org") == str(tmp_path / "org")
    for local in ("./name", "/org/name", "org/name/x", "~/name", "..."):
        with pytest.raises(SystemExit):
            check_model(local)
