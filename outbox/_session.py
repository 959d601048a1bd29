"""Checks on the caller's connection, and translation of psycopg errors at the boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format, PipelineStatus
from psycopg.pq import TransactionStatus as PgTxStatus
from psycopg.rows import tuple_row

from outbox._errors import (
    ConnectionLost,
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


def not_a_connection(target: object, *, asynchronous: bool) -> OutboxUsageError:
    """What to give instead of `target`, which is not a connection or cursor of the kind."""
    kinds = "AsyncConnection or AsyncCursor" if asynchronous else "Connection or Cursor"
    name = type(target).__name__
    hint = ""
    if isinstance(target, (psycopg.Connection, psycopg.Cursor)):
        hint = ": use Outbox for sync connections"
    elif isinstance(target, (psycopg.AsyncConnection, psycopg.AsyncCursor)):
        hint = ": use AsyncOutbox for async connections"
    elif "Pool" in name:  # psycopg_pool's, without importing it
        hint = (
            ": take a connection from the pool, `async with pool.connection() as conn:`"
            if asynchronous
            else ": take a connection from the pool, `with pool.connection() as conn:`"
        )
    elif isinstance(target, str):
        hint = ": connect first (the outbox writes in your transaction, on your connection)"
    return OutboxUsageError(f"expected a psycopg {kinds}, got {name}{hint}")


def in_pipeline(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """In pipeline mode, statements queued make the transaction status ACTIVE until a Sync."""
    return conn.pgconn.pipeline_status != PipelineStatus.OFF


def ends_on_its_own_in_pipeline(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> bool:
    """An autocommit connection in pipeline mode with no transaction open: an end's statements
    commit at the next Sync only, and a failure of the caller's next statement before one
    rolled back an end reported changed. So such an end is followed by a Sync of its own."""
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    return conn.autocommit and idle and in_pipeline(conn)


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
        return _own_text(psycopg.ClientCursor(conn, row_factory=tuple_row))
    return _own_text(psycopg.Cursor(conn, row_factory=tuple_row))


def async_statement_cursor(
    target: psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any],
) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """statement_cursor() for asyncio."""
    conn = target.connection if isinstance(target, psycopg.AsyncCursor) else target
    kind = type(target) if isinstance(target, psycopg.AsyncCursor) else conn.cursor_factory
    if issubclass(kind, psycopg.AsyncClientCursor):
        return _own_text(psycopg.AsyncClientCursor(conn, row_factory=tuple_row))
    return _own_text(psycopg.AsyncCursor(conn, row_factory=tuple_row))


class _TextAsStr(Loader):
    """The outbox's text results (tx ids, states, settings) as str: on a SQL_ASCII database
    psycopg gives text as bytes, and the outbox refused every caller-given tx id (b'READ
    COMMITTED' is not 'READ COMMITTED') and returned tx ids commit() refused. Also keeps
    text loaders an application registered globally out of the outbox's reads."""

    def load(self, data: Buffer) -> str:
        return bytes(data).decode("utf-8")


class _BinaryTextAsStr(_TextAsStr):
    """The same for results asked in binary (a text's binary form is its bytes)."""

    format = Format.BINARY


_C = TypeVar("_C", psycopg.Cursor[Any], psycopg.AsyncCursor[Any])


def _own_text(cur: _C) -> _C:
    text_as_str(cur, binary=False)  # the outbox's own reads are text: two loaders, not four
    return cur


def text_as_str(
    target: psycopg.Connection[Any]
    | psycopg.AsyncConnection[Any]
    | psycopg.Cursor[Any]
    | psycopg.AsyncCursor[Any],
    *,
    binary: bool = True,
) -> None:
    """Text results as str on `target` (a cursor, or a connection the sidecar owns), on a
    SQL_ASCII database too (_TextAsStr); with `binary`, results asked in binary too."""
    for name in ("text", "varchar"):
        target.adapters.register_loader(name, _TextAsStr)
        if binary:
            target.adapters.register_loader(name, _BinaryTextAsStr)


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
        kind = (
            TransactionConflict
            if exc.sqlstate in _CONFLICTS
            else ConnectionLost
            if connection_lost(exc)
            else OutboxDatabaseError
        )
        raise kind(f"the database failed: {exc}{_hint(exc)}", sqlstate=exc.sqlstate) from exc


def _hint(exc: psycopg.Error) -> str:
    """What of the record a database refusal points at, where the database's words do not."""
    untranslatable = exc.sqlstate == "22P05" or (  # a LATIN1 database and a '€'
        exc.sqlstate == "0A000" and "conversion between" in str(exc)  # SQL_ASCII, any non-ASCII
    )
    if untranslatable:
        return (
            " (a header name or tx id holds a character the database's encoding cannot "
            "store: use ASCII there, or a UTF8 database)"
        )
    return ""


# serialization_failure, deadlock_detected
_CONFLICTS = frozenset({"40001", "40P01"})
# admin_shutdown, crash_shutdown, cannot_connect_now (a server starting, or in recovery),
# database_dropped, idle_session_timeout, idle_in_transaction_session_timeout: the session ends
_SHUT_DOWN = frozenset({"57P01", "57P02", "57P03", "57P04", "57P05", "25P03"})


def connection_lost(exc: psycopg.Error) -> bool:
    """The connection, not the statement, failed: class 08, a shutdown, or no answer at all
    (psycopg's own OperationalError without a SQLSTATE: the server closed the connection)."""
    state = exc.sqlstate
    if state == "25P03":  # an InvalidTransactionState, not an OperationalError
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    return state is None or state.startswith("08") or state in _SHUT_DOWN


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
