"""The calls the front end makes to vinterp in vLLM's workers, typed: one client for the
engine, the async engine and the server routes.

Each method names the `VinterpWorkerExtension` method it calls by the method itself (its
`__name__`), not by a string, so a call the workers do not have fails where the client is
exercised (tests/test_worker_calls.py), never first in production. `collective_rpc` answers
with every worker's reply in a list, or with an awaitable of that list on the async engine
and the server: the client hands back whichever it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from vinterp.engine.worker_ext import VinterpWorkerExtension as Workers

Answer = TypeVar("Answer")  # the per-worker replies, or an awaitable of them


class WorkerCalls(Generic[Answer]):
    """`rpc(name, args)` sends one call to every worker (`collective_rpc` or its
    non-blocking form)."""

    def __init__(self, rpc: Callable[[str, tuple[Any, ...]], Answer]) -> None:
        self._rpc = rpc

    @classmethod
    def of(cls, engine: Any) -> WorkerCalls[Any]:
        """The calls of a vLLM engine (`vllm.LLM`, vLLM's `AsyncLLM` or a server's engine
        client): `engine.collective_rpc`."""
        return cls(lambda name, args: engine.collective_rpc(name, args=args))

    def _call(self, method: Callable[..., Any], *args: Any) -> Answer:
        return self._rpc(method.__name__, args)

    def begin(self, trace_id: str, wire: dict[str, Any]) -> Answer:
        """Per worker: None, or why the trace cannot start."""
        return self._call(Workers.vinterp_begin, trace_id, wire)

    def collect(self, trace_id: str) -> Answer:
        """Per worker: the trace's saved values and failure."""
        return self._call(Workers.vinterp_collect, trace_id)

    def forget(self, trace_id: str) -> Answer:
        return self._call(Workers.vinterp_forget, trace_id)

    def attach_sae(self, site: str, wire: dict[str, Any]) -> Answer:
        """Per worker: None, or why the SAE cannot be attached."""
        return self._call(Workers.vinterp_attach_sae, site, wire)

    def set_steering(self, wires: list[dict[str, Any]]) -> Answer:
        return self._call(Workers.vinterp_set_steering, wires)

    def register_steering(self, name: str, wire: dict[str, Any] | None) -> Answer:
        return self._call(Workers.vinterp_register_steering, name, wire)

    def take_captures(
        self, capture_ids: list[str], handoff: dict[str, str] | None = None
    ) -> Answer:
        """Per worker: the captures' rows (inline, or in the files `handoff` names)."""
        return self._call(Workers.vinterp_take_captures, capture_ids, handoff)

    def unapplied(self) -> Answer:
        """Per worker: what its applied check found since the last call."""
        return self._call(Workers.vinterp_unapplied)

    def step_stats(self) -> Answer:
        return self._call(Workers.vinterp_step_stats)

    def held_state(self) -> Answer:
        """Per worker: how much per-trace state it holds."""
        return self._call(Workers.vinterp_held_state)
