"""Checks on the caller's connection, and translation of psycopg errors at the boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus as PgTxStatus

from outbox._errors import OutboxDatabaseError, OutboxUsageError, SchemaError


def require_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """The record must be part of the caller's transaction, never a transaction of its own."""
    status = conn.info.transaction_status
    if status == PgTxStatus.INERROR:
        raise OutboxUsageError(
            "the connection's transaction is aborted (an earlier statement failed): "
            "roll it back before writing to the outbox"
        )
    if status == PgTxStatus.IDLE and conn.autocommit:
        raise OutboxUsageError(
            "no transaction is open and the connection is in autocommit mode, so the record "
            "would commit on its own, apart from your business rows: write it inside "
            "`with conn.transaction():`"
        )


def statement_cursor(target: psycopg.Connection[Any] | psycopg.Cursor[Any]) -> psycopg.Cursor[Any]:
    """A cursor that runs the outbox's statements in the caller's transaction: the caller's own,
    or one of the connection's `cursor_factory` (a ClientCursor, say, behind a pooler that
    allows no server-side binding). Not a RawCursor (positional $1 parameters only, where the
    outbox's statements name theirs) nor a ServerCursor (a single SELECT): a plain one on the
    same connection then, which is the same transaction."""
    cur = target if isinstance(target, psycopg.Cursor) else target.cursor()
    if isinstance(cur, psycopg.RawCursor | psycopg.ServerCursor):
        return psycopg.Cursor(cur.connection)
    return cur


def async_statement_cursor(
    target: psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any],
) -> psycopg.AsyncCursor[Any]:
    """statement_cursor() for asyncio."""
    cur = target if isinstance(target, psycopg.AsyncCursor) else target.cursor()
    if isinstance(cur, psycopg.AsyncRawCursor | psycopg.AsyncServerCursor):
        return psycopg.AsyncCursor(cur.connection)
    return cur


@contextmanager
def database_errors() -> Iterator[None]:
    try:
        yield
    except pg_errors.UndefinedTable as exc:
        raise SchemaError(
            f"the outbox tables are missing ({exc.diag.message_primary}): "
            "run `outboxctl migrate` (or outbox.migrate()) against this database"
        ) from exc
    except psycopg.Error as exc:
        raise OutboxDatabaseError(f"the database failed: {exc}") from exc
