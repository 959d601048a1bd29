"""Whether the database answers, for /readyz, on one connection kept between probes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from relay.logs import Outage

logger = logging.getLogger(__name__)


class DatabaseProbe:
    """`SELECT 1` on a connection kept from one probe to the next.

    A new connection per probe was a Postgres backend forked, authenticated and torn down every
    probe period (5 s in the chart), for the relay and again for the checker, in every pod.
    A kept connection that the server or a proxy closed meanwhile (idle_session_timeout, a
    restart) fails once: the probe then tries a new one before it says the database is down.

    `connect` must return an autocommit connection (a probe must not leave a transaction open)
    whose connect_timeout bounds a probe of a database that does not answer, and whose TCP
    options (dbconnect.dead_peer_options) end a kept connection whose peer went away unsaid (a
    failover that drops the old address): without them a probe waited in recv() ~15 minutes.
    Probes that come together (the kubelet's and a person's curl) share the connection, one at
    a time; one that cannot get it within `wait_s` answers False rather than queue behind a
    stuck one. After close(), False: the service it probed for has stopped.

    Why a probe found the database down is logged (and that it answers again):
    /readyz says only `"database": false`, and an engineer looking at a pod that is not ready
    found no reason anywhere (a wrong password, a host not found, a refused port): each reason
    once an outage (logs.Outage). `owner` names whose probe it is in those lines."""

    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], wait_s: float, owner: str = "the"
    ) -> None:
        self._connect = connect
        self._wait_s = wait_s
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._failure = ""  # why the last try failed
        self._outage = Outage(logger, f"{owner} readiness probe: the database")

    def reachable(self) -> bool:
        if not self._lock.acquire(timeout=self._wait_s):
            return False
        try:
            if self._closed:
                return False
            conn = self._conn
            kept = conn is not None and not conn.closed and not conn.broken
            up = self._select_one() or (kept and self._select_one())
            self._say(up)
            return up
        finally:
            self._lock.release()

    def _say(self, up: bool) -> None:
        if up:
            self._outage.up()
        else:
            self._outage.down(self._failure)

    def close(self) -> None:
        """Under the lock: libpq frees the connection, which a probe in flight still used. A
        probe stuck past `wait_s` keeps it; the process is ending then."""
        self._closed = True  # first: a probe after this one says False even then
        if self._lock.acquire(timeout=self._wait_s):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _select_one(self) -> bool:
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            self._conn.execute("SELECT 1")
            return True
        except psycopg.Error as exc:
            self._failure = str(exc)
            self._drop()
            return False
