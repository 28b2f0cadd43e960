"""Virtual environments for the peers whose packages are not in vinterp's, built from the
package index at their released versions under the vinterp cache directory. A failed
build is remembered with pip's error (the peer's row shows it) until `--setup-peers`."""

from __future__ import annotations

import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vinterp.models.cache import cache_root

# The CPU torch wheel pip finds on local disk: installed first, then held by a constraint,
# so a peer's requirements cannot pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
OK, FAILED = ".vinterp-ok", ".vinterp-failed"


class EnvError(RuntimeError):
    """The environment could not be built; the message is pip's own error."""


@dataclass(frozen=True)
class Env:
    """`packages` on their own interpreter; `layered` environments also see vinterp's
    packages (vLLM among them) and must install next to them without changing any."""

    name: str
    packages: tuple[str, ...]
    layered: bool = False

    @property
    def root(self) -> Path:
        return cache_root() / "bench-peers" / self.name

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"


def ensure(env: Env, rebuild: bool = False) -> Path:
    """The environment's interpreter, built on first use (or again when `rebuild`)."""
    if not rebuild and (env.root / OK).exists():
        return env.python
    if not rebuild and (env.root / FAILED).exists():
        raise EnvError((env.root / FAILED).read_text())
    env.root.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", "--clear", str(env.root)], env)
    constraints = env.root / "constraints.txt"
    if env.layered:
        base = site.getsitepackages()
        where = "import site; print(site.getsitepackages()[0])"
        own = Path(_output([str(env.python), "-c", where]))
        (own / "_vinterp_base.pth").write_text("\n".join(base) + "\n")
        frozen = _output([sys.executable, "-m", "pip", "freeze", "--exclude-editable"])
        constraints.write_text(frozen)
    else:
        _run([str(env.python), "-m", "pip", "install", "-q", TORCH], env)
        constraints.write_text(TORCH + "\n")
    pip = [str(env.python), "-m", "pip", "install", "-q", "-c", str(constraints)]
    _run([*pip, *env.packages], env)
    (env.root / OK).touch()
    return env.python


def _run(command: list[str], env: Env) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        message = "; ".join(errors) or lines[-1]
        (env.root / FAILED).write_text(f"pip install {' '.join(env.packages)}: {message}")
        raise EnvError((env.root / FAILED).read_text())


def _output(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
