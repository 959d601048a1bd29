"""Schema migrations: safe to run from many pods at once (one applies, the others wait).

A fresh database gets `schema.sql` in one step and every migration recorded as applied; a database
at an older version gets the missing migrations in order. Everything happens in one transaction
under an advisory lock, so a failure leaves the schema as it was, and a concurrent `migrate`
waits for the lock, then finds nothing left to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from outbox import sql as queries
from outbox._core import check_schema_name
from outbox._dsn import parse_dsn
from outbox._errors import (
    ConnectionLost,
    InvalidConfigError,
    OutboxDatabaseError,
    OutboxUsageError,
    SchemaError,
)
from outbox._session import connection_lost, in_pipeline

logger = logging.getLogger(__name__)

# Arbitrary, fixed: the advisory lock every migrating process takes (per schema, see below).
_LOCK_NAMESPACE = 74_110
# How long a migration waits for its tables at most (queries queue behind it meanwhile), and
# how often it tries
_LOCK_TIMEOUT = "3s"
_LOCK_ATTEMPTS = 8
# The library's tables in the order its transactions lock them: a relay's heartbeat
# relay_member then shard_lease, its end shard_lease then outbox_record, the checker
# outbox_record then audit_log. In another order, a migration waiting for one and holding
# another deadlocked with them, and Postgres aborted one side.
_TABLES_IN_LOCK_ORDER = (
    "relay_member",
    "shard_lease",
    "outbox_record",
    "audit_log",
    "reconciliation_finding",
    "reconciliation_window",
    "schema_migration",
)
# The tables a migration changes, where that is not all of them: only those are locked. All
# locked for one that touches the reconciliation's or the audit log's alone, an upgrade held
# back every publish while it waited for them, up to 3 s a try behind a long transaction.
# A migration not listed locks every table.
_MIGRATION_TABLES = {
    7: ("shard_lease",),
    8: ("reconciliation_finding",),
    9: ("audit_log",),
    10: ("outbox_record",),
}
# A try that did not get its tables, tried again: a lock not granted in time, the whole LOCK
# statement over its time, a deadlock Postgres broke by aborting the migration
_BUSY = (
    psycopg.errors.LockNotAvailable,
    psycopg.errors.QueryCanceled,
    psycopg.errors.DeadlockDetected,
)


@dataclass(frozen=True)
class MigrationReport:
    schema: str
    applied: tuple[int, ...]  # versions applied by this call
    version: int  # version the schema is at now


def latest_version() -> int:
    return queries.migrations()[-1].version


def migrate(
    conninfo_or_conn: str | psycopg.Connection[Any], schema: str = "outbox"
) -> MigrationReport:
    """Bring `schema` to the newest version.

    Takes a DSN, or a connection with no transaction open (the migration commits). Raises
    InvalidConfigError for a bad schema name, OutboxUsageError for a connection inside a
    transaction or in pipeline mode, SchemaError for a schema migrated by another build or a
    newer library, ConnectionLost when the connection is refused or lost (a start-up loop
    waiting for Postgres catches it), and OutboxDatabaseError when the database fails otherwise
    (psycopg's error is the __cause__).
    """
    if not isinstance(schema, str):
        raise InvalidConfigError(f"migrate(): schema must be a str, not {type(schema).__name__}")
    try:
        check_schema_name(schema)
    except ValueError as exc:  # named as migrate() calls it, not as OutboxConfig's setting
        raise InvalidConfigError(f"migrate(): schema {exc}") from None
    try:
        if isinstance(conninfo_or_conn, str):
            parse_dsn(conninfo_or_conn)
            # a migration runs each statement once or a few times: preparing gains nothing,
            # and through a pooler in transaction pooling it fails (the next client to get the
            # server connection finds the statement there, or the next statement lacks it)
            with psycopg.connect(conninfo_or_conn, prepare_threshold=None) as conn:
                return _migrate(conn, schema)
        if not isinstance(conninfo_or_conn, psycopg.Connection):  # typed callers cannot; others
            kind = type(conninfo_or_conn).__name__  # type: ignore[unreachable]
            raise OutboxUsageError(
                f"migrate() takes a DSN or a psycopg Connection, got {kind}"
                + (
                    " (there is no async migrate: pass a DSN, or await "
                    "asyncio.to_thread(outbox.migrate, dsn))"
                    if "Async" in kind
                    else ""
                )
            )
        if conninfo_or_conn.closed:  # its status, UNKNOWN, read as a transaction open
            raise OutboxUsageError("migrate() was given a closed connection")
        if in_pipeline(conninfo_or_conn):
            # Its files hold several statements each, which the extended protocol (the only
            # one a pipeline speaks) refuses: a fresh schema failed, an up-to-date one did not.
            raise OutboxUsageError(
                "migrate() cannot run on a connection in pipeline mode: run it before "
                "conn.pipeline(), or pass a DSN"
            )
        if conninfo_or_conn.info.transaction_status != TransactionStatus.IDLE:
            # Its transaction() would be a savepoint: reported applied, then gone with a rollback.
            raise OutboxUsageError(
                "migrate() needs a connection with no transaction open: the migration commits "
                "on its own (commit or roll back first, or pass a DSN)"
            )
        return _migrate(conninfo_or_conn, schema)
    except psycopg.Error as exc:
        kind = ConnectionLost if connection_lost(exc) else OutboxDatabaseError
        raise kind(f"migrating schema {schema!r} failed: {exc}", sqlstate=exc.sqlstate) from exc


def _tuples(conn: psycopg.Connection[Any]) -> psycopg.Cursor[tuple[Any, ...]]:
    """A plain cursor with tuple rows, whatever the caller's connection makes by default (a
    dict_row or RawCursor factory broke the reads below)."""
    return psycopg.Cursor(conn, row_factory=tuple_row)


def _migrate(conn: psycopg.Connection[Any], schema: str) -> MigrationReport:
    found = _up_to_date(conn, schema)
    if found is not None:
        return MigrationReport(schema, (), found)
    for attempt in range(1, _LOCK_ATTEMPTS + 1):
        try:
            return _migrate_once(conn, schema)
        except _BUSY:
            if attempt == _LOCK_ATTEMPTS:
                raise
            logger.warning(
                "migrating schema %s: its tables are busy (no lock within %s), trying again "
                "(attempt %d of %d)",
                schema,
                _LOCK_TIMEOUT,
                attempt + 1,
                _LOCK_ATTEMPTS,
            )
            time.sleep(min(0.5 * 2**attempt, 5.0))
    raise AssertionError("unreachable: the last attempt raises")


def _migrate_once(conn: psycopg.Connection[Any], schema: str) -> MigrationReport:
    ident = sql.Identifier(schema)
    cur = _tuples(conn)
    with conn.transaction():
        # READ COMMITTED whatever the database's default: under REPEATABLE READ the snapshot was
        # taken before the advisory lock was granted, and a process that waited for another's
        # migration found no migration applied, and failed creating the schema again.
        cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED, READ WRITE")
        # Another's migration is waited out however long it runs (index builds over an
        # archive): under a role's statement_timeout or lock_timeout the wait was cancelled
        # and, tried again 8 times, migrate failed while the other went on.
        cur.execute("SET LOCAL statement_timeout = 0")
        cur.execute("SET LOCAL lock_timeout = 0")
        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_LOCK_NAMESPACE, schema))
        # Migrated meanwhile by the one it waited for: nothing to do, and no DDL, which a role
        # that may only read the schema cannot run (two releases' hooks at once). The catalog
        # is read first: this session's caches, not refreshed while it waited for the lock,
        # still missed a schema created meanwhile (the read refreshes them for the next reads).
        if _tuples(conn).execute(_SCHEMA_LISTED, (schema,)).fetchone() is not None:
            found = _up_to_date(conn, schema)
            if found is not None:
                return MigrationReport(schema, (), found)
        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        cur.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migration ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        applied = _applied(conn, schema)
        done = set(applied)
        known = {m.version for m in queries.migrations()}
        if done - known:
            raise SchemaError(
                f"schema {schema!r} has migrations {sorted(done - known)} that this library does "
                f"not know (it knows up to {latest_version()}): upgrade the library"
            )
        _refuse_other_migrations(schema, applied)
        pending = [m for m in queries.migrations() if m.version not in done]
        if done and pending:
            _lock_tables(conn, schema, pending)
        # prepare=False: a file holds several statements, which Postgres will not prepare (a
        # connection of prepare_threshold=0 prepares every statement, the first run too)
        if not done:
            cur.execute(queries.schema_sql(schema), prepare=False)
        else:
            for m in pending:
                logger.info("applying migration %04d_%s to schema %s", m.version, m.name, schema)
                cur.execute(m.sql_for(schema), prepare=False)
        for m in pending:
            cur.execute(
                sql.SQL("INSERT INTO {}.schema_migration (version, name) VALUES (%s, %s)").format(
                    ident
                ),
                (m.version, m.name),
                prepare=False,  # run once per migration; a 5th run was prepared (see above)
            )
    return MigrationReport(schema, tuple(m.version for m in pending), latest_version())


_SCHEMA_LISTED = "SELECT FROM pg_catalog.pg_namespace WHERE nspname = %s"


def _up_to_date(conn: psycopg.Connection[Any], schema: str) -> int | None:
    """The schema's version when every migration of this library is applied already (newer
    ones too: migrations only add), read without a lock or DDL; else None. Then migrate changes
    nothing, and a role that may only read the schema runs it (the chart's hook, on every
    upgrade, with the sidecar's own role; an older release's hook on a schema a newer one
    migrated). CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
    exists."""
    with _as_found(conn):
        version = current_version(conn, schema)
        if version is None:
            return None
        applied = _applied(conn, schema)
    ours = {m.version: m.name for m in queries.migrations()}
    if any(applied.get(v) != name for v, name in ours.items()):
        return None
    if version > latest_version():
        logger.info(
            "schema %s is at version %d, newer than this library's %d: nothing to apply",
            schema,
            version,
            latest_version(),
        )
    return version


def _lock_tables(
    conn: psycopg.Connection[Any], schema: str, pending: list[queries.Migration]
) -> None:
    """The library's tables in the schema that the migrations to come change, locked at once,
    in the order its transactions lock them (_TABLES_IN_LOCK_ORDER), within _LOCK_TIMEOUT.

    Taken statement by statement, a migration's locks grew (an index's SHARE, then an ALTER's
    ACCESS EXCLUSIVE) while an application's, the checker's or the relay's transaction held
    one and asked for another: a deadlock, and Postgres aborted one of them, the application's
    business transaction maybe. Waiting without a bound, the lock asked for held back every
    query of the table behind it."""
    found = {
        row[0]
        for row in _tuples(conn).execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
        )
    }
    changed: set[str] = set()
    for migration in pending:
        changed.update(_MIGRATION_TABLES.get(migration.version, _TABLES_IN_LOCK_ORDER))
    # not tables of others there
    tables = [t for t in _TABLES_IN_LOCK_ORDER if t in found and t in changed]
    if not tables:
        return
    cur = _tuples(conn)
    cur.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(_LOCK_TIMEOUT)))
    # lock_timeout bounds each table's wait: the statement's whole wait is bounded too
    cur.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(_LOCK_TIMEOUT)))
    cur.execute(
        sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
            sql.SQL(", ").join(sql.Identifier(schema, t) for t in tables)
        )
    )
    # the tables are ours: the DDL waits on nothing, and an index's build takes its time
    cur.execute("SET LOCAL lock_timeout = 0")
    cur.execute("SET LOCAL statement_timeout = 0")


def _applied(conn: psycopg.Connection[Any], schema: str) -> dict[int, str]:
    """The recorded migrations: version -> name."""
    query = sql.SQL("SELECT version, name FROM {}.schema_migration").format(sql.Identifier(schema))
    return {row[0]: row[1] for row in _tuples(conn).execute(query)}


def _refuse_other_migrations(schema: str, applied: dict[int, str]) -> None:
    """Raise SchemaError when a version was applied under another name than this library's.

    A version is applied once and then skipped by number: had another build's migration of
    that number been applied, what this library's adds would be missing, and the relay and
    the checker would fail every round on a missing column instead of saying why.
    """
    ours = {m.version: m.name for m in queries.migrations()}
    other = {v: n for v, n in sorted(applied.items()) if v in ours and ours[v] != n}
    if other:
        listed = ", ".join(f"{v} as {n!r} (this library's: {ours[v]!r})" for v, n in other.items())
        raise SchemaError(
            f"schema {schema!r} has migrations applied by another build of this library: "
            f"{listed}. A migration must not change once applied; recreate the schema (a "
            "development database), or bring it to this library's migrations by hand and "
            "record their names in schema_migration"
        )


@contextmanager
def _as_found(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Reads that leave `conn` as they found it: a transaction they opened is ended, so a
    migrate() after a current_version() on the same connection is not refused."""
    opened = not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    try:
        yield
    finally:
        if opened and not conn.closed:
            conn.rollback()


def check_applied(conn: psycopg.Connection[Any], schema: str = "outbox") -> None:
    """Raise SchemaError when the schema's migrations are not this library's (see migrate)."""
    with _as_found(conn):
        if current_version(conn, schema) is not None:
            _refuse_other_migrations(schema, _applied(conn, schema))


# The oldest schema each part of the sidecar runs on: the first version with every table,
# column and function its queries use (tests/integration/test_migrations.py prepares each of
# them there). Gated at the latest, every relay of a rollout whose migration was put off stopped
# for a migration of another part's (0008 is the reconciliation's, 0009 the audit log's).
RELAY_SCHEMA_VERSION = 7
CHECKER_SCHEMA_VERSION = 6
# From this version the relay marks the discarded records it takes to ship (shipping_since),
# and re-arm and resolve refuse those. Below it (a rollout whose migration was put off) both
# go on as before: the relay checks at start, the commands at each call. Its queries are named
# shipping_*.
SHIPPING_CLAIM_VERSION = 10


def schema_problem(
    conn: psycopg.Connection[Any], schema: str = "outbox", needs: int | None = None
) -> str | None:
    """Why a service of this library cannot run on the schema as it is, or None.

    A schema not migrated (yet), or migrated by another build, gives every round an error about
    a missing relation or column; this says what to do instead. A newer one is fine
    (migrations only add). `needs`: the version the service needs (by default the latest).
    Leaves no transaction open.
    """
    try:
        version = current_version(conn, schema)
        check_applied(conn, schema)
    except SchemaError as exc:
        return str(exc)
    finally:
        if not conn.autocommit:
            conn.rollback()
    needed = latest_version() if needs is None else needs
    if version is None or version < needed:
        return (
            f"schema {schema!r} is at version {version or 'none'}, this needs {needed}: run "
            f"`outboxctl migrate --schema {schema}` (the chart's migration hook does it on "
            "install and upgrade)"
        )
    return None


def current_version(conn: psycopg.Connection[Any], schema: str = "outbox") -> int | None:
    """The newest applied migration, or None where the schema was never migrated."""
    # quoted: a name with capitals is the table the migrations made (they quote it too)
    with _as_found(conn):
        cur = _tuples(conn)
        row = cur.execute(
            "SELECT to_regclass(format('%%I.schema_migration', %s::text))", (schema,)
        ).fetchone()
        if row is None or row[0] is None:
            return None
        got = cur.execute(
            sql.SQL("SELECT max(version) FROM {}.schema_migration").format(sql.Identifier(schema))
        ).fetchone()
        return None if got is None else got[0]
