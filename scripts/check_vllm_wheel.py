"""Check vinterp's vLLM boundary (`engine/vllm_boundary/targets.py`) against a vLLM wheel that
is not installed, e.g. a CUDA wheel on the CPU machine, before any GPU time is spent on it.

    .venv/bin/python scripts/check_vllm_wheel.py DIR/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

The wheel's Python files, put before the installed vLLM, import on this environment's torch
far enough for every target to resolve (vLLM's compiled kernels are missing and nothing runs),
so each target's module, attribute, parameters and fields are checked as `check_boundary` does
for the GPU and the CPU platform. What it cannot see: behaviour behind an unchanged signature
(read the diff of the hooked code) and anything that needs a GPU (the suite in tests/gpu).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CHECK = """
import vllm
from vinterp.engine.vllm_boundary.targets import boundary_problems
problems = {p: boundary_problems(p) for p in ("gpu", "cpu")}
for platform, found in problems.items():
    print(f"vLLM {vllm.__version__} ({vllm.__file__}), {platform}: "
          f"{'; '.join(found) or 'every target fits'}")
raise SystemExit(1 if any(problems.values()) else 0)
"""


def release(wheel: Path) -> str:
    """ "0.33" of vllm-0.33.0-cp38-abi3-....whl."""
    return ".".join(wheel.name.split("-")[1].split(".")[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    wheel = parser.parse_args().wheel
    with tempfile.TemporaryDirectory() as tree:
        with zipfile.ZipFile(wheel) as archive:
            sources = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            archive.extractall(tree, sources)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([tree, str(SRC)]),
            "VINTERP_TRY_VLLM": release(wheel),  # the release check is not what is asked here
        }
        sys.exit(subprocess.run([sys.executable, "-c", CHECK], env=env).returncode)


if __name__ == "__main__":
    main()
