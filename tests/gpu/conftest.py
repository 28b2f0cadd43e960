"""GPU acceptance tests: vinterp with CUDA graphs in bf16 against its own `enforce_eager=True`
engine and plain vLLM (test_gpu_check.py, one GPU), attention patterns on two attention
backends and mixture-of-experts routers against transformers (test_gpu_attention.py, one
GPU), and tensor and pipeline parallelism against one worker (test_gpu_parallel.py, two
GPUs). Skipped on a machine without a CUDA GPU (the two-GPU tests: with fewer than two), as on
the CPU machine `make test` runs on; marked `engine` (not in `make test-fast`).

On the lent GPU machine (/work/shared/gpu/README.md: install the wheels, then, in the call
that sends the last part or a later one):

    source .gpu/bin/setup.sh [.gpu/pNN] && \\
        VINTERP_GPU_OUT=$OUT VINTERP_GPU_KEEP=/tmp/gpu-keep python3 -m pytest tests/gpu -q \\
        2>&1 | tee $OUT/log

Each engine start costs a minute or more (over 4 minutes for the first compile on a fresh
machine) and a call at most 10: with VINTERP_GPU_KEEP set, each engine's results are kept
in that folder as soon as it has run, and a later run of the same command (on the same warm
machine, with the same vLLM, torch and source of vinterp and the tests) loads them instead of
starting that engine again. So rerun the command until it passes the time limit; `-k` picks
tests, and only the engines they need start (e.g.
`-k "not plain and not in_graph"`: the vinterp engines with and without graphs only).

Environment:
  VINTERP_GPU_OUT=DIR       write each module's checks (with their numbers), tokens and
                            timings to DIR/<module>.json (gpu_check, gpu_attention,
                            gpu_parallel, gpu_extract)
  VINTERP_GPU_KEEP=DIR      keep and reuse each engine's results (see above)
  VINTERP_GPU_MODEL         test_gpu_check's model: bundled (default), llama1b (a random
                            Llama of ~1B parameters, LLAMA_1B below) or a checkpoint path
  VINTERP_GPU_PARALLEL_MODEL  test_gpu_parallel's: llama1b (default; the bundled model's 9
                            attention heads do not split over two GPUs), tiny or a path
  VINTERP_CHECK_APPLIED=1   every vinterp engine counts on the GPU what its site ops applied,
                            inside the replayed graphs, and raises where a step applied less
                            than it asked for (its timings then include a wait per step)
  VLLM_USE_V2_MODEL_RUNNER=0  vLLM's V1 GPU runner instead of its default V2 one
  VINTERP_GPU_DTYPE=float32 every engine in float32 (default bfloat16); the relative
                            tolerance of captures, saves and logits is then 1e-4
  VINTERP_GPU_MEMORY=0.4    every engine's gpu_memory_utilization (vLLM's default else):
                            lower it to share the cards with another run
  VINTERP_GPU_KV_BYTES=N    every engine's kv_cache_memory_bytes instead: vLLM then sizes
                            the KV cache without the memory profiling that another run's
                            engine on the same card upsets (vLLM 0.33 asserts there)
  VINTERP_GPU_REHEARSAL=1   run the modules on the CPU engine (no GPU needed; the parallel
                            one with VINTERP_GPU_PARALLEL_MODEL=tiny): the tests' own code
                            runs end to end before device time is spent on it. Numbers
                            differ from a GPU's; a failure that is not a tolerance is a bug
                            in the test or in vinterp
  VINTERP_GPU_OUT also receives failures.txt: each failing test's report as it fails (a run
  cut short by a call's time limit still says why)

bf16 tolerances (the default dtype): captures, trace saves and logits within 2e-2 relative
error (captures taken inside the compiled graphs, `capture_in_graph`: 1e-1, compiled-vs-eager
distance); greedy tokens equal for at least 7 of the 8 prompts where the same computation is
compared (vinterp against plain vLLM in the same mode, TP/PP against one worker, unless plain
vLLM's own TP/PP part from its TP=1 on more: test_gpu_parallel). Compiled and eager engines
part on some prompts by themselves (plain vLLM's own: 6/8 for the bundled model on an H200),
so vinterp's compiled-vs-eager token checks ask for at least one fewer than its unsteered
runs share, and those may part no more than plain vLLM's.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sample_prompts import PROMPTS

DTYPE = os.environ.get("VINTERP_GPU_DTYPE", "bfloat16")
REHEARSAL = os.environ.get("VINTERP_GPU_REHEARSAL", "") not in ("", "0")
DEVICE = "cpu" if REHEARSAL else "cuda"  # where the transformers references run
N = len(PROMPTS)
# every engine's share of its cards, where told (another run may hold the rest)
SHARE = (
    {"kv_cache_memory_bytes": int(os.environ["VINTERP_GPU_KV_BYTES"])}
    if os.environ.get("VINTERP_GPU_KV_BYTES")
    else {"gpu_memory_utilization": float(os.environ["VINTERP_GPU_MEMORY"])}
    if os.environ.get("VINTERP_GPU_MEMORY")
    else {}
)
REL_TOL = 1e-4 if DTYPE == "float32" else 2e-2  # captures, saves and logits
MIN_EQUAL = 7  # of 8 prompts' greedy tokens
# A random Llama of ~1B parameters (head size 64) with the tiny models' vocab and tokenizer.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,  # room for max_model_len 2048 (the tiny default is 512)
}


def gpus() -> int:
    """CUDA GPUs visible, asked through NVML where torch can: this process must not initialise
    CUDA before vLLM starts its engine processes."""
    return torch.cuda.device_count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpus(n): the module needs n CUDA GPUs (skipped without, unless rehearsing)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("gpus")
    if mark and gpus() < mark.args[0] and not REHEARSAL:
        pytest.skip(f"needs {mark.args[0]} CUDA GPU(s); VINTERP_GPU_REHEARSAL=1 runs it on the CPU")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failing test's report goes to $VINTERP_GPU_OUT/failures.txt at once."""
    out = os.environ.get("VINTERP_GPU_OUT")
    if out and report.failed:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "failures.txt", "a") as file:
            file.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


class Gpu:
    """What both modules share: the prompts and tolerances, the comparisons, the models."""

    PROMPTS = PROMPTS
    N = N
    REL_TOL = REL_TOL
    MIN_EQUAL = MIN_EQUAL
    DTYPE = DTYPE
    SHARE = SHARE
    DEVICE = DEVICE
    REHEARSAL = REHEARSAL

    @staticmethod
    def equal(a: list[Any], b: list[Any]) -> int:
        """How many of the paired entries are equal."""
        return sum(x == y for x, y in zip(a, b))

    @staticmethod
    def rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
        if a is None or b is None or a.shape != b.shape:
            return math.inf
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    @staticmethod
    def model(name: str) -> Path:
        """bundled, llama1b, tiny or a checkpoint path."""
        import vinterp

        if name == "bundled":
            return vinterp.models.bundled()
        if name == "llama1b":
            return vinterp.models.tiny("llama", **LLAMA_1B)
        if name == "tiny":
            return vinterp.models.tiny("llama")
        return Path(name)

    @staticmethod
    def free_memory() -> None:
        """Between engines: drop dead objects and the allocator's cached blocks."""
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @staticmethod
    def vinterp_engine(model: Path, fn: Callable[[Any], Any], **engine_kwargs: Any) -> Any:
        """Start vinterp.LLM in bf16, return fn(llm), shut it down and free GPU memory."""
        import vinterp

        llm = vinterp.LLM(model, dtype=DTYPE, **{**SHARE, **engine_kwargs})
        try:
            return fn(llm)
        finally:
            llm.shutdown()
            del llm
            Gpu.free_memory()


class Report:
    """A module's checks (each recorded, then asserted by the test) and what its engines
    gave; written to $VINTERP_GPU_OUT/<name>.json when the module ends."""

    def __init__(self, name: str, model: Path | None, module: Path) -> None:
        self.name, self.model, self.module = name, model, module
        self.checks: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}

    def check(self, check: str, numbers: str, ok: bool) -> bool:
        self.checks.append({"check": check, "numbers": numbers, "ok": bool(ok)})
        print(f"{check:<60} {numbers:>18}  {'ok' if ok else 'NOT OK'}")
        return bool(ok)

    def kept(self, engine: str, run: Callable[[], Any]) -> Any:
        """run() (one engine's results); with VINTERP_GPU_KEEP, saved there once run and
        loaded instead of running by later runs of the same module and model, with the same
        settings, vLLM and torch versions and source (`source_digest`)."""
        keep = os.environ.get("VINTERP_GPU_KEEP")
        if not keep:
            return run()
        import vllm

        settings = [str(self.model), DTYPE, vllm.__version__, torch.__version__] + [
            f"{k}={os.environ.get(k, '')}"
            for k in ("VINTERP_CHECK_APPLIED", "VLLM_USE_V2_MODEL_RUNNER")
        ]
        settings.append(source_digest(self.module))
        digest = hashlib.sha256("\n".join(settings).encode()).hexdigest()[:12]
        model = self.model.name if self.model else "models"
        file = Path(keep) / f"{self.name}-{model}-{digest}-{engine}.pt"
        if file.exists():
            return torch.load(file, weights_only=False)
        result = run()
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, file)
        return result

    def write(self) -> None:
        out = os.environ.get("VINTERP_GPU_OUT")
        if not out:
            return
        doc = {"machine": machine(self.model), "checks": self.checks, **self.data}
        path = Path(out) / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"written {path}")


def source_digest(module: Path) -> str:
    """A digest of the code whose results VINTERP_GPU_KEEP keeps: the imported vinterp
    package's source (wherever it was imported from: a checkout, edited or not, or a snapshot
    without git), the test module, this file and the prompts."""
    import vinterp

    package = Path(vinterp.__file__).parent
    files = [(p.relative_to(package), p) for p in sorted(package.rglob("*.py"))]
    files += [
        (p.name, p)
        for p in (module, Path(__file__), Path(__file__).parents[1] / "sample_prompts.py")
    ]
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(f"{name}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def machine(model: Path | None) -> dict[str, Any]:
    """Where and how the module ran."""
    import importlib.metadata

    import vllm

    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "device": torch.cuda.get_device_name(0) if gpus() else platform.processor(),
        "gpus": gpus(),
        "commit": commit,
        "vinterp": importlib.metadata.version("vinterp"),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": DTYPE,
        "model": str(model) if model else "each check's own",
        "runner": "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "vllm default",
        "check_applied": os.environ.get("VINTERP_CHECK_APPLIED", "") not in ("", "0"),
    }


@pytest.fixture(scope="session")
def gpu() -> Gpu:
    return Gpu()


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest, engines: Any) -> Iterator[Report]:
    """The module's report; its model is the module's `MODEL_ENV` setting (else
    `DEFAULT_MODEL`); a module without `MODEL_ENV` runs several models and names each in its
    checks. The shared engine of the other tests is stopped first: these start their own,
    one at a time."""
    engines.release()
    module = request.module
    model = None
    if hasattr(module, "MODEL_ENV"):
        model = Gpu.model(os.environ.get(module.MODEL_ENV) or module.DEFAULT_MODEL)
    report = Report(module.__name__.removeprefix("test_"), model, Path(module.__file__))
    yield report
    report.write()
