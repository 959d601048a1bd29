"""With claim_ahead on: in a drain, the next batch is claimed on the claimer's connection while a
full batch waits for Kafka (ShardWorker._start_claim_ahead). The next round takes that claim only if
the batch before it committed, nothing needs recovery, and it came full; otherwise it claims again
itself."""

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


def relay_with_backlog(
    relay_factory: Any, dsn: str, topic: str, count: int, **settings: Any
) -> tuple[Relay, list[str]]:
    """A relay that holds shard 0 (batches of BATCH, claims ahead unless told), and `count`
    committed records of one key waiting for it."""
    relay: Relay = relay_factory(
        **{
            "batch_size": BATCH,
            "heartbeat_interval": "PT60S",
            "lease_duration": "PT180S",
            "claim_ahead": True,
            **settings,
        }
    )
    relay.run_once()  # shard 0 taken
    payloads = [f"r{i:02d}" for i in range(count)]
    publish(dsn, topic, *payloads)
    return relay, payloads


def assert_each_once_in_order(dsn: str, bootstrap: str, topic: str, payloads: list[str]) -> None:
    assert values(consume_all(bootstrap, topic, "read_committed")) == [p.encode() for p in payloads]
    assert committed_rows(dsn) == 0


def drained(relay: Relay) -> None:
    for _ in range(20):
        if relay.run_once(pipelined=True).delivered == 0:
            break
    relay.run_once()  # settles the last end


def test_a_drain_claims_each_next_batch_while_the_one_before_waits_for_kafka(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay, payloads = relay_with_backlog(relay_factory, pg_dsn, topic, 3 * BATCH + 1)
    made_by = claims_by_connection(relay)
    drained(relay)
    # rounds 2 and 3 took the claims made during rounds 1 and 2; the claim made during round 3
    # (one record: not full) is made again by round 4 itself
    assert made_by[:4] == ["relay", "outbox-claimer", "outbox-claimer", "outbox-claimer"]
    assert made_by[4] == "relay"
    assert_each_once_in_order(pg_dsn, kafka_bootstrap, topic, payloads)


def test_a_claim_made_during_a_batch_whose_commit_failed_is_dropped_and_order_holds(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay, payloads = relay_with_backlog(relay_factory, pg_dsn, topic, 3 * BATCH)
    (worker,) = relay.workers.values()
    commit = worker.producer.commit

    def unknown_once(*waiting: Any) -> None:  # as a broker that went away during the commit
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
    assert_each_once_in_order(pg_dsn, kafka_bootstrap, topic, payloads)


def test_a_claim_made_ahead_that_did_not_come_full_is_made_again_with_what_committed_since(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay: Relay = relay_factory(
        batch_size=BATCH, heartbeat_interval="PT60S", lease_duration="PT180S", claim_ahead=True
    )
    relay.run_once()
    publish(pg_dsn, topic, *(f"a{i}" for i in range(BATCH + 1)))
    assert relay.run_once(pipelined=True).delivered == BATCH
    (worker,) = relay.workers.values()
    worker.await_claim_ahead()  # it found "a4" alone
    # the end of the batch, a transaction of its own, must not hold the horizon below b0, b1
    worker.settle()
    assert worker._claim_ahead is not None
    assert worker._claim_ahead.valid
    publish(pg_dsn, topic, "b0", "b1")
    made_by = claims_by_connection(relay)
    # Taken, that claim would have sent "a4" alone and left b0, b1 for a later wake-up.
    assert relay.run_once(pipelined=True).delivered == 3
    assert made_by == ["relay"]  # the claim made ahead was dropped
    relay.run_once()
    got = values(consume_all(kafka_bootstrap, topic, "read_committed"))
    assert got == [*(f"a{i}".encode() for i in range(BATCH + 1)), b"b0", b"b1"]


def test_a_claim_ahead_that_fails_costs_a_claim_on_the_relays_connection_not_a_record(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay, payloads = relay_with_backlog(relay_factory, pg_dsn, topic, 2 * BATCH + 1)
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
    assert_each_once_in_order(pg_dsn, kafka_bootstrap, topic, payloads)


def test_with_claim_ahead_off_every_claim_is_made_on_the_relays_connection(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay, payloads = relay_with_backlog(
        relay_factory, pg_dsn, topic, 2 * BATCH + 1, claim_ahead=False
    )
    made_by = claims_by_connection(relay)
    drained(relay)
    assert relay.claimer is None
    assert set(made_by) == {"relay"}
    assert len(made_by) >= 3
    assert_each_once_in_order(pg_dsn, kafka_bootstrap, topic, payloads)


def test_a_claim_made_ahead_runs_before_the_next_stamp_so_a_later_commit_never_overtakes(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """S takes its transaction id before the open transaction `old`, U after it; U commits
    first, then S. The next stamp stamps S (below the horizon `old` holds) and not U, and holds
    back everything that committed after U. A claim made ahead with no hold-back (nothing was
    unstamped at its round's stamp) that ran after that stamp found S, and S went before U.
    Both rounds stamp (a full stamp is due): a round that stamps nothing bounds its claims,
    and the claim made ahead, by themselves."""
    topic = topic_factory()
    relay: Relay = relay_factory(
        batch_size=BATCH, heartbeat_interval="PT60S", lease_duration="PT180S", claim_ahead=True
    )
    relay.run_once()
    publish(pg_dsn, topic, *(f"r{i}" for i in range(2 * BATCH - 1)))
    (worker,) = relay.workers.values()
    claim, stamped = worker._claim, threading.Event()

    def late(conn: psycopg.Connection[Any], *args: Any) -> Any:
        if threading.current_thread().name == "outbox-claimer":
            stamped.wait(2)  # till the next stamp: the relay must not stamp before it is done
        return claim(conn, *args)

    worker._claim = late  # type: ignore[method-assign]
    relay._next_full_stamp = 0.0
    assert relay.run_once(pipelined=True).delivered == BATCH
    stamp = relay._stamp

    def stamp_then_signal(params: dict[str, Any]) -> Any:
        try:
            return stamp(params)
        finally:
            stamped.set()

    relay._stamp = stamp_then_signal  # type: ignore[method-assign]
    with (
        psycopg.connect(pg_dsn) as s_conn,
        psycopg.connect(pg_dsn) as old,
        psycopg.connect(pg_dsn) as u_conn,
    ):
        outbox.publish(s_conn, topic, "S", key="k")
        old.execute("SELECT pg_current_xact_id()")
        outbox.publish(u_conn, topic, "U", key="k")
        u_conn.commit()
        s_conn.commit()
        relay._next_full_stamp = 0.0
        relay.run_once(pipelined=True)
        old.rollback()
    drained(relay)
    got = values(consume_all(kafka_bootstrap, topic, "read_committed"))
    assert got == [*(f"r{i}".encode() for i in range(2 * BATCH - 1)), b"U", b"S"]
