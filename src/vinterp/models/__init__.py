"""Models vinterp can load without a hub: the bundled SmolLM2 and tiny random test models."""

from vinterp.models.bundled import bundled
from vinterp.models.tiny import ARCHITECTURES, tiny

__all__ = ["ARCHITECTURES", "bundled", "tiny"]
