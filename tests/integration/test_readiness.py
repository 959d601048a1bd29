"""/readyz: its database check keeps one connection between probes; the shards it lists are held."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox import Outbox
from relay.dbprobe import DatabaseProbe
from relay.http import CHECK_WITHIN_S, READY_WITHIN_S
from relay.kafka import CLIENT_LOGGER, Topics
from relay.service import Relay

APP = "outbox-probe-test"


class CountedConnect:
    """Connects as the probe's owner does (autocommit), counting the connections made."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.made = 0

    def __call__(self, **options: Any) -> psycopg.Connection[Any]:
        self.made += 1
        return psycopg.connect(
            self.dsn, autocommit=True, connect_timeout=2, application_name=APP, **options
        )


def backends(dsn: str, app: str = APP) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> "
            "pg_backend_pid()",
            (app,),
        ).fetchall()
    return [pid for (pid,) in rows]


def test_probes_share_one_connection(pg_dsn: str) -> None:
    """A new connection per probe was a backend forked and torn down every probe period."""
    connect = CountedConnect(pg_dsn)
    probe = DatabaseProbe(connect, wait_s=2)
    try:
        assert [probe.reachable() for _ in range(5)] == [True] * 5
        assert connect.made == 1
        assert len(backends(pg_dsn)) == 1
    finally:
        probe.close()


def test_a_kept_connection_the_server_ended_is_replaced_not_reported_down(pg_dsn: str) -> None:
    """idle_session_timeout, a proxy or a restart ends a kept connection between probes: the
    database is up all the same."""
    connect = CountedConnect(pg_dsn)
    probe = DatabaseProbe(connect, wait_s=2)
    try:
        assert probe.reachable()
        (pid,) = backends(pg_dsn)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        assert probe.reachable()
        assert connect.made == 2
        assert backends(pg_dsn) != [pid]
    finally:
        probe.close()


def test_a_database_that_does_not_answer_is_down_after_one_try(pg_dsn: str) -> None:
    connect = CountedConnect(make_conninfo(pg_dsn, port=1))  # nothing listens there
    probe = DatabaseProbe(connect, wait_s=2)
    assert not probe.reachable()
    assert connect.made == 1  # no connection was kept: nothing to try again


def test_the_database_probe_logs_why_it_is_down_once_and_when_it_answers_again(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """/readyz says `"database": false`; a pod not ready for a wrong password, a host not found
    or a refused port said why nowhere."""
    connect = CountedConnect(make_conninfo(pg_dsn, port=1))  # nothing listens there
    probe = DatabaseProbe(connect, wait_s=2, owner="the relay's")
    with caplog.at_level(logging.INFO, logger="relay.dbprobe"):
        assert [probe.reachable() for _ in range(3)] == [False] * 3
        connect.dsn = pg_dsn  # it is back
        assert [probe.reachable() for _ in range(2)] == [True] * 2
    probe.close()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "relay.dbprobe"]
    assert len(said) == 2, said
    (level, down), up = said
    assert level == "WARNING"
    assert down.startswith("the relay's readiness probe: the database does not answer: ")
    assert "port 1 failed" in down
    assert "\n" not in down  # libpq's lines as one
    assert up == ("INFO", "the relay's readiness probe: the database answers again")


def test_a_probe_behind_a_stuck_one_answers_false_at_its_wait(pg_dsn: str) -> None:
    entered, release = threading.Event(), threading.Event()
    connect = CountedConnect(pg_dsn)

    def stuck_connect(**options: Any) -> psycopg.Connection[Any]:
        entered.set()
        release.wait(30)  # as a connect to a host that does not answer
        return connect(**options)

    probe = DatabaseProbe(stuck_connect, wait_s=0.2)
    first = threading.Thread(target=probe.reachable, daemon=True)
    first.start()
    try:
        assert entered.wait(10)
        assert not probe.reachable()
    finally:
        release.set()
        first.join(10)
        probe.close()


def test_close_ends_the_connection_and_later_probes_say_false(pg_dsn: str) -> None:
    connect = CountedConnect(pg_dsn)
    probe = DatabaseProbe(connect, wait_s=2)
    assert probe.reachable()
    probe.close()
    assert backends(pg_dsn) == []
    assert not probe.reachable()
    assert connect.made == 1


def test_a_relays_readiness_probes_reuse_a_connection(
    pg_dsn: str, relay_factory: Callable[..., Relay]
) -> None:
    relay = relay_factory()
    made: list[dict[str, Any]] = []
    connect = relay._connect

    def counted(**kwargs: Any) -> psycopg.Connection[Any]:
        made.append(kwargs)
        return connect(**kwargs)

    relay._connect = counted  # type: ignore[method-assign]
    assert [relay.ready()["database"] for _ in range(4)] == [True] * 4
    assert len(made) == 1  # one connection for the four probes
    assert made[0]["autocommit"] is True
    kept = relay._db_probe._conn
    assert kept is not None  # it gives up on a peer gone unsaid (test_database_connections.py)
    assert {o.keyword: o.val for o in kept.pgconn.info}[b"tcp_user_timeout"] == b"10000"
    relay.stop(timeout=10)
    assert not relay.ready()["database"]  # stopped: the probe's connection is closed


def test_shards_whose_lease_ran_out_unrenewed_are_not_reported_held(
    relay_factory: Callable[..., Relay],
) -> None:
    """Through a database outage /readyz listed the shards and the owned gauge said 1, long
    after the leases had run out and another relay could hold them."""
    from prometheus_client import REGISTRY

    relay = relay_factory(lease_duration="PT2S", heartbeat_interval="PT0.5S")
    relay.run_once()
    relay.heartbeat()  # renewed just now: the first round (set-up, recovery) may take 2 s
    assert relay.ready()["shards"] == [0]
    time.sleep(2.1)  # a lease duration with no heartbeat: what an unreachable database makes
    assert relay.ready()["shards"] == []
    relay.refresh_gauges()
    assert REGISTRY.get_sample_value("outbox_relay_shards_owned") == 0
    relay.run_once()  # renewed
    assert relay.ready()["shards"] == [0]


def test_a_relays_database_and_broker_are_probed_at_once(
    relay_factory: Callable[..., Relay],
) -> None:
    """Each may wait a connect timeout in an outage; one after another they added up. The
    database check here ends only once the broker's (the real one) has begun."""
    relay = relay_factory()
    broker_began = threading.Event()
    database, broker = relay._db_probe.reachable, relay.topics.reachable

    def database_after_broker() -> bool:
        return broker_began.wait(30) and database()

    def broker_noted() -> bool:
        broker_began.set()
        return broker()

    relay._db_probe.reachable = database_after_broker  # type: ignore[method-assign]
    relay.topics.reachable = broker_noted  # type: ignore[method-assign]
    report = relay.ready()
    assert (report["database"], report["broker"]) == (True, True)


def test_a_relays_database_check_that_does_not_answer_in_time_says_unreachable(
    relay_factory: Callable[..., Relay],
) -> None:
    """Its own waits (a connect timeout, 10 s by default) ran past the kubelet's probe timeout
    (5 s), which then said only that the probe timed out: the report names the database."""
    relay = relay_factory()
    release = threading.Event()
    relay._db_probe.reachable = lambda: release.wait(30)  # type: ignore[method-assign]
    try:
        began = time.monotonic()
        report = relay.ready()
        took = time.monotonic() - began
    finally:
        release.set()
    assert report["database"] is False
    assert isinstance(report["broker"], bool)  # answered for, whatever the broker said in time
    assert CHECK_WITHIN_S <= took < READY_WITHIN_S  # not the database's own wait, 30 s here


def test_the_brokers_probe_asks_for_no_topics_metadata(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every topic's metadata at every probe of every pod was a large response and a load on the
    broker on a cluster of many topics; the brokers' alone say it answers."""
    topics = Topics({"bootstrap.servers": kafka_bootstrap, "debug": "metadata"})
    with caplog.at_level(logging.DEBUG, logger=CLIENT_LOGGER.name):
        assert topics.reachable()
        topics.reachable()  # the lines of the first come out at the next call's poll
    asked = [r.getMessage() for r in caplog.records if "Request metadata for" in r.getMessage()]
    assert any("brokers only" in line for line in asked), asked
    assert not [line for line in asked if "all topics" in line]


def test_a_broker_that_does_not_answer_is_down_within_the_probes_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    topics = Topics({"bootstrap.servers": "127.0.0.1:1"})  # nothing listens there
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="relay.kafka"):
        assert not topics.reachable()
        assert time.monotonic() - began < 10  # its wait is 4 s
        assert not topics.reachable()
    said = [r.getMessage() for r in caplog.records if r.name == "relay.kafka"]
    assert len(said) == 1, said  # once, not at every probe
    assert said[0].startswith("the relay's readiness probe: the broker does not answer: ")


def test_gauges_that_cannot_be_read_say_so_and_the_backlog_age_goes_on(
    relay_factory: Callable[..., Relay], pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left as last read when a refresh failed, the age of the oldest undelivered record stayed
    at its value from before the database went away, ~0, and the lag alert never fired (found
    by a review of the sidecar)."""
    from prometheus_client import REGISTRY

    def sample(name: str) -> float:
        value = REGISTRY.get_sample_value(name)
        assert value is not None, name
        return value

    def refused(**_: Any) -> psycopg.Connection[Any]:
        raise psycopg.OperationalError("connection refused (the test's database is away)")

    def refresh_fails() -> None:
        connect = relay._connect
        monkeypatch.setattr(relay, "_connect", refused)
        assert relay._gauge_conn is not None
        relay._gauge_conn.close()  # lost: the next refresh connects again, and is refused
        with pytest.raises(psycopg.OperationalError, match="refused"):
            relay.refresh_gauges()
        monkeypatch.setattr(relay, "_connect", connect)

    relay = relay_factory()
    relay.run_once()
    relay.refresh_gauges()
    assert sample("outbox_relay_backlog_records") == 0
    refresh_fails()  # with no backlog then, what came since is unknown
    for unknown in (
        "outbox_relay_backlog_records",
        "outbox_relay_oldest_undelivered_seconds",
        "outbox_relay_parked_records",
        "outbox_relay_horizon_held_seconds",
    ):
        assert math.isnan(sample(unknown)), unknown

    with psycopg.connect(pg_dsn) as conn:  # a record no round takes: the backlog's oldest
        Outbox().publish(conn, "gauges.t", "v")
    relay.refresh_gauges()
    assert sample("outbox_relay_backlog_records") == 1
    age_read = sample("outbox_relay_oldest_undelivered_seconds")
    refresh_fails()
    assert sample("outbox_relay_oldest_undelivered_seconds") > age_read  # it goes on
    assert math.isnan(sample("outbox_relay_backlog_records"))


def test_a_stopped_relay_says_it_holds_no_shard_and_does_not_know_the_backlog(
    relay_factory: Callable[..., Relay],
) -> None:
    """Left as last read, a stopped relay (a sidecar's part waiting to be started again) kept
    saying it held its shards and how old the backlog was: the alerts on shards without a relay
    and on a backlog growing kept quiet (found by a review of the alerts)."""
    from prometheus_client import REGISTRY

    relay = relay_factory()
    relay.run_once()
    relay.refresh_gauges()
    assert REGISTRY.get_sample_value("outbox_relay_shards_owned") == 1
    assert REGISTRY.get_sample_value("outbox_relay_oldest_undelivered_seconds") == 0
    relay.stop(timeout=10)
    assert REGISTRY.get_sample_value("outbox_relay_shards_owned") == 0
    for unknown in (
        "outbox_relay_backlog_records",
        "outbox_relay_oldest_undelivered_seconds",
        "outbox_relay_parked_records",
        "outbox_relay_horizon_held_seconds",
    ):
        assert math.isnan(REGISTRY.get_sample_value(unknown) or 0.0), unknown
