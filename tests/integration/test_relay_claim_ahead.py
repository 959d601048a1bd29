"""In a drain, the next batch is claimed on the claimer's connection while a full batch waits for
Kafka (ShardWorker._start_prefetch). The next round takes that claim only if the batch before it
committed, nothing needs recovery, and it came full; otherwise it claims again itself."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import outbox
from relay.kafka import OutcomeUnknown
from relay.service import Relay
from tests.fixtures.kafka import consume_all
from tests.integration.test_relay_delivery import values
from tests.integration.test_relay_ending_overlap import committed_rows

BATCH = 4


def publish(dsn: str, topic: str, *payloads: str, key: str = "k") -> None:
    """One transaction per payload, all of one key: delivery must keep their commit order."""
    with psycopg.connect(dsn) as conn:
        for payload in payloads:
            with conn.transaction():
                outbox.publish(conn, topic, payload, key=key)


def claims_by_connection(relay: Relay) -> list[str]:
    """Records, per claim of the relay's one shard, whose connection made it."""
    (worker,) = relay.workers.values()
    claim, made_by = worker._claim, []

    def recorded(conn: psycopg.Connection[Any], *args: Any) -> Any:
        made_by.append("relay" if conn is relay.conn else threading.current_thread().name)
        return claim(conn, *args)

    worker._claim = recorded  # type: ignore[method-assign]
    return made_by


def drained(relay: Relay) -> None:
    for _ in range(20):
        if relay.run_once(pipelined=True).delivered == 0:
            break
    relay.run_once()  # settles the last end


def test_a_drain_claims_each_next_batch_while_the_one_before_waits_for_kafka(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(batch_size=BATCH, heartbeat_interval="PT60S")
    relay.run_once()  # shard 0 taken
    payloads = [f"r{i:02d}" for i in range(3 * BATCH + 1)]
    publish(pg_dsn, topic, *payloads)
    made_by = claims_by_connection(relay)
    drained(relay)
    # rounds 2 and 3 took the claims made during rounds 1 and 2; the claim made during round 3
    # (one record: not full) is made again by round 4 itself
    assert made_by[:4] == ["relay", "outbox-claimer", "outbox-claimer", "outbox-claimer"]
    assert made_by[4] == "relay"
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        p.encode() for p in payloads
    ]
    assert committed_rows(pg_dsn) == 0


def test_a_claim_made_during_a_batch_whose_commit_failed_is_dropped_and_order_holds(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(batch_size=BATCH, heartbeat_interval="PT60S")
    relay.run_once()
    payloads = [f"r{i:02d}" for i in range(3 * BATCH)]
    publish(pg_dsn, topic, *payloads)
    (worker,) = relay.workers.values()
    commit = worker.producer.commit

    def unknown_once() -> None:  # as a broker that went away during the commit
        worker.producer.commit = commit  # type: ignore[method-assign]
        raise OutcomeUnknown("the commit's outcome is unknown (test)")

    worker.producer.commit = unknown_once  # type: ignore[method-assign]
    made_by = claims_by_connection(relay)
    with pytest.raises(OutcomeUnknown):  # the one shard failed: the round fails
        relay.run_once(pipelined=True)
    assert worker.needs_recovery
    worker.retry_at = 0.0
    drained(relay)
    # The claim made during the failed batch left that batch's rows out: taken, it would have
    # sent r04.. before r00..r03. The round after the failure claimed on its own.
    assert made_by[:3] == ["relay", "outbox-claimer", "relay"]
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        p.encode() for p in payloads
    ]
    assert committed_rows(pg_dsn) == 0


def test_a_claim_made_ahead_that_did_not_come_full_is_made_again_with_what_committed_since(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(batch_size=BATCH, heartbeat_interval="PT60S")
    relay.run_once()
    publish(pg_dsn, topic, *(f"a{i}" for i in range(BATCH + 1)))
    assert relay.run_once(pipelined=True).delivered == BATCH  # the claim ahead found "a4"
    publish(pg_dsn, topic, "b0", "b1")
    # Taken, that claim would have sent "a4" alone and left b0, b1 for a later wake-up.
    assert relay.run_once(pipelined=True).delivered == 3
    relay.run_once()
    got = values(consume_all(kafka_bootstrap, topic, "read_committed"))
    assert got == [*(f"a{i}".encode() for i in range(BATCH + 1)), b"b0", b"b1"]


def test_a_claim_ahead_that_fails_costs_a_claim_on_the_relays_connection_not_a_record(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(batch_size=BATCH, heartbeat_interval="PT60S")
    relay.run_once()
    payloads = [f"r{i:02d}" for i in range(2 * BATCH + 1)]
    publish(pg_dsn, topic, *payloads)
    made_by = claims_by_connection(relay)
    (worker,) = relay.workers.values()
    recorded = worker._claim

    def broken(conn: psycopg.Connection[Any], *args: Any) -> Any:
        if threading.current_thread().name == "outbox-claimer":
            recorded(conn, *args)
            raise psycopg.OperationalError("the claimer's server went away (test)")
        return recorded(conn, *args)

    worker._claim = broken  # type: ignore[method-assign]
    drained(relay)
    assert made_by[:3] == ["relay", "outbox-claimer", "relay"]
    assert worker.failures == 0
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        p.encode() for p in payloads
    ]
    assert committed_rows(pg_dsn) == 0


def test_with_claim_ahead_off_every_claim_is_made_on_the_relays_connection(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(batch_size=BATCH, heartbeat_interval="PT60S", claim_ahead=False)
    relay.run_once()
    payloads = [f"r{i:02d}" for i in range(2 * BATCH + 1)]
    publish(pg_dsn, topic, *payloads)
    made_by = claims_by_connection(relay)
    drained(relay)
    assert relay.claimer is None
    assert set(made_by) == {"relay"}
    assert len(made_by) >= 3
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        p.encode() for p in payloads
    ]
