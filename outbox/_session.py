"""Checks on the caller's connection, and translation of psycopg errors at the boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import PipelineStatus
from psycopg.pq import TransactionStatus as PgTxStatus
from psycopg.rows import tuple_row

from outbox._errors import (
    OutboxDatabaseError,
    OutboxUsageError,
    SchemaError,
    TransactionConflict,
)


def require_not_aborted(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Said here, not as the database's InFailedSqlTransaction at the first statement."""
    if conn.info.transaction_status == PgTxStatus.INERROR:
        raise OutboxUsageError(
            "the connection's transaction is aborted (an earlier statement failed): "
            "roll it back before writing to the outbox"
        )


def require_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """The record must be part of the caller's transaction, never a transaction of its own."""
    require_not_aborted(conn)
    if conn.info.transaction_status == PgTxStatus.IDLE and conn.autocommit:
        raise OutboxUsageError(
            "no transaction is open and the connection is in autocommit mode, so the record "
            "would commit on its own, apart from your business rows: write it inside "
            + (
                "`async with conn.transaction():`"
                if isinstance(conn, psycopg.AsyncConnection)
                else "`with conn.transaction():`"
            )
        )


def in_pipeline(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """In pipeline mode, statements queued make the transaction status ACTIVE until a Sync."""
    return conn.pgconn.pipeline_status != PipelineStatus.OFF


def statement_cursor(
    target: psycopg.Connection[Any] | psycopg.Cursor[Any],
) -> psycopg.Cursor[tuple[Any, ...]]:
    """A cursor of the outbox's own on the caller's connection, so in the caller's transaction,
    whatever the caller's cursor or `cursor_factory` and `row_factory` are: the outbox reads
    its rows as tuples (a dict_row connection failed after the INSERT), and names its
    parameters (a RawCursor takes $1 ones only; a named cursor runs a single SELECT). A
    ClientCursor stays one: it is chosen for poolers that allow no server-side binding."""
    conn = target.connection if isinstance(target, psycopg.Cursor) else target
    kind = type(target) if isinstance(target, psycopg.Cursor) else conn.cursor_factory
    if issubclass(kind, psycopg.ClientCursor):
        return psycopg.ClientCursor(conn, row_factory=tuple_row)
    return psycopg.Cursor(conn, row_factory=tuple_row)


def async_statement_cursor(
    target: psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any],
) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """statement_cursor() for asyncio."""
    conn = target.connection if isinstance(target, psycopg.AsyncCursor) else target
    kind = type(target) if isinstance(target, psycopg.AsyncCursor) else conn.cursor_factory
    if issubclass(kind, psycopg.AsyncClientCursor):
        return psycopg.AsyncClientCursor(conn, row_factory=tuple_row)
    return psycopg.AsyncCursor(conn, row_factory=tuple_row)


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
        # A retry loop that catches these in the application's own statements catches them
        # here by their own class, not only as a database error.
        kind = TransactionConflict if exc.sqlstate in _CONFLICTS else OutboxDatabaseError
        raise kind(f"the database failed: {exc}", sqlstate=exc.sqlstate) from exc


# serialization_failure, deadlock_detected
_CONFLICTS = frozenset({"40001", "40P01"})


def quiet(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], params: dict[str, Any]
) -> dict[str, Any]:
    """A statement's parameters with its NOTIFY of the relay turned off in a two-phase
    transaction (tpc_begin): Postgres refuses to PREPARE one that ran NOTIFY, and the
    application's transaction was lost at its PREPARE. The relay finds those records by
    polling. psycopg keeps the two-phase state only as `_tpc` (xid, prepared), since 3.0."""
    if params.get("notify") and getattr(conn, "_tpc", None) is not None:
        return {**params, "notify": False}
    return params
