"""The error answers of vinterp's routes and middleware, in the form of vLLM's server:
`{"error": {"message": ..., "type": ..., "code": status, ...}}`."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


def error_response(message: str, status: int, kind: str, **extra: Any) -> JSONResponse:
    """An error answer with HTTP `status`; `kind` is its `type`, `extra` more fields."""
    error = {"message": message, "type": kind, "code": status, **extra}
    return JSONResponse({"error": error}, status_code=status)


def bad_request(message: str, kind: str = "BadRequestError", **extra: Any) -> JSONResponse:
    """A 400 that names the problem (`extra`: more fields, as the `param` at fault)."""
    return error_response(message, 400, kind, **extra)
