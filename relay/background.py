"""Database work in the background, in order, on a thread and connection of its own.

The relay has two (relay/service.py):
- the ender: once a batch's Kafka transaction is committed, its rows are ended (deleted or
  archived) in a Postgres transaction of their own. Done in line, that transaction sat between
  one batch and the next: about a fifth of a backlog drain. Here it runs while the next batch
  is claimed and produced; a shard waits for it before it commits its next Kafka transaction
  (relay/shard.py), so at most one batch per shard is ever in doubt, as before.
- the claimer, with claim_ahead on: in a drain, the next batch is claimed while a full batch
  waits for Kafka's reports and commit (ShardWorker._start_claim_ahead). On the ender's thread it
  waited behind the end of the batch before, and the two made the ender the slowest thread.
One of each for all the relay's shards: their work goes one after the other.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")
_Job = tuple[Callable[[psycopg.Connection[Any]], Any], Future[Any]]


class BackgroundConnection:
    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], name: str) -> None:
        self._connect = connect
        self._name = name
        self._conn: psycopg.Connection[Any] | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, work: Callable[[psycopg.Connection[Any]], T]) -> Future[T]:
        """Run `work(conn)` after the work submitted before it; its error comes with the
        result."""
        if self._closed:
            raise RuntimeError(f"the relay's {self._name} is closed")
        if self._thread is None:
            # A daemon: work stuck on a lock or a dead socket must not keep the process alive
            # past its shutdown grace (a thread pool's threads are joined at exit).
            self._thread = threading.Thread(
                target=self._work, name=f"outbox-{self._name}", daemon=True
            )
            self._thread.start()
        done: Future[T] = Future()
        self._jobs.put((work, done))
        return done

    def _work(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                work, done = job
                try:
                    done.set_result(self._run(work))
                except BaseException as exc:  # handed to whoever waits for the result
                    done.set_exception(exc)
        finally:  # here, not in close(): a close that timed out leaves the thread its work
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _run(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._connect()
        try:
            return work(self._conn)
        except psycopg.Error:
            self._conn.close()  # a new one for the next work: this one may be in any state
            self._conn = None
            raise

    def close(self, timeout: float | None = None) -> None:
        """After the work submitted (at most `timeout`), stop the thread and its connection."""
        self._closed = True
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)
