"""Commit order against a transaction that has taken its commit time but is not visible yet: it
waits for its WAL flush and, with synchronous replication, for its standby. Staged with a
synchronous standby that never answers, so the wait lasts until the test cancels it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import outbox
from outbox import sql as queries
from relay.config import SidecarSettings
from relay.service import Relay, RelayConfigError
from scripts.services import NO_STANDBY
from tests.fixtures.kafka import consume_all
from tests.fixtures.postgres import GrantedRoles
from tests.fixtures.relay import as_role
from tests.fixtures.services import Services
from tests.integration.test_relay_delivery import rows, values


def waiting_for_standby(admin: psycopg.Connection[Any], pid: int) -> bool:
    found = admin.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,))
    return found.fetchone() == ("SyncRep",)


def commit_in_background(conn: psycopg.Connection[Any]) -> threading.Thread:
    thread = threading.Thread(target=conn.commit, daemon=True)
    thread.start()
    return thread


def await_commit_wait(admin: psycopg.Connection[Any], pid: int, thread: threading.Thread) -> bool:
    """True once the commit waits for the standby; False if it ended without waiting."""
    deadline = time.monotonic() + 10
    while not waiting_for_standby(admin, pid):
        if not thread.is_alive():
            return False
        assert time.monotonic() < deadline, "the commit neither waited nor ended"
        time.sleep(0.01)
    return True


@pytest.fixture
def standby_that_never_answers(services: Services, pg_dsn: str) -> Iterator[psycopg.Connection]:
    """Commits with synchronous_commit on wait for a standby that does not exist, on the whole
    server (the suite runs one test at a time); every other session of this test's database
    commits locally (new sessions: made after this). Yields a superuser connection; the server
    is set back however the test ends, which releases every commit still waiting (and the next
    `services.py up` or session clears it after a run killed meanwhile)."""
    dbname = conninfo_to_dict(pg_dsn)["dbname"]
    admin = psycopg.connect(services.pg_dsn, autocommit=True)
    admin.execute(
        sql.SQL("ALTER DATABASE {} SET synchronous_commit = local").format(sql.Identifier(dbname))
    )
    try:
        admin.execute(
            sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                sql.Literal(NO_STANDBY)
            )
        )
        admin.execute("SELECT pg_reload_conf()")
        # The reload reaches each process in its own time: a commit waits once it has reached
        # the one that releases waiters. Commits that end without waiting are tried again.
        with psycopg.connect(pg_dsn, autocommit=True) as setup:
            setup.execute("CREATE TABLE canary (n int)")
        deadline = time.monotonic() + 30
        waited = False
        while not waited:
            assert time.monotonic() < deadline, (
                "no commit waited for the standby in 30 s: this server does not take "
                "synchronous_standby_names from ALTER SYSTEM (set on its command line?)"
            )
            with contextlib.closing(psycopg.connect(pg_dsn)) as canary:
                canary.execute("SET synchronous_commit = on")
                canary.execute("INSERT INTO canary VALUES (1)")
                thread = commit_in_background(canary)
                waited = await_commit_wait(admin, canary.info.backend_pid, thread)
                if waited:
                    admin.execute("SELECT pg_cancel_backend(%s)", (canary.info.backend_pid,))
                thread.join(10)
            time.sleep(0 if waited else 0.05)
        yield admin
    finally:
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        admin.close()


def relay_as(roles: GrantedRoles, settings: Callable[..., SidecarSettings], factory: Any) -> Relay:
    """A relay with the example grants' role: sees other roles' sessions as such a role does."""
    relay: Relay = factory(as_role(settings(), roles.dsn(roles.relay)))
    return relay


@pytest.mark.parametrize("stamping", [False, True], ids=["usual round", "stamping round"])
@pytest.mark.parametrize("missed", [False, True], ids=["listed before", "missed before"])
def test_a_transaction_waiting_for_its_standby_holds_back_those_that_committed_after_it(
    pg_dsn: str,
    kafka_bootstrap: str,
    granted_roles: GrantedRoles,  # first: its roles outlive the relay, which is stopped before
    topic_factory: Callable[..., str],
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Any,
    standby_that_never_answers: psycopg.Connection[Any],
    stamping: bool,
    missed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """T1 takes its commit time, then waits for its standby; T2, of the same key, with the
    smaller xid and synchronous_commit local, commits after it and is visible first. Below the
    horizon, T2 went out first, though it committed second. Without NOTIFY, as the README
    advises at high rates: a notifying commit holds Postgres's notify lock until it is
    visible, and the other's commit waits for it. `missed`: T1 took its id and reached its
    commit after the relay read which transactions run (relay_running_xids), right before the
    statement that holds back: that statement's own snapshot lists it (a transaction with a
    later id has ended: else no snapshot lists an id that high, the gap still open)."""
    admin = standby_that_never_answers
    quiet = outbox.Outbox(notify=False)
    topic = topic_factory()
    relay = relay_as(granted_roles, relay_settings, relay_factory)
    relay.run_once()  # its first stamp: the next round claims unstamped rows itself
    if missed:  # the relay's read of running transactions as it was before T1 took its id
        (xmax,) = admin.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())").fetchone()  # type: ignore[misc]
        staged = (
            "SELECT set_config('outbox_relay.running_xids', '{}', true),"
            f" set_config('outbox_relay.running_xmax', '{xmax}', true)"
        ).encode()
        real = queries.query
        monkeypatch.setattr(
            queries,
            "query",
            lambda name, schema: staged if name == "relay_running_xids" else real(name, schema),
        )
    with (
        contextlib.closing(psycopg.connect(pg_dsn)) as t2,
        contextlib.closing(psycopg.connect(pg_dsn)) as t1,
    ):
        t2.execute("SET lock_timeout = '10s'")  # a failure, not a hang, if T1 held its lock
        t2_xid = t2.execute("SELECT pg_current_xact_id()::text").fetchone()[0]  # type: ignore[index]
        t1.execute("SET synchronous_commit = on")
        quiet.publish(t1, topic, "T1: committed first", key="k")
        t1_xid = t1.execute("SELECT pg_current_xact_id()::text").fetchone()[0]  # type: ignore[index]
        quiet.publish(t2, topic, "T2: committed second", key="k")
        t1_commit = commit_in_background(t1)
        try:
            assert await_commit_wait(admin, t1.info.backend_pid, t1_commit)
            t2.commit()
            t1_ts, t2_ts = admin.execute(
                "SELECT pg_xact_commit_timestamp(%s::xid8::xid),"
                " pg_xact_commit_timestamp(%s::xid8::xid)",
                (t1_xid, t2_xid),
            ).fetchone()  # type: ignore[misc]
            assert int(t2_xid) < int(t1_xid)  # as staged
            assert t1_ts < t2_ts
            with psycopg.connect(pg_dsn, autocommit=True) as later:  # commits locally
                (later_xid,) = later.execute("SELECT pg_current_xact_id()").fetchone()  # type: ignore[misc]
            assert int(str(later_xid)) > int(t1_xid)
            if stamping:
                relay._stamp_all_again()  # a full stamp: the round stamps, then claims
            held = relay.run_once()
            assert held.delivered == 0
            assert held.held_by_horizon  # looked for again soon, not after the poll interval
        finally:
            admin.execute("SELECT pg_cancel_backend(%s)", (t1.info.backend_pid,))
            t1_commit.join(10)
    until = 0
    while rows(pg_dsn) and until < 20:
        relay.run_once()
        until += 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        b"T1: committed first",
        b"T2: committed second",
    ]


@pytest.mark.parametrize(
    "function",
    [
        "pg_stat_get_activity(integer)",
        "pg_xact_commit_timestamp(xid)",
        "pg_snapshot_xip(pg_snapshot)",
    ],
)
def test_a_relay_that_may_not_read_which_transactions_run_refuses_to_start(
    pg_dsn: str,
    granted_roles: GrantedRoles,
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Any,
    function: str,
) -> None:
    """A hardened database that revoked the function from PUBLIC: every claim failed."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:  # this database's catalog alone
        admin.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
    relay = relay_as(granted_roles, relay_settings, relay_factory)
    name = function.split("(")[0]
    with pytest.raises(
        RelayConfigError,
        match=rf"may not read which transactions run and when they committed \(permission "
        rf"denied for function {name}\)",
    ):
        relay.run_once()
