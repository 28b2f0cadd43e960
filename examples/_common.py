"""The command line every example shares: `--out DIR`, `--backend`, one engine start.

Each example keeps its research in `run(llm, out_dir)`; only this start-up is common, so it
lives here once instead of in a copy per script. The examples import it in their
`if __name__ == "__main__":` block, where `python examples/NAME.py` puts this folder on
sys.path; `tests/test_examples.py` imports the scripts and calls `run` without it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vinterp


def main(run: Callable[[vinterp.LLM, Path], Any], doc: str) -> None:
    """Parse `--out DIR` (default examples/out) and `--backend vllm|hf` (hf: the transformers
    reference), start the bundled model and call `run(llm, out)`; `doc` is the example's module
    docstring, whose first line describes the script in `--help`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    args = parser.parse_args()
    with vinterp.LLM(backend=args.backend) as llm:
        run(llm, args.out)
