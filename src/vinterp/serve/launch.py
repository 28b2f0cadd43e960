"""Start vLLM's OpenAI-compatible server as a vinterp engine: sites installed in the workers,
vinterp's RPCs on them, the `vinterp` body field handled by a middleware. Every other flag is
vLLM's own and passes through unchanged."""

from __future__ import annotations

import json
import os

from vinterp.engine.vllm_engine import vinterp_engine_settings
from vinterp.engine.vllm_serve import run_vllm_serve, with_checkpoint_dtype

MIDDLEWARE = "vinterp.serve.fields.vinterp_fields"


def vllm_serve_argv(
    model: str,
    host: str,
    port: int,
    api_key: str | None,
    rest: list[str],
    capture_in_graph: bool | str | list[str] = False,
) -> list[str]:
    """The arguments of `vllm serve` for a vinterp server."""
    settings = vinterp_engine_settings(capture_in_graph=capture_in_graph)
    argv = [
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--worker-extension-cls",
        settings["worker_extension_cls"],
        "--additional-config",
        json.dumps(settings["additional_config"]),
        "--middleware",
        MIDDLEWARE,
        "--seed",
        str(settings["seed"]),
    ]
    if not settings["enable_prefix_caching"] and "--enable-prefix-caching" not in rest:
        argv.append("--no-enable-prefix-caching")
    if api_key:
        argv += ["--api-key", api_key]
    return argv + rest


def allow_routes_plugin() -> None:
    """vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them, and that list then
    also limits the general plugins: name vinterp's routes and keep every general plugin
    that would have loaded (an allowlist the user set is extended, not replaced), vinterp's
    own (`vinterp`, which installs the sites) always."""
    from importlib.metadata import entry_points

    from vinterp.serve.routes import PLUGIN_NAME

    current = os.environ.get("VLLM_PLUGINS")
    names = (
        [n for n in current.split(",") if n]
        if current is not None
        else [ep.name for ep in entry_points(group="vllm.general_plugins")]
    )
    os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*names, "vinterp", PLUGIN_NAME]))


def serve(
    model: str | None,
    host: str,
    port: int,
    api_key: str | None,
    rest: list[str],
    capture_in_graph: bool | str | list[str] = False,
) -> None:
    """Run the server in this process until it is stopped (the bundled model by default)."""
    if model is None:
        from vinterp.models import bundled

        model = str(bundled())
    allow_routes_plugin()
    from transformers import AutoConfig

    from vinterp.engine.vllm_engine import check_capture_in_graph

    check_capture_in_graph(
        AutoConfig.from_pretrained(model), {"capture_in_graph": capture_in_graph}
    )
    rest = with_checkpoint_dtype(model, rest)
    run_vllm_serve(
        vllm_serve_argv(model, host, port, api_key, rest, capture_in_graph), "vinterp serve"
    )
    from vinterp.serve.routes import ENGINE_DIED

    if ENGINE_DIED.is_set():
        raise SystemExit("vinterp serve: the engine died while serving (its error is above)")
