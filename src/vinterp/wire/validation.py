"""Decoding a spec's data from anyone: the fields checked, pydantic's validation errors turned
into one WireError naming each field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from vinterp.wire.errors import WireError


def check_fields(obj: Any, what: str, fields: dict[str, Any]) -> None:
    """A spec's data is an object with its first field and no unknown ones."""
    first = next(iter(fields))
    if not isinstance(obj, dict) or first not in obj:
        raise WireError(f"{what}: expected {{{', '.join(fields)}}} with {first}")
    unknown = [k for k in obj if k not in fields]
    if unknown:
        raise WireError(
            f"{what}: unknown fields {[str(k) for k in unknown][:5]}; the fields are "
            f"{', '.join(fields)}"
        )


def validated(cls: type[BaseModel], what: str, fields: dict[str, Any]) -> Any:
    """`cls(**fields)` with pydantic's validation errors as one WireError naming each field."""
    try:
        return cls(**fields)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            message = str(error["msg"]).removeprefix("Value error, ")
            field_name = str(error["loc"][0]) if error["loc"] else ""
            problems.append(
                f"{what}.{message}"
                if not field_name or message.startswith(field_name)
                else f"{what}.{field_name}: {message}"
            )
        raise WireError("; ".join(problems)) from None
    except (TypeError, ValueError) as exc:  # e.g. torch refusing a vector's values
        raise WireError(f"{what}: {exc}") from None
