"""The job's Postgres side: the findings sink and the ledger look-ups, with plain psycopg.

Why psycopg from the driver rather than Spark's JDBC writer: findings are few (each is an anomaly)
and summary windows fewer still, so streaming them to the driver costs little; psycopg then gives
what the JDBC writer cannot: COPY into a temporary table and one `INSERT ... ON CONFLICT DO
NOTHING` on the natural key, plus the window upserts, in ONE transaction. A replayed micro-batch,
a restart or a repeated audit therefore inserts nothing twice, and `RETURNING` says what is new.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from relay.dbconnect import dead_peer_options, dsn_keys, own_transaction_mode
from spark import _sql
from spark._errors import ReconcileConfigError

CONNECT_TIMEOUT_S = 10
LOCK_TIMEOUT_S = 120
STATEMENT_TIMEOUT_S = 900
PRUNE_BATCH = 10_000  # rows a transaction: ~0.1-0.3 s each
PRUNE_MAX_ROWS = 200_000  # of each table a judgement: the rest waits for the next
# How stale a finding's last_seen_at may grow while it is found again: the retention counts from
# it. Hourly, not at every trigger: a backlog of stuck records is thousands of findings.
SEEN_EVERY = timedelta(hours=1)


def connect(dsn: str, *, write: bool = True) -> psycopg.Connection[Any]:
    """Its transactions READ COMMITTED (and READ WRITE to `write`), whatever the database's
    defaults: under default_transaction_read_only the job's findings failed to be written. A
    database gone silent (a failover) fails a micro-batch's write in seconds, not ~15 minutes.
    A `connect_timeout` the DSN (or its service file) gives wins over CONNECT_TIMEOUT_S."""
    options: dict[str, Any] = dead_peer_options(dsn, CONNECT_TIMEOUT_S)
    if "connect_timeout" not in dsn_keys(dsn):
        options["connect_timeout"] = CONNECT_TIMEOUT_S
    conn = psycopg.connect(dsn, **options)
    return own_transaction_mode(conn, write=write)


def _bounded(cur: psycopg.Cursor[Any] | psycopg.Connection[Any]) -> None:
    """Bound the waits of the transaction begun (settings of the transaction alone, so through
    a transaction pooler too). A lock waited for without end (an operator's transaction open on
    the findings, a migration's lock queued ahead) held the judgement, and the idle ticks behind
    it, while the probes stayed green: failed, the micro-batch goes again after a restart."""
    cur.execute(_BOUNDS, (f"{LOCK_TIMEOUT_S}s", f"{STATEMENT_TIMEOUT_S}s"))


_BOUNDS = "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)"


@contextmanager
def schema_needed(schema: str) -> Iterator[None]:
    """Say what to do when the sink tables are missing (a schema before migration 0002), or
    a column of theirs (a schema migrated by an older build)."""
    try:
        yield
    except psycopg.errors.UndefinedColumn as exc:
        raise ReconcileConfigError(
            f"schema {schema!r} is older than this job: run `outboxctl migrate` first "
            f"({exc.diag.message_primary})"
        ) from exc
    except psycopg.errors.UndefinedTable as exc:
        raise ReconcileConfigError(
            f"schema {schema!r} has no reconciliation tables: run `outboxctl migrate` "
            f"(migration 0002) first ({exc.diag.message_primary})"
        ) from exc


# What the job reads (the ledger) and writes (findings, summary windows).
_TABLES = ("outbox_record", "reconciliation_finding", "reconciliation_window")


def check_database(dsn: str, schema: str) -> None:
    """Before Spark starts: the database takes the job's login and holds the tables it reads
    and writes, to its role. Found first inside the first micro-batch, after Spark had read
    the whole horizon from Kafka, a wrong password or a schema not migrated came out as "the
    reconciliation query failed" with the JVM's trace, or as Postgres's words alone."""
    with connect(dsn, write=False) as conn, schema_needed(schema):
        for table in _TABLES:  # LIMIT 0 reads nothing; the privilege is checked all the same
            conn.execute(
                sql.SQL("SELECT FROM {}.{} LIMIT 0").format(
                    sql.Identifier(schema), sql.Identifier(table)
                )
            )


@dataclass(frozen=True)
class Written:
    new: Counter[str]  # findings of each kind written for the first time
    # why the findings found again kept their last_seen_at (a role granted before migration 0008
    # may not update it); None: moved on, or not asked to
    seen_refused: str | None = None


def write_judgement(
    conn: psycopg.Connection[Any],
    schema: str,
    findings: Iterable[Sequence[Any]],
    windows: Iterable[Mapping[str, Any]],
    *,
    detected_in: str,
    seen_every: timedelta | None = SEEN_EVERY,
) -> Written:
    """Merge findings (rows in transform.FINDING_COLUMNS order) and upsert summary windows in one
    transaction. Findings already there keep their first detection; their `last_seen_at` moves
    on when older than `seen_every` (None: left as it is)."""
    new: Counter[str] = Counter()
    refused = None
    with schema_needed(schema), conn.transaction(), conn.cursor() as cur:
        _bounded(cur)
        cur.execute(_sql.query("create_finding_stage", schema))
        with cur.copy(_sql.query("copy_finding_stage", schema)) as copy:
            for row in findings:
                copy.write_row(row)
        if seen_every is not None:
            try:
                with conn.transaction():  # a savepoint: the findings matter more
                    cur.execute(
                        _sql.query("touch_findings", schema),
                        {"every_s": seen_every.total_seconds()},
                    )
            except psycopg.errors.InsufficientPrivilege as exc:
                refused = exc.diag.message_primary or str(exc)
        cur.execute(_sql.query("merge_findings", schema), {"detected_in": detected_in})
        new.update(kind for (kind,) in cur.fetchall())
        rows = list(windows)
        if rows:
            cur.executemany(_sql.query("upsert_window", schema), rows)
    return Written(new, refused)


@dataclass(frozen=True)
class Pruned:
    findings: int
    windows: int
    complete: bool  # False: max_rows were deleted of a table, and more may be due


def prune(
    conn: psycopg.Connection[Any],
    schema: str,
    retention: timedelta,
    *,
    batch: int | None = None,
    max_rows: int | None = None,
) -> Pruned:
    """Delete findings not found and summary windows not written for longer than `retention`,
    `batch` rows a transaction (PRUNE_BATCH), at most about `max_rows` of each table a call
    (PRUNE_MAX_ROWS; the rest at the next)."""
    batch = batch or PRUNE_BATCH
    max_rows = max_rows or PRUNE_MAX_ROWS
    deleted = {}
    complete = True
    with schema_needed(schema), conn.cursor() as cur:
        for table in ("findings", "windows"):
            deleted[table] = 0
            while True:
                with conn.transaction():
                    _bounded(cur)
                    cur.execute(
                        _sql.query(f"prune_{table}", schema),
                        {"retention_s": retention.total_seconds(), "limit": batch},
                    )
                deleted[table] += cur.rowcount
                if cur.rowcount < batch:
                    break
                if deleted[table] >= max_rows:
                    complete = False
                    break
    return Pruned(deleted["findings"], deleted["windows"], complete)


def ledger_rows_by_ids(
    conn: psycopg.Connection[Any], schema: str, ids: Sequence[int]
) -> list[tuple[Any, ...]]:
    """Ledger rows of these ids (transform.LEDGER_SCHEMA order); unknown ids give no row."""
    if not ids:
        return []
    # a transaction of its own: on an autocommit connection the bounds ended with their SELECT
    with conn.transaction(), conn.cursor() as cur:
        _bounded(cur)
        cur.execute(_sql.query("ledger_by_ids", schema), {"ids": list(ids)})
        return cur.fetchall()


def oldest_ended(conn: psycopg.Connection[Any], schema: str) -> datetime | None:
    """The oldest `ended_at` the ledger still keeps (None: it keeps no ended rows)."""
    with conn.transaction():  # as ledger_rows_by_ids
        _bounded(conn)
        row = conn.execute(_sql.query("ledger_oldest_ended", schema)).fetchone()
    return None if row is None else row[0]


def oldest_due(
    conn: psycopg.Connection[Any],
    schema: str,
    lo: datetime,
    hi: datetime,
    include_stuck: bool,
    topics: Sequence[str] | None = None,
) -> datetime | None:
    """The oldest commit time of the rows a judgement of [lo, hi] may call missing (None: none);
    of `topics` only, when given."""
    with conn.transaction():  # as ledger_rows_by_ids
        _bounded(conn)
        row = conn.execute(
            _sql.query("ledger_oldest_due", schema),
            {
                "lo": lo,
                "hi": hi,
                "include_stuck": include_stuck,
                "topics": None if topics is None else list(topics),
            },
        ).fetchone()
    return None if row is None else row[0]
