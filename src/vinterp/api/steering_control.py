"""`model.steering`: the global steering and the named steerings of one model, kept by its
backend (a server's named steerings are shared by all of its clients)."""

from __future__ import annotations

from vinterp.api.front_end import TraceFrontEnd
from vinterp.api.requests import check_steering
from vinterp.wire.specs import Steering


class SteeringRegistry:
    """What the model applies: global steering to every later request, traced or not; named
    ones on request. Specs are checked against the model before any engine sees them."""

    def __init__(self, model: TraceFrontEnd) -> None:
        self._model = model
        self.active: list[Steering] = []  # the global steering set through this object

    def _checked(self, steering: Steering | list[Steering], where: str) -> list[Steering]:
        specs = steering if isinstance(steering, list) else [steering]
        for spec in specs:
            check_steering(spec, self._model.config, self._model.saes, where, shared=True)
        return list(specs)


class SteeringControl(SteeringRegistry):
    def set(self, steering: Steering | list[Steering]) -> None:
        """Replace the global steering (a list adds up)."""
        specs = self._checked(steering, "steering.set")
        self._model.backend.set_global_steering(specs)
        self.active = specs

    def clear(self) -> None:
        """No global steering: outputs are byte-identical to the unsteered model again."""
        self._model.backend.set_global_steering([])
        self.active = []

    def register(self, name: str, steering: Steering) -> None:
        """Make `steering` usable as `steering=name` in later requests."""
        (spec,) = self._checked(steering, f"steering.register({name!r})")
        self._model.backend.register_steering(name, spec)

    def unregister(self, name: str) -> None:
        self._model.backend.register_steering(name, None)

    def names(self) -> set[str]:
        """The names usable as `steering=name`."""
        return self._model.backend.steering_names()


class AsyncSteeringControl(SteeringRegistry):
    """As SteeringControl, awaited (the engine's workers or the server are told
    asynchronously)."""

    async def set(self, steering: Steering | list[Steering]) -> None:
        specs = self._checked(steering, "steering.set")
        await self._model.backend.set_global_steering(specs)
        self.active = specs

    async def clear(self) -> None:
        await self._model.backend.set_global_steering([])
        self.active = []

    async def register(self, name: str, steering: Steering) -> None:
        (spec,) = self._checked(steering, f"steering.register({name!r})")
        await self._model.backend.register_steering(name, spec)

    async def unregister(self, name: str) -> None:
        await self._model.backend.register_steering(name, None)

    async def names(self) -> set[str]:
        return await self._model.backend.steering_names()
