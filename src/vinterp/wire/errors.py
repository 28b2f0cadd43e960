"""The one error every decoder of the wire package raises, whatever the input."""

from __future__ import annotations

import reprlib
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 40, 40


class WireError(ValueError):
    """Data from another process or a client that is malformed or asks for something not
    allowed; the message names the field and what would be right."""


def short(value: Any) -> str:
    """A bounded repr for error messages: the input may be huge or deeply nested."""
    return _SHORT.repr(value)
