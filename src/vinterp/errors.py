"""Errors a trace raises at its `with` exit (API.md section 4)."""

from __future__ import annotations


class VinterpError(Exception):
    """Base of vinterp's own errors."""


class TraceError(VinterpError, ValueError):
    """Found before anything ran: unknown site, index out of range, a shape mismatch."""


class OutOfOrderError(TraceError):
    """A write needs a value the forward pass has not produced yet at that point."""


class InterventionError(VinterpError, RuntimeError):
    """An operation failed while the engine ran it; names the user's file:line."""
