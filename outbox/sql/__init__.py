"""SQL of the outbox, kept in files and loaded by name.

`queries.sql` (the library) and `relay.sql` (the sidecar) hold named queries under
`-- name: <name>` headers; `schema.sql` is the whole schema; `migrations/NNNN_<what>.sql` are
the ordered migrations. `{schema}` in any of them is replaced by the configured schema name
through `psycopg.sql.Identifier`, never by formatting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

from psycopg import sql

_NAME_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_MIGRATION_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


def _read(name: str) -> str:
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


# Query files: the library's own, and the sidecar's (relay and checker).
_QUERY_FILES = ("queries.sql", "relay.sql")


@cache
def _queries() -> dict[str, str]:
    found: dict[str, str] = {}
    for file in _QUERY_FILES:
        parts = _NAME_HEADER.split(_read(file))
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise RuntimeError(f"query {name!r} is defined twice (second time in {file})")
            found[name] = body.strip().rstrip(";")
    return found


def with_schema(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


@cache
def query(name: str, schema: str) -> bytes:
    """The named query from queries.sql for the given schema, rendered once.

    Plain bytes (not `sql.Composed`) let psycopg cache the query's conversion and prepare it
    after a few executions: the composition cost is paid once per process, not per call.
    """
    try:
        text = _queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in {', '.join(_QUERY_FILES)}") from None
    return with_schema(text, schema).as_bytes(None)


def schema_sql(schema: str) -> sql.Composed:
    return with_schema(_read("schema.sql"), schema)


def grants_sql(
    schema: str, writer_role: str, relay_role: str, reconciler_role: str
) -> sql.Composed:
    """grants.example.sql rendered for the given schema and roles."""
    return sql.SQL(_read("grants.example.sql")).format(
        schema=sql.Identifier(schema),
        writer=sql.Identifier(writer_role),
        relay=sql.Identifier(relay_role),
        reconciler=sql.Identifier(reconciler_role),
    )


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    def sql_for(self, schema: str) -> sql.Composed:
        return with_schema(self.text, schema)


@cache
def migrations() -> tuple[Migration, ...]:
    """All migrations, in version order."""
    found = []
    for entry in files(__package__).joinpath("migrations").iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..N without gaps, found {versions}")
    return tuple(found)
