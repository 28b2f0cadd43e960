"""`llm.steering`: the global steering and the named steerings of one LLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vinterp.api.fast import check_steering
from vinterp.api.specs import Steering

if TYPE_CHECKING:
    from vinterp.api.llm import LLM


class SteeringControl:
    """Global steering applies to every later request, traced or not; named ones on request."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self.active: list[Steering] = []
        self.named: dict[str, Steering] = {}

    def set(self, steering: Steering | list[Steering]) -> None:
        """Replace the global steering (a list adds up)."""
        specs = steering if isinstance(steering, list) else [steering]
        for spec in specs:
            check_steering(spec, self._llm.config, "steering.set")
        self._llm._engine.set_global_steering(specs)
        self.active = list(specs)

    def clear(self) -> None:
        """No global steering: outputs are byte-identical to the unsteered model again."""
        self._llm._engine.set_global_steering([])
        self.active = []

    def register(self, name: str, steering: Steering) -> None:
        """Make `steering` usable as `steering=name` in later requests."""
        check_steering(steering, self._llm.config, f"steering.register({name!r})")
        self._llm._engine.register_steering(name, steering)
        self.named[name] = steering

    def names(self) -> set[str]:
        """The names usable as `steering=name`."""
        return set(self.named)

    def unregister(self, name: str) -> None:
        self._llm._engine.register_steering(name, None)
        self.named.pop(name, None)
