"""How the sidecar's own connections begin their transactions, whatever the database's defaults."""

from __future__ import annotations

from typing import Any

import psycopg


def own_transaction_mode(
    conn: psycopg.Connection[Any], *, write: bool = True
) -> psycopg.Connection[Any]:
    """`conn`, its transactions begun READ COMMITTED, and READ WRITE if it `write`s (`BEGIN
    ISOLATION LEVEL READ COMMITTED READ WRITE`: no session state, so through a transaction
    pooler too).

    The relay's, checker's and outboxctl's statements are written for READ COMMITTED. A role or
    database default of REPEATABLE READ or SERIALIZABLE failed every relay round ("could not
    serialize access due to concurrent update"), and one of default_transaction_read_only
    every write; nothing went out. On a standby a writer's error now says it: "cannot set
    transaction read-write mode during recovery"; a reader (`write=False`: outboxctl status,
    records) still reads there. Statements run outside a transaction block on an autocommit
    connection keep the defaults: only reads run so (probes, gauges)."""
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    if write:
        conn.read_only = False
    return conn
