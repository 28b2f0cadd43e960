"""A worker call whose answer is waited for later, on a deadline and on the engine's life.

`LLM.collective_rpc` blocks its caller until the engine core has finished its current step
and run the call: a loop that feeds the
engine requests and takes captured rows once per shard then spends its time waiting while
the queued requests run out (measured on an H200: 91% of the loop's time). Here the call
is sent as `collective_rpc` sends it, and the answer is a future the client's output thread
fills."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

POLL_S = 0.5  # how often a wait looks whether the engine core has died
# How long a wait for the workers' answer lasts at most: the engine core runs a utility call
# between two steps, so only a protocol that changed under vinterp leaves it unanswered
ANSWER_TIMEOUT_S = float(os.environ.get("VINTERP_ENGINE_CALL_TIMEOUT_S", "600"))


def collective_rpc_later(llm: Any, method: str, args: tuple = ()) -> Callable[..., list[Any]]:
    """Send `method(*args)` to every worker of `llm` (a `vllm.LLM`) now, from the thread that
    also adds its requests; the returned call waits for the workers' answers, from any
    thread, at most `timeout` seconds (default `ANSWER_TIMEOUT_S`; then TimeoutError), and
    raises vLLM's EngineDeadError within a second of the engine core dying (its answer would
    never come). An engine core in this process answers at once."""
    client = llm.llm_engine.engine_core
    utility_results = getattr(client, "utility_results", None)
    send = getattr(client, "_send_input", None)
    if not isinstance(utility_results, dict) or send is None:
        answers = llm.collective_rpc(method, args=args)
        return lambda timeout=ANSWER_TIMEOUT_S: answers
    from vllm.v1.engine import EngineCoreRequestType

    call_id = uuid.uuid1().int >> 64  # as vLLM's `call_utility` numbers its calls
    answer: Future[list[Any]] = Future()
    utility_results[call_id] = answer
    send(EngineCoreRequestType.UTILITY, (0, call_id, "collective_rpc", (method, None, args, None)))
    alive = engine_alive(llm)

    def wait(timeout: float = ANSWER_TIMEOUT_S) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = min(POLL_S, deadline - time.monotonic())
            try:
                return answer.result(timeout=max(left, 0.0))
            except TimeoutError:  # concurrent.futures.TimeoutError is this one
                if not alive():
                    from vllm.v1.engine.exceptions import EngineDeadError

                    raise EngineDeadError() from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the workers did not answer {method} within {timeout:.0f} s while the "
                        "engine core ran (VINTERP_ENGINE_CALL_TIMEOUT_S sets the limit)"
                    ) from None

    return wait


def engine_alive(llm: Any) -> Callable[[], bool]:
    """Whether the engine core of `llm` (a `vllm.LLM`) still runs: vLLM's client marks it dead
    when the core's process ends. An engine core in this process counts as running."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    return lambda: not getattr(resources, "engine_dead", False)
