"""Postgres runs with the settings the relay's ordering relies on (design properties 3 and 4)."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from scripts import services as local_services
from tests.fixtures.services import Services


def test_settings_the_design_needs(pg_conn: psycopg.Connection) -> None:
    assert pg_conn.execute("SHOW track_commit_timestamp").fetchone() == ("on",)
    assert pg_conn.execute("SHOW wal_level").fetchone() == ("logical",)


def test_xact_id_and_commit_timestamp_round_trip(pg_conn: psycopg.Connection) -> None:
    pg_conn.execute("CREATE TABLE probe (id int PRIMARY KEY)")
    pg_conn.commit()

    before = pg_conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    pg_conn.commit()
    with pg_conn.transaction():
        pg_conn.execute("INSERT INTO probe VALUES (1)")
        xid8 = pg_conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]  # type: ignore[index]
    row = pg_conn.execute(
        """SELECT xmin::text::bigint, pg_xact_commit_timestamp(xmin),
                  pg_snapshot_xmin(pg_current_snapshot())::text::bigint
           FROM probe"""
    ).fetchone()
    assert row is not None
    row_xid, committed_at, horizon = row
    assert row_xid == xid8 % 2**32  # xmin is the 32-bit xid of the 64-bit xact id
    assert committed_at is not None
    assert committed_at >= before
    assert horizon > xid8  # the writer has ended, so its xid is below the horizon


@pytest.mark.parametrize("run", [1, 2])  # the second run must not see the first's table
def test_each_test_gets_its_own_database(
    pg_conn: psycopg.Connection, pg_template: str, run: int
) -> None:
    name = pg_conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
    assert name.startswith("outbox_test_")
    assert name != pg_template
    probe_tables = "SELECT count(*) FROM pg_tables WHERE tablename = 'isolation_probe'"
    assert pg_conn.execute(probe_tables).fetchone() == (0,)
    pg_conn.execute("CREATE TABLE isolation_probe (run int)")
    pg_conn.commit()


def test_a_prepared_transaction_a_killed_run_left_is_rolled_back_by_the_next_up(
    pg_dsn: str, services: Services
) -> None:
    """Left by a killed test run, it survived restarts and held the whole cluster's xid horizon
    back: no relay of the local Postgres delivered anything again (found by a review)."""
    if services.source != "script":
        pytest.skip(f"the local services script does not run {services.source}'s Postgres")
    left = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        database = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        conn.execute("CREATE TABLE held (id int)")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO held VALUES (1)")
        conn.execute("PREPARE TRANSACTION 'left-by-a-killed-run'")
        try:
            bindir = local_services.pg_bindir()
            assert bindir is not None
            local_services.rollback_stale_prepared(bindir, database=database)  # not stale yet
            assert conn.execute(left).fetchall() == [("left-by-a-killed-run",)]
            local_services.rollback_stale_prepared(bindir, older_than="0 s", database=database)
            assert conn.execute(left).fetchall() == []
            assert conn.execute("SELECT count(*) FROM held").fetchone() == (0,)
        finally:  # left prepared, it held every later test's horizon (and its database)
            if conn.execute(left).fetchall():
                conn.execute("ROLLBACK PREPARED 'left-by-a-killed-run'")


def test_a_standby_name_a_killed_run_left_is_cleared_by_the_next_up(services: Services) -> None:
    """tests/integration/test_relay_commit_wait.py names a synchronous standby that never
    answers: left set by a run killed in that test, every later commit would wait for it."""
    if services.source != "script":
        pytest.skip(f"the local services script does not run {services.source}'s Postgres")

    def shown() -> str:
        with psycopg.connect(services.pg_dsn, autocommit=True) as fresh:  # the reloaded value
            return fresh.execute("SHOW synchronous_standby_names").fetchone()[0]  # type: ignore[index,no-any-return]

    def await_shown(value: str) -> None:
        deadline = time.monotonic() + 10
        while shown() != value:
            assert time.monotonic() < deadline, f"synchronous_standby_names never became {value!r}"
            time.sleep(0.02)

    with psycopg.connect(services.pg_dsn, autocommit=True) as admin:
        try:
            admin.execute(
                sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                    sql.Literal(local_services.NO_STANDBY)
                )
            )
            admin.execute("SELECT pg_reload_conf()")
            await_shown(local_services.NO_STANDBY)
            bindir = local_services.pg_bindir()
            assert bindir is not None
            local_services.release_commits_left_waiting(bindir)
            await_shown("")
        finally:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")
