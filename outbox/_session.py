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
