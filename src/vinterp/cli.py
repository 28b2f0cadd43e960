"""The `vinterp` command: prepare the bundled model, run the demo."""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
]


def _prepare(_: argparse.Namespace) -> None:
    from vinterp.models import bundled

    print(f"bundled model ready at {bundled()}")


def _demo(args: argparse.Namespace) -> None:
    import vinterp

    start = time.perf_counter()
    llm = vinterp.LLM()
    print(f"engine started in {time.perf_counter() - start:.1f} s")
    outputs = llm.generate(DEMO_PROMPTS, max_tokens=args.max_tokens, temperature=0.0)
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        print(f"{prompt!r} -> {out.text!r}")
    llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `vinterp` console script."""
    parser = argparse.ArgumentParser(prog="vinterp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="convert the bundled model once").set_defaults(
        run=_prepare
    )
    demo = commands.add_parser("demo", help="run the bundled model")
    demo.add_argument("--max-tokens", type=int, default=8)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
