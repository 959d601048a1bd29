"""Every connection the sidecar keeps gives up on a database gone silent (dead_peer_options).

What it does against a real silent peer is in test_relay_failover.py (with iptables); here, that
each kind of connection carries the options, and that the DSN's own values win.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from checker import CheckerSettings
from checker.service import Checker
from relay import cli_database
from relay.config import DatabaseSettings, SidecarSettings
from relay.service import Relay
from spark import sink


def tcp_options(conn: psycopg.Connection[Any]) -> dict[str, str]:
    wanted = {"tcp_user_timeout", "keepalives", "keepalives_idle", "keepalives_count"}
    found = {o.keyword.decode(): (o.val or b"").decode() for o in conn.pgconn.info}
    return {name: value for name, value in found.items() if name in wanted}


EXPECTED = {"tcp_user_timeout": "4000", "keepalives": "1", "keepalives_idle": "4"}


def test_the_relays_connections_give_up_after_the_connect_timeout(
    pg_dsn: str,
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Callable[..., Relay],
) -> None:
    built = relay_settings(claim_ahead=True, listen_notify=True)
    database = DatabaseSettings(dsn=pg_dsn, connect_timeout_s=4)
    relay = relay_factory(built.model_copy(update={"database": database}))
    relay.run_once()
    assert relay.ready()["database"]
    with relay._connect() as made:  # as the ender's, claimer's and LISTEN's are made
        kept = {"rounds": relay.conn, "probe": relay._db_probe._conn, "others": made}
        for name, conn in kept.items():
            assert conn is not None, name
            assert tcp_options(conn).items() >= EXPECTED.items(), name
            assert tcp_options(conn)["keepalives_count"] == "3", name


def test_the_checkers_outboxctls_and_the_reconciliations_connections_too(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = Checker(CheckerSettings(), pg_dsn, connect_timeout_s=4)
    try:
        assert tcp_options(checker._connection()).items() >= EXPECTED.items()
    finally:
        checker.stop()
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", pg_dsn)
    monkeypatch.setenv("OUTBOX_DATABASE__CONNECT_TIMEOUT_S", "4")
    with cli_database.connect(argparse.Namespace(dsn=None)) as conn:
        assert tcp_options(conn).items() >= EXPECTED.items()
    with sink.connect(pg_dsn) as conn:  # its own 10 s
        assert tcp_options(conn)["tcp_user_timeout"] == "10000"
        assert conn.info.get_parameters()["connect_timeout"] == "10"


def test_the_reconciliations_connections_take_the_dsns_connect_timeout(pg_dsn: str) -> None:
    """The sink passed its 10 s over the DSN's `connect_timeout`: a database further away than
    that could not be reached by the job or `outboxctl findings`, whatever the DSN said."""
    with sink.connect(make_conninfo(pg_dsn, connect_timeout=25)) as conn:
        assert conn.info.get_parameters()["connect_timeout"] == "25"


def test_the_dsns_own_values_win(
    pg_dsn: str,
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Callable[..., Relay],
) -> None:
    dsn = make_conninfo(pg_dsn, tcp_user_timeout=2500, keepalives_idle=60)
    built = relay_settings()
    relay = relay_factory(built.model_copy(update={"database": DatabaseSettings(dsn=dsn)}))
    options = tcp_options(relay.conn)
    assert options["tcp_user_timeout"] == "2500"
    assert options["keepalives_idle"] == "60"
    assert options["keepalives_count"] == "3"


def setting(conn: psycopg.Connection[Any], name: str) -> str:
    """A setting of the session, read without leaving a transaction open on it."""
    (value,) = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()  # type: ignore[misc]
    conn.rollback()
    return str(value)


def idle_limit(conn: psycopg.Connection[Any]) -> str:
    return setting(conn, "idle_in_transaction_session_timeout")


def test_a_sidecar_transaction_left_idle_is_ended_by_the_server(
    pg_dsn: str, relay_factory: Callable[..., Relay]
) -> None:
    """A sidecar whose node died between a statement and its COMMIT left its backend idle in
    transaction until the server's TCP keepalive gave up (two hours): its transaction id held
    back every relay's xid horizon, and its lock on a lease row kept the shard from the other
    relays (found by a review)."""
    relay = relay_factory(lease_duration="PT1S")
    relay.run_once()
    with relay._connect() as made:  # as the ender's and claimer's are made
        assert idle_limit(relay.conn) == idle_limit(made) == "5s"  # at least a few seconds
        # a host gone is found by the server's keepalives, as by the client's: connect_timeout_s
        for name, value in {
            "tcp_keepalives_idle": "10",
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "3",
            "tcp_user_timeout": "10000",
        }.items():
            assert setting(made, name) == value, name
    checker = Checker.from_sidecar_settings(relay.settings)
    try:
        assert idle_limit(checker._connection()) == "1min"
    finally:
        checker.stop()
    conn = relay.conn
    pid = conn.info.backend_pid
    # the lease row locked, and then nothing: as from a node gone
    conn.execute("SELECT 1 FROM outbox.shard_lease WHERE owner = %s FOR UPDATE", (relay.relay_id,))
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        deadline = time.monotonic() + 30
        while other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the idle transaction was left open"
            time.sleep(0.1)
        free = other.execute(
            "SELECT shard FROM outbox.shard_lease WHERE owner = %s FOR UPDATE SKIP LOCKED",
            (relay.relay_id,),
        ).fetchall()
    assert free == [(0,)]


def database_default(dsn: str, setting: str, value: str | None) -> None:
    """As a DBA sets it (None: resets it), for the new sessions of the test's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        name = sql.Identifier(conn.info.dbname)
        if value is None:
            conn.execute(sql.SQL("ALTER DATABASE {} RESET {}").format(name, sql.SQL(setting)))
        else:
            statement = sql.SQL("ALTER DATABASE {} SET {} = {}")
            conn.execute(statement.format(name, sql.SQL(setting), sql.Literal(value)))


def test_a_shorter_idle_limit_of_the_database_is_kept_and_a_pooler_gets_none(
    pg_dsn: str, relay_settings: Callable[..., SidecarSettings], relay_factory: Callable[..., Relay]
) -> None:
    database_default(pg_dsn, "idle_in_transaction_session_timeout", "2s")
    database_default(pg_dsn, "idle_session_timeout", "1s")
    relay = relay_factory()
    relay.run_once()
    assert idle_limit(relay.conn) == "2s"
    # kept open on purpose: closed unsaid, the next use of an ender's or a LISTEN failed
    assert setting(relay.conn, "idle_session_timeout") == "0"
    time.sleep(1.5)  # longer than the database lets a session idle
    relay.run_once()
    pooled = relay_settings(listen_notify=False)
    database = DatabaseSettings(dsn=pg_dsn, transaction_pooling=True)
    pooled = pooled.model_copy(update={"database": database})
    # session state would stay with the pooler's server connection, for other clients: none set
    database_default(pg_dsn, "idle_in_transaction_session_timeout", None)
    database_default(pg_dsn, "idle_session_timeout", None)
    assert idle_limit(relay_factory(pooled).conn) == "0"
    checker = Checker.from_sidecar_settings(pooled)
    try:
        assert idle_limit(checker._connection()) == "0"
    finally:
        checker.stop()


def test_a_judgements_write_gives_up_on_a_lock_held_without_end(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its write waited for ever behind an operator's transaction open on the findings: the
    judgement, and the idle ticks behind it, stopped, and the job's probes stayed green."""
    monkeypatch.setattr(sink, "LOCK_TIMEOUT_S", 1)
    with psycopg.connect(pg_dsn) as operator:
        operator.execute("LOCK TABLE outbox.reconciliation_finding IN ACCESS EXCLUSIVE MODE")
        with sink.connect(pg_dsn) as conn, pytest.raises(psycopg.errors.LockNotAvailable):
            sink.write_judgement(conn, "outbox", [], [], detected_in="test")
    with sink.connect(pg_dsn) as conn:  # the bounds were the transaction's, not the session's
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)


def test_rows_due_on_topics_a_job_does_not_watch_are_not_its_concern(pg_dsn: str) -> None:
    """A row stuck on another topic made every judgement of a job naming its topics read
    Kafka back to that row's commit, and no idle tick skip its Spark run."""
    from datetime import UTC, datetime

    import outbox

    with psycopg.connect(pg_dsn) as conn:
        for topic in ("payments", "orders"):  # the unwatched one committed first
            with conn.transaction():
                outbox.publish(conn, topic, "v")
        when = dict(
            conn.execute(
                "SELECT topic, pg_xact_commit_timestamp(committed_xid::xid)"
                " FROM outbox.outbox_record"
            ).fetchall()
        )
        now = datetime.now(UTC)
        assert sink.oldest_due(conn, "outbox", now, now, True, ["orders"]) == when["orders"]
        assert sink.oldest_due(conn, "outbox", now, now, True) == when["payments"]
