"""A transaction in pipeline mode, with no Sync of its own as it starts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg


@contextlib.contextmanager
def pipelined_transaction(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A transaction whose statements are pipelined: BEGIN goes with the first of them, and
    COMMIT after the caller's last fetch. Two round trips in all, where
    `with conn.pipeline(), conn.transaction():` took four: psycopg's transaction() syncs as it
    starts inside a pipeline (a round trip for BEGIN alone) and twice as it ends. For a
    connection that is not in autocommit mode (psycopg begins the transaction itself), and
    with no transaction open when it starts."""
    if conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        # a psycopg error: the relay drops such a connection and makes a new one
        raise psycopg.ProgrammingError(
            "pipelined_transaction needs an idle connection, not in autocommit"
        )
    try:
        with conn.pipeline():
            yield
            conn.execute("COMMIT")  # sent with the pipeline's last Sync: conn.commit() syncs too
    except BaseException:
        # Out of the pipeline: a statement's error is raised as it exits (its Sync), and a
        # rollback inside it is refused, which left the connection in a failed transaction.
        if not conn.broken:
            with contextlib.suppress(psycopg.Error):  # the caller's error says more
                conn.rollback()
        raise
