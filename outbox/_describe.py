"""pydantic's validation errors as one line that names each bad field."""

from __future__ import annotations

from pydantic import ValidationError

MAX_REPORTED = 5


def describe(exc: ValidationError, whole: str) -> str:
    """Each bad field and what is wrong with it (`whole` names an error of no field; "" for
    none, when the caller has named the whole already); never the input, which may be the
    sender's data, or large."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    parts = []
    for err in errors[:MAX_REPORTED]:
        where = ".".join(str(p) for p in err["loc"]) or whole
        said = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {said}" if where else said)
    if len(errors) > MAX_REPORTED:
        parts.append(f"and {len(errors) - MAX_REPORTED} more")
    return "; ".join(parts)
