"""Broker and Postgres restarts under load, with the relay running: nothing lost or duplicated."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psycopg
import pytest

import outbox
from tests.fixtures.kafka import consume_all
from tests.fixtures.relay import RelayProcess
from tests.fixtures.services import SERVICES, Services
from tests.integration.test_relay_crashes import FAST, assert_exactly_once, undelivered, wait_for


def restart(service: str) -> None:
    # a broker's stop may take 60 s and its start 120 s (scripts/services.py), on a slow machine
    subprocess.run([sys.executable, str(SERVICES), "restart", service], check=True, timeout=240)


@pytest.fixture
def restartable(services: Services) -> None:
    if services.source != "script":  # scripts/services.py restarts only what it started
        pytest.skip(f"the services are not ours to restart (they come from {services.source})")


class Writer(threading.Thread):
    """Writes orders with their records until stopped, reconnecting through outages.

    Each value goes into a `sent` table in the same transaction as its record, so afterwards
    `sent` says exactly which records committed, even for commits whose answer was lost.
    """

    def __init__(self, dsn: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.topic = dsn, topic
        self.stop = threading.Event()
        self.commits = 0
        self.outages = 0  # connections lost: the Postgres restart was felt

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.dsn, connect_timeout=3) as conn:
                    while not self.stop.is_set():
                        n += 1
                        with conn.transaction():
                            conn.execute("INSERT INTO sent VALUES (%s)", (f"v{n}",))
                            outbox.publish(conn, self.topic, f"v{n}", key=f"k{n % 5}")
                        self.commits += 1
                        time.sleep(0.01)
            except (psycopg.Error, outbox.OutboxError):
                self.outages += 1
                time.sleep(0.2)

    def committed(self) -> list[bytes]:
        with psycopg.connect(self.dsn) as conn:
            return [r[0].encode() for r in conn.execute("SELECT v FROM sent")]


def delivered(dsn: str) -> int:
    """Records the relay has ended: the writer's commits less the rows still committed (one
    statement, one snapshot: each `sent` row commits with its record)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM sent)"
            " - (SELECT count(*) FROM outbox.outbox_record WHERE state = 'committed')"
        ).fetchone()
    return int(row[0]) if row else 0


def test_broker_and_postgres_restarts_under_load(
    restartable: None,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = topic_factory(partitions=2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE sent (v text PRIMARY KEY)")
    relay = relay_process(**FAST)
    writer = Writer(pg_dsn, topic)
    writer.start()
    # the relay delivering when each restart comes (the broker's came during its setup before)
    wait_for(lambda: delivered(pg_dsn) >= 50, 60, "deliveries before the broker restart", relay)
    restart("kafka")
    mark = writer.commits
    wait_for(lambda: writer.commits >= mark + 50, 60, "load after the broker restart")
    mark = delivered(pg_dsn)
    wait_for(
        lambda: delivered(pg_dsn) >= mark + 50, 120, "deliveries after the broker restart", relay
    )
    restart("postgres")
    wait_for(lambda: writer.outages >= 1, 30, "the writer to feel the restart (its connection cut)")
    mark = writer.commits
    wait_for(lambda: writer.commits >= mark + 50, 60, "load after the Postgres restart")
    writer.stop.set()
    writer.join(30)

    wait_for(lambda: undelivered(pg_dsn) == 0, 120, "the relay to catch up", relay)
    assert relay.terminate() == 0, relay.output()
    expected = writer.committed()
    by_order = sorted(expected, key=lambda v: int(v[1:]))
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), by_order)
