"""Ends delivered batches' rows in the background, so the next batch does not wait for it.

Once a batch's Kafka transaction is committed, its rows are ended (deleted or archived) in a
Postgres transaction of their own. Done in line, that transaction sat between one batch and
the next: about a fifth of a backlog drain. Here it runs in a thread, on a connection of its
own, while the next batch is claimed and produced; a shard waits for it before it commits its
next Kafka transaction (relay/shard.py), so at most one batch per shard is ever in doubt, as
before. One thread for all the relay's shards: their ends go one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")


class RowEnder:
    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self._conn: psycopg.Connection[Any] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-ender")

    def submit(self, end: Callable[[psycopg.Connection[Any]], T]) -> Future[T]:
        """Run `end(conn)` after the ends submitted before it; its error comes with the result."""
        return self._pool.submit(self._run, end)

    def _run(self, end: Callable[[psycopg.Connection[Any]], T]) -> T:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._connect()
        try:
            return end(self._conn)
        except psycopg.Error:
            self._conn.close()  # a new one for the next end: this one may be in any state
            self._conn = None
            raise

    def close(self) -> None:
        """Wait for the ends submitted, then close the connection."""
        self._pool.shutdown(wait=True)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
