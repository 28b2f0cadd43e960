"""Core binding for vLLM CPU workers."""

from vinterp.engine.cpu_settings import thread_binding


def test_one_worker_gets_every_core() -> None:
    assert thread_binding(1, [0, 1]) == "0,1"


def test_workers_split_cores_evenly() -> None:
    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"


def test_more_workers_than_cores_share() -> None:
    assert thread_binding(4, [2, 3]) == "2|3|2|3"
