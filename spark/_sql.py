"""SQL of the reconciliation job, kept in `spark/queries.sql` and loaded by name.

The same layout as `outbox/sql`: `-- name: <name>` headers, `{schema}` rendered through
`psycopg.sql.Identifier`, other `{placeholders}` through `psycopg.sql.Literal` (never formatting).
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files
from typing import Any

from psycopg import sql

_NAME_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def _queries() -> dict[str, str]:
    text = files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    parts = _NAME_HEADER.split(text)
    # Whole-line comments are for readers of the file: Spark's JDBC source wraps the ledger query
    # in a subquery, where a trailing comment would swallow the closing parenthesis.
    return {
        name: "\n".join(
            line for line in body.strip().splitlines() if not line.lstrip().startswith("--")
        ).rstrip(";")
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def query(name: str, schema: str, **literals: Any) -> sql.Composed:
    """The named query with the schema identifier and any literals filled in."""
    try:
        text = _queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in spark/queries.sql") from None
    values = {k: sql.Literal(v) for k, v in literals.items()}
    return sql.SQL(text).format(schema=sql.Identifier(schema), **values)


def text(name: str, schema: str, **literals: Any) -> str:
    """The named query as plain text, for a consumer that takes SQL text (Spark's JDBC source)."""
    return query(name, schema, **literals).as_string(None)
