"""Models vinterp can load without a hub: the bundled SmolLM2, tiny random test models, and
model shapes without weights (for engines with random weights)."""

from vinterp.models.bundled import bundled
from vinterp.models.tiny import ARCHITECTURES, LLAMA_3_8B, SHAPES, shape_only, tiny

__all__ = ["ARCHITECTURES", "LLAMA_3_8B", "SHAPES", "bundled", "shape_only", "tiny"]
