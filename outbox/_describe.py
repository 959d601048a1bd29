"""pydantic's validation errors as one line that names each bad field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

MAX_REPORTED = 5


def describe(exc: ValidationError, whole: str) -> str:
    """Each bad field and what is wrong with it (`whole` names an error of no field; "" for
    none, when the caller has named the whole already); never the input, which may be the
    sender's data, or large."""
    errors = _unions_folded(
        exc.errors(include_url=False, include_input=False, include_context=False)
    )
    parts = []
    for loc, msg in errors[:MAX_REPORTED]:
        where = ".".join(str(p) for p in loc) or whole
        said = msg.removeprefix("Value error, ")
        parts.append(f"{where}: {said}" if where else said)
    if len(errors) > MAX_REPORTED:
        parts.append(f"and {len(errors) - MAX_REPORTED} more")
    return "; ".join(parts)


# pydantic's tags of a union's members (`str | int | float | bool`) at the end of an error's loc
_UNION_TAGS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}


def _unions_folded(errors: list[Any]) -> list[tuple[tuple[Any, ...], str]]:
    """(loc, message) of each error, those of one value refused by every member of a union
    folded into one: four lines for one bad value used up the errors reported, and hid the
    next setting's."""
    order: list[tuple[Any, ...]] = []  # each error's loc, or its union's (folded below)
    members: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], str]]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        union = len(loc) > 1 and loc[-1] in _UNION_TAGS and err["type"].endswith("_type")
        key = loc[:-1] if union else loc
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append((loc, err["msg"]))
    folded: list[tuple[tuple[Any, ...], str]] = []
    for key in order:
        found = members[key]
        if len(found) > 1 and all(loc[:-1] == key for loc, _ in found):
            tags = " or ".join(_UNION_TAGS[loc[-1]] for loc, _ in found)
            folded.append((key, f"Input should be {tags}"))
        else:
            folded.extend(found)
    return folded
