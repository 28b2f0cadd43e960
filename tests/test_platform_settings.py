"""The environment vinterp sets per platform: core binding for vLLM CPU workers, the process
start method on a GPU."""

import pytest

from vinterp.engine.cpu_settings import thread_binding
from vinterp.engine.platform_settings import MULTIPROC_METHOD


def test_one_worker_gets_every_core() -> None:
    assert thread_binding(1, [0, 1]) == "0,1"


def test_workers_split_cores_evenly() -> None:
    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"


def test_more_workers_than_cores_share() -> None:
    assert thread_binding(4, [2, 3]) == "2|3|2|3"


def test_a_child_process_recomputes_what_vinterp_set() -> None:
    """A script started from a process whose last engine had one worker must not take that
    binding for a two-worker engine of its own (it is vinterp's setting, not the user's)."""
    import os
    import subprocess
    import sys

    from vinterp.engine.cpu_settings import configure_cpu_environment

    configure_cpu_environment(1)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from vinterp.engine.cpu_settings import configure_cpu_environment as c;"
            " c(2); print(os.environ['VLLM_CPU_OMP_THREADS_BIND'])",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"]},
        check=True,
    )
    assert child.stdout.strip().count("|") == 1  # two groups of cores, one per worker
    user = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VINTERP_CPU_SETTINGS": ""}
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from vinterp.engine.cpu_settings import "
            "configure_cpu_environment as c; c(2); print(os.environ['VLLM_CPU_OMP_THREADS_BIND'])",
        ],
        capture_output=True,
        text=True,
        env=user,
        check=True,
    )
    assert child.stdout.strip() == "0"  # the user's own value is kept


@pytest.fixture
def on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's vLLM platform reports a GPU (the settings are read, no engine starts)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    no_start_method(monkeypatch)


def no_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the start method for one test, and restore it after (whatever the test set)."""
    monkeypatch.setenv(MULTIPROC_METHOD, "")  # recorded, so a value set later is undone
    monkeypatch.delenv(MULTIPROC_METHOD)


def test_engines_on_a_gpu_spawn_their_processes(on_gpu: None) -> None:
    import os

    from vinterp.engine.settings import EngineSettings
    from vinterp.engine.vllm_engine import engine_arguments

    arguments = engine_arguments("model", "bfloat16", 1, 1, EngineSettings(), {})
    assert arguments["model"] == "model"
    assert os.environ[MULTIPROC_METHOD] == "spawn"


def test_a_users_start_method_is_kept_on_a_gpu(
    on_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from vinterp.engine.platform_settings import configure_engine_environment

    monkeypatch.setenv(MULTIPROC_METHOD, "fork")
    configure_engine_environment(1)
    assert os.environ[MULTIPROC_METHOD] == "fork"


def test_cpu_engines_keep_vllms_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vinterp.engine.platform_settings import configure_engine_environment

    no_start_method(monkeypatch)
    configure_engine_environment(1)
    assert MULTIPROC_METHOD not in os.environ
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"]
