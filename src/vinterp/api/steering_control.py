"""`llm.steering`: the global steering and the named steerings of one model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vinterp.api.fast import check_steering
from vinterp.api.specs import Steering

if TYPE_CHECKING:
    from vinterp.api.front_end import TraceFrontEnd


class SteeringState:
    """What the model applies: global steering to every later request, traced or not; named
    ones on request. Specs are checked against the model before any engine sees them."""

    def __init__(self, llm: TraceFrontEnd) -> None:
        self._llm = llm
        self.active: list[Steering] = []  # the global steering now set
        self.named: dict[str, Steering] = {}

    def _checked(self, steering: Steering | list[Steering], where: str) -> list[Steering]:
        specs = steering if isinstance(steering, list) else [steering]
        for spec in specs:
            check_steering(spec, self._llm.config, where)
        return list(specs)

    def names(self) -> set[str]:
        """The names usable as `steering=name`."""
        return set(self.named)


class SteeringControl(SteeringState):
    def set(self, steering: Steering | list[Steering]) -> None:
        """Replace the global steering (a list adds up)."""
        specs = self._checked(steering, "steering.set")
        self._llm._engine.set_global_steering(specs)
        self.active = specs

    def clear(self) -> None:
        """No global steering: outputs are byte-identical to the unsteered model again."""
        self._llm._engine.set_global_steering([])
        self.active = []

    def register(self, name: str, steering: Steering) -> None:
        """Make `steering` usable as `steering=name` in later requests."""
        (spec,) = self._checked(steering, f"steering.register({name!r})")
        self._llm._engine.register_steering(name, spec)
        self.named[name] = spec

    def unregister(self, name: str) -> None:
        self._llm._engine.register_steering(name, None)
        self.named.pop(name, None)


class AsyncSteeringControl(SteeringState):
    """As SteeringControl, awaited (the engine's workers are told asynchronously)."""

    async def set(self, steering: Steering | list[Steering]) -> None:
        specs = self._checked(steering, "steering.set")
        await self._llm._engine.set_global_steering(specs)
        self.active = specs

    async def clear(self) -> None:
        await self._llm._engine.set_global_steering([])
        self.active = []

    async def register(self, name: str, steering: Steering) -> None:
        (spec,) = self._checked(steering, f"steering.register({name!r})")
        await self._llm._engine.register_steering(name, spec)
        self.named[name] = spec

    async def unregister(self, name: str) -> None:
        await self._llm._engine.register_steering(name, None)
        self.named.pop(name, None)
