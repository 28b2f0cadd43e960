"""Core binding for vLLM CPU workers."""

from vinterp.engine.cpu_settings import thread_binding


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
