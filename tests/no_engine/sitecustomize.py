"""The fast tier's guard: in a run of no `engine`-marked test (`pytest -m "not engine"`,
`make test-fast`), any vLLM engine start fails at once with MESSAGE.

tests/conftest.py loads this file into the pytest process and, for every child process, sets
VINTERP_TEST_NO_ENGINE=1 and puts this folder first on PYTHONPATH, so Python children (test
scripts, `vinterp serve`, vLLM's own processes) load it as their sitecustomize too.

Every vLLM engine (vllm.LLM, vLLM's AsyncLLM, `vllm serve`, vinterp's engines, which wrap
them) starts by making an engine-core client, and its core by building an EngineCore: both
are refused, patched when vLLM's module is imported (vLLM is imported lazily). A `vinterp
serve` or `vllm serve` child is refused before it starts.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ENV = "VINTERP_TEST_NO_ENGINE"
MESSAGE = (
    "this test starts an engine: mark it engine (pytestmark = pytest.mark.engine(name), see"
    " tests/conftest.py); `pytest -m 'not engine'` runs only tests that start none"
)


class EngineStartRefused(RuntimeError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise EngineStartRefused(MESSAGE)


def _patch_clients(module: Any) -> None:
    module.EngineCoreClient.make_client = staticmethod(_refuse)
    module.EngineCoreClient.make_async_mp_client = staticmethod(_refuse)


def _patch_core(module: Any) -> None:
    module.EngineCore.__init__ = _refuse


PATCHES = {"vllm.v1.engine.core_client": _patch_clients, "vllm.v1.engine.core": _patch_core}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds PATCHES' modules through the other finders and patches each once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _serves(args: Any) -> bool:
    """Whether a child's argv runs `vinterp serve` or `vllm serve`."""
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    words = [w for a in argv for w in a.split()]
    tools = {Path(w).name.split(".")[0] for w in words}
    return "serve" in words and bool(tools & {"vinterp", "vllm"})


def install() -> None:
    """Refuse engine starts in this process (idempotent)."""
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchOnImport())
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    popen_init = subprocess.Popen.__init__

    def guarded_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _serves(args):
            raise EngineStartRefused(MESSAGE)
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded_init  # type: ignore[method-assign]


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the interpreter has one."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        if not entry or Path(entry).resolve() == here:
            continue
        other = Path(entry) / "sitecustomize.py"
        if other.is_file():
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", other)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if __name__ == "sitecustomize":
    _chain()
    if os.environ.get(ENV):
        install()
