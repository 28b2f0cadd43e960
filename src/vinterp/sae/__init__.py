"""Sparse autoencoders in SAELens's format, with SAELens's inference math (no SAELens import)."""

from vinterp.sae.model import SAE

__all__ = ["SAE"]
