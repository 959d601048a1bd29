"""The relay in-process against the real Postgres and broker: delivery, order, markers, poison."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
    NewTopic,
    ResourceType,
)
from prometheus_client import REGISTRY
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import SecretStr

import outbox
from checker import drop, redrive
from outbox import IllegalTransitionError, Record
from outbox.migrations import RELAY_SCHEMA_VERSION, SHIPPING_CLAIM_VERSION
from relay import service as service_module
from relay import shard as shard_module
from relay.config import SidecarSettings
from relay.kafka import Fenced, ShardProducer, TransactionTimedOut
from relay.markers import (
    MarkerTooNew,
    Op,
    OpMarker,
    decode_markers,
    marker_entry,
    marker_messages,
)
from relay.pipelined import pipelined_transaction
from relay.service import Relay, RelayConfigError, RelayRound
from relay.shard import STOP_ABORT_S, DeadLetterUnwritable, ShardWorker
from relay.status import outbox_status
from tests.fixtures.kafka import consume_all, java_murmur2
from tests.fixtures.postgres import GrantedRoles
from tests.fixtures.relay import as_role, discarded, shipping_since


def values(msgs: list[Message]) -> list[bytes]:
    return [m.value() or b"" for m in msgs]


def markers(bootstrap: str, relay: Relay) -> list[OpMarker]:
    topic = relay.settings.relay.op_marker_topic
    return [
        marker
        for m in consume_all(bootstrap, topic, "read_committed")
        for marker in decode_markers(m.value() or b"")
    ]


def copies_by_form() -> dict[str, float]:
    """outbox_relay_dead_letter_copies_total now, by form."""
    name = "outbox_relay_dead_letter_copies_total"
    forms = ("full", "without_value", "bare", "none")
    return {f: REGISTRY.get_sample_value(name, {"form": f}) or 0.0 for f in forms}


def copies_since(before: dict[str, float]) -> dict[str, float]:
    """The copies counted since `before`, by form, those with none left out."""
    return {f: n - before[f] for f, n in copies_by_form().items() if n != before[f]}


def rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT id, state, reason, ended_at IS NOT NULL, kafka_partition, kafka_offset "
            "FROM outbox.outbox_record ORDER BY id"
        ).fetchall()


def counting(relay: Relay, method: str) -> list[None]:
    """Wraps one of the relay's methods: the list grows by one per call."""
    calls: list[None] = []
    original = getattr(relay, method)

    def counted(*args: Any) -> Any:
        calls.append(None)
        return original(*args)

    setattr(relay, method, counted)
    return calls


def wait_for(condition: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_committed_records_arrive_once_with_headers_rolled_back_never(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory(partitions=3)
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            first = outbox.publish(conn, topic, "k1-a", key="k1", headers=[("trace", "t1")])
            outbox.publish(conn, topic, "k2-a", key="k2")
        with conn.transaction():
            outbox.publish(conn, topic, "k1-b", key="k1")
        with conn.transaction():
            half = outbox.prepare(conn, topic, "never", key="k1")
        outbox.rollback(conn, half.tx_id)
        conn.commit()
    relay = relay_factory()
    assert relay.run_once().delivered == 3
    assert relay.run_once().delivered == 0  # nothing twice

    got = consume_all(kafka_bootstrap, topic, "read_committed")
    assert sorted(values(got)) == [b"k1-a", b"k1-b", b"k2-a"]
    k1 = [m for m in got if m.key() == b"k1"]
    assert values(k1) == [b"k1-a", b"k1-b"]  # one key, one partition, commit order
    headers = dict(k1[0].headers() or [])
    assert headers["trace"] == b"t1"
    assert headers["outbox-id"] == str(first).encode()
    assert headers["outbox-tx-id"].startswith(b"xid:")
    # which outbox: ids are one outbox's own, and two outboxes may write one topic
    database = conninfo_to_dict(pg_dsn)["dbname"]
    assert headers["outbox-name"] == f"{database}/outbox".encode()

    written = markers(kafka_bootstrap, relay)
    ops = sorted((m.op.value, m.id) for m in written)
    assert [op for op, _ in ops] == ["delivered"] * 3 + ["rolled_back"]
    # each delivered marker names its committing transaction (the reconciler orders by it)
    xids = {m.id: m.xid for m in written if m.op is Op.DELIVERED}
    assert None not in xids.values()
    assert len(set(xids.values())) == 2
    assert xids[first] == min(xids.values())
    assert [m.xid for m in written if m.op is Op.ROLLED_BACK] == [None]
    assert rows(pg_dsn) == []  # retention 0: every ended row is gone


def test_records_of_one_transaction_share_one_kafka_transaction(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    a, b = topic_factory(), topic_factory()
    relay = relay_factory(batch_size=1)  # even a batch size of 1 never splits a transaction
    relay.run_once()  # set up, shard 0 taken: nothing to ship yet
    (worker,) = relay.workers.values()
    commits: list[None] = []
    commit = worker.producer.commit

    def counted(*waiting: Any) -> float:
        commits.append(None)
        return commit(*waiting)

    worker.producer.commit = counted  # type: ignore[method-assign]
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, [Record(a, "1"), Record(b, "2"), Record(a, "3")])
    round_ = relay.run_once()
    assert round_.delivered == 3
    assert len(commits) == 1  # one Kafka transaction
    assert values(consume_all(kafka_bootstrap, a, "read_committed")) == [b"1", b"3"]
    assert values(consume_all(kafka_bootstrap, b, "read_committed")) == [b"2"]


def test_a_late_committing_lower_id_is_not_skipped(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay = relay_factory()
    early = psycopg.connect(pg_dsn)  # takes its xid first, writes its record last
    early.execute("SELECT pg_current_xact_id()")
    late = psycopg.connect(pg_dsn)
    late.execute("SELECT pg_current_xact_id()")
    low_id = outbox.publish(late, topic, "low id, commits last")
    high_id = outbox.publish(early, topic, "high id, commits first")
    assert low_id < high_id
    early.commit()
    assert relay.run_once().delivered == 1  # the high id goes; the open one holds nothing back
    late.commit()
    assert relay.run_once().delivered == 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        b"high id, commits first",
        b"low id, commits last",
    ]
    early.close()
    late.close()


def test_same_key_follows_commit_order_not_xid_order(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """design.md property 4: T2 takes the smaller xid, then waits on T1's row lock."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE account (id int PRIMARY KEY, balance int)")
        setup.execute("INSERT INTO account VALUES (1, 0)")
    t2 = psycopg.connect(pg_dsn)
    t2_xid = t2.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]  # type: ignore[index]
    t1 = psycopg.connect(pg_dsn)
    t1_xid = t1.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]  # type: ignore[index]
    assert t2_xid < t1_xid
    t1.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")
    outbox.publish(t1, topic, "T1: first", key="account-1")

    t2_done = threading.Event()

    def second() -> None:
        t2.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")  # waits for T1
        outbox.publish(t2, topic, "T2: second", key="account-1")
        t2.commit()
        t2_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    with psycopg.connect(pg_dsn, autocommit=True) as probe:
        deadline = time.monotonic() + 10
        while not probe.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"
        ).fetchone()[0]:  # type: ignore[index]
            assert time.monotonic() < deadline, "T2 never waited for T1's row lock"
            time.sleep(0.01)
    relay = relay_factory()
    assert relay.run_once().delivered == 0  # T2 (smaller xid) is running: the horizon holds
    t1.commit()
    assert t2_done.wait(10)
    thread.join()
    while relay.run_once().delivered:
        pass
    got = consume_all(kafka_bootstrap, topic, "read_committed")
    assert values(got) == [b"T1: first", b"T2: second"]
    t1.close()
    t2.close()


def test_half_records_go_out_in_the_order_they_were_committed(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            prepared_first = outbox.prepare(conn, topic, "prepared first, committed last", key="k")
        with conn.transaction():
            outbox.publish(conn, topic, "published in between", key="k")
        outbox.commit(conn, prepared_first.tx_id)
        conn.commit()
    relay_factory().run_once()
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        b"published in between",
        b"prepared first, committed last",
    ]


def test_keys_land_where_the_java_client_puts_them_empty_ones_in_order(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """librdkafka's default partitioner scattered records with an empty key at random, while
    the relay orders them as one key; and it put other keys elsewhere than Java producers."""
    topic = topic_factory(partitions=6)
    keys = [b""] * 12 + [f"customer-{i}".encode() for i in range(12)]
    with psycopg.connect(pg_dsn) as conn:
        for n, key in enumerate(keys):
            with conn.transaction():
                outbox.publish(conn, topic, str(n), key=key)
    assert relay_factory().run_once().delivered == len(keys)
    landed = consume_all(kafka_bootstrap, topic, "read_committed")
    assert len(landed) == len(keys)
    for msg in landed:
        key = msg.key() or b""
        assert msg.partition() == (java_murmur2(key) & 0x7FFFFFFF) % 6, key
    empty = [int(m.value()) for m in landed if not m.key()]
    assert empty == list(range(12))  # one partition, in commit order


def test_poison_records_are_parked_and_the_rest_goes_on(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory(partitions=2)
    too_large = b"x" * 1_040_000  # over the producer's message.max.bytes
    # an application that raised its limit, and not the relay's message.max.bytes with it
    raised = outbox.Outbox(max_record_bytes=1_048_576)
    records = [
        Record(topic, "before", key="a"),
        Record("no.such.topic", "lost topic", key="b"),
        Record(topic, too_large, key="c"),
        Record(topic, "bad partition", partition=7),
        Record(topic, "after", key="a"),
    ]
    with psycopg.connect(pg_dsn) as conn:
        for record in records:  # one transaction each
            with conn.transaction():
                raised.publish_many(conn, [record])
    relay = relay_factory()
    kinds = ("unknown_topic", "partition_out_of_range", "refused_by_client")

    def parked_by_kind() -> list[float]:
        name = "outbox_relay_records_parked_total"
        return [REGISTRY.get_sample_value(name, {"reason": k}) or 0.0 for k in kinds]

    before = parked_by_kind()
    first = relay.run_once()
    assert (first.delivered, first.parked) == (2, 3)
    # one of each kind, a label of a few fixed values, never the topic's name
    assert [a - b for a, b in zip(parked_by_kind(), before, strict=True)] == [1.0, 1.0, 1.0]
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"before", b"after"]

    parked = {r[0]: r[2] for r in rows(pg_dsn) if r[1] == "parked"}
    assert len(parked) == 3
    reasons = " | ".join(sorted(parked.values()))
    assert "'no.such.topic' does not exist" in reasons
    assert "partition 7 out of range" in reasons
    assert (
        "refused by the Kafka client: Unable to produce message: Broker: Message size too large"
        in reasons
    )

    copies_before = copies_by_form()
    second = relay.run_once()  # dead-letter copies and op markers of the parked records
    assert second.ended == 3
    assert copies_since(copies_before) == {"full": 2.0, "without_value": 1.0}
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert len(dead) == 3
    assert all(dict(m.headers() or [])["outbox-reason"] for m in dead)
    omitted = [dict(m.headers() or []).get("outbox-value-omitted") for m in dead]
    assert sum(1 for o in omitted if o) == 1  # the copy too large for the client, value-less
    assert next(o for o in omitted if o).startswith(b"refused by the Kafka client")
    parked_markers = [m.id for m in markers(kafka_bootstrap, relay) if m.op.value == "parked"]
    assert sorted(parked_markers) == sorted(parked)
    assert all(r[3] for r in rows(pg_dsn))  # parked rows stay, ended (shipped to the DLT)
    third = relay.run_once()
    assert (third.delivered, third.ended, third.parked) == (0, 0, 0)


def test_records_a_batch_would_park_are_not_parked_nor_reported_once_its_lease_is_lost(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A batch parks its poison before its Kafka commit, in a transaction that checks the
    lease: a relay that lost it parks none of the heir's rows, says nothing was parked, and
    aborts the batch (before, the end parked them, and "parked" was logged and counted for
    rows its rolled-back end left as they were)."""
    topic = topic_factory(partitions=1)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "good")
        outbox.publish(conn, topic, "poison", partition=3)  # no partition 3
    relay = relay_factory()
    relay.heartbeat()
    (worker,) = relay.workers.values()
    kind = {"reason": "partition_out_of_range"}
    before = REGISTRY.get_sample_value("outbox_relay_records_parked_total", kind) or 0.0
    real_park = worker._park

    def heir_takes_the_shard_first(conn: Any, poison: dict[int, str]) -> None:
        with psycopg.connect(pg_dsn) as other:
            other.execute("UPDATE outbox.shard_lease SET owner = 'heir', epoch = epoch + 1")
        real_park(conn, poison)

    worker._park = heir_takes_the_shard_first  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="relay.shard"):
        assert relay.run_once().delivered == 0
    assert "shard 0 fenced: shard 0 (epoch 1) is no longer ours" in caplog.text
    assert not [r for r in caplog.records if "parked" in r.getMessage()]
    after = REGISTRY.get_sample_value("outbox_relay_records_parked_total", kind) or 0.0
    assert after == before
    assert sorted(r[1] for r in rows(pg_dsn)) == ["committed", "committed"]  # for the heir
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == []  # aborted


def test_a_transaction_parked_for_one_reason_is_parked_in_one_statement_and_log_line(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One statement and one warning a record: parking 80,000 records of a missing topic took
    30 s and wrote 80,000 log lines."""
    missing = f"{topic_factory()}.missing"
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        ids = outbox.publish_many(conn, [Record(missing, f"v{i}") for i in range(30)]).ids
    relay = relay_factory()
    kind = {"reason": "unknown_topic"}
    before = REGISTRY.get_sample_value("outbox_relay_records_parked_total", kind) or 0.0
    with caplog.at_level("WARNING", logger="relay.shard"):
        assert relay.run_once().parked == 30
    lines = [r.getMessage() for r in caplog.records if "parked" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"parked 30 record(s) {', '.join(map(str, ids[:20]))} and 10 more")
    assert f"topic {missing!r} does not exist" in lines[0]
    after = REGISTRY.get_sample_value("outbox_relay_records_parked_total", kind)
    assert after == before + 30
    assert [r[1] for r in rows(pg_dsn)] == ["parked"] * 30


def test_a_record_with_malformed_stored_headers_is_parked_not_blocking_its_shard(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Headers another writer stored wrong (not base64, not pairs) raised out of every round:
    nothing of the shard went out again, and nothing was parked. A reserved name (outbox-id
    naming another record) went out ahead of the relay's own."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn:
        for value in ("before", "not base64", "not a pair", "name not text", "reserved", "after"):
            with conn.transaction():
                outbox.publish(conn, topic, value, key=value, headers=[("h", "v")])
        for value, stored in (
            ("not base64", '[["h", "not base64!"]]'),
            ("not a pair", '[["h", "dg==", "x"]]'),
            ("name not text", '[[7, "dg=="]]'),
            # an outbox-id ahead of the relay's own, naming another record
            ("reserved", '[["h", "dg=="], ["Outbox-Id", "MQ=="]]'),
        ):
            conn.execute(
                "UPDATE outbox.outbox_record SET headers = %s WHERE value = %s",
                (stored, value.encode()),
            )
        conn.commit()
    relay = relay_factory()
    name = "outbox_relay_records_parked_total"
    before = REGISTRY.get_sample_value(name, {"reason": "malformed_headers"}) or 0.0
    first = relay.run_once()
    assert (first.delivered, first.parked) == (2, 4)
    assert REGISTRY.get_sample_value(name, {"reason": "malformed_headers"}) == before + 4
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"before", b"after"]
    parked = [r for r in rows(pg_dsn) if r[1] == "parked"]
    assert len(parked) == 4
    assert sorted(r[2] for r in parked) == [  # what is wrong, never the values (tokens)
        "its stored headers: item 0 is not a [name, value] pair",
        "its stored headers: the name of item 0 is not a string",
        "its stored headers: the name of item 1, 'Outbox-Id', is reserved (the relay sets "
        "the outbox-* headers)",
        "its stored headers: the value of item 0 is not base64",
    ]
    assert relay.run_once().ended == 4  # the copies go without the headers, with key and value
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert sorted(m.value() for m in dead) == [
        b"name not text",
        b"not a pair",
        b"not base64",
        b"reserved",
    ]
    assert all(m.key() == m.value() and "h" not in dict(m.headers() or []) for m in dead)


def test_a_record_for_the_op_marker_topic_is_parked_and_ends_no_row(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A record delivered to the op-marker topic in a marker's form was read back by the next
    recovery as a committed marker: the relay deleted the rows it named, never sent."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()  # set up, the shard recovered once
    marker_topic = relay.settings.relay.op_marker_topic
    with psycopg.connect(pg_dsn) as conn:
        seq = conn.execute(  # the id the forged record gets
            "SELECT last_value + is_called::int FROM outbox.outbox_record_id_seq"
        ).fetchone()
        assert seq is not None
        next_id = seq[0]
        entry = marker_entry(
            Op.DELIVERED, id=next_id + 1, tx_id="t", producer_group="g", topic=topic,
            key=None, partition=0, offset=0, commit_ts=None, reason=None,
        )  # fmt: skip
        (forged,) = marker_messages([entry], shard=0, relay="r", epoch=1)
        with conn.transaction():
            outbox.publish(conn, marker_topic, forged, partition=0)
    assert relay.run_once().parked == 1
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        victim = outbox.publish(conn, topic, "victim")
    assert victim == next_id + 1
    relay.stop()
    again = relay_factory()  # a restart: recovery reads the marker partition
    assert again.run_once().delivered == 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"victim"]
    parked = [r for r in rows(pg_dsn) if r[1] == "parked"]
    assert [r[2] for r in parked] == [
        f"the relay's op-marker topic '{marker_topic}' takes only markers"
    ]


def grow(admin: AdminClient, topic: str, partitions: int) -> None:
    """Add partitions, and wait until the broker's metadata shows them."""
    admin.create_partitions([NewPartitions(topic, partitions)])[topic].result(30)
    wait_for(
        lambda: len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == partitions
    )


def test_a_partition_added_since_the_cached_count_takes_its_records_at_once(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
) -> None:
    """Partition counts are cached for 30 s, and a count older than the topic's new partition
    (or than the topic itself) parked its records: asked again before parking now."""
    topic = topic_factory(partitions=1)
    relay = relay_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "too early", partition=1)
    assert relay.run_once().parked == 1  # the count, 1, is cached now
    grow(kafka_admin, topic, 2)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "in time", partition=1)
    rounds = [relay.run_once() for _ in range(2)]  # the second ships the parked one's copy
    assert (rounds[0].delivered, rounds[0].parked) == (1, 0)
    landed = consume_all(kafka_bootstrap, topic, "read_committed")
    assert [(m.value(), m.partition()) for m in landed] == [(b"in time", 1)]


def test_a_partition_added_to_a_topic_the_producer_wrote_to_takes_its_records(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
) -> None:
    """The producer's own metadata still had the old count (refreshed every 5 minutes): it
    refused the record with "Local: Unknown partition", and the record was parked again, its
    redrive included, though the relay's fresh count knew the partition."""
    topic = topic_factory(partitions=1)
    relay = relay_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "first")  # the producer knows the topic: 1 partition
    assert relay.run_once().delivered == 1
    grow(kafka_admin, topic, 3)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "new partition", partition=2)
    first = relay.run_once()
    assert (first.delivered, first.parked) == (1, 0), rows(pg_dsn)
    landed = consume_all(kafka_bootstrap, topic, "read_committed")
    assert sorted((m.value(), m.partition()) for m in landed) == [
        (b"first", 0),
        (b"new partition", 2),
    ]


def test_a_parked_record_redriven_once_its_cause_is_fixed_goes_out_once(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
) -> None:
    topic = topic_factory(partitions=2)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        row_id = outbox.publish(conn, topic, "to partition 7", partition=7, tx_id="redrive-me")
    first = relay_factory()
    assert first.run_once().parked == 1
    assert first.run_once().ended == 1  # its dead-letter copy and op marker
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        (group,) = conn.execute(
            "SELECT producer_group FROM outbox.outbox_record WHERE id = %s", (row_id,)
        ).fetchone()  # type: ignore[misc]
        for future in kafka_admin.create_partitions([NewPartitions(topic, 8)]).values():
            future.result(30)  # the cause, fixed
        done = redrive(conn, group, "redrive-me", actor="erin", reason="partitions added")
        assert (done.record_ids, done.from_state, done.to_state) == (
            (row_id,),
            "parked",
            "committed",
        )
        (actor, action, detail) = conn.execute(
            "SELECT actor, action, detail FROM outbox.audit_log WHERE id = %s", (done.audit_id,)
        ).fetchone()  # type: ignore[misc]
    assert (actor, action, detail["reason"]) == ("erin", "redrive", "partitions added")
    assert "partition 7 out of range" in detail["parked_for"][str(row_id)]
    first.stop()  # a relay that starts after the fix: no partition count cached from before
    second = relay_factory()
    assert second.run_once().delivered == 1
    (copy,) = consume_all(kafka_bootstrap, topic, "read_committed")
    assert (copy.value(), copy.partition()) == (b"to partition 7", 7)
    ops = [m.op.value for m in markers(kafka_bootstrap, second) if m.id == row_id]
    assert ops == ["parked", "delivered"]  # the op-marker topic holds both, in order
    assert rows(pg_dsn) == []
    assert second.run_once().delivered == 0


def test_a_parked_record_dropped_is_never_sent(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
) -> None:
    """Given up on: once its dead-letter copy and op marker are out (not before), removed; the
    relay sends nothing of it, even once its cause is gone. It stayed parked for good before."""
    topic = topic_factory(partitions=2)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        row_id = outbox.publish(conn, topic, "to partition 7", partition=7, tx_id="drop-me")
    relay = relay_factory()
    assert relay.run_once().parked == 1
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        (group,) = conn.execute(
            "SELECT producer_group FROM outbox.outbox_record WHERE id = %s", (row_id,)
        ).fetchone()  # type: ignore[misc]
        with pytest.raises(IllegalTransitionError, match="not on the dead-letter topic yet"):
            drop(conn, group, "drop-me", actor="erin", reason="partition 7 is no more")
        assert relay.run_once().ended == 1  # its dead-letter copy and op marker
        done = drop(conn, group, "drop-me", actor="erin", reason="partition 7 is no more")
    assert (done.record_ids, done.from_state, done.to_state) == ((row_id,), "parked", "dropped")
    assert rows(pg_dsn) == []
    for future in kafka_admin.create_partitions([NewPartitions(topic, 8)]).values():
        future.result(30)
    relay.stop()
    again = relay_factory()  # no partition count cached from before
    assert again.run_once().delivered == 0
    assert consume_all(kafka_bootstrap, topic, "read_committed") == []
    ops = [m.op.value for m in markers(kafka_bootstrap, again) if m.id == row_id]
    assert ops == ["parked"]
    dead = consume_all(kafka_bootstrap, again.settings.relay.dead_letter_topic, "read_committed")
    assert [
        m.value() for m in dead if dict(m.headers() or [])["outbox-id"] == str(row_id).encode()
    ] == [b"to partition 7"]


def drain(relay: Relay) -> int:
    delivered, until = 0, time.monotonic() + 60
    while True:
        assert time.monotonic() < until, "the backlog did not drain"
        result = relay.run_once()
        delivered += result.delivered
        if not result.full and not result.delivered and not result.ended:
            return delivered


def test_a_claim_stops_at_batch_max_bytes_and_a_larger_transaction_goes_whole(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """By count alone, 1,000 records of 300 KB took 636 MB of the relay's memory (the chart's
    limit is 256Mi: killed, it claimed the same batch again, for ever)."""
    topic = topic_factory(partitions=2)
    kb3 = "x" * 2_988  # with its 10-byte key and no headers (`[]`): 3,000 bytes
    with psycopg.connect(pg_dsn) as conn:
        for t in range(6):  # one record each
            with conn.transaction():
                outbox.publish(conn, topic, kb3, key=f"key-{t:04d}")
        with conn.transaction():  # 15,000 bytes: more than a batch, never split
            outbox.publish_many(conn, [Record(topic, kb3, key=f"big-{i:04d}") for i in range(5)])
        with conn.transaction():  # parked together (no such topic); their copies one by one
            outbox.publish_many(
                conn, [Record("no.such.topic", kb3, key=f"lost-{i:03d}") for i in range(5)]
            )
    relay = relay_factory(batch_size=1000, batch_max_bytes=10_000)
    # the first rows up to the one that reaches 10,000 bytes: 4 (9,000 before the 4th)
    first = relay.run_once()
    assert (first.delivered, first.full) == (4, True)
    second = relay.run_once()  # 2 more, then the large transaction whole: 7 records
    assert (second.delivered, second.full) == (7, True)
    third = relay.run_once()
    assert (third.delivered, third.parked) == (0, 5)
    # their dead-letter copies, with their values, by bytes too: 9,000 before the 4th
    fourth = relay.run_once()
    assert (fourth.ended, fourth.full) == (4, True)  # the next round at once, not a poll later
    assert relay.run_once().ended == 1
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert sorted(m.key() or b"" for m in delivered) == sorted(
        [f"key-{t:04d}".encode() for t in range(6)] + [f"big-{i:04d}".encode() for i in range(5)]
    )


def test_headers_count_toward_batch_max_bytes(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Counted by key and value alone, records carrying their bytes in headers passed the
    budget: 300 of 300 KB took the relay to 294 MB (found by a review helper)."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn:
        for _ in range(6):  # ~4,000 bytes of headers each (base64, as stored), a 1-byte value
            with conn.transaction():
                outbox.publish(conn, topic, "v", headers={"blob": "y" * 3_000})
    relay = relay_factory(batch_max_bytes=10_000)
    first = relay.run_once()
    assert (first.delivered, first.full) == (3, True)  # ~8,000 bytes before the 3rd
    assert relay.run_once().delivered == 3


def test_a_transaction_held_back_past_batch_max_bytes_does_not_hold_the_shards_other_keys(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Its rows counted in the claim's bytes: a large transaction waiting for another shard
    took the whole budget, and the shard's other keys never reached the claim (found by a
    review helper)."""
    topic = topic_factory(partitions=2)
    (a0, *others), (b0,) = keys_by_shard(pg_dsn, 2, 6)[0], keys_by_shard(pg_dsn, 2, 1)[1]
    relay = relay_factory(shards=2, batch_max_bytes=10_000)
    other = same_settings_other_id(relay_factory, relay, "other")
    for r in (relay, other, relay, other):  # a shard each
        r.heartbeat()
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():  # sent by shard 1 (its first record's), 15 KB in shard 0
            outbox.publish(conn, topic, "home", key=b0)
            for _ in range(3):
                outbox.publish(conn, topic, "x" * 5000, key=a0)
        for key in others:  # shard 0's own: nothing to wait for
            with conn.transaction():
                outbox.publish(conn, topic, "small", key=key)
    shard0 = relay if 0 in relay.workers else other  # shard 1's relay does not run
    first = shard0.run_once()
    assert (first.delivered, first.held_back) == (0, True)  # the budget went to the waiting one
    second = shard0.run_once()  # the claim reads past what it held back
    assert (second.delivered, second.held_back) == (5, True)


def test_a_record_the_broker_refuses_in_a_backlog_is_parked_alone(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    # Transactions of 3 records over 4 keys, on a topic that refuses one record in the middle
    # (the broker, not the client, and with it the rest of its produce request): that record
    # is parked, everything else still goes out once, in commit order per key.
    topic = topic_factory(partitions=3, config={"max.message.bytes": "2000"})
    with psycopg.connect(pg_dsn) as conn:
        for t in range(12):
            with conn.transaction():
                outbox.publish_many(
                    conn,
                    [
                        Record(
                            topic,
                            "x" * 5000 if (t, i) == (7, 1) else f"{t}-{i}",
                            key=f"k{(t + i) % 4}",
                        )
                        for i in range(3)
                    ],
                )
    relay = relay_factory(batch_size=6)
    first = relay.run_once()
    assert first.full
    assert first.delivered + drain(relay) == 35
    got: dict[bytes, list[str]] = {}
    for msg in consume_all(kafka_bootstrap, topic, "read_committed"):
        got.setdefault(msg.key() or b"", []).append((msg.value() or b"").decode())
    for key, sent in got.items():
        order = [tuple(map(int, v.split("-"))) for v in sent]
        assert order == sorted(order), f"{key!r} out of commit order: {sent}"
    assert sorted(v for vs in got.values() for v in vs) == sorted(
        f"{t}-{i}" for t in range(12) for i in range(3) if (t, i) != (7, 1)
    )
    parked = [r for r in rows(pg_dsn) if r[1] == "parked"]
    assert len(parked) == 1
    assert "Message size too large" in parked[0][2]


def test_a_record_the_broker_refuses_is_parked_though_every_abort_fails(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """An abort that failed (timed out, say) skipped what the failed batch left to do: the
    refused record was never parked while aborts kept failing, and its batch was aborted again
    every round."""
    from relay.kafka import OutcomeUnknown

    topic = topic_factory(config={"max.message.bytes": "2000"})
    relay = relay_factory()
    relay.run_once()
    (worker,) = relay.workers.values()

    def abort_fails(timeout_s: float | None = None) -> None:
        raise OutcomeUnknown("abort failed: timed out (test)")

    worker.producer.abort = abort_fails  # type: ignore[method-assign]
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "x" * 5000)
    rounds = [relay.run_once() for _ in range(2)]  # refused in a batch, then alone
    assert [r.parked for r in rounds] == [0, 1]
    assert [r[1] for r in rows(pg_dsn)] == ["parked"]
    assert relay.workers[0].needs_recovery  # its transaction is fenced before the next batch


def test_records_that_fit_alone_are_not_parked_when_their_batch_is_refused(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The broker checks a whole batch of records against max.message.bytes: eight records of
    5000 bytes on one key, each of which fits a topic of 20000, are refused together. Each goes
    again alone, and all arrive, in order."""
    topic = topic_factory(config={"max.message.bytes": "20000"})
    with psycopg.connect(pg_dsn) as conn:
        for i in range(8):
            with conn.transaction():
                outbox.publish(conn, topic, f"{i}:".encode() + b"x" * 5000, key="k")
    relay = relay_factory()
    rounds = 0
    while any(r[1] == "committed" for r in rows(pg_dsn)):
        rounds += 1
        assert rounds < 10, "the records did not go out"
        relay.run_once()
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    arrived = [(m.value() or b"").split(b":")[0] for m in delivered]
    assert arrived == [str(i).encode() for i in range(8)]
    assert [r for r in rows(pg_dsn) if r[1] == "parked"] == []


def test_a_dead_letter_copy_the_broker_refuses_goes_again_without_its_value(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    # A dead-letter topic that takes less than the records' topics: the broker, not the client,
    # refuses the copy. That must not become a loop of aborted transactions.
    dead_letter = topic_factory(config={"max.message.bytes": "2000"})
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, "no.such.topic", b"x" * 5000, key="k")
    relay = relay_factory(dead_letter_topic=dead_letter)
    assert relay.run_once().parked == 1
    copies_before = copies_by_form()
    rounds = [relay.run_once() for _ in range(4)]
    # refused (in a batch, maybe for another record), refused alone, sent without the value
    assert [r.ended for r in rounds] == [0, 0, 1, 0]
    # the copies of the aborted transactions are not counted
    assert copies_since(copies_before) == {"without_value": 1.0}
    (copy,) = consume_all(kafka_bootstrap, dead_letter, "read_committed")
    headers = dict(copy.headers() or [])
    assert copy.value() is None
    assert b"refused by the broker" in headers["outbox-value-omitted"]
    assert headers["outbox-reason"] == b"topic 'no.such.topic' does not exist"
    assert [m.op.value for m in markers(kafka_bootstrap, relay)] == ["parked"]
    (row,) = rows(pg_dsn)
    assert row[1:4] == ("parked", "topic 'no.such.topic' does not exist", True)


@pytest.mark.parametrize("committed", [True, False])
def test_the_copy_of_a_batch_whose_commit_is_in_doubt_is_counted_once(
    pg_dsn: str, kafka_bootstrap: str, relay_factory: Any, committed: bool
) -> None:
    """A commit that raises may have committed: the recovery's markers tell. Committed, its
    copy is counted then (it is not sent again); aborted, it goes again and is counted with
    the batch that takes it. Found by a review: counted only after a commit that returned."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, "no.such.topic", "parked", key="k")
    relay = relay_factory()
    assert relay.run_once().parked == 1
    (worker,) = relay.workers.values()
    commit = worker.producer.commit

    def in_doubt(*waiting: Any) -> float:
        worker.producer.commit = commit  # type: ignore[method-assign]
        if committed:
            commit(*waiting)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "the commit's outcome is unknown"))

    worker.producer.commit = in_doubt  # type: ignore[method-assign]
    copies_before = copies_by_form()
    with pytest.raises(KafkaException, match="outcome is unknown"):
        relay.run_once()
    assert worker.needs_recovery
    assert copies_since(copies_before) == {}
    worker.retry_at = 0.0  # past its back-off
    relay.run_once()  # the recovery, then (aborted) the copy again
    assert copies_since(copies_before) == {"full": 1.0}
    dead_letter = relay.settings.relay.dead_letter_topic
    assert values(consume_all(kafka_bootstrap, dead_letter, "read_committed")) == [b"parked"]
    assert [m.op.value for m in markers(kafka_bootstrap, relay)] == ["parked"]


@pytest.mark.parametrize(
    ("max_bytes", "copied"),
    [("2000", True), ("200", False)],  # the bare copy fits / not even that does
)
def test_a_dead_letter_copy_too_large_even_without_its_value_goes_bare_or_not_at_all(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    max_bytes: str,
    copied: bool,
) -> None:
    # The key and the record's headers alone are over what the dead-letter topic takes: that
    # must not abort the shard's batch every round, with the good records in it.
    dead_letter = topic_factory(config={"max.message.bytes": max_bytes})
    good = topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(
            conn, "no.such.topic", b"x" * 5000, key=b"k" * 3000, headers={"h": b"y" * 500}
        )
    relay = relay_factory(dead_letter_topic=dead_letter)
    assert relay.run_once().parked == 1
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, good, "good", key="g")
    copies_before = copies_by_form()
    rounds = [relay.run_once() for _ in range(6)]
    assert copies_since(copies_before) == {"bare" if copied else "none": 1.0}
    # refused whole (in a batch, then alone), refused without the value, then sent bare, or
    # refused bare and then its marker goes alone; the good record waits in the aborted
    # transactions, and goes with it
    refusals = 3 if copied else 4
    assert [(r.ended, r.delivered) for r in rounds] == (
        [(0, 0)] * refusals + [(1, 1)] + [(0, 0)] * (5 - refusals)
    )
    assert [m.value() for m in consume_all(kafka_bootstrap, good, "read_committed")] == [b"good"]
    copies = consume_all(kafka_bootstrap, dead_letter, "read_committed")
    if copied:
        (copy,) = copies
        headers = dict(copy.headers() or [])
        assert (copy.key(), copy.value()) == (None, None)
        assert "h" not in headers  # the record's own headers are left out too
        assert b"refused by the broker" in headers["outbox-value-omitted"]
        assert headers["outbox-reason"] == b"topic 'no.such.topic' does not exist"
    else:
        assert copies == []
    parked = [m for m in markers(kafka_bootstrap, relay) if m.op.value == "parked"]
    assert len(parked) == 1
    assert (parked[0].offset is not None) is copied
    assert [r[1:4] for r in rows(pg_dsn)] == [
        ("parked", "topic 'no.such.topic' does not exist", True)
    ]  # the good record's row is gone: delivered


def test_a_dead_letter_copy_refused_with_a_batch_mate_keeps_its_form(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    # The broker refuses a whole batch of records for one too large: the copy that fits goes
    # again alone, whole, rather than shrinking with the one at fault.
    dead_letter = topic_factory(config={"max.message.bytes": "2000"})
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, "no.such.topic", b"x" * 5000, key=b"k" * 3000)
        outbox.publish(conn, "no.such.topic", b"fits", key=b"small")
    relay = relay_factory(dead_letter_topic=dead_letter)
    assert relay.run_once().parked == 2
    ended, rounds = 0, 0
    while ended < 2:
        rounds += 1
        assert rounds <= 6, "the dead-letter copies did not go out"
        ended += relay.run_once().ended
    copies = {
        c.key(): c.value() for c in consume_all(kafka_bootstrap, dead_letter, "read_committed")
    }
    assert copies == {None: None, b"small": b"fits"}  # bare, and whole


def test_a_record_that_names_its_partition_lands_there(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory(partitions=3)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(
            conn,
            [Record(topic, f"p{p}-{k}", key=k, partition=p) for p in (2, 0, 1) for k in "ab"]
            + [Record(topic, "any", key="a")],
        )
    assert relay_factory().run_once().delivered == 7
    landed = {
        (m.value() or b"").decode(): m.partition()
        for m in consume_all(kafka_bootstrap, topic, "read_committed")
    }
    assert {v: p for v, p in landed.items() if v != "any"} == {
        f"p{p}-{k}": p for p in (2, 0, 1) for k in "ab"
    }
    assert landed["any"] in (0, 1, 2)  # the partitioner's choice


def test_the_largest_record_the_library_takes_by_default_is_delivered_not_parked(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The library took up to 1 MiB while the relay's client refuses a message over its
    message.max.bytes (1,000,000 by default) with the headers the relay adds: such a record
    was accepted, then parked. Here with the longest tx id and producer group there are."""
    topic = topic_factory()
    value = b"v" * (outbox.DEFAULT_MAX_RECORD_BYTES - 1)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, value, key="k", tx_id="t" * 128, producer_group="g" * 128)
    assert relay_factory().run_once().delivered == 1
    [got] = consume_all(kafka_bootstrap, topic, "read_committed")
    assert got.value() == value
    assert rows(pg_dsn) == []  # ended, not parked


def test_delivered_rows_are_archived_with_their_position(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory(partitions=2)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(6):
            outbox.publish(conn, topic, f"v{i}", key=str(i))
    relay_factory(delivered_retention="PT1H").run_once()
    kept = rows(pg_dsn)
    archived = {(r[4], r[5]): r[0] for r in kept}
    assert len(kept) == len(archived) == 6  # each kept, each with its own position
    assert all(r[1] == "delivered" and r[3] for r in kept)
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert len(delivered) == 6
    for msg in delivered:
        record_id = archived[(msg.partition(), msg.offset())]
        assert dict(msg.headers() or [])["outbox-id"] == str(record_id).encode()


def test_markers_share_messages_and_say_where_each_record_landed(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory(partitions=3)
    with psycopg.connect(pg_dsn) as conn:
        for tx in range(3):
            with conn.transaction():
                for i in range(10):
                    outbox.publish(conn, topic, f"v{tx}-{i}", key=f"k{i}")
        with conn.transaction():
            half = outbox.prepare(conn, topic, "never")
        with conn.transaction():
            outbox.rollback(conn, half.tx_id)
    relay = relay_factory(op_marker_message_bytes=1024)  # a few entries per message
    assert relay.run_once().delivered == 30

    landed = {
        int(dict(m.headers() or [])["outbox-id"]): (m.partition(), m.offset())
        for m in consume_all(kafka_bootstrap, topic, "read_committed")
    }
    messages = consume_all(kafka_bootstrap, relay.settings.relay.op_marker_topic, "read_committed")
    markers = [marker for m in messages for marker in decode_markers(m.value() or b"")]
    delivered = {m.id: (m.partition, m.offset) for m in markers if m.op.value == "delivered"}
    assert delivered == landed  # every record, once, at its place
    assert [m.op.value for m in markers].count("rolled_back") == 1
    assert 1 < len(messages) < len(markers)
    assert all(len(m.value() or b"") <= 2048 for m in messages)


def test_a_record_with_a_key_too_large_for_a_marker_goes_out_once_without_a_loop(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A key of 800 KiB fits a record (1 MiB), not its marker: as base64 it is over the marker
    topic's max.message.bytes, and every round would abort. The marker goes without the key."""
    topic = topic_factory()
    big_key = b"k" * (800 * 1024)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        record_id = outbox.publish(conn, topic, "v", key=big_key)
        outbox.publish(conn, topic, "w", key="small")
    relay = relay_factory()
    assert relay.run_once().delivered == 2
    assert relay.run_once().delivered == 0
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert sorted(m.key() or b"" for m in delivered) == sorted([big_key, b"small"])
    by_id = {m.id: m for m in markers(kafka_bootstrap, relay)}
    assert by_id[record_id].key is None  # omitted: the record on its topic has it
    assert by_id[record_id].offset is not None
    assert b"small" in {m.key for m in by_id.values()}
    assert rows(pg_dsn) == []


def test_marker_messages_larger_than_the_marker_topic_takes_are_refused_at_start(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    markers_topic = topic_factory(partitions=2, config={"max.message.bytes": "100000"})
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic_factory(), "v")
    relay = relay_factory(op_marker_topic=markers_topic, op_marker_message_bytes=262144)
    with pytest.raises(
        RelayConfigError, match=rf"max.message.bytes of topic {markers_topic} is 100000"
    ):
        relay.run_once()
    running = relay_factory(op_marker_topic=markers_topic, op_marker_message_bytes=262144)
    running.start()  # the sidecar's way: the relay stops, and /healthz says it is not alive
    wait_for(lambda: not running.alive())
    fitting = relay_factory(op_marker_topic=markers_topic, op_marker_message_bytes=65536)
    assert fitting.run_once().delivered == 1
    # a limit no op_marker_message_bytes fits: the topic's is to change (the setting's least
    # is 1024; it said "set it to at most -12768")
    tiny = topic_factory(partitions=2, config={"max.message.bytes": "20000"})
    with pytest.raises(
        RelayConfigError, match=rf"raise max.message.bytes of topic {tiny} to at least 294912"
    ):
        relay_factory(op_marker_topic=tiny).run_once()


def test_marker_messages_that_fit_the_topic_alone_but_not_batched_are_sent_alone(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The broker checks a whole batch against max.message.bytes, and the client batched many
    marker messages that each fit (as the start-up check asks): every round was refused, and
    the relay stopped saying the setting was too large (before: every round aborted)."""
    topic = topic_factory()
    markers_topic = topic_factory(partitions=2, config={"max.message.bytes": "40000"})
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, [Record(topic, f"v{i}", key=f"k{i}") for i in range(600)])
    relay = relay_factory(op_marker_topic=markers_topic, op_marker_message_bytes=1024)

    def delivered() -> bool:
        with contextlib.suppress(KafkaException):  # the round that found out
            relay.run_once()
        return rows(pg_dsn) == []

    wait_for(delivered, 60)
    assert len(consume_all(kafka_bootstrap, topic, "read_committed")) == 600
    assert len(markers(kafka_bootstrap, relay)) == 600


def test_a_marker_topic_that_refuses_markers_while_the_relay_runs_stops_it(
    pg_dsn: str, kafka_admin: AdminClient, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Its max.message.bytes lowered below a marker message: every round aborted for ever,
    said as a bare RuntimeError without Kafka's error, behind green probes."""
    topic, markers_topic = topic_factory(), topic_factory(partitions=2)
    relay = relay_factory(op_marker_topic=markers_topic)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "before")
    assert relay.run_once().delivered == 1
    lowered = ConfigResource(
        ResourceType.TOPIC,
        markers_topic,
        incremental_configs=[
            ConfigEntry("max.message.bytes", "100", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    kafka_admin.incremental_alter_configs([lowered])[lowered].result(30)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after")

    def refused_alone() -> bool:  # the first refusal was in a batch: they go alone
        with contextlib.suppress(KafkaException):
            relay.run_once()
        return False

    with pytest.raises(
        RelayConfigError,
        match=rf"op markers could not be written to {markers_topic}: .*too large.* Its "
        "max.message.bytes must stay at least",
    ):
        wait_for(refused_alone, 30)
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]  # kept, not ended without its marker


def test_a_marker_topic_that_cannot_keep_the_markers_is_refused_at_start(
    topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A compacted topic keeps a shard's last marker message only (the shard is its key): the
    earlier messages of a batch in doubt would be gone, and recovery would send it again. A
    topic without a partition for some shard failed in every round of that shard."""
    compacted = topic_factory(partitions=2, config={"cleanup.policy": "compact"})
    with pytest.raises(RelayConfigError, match=rf"op-marker topic {compacted} is compacted"):
        relay_factory(op_marker_topic=compacted).run_once()
    narrow = topic_factory(partitions=1)
    with pytest.raises(RelayConfigError, match=rf"{narrow} has 1 partitions, and 2 shards"):
        relay_factory(op_marker_topic=narrow, shards=2, op_marker_partitions=2).run_once()
    assert relay_factory(op_marker_topic=narrow, shards=1).run_once().shards == 1  # enough
    # kept an hour: the markers of a batch in doubt outlived by an ordinary outage
    brief = topic_factory(partitions=4, config={"retention.ms": "3600000"})
    with pytest.raises(RelayConfigError, match=rf"{brief} keeps its messages 3600000 ms"):
        relay_factory(op_marker_topic=brief).run_once()
    by_size = topic_factory(partitions=4, config={"retention.bytes": "1048576"})
    with pytest.raises(RelayConfigError, match=rf"{by_size} keeps 1048576 bytes a partition"):
        relay_factory(op_marker_topic=by_size).run_once()


def test_the_marker_topic_the_relay_makes_keeps_markers_by_time_only(
    kafka_admin: AdminClient, relay_factory: Any
) -> None:
    """Made with the broker's defaults, a broker-wide log.retention.bytes would have applied,
    and the relay would then refuse its own topic."""
    relay = relay_factory(op_marker_retention="P2D")
    relay.run_once()
    topic = relay.settings.relay.op_marker_topic
    resource = ConfigResource(ResourceType.TOPIC, topic)
    entries = kafka_admin.describe_configs([resource])[resource].result(30)
    assert entries["retention.ms"].value == str(2 * 24 * 3600 * 1000)
    assert entries["retention.bytes"].value == "-1"
    assert entries["retention.bytes"].source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value


@pytest.mark.parametrize(("message_max", "topic_max"), [(None, None), (3_000_000, "3048588")])
def test_the_dead_letter_topic_the_relay_makes_takes_copies_of_its_largest_records(
    kafka_admin: AdminClient,
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Any,
    message_max: int | None,
    topic_max: str | None,
) -> None:
    """Made with the broker's default max.message.bytes, it refused the copies of records the
    producer's raised message.max.bytes let through: a discarded record's copy went without
    its value, and with no archive its row was deleted, the value lost."""
    settings = relay_settings()
    extra = {} if message_max is None else {"message.max.bytes": message_max}
    kafka = settings.kafka.model_copy(update={"extra": extra})
    relay = relay_factory(settings.model_copy(update={"kafka": kafka}))
    relay.run_once()
    resource = ConfigResource(ResourceType.TOPIC, relay.settings.relay.dead_letter_topic)
    entry = kafka_admin.describe_configs([resource])[resource].result(30)["max.message.bytes"]
    if topic_max is None:  # the broker's, however it is set
        assert entry.source != ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    else:
        assert (entry.value, entry.source) == (topic_max, ConfigSource.DYNAMIC_TOPIC_CONFIG.value)


def test_a_relay_with_another_op_marker_partitions_is_refused_at_start(
    topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A shard's markers are read back from the partition they were recorded in. With another
    op_marker_partitions its worker could not be made: the lease stayed held and renewed by
    a relay that never delivered that shard, its probes green."""
    markers_topic = topic_factory(partitions=4)
    first = relay_factory(op_marker_topic=markers_topic, shards=4, op_marker_partitions=2)
    assert first.run_once().shards == 4  # each shard recovered once: its partition recorded
    first.stop()
    with pytest.raises(RelayConfigError, match="shard 2 recorded its op markers in partition 0"):
        relay_factory(op_marker_topic=markers_topic, shards=4, op_marker_partitions=4).run_once()
    again = relay_factory(op_marker_topic=markers_topic, shards=4, op_marker_partitions=2)
    assert again.run_once().shards == 4


@pytest.mark.parametrize("listen_notify", [True, False])
def test_a_relay_waiting_longer_than_its_lease_keeps_its_shards(
    pg_dsn: str, relay_factory: Any, listen_notify: bool
) -> None:
    """Heartbeats came only with rounds: a poll interval (or a failure's backoff) longer than
    the lease let it lapse while the relay waited, and the shards went from relay to relay."""
    relay = relay_factory(
        lease_duration="PT5S",  # a renewal may come up to 4 s late on a loaded machine
        heartbeat_interval="PT1S",
        poll_interval="PT12S",
        listen_notify=listen_notify,
    )
    relay.start()
    wait_for(lambda: relay.workers)
    seen = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for _ in range(22):  # 11 s: past two leases with no round between them
            time.sleep(0.5)
            seen.append(
                conn.execute(
                    "SELECT owner IS NOT NULL AND lease_until > now(), epoch"
                    " FROM outbox.shard_lease"
                ).fetchone()
            )
    assert {held for held, _ in seen} == {True}, seen
    assert len({epoch for _, epoch in seen}) == 1, seen  # never taken again


def test_a_commit_the_xid_horizon_held_back_goes_out_soon_after_it_moves(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """An older transaction still running (any writer's; often a relay's own end) holds the
    horizon: the round its commit woke could not take the record, and the transaction's end
    wakes nobody. The record waited for the poll interval (60 s here, 0.5 s by default). It is
    looked for again 50 ms later, then twice as long each time nothing goes, but at least
    every second (HELD_BY_HORIZON_MAX_POLL_S): after a hold of 14 s the doubling alone waited
    some 12 s more."""
    topic = topic_factory()
    relay = relay_factory(poll_interval="PT60S")
    relay.start()
    wait_for(lambda: relay.workers and relay._stamped_below != "0")  # its first stamp done
    with psycopg.connect(pg_dsn) as older, psycopg.connect(pg_dsn) as app:
        older.execute("SELECT pg_current_xact_id()")  # holds the horizon until it ends
        with app.transaction():
            outbox.publish(app, topic, "held", key="k")  # commits, and wakes the relay
        time.sleep(14)  # the round it woke has come and gone, and many since
        assert [r[1] for r in rows(pg_dsn)] == ["committed"]
        older.commit()
        moved = time.monotonic()
    wait_for(lambda: not rows(pg_dsn), timeout=30)
    assert time.monotonic() - moved < 6  # a second's wait, and a round, under load


def test_a_transaction_that_ends_during_a_claim_leaves_its_commits_looked_for_soon(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Each statement of a claim sees the horizon of its own start. An older transaction that
    ended between the claim and the look at what the claim left unstamped made the round say
    nothing waited above the horizon: the commit the claim could not take, its wake-up spent
    on that round, waited for the poll interval (failed a CI run under load)."""
    topic = topic_factory()
    relay = relay_factory(poll_interval="PT60S")
    relay.run_once()  # its first stamp: the next round claims unstamped rows itself
    (worker,) = relay.workers.values()
    claim_unmarked = worker._unmarked

    def unmarked_later(conn: psycopg.Connection[Any], skip_ids: list[int]) -> Any:
        conn.execute("SELECT pg_sleep(3)")  # queued in the claim's pipeline, after the claim
        return claim_unmarked(conn, skip_ids)

    def end_while_the_claim_sleeps(older: psycopg.Connection[Any]) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as watch:  # each look a fresh view
            wait_for(
                lambda: watch.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(3)'"
                ).fetchone()
            )
        older.commit()

    with psycopg.connect(pg_dsn) as older, psycopg.connect(pg_dsn) as app:
        older.execute("SELECT pg_current_xact_id()")  # holds the horizon until it ends
        with app.transaction():
            outbox.publish(app, topic, "held", key="k")
        worker._unmarked = unmarked_later  # type: ignore[method-assign]
        ender = threading.Thread(target=end_while_the_claim_sleeps, args=(older,))
        ender.start()
        result = relay.run_once()
        ender.join()
    assert result.delivered == 0  # the claim ran while the older transaction did
    assert result.held_by_horizon  # so the loop looks again soon
    worker._unmarked = claim_unmarked  # type: ignore[method-assign]
    assert relay.run_once().delivered == 1


def test_wake_ups_are_read_while_the_relay_waits_out_a_failure(
    pg_dsn: str, relay_factory: Any
) -> None:
    """Read only after a round that succeeded: through a Kafka outage of hours they piled up
    in Postgres's notification queue, which every listener shares, and at 8 GB the
    applications' commits failed."""
    relay = relay_factory(listen_notify=True)
    listen = relay._listening()
    with psycopg.connect(pg_dsn) as conn:
        for i in range(3):
            with conn.transaction():
                outbox.publish(conn, "orders", f"v{i}")
    relay._pause(0.3)  # as a failure's backoff
    assert list(listen.notifies(timeout=0.2)) == []


def test_a_heartbeat_every_round_still_renews_the_leases_while_the_relay_waits(
    pg_dsn: str, relay_factory: Any
) -> None:
    """heartbeat_interval 0 ("every round") renewed nothing between rounds: a failure's
    backoff, a poll interval or a linger as long as the lease let every lease lapse, and the
    shards moved to other relays, each move a fencing and a recovery (found by a review)."""
    relay = relay_factory(
        heartbeat_interval="PT0S", lease_duration="PT2S", poll_interval="PT4S", linger="PT3S"
    )
    relay.run_once()

    def held() -> bool:
        with psycopg.connect(pg_dsn) as conn:
            (until,) = conn.execute(
                "SELECT bool_and(lease_until > now()) FROM outbox.shard_lease WHERE owner = %s",
                (relay.relay_id,),
            ).fetchone()  # type: ignore[misc]
        return bool(until)

    relay._pause(3.5)  # as a failure's backoff
    assert held()
    relay._wait_for_work()  # a poll interval with no commit, then the linger
    assert held()


def test_a_round_that_fails_in_its_only_shard_counts_one_error(relay_factory: Any) -> None:
    """A shard's failure was counted as the shard's, and again as the round's when it was the
    only shard tried: a relay with one shard (the usual sidecar) reported twice its errors."""
    relay = relay_factory()
    relay.run_once()
    (worker,) = relay.workers.values()

    def fail(*_: Any, **__: Any) -> None:
        raise RuntimeError("boom")

    worker.deliver_once = fail  # type: ignore[method-assign]
    name, labels = "outbox_relay_errors_total", {"kind": "RuntimeError"}
    before = REGISTRY.get_sample_value(name, labels) or 0.0
    with pytest.raises(RuntimeError, match="boom") as failed:
        relay.run_once()
    relay._on_failure(failed.value)  # what the loop does with it
    assert REGISTRY.get_sample_value(name, labels) == before + 1


def test_a_topic_the_broker_will_not_create_stops_the_relay(
    topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A refusal that asking again cannot change (here: a name that collides with another's
    once '.' and '_' are taken alike) was retried for ever behind green probes."""
    taken = topic_factory()
    colliding = taken.replace(".", "_")
    with pytest.raises(RelayConfigError, match=f"topic {colliding} is missing and the broker"):
        relay_factory(dead_letter_topic=colliding).run_once()


def test_a_relay_on_another_op_marker_topic_than_its_shards_wrote_to_stops(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Recovery read a renamed (or remade) marker topic from the offset recorded in the old
    one: it found none of the markers of a batch in doubt, and sent that batch again."""
    before, renamed = topic_factory(partitions=2), topic_factory(partitions=2)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic_factory(), "v")
    first = relay_factory(op_marker_topic=before)
    assert first.run_once().delivered == 1  # an offset recorded past its markers
    with psycopg.connect(pg_dsn) as conn:  # what `outboxctl status` shows of it
        (lease,) = outbox_status(conn, "outbox")["leases"]
    prefix = first.settings.relay.transactional_id_prefix
    assert (lease["marker_topic"], lease["marker_partition"]) == (before, 0)
    assert lease["marker_offset"] > 0
    assert lease["transactional_id"] == f"{prefix}-0"
    first.stop()
    wrong = relay_factory(op_marker_topic=renamed)
    with pytest.raises(RelayConfigError, match=rf"in topic {before}, not {renamed}:"):
        wrong.run_once()
    wrong.stop()  # the sidecar's way: it stops, and hands its shard back
    assert relay_factory(op_marker_topic=before).run_once().shards == 1


def test_a_marker_topic_made_anew_under_its_name_stops_the_relay(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Deleted and made again, its log refilled past the offset a shard recorded (other shards'
    markers, say): recovery read from that offset, found none of the markers of a batch in
    doubt, and would have sent it again. A relay running meanwhile wrote on into the new topic,
    its shards recording the old topic's id: it stops at its next heartbeat, also when that
    comes between rounds (an idle relay's are: the refusal was forgotten by the next round)."""
    # not 0: a refusal between rounds was forgotten when the round's own check was not due
    monkeypatch.setattr(service_module, "MARKER_TOPIC_CHECK_S", 1.0)
    markers_topic = topic_factory(partitions=2)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic_factory(), "v")
    running = relay_factory(op_marker_topic=markers_topic, lease_duration="PT60S")
    assert running.run_once().delivered == 1
    idle = relay_factory(  # holds no shard: `running` keeps them, and the check is the relay's
        op_marker_topic=markers_topic,
        heartbeat_interval="PT0.2S",
        poll_interval="PT60S",  # no round but the first: every heartbeat is between rounds
        lease_duration="PT30S",
    )
    idle.start()
    wait_for(lambda: idle._marker_topic_id is not None)  # seen once, as it was
    kafka_admin.delete_topics([markers_topic])[markers_topic].result(30)
    wait_for(lambda: markers_topic not in kafka_admin.list_topics(timeout=10).topics)

    def made_again() -> bool:
        new = NewTopic(markers_topic, num_partitions=2, replication_factor=1)
        try:
            kafka_admin.create_topics([new])[markers_topic].result(30)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            return False  # still being deleted
        return True

    wait_for(made_again, 30)
    refill = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(10):
        refill.produce(markers_topic, b"another's", partition=0)
    assert refill.flush(30) == 0
    replaced = rf"op-marker topic {markers_topic} was deleted and made again while the relay ran"
    wait_for(idle.ended_by_itself, 30)  # while `running` holds the shards: by its heartbeat
    assert any(re.search(replaced, r.getMessage()) for r in caplog.records)
    running._marker_topic_checked_at = -float("inf")  # due at its next heartbeat
    with pytest.raises(RelayConfigError, match=replaced):
        running.run_once()
    running.stop()
    wrong = relay_factory(op_marker_topic=markers_topic)
    with pytest.raises(RelayConfigError, match="it was deleted and made again"):
        wrong.run_once()
    wrong.stop()


def test_a_marker_topic_described_as_missing_once_is_looked_up_again_not_refused(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One describe answered "missing" (a broker's metadata still settling on a cluster) made
    recovery refuse the shard's recorded topic, and the relay stopped for good."""
    # the heartbeat's own check, due once in a while, would take the one "missing" answer
    monkeypatch.setattr(service_module, "MARKER_TOPIC_CHECK_S", 3600.0)
    topic = topic_factory()
    relay = relay_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "before")
    assert relay.run_once().delivered == 1  # the topic's id recorded with the markers' offset
    for worker in relay.workers.values():
        worker.needs_recovery = True
    real_topic_id, asked = relay.topics.topic_id, []

    def missing_once(name: str, **kw: Any) -> str | None:
        asked.append(name)
        return None if len(asked) == 1 else real_topic_id(name, **kw)

    relay.topics.topic_id = missing_once
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after")
    with pytest.raises(KafkaException, match="described as missing, listed as there"):
        relay.run_once()  # not RelayConfigError: this recovery fails, and goes again
    for worker in relay.workers.values():
        worker.retry_at = 0.0  # its backoff over
    assert relay.run_once().delivered == 1
    assert asked == [relay.settings.relay.op_marker_topic] * 2
    copies = consume_all(relay.settings.kafka.bootstrap_servers, topic, "read_committed")
    assert [m.value() for m in copies] == [b"before", b"after"]


def test_relays_of_two_shard_counts_starting_together_do_not_both_run(
    pg_dsn: str, relay_factory: Any
) -> None:
    """Each read the shard count before any lease row existed, both found none, both made
    their rows and ran, their leases not excluding each other: the same records twice. Here
    one relay's first heartbeat (2 shards) is caught between its rows and its commit."""
    from outbox import sql as queries

    with psycopg.connect(pg_dsn) as first_relay:
        first_relay.execute(queries.query("relay_lock_shard_set", "outbox"), {"schema": "outbox"})
        first_relay.execute(queries.query("relay_ensure_shards", "outbox"), {"shards": 2})
        other = relay_factory(shards=4)
        outcome: list[BaseException | None] = []

        def start() -> None:
            try:
                other.run_once()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        starting = threading.Thread(target=start)
        starting.start()
        starting.join(1.0)  # it waits for the first relay's heartbeat to end
        first_relay.commit()
    starting.join(30)
    assert len(outcome) == 1
    assert isinstance(outcome[0], RelayConfigError), outcome
    assert "made for 2 shards, this relay is configured with 4" in str(outcome[0])


def test_a_shard_count_refused_by_a_heartbeat_between_rounds_stops_the_relay(
    pg_dsn: str, relay_factory: Any
) -> None:
    """Found between rounds (a poll interval longer than the heartbeat interval), the refusal
    was logged as a failed heartbeat and the relay ran on, its leases no longer renewed."""
    relay = relay_factory(poll_interval="PT30S", heartbeat_interval="PT0.5S", lease_duration="PT3S")
    relay.run_once()  # set up, its shard taken: it waits for work now, heartbeating
    relay.start()
    with psycopg.connect(pg_dsn) as conn:  # another relay's lease rows, for more shards
        conn.execute("INSERT INTO outbox.shard_lease (shard) VALUES (1), (2)")
    began = time.monotonic()
    wait_for(relay.ended_by_itself, 40)
    assert time.monotonic() - began < 5, "it ran on until a round's own heartbeat"


@pytest.mark.parametrize("deleted", ["destination", "dead-letter"])
def test_a_topic_deleted_after_the_producer_wrote_to_it_does_not_stall_the_shard(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    deleted: str,
) -> None:
    """The client kept the records for a topic it had written to, deleted since, queued until
    the Kafka transaction timed out: every other record of the shard waited that long (60 s
    by default), and the error said Kafka was slow."""
    gone, other = topic_factory(partitions=3), topic_factory()
    relay = relay_factory(kafka_transaction_timeout="PT300S")  # the stall, before
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, gone, "first")
    if deleted == "dead-letter":
        discarded(pg_dsn, gone, "copied")  # its copy goes to the dead-letter topic
    wait_for(lambda: relay.run_once() and rows(pg_dsn) == [])  # the producer knows the topic
    target = gone if deleted == "destination" else relay.settings.relay.dead_letter_topic
    kafka_admin.delete_topics([target])[target].result(30)
    wait_for(lambda: target not in kafka_admin.list_topics(timeout=10).topics)
    if deleted == "destination":
        with psycopg.connect(pg_dsn) as conn, conn.transaction():
            outbox.publish(conn, gone, "lost")
    else:
        discarded(pg_dsn, other, "needs a copy")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, other, "goes on")

    def sent_on() -> bool:
        try:
            relay.run_once()
        except RelayConfigError:
            raise
        except Exception:
            pass
        return not [r for r in rows(pg_dsn) if r[1] == "committed"]

    wait_for(sent_on, 60)
    assert values(consume_all(kafka_bootstrap, other, "read_committed")) == [b"goes on"]
    if deleted == "destination":
        assert [(r[1], r[2]) for r in rows(pg_dsn)] == [
            ("parked", f"topic {gone!r} does not exist")
        ]
    else:  # made again, its copy sent once it takes copies again
        assert target in kafka_admin.list_topics(timeout=10).topics
        assert [r[1] for r in rows(pg_dsn)] == ["discarded"]


def test_a_topic_deleted_since_the_relay_cached_it_is_found_gone_when_the_broker_refuses(
    kafka_bootstrap: str, kafka_admin: AdminClient, topic_factory: Callable[..., str]
) -> None:
    """The race the test above can lose either way, made certain: the relay's cached count
    still says the topic is there, the broker refuses a record for it, and the reason comes
    from asking the broker again, not from the cache (it was "refused by the broker" then)."""
    from types import SimpleNamespace

    from relay.kafka import Topics
    from relay.shard import ShardWorker

    topic = topic_factory(partitions=3)
    topics = Topics({"bootstrap.servers": kafka_bootstrap})
    assert topics.partitions(topic) == 3  # cached for 30 s
    refused = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    worker: Any = SimpleNamespace(topics=topics)
    assert not ShardWorker._gone(worker, topic, refused, {})  # there: the broker's words stand
    kafka_admin.delete_topics([topic])[topic].result(30)
    wait_for(lambda: topic not in kafka_admin.list_topics(timeout=10).topics)
    assert topics.partitions(topic) == 3  # the cache has not seen it go
    assert ShardWorker._gone(worker, topic, refused, {})
    assert topics.partitions(topic) == 0  # and the next round's check finds it gone too


def test_a_marker_topic_deleted_while_the_relay_runs_stops_it(
    pg_dsn: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
) -> None:
    """Every round failed on its markers (no delivery report in time) while the probes stayed
    green, and nothing made the topic again: delivery stopped with no end, and said nothing."""
    topic = topic_factory()
    relay = relay_factory(kafka_transaction_timeout="PT5S")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "before")
    assert relay.run_once().delivered == 1
    markers_topic = relay.settings.relay.op_marker_topic
    kafka_admin.delete_topics([markers_topic])[markers_topic].result(30)
    wait_for(lambda: markers_topic not in kafka_admin.list_topics(timeout=10).topics)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after")

    def rounds() -> None:  # the first may fail alone, before the topic is looked at
        for _ in range(5):
            relay.run_once()

    with pytest.raises(RelayConfigError, match=f"op-marker topic {markers_topic} was deleted"):
        rounds()
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]  # kept for the relays to come


def test_a_transaction_too_large_to_send_in_time_is_named_and_sent_apart(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """An outbox transaction that could not be sent within kafka_transaction_timeout failed
    every round with "N records had no delivery report", which named neither it nor the
    timeout; and the transactions claimed with it waited behind it for ever."""
    topic = topic_factory()
    big = 200_000  # far more than any machine produces and confirms in 1 s from Python
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            outbox.publish(conn, topic, "before", key="a")
        with conn.transaction():
            written = outbox.publish_many(conn, [Record(topic, b"x", key=b"b")] * big)
        with conn.transaction():
            outbox.publish(conn, topic, "after", key="c")
    relay = relay_factory(kafka_transaction_timeout="PT1S")
    counted = {"kind": "transaction_timeout"}
    counted_before = REGISTRY.get_sample_value("outbox_relay_errors_total", counted) or 0

    def next_round() -> RelayRound | str:
        """The next round that sent something or timed out (a refusal of the new producer
        while the coordinator still aborts the transaction left open is retried, as the
        relay's loop retries it after a backoff)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                return relay.run_once()
            except TransactionTimedOut as exc:
                return str(exc)
            except KafkaException as exc:
                # and what a loaded machine's 1 s cuts short besides (the recovery's
                # init_transactions, a one-record batch): the loop retries those too
                error = exc.args[0]
                retried = error.code() == KafkaError.CONCURRENT_TRANSACTIONS or error.retriable()
                if not retried or time.monotonic() > deadline:
                    raise
            except TimeoutError:  # the recovery's read of the markers, past aborted ones
                if time.monotonic() > deadline:
                    raise
            finally:
                for w in relay.workers.values():
                    w.retry_at = 0.0  # no backoff: the test drives the rounds

    def round_failing() -> str:
        outcome = next_round()
        assert isinstance(outcome, str), outcome
        return outcome

    said = round_failing()
    assert f"a batch of {big + 1:,} records of 2 outbox transactions" in said, said
    assert f"outbox transaction {written.tx_id!r}" in said, said
    assert f"{big:,} records" in said, said
    assert "relay.kafka_transaction_timeout (1s)" in said, said
    sent_alone = next_round()
    assert isinstance(sent_alone, RelayRound), sent_alone
    assert sent_alone.delivered == 1  # the first transaction
    said = round_failing()
    assert f"outbox transaction {written.tx_id!r}" in said, said
    assert "in a batch of its own" in said, said
    assert REGISTRY.get_sample_value("outbox_relay_errors_total", counted) == counted_before + 2
    relay.stop(timeout=10)
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"before"]

    relay = relay_factory(kafka_transaction_timeout="PT60S")  # what the message says to do
    wait_for(lambda: relay.run_once() and not rows(pg_dsn), 120)
    copies = consume_all(kafka_bootstrap, topic, "read_committed")
    assert len(copies) == big + 2
    assert values(copies[:1]) == [b"before"]
    assert values(copies[-1:]) == [b"after"]


def test_a_statement_timeout_of_the_database_does_not_stop_a_backlog_draining(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A role's or database's statement_timeout cancelled the stamp of a backlog (a slice
    takes over a second by design) in every round: nothing drained, probes green."""
    topic = topic_factory()
    backlog = 60_000
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            records = [Record(topic, b"x", key=str(i % 50)) for i in range(backlog)]
            outbox.publish_many(conn, records)
        database = conn.info.dbname
        conn.execute(f"ALTER DATABASE \"{database}\" SET statement_timeout = '300ms'")
    relay = relay_factory()
    try:
        delivered = 0
        deadline = time.monotonic() + 120
        while delivered < backlog:
            assert time.monotonic() < deadline, f"{delivered} of {backlog} delivered"
            delivered += relay.run_once().delivered
    finally:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(f'ALTER DATABASE "{database}" RESET statement_timeout')
    assert rows(pg_dsn) == []


def test_ending_a_batch_slower_than_the_databases_statement_timeout_still_ends_it(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The end of a batch ran under a role's or database's statement_timeout: on a busy
    machine a 1000-row end took over 300 ms, was cancelled, and recovery's end, as large, could
    be too. Here every delete of ended rows takes 0.4 s (a trigger), over the 0.3 s timeout."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION slow_end() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(0.4); RETURN NULL; END $$"
        )
        conn.execute(
            "CREATE TRIGGER slow_end AFTER DELETE ON outbox.outbox_record "
            "FOR EACH STATEMENT EXECUTE FUNCTION slow_end()"
        )
        with conn.transaction():
            outbox.publish_many(conn, [Record(topic, b"x", key=str(i)) for i in range(20)])
        conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET statement_timeout = '300ms'")
    relay = relay_factory()
    try:
        deadline, failure = time.monotonic() + 30, None
        while rows(pg_dsn):  # a failed round goes again, as the relay's loop makes it
            assert time.monotonic() < deadline, f"the batch was never ended: {failure!r}"
            try:
                relay.run_once()
            except Exception as exc:
                failure = exc
    finally:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(f'ALTER DATABASE "{conn.info.dbname}" RESET statement_timeout')
    assert len(consume_all(kafka_bootstrap, topic, "read_committed")) == 20


def test_a_cut_listen_connection_does_not_leave_the_relay_deaf_for_a_poll_interval(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Its notifications lost with it, the relay waited out the whole poll interval before it
    looked for work or listened again; and what committed between the cut and the new LISTEN
    announced itself to nobody (a full suite's run met that gap)."""
    topic = topic_factory()
    relay = relay_factory(poll_interval="PT60S", heartbeat_interval="PT1S", lease_duration="PT5S")
    listening = relay._listening
    in_the_gap = threading.Event()

    def listening_again() -> Any:
        if relay._listen is None:  # after the cut: a commit lands before LISTEN takes effect
            with psycopg.connect(pg_dsn) as conn, conn.transaction():
                outbox.publish(conn, topic, "in the gap")
            in_the_gap.set()
        return listening()

    relay.start()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with conn.transaction():
            outbox.publish(conn, topic, "before")
        wait_for(lambda: not rows(pg_dsn), 30)  # woken by it: the relay listens, and waits
        relay._listening = listening_again
        listen_pid = relay._listen.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (listen_pid,))
    assert in_the_gap.wait(20), "the relay did not listen anew"
    wait_for(lambda: not rows(pg_dsn), 20)
    copies = consume_all(kafka_bootstrap, topic, "read_committed")
    assert values(copies) == [b"before", b"in the gap"]


def test_a_producer_fenced_while_it_waits_for_reports_is_told_fenced_and_recovers(
    kafka_bootstrap: str,
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka raises a fencing from flush() too: that one was counted as a Kafka error
    (kind kafka), not a fencing."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()
    begin = ShardProducer.begin

    def begin_then_fenced(producer: ShardProducer) -> None:
        begin(producer)
        heir = Producer(
            {"bootstrap.servers": kafka_bootstrap, "transactional.id": producer.transactional_id}
        )
        heir.init_transactions(30)  # a newer instance of the same transactional.id

    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "once")
    counted = {"kind": "fenced"}
    fenced_before = REGISTRY.get_sample_value("outbox_relay_errors_total", counted) or 0
    monkeypatch.setattr(ShardProducer, "begin", begin_then_fenced)
    with pytest.raises(Fenced):
        relay.run_once()
    assert REGISTRY.get_sample_value("outbox_relay_errors_total", counted) == fenced_before + 1
    monkeypatch.setattr(ShardProducer, "begin", begin)
    for w in relay.workers.values():
        w.retry_at = 0.0
    assert relay.run_once().delivered == 1  # the lease is still its own: a new producer goes on
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"once"]


def test_a_shard_whose_worker_cannot_be_built_is_handed_back(
    pg_dsn: str, relay_factory: Any
) -> None:
    """Its lease was taken before its worker failed to be built: held and renewed for ever by
    a relay that never delivered it, probes green, and no other relay could take it."""
    first = relay_factory()
    first.run_once()  # shard 0 recovered once: its marker partition recorded
    first.stop()
    relay = relay_factory()
    relay.setup()
    with psycopg.connect(pg_dsn) as conn:  # as another relay's other op_marker_partitions would
        conn.execute("UPDATE outbox.shard_lease SET marker_partition = 1")
    with pytest.raises(RuntimeError, match="op_marker_partitions must not change"):
        relay.heartbeat()
    assert relay.workers == {}
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT owner FROM outbox.shard_lease").fetchall() == [(None,)]


def test_a_relay_waiting_a_long_poll_interval_is_alive(relay_factory: Any) -> None:
    """Liveness allowed 120 s without a finished round, whatever the poll interval: with one
    above that, /healthz failed while the relay only waited for work. (And the longest Kafka
    commit: it blocks up to kafka_transaction_timeout, and the linger after a wake-up.)"""
    relay = relay_factory(
        poll_interval="PT150S", listen_notify=False, kafka_transaction_timeout="PT30S"
    )
    assert relay.stale_after_s() == 120 + 150 + 30
    lingering = relay_factory(poll_interval="PT1S", linger="PT300S")
    assert lingering.stale_after_s() == 120 + 1 + 300 + 60
    first_round = threading.Event()
    run_once = relay.run_once

    def round_then_say(**kwargs: Any) -> RelayRound:
        try:
            return run_once(**kwargs)
        finally:
            first_round.set()

    relay.run_once = round_then_say  # type: ignore[method-assign]
    relay.start()
    assert first_round.wait(60)  # its first round is over: then it waits up to 150 s
    relay.last_round_at = time.monotonic() - 150
    assert relay.alive()
    relay.last_round_at -= 160
    assert not relay.alive()


class _ReportsHeldBack:
    """A producer whose flush serves no delivery report for `seconds` once armed (a broker
    slow to acknowledge): the relay's wait for reports runs as it does then."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False
        self.until: float | None = None

    def wrap(self, producer: Producer) -> Any:
        held = self

        class Proxy:
            def __getattr__(self, name: str) -> Any:
                return getattr(producer, name)

            def flush(self, timeout: float = -1) -> int:
                if held.armed:
                    if held.until is None:
                        held.until = time.monotonic() + held.seconds
                    if time.monotonic() < held.until:
                        time.sleep(max(timeout, 0))
                        return 1  # still queued
                return producer.flush(timeout)

        return Proxy()


def hold_reports(monkeypatch: pytest.MonkeyPatch, seconds: float) -> _ReportsHeldBack:
    """Every shard producer's reports held back `seconds` once the result is armed."""
    held = _ReportsHeldBack(seconds)
    real = ShardProducer.producer
    monkeypatch.setattr(ShardProducer, "producer", property(lambda p: held.wrap(real.fget(p))))
    return held


def test_a_batch_slower_than_the_lease_keeps_its_shards_and_counts_as_progress(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing renewed the leases while a shard waited for Kafka's delivery reports: a batch
    slower than lease_duration let them lapse, another relay took the shards (and fenced the
    batch), and liveness saw no round finish. Now the wait renews the leases, and only them."""
    topic = topic_factory()
    held = hold_reports(monkeypatch, seconds=4.5)
    timing = {"lease_duration": "PT2S", "heartbeat_interval": "PT0.5S", "shards": 2}
    slow = relay_factory(relay_id="pod-a", **timing)
    slow.run_once()  # both shards, recovered
    assert sorted(slow.workers) == [0, 1]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with conn.transaction():
            outbox.publish(conn, topic, "slow to acknowledge", key="k")
        held.armed = True
        shipping = threading.Thread(target=slow.run_once)
        shipping.start()
        wait_for(lambda: held.until is not None)  # the batch waits for its reports
        leases = "SELECT max(lease_until) FROM outbox.shard_lease"
        (renewed_until,) = conn.execute(leases).fetchone()  # type: ignore[misc]
        # past the leases as they stood: lapsed by now, unless renewed while the batch waits
        wait_for(lambda: conn.execute("SELECT now() > %s", (renewed_until,)).fetchone()[0])  # type: ignore[index]
    joining = relay_factory(relay_id="pod-0", **timing)  # first by id: its share is 1 of 2
    joining.setup()
    joining.heartbeat()
    assert joining.workers == {}
    assert held.until is not None
    waiting_from = held.until - held.seconds
    assert slow.last_round_at > waiting_from + 1  # the wait counted as progress
    shipping.join(30)
    assert not shipping.is_alive()
    assert sorted(slow.workers) == [0, 1]
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert [m.value() for m in delivered] == [b"slow to acknowledge"]


def test_a_stop_aborts_a_batch_that_cannot_finish_within_the_grace(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop waited for the round in flight, whose wait for Kafka's reports may last the
    transaction timeout: the process exited with its Kafka transaction open, every partition it
    wrote stalled for read_committed consumers until the broker timed it out."""
    topic = topic_factory()
    held = hold_reports(monkeypatch, seconds=120)
    relay = relay_factory(kafka_transaction_timeout="PT120S")
    relay.run_once()
    aborts: list[float | None] = []
    abort = ShardProducer.abort

    def counted(producer: ShardProducer, timeout_s: float | None = None, *args: Any) -> None:
        aborts.append(timeout_s)
        abort(producer, timeout_s, *args)

    monkeypatch.setattr(ShardProducer, "abort", counted)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "in flight at the stop")
    held.armed = True
    relay.start()
    wait_for(lambda: held.until is not None)  # the batch waits for its reports
    asked = time.monotonic()
    relay.stop(service_module.STOP_RESERVE_S + 2)
    assert not relay.running()
    assert time.monotonic() - asked < service_module.STOP_RESERVE_S + 2
    assert aborts == [STOP_ABORT_S]  # aborted within the grace, not left open
    held.armed = False
    heir = relay_factory()
    assert heir.run_once().delivered == 1  # nothing pinned, nothing lost
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert [m.value() for m in delivered] == [b"in flight at the stop"]


def test_a_stop_cuts_short_a_recovery_stuck_behind_a_transaction_open_on_its_markers(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recovery reads its markers up to the log's end, waiting (up to the transaction
    timeout) for every transaction on the partition to be decided: a stop then waited too,
    past its grace, and the shards were not handed back."""
    topic = topic_factory()
    first = relay_factory(relay_id="relay-a")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "before")
    assert first.run_once().delivered == 1  # its markers' offset recorded
    first.stop()
    other = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic}-open"})
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(first.settings.relay.op_marker_topic, b"another producer's", partition=0)
    other.flush(30)  # open on the marker partition, after the recorded offset
    reading = threading.Event()
    read_markers = ShardWorker._read_markers

    def noted(worker: ShardWorker, *args: Any, **kwargs: Any) -> Any:
        reading.set()
        return read_markers(worker, *args, **kwargs)

    monkeypatch.setattr(ShardWorker, "_read_markers", noted)
    heir = relay_factory(relay_id="relay-b", kafka_transaction_timeout="PT60S")
    try:
        heir.start()
        assert reading.wait(30)  # its recovery reads up to the open transaction
        asked = time.monotonic()
        heir.stop(15)  # well under the transaction timeout (60 s) the old stop waited out
        assert not heir.running()
        assert time.monotonic() - asked < 15
        with psycopg.connect(pg_dsn) as conn:
            owners = conn.execute("SELECT owner FROM outbox.shard_lease").fetchall()
        assert owners == [(None,)]  # handed back
    finally:
        other.abort_transaction(30)


def test_a_stop_once_every_report_is_in_commits_the_batch(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stop's check before the commit ended the batch there, neither committed nor
    aborted: its transaction stayed open until the broker's timeout."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()
    reports = ShardProducer.reports

    def every_report_in_then_a_stop(
        p: ShardProducer, stalled: Any = None, waiting: Any = None
    ) -> Any:
        # every report in before the stop is seen: only the check before the commit meets it
        done = reports(p, stalled)
        relay._stop_by = time.monotonic()  # a stop with no grace left
        relay._stop.set()
        return done

    monkeypatch.setattr(ShardProducer, "reports", every_report_in_then_a_stop)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "reported before the stop")
    assert relay.run_once().delivered == 1
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert [m.value() for m in delivered] == [b"reported before the stop"]


def test_a_stop_during_a_round_starts_no_other_shards_batch_nor_takes_a_shard(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped while one shard shipped, the round went on to the others: each claimed and
    shipped a batch, or recovered (up to kafka_transaction_timeout each), and a stop in a
    Kafka incident overran its grace. Its heartbeats took shards only to hand them back."""
    topic = topic_factory(partitions=2)
    relay = relay_factory(shards=2)
    relay.run_once()  # both shards taken and recovered
    for key in (keys[0] for keys in keys_by_shard(pg_dsn, 2, 1)):
        publish_tx(pg_dsn, topic, key)
    shipped: list[int] = []
    deliver = ShardWorker.deliver_once

    def stopped_after_the_first(worker: ShardWorker, *args: Any, **kwargs: Any) -> Any:
        shipped.append(worker.shard)
        done = deliver(worker, *args, **kwargs)
        relay._stop.set()  # the SIGTERM, while this shard shipped
        return done

    monkeypatch.setattr(ShardWorker, "deliver_once", stopped_after_the_first)
    assert relay.run_once().delivered == 1
    assert len(shipped) == 1
    assert len(consume_all(kafka_bootstrap, topic, "read_committed")) == 1
    spare = same_settings_other_id(relay_factory, relay, "spare")
    relay.leases.leave(relay.conn)  # both shards free: the stopping spare takes neither
    spare._stop.set()
    spare.heartbeat()
    assert spare.workers == {}


def test_a_batch_failing_between_produce_and_commit_does_not_hold_back_its_partitions(
    kafka_bootstrap: str,
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shard's batch failed after its records were produced (here, an error of our own):
    its Kafka transaction was left open until the shard recovered, after its backoff, and
    meanwhile read_committed consumers saw nothing of its partition past it, the other
    shard's committed record included. It is aborted at once now."""
    topic = topic_factory(partitions=1)
    relay = relay_factory(shards=2)
    relay.run_once()  # both shards taken and recovered
    for key in (keys[0] for keys in keys_by_shard(pg_dsn, 2, 1)):
        publish_tx(pg_dsn, topic, key)
    failed: list[str] = []
    hit = shard_module._failpoints.hit

    def failing_once(name: str) -> None:
        hit(name)
        if name == shard_module._failpoints.AFTER_PRODUCE and not failed:
            failed.append(name)
            raise RuntimeError("a failure between produce and commit")

    monkeypatch.setattr(shard_module._failpoints, "hit", failing_once)
    assert relay.run_once().delivered == 1  # the other shard's
    assert failed
    assert len(consume_all(kafka_bootstrap, topic, "read_committed")) == 1
    for worker in relay.workers.values():
        worker.retry_at = 0.0  # its backoff, over
    assert relay.run_once().delivered == 1  # recovered, and sent again
    assert len(consume_all(kafka_bootstrap, topic, "read_committed")) == 2


def test_a_stop_during_a_backlogs_stamping_leaves_the_rest_of_it(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stamping of a backlog went on slice after slice after a stop: a million rows' took
    ~30 s, past the grace (found by a review)."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()
    with psycopg.connect(pg_dsn) as conn:
        for i in range(4):
            with conn.transaction():
                outbox.publish(conn, topic, f"v{i}")
    monkeypatch.setattr(service_module, "STAMP_SLICE", 1)
    keep_alive = relay._keep_alive

    def stopped_in_the_stamp() -> None:
        keep_alive()
        relay._stop.set()  # the SIGTERM, between two slices

    relay._keep_alive = stopped_in_the_stamp  # type: ignore[method-assign]
    relay._stamp_all_again()  # the next round stamps
    assert relay.run_once().delivered == 0
    with psycopg.connect(pg_dsn) as conn:
        unstamped = "SELECT count(*) FROM outbox.outbox_record WHERE commit_ts IS NULL"
        assert conn.execute(unstamped).fetchone()[0] >= 2  # type: ignore[index]


def test_recovery_skips_what_is_not_a_marker_on_the_marker_topic(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()  # the marker topic exists; shard 0 recovered up to its end
    (worker,) = relay.workers.values()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(relay.settings.relay.op_marker_topic, b"not a marker", partition=0)
    assert producer.flush(10) == 0
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after the stranger")
    worker.needs_recovery = True  # as after a failed round: it reads past the stranger
    assert relay.run_once().delivered == 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"after the stranger"]


def test_recovery_stops_at_a_marker_message_of_a_newer_relay_and_sends_nothing_again(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A rolling upgrade: a newer relay's markers (a later format) end a batch it committed
    in Kafka; an older relay that recovers the shard skipped them as not a relay's, and sent
    the batch again."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()  # the marker topic exists; shard 0 recovered up to its end
    (worker,) = relay.workers.values()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def newer_markers(**envelope: Any) -> None:
        newer = {"v": 3, "shard": worker.shard, "relay": "newer", "epoch": 9, **envelope}
        producer.produce(
            relay.settings.relay.op_marker_topic,
            json.dumps({**newer, "entries": []}).encode(),
            partition=worker.marker_partition,
        )
        assert producer.flush(10) == 0

    def errors(kind: str) -> float:
        return REGISTRY.get_sample_value("outbox_relay_errors_total", {"kind": kind}) or 0.0

    # another outbox's, on a marker topic shared by mistake: not this shard's business
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after another outbox's")
    newer_markers(outbox="elsewhere/outbox")
    foreign = errors("foreign_markers")
    worker.needs_recovery = True
    assert relay.run_once().delivered == 1
    assert errors("foreign_markers") == foreign + 1

    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "in doubt")
    newer_markers()  # this outbox's (a marker naming none is its own)
    too_new = errors("marker_too_new")
    worker.needs_recovery = True
    with pytest.raises(MarkerTooNew, match=r"format version 3.*upgraded"):
        relay.run_once()
    assert errors("marker_too_new") == too_new + 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        b"after another outbox's"
    ]
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]


def test_a_backlog_is_stamped_in_slices_with_heartbeats_between_and_keeps_commit_order(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import relay.service

    topic = topic_factory(partitions=2)
    with psycopg.connect(pg_dsn) as conn:
        for tx in range(10):
            with conn.transaction():
                outbox.publish(conn, topic, f"{tx}-a", key="a")
                outbox.publish(conn, topic, f"{tx}-b", key="b")
    monkeypatch.setattr(relay.service, "STAMP_SLICE", 3)
    r = relay_factory(batch_size=4)  # a backlog (more than a batch): stamped, not read unstamped
    beats = counting(r, "heartbeat")
    delivered = 0
    while (done := r.run_once()).delivered or done.full:
        delivered += done.delivered
    assert delivered == 20
    # a slice ends with a whole transaction: 3 rows reach into a second one, so 4 rows a slice
    assert len(beats) >= 1 + 20 // 4  # the round's own, then one between each full slice
    by_key: dict[bytes, list[bytes]] = {}
    for m in consume_all(kafka_bootstrap, topic, "read_committed"):
        by_key.setdefault(m.key() or b"", []).append(m.value() or b"")
    assert by_key == {
        b"a": [f"{tx}-a".encode() for tx in range(10)],
        b"b": [f"{tx}-b".encode() for tx in range(10)],
    }


def noting_stamps(dsn: str) -> Callable[[], int]:
    """A trigger notes each stamp (a row's commit time set while it is still committed; the end
    of a row changes its state too). Returns a function that counts them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE stamped (id bigint)")
        conn.execute(
            """
            CREATE FUNCTION note_stamp() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF OLD.commit_ts IS NULL AND NEW.commit_ts IS NOT NULL
                   AND NEW.state = 'committed' THEN
                    INSERT INTO stamped VALUES (NEW.id);
                END IF;
                RETURN NEW;
            END $$
            """
        )
        conn.execute(
            "CREATE TRIGGER note_stamp BEFORE UPDATE ON outbox.outbox_record"
            " FOR EACH ROW EXECUTE FUNCTION note_stamp()"
        )

    def count() -> int:
        with psycopg.connect(dsn) as conn:
            return conn.execute("SELECT count(*) FROM stamped").fetchone()[0]  # type: ignore[index]

    return count


def test_a_few_rows_go_out_unstamped_with_their_real_commit_times(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The usual round writes no stamp: the claim reads the few committed rows below the xid
    horizon with their commit times looked up, and they go out in commit order all the same."""
    topic = topic_factory()
    stamps = noting_stamps(pg_dsn)
    relay = relay_factory(delivered_retention="PT1H")
    assert relay.run_once().delivered == 0  # its first round stamps what there is: nothing
    with psycopg.connect(pg_dsn) as conn:
        for value in ("one", "two", "three"):
            with conn.transaction():
                outbox.publish(conn, topic, value, key="k")
    assert relay.run_once().delivered == 3
    assert stamps() == 0
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        b"one",
        b"two",
        b"three",
    ]
    with psycopg.connect(pg_dsn) as conn:
        kept = conn.execute(
            "SELECT id, commit_ts, pg_xact_commit_timestamp(committed_xid::xid)"
            " FROM outbox.outbox_record WHERE state = 'delivered' ORDER BY id"
        ).fetchall()
    assert len(kept) == 3
    assert all(commit_ts == real for _, commit_ts, real in kept)  # the end keeps the real one
    sent_at = {m.id: m.commit_ts for m in markers(kafka_bootstrap, relay)}
    assert [sent_at[row_id] for row_id, _, _ in kept] == [real for _, _, real in kept]


def test_a_backlog_of_more_than_a_batch_is_stamped(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """More than a batch a shard unstamped below the horizon: stamped, so that each claim
    reads an index in commit order instead of sorting the backlog."""
    topic = topic_factory()
    stamps = noting_stamps(pg_dsn)
    relay = relay_factory(batch_size=4)
    assert relay.run_once().delivered == 0  # its first round stamps what there is: nothing
    with psycopg.connect(pg_dsn) as conn:
        for n in range(6):
            with conn.transaction():
                outbox.publish(conn, topic, str(n), key="k")
    assert relay.run_once().delivered == 4  # read unstamped; 6 were, more than a batch
    assert stamps() == 0
    assert relay.run_once().delivered == 2
    assert stamps() == 2  # the 2 left, stamped first
    got = values(consume_all(kafka_bootstrap, topic, "read_committed"))
    assert got == [str(n).encode() for n in range(6)]


def test_a_stamp_waits_for_the_end_of_rows_claimed_unstamped(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Rows claimed unstamped are ended while the next round runs. A round that stamps must
    wait for that end first: its UPDATE would lock the same rows, in another order (deadlocks
    under load). Here the end is held up by a lock on one of its rows; the stamping round must
    not be found waiting for a lock in Postgres meanwhile."""
    topic = topic_factory()
    # No heartbeat in the stamping round: it waits for the lease, which the end holds locked
    # (a wait that cannot deadlock, and not the one looked for; once seen in a full run).
    r = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    assert r.run_once(pipelined=True).delivered == 0  # its first round stamps: nothing
    ids = []
    with psycopg.connect(pg_dsn) as conn:
        for value in ("a", "b", "c"):
            with conn.transaction():
                ids.append(outbox.publish(conn, topic, value, key=value))
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SELECT 1 FROM outbox.outbox_record WHERE id = %s FOR UPDATE", (ids[1],))
        assert r.run_once(pipelined=True).delivered == 3  # their end waits for the holder
        r._next_full_stamp = 0.0  # a stamp is due
        relay_pid = r.conn.info.backend_pid
        stamping = threading.Thread(target=r.run_once, kwargs={"pipelined": True})
        stamping.start()
        with psycopg.connect(pg_dsn, autocommit=True) as probe:
            deadline = time.monotonic() + 2  # a stamp that did not wait is blocked within this
            while time.monotonic() < deadline:
                (blocked,) = probe.execute(
                    "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (relay_pid,)
                ).fetchone()  # type: ignore[misc]
                assert blocked == 0, "the stamp ran while the end of the rows was held up"
                time.sleep(0.05)
        assert stamping.is_alive()  # waiting for the end, in the relay
        holder.commit()
        stamping.join(15)
        assert not stamping.is_alive()
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute("SELECT count(*) FROM outbox.outbox_record").fetchone()[0]  # type: ignore[index]
    assert left == 0
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"a", b"b", b"c"]


def _waiting_for_a_lock(probe: psycopg.Connection[Any], pid: int) -> bool:
    (waiting,) = probe.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
    ).fetchone()  # type: ignore[misc]
    return bool(waiting)


def test_a_stamp_gives_way_to_another_relays_end_that_locks_its_rows_in_another_order(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Another relay ends a transaction that spans shards, rows of this relay's shard among
    them, while this relay stamps: the stamp locks rows by transaction id, the end in its own
    order. Here the stamp holds X and wants Y, the end holds Y and wants X. Postgres would end
    one of them after deadlock_timeout (the end: it waited longer); the stamp gives up first
    and is made again, so the end goes through and the stamp after it."""
    topic = topic_factory()
    r = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    assert r.run_once().delivered == 0  # set up, its first stamp done
    ids = []
    with psycopg.connect(pg_dsn) as conn:
        for value in ("x", "y"):  # two transactions: X's transaction id is the lower
            with conn.transaction():
                ids.append(outbox.publish(conn, topic, value, key=value))
    x, y = ids
    waits_before = REGISTRY.get_sample_value("outbox_relay_stamp_lock_waits_total") or 0.0
    failed: list[BaseException] = []

    def catching(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                failed.append(exc)

        return run

    with (
        psycopg.connect(pg_dsn, autocommit=True) as probe,
        psycopg.connect(pg_dsn) as holder,
        psycopg.connect(pg_dsn) as ender,
    ):

        def other_relays_end() -> None:  # its statement, rows in the other order
            with ender.transaction():
                # The plan of a table with a backlog, not of these two rows: each row of the
                # batch looked up by its key in turn, and locked in the batch's order.
                ender.execute("SET LOCAL enable_seqscan = off")
                ender.execute("SET LOCAL enable_hashjoin = off")
                ender.execute("SET LOCAL enable_mergejoin = off")
                ender.execute(
                    outbox.sql.query("relay_delete_rows", "outbox"),
                    {"ids": [y, x], "states": ["committed", "committed"]},
                )

        holder.execute("SELECT 1 FROM outbox.outbox_record WHERE id = %s FOR UPDATE", (x,))
        r._next_full_stamp = 0.0  # a stamp is due
        stamping = threading.Thread(target=catching(r.run_once))
        ending = threading.Thread(target=catching(other_relays_end))
        try:
            stamping.start()
            wait_for(lambda: _waiting_for_a_lock(probe, r.conn.info.backend_pid))  # for X
            ending.start()
            wait_for(lambda: _waiting_for_a_lock(probe, ender.info.backend_pid))  # for X
            with pytest.raises(psycopg.errors.LockNotAvailable):  # and it has Y
                probe.execute(
                    "SELECT 1 FROM outbox.outbox_record WHERE id = %s FOR UPDATE NOWAIT", (y,)
                )
        finally:
            holder.rollback()  # the stamp takes X, and wants Y
        ending.join(15)
        stamping.join(15)
    assert not ending.is_alive()
    assert not stamping.is_alive()
    assert failed == []
    assert REGISTRY.get_sample_value("outbox_relay_stamp_lock_waits_total") > waits_before  # type: ignore[operator]
    assert rows(pg_dsn) == []  # ended by the other relay; stamped by none


def test_a_stamp_kept_from_a_row_for_long_fails_its_round_and_the_next_one_goes_through(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lock held long on a committed row (an operator's open transaction): the stamp tries a
    few times, then its round fails with the lock named, instead of waiting unseen; once the
    lock goes, the next round delivers."""
    import relay.service

    topic = topic_factory()
    r = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    assert r.run_once().delivered == 0
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        row_id = outbox.publish(conn, topic, "held", key="h")
    monkeypatch.setattr(relay.service, "STAMP_LOCK_ATTEMPTS", 2)
    waits = REGISTRY.get_sample_value("outbox_relay_stamp_lock_waits_total") or 0.0
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SELECT 1 FROM outbox.outbox_record WHERE id = %s FOR UPDATE", (row_id,))
        r._next_full_stamp = 0.0  # a stamp is due
        with pytest.raises(psycopg.errors.LockNotAvailable):
            r.run_once()
    assert REGISTRY.get_sample_value("outbox_relay_stamp_lock_waits_total") == waits + 1
    assert r.run_once().delivered == 1  # the lock is gone, and the connection was usable


def test_an_end_that_postgres_ends_to_break_a_deadlock_is_made_again(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Another session (as another relay's stamp would) holds Y and then wants X while this
    relay's end holds X and wants Y: Postgres ends the end, which waited longer. It is made
    again at once, instead of the shard recovering from its op markers."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # A waiter looks for a deadlock once, deadlock_timeout after it began to wait: the end's
        # look must come after the other session's wait closed the cycle, or the other's own
        # look, later, ends the other instead. The other asks for X as soon as the end waits
        # (below), with 5 s for the end's look instead of the default second.
        conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET deadlock_timeout = '5s'")
    topic = topic_factory()
    r = relay_factory(heartbeat_interval="PT60S", lease_duration="PT180S")
    assert r.run_once(pipelined=True).delivered == 0
    ids = []
    with psycopg.connect(pg_dsn) as conn:
        for value in ("x", "y"):
            with conn.transaction():
                ids.append(outbox.publish(conn, topic, value, key=value))
    x, y = ids
    deadlocks = REGISTRY.get_sample_value("outbox_relay_errors_total", {"kind": "end_deadlock"})
    failed: list[BaseException] = []
    with psycopg.connect(pg_dsn, autocommit=True) as probe, psycopg.connect(pg_dsn) as other:
        # The other looks for a deadlock long after the end does, whenever each began to wait:
        # the end's wait may begin anew (a lock it waited for a moment, then Y), and with the
        # same 5 s the other's look came first in a fresh-clone run, and ended the other.
        other.execute("SET LOCAL deadlock_timeout = '60s'")
        other.execute("SELECT 1 FROM outbox.outbox_record WHERE id = %s FOR UPDATE", (y,))

        def end_waits() -> bool:
            (waiting,) = probe.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE '%%DELETE FROM%%'"
            ).fetchone()  # type: ignore[misc]
            return bool(waiting)

        def take_x_once_the_end_waits() -> None:
            # Not after run_once returned: in a fresh-clone run it returned ~5 s after its end
            # began to wait, the end's one look found no cycle yet, and the other was ended.
            try:
                wait_for(end_waits)
                other.execute("SELECT 1 FROM outbox.outbox_record WHERE id = %s FOR UPDATE", (x,))
            except BaseException as exc:
                failed.append(exc)

        taking = threading.Thread(target=take_x_once_the_end_waits)
        taking.start()
        try:
            assert r.run_once(pipelined=True).delivered == 2  # their end waits for Y
            taking.join(30)
            assert not taking.is_alive()
        finally:
            other.rollback()
    assert failed == []  # the other session got X: Postgres ended the end
    worker = next(iter(r.workers.values()))
    worker.settle()  # raises if the end failed
    assert not worker.needs_recovery
    after = REGISTRY.get_sample_value("outbox_relay_errors_total", {"kind": "end_deadlock"})
    # Once, mostly; twice at times: the ended end's rows are free, but the other session must
    # wake to lock X, and the end made again can lock it first, closing the cycle once more
    # (a run of the relay tests saw 2). Either way it ended without a recovery, in its attempts.
    assert 1 <= (after or 0.0) - (deadlocks or 0.0) <= shard_module.END_DEADLOCK_ATTEMPTS - 1
    assert rows(pg_dsn) == []
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"x", b"y"]


def test_only_the_claim_is_planned_generically(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The claim runs with a generic plan (planned once a connection); the statements after it
    in its transaction get custom plans again, which see their key ranges: Postgres plans even
    an unprepared statement by plan_cache_mode."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "one", key="a")
    r = relay_factory()
    assert r.run_once().delivered == 1
    worker = next(iter(r.workers.values()))
    for _ in range(6):  # psycopg prepares a statement on its 5th run
        with pipelined_transaction(r.conn):
            claimed = worker._claim(r.conn, None, [], [])
            mode = r.conn.execute("SELECT current_setting('plan_cache_mode')")
        assert claimed.transactions == []
        assert mode.fetchone() == ("auto",)
    with r.conn.transaction():
        plans = r.conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE %s",
            ("%CROSS JOIN LATERAL%",),  # the claim's own text
        ).fetchall()
    assert len(plans) == 1
    generic, custom = plans[0]
    assert generic >= 1
    assert custom == 0  # never planned for its parameters


def _an_old_xid_then_first(pg_dsn: str, topic: str) -> str:
    """The xid of a transaction that commits nothing, then "first" published (key "a")."""
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            (old_xid,) = conn.execute("SELECT pg_current_xact_id()::text").fetchone()  # type: ignore[misc]
        with conn.transaction():
            outbox.publish(conn, topic, "first", key="a")
    return str(old_xid)


def test_a_stamp_slice_cut_short_by_a_row_ended_meanwhile_is_not_taken_for_the_last(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row deleted by another session (another relay ending its transaction) while a slice
    ran made the slice's count short of STAMP_SLICE: taken for the last slice, the rows above
    its bound stayed unstamped below `_stamped_below`, where no claim looks, and newer records
    of their keys went out before them (for up to a minute, until a full stamp)."""
    import relay.service

    monkeypatch.setattr(relay.service, "STAMP_SLICE", 5)
    topic = topic_factory()
    ids = []
    with psycopg.connect(pg_dsn) as conn:
        for i in range(12):
            with conn.transaction():
                ids.append(outbox.publish(conn, topic, f"v{i}", key=f"k{i}"))
    r = relay_factory()
    r.heartbeat()  # shard 0 is its own
    with psycopg.connect(pg_dsn) as other:
        other.execute("DELETE FROM outbox.outbox_record WHERE id = %s", (ids[1],))
        ended = threading.Timer(0.1, other.commit)  # while the first slice waits for its lock
        ended.start()
        try:
            r._stamp(r._stamp_params([0]))
        finally:
            ended.join()
    assert unstamped_count(pg_dsn) == 0


def test_a_complete_stamp_is_not_scanned_again_below_its_horizon_until_a_full_stamp(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """After a complete stamp, stamps and hold-backs look only above the horizon it started
    with (past the index entries of the rows stamped before). A row put back by hand with an
    old transaction id waits for the next stamp of every row: a minute at most, or a new
    database connection."""
    topic = topic_factory()
    old_xid = _an_old_xid_then_first(pg_dsn, topic)
    r = relay_factory()
    assert r.run_once().delivered == 1  # its first round: a complete stamp of every row
    assert int(r._stamped_below) > int(old_xid)

    def put_back_by_hand(value: str) -> None:  # as if committed by the old transaction
        with psycopg.connect(pg_dsn) as conn:
            with conn.transaction():
                row_id = outbox.publish(conn, topic, value, key="b")
            conn.execute(
                "UPDATE outbox.outbox_record SET committed_xid = %s::xid8 WHERE id = %s",
                (old_xid, row_id),
            )

    put_back_by_hand("by hand")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "second", key="a")
    assert r.run_once().delivered == 1  # "second": the old xid is below the stamped horizon
    assert r.run_once().delivered == 0
    r._next_full_stamp = 0.0  # as a minute later
    assert r.run_once().delivered == 1  # "by hand"
    assert r.run_once().delivered == 0  # nothing below the horizon is left unstamped
    put_back_by_hand("by hand again")
    assert r.run_once().delivered == 0
    r.conn.close()  # as a database restart would
    assert r.run_once().delivered == 1
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [b"first", b"second", b"by hand", b"by hand again"]


def test_a_row_stamped_before_where_the_claims_start_waits_for_the_next_stamp(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A usual round's claim starts past the transactions already sent (over the index entries
    of their ended rows). A row that a stamp puts before that point (here one put back by
    hand, stamped with an old commit time) is claimed by the next round that stamps, which
    starts from the first row."""
    topic = topic_factory()
    old_xid = _an_old_xid_then_first(pg_dsn, topic)
    r = relay_factory()
    assert r.run_once().delivered == 1  # a round that stamps
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "second", key="a")
    assert r.run_once().delivered == 1  # the usual round: later claims start past "second"
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            row_id = outbox.publish(conn, topic, "by hand", key="b")
        conn.execute(
            "UPDATE outbox.outbox_record SET committed_xid = %s::xid8,"
            " commit_ts = now() - interval '1 hour' WHERE id = %s",
            (old_xid, row_id),
        )
    assert r.run_once().delivered == 0  # before where the claim starts
    r._next_full_stamp = 0.0  # as a minute later: a round that stamps
    assert r.run_once().delivered == 1
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [b"first", b"second", b"by hand"]


def test_a_relay_that_gains_a_shard_stamps_its_rows_below_its_own_stamped_horizon(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A row of a shard another relay held, committed before this relay's last complete stamp,
    is below its stamped horizon, and unstamped: gaining the shard makes it look again."""
    from relay.sharding import shard_of

    topic = topic_factory()
    first, second = _two_relays_a_shard_each(relay_factory)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        row_id = outbox.publish(conn, topic, "left behind", key="x")
        ((key_hash, xid),) = conn.execute(
            "SELECT key_hash, committed_xid::text FROM outbox.outbox_record WHERE id = %s",
            (row_id,),
        ).fetchall()
    owner, other = (first, second) if shard_of(key_hash, 2) in first.workers else (second, first)
    assert other.run_once().delivered == 0  # not its shard; a complete stamp of its own
    assert int(other._stamped_below) > int(xid)
    owner.stop()  # never ran a round: hands its shard back with the row unstamped
    other.heartbeat()
    assert len(other.workers) == 2
    assert other.run_once().delivered == 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"left behind"]


def publish_one_by_one(pg_dsn: str, topic: str, values: list[str]) -> None:
    """Each value in a transaction of its own, in order, under one key."""
    with psycopg.connect(pg_dsn) as conn:
        for value in values:
            with conn.transaction():
                outbox.publish(conn, topic, value, key="k")


def test_a_drain_goes_on_without_stamping_while_nothing_is_left_unstamped(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    publish_one_by_one(pg_dsn, topic, [f"t{i}" for i in range(5)])
    r = relay_factory(batch_size=2)
    r._listening()  # as the loop does; the commits above notified before it listened
    stamps = counting(r, "_stamp")
    rounds = [r.run_once(pipelined=True) for _ in range(3)]
    assert [(x.delivered, x.full) for x in rounds] == [(2, True), (2, True), (1, False)]
    assert len(stamps) == 1  # the first round's; the next two followed a full one
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [f"t{i}".encode() for i in range(5)]


def test_a_row_committed_during_a_drain_goes_with_it_unstamped(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """After the first round's stamp, a drain's claims read what commits meanwhile unstamped:
    the new row goes with the drain, after the rows that committed before it."""
    topic = topic_factory()
    publish_one_by_one(pg_dsn, topic, [f"t{i}" for i in range(5)])
    r = relay_factory(batch_size=2)
    r._listening()
    stamps = counting(r, "_stamp")
    assert r.run_once(pipelined=True).full
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "late", key="k")
    rounds = [r.run_once(pipelined=True) for _ in range(3)]
    assert [(x.delivered, x.full) for x in rounds] == [(2, True), (2, True), (0, False)]
    assert len(stamps) == 1
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [*(f"t{i}".encode() for i in range(5)), b"late"]


def test_a_drain_holds_back_every_round_while_a_committed_row_is_above_the_horizon(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """`y` commits after `r1`, but below the xid horizon, which an open transaction holds
    above `r1`: `y` is stamped, `r1` not, and the hold-back keeps `y` back. The rounds that
    stamp nothing hold back by `r1` all the same: each claim finds it above its horizon."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn:
        for value in ("p1", "p2"):
            with conn.transaction():
                outbox.publish(conn, topic, value, key=value)
    with (
        psycopg.connect(pg_dsn) as y_conn,
        psycopg.connect(pg_dsn) as holder,
        psycopg.connect(pg_dsn) as conn,
    ):
        outbox.publish(y_conn, topic, "y", key="y")  # its transaction is older than the holder
        holder.execute("SELECT pg_current_xact_id()")
        with conn.transaction():
            outbox.publish(conn, topic, "r1", key="r1")
        y_conn.commit()
        r = relay_factory(batch_size=1)
        r._listening()  # nothing pending: every commit came before
        stamps = counting(r, "_stamp")
        rounds = [r.run_once(pipelined=True).delivered for _ in range(3)]
        assert rounds == [1, 1, 0]  # p1, p2; then `y` waits for `r1`
        assert len(stamps) == 1  # the first round's
        holder.commit()
    while r.run_once().delivered:
        pass
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [b"p1", b"p2", b"r1", b"y"]


def test_a_schema_with_capitals_is_migrated_once_and_wakes_its_relay(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_settings: Callable[..., SidecarSettings],
) -> None:
    """The migrations quote the schema's name, so LISTEN and the version look-up must too:
    unquoted, Postgres folds the name to lower case (a relay never woken, a version never seen)."""
    schema = "MyOutbox"
    assert outbox.migrate(pg_dsn, schema=schema).applied
    assert outbox.migrate(pg_dsn, schema=schema).applied == ()  # its version is seen
    topic = topic_factory()
    relay = Relay(relay_settings(schema_name=schema, poll_interval="PT20S"))
    try:
        relay.run_once()

        def write() -> None:
            time.sleep(1)
            with psycopg.connect(pg_dsn) as conn, conn.transaction():
                outbox.Outbox(schema_name=schema).publish(conn, topic, "v", key="k")

        writer = threading.Thread(target=write)
        writer.start()
        started = time.monotonic()
        relay._wait_for_work()  # a commit's NOTIFY wakes it, long before the 20 s poll
        assert time.monotonic() - started < 10
        writer.join()
        assert relay.run_once().delivered == 1
    finally:
        relay.stop(timeout=10)


def test_two_outboxes_sharing_an_op_marker_topic_end_only_their_own_rows(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_settings: Callable[..., SidecarSettings],
) -> None:
    """Markers named no outbox: on a marker topic two outboxes shared by mistake, one's
    recovery ended the other's rows of the same ids, which were then never sent."""
    assert outbox.migrate(pg_dsn, schema="other_outbox").applied
    mine_topic, theirs_topic = topic_factory(), topic_factory()
    mine = relay_settings(transactional_id_prefix=f"{mine_topic}-a")
    theirs = relay_settings(
        schema_name="other_outbox",
        transactional_id_prefix=f"{mine_topic}-b",
        op_marker_topic=mine.relay.op_marker_topic,
    )
    first = Relay(mine)
    first.run_once()  # recovered once: its offset in the marker partition is stored
    first.stop(timeout=10)  # down, with rows to send
    other = Relay(theirs)
    try:
        for schema, topic in (("outbox", mine_topic), ("other_outbox", theirs_topic)):
            with psycopg.connect(pg_dsn) as conn:
                for i in range(3):
                    with conn.transaction():
                        outbox.Outbox(schema_name=schema).publish(conn, topic, f"{schema}-{i}")
        assert other.run_once().delivered == 3  # ids 1..3 of its own, markers on the topic
    finally:
        other.stop(timeout=10)
    restarted = Relay(mine)
    try:
        assert restarted.run_once().delivered == 3  # none ended by the other's markers
    finally:
        restarted.stop(timeout=10)
    got = [m.value() for m in consume_all(kafka_bootstrap, mine_topic, "read_committed")]
    assert got == [b"outbox-0", b"outbox-1", b"outbox-2"]


def test_a_relay_refuses_a_schema_not_migrated_yet(pg_dsn: str, relay_factory: Any) -> None:
    with psycopg.connect(pg_dsn) as conn:  # as if the relay's newest migration had not run
        conn.execute(
            "DELETE FROM outbox.schema_migration WHERE version >= %s", (RELAY_SCHEMA_VERSION,)
        )
    with pytest.raises(
        RelayConfigError,
        match=f"needs {RELAY_SCHEMA_VERSION}: run `outboxctl migrate --schema outbox`",
    ):
        relay_factory().run_once()


def test_the_backlog_gauges_count_committed_rows_and_age_the_oldest_stamped_or_not(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with conn.transaction():
            a = outbox.publish(conn, topic, "a", key="a")
        with conn.transaction():
            b = outbox.publish(conn, topic, "b", key="b")
        with conn.transaction():  # not counted: rolled back
            gone = outbox.publish(conn, topic, "gone", key="c")
        conn.execute("UPDATE outbox.outbox_record SET state = 'rolled_back' WHERE id = %s", (gone,))
        r = relay_factory()

        def oldest_age_with(a_sql: str, b_sql: str) -> float:
            """The gauges after setting `a` and `b` so; both count, the age is returned."""
            conn.execute(f"UPDATE outbox.outbox_record SET {a_sql} WHERE id = %s", (a,))
            conn.execute(f"UPDATE outbox.outbox_record SET {b_sql} WHERE id = %s", (b,))
            r.refresh_gauges()
            assert REGISTRY.get_sample_value("outbox_relay_backlog_records") == 2
            age = REGISTRY.get_sample_value("outbox_relay_oldest_undelivered_seconds")
            assert age is not None
            return age

        # the oldest unstamped: its commit time, looked up; not state_changed_at, the start of
        # its transaction, which began an hour before it committed (just now)
        age = oldest_age_with(
            "commit_ts = NULL, state_changed_at = now() - interval '1 hour'",
            "commit_ts = now() - interval '10 minutes'",
        )
        assert 600 <= age < 700
        oldest = outbox_status(conn, "outbox")["oldest_undelivered"]  # `outboxctl status`'s
        assert datetime.now(UTC) - oldest < timedelta(minutes=11)
        # the oldest stamped: its commit time
        age = oldest_age_with(
            "commit_ts = now() - interval '2 hours'", "commit_ts = NULL, state_changed_at = now()"
        )
        assert 7200 <= age < 7300
        assert REGISTRY.get_sample_value("outbox_relay_parked_records") == 0
        conn.execute("UPDATE outbox.outbox_record SET state = 'delivered' WHERE id = %s", (a,))
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'parked', reason = 'too large' WHERE id = %s",
            (b,),
        )
        r.refresh_gauges()
        assert REGISTRY.get_sample_value("outbox_relay_backlog_records") == 0
        assert REGISTRY.get_sample_value("outbox_relay_oldest_undelivered_seconds") == 0
        # parked: out of the backlog, waiting for a redrive (the parked alert only says when
        # records were parked; this says how many still wait)
        assert REGISTRY.get_sample_value("outbox_relay_parked_records") == 1


def test_a_stop_during_a_gauges_refresh_cuts_it_short_and_closes_its_connection(
    pg_dsn: str, relay_factory: Any
) -> None:
    """The stop closed the gauges' connection while the gauges' thread read on it (counting a
    large backlog takes seconds): libpq's connection freed under a query in progress."""
    relay = relay_factory()
    relay.run_once()
    failed: list[Exception] = []

    def refresh() -> None:
        try:
            relay.refresh_gauges()
        except psycopg.Error as exc:
            failed.append(exc)

    def waiting_on_a_lock(admin: psycopg.Connection[Any], pid: int) -> bool:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        return row is not None and row[0] == "Lock"

    with (
        psycopg.connect(pg_dsn, autocommit=True) as admin,
        psycopg.connect(pg_dsn) as locker,
    ):
        locker.execute("LOCK TABLE outbox.outbox_record IN ACCESS EXCLUSIVE MODE")
        reading = threading.Thread(target=refresh)
        reading.start()
        wait_for(lambda: relay._gauge_conn is not None, 10)
        pid = relay._gauge_conn.info.backend_pid
        wait_for(lambda: waiting_on_a_lock(admin, pid), 10)
        relay.stop(timeout=10)
        reading.join(10)
        assert not reading.is_alive()
        # cut short by the stop: no error to log, and the stop's gauges stand (unknown)
        assert failed == []
        assert math.isnan(REGISTRY.get_sample_value("outbox_relay_backlog_records") or 0.0)
        assert relay._gauge_conn is None
        gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s"
        wait_for(lambda: admin.execute(gone, (pid,)).fetchone() == (True,), 10)
        relay.refresh_gauges()  # after the stop: nothing read, no connection made
        assert relay._gauge_conn is None


def test_one_relay_counts_the_backlog_for_the_gauges_on_a_connection_it_keeps(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Counting the backlog reads all of it: every pod of a deployment counted it every ten
    seconds, on a new connection each time. The live relay of the lowest id counts; the others
    say 0 (the dashboards and alerts take the max) until it is gone."""
    topic = topic_factory()
    first, second = relay_factory(relay_id="pod-a"), relay_factory(relay_id="pod-b")
    for relay in (first, second):
        relay.run_once()  # members now: their heartbeats are what the choice reads
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, [outbox.Record(topic, str(n), key=str(n)) for n in range(3)])

    def backlog(relay: Any) -> float | None:
        relay.refresh_gauges()
        return REGISTRY.get_sample_value("outbox_relay_backlog_records")

    assert backlog(first) == 3
    # what the relays' owned shards add up to, for the alert on shards without a relay
    assert REGISTRY.get_sample_value("outbox_relay_shards") == first.settings.relay.shards
    pid = first._gauge_conn.info.backend_pid
    parked = "outbox_relay_parked_records"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.outbox_record SET state = 'parked', reason = 'x' WHERE id = "
                     "(SELECT min(id) FROM outbox.outbox_record)")  # fmt: skip
    assert backlog(first) == 2
    assert REGISTRY.get_sample_value(parked) == 1
    assert backlog(second) == 0  # the gauges are this process's: the second's say 0
    assert REGISTRY.get_sample_value(parked) == 0
    assert backlog(first) == 2
    assert first._gauge_conn.info.backend_pid == pid  # kept, not one per refresh
    first.stop()  # it leaves: no longer a member
    assert backlog(second) == 2
    assert REGISTRY.get_sample_value(parked) == 1


def test_the_oldest_age_is_the_earliest_commit_whatever_the_transaction_ids(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Only the unstamped row of the lowest transaction id was looked at: one that committed
    after others hid them, and the age, and the lag alert, said less than the truth."""
    topic = topic_factory()
    relay = relay_factory()
    with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn) as second:
        outbox.publish(first, topic, "lower xid, committed last")  # its xid taken now
        with second.transaction():
            outbox.publish(second, topic, "higher xid, committed first")
        committed_first = time.monotonic()
        wait_for(lambda: time.monotonic() - committed_first > 0.5)
        first.commit()
    relay.refresh_gauges()
    age = REGISTRY.get_sample_value("outbox_relay_oldest_undelivered_seconds")
    assert age is not None
    assert age >= 0.5


def test_a_prepared_transaction_holding_the_horizon_shows_in_the_gauges_and_log(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A transaction prepared for two-phase commit has no session any more: the gauges said
    nothing held the horizon while delivery waited for it. Their pid is 0 for it: the log
    names it (nothing did, and an operator could not tell which transaction to end)."""
    monkeypatch.setattr(service_module, "HORIZON_WARN_S", 0.2)
    topic = topic_factory()
    relay = relay_factory()
    gid = f"held-{topic}"[:200]
    app = psycopg.connect(pg_dsn)
    app.tpc_begin(gid)
    app.execute("SELECT pg_current_xact_id()")
    app.tpc_prepare()
    app.close()  # prepared: it outlives its session
    try:
        with psycopg.connect(pg_dsn) as conn, conn.transaction():
            outbox.publish(conn, topic, "behind it")
        assert relay.run_once().delivered == 0  # held back by the prepared transaction

        def held() -> float:
            relay.refresh_gauges()
            return REGISTRY.get_sample_value("outbox_relay_horizon_held_seconds") or 0.0

        wait_for(lambda: held() > 0.2)
        assert REGISTRY.get_sample_value("outbox_relay_horizon_holder_pid") == 0
        relay.refresh_gauges()  # said once
        said = [r.getMessage() for r in caplog.records if "xid horizon" in r.getMessage()]
        assert len(said) == 1, said
        assert f"the prepared transaction '{gid}'" in said[0]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"ROLLBACK PREPARED '{gid}'")
    assert relay.run_once().delivered == 1
    relay.refresh_gauges()
    assert REGISTRY.get_sample_value("outbox_relay_horizon_held_seconds") == 0


def test_the_horizon_gauges_work_for_a_role_that_cannot_see_when_the_holder_began(
    pg_dsn: str,
    granted_roles: GrantedRoles,  # first: its roles outlive the relay, which is stopped before
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Any,
) -> None:
    """pg_stat_activity hides another role's xact_start from a role without pg_read_all_stats,
    as the example grants make the relay's: the age came back None, every refresh failed, and
    the alert on outbox_relay_horizon_held_seconds could never fire."""
    r = relay_factory(as_role(relay_settings(), granted_roles.dsn(granted_roles.relay)))

    def held() -> float:
        r.refresh_gauges()
        return REGISTRY.get_sample_value("outbox_relay_horizon_held_seconds") or 0.0

    with psycopg.connect(pg_dsn) as app:  # the application's long transaction, another role
        app.execute("SELECT pg_current_xact_id()")

        def holder() -> float | None:
            held()
            return REGISTRY.get_sample_value("outbox_relay_horizon_holder_pid")

        # awaited: the holder is the cluster's oldest transaction, and an autovacuum's analyze
        # of another test's database may be older for a moment
        wait_for(lambda: holder() == app.info.backend_pid)
        first = held()
        wait_for(lambda: held() > first + 0.2)  # counted from when the relay first saw it
        app.rollback()
    wait_for(lambda: held() == 0.0)
    assert REGISTRY.get_sample_value("outbox_relay_horizon_holder_pid") == 0


def test_a_relay_refuses_a_schema_migrated_by_another_build(
    pg_dsn: str, relay_factory: Any
) -> None:
    with psycopg.connect(pg_dsn) as conn:  # the newest version's number, another migration
        conn.execute(
            "UPDATE outbox.schema_migration SET name = 'elsewhere' WHERE version = (SELECT"
            " max(version) FROM outbox.schema_migration)"
        )
    with pytest.raises(RelayConfigError, match="applied by another build"):
        relay_factory().run_once()


def test_a_relay_with_another_shard_count_refuses_to_start(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "v", key="k")
    first = relay_factory(shards=2)
    assert first.run_once().delivered == 1
    with pytest.raises(
        RelayConfigError, match="made for 2 shards, this relay is configured with 4"
    ):
        relay_factory(shards=4).run_once()
    first.stop(timeout=10)  # the documented way: every relay stopped, then the leases deleted
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM outbox.shard_lease")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "w", key="k")
    assert relay_factory(shards=4).run_once().delivered == 1


def test_a_new_lease_does_not_take_markers_already_in_its_partition_for_its_own(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    transactional_producer: Any,
) -> None:
    """A marker partition outlives lease rows (they are made anew for a new shard count) and is
    shared by shards: what is in it before a lease first recovers is not that lease's. Taking
    such a marker for its own would end a row that never went out."""
    topic, marker_topic = topic_factory(), topic_factory(partitions=1)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        row_id = outbox.publish(conn, topic, "v", key="k")
    stale = marker_entry(
        Op.DELIVERED, id=row_id, tx_id="tx", producer_group="default", topic=topic, key=b"k",
        partition=0, offset=0, commit_ts=None, reason=None,
    )  # fmt: skip
    transactional_producer.begin_transaction()
    for value in marker_messages([stale], shard=0, relay="an earlier relay", epoch=1):
        transactional_producer.produce(marker_topic, value, b"0", partition=0)
    transactional_producer.commit_transaction(30)
    relay = relay_factory(op_marker_topic=marker_topic, op_marker_partitions=1)
    assert relay.run_once().delivered == 1
    assert [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")] == [b"v"]


def test_a_relay_without_a_shard_stays_alive(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """More relays than shards is safe: a spare one waits for a shard, and its liveness probe
    must not restart it meanwhile."""
    holder = relay_factory(shards=1)
    holder.run_once()
    spare = same_settings_other_id(relay_factory, holder, "spare")
    spare.last_round_at -= 1000  # as if its last round were long ago
    assert spare.run_once().shards == 0
    assert time.monotonic() - spare.last_round_at < 60  # what alive() judges a running relay by


def test_a_relay_whose_database_is_down_stays_alive_while_it_tries_again(
    relay_settings: Callable[..., SidecarSettings], relay_factory: Any
) -> None:
    """Failed rounds did not count: through a database outage the liveness probe restarted
    the relay every few minutes, which brings no database back, and crash-loop backoff then
    delayed it once the database was back."""
    settings = relay_settings()
    gone = SecretStr("host=127.0.0.1 port=1 dbname=gone connect_timeout=1")
    relay = relay_factory(
        settings.model_copy(update={"database": settings.database.model_copy(update={"dsn": gone})})
    )
    relay.last_round_at -= 1000  # as if it had not finished a round for long
    relay.start()
    wait_for(lambda: time.monotonic() - relay.last_round_at < 60)
    assert relay.alive()


def test_leases_are_renewed_between_shards_of_one_round(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """One shard's round can take long (a recovery, a slow commit): the others' leases must not
    lapse meanwhile."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(20):  # keys over both shards
            outbox.publish(conn, topic, f"v{i}", key=f"k{i}")
    r = relay_factory(shards=2)
    r.run_once()  # takes both shards
    assert len(r.workers) == 2
    beats = counting(r, "heartbeat")
    r._heartbeat_due = lambda: True  # type: ignore[method-assign]  # as if each shard was slow
    r.run_once()
    assert len(beats) == 1 + 2  # the round's own, then one before each shard
    assert len(r.workers) == 2


def test_a_transaction_larger_than_a_stamp_slice_is_stamped_whole(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import relay.service

    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            for i in range(5):
                outbox.publish(conn, topic, f"big-{i}", key="k")
        with conn.transaction():
            outbox.publish(conn, topic, "after", key="k")
    monkeypatch.setattr(relay.service, "STAMP_SLICE", 2)
    r = relay_factory()
    delivered = 0
    while (done := r.run_once()).delivered or done.full:
        delivered += done.delivered
    assert delivered == 6
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [f"big-{i}".encode() for i in range(5)] + [b"after"]


def same_settings_other_id(relay_factory: Any, relay: Relay, relay_id: str) -> Relay:
    """Another relay of the same outbox, as another pod's sidecar would be."""
    settings = relay.settings
    relay_settings = settings.relay.model_copy(update={"relay_id": relay_id})
    return relay_factory(settings.model_copy(update={"relay": relay_settings}))  # type: ignore[no-any-return]


def _two_relays_a_shard_each(relay_factory: Any) -> tuple[Relay, Relay]:
    # Rounds driven by hand, one relay at a time: with the 15 s lease, a slow machine (one
    # relay's setup took 11 s in a CI run) let the idle one's lapse, and the other took its
    # shard mid-test.
    first = relay_factory(shards=2, lease_duration="PT2M")
    second = same_settings_other_id(relay_factory, first, "second")
    for r in (first, second, first, second):  # the first takes both, hands one back
        r.heartbeat()
    assert {len(first.workers), len(second.workers)} == {1}
    return first, second


def test_a_transaction_across_shards_goes_once_whole_from_its_home_shard(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The relay of the other shard runs first, while the home shard's rows are not stamped:
    it must wait, not send its part alone (a split transaction, or, racing the home relay that
    sends it whole, the same records twice)."""
    from relay.sharding import shard_of

    topic = topic_factory(partitions=2)
    first, second = _two_relays_a_shard_each(relay_factory)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        ids = [outbox.publish(conn, topic, f"v{i}", key=f"k{i}") for i in range(12)]
        hashes = dict(
            conn.execute(
                "SELECT id, key_hash FROM outbox.outbox_record WHERE id = ANY(%s)", (ids,)
            ).fetchall()
        )
    home = shard_of(hashes[min(ids)], 2)
    assert {shard_of(h, 2) for h in hashes.values()} == {0, 1}
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    other = by_shard[1 - home]
    assert other.run_once().delivered == 0  # the home shard's rows are not stamped yet
    assert by_shard[home].run_once().delivered == 12
    assert other.run_once().delivered == 0
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert sorted(values(delivered)) == sorted(f"v{i}".encode() for i in range(12))
    marked = [m for m in markers(kafka_bootstrap, first) if m.id in hashes]
    assert sorted(m.id for m in marked) == sorted(ids)
    assert {m.shard for m in marked} == {home}  # one relay, one Kafka transaction


def test_a_later_transaction_not_stamped_yet_does_not_hold_the_home_shard_back(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    from relay.sharding import shard_of

    topic = topic_factory(partitions=2)
    first, second = _two_relays_a_shard_each(relay_factory)
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            ids = [outbox.publish(conn, topic, f"t{i}", key=f"k{i}") for i in range(12)]
            rows_ = conn.execute(
                "SELECT id, key_hash, key FROM outbox.outbox_record WHERE id = ANY(%s)", (ids,)
            ).fetchall()
        home = shard_of(min(rows_)[1], 2)
        other_key = next(bytes(k) for _, h, k in rows_ if shard_of(h, 2) != home)
        with conn.transaction():  # later, only in the other shard, which nobody stamped yet
            outbox.publish(conn, topic, "later", key=other_key)
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    assert by_shard[home].run_once().delivered == 12
    # the other shard's rows of it went unstamped, with the transaction's commit time
    sent = {m.commit_ts for m in markers(kafka_bootstrap, first) if m.id in ids}
    assert len(sent) == 1
    assert None not in sent
    assert by_shard[1 - home].run_once().delivered == 1
    same_key = [
        m.value()
        for m in consume_all(kafka_bootstrap, topic, "read_committed")
        if m.key() == other_key
    ]
    assert len(same_key) == 2
    assert same_key[-1] == b"later"  # after the earlier transaction's record of the key


def keys_by_shard(dsn: str, shards: int, per_shard: int) -> list[list[str]]:
    """Keys whose records land in each shard, `per_shard` of each (hashed as publish() does)."""
    from relay.sharding import shard_of

    found: list[list[str]] = [[] for _ in range(shards)]
    with psycopg.connect(dsn) as conn:
        for i in range(1000):
            key = f"key-{i}"
            (key_hash,) = conn.execute(
                "SELECT hashtextextended(encode(convert_to(%s, 'UTF8'), 'hex'), 0)", (key,)
            ).fetchone()  # type: ignore[misc]
            if len(found[shard_of(key_hash, shards)]) < per_shard:
                found[shard_of(key_hash, shards)].append(key)
            if all(len(keys) == per_shard for keys in found):
                return found
    raise AssertionError("not enough keys for every shard")


def publish_tx(dsn: str, topic: str, *keys: str) -> None:
    """One outbox transaction, a record per key in this order (the first is its home shard's)."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        for key in keys:
            outbox.publish(conn, topic, f"{key}@{time.monotonic_ns()}", key=key)


def by_key(bootstrap: str, topic: str) -> dict[bytes, list[bytes]]:
    got: dict[bytes, list[bytes]] = {}
    for m in consume_all(bootstrap, topic, "read_committed"):
        got.setdefault(m.key() or b"", []).append(m.value() or b"")
    return got


def test_transactions_across_shards_whose_home_shards_alternate_go_in_one_round(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Each shard sends those of its home and holds back the others' behind their keys only: a
    shard that stopped at the first transaction of another home sent one transaction a round,
    and a load of such transactions crawled at a few a second."""
    topic = topic_factory()
    a, b = keys_by_shard(pg_dsn, 2, 4)
    for i in range(4):  # homes 0, 1, 0, 1; no key in two transactions
        publish_tx(pg_dsn, topic, *((a[i], b[i]) if i % 2 == 0 else (b[i], a[i])))
    relay = relay_factory(shards=2)
    relay.heartbeat()
    assert sorted(relay.workers) == [0, 1]
    assert relay.run_once().delivered == 8
    assert sum(map(len, by_key(kafka_bootstrap, topic).values())) == 8
    marked = markers(kafka_bootstrap, relay)
    assert len({(m.shard, m.id) for m in marked}) == 8


def test_what_another_shard_of_the_relay_committed_in_kafka_is_not_waited_for_until_it_ends(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Rows another shard of the same relay committed in Kafka are out, their end pending or
    not: waiting for that end cost a round per transaction spanning shards, and a load of
    small ones drained at a tenth of its rate (bench/spanning.py)."""
    topic = topic_factory()
    (a_key,), (b_key,) = keys_by_shard(pg_dsn, 2, 1)
    relay = relay_factory(shards=2)
    relay.heartbeat()
    assert sorted(relay.workers) == [0, 1]
    relay.run_once(pipelined=True)  # set up, recovered, stamped: the next rounds stamp nothing
    publish_tx(pg_dsn, topic, a_key)  # shard 0's alone
    publish_tx(pg_dsn, topic, b_key, a_key)  # home 1, after the first on a_key
    publish_tx(pg_dsn, topic, a_key)  # shard 0's alone, after the second
    gate = threading.Event()
    assert relay.ender is not None
    relay.ender.submit(lambda _conn: gate.wait(30))  # the ends wait behind it
    try:
        # shard 0 sends the first (the second is shard 1's, the third waits behind it); shard
        # 1 sends the second, the first's end still waiting
        assert relay.run_once(pipelined=True).delivered == 3
        # shard 0 leaves out the second, its rows still there: the third goes (its commit
        # waits for the first's end, so the gate opens there)
        shard_0 = relay.workers[0]
        settle = shard_0._settle_before_commit
        shard_0._settle_before_commit = lambda: (gate.set(), settle())  # type: ignore[method-assign]
        assert relay.run_once(pipelined=True).delivered == 1
    finally:
        gate.set()
    relay.run_once()  # the ends settled
    got = by_key(kafka_bootstrap, topic)[a_key.encode()]
    assert len(got) == 3
    assert got == sorted(got, key=lambda v: int(v.split(b"@")[1]))  # in commit order
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute("SELECT count(*) FROM outbox.outbox_record WHERE topic = %s", (topic,))
        assert left.fetchone() == (0,)


def test_a_key_s_later_transaction_goes_once_its_earlier_one_s_record_is_parked(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A batch parks its poison before its Kafka commit: the key's later records, in another
    shard, go without waiting for that batch's end. (Parked by the end, a row of an end that
    failed stayed committed, and went later after its key's next record; so the other shard
    held them back until the end.)"""
    topic = topic_factory(partitions=1)
    (a_key,), (b_key,) = keys_by_shard(pg_dsn, 2, 1)
    relay = relay_factory(shards=2)
    relay.heartbeat()
    relay.run_once(pipelined=True)  # set up, recovered, stamped: the next rounds stamp nothing
    with psycopg.connect(pg_dsn) as conn, conn.transaction():  # home 0
        outbox.publish(conn, topic, "T-a", key=a_key)
        outbox.publish(conn, topic, "T-b", key=b_key, partition=1)  # no partition 1: parked
    publish_tx(pg_dsn, topic, b_key)  # shard 1's alone, after T on b_key
    gate = threading.Event()
    assert relay.ender is not None
    relay.ender.submit(lambda _conn: gate.wait(30))
    try:
        went = relay.run_once(pipelined=True)
        assert (went.delivered, went.held_back) == (2, False)  # T-a, and the last: T-b parked
    finally:
        gate.set()
    relay.run_once()
    got = by_key(kafka_bootstrap, topic)
    assert got[a_key.encode()] == [b"T-a"]
    assert [v.split(b"@")[0] for v in got[b_key.encode()]] == [b_key.encode()]
    with psycopg.connect(pg_dsn) as conn:
        parked = conn.execute("SELECT value FROM outbox.outbox_record WHERE state = 'parked'")
        assert parked.fetchall() == [(b"T-b",)]


def test_a_transaction_waits_for_an_earlier_one_of_its_key_until_its_record_is_parked(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """As above, from the other side: the home shard of a later transaction of the key waits
    for the earlier one's record to be parked, not for that one's end."""
    topic = topic_factory(partitions=1)
    (a_key, _), (b_key, b2_key) = keys_by_shard(pg_dsn, 2, 2)
    relay = relay_factory(shards=2)
    relay.heartbeat()
    relay.run_once(pipelined=True)  # set up, recovered, stamped: the next rounds stamp nothing
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():  # shard 1's alone
            outbox.publish(conn, topic, "P-b2", key=b2_key)
            outbox.publish(conn, topic, "P-b", key=b_key, partition=1)  # no partition 1: parked
        with conn.transaction():  # home 0, after the first on b_key
            outbox.publish(conn, topic, "T-a", key=a_key)
            outbox.publish(conn, topic, "T-b", key=b_key)
    gate = threading.Event()
    assert relay.ender is not None
    relay.ender.submit(lambda _conn: gate.wait(30))
    try:
        assert relay.run_once(pipelined=True).delivered == 1  # P-b2 (P-b parked); T waited
        went = relay.run_once(pipelined=True)
        assert (went.delivered, went.held_back) == (2, False)  # P's end still waits
    finally:
        gate.set()
    relay.run_once()
    assert by_key(kafka_bootstrap, topic)[b_key.encode()] == [b"T-b"]


def test_an_earlier_row_of_its_key_in_another_shard_holds_a_transaction_back_others_do_not(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    first, second = _two_relays_a_shard_each(relay_factory)
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    (a1, a2), (b_shared, b_other) = keys_by_shard(pg_dsn, 2, 2)
    publish_tx(pg_dsn, topic, b_shared)  # only in shard 1, which has not sent it yet
    publish_tx(pg_dsn, topic, a1, b_other)  # home 0: nothing earlier of its keys
    publish_tx(pg_dsn, topic, a2, b_shared)  # home 0: waits for the first
    assert by_shard[0].run_once().delivered == 2
    assert by_shard[1].run_once().delivered == 1
    assert by_shard[0].run_once().delivered == 2
    got = by_key(kafka_bootstrap, topic)
    assert [v.split(b"@")[0] for v in got[b_shared.encode()]] == [b_shared.encode()] * 2
    assert got[b_shared.encode()] == sorted(
        got[b_shared.encode()], key=lambda v: int(v.split(b"@")[1])
    )


def test_a_transaction_held_back_for_another_shard_holds_back_later_ones_of_its_keys(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    first, second = _two_relays_a_shard_each(relay_factory)
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    (a_shared, a_other), (b1, _) = keys_by_shard(pg_dsn, 2, 2)
    publish_tx(pg_dsn, topic, b1, a_shared)  # home 1: shard 0 holds it back
    publish_tx(pg_dsn, topic, a_shared)  # shard 0's alone, but after the first on its key
    publish_tx(pg_dsn, topic, a_other)  # shard 0's alone, no key of a held-back one
    assert by_shard[0].run_once().delivered == 1
    assert by_shard[1].run_once().delivered == 2
    assert by_shard[0].run_once().delivered == 1
    got = by_key(kafka_bootstrap, topic)[a_shared.encode()]
    assert len(got) == 2
    assert got == sorted(got, key=lambda v: int(v.split(b"@")[1]))  # in commit order


def test_a_claim_after_a_round_that_held_back_reads_less_and_goes_again_at_once_if_cut_short(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A round that held transactions back makes the next claim read fewer rows (see
    ShardWorker._next_claim_limit); a claim cut short by that must say more is waiting, or the
    rest of a backlog would wait for the poll interval."""
    from relay.shard import MIN_CLAIM_LIMIT

    topic = topic_factory()
    first, second = _two_relays_a_shard_each(relay_factory)
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    (a_key, other_key), (b_key, _) = keys_by_shard(pg_dsn, 2, 2)
    publish_tx(pg_dsn, topic, b_key, a_key)  # home 1: shard 0 holds it back
    publish_tx(pg_dsn, topic, other_key)  # goes: the round sends little, and holds back
    behind = MIN_CLAIM_LIMIT + MIN_CLAIM_LIMIT // 2
    with psycopg.connect(pg_dsn) as conn:
        for i in range(behind):  # shard 0's alone, each behind the first on its key
            with conn.transaction():
                outbox.publish(conn, topic, f"{a_key}#{i}", key=a_key)
    held = by_shard[0].run_once()
    assert (held.delivered, held.held_back) == (1, True)
    assert by_shard[1].run_once().delivered == 2
    cut = by_shard[0].run_once()
    assert (cut.delivered, cut.held_back, cut.full) == (MIN_CLAIM_LIMIT, False, True)
    rest = by_shard[0].run_once()  # the claim grows again: the rest at once
    assert (rest.delivered, rest.full) == (behind - MIN_CLAIM_LIMIT, False)
    got = by_key(kafka_bootstrap, topic)[a_key.encode()]
    assert [v.split(b"@")[0] for v in got[1:]] == [f"{a_key}#{i}".encode() for i in range(behind)]


def test_a_short_claim_filled_by_held_back_transactions_reads_on_to_the_other_keys(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """After a round that held back and sent little, the next claim reads fewer rows (see
    ShardWorker._next_claim_limit). When the held-back ones filled it, a commit of another key
    behind them was never read while they waited (for another relay's large transaction, or
    one dead until its lease expires), though nothing held it back."""
    from relay.shard import MIN_CLAIM_LIMIT

    topic = topic_factory()
    first, second = _two_relays_a_shard_each(relay_factory)
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    (a_key, other_key, more_key), (b_key, _, _) = keys_by_shard(pg_dsn, 2, 3)
    publish_tx(pg_dsn, topic, b_key, a_key)  # home 1: shard 0 holds it back
    publish_tx(pg_dsn, topic, other_key)
    with psycopg.connect(pg_dsn) as conn:
        for i in range(MIN_CLAIM_LIMIT + 10):  # each behind the first on its key
            with conn.transaction():
                outbox.publish(conn, topic, f"{a_key}#{i}", key=a_key)
    held = by_shard[0].run_once()  # sent little, held back: the next claim reads less
    assert (held.delivered, held.held_back) == (1, True)
    publish_tx(pg_dsn, topic, more_key)  # held back by nothing, behind those held back
    cut = by_shard[0].run_once()  # filled by those held back: it reads further at once
    assert (cut.delivered, cut.held_back, cut.full) == (0, True, True)
    further = by_shard[0].run_once()
    assert (further.delivered, further.held_back) == (1, True)
    assert len(by_key(kafka_bootstrap, topic)[more_key.encode()]) == 1
    # Sent little again, so read less again, and further at once; then, read to the end
    # with all of it held back, it waits (not full), and reads as far the next time.
    settling = [by_shard[0].run_once() for _ in range(3)]
    assert [(r.delivered, r.held_back, r.full) for r in settling] == [
        (0, True, True),
        (0, True, False),
        (0, True, False),
    ]


def test_a_shard_backing_off_goes_again_when_its_backoff_ends(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """One shard's failure backs it off alone (the other shards go on, and the round
    succeeds). Its records then waited for the next wake-up or the poll interval (60 s here),
    not for the end of its backoff (0.5 s): their commits' wake-ups had been spent."""
    topic = topic_factory()
    (a_key,), (b_key,) = keys_by_shard(pg_dsn, 2, 1)
    relay = relay_factory(shards=2, poll_interval="PT60S")
    relay.run_once()
    assert sorted(relay.workers) == [0, 1]
    worker = relay.workers[0]
    deliver_once, failures = worker.deliver_once, []

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(time.monotonic())
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "the broker went (test)"))
        return deliver_once(*args, **kwargs)

    worker.deliver_once = fails_once  # type: ignore[method-assign]
    for key in (a_key, b_key):
        publish_tx(pg_dsn, topic, key)
    relay.start()
    wait_for(lambda: not rows(pg_dsn), timeout=30)
    assert time.monotonic() - failures[0] < 15


def test_a_relay_takes_a_shard_it_gains_between_rounds_at_once(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A shard gained by a heartbeat while waiting for work (its relay stopped) went on
    waiting for a wake-up or the poll interval (60 s here): its records' wake-ups had come
    before, to a relay that could not take them."""
    topic = topic_factory()
    owner = relay_factory(poll_interval="PT60S", heartbeat_interval="PT0.2S")
    owner.run_once()
    assert owner.workers
    spare = same_settings_other_id(relay_factory, owner, "spare")
    spare.start()
    wait_for(lambda: spare._leases_renewed_at > 0)  # its first heartbeat: it has no shard
    publish_tx(pg_dsn, topic, "k")  # wakes the spare, which has no shard
    owner.stop(timeout=10)  # hands its shard back, its record not sent
    stopped = time.monotonic()
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]
    wait_for(lambda: not rows(pg_dsn), timeout=30)
    assert time.monotonic() - stopped < 15
    assert spare.workers


def test_records_batched_with_one_the_broker_refuses_go_again_at_once(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The broker refused one record of a batch and the client purged the others with it: the
    round aborted, marked the refused one to go alone, and said nothing was waiting. The
    others then waited for a wake-up or the poll interval (60 s here), and again after the
    refused one was parked (its dead-letter copy and marker)."""
    topic = topic_factory(config={"max.message.bytes": "2000"})
    with psycopg.connect(pg_dsn) as conn:
        for i in range(5):
            with conn.transaction():
                outbox.publish(conn, topic, "x" * 5000 if i == 2 else f"fits {i}", key=f"k{i}")
    relay = relay_factory(poll_interval="PT60S")
    started = time.monotonic()
    relay.start()
    # the others delivered (gone), the refused one parked with its marker written (ended)
    wait_for(lambda: [r[1:4:2] for r in rows(pg_dsn)] == [("parked", True)], timeout=30)
    assert time.monotonic() - started < 15


def _two_relays_polling_every_30s(relay_factory: Any, **relay: Any) -> tuple[Relay, Relay]:
    first = relay_factory(shards=2, poll_interval="PT30S", **relay)
    second = same_settings_other_id(relay_factory, first, "second")
    for r in (first, second, first, second):  # the first takes both, hands one back
        r.heartbeat()
    return first, second


def record_rounds(relay: Relay) -> list[Any]:
    """What each round of the relay returns, once it is started."""
    rounds: list[Any] = []
    run_once = relay.run_once
    relay.run_once = lambda **kw: rounds.append(run_once(**kw)) or rounds[-1]  # type: ignore[method-assign]
    return rounds


@pytest.mark.parametrize("listen_notify", [True, False], ids=["woken-by-its-end", "polling"])
def test_a_running_relay_held_back_for_another_relay_goes_on_soon_after_that_one_sends(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    listen_notify: bool,
) -> None:
    """No application's commit announces what another relay sends. With listen_notify, that
    relay's end wakes it: polling, it waited twice as long each round that sent nothing, and two
    relays drained small transactions spanning their shards 5x slower than one. Without, it
    polls soon, not after its (here long) poll interval."""
    if listen_notify:
        monkeypatch.setattr(service_module, "HELD_BACK_POLL_S", 30.0)  # no poll comes in time
    topic = topic_factory()
    first, second = _two_relays_polling_every_30s(relay_factory, listen_notify=listen_notify)
    by_shard = {next(iter(r.workers)): r for r in (first, second)}
    (a_key,), (b_key,) = keys_by_shard(pg_dsn, 2, 1)
    publish_tx(pg_dsn, topic, b_key, a_key)  # home 1
    publish_tx(pg_dsn, topic, a_key)  # shard 0's, behind the first
    waiting, sending = by_shard[0], by_shard[1]
    rounds = record_rounds(waiting)
    waiting.start()
    wait_for(lambda: any(r.held_back for r in rounds))
    assert sending.run_once().delivered == 2
    wait_for(lambda: len(consume_all(kafka_bootstrap, topic, "read_committed")) == 3, 10)


def test_a_relay_holding_nothing_back_is_not_woken_by_ends_its_own_or_another_relays(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Only one that holds a transaction back waits for them: a round after each batch of any
    relay would find nothing, and with 10 relays nearly doubled the idle ones' claims."""
    topic = topic_factory()
    first, second = _two_relays_polling_every_30s(relay_factory)
    keys = keys_by_shard(pg_dsn, 2, 1)
    (own,), (others,) = keys[next(iter(first.workers))], keys[next(iter(second.workers))]
    rounds = record_rounds(first)
    first.start()
    wait_for(lambda: len(rounds) == 1)  # its first round, then it waits: nothing to send
    publish_tx(pg_dsn, topic, own)  # the commit wakes it
    wait_for(lambda: sum(r.delivered for r in rounds) == 1)
    with psycopg.connect(pg_dsn) as conn:
        publish_tx(pg_dsn, topic, others)  # wakes it too: a round that finds nothing
        wait_for(lambda: len(rounds) == 3)
        assert second.run_once().delivered == 1  # the other relay's end
        wait_for(  # both ends are done: the rows are gone
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM outbox.outbox_record WHERE topic = %s", (topic,)
                ).fetchone()
                == (0,)
            )
        )
    time.sleep(1)  # a wake-up by either end would be a round now, not in 30 s
    assert len(rounds) == 3


def test_two_running_relays_keep_commit_order_per_key_across_shards(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Transactions of 3 keys out of 8, each spanning both shards, their homes in turn, while
    two relays with a shard each run: every record once, each key's records in commit order."""
    topic = topic_factory(partitions=3)
    a, b = keys_by_shard(pg_dsn, 2, 4)
    first, second = _two_relays_a_shard_each(relay_factory)
    for r in (first, second):
        r.start()
    sent: dict[bytes, list[bytes]] = {}
    with psycopg.connect(pg_dsn) as conn:
        for i in range(120):
            keys = [a[i % 4], b[i % 3], a[(i + 1) % 4]] if i % 2 else [b[i % 4], a[i % 3]]
            with conn.transaction():
                for key in keys:
                    value = f"{key}#{i}".encode()
                    outbox.publish(conn, topic, value, key=key)
                    sent.setdefault(key.encode(), []).append(value)
    total = sum(map(len, sent.values()))
    wait_for(lambda: len(consume_all(kafka_bootstrap, topic, "read_committed")) >= total, 60)
    assert by_key(kafka_bootstrap, topic) == sent


def test_one_shard_in_trouble_backs_off_alone_the_others_go_on(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    from confluent_kafka import KafkaError, KafkaException

    from relay.sharding import shard_of

    topic = topic_factory()
    relay = relay_factory(shards=2)
    relay.heartbeat()
    assert sorted(relay.workers) == [0, 1]
    with psycopg.connect(pg_dsn) as conn:
        for i in range(10):
            with conn.transaction():
                outbox.publish(conn, topic, f"v{i}", key=f"k{i}")
        shards = [
            shard_of(h, 2)
            for (h,) in conn.execute("SELECT key_hash FROM outbox.outbox_record").fetchall()
        ]
    troubled = relay.workers[0]

    def no_leader(*args: Any, **kwargs: Any) -> Any:
        raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT, "no leader"))

    troubled.deliver_once = no_leader  # type: ignore[method-assign]
    before = time.monotonic()
    assert relay.run_once().delivered == shards.count(1)  # shard 1 goes on
    assert troubled.needs_recovery
    assert troubled.failures == 1
    assert troubled.retry_at >= before + 0.5  # it backs off alone
    relay.workers[1].retry_at = time.monotonic() + 60  # as if in trouble too
    troubled.retry_at = 0.0
    with pytest.raises(KafkaException):  # nothing went: the round fails, and the loop waits
        relay.run_once()


def test_a_relay_that_lost_its_lease_parks_nothing(pg_dsn: str, relay_factory: Any) -> None:
    from relay.shard import LeaseLost

    old = relay_factory(lease_duration="PT1S")
    old.run_once()  # owns shard 0
    time.sleep(1.5)  # its lease expires; it does not know yet
    heir = same_settings_other_id(relay_factory, old, "heir")
    heir.heartbeat()  # takes shard 0
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, "no.such.topic", "the heir's to park")
    (stale,) = old.workers.values()
    heir._stamp(heir._stamp_params([0]))  # the old one stamps shards of its own only
    with pytest.raises(LeaseLost):
        stale.deliver_once(old.conn, None)
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]


def unstamped_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT count(*) FROM outbox.outbox_record"
            " WHERE state = 'committed' AND commit_ts IS NULL"
        ).fetchone()
    assert got is not None
    return int(got[0])


@pytest.mark.parametrize("how", ["taken_over", "handed_over"])
def test_a_relay_stamps_no_shard_it_no_longer_holds(
    pg_dsn: str, relay_factory: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A stamp went on stamping, slice after slice, a shard its relay handed over between two
    slices, or lost while paused: rows of its new owner's came into that owner's claims past
    the hold-back its own stamp had found, and went out before older rows of their keys."""
    import relay.service

    old = relay_factory(lease_duration="PT1S")
    old.run_once()  # owns shard 0
    params = old._stamp_params([0])  # as its round took them, before the stamp
    with psycopg.connect(pg_dsn) as conn:
        for i in range(3):
            with conn.transaction():
                outbox.publish(conn, "orders", f"v{i}", key=f"k{i}")
    if how == "taken_over":
        time.sleep(1.5)  # its lease expires; it does not know yet
        heir = same_settings_other_id(relay_factory, old, "heir")
        heir.heartbeat()  # takes shard 0
        left = 3  # it stamps nothing
    else:  # its heartbeat between two slices hands the shard back
        monkeypatch.setattr(relay.service, "STAMP_SLICE", 1)
        monkeypatch.setattr(old, "_keep_alive", lambda: old.leases.release(old.conn, 0))
        left = 2  # the first slice only, while the shard was its own
    old._stamp(params)
    assert unstamped_count(pg_dsn) == left


def test_the_archive_is_trimmed_after_its_retention_parked_rows_stay(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(5):
            outbox.publish(conn, topic, f"v{i}")
        outbox.publish(conn, "no.such.topic", "poison")
    relay = relay_factory(delivered_retention="PT1H")
    relay.run_once()
    relay.run_once()  # the parked record's dead-letter copy and marker
    assert sorted(r[1] for r in rows(pg_dsn)) == ["delivered"] * 5 + ["parked"]
    assert relay.trim_archive() == 0  # nothing is an hour old yet
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE outbox.outbox_record SET ended_at = ended_at - interval '2 hours'"
            " WHERE id IN (SELECT id FROM outbox.outbox_record ORDER BY id LIMIT 3)"
            " OR state = 'parked'"
        )
    assert relay.trim_archive(limit=2, budget_s=0) == 2  # one slice, then the budget is spent
    assert relay.trim_archive(limit=2) == 1  # slices until none is left
    assert relay.trim_archive() == 0
    assert sorted(r[1] for r in rows(pg_dsn)) == ["delivered"] * 2 + ["parked"]


def test_a_trim_passes_over_archived_rows_another_session_holds(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The trim waited for every row lock in its slice, with no statement timeout: another
    relay's trim, or an operator's transaction on an archived row, held the relay's round."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(4):
            outbox.publish(conn, topic, f"v{i}")
    relay = relay_factory(delivered_retention="PT1H")
    relay.run_once()
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE outbox.outbox_record SET ended_at = ended_at - interval '2 hours'")
    held_id = min(r[0] for r in rows(pg_dsn))
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SELECT FROM outbox.outbox_record WHERE id = %s FOR UPDATE", (held_id,))
        trimmed: list[int] = []
        trim = threading.Thread(target=lambda: trimmed.append(relay.trim_archive()), daemon=True)
        trim.start()
        trim.join(15)
        blocked = trim.is_alive()
        holder.rollback()  # lets a blocked trim end
        trim.join(15)
    assert not blocked, "the trim waited for the row the other session held"
    assert trimmed == [3]
    assert [r[0] for r in rows(pg_dsn)] == [held_id]  # trimmed by a later round


@pytest.mark.parametrize("listen_notify", [True, False])
def test_the_running_relay_wakes_on_commit_or_polls(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    listen_notify: bool,
) -> None:
    topic = topic_factory()
    # With LISTEN the poll interval is long: only the notification can wake it in time.
    poll = "PT30S" if listen_notify else "PT0.1S"
    relay = relay_factory(listen_notify=listen_notify, poll_interval=poll)
    relay.start()
    wait_for(lambda: relay.workers and (relay._listen is not None or not listen_notify))
    started = time.monotonic()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "wake up")
    wait_for(lambda: not rows(pg_dsn), timeout=40)  # sent and ended
    assert time.monotonic() - started < 20  # well before the 30 s poll interval
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"wake up"]
    stopping = time.monotonic()
    relay.stop(20)
    assert time.monotonic() - stopping < 15  # never kept waiting for the long poll interval
    relay.stop(10)  # a second stop is harmless


def test_relays_gone_for_a_day_are_forgotten(pg_dsn: str, relay_factory: Any) -> None:
    """A killed relay never leaves: its member row stayed for ever, one per pod restart."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "INSERT INTO outbox.relay_member (relay_id, heartbeat_at, expires_at) VALUES"
            " ('gone', now() - interval '2 days', now() - interval '2 days'),"
            " ('recent', now() - interval '1 hour', now() - interval '1 hour')"
        )
    relay = relay_factory()
    relay.run_once()
    with psycopg.connect(pg_dsn) as conn:
        members = conn.execute("SELECT relay_id FROM outbox.relay_member ORDER BY 1").fetchall()
    assert members == sorted([("recent",), (relay.relay_id,)])


def test_an_archive_turned_off_is_trimmed_too(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """With delivered_retention 0 the trim did not run at all: the rows an archive kept
    before it was turned off stayed for ever."""
    topic = topic_factory()
    with psycopg.connect(pg_dsn) as conn:
        for value in ("a", "b"):
            with conn.transaction():
                outbox.publish(conn, topic, value)
        with conn.transaction():
            parked = outbox.publish(conn, "no.such.topic", "parked")
    archiving = relay_factory(delivered_retention="PT1H")
    assert (archiving.run_once().delivered, archiving.run_once().ended) == (2, 1)
    archiving.stop()
    assert len(rows(pg_dsn)) == 3
    assert relay_factory(delivered_retention="PT0S").trim_archive() == 2
    assert [r[0] for r in rows(pg_dsn)] == [parked]  # parked rows stay, as always


def test_discarded_transactions_reach_the_dead_letter_topic_with_a_marker(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """The checker's discard (state discarded, reason) is shipped by the relay."""
    topic = topic_factory()
    written = discarded(pg_dsn, topic, "a", "b")
    relay = relay_factory()
    assert relay.run_once().ended == 2
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert values(dead) == [b"a", b"b"]
    assert {dict(m.headers() or [])["outbox-reason"] for m in dead} == {b"max checks (15)"}
    assert consume_all(kafka_bootstrap, topic, "read_committed") == []
    assert sorted(
        m.id for m in markers(kafka_bootstrap, relay) if m.op.value == "discarded"
    ) == list(written.ids)
    assert rows(pg_dsn) == []


def test_a_dead_letter_topic_deleted_under_the_relay_is_made_again_and_no_copy_is_lost(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    relay_factory: Any,
) -> None:
    """A copy the dead-letter topic refused for what the topic is (missing, no ACL) was made
    smaller and smaller, then not sent at all: the discarded row ended without it, and its
    payload was gone from Postgres and Kafka alike."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()  # set up: the dead-letter topic is made
    dead_letter = relay.settings.relay.dead_letter_topic
    kafka_admin.delete_topics([dead_letter])[dead_letter].result(30)
    wait_for(lambda: dead_letter not in kafka_admin.list_topics(timeout=10).topics)
    discarded(pg_dsn, topic, "payment-42")
    with pytest.raises(DeadLetterUnwritable, match="dead-letter topic"):
        relay.run_once()
    assert [r[1] for r in rows(pg_dsn)] == ["discarded"]  # kept: never ended without its copy
    # Meanwhile the shard's other records go: only the rows that need a copy wait.
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "other key", key="other")
    (worker,) = relay.workers.values()
    worker.retry_at = 0.0  # the shard's backoff: the test goes again at once
    assert relay.run_once().delivered == 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"other key"]
    assert [r[1] for r in rows(pg_dsn) if r[1] != "delivered"] == ["discarded"]

    def copied() -> bool:
        worker.retry_at = worker._dead_letter_blocked_until = 0.0  # tried again at once
        try:
            return bool(relay.run_once().ended == 1)
        except DeadLetterUnwritable:  # made again, not yet known to the producer
            return False

    wait_for(copied, 60)
    (copy,) = consume_all(kafka_bootstrap, dead_letter, "read_committed")
    assert copy.value() == b"payment-42"
    assert dict(copy.headers() or [])["outbox-reason"] == b"max checks (15)"
    assert [m.op.value for m in markers(kafka_bootstrap, relay)] == ["delivered", "discarded"]


def rearm_or_resolve(dsn: str, action: str, tx_id: str) -> str:
    """An operator's re-arm, or commit by hand, of a discarded transaction: "done", or why not."""
    from checker import rearm, resolve

    with psycopg.connect(dsn) as conn:
        try:
            if action == "rearm":
                rearm(conn, "default", tx_id, actor="ops")
            else:
                resolve(conn, "default", tx_id, "COMMIT", actor="ops", reason="it was paid")
        except IllegalTransitionError as exc:
            return str(exc)
    return "done"


@pytest.mark.parametrize("retention", ["PT0S", "PT1H"])
@pytest.mark.parametrize("action", ["rearm", "resolve"])
def test_a_discarded_record_the_relay_is_shipping_is_neither_rearmed_nor_resolved(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    retention: str,
    action: str,
) -> None:
    """The relay holds no row lock while a discarded transaction's dead-letter copy is in its
    Kafka transaction: a re-arm or resolve then went through, and the record went out twice,
    as a dead-letter copy and to its topic. The relay marks the rows it takes; both refuse them."""
    topic = topic_factory()
    relay = relay_factory(delivered_retention=retention)
    relay.run_once()  # set up, shard 0 taken: nothing to ship yet
    (worker,) = relay.workers.values()
    written = discarded(pg_dsn, topic, "late but wanted")
    commit = worker.producer.commit
    said: list[str] = []

    def changed_meanwhile(*waiting: Any) -> float:
        said.append(rearm_or_resolve(pg_dsn, action, written.tx_id))
        return commit(*waiting)

    worker.producer.commit = changed_meanwhile  # type: ignore[method-assign]
    assert relay.run_once().ended == 1  # the dead-letter copy and its marker
    worker.producer.commit = commit  # type: ignore[method-assign]
    (refusal,) = said
    assert "taken by the relay to ship to the dead-letter topic (1 since" in refusal
    assert relay.run_once().delivered == 0
    assert consume_all(kafka_bootstrap, topic, "read_committed") == []
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert values(dead) == [b"late but wanted"]
    assert [m.op.value for m in markers(kafka_bootstrap, relay)] == ["discarded"]
    kept = [(state, ended) for _, state, _, ended, *_ in rows(pg_dsn)]
    assert kept == ([] if retention == "PT0S" else [("discarded", True)])


def test_a_claim_that_ships_discarded_rows_waits_for_an_end_whatever_the_roles_lock_timeout(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    relay_settings: Callable[..., SidecarSettings],
) -> None:
    """The claim's shipping mark takes the lease's share lock, which the end of the shard's batch
    before holds until it commits (seconds, for a large one): a role's lock_timeout failed the
    claim there. Here another session holds the lease's lock, as an end does, past it."""
    topic = topic_factory()
    impatient = make_conninfo(pg_dsn, options="-c lock_timeout=100ms")
    # no heartbeat in the timed round: its renewal would wait for the lock first
    settings = relay_settings(heartbeat_interval="PT60S", lease_duration="PT180S")
    relay = relay_factory(as_role(settings, impatient))
    relay.run_once()  # set up, shard 0 taken
    written = discarded(pg_dsn, topic, "a")
    done: list[RelayRound] = []
    with psycopg.connect(pg_dsn) as end:
        end.execute("SELECT 1 FROM outbox.shard_lease WHERE shard = 0 FOR UPDATE")
        round_ = threading.Thread(target=lambda: done.append(relay.run_once()))
        round_.start()

        def marking_waits() -> bool:  # the one session here that can wait for a lock
            row = end.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
            return bool(row and row[0])

        wait_for(marking_waits)
        round_.join(0.5)  # five times the role's lock_timeout
        assert round_.is_alive()
    round_.join(30)
    assert [r.ended for r in done] == [1]
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert values(dead) == [b"a"]
    assert [m.id for m in markers(kafka_bootstrap, relay)] == list(written.ids)


def test_a_relay_started_before_the_shipping_claims_migration_marks_once_it_ran(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Started on a schema without shipping_since, the relay said so and never marked until
    restarted: a migration run while it ran left operators' re-arms racing its copies."""
    with psycopg.connect(pg_dsn) as conn:  # as if migration 0010 had not run yet
        conn.execute(
            "DELETE FROM outbox.schema_migration WHERE version = %s", (SHIPPING_CLAIM_VERSION,)
        )
    topic = topic_factory()
    relay = relay_factory()
    with caplog.at_level(logging.WARNING, logger="relay.service"):
        relay.run_once()
    assert "shipped without being marked as taken" in caplog.text
    (worker,) = relay.workers.values()
    assert not worker.marks_shipping
    with psycopg.connect(pg_dsn) as conn:  # now it runs (the column is there already)
        conn.execute(
            "INSERT INTO outbox.schema_migration (version, name) VALUES (%s, 'shipping_claim')",
            (SHIPPING_CLAIM_VERSION,),
        )
    relay.run_once()  # the test relays' heartbeat interval is 0: checked again at once
    written = discarded(pg_dsn, topic, "marked at last")
    commit = worker.producer.commit
    said: list[str] = []

    def rearmed_meanwhile(*waiting: Any) -> float:
        said.append(rearm_or_resolve(pg_dsn, "rearm", written.tx_id))
        return commit(*waiting)

    worker.producer.commit = rearmed_meanwhile  # type: ignore[method-assign]
    assert relay.run_once().ended == 1
    (refusal,) = said
    assert "taken by the relay" in refusal


def test_a_discarded_record_is_not_taken_while_the_dead_letter_topic_is_backed_off(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """Its copy cannot go then: marked anyway, it was refused to operators (re-arm, resolve)
    for as long as the topic refused copies, though the relay did not ship it."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()
    (worker,) = relay.workers.values()
    written = discarded(pg_dsn, topic, "kept for the operator")
    worker._dead_letter_blocked_until = time.monotonic() + 60
    assert relay.run_once().ended == 0
    assert shipping_since(pg_dsn, written.tx_id) is None
    assert rearm_or_resolve(pg_dsn, "rearm", written.tx_id) == "done"
    worker._dead_letter_blocked_until = 0.0
    assert relay.run_once().ended == 0  # prepared again: nothing to end
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert dead == []


@pytest.mark.parametrize("how", ["rearmed", "locked"])
def test_a_discarded_record_an_operator_changes_as_the_relay_takes_it_is_not_shipped(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """Between the claim's read of a discarded row and its mark: re-armed (committed), the
    relay leaves it to go out as what it became; locked by a command still deciding, the
    relay neither waits for it nor ships it in that round."""
    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()
    (worker,) = relay.workers.values()
    written = discarded(pg_dsn, topic, "changed in time")
    taken = worker._taken
    holder = psycopg.connect(pg_dsn)
    let_go = threading.Timer(20, holder.rollback)  # if the mark waited for the lock

    def changed_first(conn: Any, ended: list[Any]) -> list[Any]:
        if how == "rearmed":
            assert rearm_or_resolve(pg_dsn, "rearm", written.tx_id) == "done"
        else:  # held until after the mark
            holder.execute("SELECT 1 FROM outbox.outbox_record FOR UPDATE").fetchall()
            let_go.start()
        return taken(conn, ended)

    monkeypatch.setattr(worker, "_taken", changed_first)
    try:
        assert relay.run_once().ended == 0
    finally:
        let_go.cancel()
        holder.rollback()
        holder.close()
    monkeypatch.setattr(worker, "_taken", taken)
    dead_letter = relay.settings.relay.dead_letter_topic
    assert consume_all(kafka_bootstrap, dead_letter, "read_committed") == []
    if how == "locked":  # still discarded, and shipped by the next round
        assert relay.run_once().ended == 1
        assert values(consume_all(kafka_bootstrap, dead_letter, "read_committed")) == [
            b"changed in time"
        ]
        return
    assert [state for _, state, *_ in rows(pg_dsn)] == ["prepared"]
    with psycopg.connect(pg_dsn) as conn:
        outbox.commit(conn, written.tx_id)
    assert relay.run_once().delivered == 1
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"changed in time"]
    assert [m.op.value for m in markers(kafka_bootstrap, relay)] == ["delivered"]


def test_a_relay_that_lost_its_lease_does_not_fence_the_new_owner(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    from relay.shard import LeaseLost

    topic = topic_factory()
    old = relay_factory(lease_duration="PT1S")
    old.run_once()  # owns shard 0
    time.sleep(1.5)  # its lease expires; it does not know yet
    heir = same_settings_other_id(relay_factory, old, "heir")
    heir.run_once()  # takes shard 0 (same transactional.id), fencing the old producer
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after the hand-over")
    (stale,) = old.workers.values()
    stale.needs_recovery = True  # e.g. after an error: it would re-initialise its producer
    with pytest.raises(LeaseLost):
        stale.deliver_once(old.conn, None)
    assert heir.run_once().delivered == 1  # the heir was not fenced by the stale relay
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"after the hand-over"]


def test_a_relay_that_lost_its_lease_does_not_mark_the_heirs_discarded_records(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """A claim marks the discarded records it takes to ship (re-arm and resolve refuse them
    from then on). A relay whose lease was taken marked the heir's, after the heir's recovery
    had unmarked them: refused to operators until the heir shipped them (found by a review)."""
    from relay.shard import LeaseLost

    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()  # owns shard 0
    written = discarded(pg_dsn, topic, "the heir's to ship")
    with psycopg.connect(pg_dsn) as conn:  # taken meanwhile; the relay does not know yet
        conn.execute("UPDATE outbox.shard_lease SET owner = 'heir', epoch = epoch + 1")
    (stale,) = relay.workers.values()
    with pytest.raises(LeaseLost):
        stale.deliver_once(relay.conn, None)
    assert shipping_since(pg_dsn, written.tx_id) is None
    assert rearm_or_resolve(pg_dsn, "rearm", written.tx_id) == "done"
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert dead == []


def test_a_fenced_producer_whose_lease_is_still_ours_recovers_instead_of_idling(
    pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    """As when the coordinator aborts a transaction that outran its timeout: Kafka bumps the
    epoch, the lease in Postgres stays ours."""
    from relay.kafka import Fenced

    topic = topic_factory()
    relay = relay_factory()
    relay.run_once()  # shard 0 ours, its producer ready
    (worker,) = relay.workers.values()
    commit = worker.producer.commit

    def fenced_first(*waiting: Any) -> float:
        worker.producer.commit = commit  # type: ignore[method-assign]
        intruder = Producer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "transactional.id": worker.producer.transactional_id,
            }
        )
        intruder.init_transactions(30)  # a newer epoch: ours is fenced, its transaction aborted
        return commit(*waiting)

    worker.producer.commit = fenced_first  # type: ignore[method-assign]
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "after the fencing")
    with pytest.raises(Fenced):
        relay.run_once()  # its one shard failed: the loop would back off
    assert relay.workers == {0: worker}  # not dropped: its lease is still ours
    assert worker.needs_recovery
    worker.retry_at = 0.0  # past its back-off
    assert relay.run_once().delivered == 1  # a new producer, fencing the intruder in turn
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"after the fencing"]


def test_a_producer_setting_the_broker_refuses_for_good_stops_the_relay_saying_what_to_change(
    relay_settings: Callable[..., SidecarSettings], relay_factory: Any
) -> None:
    settings = relay_settings()
    # above the broker's transaction.max.timeout.ms (15 min by default)
    kafka = settings.kafka.model_copy(update={"extra": {"transaction.timeout.ms": 960_000}})
    relay = relay_factory(settings.model_copy(update={"kafka": kafka}))
    with pytest.raises(RelayConfigError, match=r"must not exceed the broker's transaction\.max"):
        relay.run_once()  # the loop stops on it, and the process exits 1


def test_the_delivery_lag_is_observed_once_a_transaction_from_its_database_commit(
    pg_dsn: str, topic_factory: Callable[..., str], relay_factory: Any
) -> None:
    topic = topic_factory()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with conn.transaction():
            late = outbox.publish(conn, topic, "committed two minutes ago", key="a")
        with conn.transaction():
            outbox.publish_many(conn, [Record(topic, f"v{i}", key=f"k{i}") for i in range(3)])
        conn.execute(
            "UPDATE outbox.outbox_record SET commit_ts = now() - interval '2 minutes'"
            " WHERE id = %s",
            (late,),
        )

    def sample(suffix: str, **labels: str) -> float:
        name = f"outbox_relay_delivery_lag_seconds_{suffix}"
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (sample("count"), sample("sum"), sample("bucket", le="60.0"))
    assert relay_factory().run_once().delivered == 4
    count, total, within_a_minute = (
        sample("count") - before[0],
        sample("sum") - before[1],
        sample("bucket", le="60.0") - before[2],
    )
    assert count == 2  # a transaction of three records counts once
    assert within_a_minute == 1  # the other waited two minutes, from its commit
    assert 120 <= total < 180


def test_the_relay_delivers_from_a_sql_ascii_database(
    database_in: Callable[[str], str],
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    relay_settings: Callable[..., SidecarSettings],
) -> None:
    """The library works on a SQL_ASCII database (README), where psycopg gives text as bytes;
    the relay read its own text results (the xid horizon, states) as bytes there (found by a
    review of the checker, which had the same gap)."""
    dsn = database_in("SQL_ASCII")
    topic = topic_factory()
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            outbox.publish(conn, topic, "legacy-a", key="k", headers=[("trace", "t1")])
        with conn.transaction():
            half = outbox.prepare(conn, topic, "never", key="k")
        outbox.rollback(conn, half.tx_id)
        conn.commit()
    relay = relay_factory(as_role(relay_settings(), dsn))
    assert relay.run_once().delivered == 1
    got = consume_all(kafka_bootstrap, topic, "read_committed")
    assert values(got) == [b"legacy-a"]
    assert dict(got[0].headers() or [])["trace"] == b"t1"
    assert sorted(m.op.value for m in markers(kafka_bootstrap, relay)) == [
        "delivered",
        "rolled_back",
    ]
    assert rows(dsn) == []
