"""vinterp's errors: those a trace raises at its `with` exit (API.md section 4), and a
capture sink's."""

from __future__ import annotations


class VinterpError(Exception):
    """Base of vinterp's own errors."""


class TraceError(VinterpError, ValueError):
    """Found before anything ran: unknown site, index out of range, a shape mismatch."""


class OutOfOrderError(TraceError):
    """A write needs a value the forward pass has not produced yet at that point."""


class InterventionError(VinterpError, RuntimeError):
    """An operation failed while the engine ran it; names the user's file:line."""


class CaptureWriteError(VinterpError, OSError):
    """A filesystem sink could not write some requests' captures (a full disk, a folder it
    may not write). Nothing else is lost: `outputs` holds every request's output, with the
    files that were written named in them."""

    def __init__(self, message: str, outputs: list) -> None:
        super().__init__(message)
        self.outputs = outputs
