"""Which class of OutboxDatabaseError a psycopg error becomes (pure logic: psycopg's classes)."""

from __future__ import annotations

import socket

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


def test_migrate_refused_a_connection_raises_connection_lost() -> None:
    """migrate() is the one call that opens a connection: a start-up loop that waits for
    Postgres (`except outbox.ConnectionLost`) got a plain OutboxDatabaseError and crashed."""
    with socket.socket() as s:  # a loopback port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(outbox.ConnectionLost, match="migrating schema 'outbox' failed") as caught:
        outbox.migrate(f"host=127.0.0.1 port={port} dbname=x user=x connect_timeout=5")
    assert isinstance(caught.value.__cause__, psycopg.OperationalError)


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ("pg_x", "migrate(): schema 'pg_x' begins with 'pg_'"),
        ("a-b", "migrate(): schema 'a-b' is not a plain identifier"),
        (None, "migrate(): schema must be a str, not NoneType"),
    ],
)
def test_migrate_names_its_own_schema_argument_when_refusing_it(schema: object, said: str) -> None:
    """Refused before any connection: the message named `schema_name`, OutboxConfig's setting,
    which migrate() has no argument of."""
    with pytest.raises(outbox.InvalidConfigError) as caught:
        outbox.migrate("host=127.0.0.1 port=1 dbname=x", schema=schema)  # type: ignore[arg-type]
    assert str(caught.value).startswith(said)
    assert "schema_name" not in str(caught.value)
