"""Which class of OutboxDatabaseError a psycopg error becomes (pure logic: psycopg's classes)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors as pg_errors

import outbox
from outbox._session import database_errors


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), "ConnectionLost"),
        (pg_errors.AdminShutdown("terminating connection"), "ConnectionLost"),
        (pg_errors.CannotConnectNow("the database system is starting up"), "ConnectionLost"),
        (pg_errors.ConnectionFailure("connection failure"), "ConnectionLost"),
        (pg_errors.IdleSessionTimeout("idle-session timeout"), "ConnectionLost"),
        (
            pg_errors.IdleInTransactionSessionTimeout("idle-in-transaction timeout"),
            "ConnectionLost",
        ),
        (pg_errors.DatabaseDropped("database dropped"), "ConnectionLost"),
        (pg_errors.SerializationFailure("could not serialize"), "TransactionConflict"),
        (pg_errors.DeadlockDetected("deadlock detected"), "TransactionConflict"),
        # a statement's own failure: the connection is fine
        (pg_errors.QueryCanceled("canceling statement due to statement timeout"), "other"),
        (pg_errors.LockNotAvailable("lock timeout"), "other"),
        (pg_errors.UniqueViolation("duplicate key"), "other"),
        (pg_errors.ReadOnlySqlTransaction("read-only transaction"), "other"),
    ],
)
def test_a_database_error_is_told_by_what_failed(raised: psycopg.Error, kind: str) -> None:
    """A lost connection was a plain OutboxDatabaseError: a retry loop that catches psycopg's
    OperationalError for its own statements missed it, and nothing said it might be applied."""
    with pytest.raises(outbox.OutboxDatabaseError) as caught, database_errors():
        raise raised
    assert isinstance(caught.value, outbox.ConnectionLost) == (kind == "ConnectionLost")
    assert isinstance(caught.value, outbox.TransactionConflict) == (kind == "TransactionConflict")
    assert caught.value.__cause__ is raised
    assert caught.value.sqlstate == raised.sqlstate
