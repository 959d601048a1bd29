"""How the sidecar's own connections give up on a peer gone silent, and begin their transactions
whatever the database's defaults."""

from __future__ import annotations

import configparser
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox._session import text_as_str

# The kernel's limit for TCP_KEEPIDLE: above it every connection failed ("setsockopt failed").
MAX_KEEPALIVE_S = 32767


def dead_peer_options(dsn: str, after_s: float) -> dict[str, int]:
    """libpq's TCP options that end a connection whose peer has answered nothing for about
    `after_s` (its data unacknowledged, or, idle, its keepalives), unless the DSN or the
    service file it names sets them.

    A database host that failed, or one cut off by a partition or a moved address (a failover),
    sends no reset: a statement on a connection to it waited for the kernel to give up, about
    15 minutes on Linux, and the relay delivered nothing meanwhile, its probes green (they
    connect anew, to the new primary). A slow statement is not cut, nor a wait on a lock: the
    server's kernel acknowledges the statement and the keepalives meanwhile. What is cut is a
    stream the server stops reading for that long (a COPY into a table it waits to lock); the
    sidecar sends none."""
    seconds = min(max(1, round(after_s)), MAX_KEEPALIVE_S)
    options = {
        "tcp_user_timeout": seconds * 1000,
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": 1,
        "keepalives_count": 3,
    }
    taken = dsn_keys(dsn)
    return {name: value for name, value in options.items() if name not in taken}


def dsn_keys(dsn: str) -> set[str]:
    """The libpq keys `dsn` sets, itself or through the service file it names."""
    given = conninfo_to_dict(dsn)
    service = given.get("service") or os.environ.get("PGSERVICE")
    return set(given) | (_service_keys(str(service)) if service else set())


def _service_keys(service: str) -> set[str]:
    """The keys the libpq service file gives `service`: the user's file, else the system's
    (libpq reads the first that has it)."""
    user = os.environ.get("PGSERVICEFILE") or str(Path.home() / ".pg_service.conf")
    system_dir = os.environ.get("PGSYSCONFDIR") or "/etc/postgresql-common"  # Debian's libpq
    for path in (Path(user), Path(system_dir) / "pg_service.conf"):
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            parser.read(path, encoding="utf-8")
        except (OSError, configparser.Error):
            continue  # libpq says so when it connects
        if parser.has_section(service):
            return {key.strip() for key in parser.options(service)}
    return set()


# A checker's transactions are short (its claim, its verdicts): one left idle this long is a
# sidecar gone, not a slow one.
CHECKER_IDLE_TRANSACTION = timedelta(seconds=60)


# The session settings bound_idle_time lowers to its values (kept when already lower, not 0),
# by pg_settings' units: milliseconds, seconds, seconds, a count, milliseconds.
_SERVER_BOUNDS = """
SELECT set_config(s.name, w.value::text, false)
FROM pg_settings AS s
JOIN (VALUES ('idle_in_transaction_session_timeout', %(in_transaction_ms)s::bigint),
             ('tcp_keepalives_idle', %(dead_peer_s)s::bigint),
             ('tcp_keepalives_interval', 1),
             ('tcp_keepalives_count', 3),
             ('tcp_user_timeout', %(dead_peer_ms)s::bigint)) AS w (name, value)
  ON w.name = s.name
WHERE CASE WHEN s.setting ~ '^[0-9]+$' THEN s.setting::numeric NOT BETWEEN 1 AND w.value END
UNION ALL
SELECT set_config(name, '0', false) FROM pg_settings  -- PostgreSQL 14 on
WHERE name = 'idle_session_timeout' AND setting <> '0'
"""
_MAX_MS = 2**31 - 1  # the settings are int4


def bound_idle_time(
    conn: psycopg.Connection[Any], in_transaction: timedelta, dead_peer_after_s: float
) -> psycopg.Connection[Any]:
    """`conn`, its session set so that the server ends it once it waits for the client
    `in_transaction` in a transaction (idle_in_transaction_session_timeout), or once the client's
    host has answered nothing for about `dead_peer_after_s` (the server's TCP keepalives and
    user timeout, as dead_peer_options sets the client's); lower limits of the role, database
    or DSN are kept. And never for idling outside a transaction (idle_session_timeout 0).

    A sidecar whose node died, or was cut off, in a transaction left its backend waiting until
    the server's TCP keepalive gave up: two hours by default, for the server sends nothing to a
    client it waits for. Its transaction id held back the xid horizon of every relay, and its
    lock on a lease row kept the shard from the others (SKIP LOCKED): nothing of the outbox went
    out. The keepalives cover a pipeline's wait too, where the server sent no ReadyForQuery and
    so runs no idle timer; the idle timer, a client alive but stuck (its kernel answers them).
    The user timeout also ends a session whose client reads nothing it is sent for that long: a
    LISTEN left unread through a round that long (the relay listens anew, then rounds).

    The sidecar keeps its connections open on purpose, quiet ones too (a LISTEN, a relay's ender
    between bursts): a DBA's idle_session_timeout closed them unsaid, and the next use of each
    failed (a batch committed in Kafka then ended by a recovery, a round counted as an error).

    Session state: not for a connection through a transaction pooler, which hands the session to
    other clients (PgBouncer's idle_transaction_timeout and tcp_keepalive do this there)."""
    dead_peer_s = min(max(1, round(dead_peer_after_s)), MAX_KEEPALIVE_S)
    params = {
        "in_transaction_ms": min(_MAX_MS, max(1, math.ceil(in_transaction.total_seconds() * 1000))),
        "dead_peer_s": dead_peer_s,
        "dead_peer_ms": dead_peer_s * 1000,
    }
    try:
        conn.execute(_SERVER_BOUNDS, params)
        conn.commit()  # kept for the session; nothing to commit in autocommit mode
    except BaseException:
        conn.close()  # a connection made for nothing: not left for the garbage collector
        raise
    return conn


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
    # Every connection of the sidecar passes here: its text results as str on a SQL_ASCII
    # database too, where psycopg gives bytes, and the relay refused its own schema's
    # migration names (b'initial' is not 'initial'), the checker every claim. Only there:
    # elsewhere psycopg's own loaders (in C) are faster than ours.
    if conn.info.encoding == "ascii":  # psycopg's name of SQL_ASCII
        text_as_str(conn)
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    if write:
        conn.read_only = False
    return conn
