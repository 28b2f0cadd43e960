"""Start vLLM's OpenAI-compatible server as a vinterp engine: sites installed in the workers,
vinterp's RPCs on them, the `vinterp` body field handled by a middleware. The command line is
read as `vllm serve` reads it (vLLM's own parser); every flag but vinterp's is vLLM's own and
passes through unchanged."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from vinterp.engine.settings import EngineSettings
from vinterp.engine.vllm_engine import vinterp_engine_arguments
from vinterp.engine.vllm_serve import run_vllm_serve, vllm_serve_parser, with_checkpoint_dtype

MIDDLEWARE = "vinterp.serve.fields.vinterp_fields"
USAGE = "vinterp serve [MODEL] [vinterp's flags] [vLLM serve flags, --model MODEL among them]"
# `--model M` or `--model=M`: how vLLM's own parser finds that flag (FlexibleArgumentParser)
MODEL_FLAG = re.compile(r"^--model(=.+|$)")


def split_model(args: list[str]) -> tuple[str | None, list[str]]:
    """The model and vLLM's other arguments, in their order, from `vinterp serve`'s arguments
    once vinterp's own flags are taken out. vLLM's own parser reads them, so a flag's value is
    never taken for the model: the model is the positional argument (first, as `vllm serve
    MODEL`, or after flags and their values) or `--model MODEL` anywhere; None when neither
    gives one (a `--config` file's `model` excepted): the bundled model. A flag vLLM does not
    know, a missing value, a second model end the command as vLLM's parser ends it (usage,
    error line, exit status 2) before anything starts."""
    parser = vllm_serve_parser("vinterp serve", USAGE)
    parser.set_defaults(model=None)  # vLLM's default model is not vinterp's
    parsed = parser.parse_args(args)
    given = [i for i, arg in enumerate(args) if MODEL_FLAG.match(arg)]
    if len(given) > 1 or (given and parsed.model_tag is not None):
        parser.error("the model is given twice: give it first or as --model MODEL, once")
    if given:
        at = given[0]
        return parsed.model, args[:at] + args[at + (2 if args[at] == "--model" else 1) :]
    model = parsed.model_tag
    if model is None:
        return parsed.model, list(args)
    found = [i for i, arg in enumerate(args) if arg == model]
    if args[0] != model and len(found) > 1:  # the first argument can only be the positional
        parser.error(f"{model} is the model and a flag's value: give the model first")
    at = 0 if args[0] == model else found[0]
    return model, args[:at] + args[at + 1 :]


def check_model(model: str) -> str:
    """`model` as the server loads it: a file or folder here (`~` expanded), or else a Hugging
    Face repo id (`name` or `org/name`, as huggingface_hub validates one), which vLLM fetches.
    Anything else (`/...`, `./...`, `../...`, `~/...`, `a/b/c`) names a local path; a missing
    one ends the command with one line naming it (exit status 1) before anything starts."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = Path(model).expanduser()
    if path.exists():
        return str(path) if model.startswith("~") else model
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise SystemExit(f"vinterp serve: no model at {model} (no such file or folder)") from None
    return model


def model_config(model: str) -> Any:
    """The checkpoint's HF config; one that cannot be read (a folder without a checkpoint's
    config.json, an architecture transformers does not know, a repo id not found or not
    reachable) ends the command with one line naming the model and the reason's first line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SystemExit(f"vinterp serve: cannot load the model {model}: {reason}") from None


def vllm_serve_argv(
    model: str,
    host: str,
    port: int,
    api_key: str | None,
    rest: list[str],
    settings: EngineSettings,
) -> list[str]:
    """The arguments of `vllm serve` for a vinterp server."""
    settings = vinterp_engine_arguments(settings)
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
    probe_sites: list[str] | None = None,
) -> None:
    """Run the server in this process until it is stopped (the bundled model by default)."""
    if model is None:
        from vinterp.models import bundled

        model = str(bundled())
    model = check_model(model)
    config = model_config(model)
    allow_routes_plugin()
    settings = EngineSettings.from_keywords(
        {"capture_in_graph": capture_in_graph, "probe_sites": probe_sites}, config=config
    )
    rest = with_checkpoint_dtype(model, rest)
    run_vllm_serve(vllm_serve_argv(model, host, port, api_key, rest, settings), "vinterp serve")
    from vinterp.serve.routes import ENGINE_DIED

    if ENGINE_DIED.is_set():
        raise SystemExit("vinterp serve: the engine died while serving (its error is above)")
