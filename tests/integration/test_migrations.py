"""Migrations: schema.sql equals all migrations; concurrent migrate; least-privilege grants."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

import outbox
from outbox import migrations
from outbox import sql as outbox_sql
from outbox.migrations import (
    CHECKER_SCHEMA_VERSION,
    RELAY_SCHEMA_VERSION,
    SHIPPING_CLAIM_VERSION,
    check_applied,
    current_version,
    latest_version,
    schema_problem,
)
from relay.cli import main as cli_main
from spark import _sql as spark_sql
from spark import sink
from spark.findings import read_findings, read_windows
from spark.sink import Written
from tests.fixtures.services import Services

CATALOG = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
        FROM information_schema.columns WHERE table_schema = %(s)s ORDER BY 1, 2""",
    "constraints": """
        SELECT rel.relname, con.conname, pg_get_constraintdef(con.oid)
        FROM pg_constraint con JOIN pg_class rel ON rel.oid = con.conrelid
        JOIN pg_namespace n ON n.oid = rel.relnamespace WHERE n.nspname = %(s)s ORDER BY 1, 2""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(s)s ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(s)s ORDER BY 1""",
}


def catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    return {k: conn.execute(q, {"s": schema}).fetchall() for k, q in CATALOG.items()}


@pytest.fixture
def empty_db(services: Services) -> Iterator[str]:
    """A database with no outbox schema at all."""
    from tests.fixtures.postgres import _dsn_for

    name = f"outbox_empty_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(services.pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield _dsn_for(services.pg_dsn, name)
    with psycopg.connect(services.pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_schema_file_equals_all_migrations_applied(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA from_file")
        conn.execute(outbox_sql.schema_sql("from_file"))
        conn.execute("CREATE SCHEMA stepwise")
        for migration in outbox_sql.migrations():
            conn.execute(migration.sql_for("stepwise"))
        from_file, stepwise = catalog(conn, "from_file"), catalog(conn, "stepwise")
    assert from_file["columns"]  # the comparison below compares something
    normalise = lambda c: repr(c).replace("from_file", "S").replace("stepwise", "S")  # noqa: E731
    assert normalise(from_file) == normalise(stepwise)


def test_the_reconciliation_on_a_schema_of_an_older_build_says_to_migrate(empty_db: str) -> None:
    """A job upgraded before the schema met a missing column (last_seen_at, 0008) unexplained."""
    from spark import ReconcileConfigError

    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA outbox")
        for migration in outbox_sql.migrations():
            if migration.version < 8:
                conn.execute(migration.sql_for("outbox"))
        with pytest.raises(ReconcileConfigError, match="older than this job: run `outboxctl mig"):
            _write_found_again(conn)
    with pytest.raises(ReconcileConfigError, match="older than this job: run `outboxctl migrate`"):
        read_findings(empty_db)


def test_migrate_is_idempotent_and_versioned(empty_db: str) -> None:
    first = outbox.migrate(empty_db)
    again = outbox.migrate(empty_db)
    assert first.applied == tuple(range(1, latest_version() + 1))
    assert again.applied == ()
    with psycopg.connect(empty_db) as conn:
        assert current_version(conn) == latest_version()
        assert current_version(conn, "absent") is None


@pytest.mark.parametrize(
    "options",
    [{"row_factory": dict_row}, {"cursor_factory": psycopg.RawCursor}, {"prepare_threshold": 0}],
    ids=["dict_row", "RawCursor", "prepare_threshold=0"],
)
def test_migrate_on_a_connection_of_any_row_or_cursor_factory(
    empty_db: str, options: dict[str, Any]
) -> None:
    with psycopg.connect(empty_db, **options) as conn:
        assert current_version(conn) is None
        assert outbox.migrate(conn).applied == tuple(range(1, latest_version() + 1))
        assert outbox.migrate(conn).applied == ()
        assert current_version(conn) == latest_version()
        check_applied(conn)
        assert schema_problem(conn) is None


def _migrated_to(conn: psycopg.Connection[Any], version: int, schema: str = "outbox") -> None:
    """`schema` made as migrate() makes it, but only up to `version` (an older build's)."""
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    for migration in outbox_sql.migrations()[:version]:
        conn.execute(migration.sql_for(schema))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {}.schema_migration (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(sql.Identifier(schema))
    )
    for migration in outbox_sql.migrations()[:version]:
        conn.execute(
            sql.SQL("INSERT INTO {}.schema_migration (version, name) VALUES (%s, %s)").format(
                sql.Identifier(schema)
            ),
            (migration.version, migration.name),
        )


def one_release_behind(dsn: str) -> outbox_sql.Migration:
    """The schema as the release before this one left it; returns the migration it lacks."""
    *older, last = outbox_sql.migrations()
    with psycopg.connect(dsn, autocommit=True) as conn:
        _migrated_to(conn, len(older))
    return last


def test_migrate_upgrades_on_a_connection_that_prepares_every_statement(empty_db: str) -> None:
    """A pool's prepare_threshold=0 prepares even a statement's first run, and Postgres refuses
    to prepare one of several commands: an upgrade (and a fresh schema) failed with "cannot
    insert multiple commands into a prepared statement", while an up-to-date schema did not."""
    last = one_release_behind(empty_db)
    with psycopg.connect(empty_db, prepare_threshold=0) as conn:
        assert outbox.migrate(conn).applied == (last.version,)
        check_applied(conn)
        assert schema_problem(conn) is None


@pytest.mark.parametrize("autocommit", [True, False])
def test_migrate_refuses_a_connection_in_pipeline_mode_by_name(
    empty_db: str, autocommit: bool
) -> None:
    """Pipeline mode refuses a statement of several commands: migrating a fresh schema there
    failed with Postgres's "cannot insert multiple commands into a prepared statement"."""
    with psycopg.connect(empty_db, autocommit=autocommit) as conn:
        with conn.pipeline(), pytest.raises(outbox.OutboxUsageError, match="pipeline mode"):
            outbox.migrate(conn)
        conn.rollback()
        assert current_version(conn) is None  # nothing written
        assert outbox.migrate(conn).version == latest_version()  # out of the pipeline: works


def test_migrate_refuses_a_closed_connection_by_name(empty_db: str) -> None:
    """Its status, UNKNOWN, was read as a transaction open: "commit or roll back first"."""
    conn = psycopg.connect(empty_db)
    conn.close()
    with pytest.raises(outbox.OutboxUsageError, match="closed connection"):
        outbox.migrate(conn)


def test_migrate_refuses_an_async_connection_by_name(empty_db: str) -> None:
    """It failed with "'Lock' object does not support the context manager protocol" and a
    coroutine never awaited."""

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(empty_db) as conn:
            with pytest.raises(outbox.OutboxUsageError, match=r"AsyncConnection.*pass a DSN"):
                outbox.migrate(conn)  # type: ignore[arg-type]

    asyncio.run(main())
    with psycopg.connect(empty_db) as conn:
        assert current_version(conn) is None  # nothing written


def test_concurrent_migrate_from_many_pods(empty_db: str) -> None:
    results: list[object] = []
    barrier = threading.Barrier(4)

    def pod() -> None:
        barrier.wait()
        try:
            results.append(outbox.migrate(empty_db).applied)
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=pod) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=len) == [(), (), (), tuple(range(1, latest_version() + 1))]


def test_migrate_of_an_older_build_on_a_newer_schema_applies_nothing(empty_db: str) -> None:
    """It failed ("upgrade the library"), or with the chart's own role "permission denied for
    database" (its CREATE SCHEMA IF NOT EXISTS), while schema-version said this build runs on
    the schema: an older release's migration hook failed, and the release could be rolled
    neither back nor forward."""
    outbox.migrate(empty_db)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.schema_migration (version, name) VALUES (999, 'future')")
    sidecar = f"relay_{uuid.uuid4().hex[:8]}"  # the chart's hook runs as the sidecar's role
    with psycopg.connect(empty_db, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(sidecar)))
        admin.execute(outbox_sql.grants_sql("outbox", sidecar, sidecar, sidecar))
    try:
        report = outbox.migrate(make_conninfo(empty_db, user=sidecar))
    finally:
        with psycopg.connect(empty_db, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(sidecar)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(sidecar)))
    assert (report.applied, report.version) == ((), 999)


def test_concurrent_migrate_under_a_repeatable_read_default(empty_db: str) -> None:
    """Under REPEATABLE READ the waiting pod's snapshot was taken before the other's migration
    committed: it found no migration applied, and failed creating the tables again."""
    repeatable = make_conninfo(
        empty_db, options="-c default_transaction_isolation=repeatable\\ read"
    )
    results = migrated_while_another_waits(empty_db, repeatable)
    assert sorted(results, key=str) == [(), tuple(range(1, latest_version() + 1))]


def migrated_while_another_waits(
    dsn: str, waiter: str, meanwhile: Callable[[list[object]], None] = lambda _: None
) -> list[object]:
    """Migrate from a session that holds the migration lock while another (`waiter`, a DSN)
    runs migrate and waits for it; `meanwhile` is given the results once it waits. The
    results of both, or the waiter's error."""
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute(
            "SELECT pg_advisory_lock(%s, hashtext('outbox'))", (migrations._LOCK_NAMESPACE,)
        )
        results: list[object] = []
        waiting = threading.Thread(
            target=lambda: results.append(_migrated_or_error(waiter)), daemon=True
        )
        waiting.start()
        wait_for_a_lock_wait(holder, "advisory")
        meanwhile(results)
        results.append(outbox.migrate(holder).applied)  # its session holds the lock already
        holder.execute(
            "SELECT pg_advisory_unlock(%s, hashtext('outbox'))", (migrations._LOCK_NAMESPACE,)
        )
        waiting.join(30)
    return results


def test_a_role_that_may_only_read_waits_out_anothers_migration_and_applies_nothing(
    empty_db: str,
) -> None:
    """Its check without the lock found no schema yet; once the lock was its own, it ran
    CREATE SCHEMA IF NOT EXISTS all the same: "permission denied for database" (two releases'
    hooks at once, one of them with the sidecar's role)."""
    sidecar = f"relay_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_db, autocommit=True) as holder:
        holder.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(sidecar)))
        try:
            holder.execute(
                "SELECT pg_advisory_lock(%s, hashtext('outbox'))", (migrations._LOCK_NAMESPACE,)
            )
            results: list[object] = []
            waiting = threading.Thread(
                target=lambda: results.append(
                    _migrated_or_error(make_conninfo(empty_db, user=sidecar))
                ),
                daemon=True,
            )
            waiting.start()
            wait_for_a_lock_wait(holder, "advisory")
            assert outbox.migrate(holder).applied  # the owner's, while the other waits
            holder.execute(outbox_sql.grants_sql("outbox", sidecar, sidecar, sidecar))
            holder.execute(
                "SELECT pg_advisory_unlock(%s, hashtext('outbox'))", (migrations._LOCK_NAMESPACE,)
            )
            waiting.join(30)
        finally:
            holder.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(sidecar)))
            holder.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(sidecar)))
    assert results == [()]


@pytest.mark.parametrize("timeout", ["statement_timeout", "lock_timeout"])
def test_a_migrate_waits_out_anothers_past_its_roles_timeouts(
    empty_db: str, monkeypatch: pytest.MonkeyPatch, timeout: str
) -> None:
    """The wait for another's migration (index builds over an archive) ran under the role's
    statement_timeout and lock_timeout: cancelled, and tried again a few times, migrate failed
    meanwhile."""
    monkeypatch.setattr(migrations, "_LOCK_ATTEMPTS", 1)
    hurried = make_conninfo(empty_db, options=f"-c {timeout}=200")

    def still_waiting(results: list[object]) -> None:
        waited_past = time.monotonic() + 1.0  # five times its timeout
        while time.monotonic() < waited_past:
            assert not results, results  # cancelled, it returned an error
            time.sleep(0.05)

    results = migrated_while_another_waits(empty_db, hurried, still_waiting)
    assert sorted(results, key=str) == [(), tuple(range(1, latest_version() + 1))]


def _migrated_or_error(dsn: str) -> object:
    try:
        return outbox.migrate(dsn).applied
    except Exception as exc:
        return exc


def wait_for_a_lock_wait(conn: psycopg.Connection[Any], kind: str) -> None:
    deadline = time.monotonic() + 30
    while not conn.execute(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = %s", (kind,)
    ).fetchone()[0]:  # type: ignore[index]
        assert time.monotonic() < deadline, f"nobody waits on a {kind} lock"
        time.sleep(0.02)


def test_an_upgrade_waits_for_busy_tables_in_bounded_tries_not_a_deadlock(
    empty_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its locks grew statement by statement (an index's SHARE, then an ALTER's ACCESS
    EXCLUSIVE) while an application's transaction held one and asked for another: Postgres
    found a deadlock and aborted one of the two. The tables are now locked at once, each try
    waiting 3 s at most."""
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _migrated_to(conn, 5)  # 0006 changes outbox_record
    with psycopg.connect(empty_db) as app:
        app.execute("SELECT count(*) FROM outbox.outbox_record")  # an application's read
        done: list[object] = []
        upgrade = threading.Thread(target=lambda: done.append(_migrated_or_error(empty_db)))
        with caplog.at_level(logging.WARNING, logger="outbox.migrations"):
            upgrade.start()
            deadline = time.monotonic() + 30
            while "its tables are busy" not in caplog.text:
                assert time.monotonic() < deadline, "the migration never gave up a try"
                time.sleep(0.05)
            # the application goes on, and is not the one aborted
            outbox.publish(app, "orders", {"n": 1})
            app.commit()
            upgrade.join(60)
    assert done == [tuple(range(6, latest_version() + 1))]


def test_an_upgrade_that_leaves_the_records_alone_does_not_wait_for_their_writers(
    empty_db: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every table was locked for any migration: one of the audit log's alone waited for an
    application's open transaction (3 s a try), and held back every publish behind it."""
    *older, last = released = outbox_sql.migrations()[:9]  # the release that brought 0009
    assert last.version == 9  # the audit log's alone
    assert "outbox_record" not in last.text
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _migrated_to(conn, len(older))
    monkeypatch.setattr(outbox_sql, "migrations", lambda: released)
    with psycopg.connect(empty_db) as app:
        outbox.publish(app, "orders", {"n": 1})  # and its transaction stays open
        with caplog.at_level(logging.WARNING, logger="outbox.migrations"):
            assert outbox.migrate(empty_db).applied == (last.version,)
        assert "busy" not in caplog.text
        app.commit()


def test_schema_version_passes_a_newer_schema_this_build_runs_on(
    empty_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gate on `outboxctl schema-version` blocked the older pods of a rolling upgrade once
    the newer ones had migrated, although they run on it (migrations only add)."""
    assert cli_main(["schema-version", "--dsn", empty_db, "--schema", "outbox"]) == 1
    assert "not migrated" in capsys.readouterr().out
    outbox.migrate(empty_db)
    assert cli_main(["schema-version", "--dsn", empty_db, "--schema", "outbox"]) == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.schema_migration (version, name) VALUES (999, 'future')")
    capsys.readouterr()
    assert cli_main(["schema-version", "--dsn", empty_db, "--schema", "outbox", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["version"], report["latest"], report["problem"]) == (999, latest_version(), None)
    assert cli_main(["schema-version", "--dsn", empty_db, "--schema", "outbox"]) == 0
    assert "(newer: this build runs on it)" in capsys.readouterr().out


_PLACEHOLDER = re.compile(r"%\((\w+)\)[sbt]|%%")


def _prepared(conn: psycopg.Connection[Any], text: str) -> str | None:
    """Why Postgres will not prepare `text` (psycopg's placeholders made $n), or None."""
    numbers: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        if m[0] == "%%":
            return "%"
        return f"${numbers.setdefault(m[1], len(numbers) + 1)}"

    name = f"p{uuid.uuid4().hex}".encode()
    result = conn.pgconn.prepare(name, _PLACEHOLDER.sub(number, text).encode())
    if result.status == psycopg.pq.ExecStatus.COMMAND_OK:
        conn.pgconn.exec_(b"DEALLOCATE " + name)
        return None
    return (result.error_message or b"").decode().strip()


@pytest.mark.parametrize(
    ("part", "needs"), [("relay_", RELAY_SCHEMA_VERSION), ("checker_", CHECKER_SCHEMA_VERSION)]
)
def test_each_part_of_the_sidecar_runs_on_the_schema_version_it_says_it_needs(
    empty_db: str, part: str, needs: int
) -> None:
    """Gated at the latest version, every relay of a rollout whose migration was put off
    stopped, for a migration of another part's (the reconciliation's, the audit log's). Each
    query of the part is prepared on a schema at the version it says it needs, and one below."""
    names = [name for name in outbox_sql._queries() if name.startswith(part)]
    schemas = {"latest": latest_version(), "needs": needs, "below": needs - 1}
    with psycopg.connect(empty_db, autocommit=True) as conn:
        for schema, version in schemas.items():
            _migrated_to(conn, version, schema)
        why = {
            schema: {
                name: _prepared(
                    conn, outbox_sql.with_schema(outbox_sql._queries()[name], schema).as_string()
                )
                for name in names
            }
            for schema in schemas
        }
        _migrated_to(conn, needs)
        assert schema_problem(conn, "outbox", needs) is None
        assert f"at version {needs}, this needs {latest_version()}" in str(schema_problem(conn))
    # what Postgres cannot type without values (a parameter beside an interval), on any schema
    untyped = {name for name, problem in why["latest"].items() if problem is not None}
    assert untyped <= {"checker_prepared_ages"}, why["latest"]
    assert len(names) - len(untyped) >= 10  # the comparison below compares something
    assert {n: p for n, p in why["needs"].items() if n not in untyped and p is not None} == {}
    assert [n for n, p in why["below"].items() if n not in untyped and p is not None]


def test_the_shipping_claim_is_used_only_where_the_schema_has_it(empty_db: str) -> None:
    """The relay's mark of the discarded rows it takes (and its recovery's unmark of those
    not shipped), and the commands' check of it, need SHIPPING_CLAIM_VERSION; below it (a
    migration put off) re-arm works as before (the relay on such a schema: test_relay_delivery)."""
    from checker import rearm
    from relay.records import list_records

    names = [name for name in outbox_sql._queries() if name.startswith("shipping_")]
    assert len(names) == 3
    with psycopg.connect(empty_db, autocommit=True) as conn:
        for schema, version in (
            ("has", SHIPPING_CLAIM_VERSION),
            ("lacks", SHIPPING_CLAIM_VERSION - 1),
        ):
            _migrated_to(conn, version, schema)
        why = {
            schema: [
                _prepared(
                    conn, outbox_sql.with_schema(outbox_sql._queries()[n], schema).as_string()
                )
                for n in names
            ]
            for schema in ("has", "lacks")
        }
        assert why["has"] == [None] * len(names)
        assert all(w and "shipping_since" in w for w in why["lacks"]), why["lacks"]
        # a discarded transaction on the older schema is listed and re-armed, not failed on
        # the column
        conn.execute(
            "INSERT INTO lacks.outbox_record (producer_group, tx_id, topic, value, key_hash, "
            "state, reason) VALUES ('default', 'tx-1', 'orders', 'v', 1, 'discarded', 'max age')"
        )
        (listed,) = list_records(conn, "lacks")
        assert (listed.state, listed.shipping_since) == ("discarded", None)
        assert rearm(conn, "default", "tx-1", actor="ops", schema="lacks").changed
        (state,) = conn.execute("SELECT state FROM lacks.outbox_record").fetchone() or ("",)
        assert state == "prepared"


def test_schema_version_passes_a_schema_older_than_the_library_that_the_sidecar_runs_on(
    empty_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    needs = max(RELAY_SCHEMA_VERSION, CHECKER_SCHEMA_VERSION)
    assert needs < latest_version()  # else this compares nothing
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _migrated_to(conn, needs)
    assert cli_main(["schema-version", "--dsn", empty_db, "--schema", "outbox"]) == 0
    assert "(older: this build's relay and checker run on it" in capsys.readouterr().out
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox.schema_migration WHERE version = %s", (needs,))
    assert cli_main(["schema-version", "--dsn", empty_db, "--schema", "outbox"]) == 1
    assert f"this needs {needs}" in capsys.readouterr().out


def test_a_migration_applied_under_another_name_is_refused(
    empty_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another build's migration of the same number: skipped by number, its columns would be
    missing, and the relay and the checker would fail every round without saying why."""
    outbox.migrate(empty_db)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("UPDATE outbox.schema_migration SET name = 'elsewhere' WHERE version = 2")
    with pytest.raises(
        outbox.SchemaError, match=r"2 as 'elsewhere' \(this library's: 'reconciliation'\)"
    ):
        outbox.migrate(empty_db)
    with psycopg.connect(empty_db) as conn, pytest.raises(outbox.SchemaError, match="another"):
        check_applied(conn)
    assert cli_main(["schema-version", "--dsn", empty_db]) == 1  # the number alone is right
    assert "'elsewhere'" in capsys.readouterr().out
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("UPDATE outbox.schema_migration SET name = 'reconciliation' WHERE version = 2")
        check_applied(conn)  # this library's again
    assert outbox.migrate(empty_db).applied == ()


def test_least_privilege_grants(pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    suffix = uuid.uuid4().hex[:8]
    writer, relay, reconciler = f"writer_{suffix}", f"relay_{suffix}", f"recon_{suffix}"
    roles = (writer, relay, reconciler)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for role in roles:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(outbox_sql.grants_sql("outbox", writer, relay, reconciler))
    try:
        with psycopg.connect(pg_dsn, user=writer) as app:
            with app.transaction():
                outbox.publish(app, "t", "v", tx_id="with-reuse-check")
                half = outbox.prepare(app, "t", "half")
            outbox.commit(app, half.tx_id)
            app.commit()
            for forbidden in (
                "SELECT value FROM outbox.outbox_record",
                "DELETE FROM outbox.outbox_record",
                "SELECT * FROM outbox.shard_lease",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    app.execute(forbidden)
                app.rollback()
        with psycopg.connect(pg_dsn, user=relay) as sidecar:
            assert sidecar.execute("SELECT count(*) FROM outbox.outbox_record").fetchone() == (2,)
            sidecar.execute("UPDATE outbox.outbox_record SET state = 'delivered'")
            sidecar.execute("DELETE FROM outbox.outbox_record")
            sidecar.execute("DELETE FROM outbox.audit_log")  # its audit_retention
            # who wrote an entry, and when, come from the defaults: a command cannot say them
            entry = sidecar.execute(
                "INSERT INTO outbox.audit_log (actor, action) VALUES ('anyone', 'rearm')"
                " RETURNING db_role, client_addr IS NOT DISTINCT FROM inet_client_addr()"
            ).fetchone()
            assert entry == (relay, True)
            for forged in ("db_role", "client_addr", "at"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    sidecar.execute(
                        sql.SQL(
                            "INSERT INTO outbox.audit_log (actor, action, {}) "
                            "SELECT 'anyone', 'rearm', {} FROM outbox.audit_log LIMIT 1"
                        ).format(sql.Identifier(forged), sql.Identifier(forged))
                    )
                sidecar.rollback()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                sidecar.execute("INSERT INTO outbox.outbox_record (producer_group) VALUES ('x')")
            sidecar.rollback()
            for forbidden in (
                "DELETE FROM outbox.shard_lease",  # no component does: an operator empties it
                "DELETE FROM outbox.reconciliation_finding",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    sidecar.execute(forbidden)
                sidecar.rollback()
        # `outboxctl findings` in the sidecar's container, where the alert says to run it
        assert read_findings(make_conninfo(pg_dsn, user=relay), "outbox") == []
        assert read_windows(make_conninfo(pg_dsn, user=relay), "outbox") == []
        with psycopg.connect(pg_dsn, user=relay, autocommit=True) as sidecar:
            # the chart's hook runs with the sidecar's role on every upgrade: an up-to-date
            # schema needs no DDL (CREATE SCHEMA IF NOT EXISTS needs CREATE on the database)
            assert outbox.migrate(sidecar).applied == ()
        with psycopg.connect(pg_dsn, user=reconciler) as spark_job:
            spark_job.execute("SELECT count(*) FROM outbox.outbox_record")
            # every ledger query of the job, and no record contents (it never reads them)
            now = datetime.now(UTC)
            spark_job.execute(spark_sql.query("ledger_window", "outbox", ended_from=now,
                                              ended_until=now))  # fmt: skip
            spark_job.execute(spark_sql.query("ledger_by_ids", "outbox"), {"ids": [1]})
            spark_job.execute(spark_sql.query("ledger_oldest_ended", "outbox"))
            spark_job.execute(
                spark_sql.query("ledger_oldest_due", "outbox"),
                {"lo": now, "hi": now, "include_stuck": True, "topics": ["orders"]},
            )
            for contents in ("value", "headers"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    spark_job.execute(f"SELECT {contents} FROM outbox.outbox_record")
                spark_job.rollback()
            spark_job.execute("SELECT count(*) FROM outbox.reconciliation_finding")
            spark_job.execute("DELETE FROM outbox.reconciliation_finding")  # its retention
            spark_job.execute("DELETE FROM outbox.reconciliation_window")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                spark_job.execute("DELETE FROM outbox.outbox_record")
        with psycopg.connect(pg_dsn, user=reconciler, autocommit=True) as spark_job:
            assert _write_found_again(spark_job) == sink.Written(Counter(missing=1))
            assert _write_found_again(spark_job) == sink.Written(Counter())  # last_seen_at moved
        with psycopg.connect(pg_dsn, autocommit=True) as admin:  # as granted before 0008
            admin.execute(
                sql.SQL("REVOKE UPDATE ON outbox.reconciliation_finding FROM {}").format(
                    sql.Identifier(reconciler)
                )
            )
        with psycopg.connect(pg_dsn, user=reconciler, autocommit=True) as spark_job:
            refused = _write_found_again(spark_job, outbox_id=2)
            assert refused.new == Counter(missing=1)  # written all the same
            assert "permission denied" in str(refused.seen_refused)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:  # as granted before retention
            admin.execute(
                sql.SQL("REVOKE DELETE ON outbox.reconciliation_finding FROM {}").format(
                    sql.Identifier(reconciler)
                )
            )
        with psycopg.connect(pg_dsn, user=reconciler, autocommit=True) as spark_job:
            _prune_without_delete(spark_job, pg_dsn)
        said = [r.message for r in caplog.records if "findings are kept for ever" in r.message]
        assert len(said) == 1  # once, not at every judgement
        assert "grant it DELETE" in said[0]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for role in roles:
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _write_found_again(conn: psycopg.Connection[Any], outbox_id: int = 1) -> Written:
    """A missing finding as a judgement writes it, its last_seen_at moved on however new."""
    row = ("missing", "t", outbox_id, "", None, None, None, None, datetime.now(UTC), "{}")
    return sink.write_judgement(
        conn, "outbox", [row], [], detected_in="tick", seen_every=timedelta(0)
    )


def _prune_without_delete(conn: psycopg.Connection[Any], dsn: str) -> None:
    """The reconciliation job goes on, keeping its findings, and says what to grant."""
    from spark.config import ReconcileSettings
    from spark.job import ReconcileJob

    settings = ReconcileSettings(
        dsn=dsn, bootstrap_servers="k", topics=("t",), checkpoint="cp"
    )  # fmt: skip
    job = ReconcileJob(settings, spark=None)  # type: ignore[arg-type]  # not needed to prune
    job._prune(conn)  # no error: logged
    job._prune(conn)  # and not tried again
