"""A batch's rows are ended in the background while the next batch is claimed (relay/background.py):
nothing goes twice meanwhile, and an end that fails costs the next batch, not a record."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

import outbox
from relay.service import Relay
from relay.shard import EndFailed
from tests.fixtures.kafka import consume_all
from tests.integration.test_relay_delivery import markers, same_settings_other_id, values

_ERRORS = "outbox_relay_errors_total"


def publish(dsn: str, topic: str, *payloads: str) -> None:
    with psycopg.connect(dsn) as conn:
        for payload in payloads:
            with conn.transaction():
                outbox.publish(conn, topic, payload, key=payload)


@contextmanager
def ends_held(relay: Relay) -> Iterator[threading.Event]:
    """The ends of the relay's batches wait until the event is set (then run as they would)."""
    (worker,) = relay.workers.values()
    gate = threading.Event()
    end = worker._end_batch

    def held(conn: psycopg.Connection[Any], ending: Any) -> int:
        assert gate.wait(30)
        return end(conn, ending)

    worker._end_batch = held  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()


def _first_of(*events: threading.Event, timeout: float) -> threading.Event | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events:
            if event.is_set():
                return event
        time.sleep(0.01)
    return None


def committed_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox.outbox_record WHERE state = 'committed'"
        ).fetchone()
    return row[0] if row else -1


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def round_held_by_the_end(relay: Relay, gate: threading.Event) -> Any:
    """A pipelined round whose Kafka commit must wait for the held end of the batch before:
    checked waiting there, then the end let go. Returns the round's result, or its error."""
    (worker,) = relay.workers.values()
    waiting, settle = threading.Event(), worker.settle

    def waited() -> None:
        waiting.set()
        settle()

    worker.settle = waited  # type: ignore[method-assign]
    thread, outcome = in_thread(lambda: relay.run_once(pipelined=True))
    try:
        assert waiting.wait(30), "the round never waited for the end before its commit"
        thread.join(0.5)
        assert thread.is_alive(), "the next batch committed before the batch before it ended"
    finally:
        gate.set()
        thread.join(30)
        worker.settle = settle  # type: ignore[method-assign]
    assert not thread.is_alive()
    (result,) = outcome
    return result


def test_the_next_batch_is_claimed_while_the_last_one_ends_and_nothing_goes_twice(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    # heartbeats (of the lease rows the test holds) only in the first round
    relay: Relay = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    relay.run_once()  # shard 0 taken
    publish(pg_dsn, topic, "a1", "a2")
    with psycopg.connect(pg_dsn) as conn:  # a rolled back record: its op marker goes too
        half = outbox.prepare(conn, topic, "never", key="never")
        conn.commit()
        outbox.rollback(conn, half.tx_id)
        conn.commit()
    with ends_held(relay) as gate:
        first = relay.run_once(pipelined=True)
        assert (first.delivered, first.ended) == (2, 1)
        # committed in Kafka, their end held: still "committed" here
        assert committed_rows(pg_dsn) == 2
        publish(pg_dsn, topic, "b1")
        # The next round claims around the batch being ended, and waits for that end only
        # before its own Kafka commit.
        second = round_held_by_the_end(relay, gate)
    # b1 only: a1 and a2 were not claimed again, nor the rolled back record's marker
    assert (second.delivered, second.ended) == (1, 0)
    relay.run_once()  # settles the second batch's end
    got = values(consume_all(kafka_bootstrap, topic, "read_committed"))
    assert sorted(got) == [b"a1", b"a2", b"b1"]
    assert sorted(m.op.value for m in markers(kafka_bootstrap, relay)) == [
        "delivered",
        "delivered",
        "delivered",
        "rolled_back",
    ]
    assert committed_rows(pg_dsn) == 0


def test_an_end_that_fails_aborts_the_next_batch_and_the_heir_ends_the_rows_from_markers(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    relay.run_once()
    publish(pg_dsn, topic, "first")
    with ends_held(relay) as gate:
        assert relay.run_once(pipelined=True).delivered == 1
        # Another relay took the shard before the end ran (and its lease then ran out): the
        # end must find the lease gone.
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "UPDATE outbox.shard_lease SET owner = 'gone', epoch = epoch + 1, "
                "lease_until = now() - interval '1 second'"
            )
        publish(pg_dsn, topic, "second")
        round_ = round_held_by_the_end(relay, gate)
    assert round_.delivered == 0  # the round ended; its one shard was lost
    assert relay.workers == {}  # LeaseLost: the shard was dropped
    # "second" was in a Kafka transaction that was aborted; "first" is committed in Kafka
    # and its row not ended
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"first"]
    assert committed_rows(pg_dsn) == 2

    heir = same_settings_other_id(relay_factory, relay, "heir")
    assert heir.run_once().delivered == 1  # "second"; "first" was ended from its marker
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"first", b"second"]
    assert committed_rows(pg_dsn) == 0


def test_a_stopping_relay_ends_the_rows_it_delivered_before_it_hands_its_shards_back(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory()
    relay.run_once()
    publish(pg_dsn, topic, "x", "y")
    released, waiting = threading.Event(), threading.Event()
    release = relay.leases.release
    (worker,) = relay.workers.values()
    settle = worker.settle

    def recorded(conn: psycopg.Connection[Any], shard: int) -> None:
        released.set()
        release(conn, shard)

    def waited() -> None:
        waiting.set()
        settle()

    relay.leases.release = recorded  # type: ignore[method-assign]
    with ends_held(relay) as gate:
        assert relay.run_once(pipelined=True).delivered == 2
        worker.settle = waited  # type: ignore[method-assign]
        stopping, _ = in_thread(relay.stop)
        assert _first_of(waiting, released, timeout=30) is waiting, (
            "the shard was handed back before its rows ended: no longer this relay's to end"
        )
        gate.set()
        stopping.join(30)
    assert released.is_set()
    assert committed_rows(pg_dsn) == 0
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT owner FROM outbox.shard_lease").fetchall() == [(None,)]


@pytest.mark.parametrize("found", ["before the next claim", "before the next commit"])
def test_an_ender_whose_connection_breaks_costs_its_shard_a_recovery_not_the_round(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    found: str,
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    relay.run_once()
    publish(pg_dsn, topic, "first")
    main = relay.conn
    (worker,) = relay.workers.values()
    with ends_held(relay) as gate:
        assert relay.run_once(pipelined=True).delivered == 1
        deadline = time.monotonic() + 10
        while (ender_conn := relay.ender._conn) is None:  # connected in the ender's thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:  # as a failover would
            admin.execute("SELECT pg_terminate_backend(%s)", (ender_conn.info.backend_pid,))
        publish(pg_dsn, topic, "second")
        if found == "before the next claim":
            gate.set()
            deadline = time.monotonic() + 10
            while not (worker._ending and worker._ending.changed.done()):  # type: ignore[union-attr]
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # the shard recovers "first" from its marker, then ships "second"
            assert relay.run_once(pipelined=True).delivered == 1
        else:
            database_errors = REGISTRY.get_sample_value(_ERRORS, {"kind": "database"}) or 0.0
            error = round_held_by_the_end(relay, gate)
            # the shard's trouble, not the relay connection's: the loop keeps that one
            assert isinstance(error, EndFailed)
            # counted with the database errors, where an alert on them looks
            assert REGISTRY.get_sample_value(_ERRORS, {"kind": "database"}) == database_errors + 1
            # "second" was aborted with it
            assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"first"]
            assert relay.run_once().delivered == 1  # after recovering "first"
    assert relay.conn is main
    assert relay.workers == {0: worker}
    relay.run_once()
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"first", b"second"]
    assert committed_rows(pg_dsn) == 0
