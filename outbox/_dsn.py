"""A libpq connection string checked before use, without ever quoting it.

libpq's parse errors quote what they stumbled on: the password itself ("invalid percent-encoded
token"), or the whole URI. Printed by a failing round or command, that went to every log line.
So only a fixed text of ours is given for each reason libpq has, never libpq's own message.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import SecretStr

from outbox._errors import InvalidConfigError

# libpq's reason (its message's start) -> what we say: no part of the DSN in either
_REASONS = (
    ("invalid percent-encoded token", "a '%' not followed by two hex digits (write '%' as %25)"),
    ("end of string reached when looking for matching", "a '[' of an IPv6 host left open"),
    ("unterminated quoted string", "a quoted value left open"),
    ('missing "=" after', "a word without '=' (quote a value with spaces: key='a b')"),
    ("invalid connection option", "an unknown parameter name"),
    ("invalid URI query parameter", "an unknown parameter in the URI's query"),
    ("missing key/value separator", "a URI query parameter without '='"),
    ("invalid URI", "not a valid URI"),
)


def parse_dsn(dsn: str, what: str = "the DSN") -> dict[str, Any]:
    """The connection parameters of `dsn`; InvalidConfigError naming `what` and the reason
    libpq refused it (in words of ours: libpq's own quote the DSN) when libpq cannot parse it."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        said = str(exc)
        reason = next((ours for start, ours in _REASONS if said.startswith(start)), None)
        raise InvalidConfigError(
            f"{what} is not a libpq connection string or URI: "
            + (reason or "libpq cannot parse it (its message is not shown: it quotes the DSN)")
        ) from None
    if _split_secret(dsn):
        # libpq parsed it, but a '@' or '/' of the password cut the URI elsewhere: the rest
        # became the host, the port or the database, which the connection's errors then quote
        raise InvalidConfigError(
            f"{what} is not a URI libpq reads as meant: a '@' or '/' in the user or "
            "password must be percent-encoded (%40, %2F)"
        )
    return params


# libpq's parameters that hold a secret (sslkey, passfile and the like name files: shown)
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})
# Shown first, in this order: where it connects, then as whom; the rest as libpq parsed them
_LEADING_PARAMETERS = ("host", "hostaddr", "port", "dbname", "user")
MASK = "**********"  # as pydantic shows a SecretStr


def masked_dsn(dsn: str) -> str:
    """`dsn` as a keyword string with its secrets masked: what `outboxctl config` shows, so the
    host, database and user in effect can be checked without the password being printed."""
    params = parse_dsn(dsn)
    order = {name: i for i, name in enumerate(_LEADING_PARAMETERS)}
    shown = {
        name: MASK if name in _SECRET_PARAMETERS else value
        for name, value in sorted(params.items(), key=lambda kv: order.get(kv[0], len(order)))
    }
    return make_conninfo("", **shown)


def check_dsn_setting(value: SecretStr, name: str) -> SecretStr:
    """The body of a settings validator: parse_dsn's refusal as the ValueError pydantic takes
    (its message never holds the DSN)."""
    try:
        parse_dsn(value.get_secret_value(), name)
    except InvalidConfigError as exc:
        raise ValueError(str(exc)) from None
    return value


def _split_secret(dsn: str) -> bool:
    """A URI, as written (not decoded: a '%40' in a database name is meant), whose user or
    password holds a '@' or '/' that cut it elsewhere: a second '@' before the path, an '@' in
    the path, or a port that is not a number."""
    scheme, sep, rest = dsn.strip().partition("://")
    if not sep or scheme.lower() not in ("postgresql", "postgres"):
        return False
    # As libpq reads it: the user and password end at the first '@' or '/' ('?' and '#' are
    # theirs), the hosts at the next '/' or '?', the path at '?'
    cut = min((i for i in (rest.find("@"), rest.find("/")) if i >= 0), default=len(rest))
    after_user = rest[cut + 1 :] if rest[cut : cut + 1] == "@" else rest
    end = min((i for i in (after_user.find(c) for c in "/?") if i >= 0), default=len(after_user))
    hosts, path = after_user[:end], after_user[end:].partition("?")[0]
    if "@" in hosts or "@" in path:
        return True
    for host in hosts.split(","):
        port = host.rpartition("]")[2] if host.startswith("[") else host
        port = port.partition(":")[2] if ":" in port else ""
        if port and not port.isdigit():
            return True
    return False
