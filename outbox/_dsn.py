"""A libpq connection string checked before use, without ever quoting it.

libpq's parse errors quote what they stumbled on: the password itself ("invalid percent-encoded
token"), or the whole URI. Printed by a failing round or command, that went to every log line.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox._errors import InvalidConfigError

_QUOTED = re.compile(r'"[^"]*"')


def parse_dsn(dsn: str, what: str = "the DSN") -> dict[str, Any]:
    """The connection parameters of `dsn`; InvalidConfigError naming `what` and libpq's reason,
    with what libpq quoted left out, when libpq cannot parse it."""
    try:
        return conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        reason = _QUOTED.sub('"..."', str(exc).strip())
        hint = " (a '%' in a URI is written %25)" if "percent" in reason else ""
        raise InvalidConfigError(
            f"{what} is not a libpq connection string or URI: {reason}{hint}"
        ) from None
