"""The relay as a real process: kill -9 at each point, a paused zombie, relays competing.

After every scenario a read_committed consumer must see each committed record exactly once.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions, OffsetSpec
from prometheus_client import REGISTRY

import outbox
from relay import _failpoints
from relay import shard as shard_module
from relay.markers import decode_markers
from relay.service import RelayConfigError
from tests.fixtures.kafka import consume_all
from tests.fixtures.relay import RelayProcess, discarded

FAST = {"lease_duration": "PT3S", "poll_interval": "PT0.2S"}


def wait_for(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    *logs: RelayProcess,
) -> None:
    """Polls `condition`; on timeout, fails with the output of the relay processes in `logs`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            shown = "".join(f"\n--- {p.log.name}:\n{p.output()}" for p in logs)
            pytest.fail(f"timed out waiting for {what}{shown}")
        time.sleep(0.05)


def undelivered(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox.outbox_record WHERE state = 'committed'"
        ).fetchone()
    return int(row[0]) if row else 0


def publish(dsn: str, topic: str, transactions: int, per_tx: int, tag: str = "") -> list[bytes]:
    sent = []
    with psycopg.connect(dsn) as conn:
        for t in range(transactions):
            with conn.transaction():
                for i in range(per_tx):
                    value = f"{tag}{t}-{i}"
                    outbox.publish(conn, topic, value, key=f"key-{i % 3}")
                    sent.append(value.encode())
    return sent


def in_doubt(
    dsn: str,
    topic: str,
    relay_process: Callable[..., RelayProcess],
    transactions: int = 2,
    per_tx: int = 3,
) -> tuple[list[bytes], RelayProcess]:
    """Records published, then sent and committed in Kafka by a relay killed before it ended
    their rows: a batch in doubt. The records, and the killed relay."""
    sent = publish(dsn, topic, transactions, per_tx)
    doomed = relay_process(failpoint=_failpoints.AFTER_KAFKA_COMMIT, **FAST)
    assert doomed.proc.wait(60) == -9, doomed.output()
    return sent, doomed


def recovered(relay: Any, dsn: str, what: str = "the recovery") -> None:
    wait_for(lambda: relay.run_once() and undelivered(dsn) == 0, 60, what)


def assert_exactly_once(msgs: list[Message], expected: list[bytes]) -> None:
    got = Counter(m.value() for m in msgs)
    duplicates = {v: n for v, n in got.items() if n > 1}
    assert duplicates == {}, f"delivered more than once: {duplicates}"
    assert sorted(got) == sorted(expected), "records lost or invented"
    for key in {m.key() for m in msgs}:  # per key, in commit order
        of_key = [m.value() for m in msgs if m.key() == key]
        assert of_key == [v for v in expected if v in set(of_key)]


def delivered_markers(bootstrap: str, topic: str) -> Counter[int]:
    return Counter(
        marker.id
        for m in consume_all(bootstrap, topic, "read_committed")
        for marker in decode_markers(m.value() or b"")
        if marker.op.value == "delivered"
    )


@pytest.mark.parametrize(
    "point",
    [_failpoints.BEFORE_PRODUCE, _failpoints.AFTER_PRODUCE, _failpoints.AFTER_KAFKA_COMMIT],
)
def test_kill_9_at_each_point_loses_and_duplicates_nothing(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    point: str,
) -> None:
    topic = topic_factory(partitions=2)
    expected = publish(pg_dsn, topic, transactions=5, per_tx=4)

    doomed = relay_process(failpoint=point, **FAST)
    assert doomed.proc.wait(60) == -9, doomed.output()
    if point == _failpoints.AFTER_KAFKA_COMMIT:
        # Kafka has the batch; Postgres still has the rows: the restart must not resend them.
        assert len(consume_all(kafka_bootstrap, topic, "read_committed")) > 0
        assert undelivered(pg_dsn) == len(expected)
    else:
        assert consume_all(kafka_bootstrap, topic, "read_committed") == []

    survivor = relay_process(**FAST)
    wait_for(
        lambda: undelivered(pg_dsn) == 0, 60, "the restarted relay to deliver everything", survivor
    )
    assert survivor.terminate() == 0, survivor.output()

    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)
    counts = delivered_markers(kafka_bootstrap, survivor.settings.relay.op_marker_topic)
    assert sorted(counts.values()) == [1] * len(expected)  # one committed marker per record


def test_a_record_refused_before_sending_stays_parked_through_a_crash_before_the_end(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """A record the relay refuses before sending (its partition is missing) is parked before
    the batch's Kafka commit. It was parked by the batch's end: killed in between, the row
    stayed committed with no marker to end it, and once the partition existed the next relay
    sent it after its key's later record, which had gone with the batch (found by a review)."""
    topic = topic_factory(partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            outbox.publish(conn, topic, "poison", key="k", partition=3)  # no partition 3
        with conn.transaction():
            outbox.publish(conn, topic, "later", key="k")
    doomed = relay_process(failpoint=_failpoints.AFTER_KAFKA_COMMIT, **FAST)
    assert doomed.proc.wait(60) == -9, doomed.output()
    with psycopg.connect(pg_dsn) as conn:
        states = dict(conn.execute("SELECT value, state FROM outbox.outbox_record").fetchall())
    assert states == {b"poison": "parked", b"later": "committed"}  # in doubt, in Kafka
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_partitions([NewPartitions(topic, 4)])[topic].result(30)  # it would fit now
    survivor = relay_process(**FAST)
    wait_for(lambda: undelivered(pg_dsn) == 0, 60, "the recovery", survivor)
    assert survivor.terminate() == 0, survivor.output()
    got = [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")]
    assert got == [b"later"]


def test_records_a_recovery_ends_are_counted_delivered_and_ended(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    relay_factory: Callable[..., Any],
) -> None:
    """Only a batch's own end counted its records: those a recovery ended from their markers
    (after a crash, or a lost connection in the end) were missing from both totals."""
    topic = topic_factory()
    expected, _ = in_doubt(pg_dsn, topic, relay_process)
    assert undelivered(pg_dsn) == len(expected)  # in Kafka, not ended

    def total(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    ended_before = total("outbox_relay_records_ended_total", op="delivered")
    survivor = relay_factory(**FAST)  # in this process: its metrics are read here
    recovered(survivor, pg_dsn)
    assert total("outbox_relay_records_delivered_total", topic=topic) == len(expected)
    assert total("outbox_relay_records_ended_total", op="delivered") - ended_before == len(expected)
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)


def test_records_given_ids_again_after_a_database_restore_are_delivered_not_ended(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    relay_factory: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A database restored from a backup taken before a batch was delivered gives that batch's
    ids to new records; recovery ended rows by id alone, so the new records' rows were deleted
    by the old records' markers, never sent."""
    topic = topic_factory()
    delivered, _ = in_doubt(pg_dsn, topic, relay_process)  # rows still here
    with psycopg.connect(pg_dsn) as conn:  # the restore: those rows gone, their ids given again
        ids = [r[0] for r in conn.execute("SELECT id FROM outbox.outbox_record ORDER BY id")]
        conn.execute("DELETE FROM outbox.outbox_record")
        conn.execute(
            "SELECT setval(pg_get_serial_sequence('outbox.outbox_record', 'id'), %s, false)",
            (min(ids),),
        )
    fresh = publish(pg_dsn, topic, transactions=2, per_tx=3, tag="after-restore-")
    with psycopg.connect(pg_dsn) as conn:
        reused = [r[0] for r in conn.execute("SELECT id FROM outbox.outbox_record ORDER BY id")]
    assert reused == ids  # the same ids, other records
    caplog.set_level("ERROR", logger="relay.shard")
    survivor = relay_factory(**FAST)
    recovered(survivor, pg_dsn, "the new records")
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), delivered + fresh)
    assert "have the ids of records whose op markers are committed" in caplog.text


def test_a_row_changed_by_hand_while_in_doubt_is_not_taken_for_a_restore(
    pg_dsn: str,
    relay_process: Callable[..., RelayProcess],
    relay_factory: Callable[..., Any],
    topic_factory: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A marker's own record in another state (redriven, re-armed meanwhile) is left as it is,
    as before; it was also reported as a database restored from a backup, an error and a
    metric an alert may watch."""
    in_doubt(pg_dsn, topic_factory(), relay_process, transactions=1, per_tx=2)
    with psycopg.connect(pg_dsn) as conn:  # the same record, in another state now
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'parked', reason = 'by hand'"
            " WHERE id = (SELECT min(id) FROM outbox.outbox_record)"
        )
    caplog.set_level("ERROR", logger="relay.shard")
    reused = REGISTRY.get_sample_value("outbox_relay_errors_total", {"kind": "marker_id_reused"})
    survivor = relay_factory(**FAST)
    recovered(survivor, pg_dsn)
    assert "have the ids of records" not in caplog.text
    after = REGISTRY.get_sample_value("outbox_relay_errors_total", {"kind": "marker_id_reused"})
    assert after == reused


def test_a_batch_in_doubt_is_not_sent_again_after_the_outbox_schema_was_renamed(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    relay_settings: Callable[..., Any],
    relay_factory: Callable[..., Any],
) -> None:
    """Markers name their outbox (database/schema): after a rename, recovery took the outbox's
    own markers for another's, ended nothing by them, and the batch in doubt went out twice."""
    topic = topic_factory()
    expected, _ = in_doubt(pg_dsn, topic, relay_process)
    settings = relay_settings(**FAST)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER SCHEMA outbox RENAME TO outbox_renamed")
    try:
        database = settings.database.model_copy(update={"schema_name": "outbox_renamed"})
        survivor = relay_factory(settings.model_copy(update={"database": database}))

        def left() -> int:
            with psycopg.connect(pg_dsn) as conn:
                return int(
                    conn.execute("SELECT count(*) FROM outbox_renamed.outbox_record").fetchone()[0]  # type: ignore[index]
                )

        wait_for(lambda: survivor.run_once() is not None and left() == 0, 60, "the recovery")
        survivor.stop()
        assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("ALTER SCHEMA outbox_renamed RENAME TO outbox")


def test_a_discarded_record_in_doubt_after_a_crash_is_not_rearmed_nor_sent_twice(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """Killed between the Kafka commit of a discarded transaction's dead-letter copy and the
    end of its rows, a relay left them discarded until the shard's next owner recovered: a
    re-arm meanwhile put them back to prepared, and they could then go to their topic too."""
    from checker import rearm

    topic = topic_factory()
    written = discarded(pg_dsn, topic, "abandoned")
    doomed = relay_process(failpoint=_failpoints.AFTER_KAFKA_COMMIT, **FAST)
    assert doomed.proc.wait(60) == -9, doomed.output()
    dead_letter = doomed.settings.relay.dead_letter_topic
    assert [m.value() for m in consume_all(kafka_bootstrap, dead_letter, "read_committed")] == [
        b"abandoned"
    ]

    def not_ended() -> int:
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM outbox.outbox_record WHERE ended_at IS NULL"
            ).fetchone()
        return int(row[0]) if row else -1

    assert not_ended() == 1  # in doubt: out in Kafka, not ended
    with (
        psycopg.connect(pg_dsn) as conn,
        pytest.raises(outbox.IllegalTransitionError, match="taken by the relay"),
    ):
        rearm(conn, "default", written.tx_id, actor="ops")
    survivor = relay_process(**FAST)
    wait_for(lambda: not_ended() == 0, 60, "the survivor to end the discarded row", survivor)
    assert survivor.terminate() == 0, survivor.output()
    assert consume_all(kafka_bootstrap, topic, "read_committed") == []
    assert [m.value() for m in consume_all(kafka_bootstrap, dead_letter, "read_committed")] == [
        b"abandoned"
    ]


def test_a_transaction_open_on_the_marker_partition_hides_no_committed_marker(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """Recovery read the markers up to the read_committed consumer's high watermark, the last
    stable offset: a transaction left open before the crashed batch's markers (another shard's
    or relay's on the same partition) hid them, and the batch went again."""
    topic = topic_factory()
    doomed = relay_process(failpoint=_failpoints.AFTER_KAFKA_COMMIT, **FAST)

    def lease() -> tuple[Any, ...]:
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute("SELECT owner, marker_partition FROM outbox.shard_lease").fetchone()
        return row or (None, None)

    wait_for(lambda: lease()[1] is not None, 60, "the first relay's first recovery", doomed)
    first_owner = lease()[0]
    other = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic}-open"})
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(doomed.settings.relay.op_marker_topic, b"another producer's", partition=0)
    other.flush(30)  # open on the marker partition, before the batch's markers
    expected = publish(pg_dsn, topic, transactions=3, per_tx=2)
    assert doomed.proc.wait(60) == -9, doomed.output()  # its batch committed in Kafka
    survivor = relay_process(**FAST)

    def taken_over() -> bool:  # the survivor holds the shard: it recovers now
        return lease()[0] not in (None, first_owner)

    wait_for(taken_over, 60, "the survivor to take the shard", survivor)
    # Reading only to the last stable offset, its recovery ends at once, having read no
    # marker; reading to the log's end, it waits for the open transaction. So: aborted once
    # it recovered, or after a while.
    waited_until = time.monotonic() + 4
    while "recovered" not in survivor.output() and time.monotonic() < waited_until:
        time.sleep(0.1)
    other.abort_transaction(30)
    wait_for(lambda: undelivered(pg_dsn) == 0, 60, "the survivor to end the batch", survivor)
    assert survivor.terminate() == 0, survivor.output()
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)


def delete_markers_up_to_the_end(bootstrap: str, topic: str, partition: int = 0) -> int:
    """What retention or `kafka-delete-records` does to the marker partition."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    tp = TopicPartition(topic, partition)
    end = admin.list_offsets({tp: OffsetSpec.latest()})[tp].result(30).offset
    admin.delete_records([TopicPartition(topic, partition, end)])[tp].result(30)
    return int(end)


def test_markers_deleted_while_a_batch_is_in_doubt_stop_the_relay_not_send_it_again(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    relay_factory: Callable[..., Any],
) -> None:
    """A relay down longer than op_marker_retention after its Kafka commit: its consumer reset
    to the log start without a word, past the batch's markers, and the batch went again (or,
    with nothing after them, the shard waited for ever behind green probes)."""
    topic = topic_factory()
    expected, doomed = in_doubt(pg_dsn, topic, relay_process)
    assert undelivered(pg_dsn) == len(expected)  # in doubt: sent, not ended
    markers = doomed.settings.relay.op_marker_topic
    end = delete_markers_up_to_the_end(kafka_bootstrap, markers)
    survivor = relay_factory(doomed.settings)

    def until_it_holds_the_shard() -> None:  # the dead relay's lease expires first
        until = time.monotonic() + 30
        while not survivor.run_once().shards:
            assert time.monotonic() < until, "the survivor never took the shard"
            time.sleep(0.2)

    with pytest.raises(RelayConfigError, match=rf"{markers}:0, which now starts at {end}"):
        until_it_holds_the_shard()
    assert undelivered(pg_dsn) == len(expected)  # kept, not sent again
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)


def test_a_relay_stopped_cleanly_for_longer_than_the_marker_retention_starts_again(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Any],
) -> None:
    """A batch's end records the offset of its own commit marker, one below the partition's
    end: once retention had emptied the partition, the restart was refused, though every batch
    had ended."""
    topic = topic_factory()
    expected = publish(pg_dsn, topic, transactions=2, per_tx=2)
    relay = relay_factory(**FAST)
    delivered, until = 0, time.monotonic() + 30
    while delivered < len(expected):
        assert time.monotonic() < until, f"{delivered} of {len(expected)} delivered"
        delivered += relay.run_once().delivered
    relay.stop()  # cleanly: nothing in doubt
    delete_markers_up_to_the_end(kafka_bootstrap, relay.settings.relay.op_marker_topic)
    assert relay_factory(relay.settings).run_once().shards == 1  # recovers, not refused
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)


def test_a_stop_with_the_broker_unreachable_spends_one_allowance_on_the_hand_over(
    relay_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard's hand-over waited its own 3 s for the log end: a relay of 12 shards took
    36 s to stop, past its shutdown grace, and exited 1 with its leases held."""
    relay = relay_factory(shards=6, **FAST)
    assert relay.run_once().shards == 6
    asked: list[float] = []

    def unreachable(name: str, partition: int, *, timeout_s: float = 10.0) -> int:
        asked.append(timeout_s)
        time.sleep(timeout_s)  # as a request to a broker that does not answer
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    monkeypatch.setattr(relay.topics, "log_end", unreachable)
    began = time.monotonic()
    relay.stop()
    # was 6 x 3 s; one allowance (3 s), with room for the rest of the stop on a loaded machine
    assert time.monotonic() - began < 9, asked
    assert len(asked) == 1  # none tried after the first failed


def test_an_idle_shard_moves_its_marker_offset_on_so_that_retention_stops_no_restart(
    pg_dsn: str,
    kafka_bootstrap: str,
    relay_factory: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Others' messages on the marker partition (another shard's markers) pass retention while
    this shard is idle: its recorded offset must not stay behind them."""
    monkeypatch.setattr(shard_module, "MARKER_OFFSET_REFRESH_S", 0.0)
    relay = relay_factory(**FAST)
    relay.run_once()  # recovered: its offset is the partition's end
    markers = relay.settings.relay.op_marker_topic
    other = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(3):
        other.produce(markers, b"not this shard's", partition=0)
    assert other.flush(30) == 0
    relay.run_once()  # idle
    with psycopg.connect(pg_dsn) as conn:
        recorded = conn.execute("SELECT marker_offset FROM outbox.shard_lease").fetchone()
    end = delete_markers_up_to_the_end(kafka_bootstrap, markers)
    assert recorded == (end,)
    # The same relay after a failed round: it recovered from the offset its worker had kept,
    # not the one moved on in shard_lease, and stopped with "markers were deleted".
    for worker in relay.workers.values():
        worker.needs_recovery = True  # as a failed round leaves it (Relay._on_failure)
    assert relay.run_once().shards == 1
    relay.stop()
    assert relay_factory(relay.settings).run_once().shards == 1  # a restart recovers too


@pytest.mark.parametrize(
    ("paused_at", "prefix_changed"),
    [
        (_failpoints.AFTER_PRODUCE, False),
        (_failpoints.BEFORE_PRODUCE, True),
        (_failpoints.AFTER_PRODUCE, True),
    ],
    ids=["same-prefix", "prefix-changed-before-produce", "prefix-changed-after-produce"],
)
def test_a_paused_owner_is_fenced_after_losing_its_lease(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    paused_at: str,
    prefix_changed: bool,
) -> None:
    """Prefix changed: the successor's transactional ids are not the zombie's (a rolling update
    that changed relay.transactional_id_prefix), so its own producers fenced nothing. Paused
    before its Kafka transaction began, the zombie woke, committed its batch, and its records
    went out twice; paused in it, the successor waited for it to time out."""
    topic = topic_factory()
    expected = publish(pg_dsn, topic, transactions=4, per_tx=5)

    zombie = relay_process(failpoint=f"{paused_at}:stop", **FAST)
    wait_for(zombie.stopped, 60, "the first relay to pause with its batch in flight", zombie)

    settings = zombie.settings
    if prefix_changed:
        relay = settings.relay.model_copy(
            update={"transactional_id_prefix": f"{settings.relay.transactional_id_prefix}-new"}
        )
        settings = settings.model_copy(update={"relay": relay})
    successor = relay_process(settings=settings)
    if prefix_changed:
        wait_for(
            lambda: "fencing that one first" in successor.output(),
            60,
            "the successor to fence the zombie's producer",
            successor,
        )
    wait_for(
        lambda: undelivered(pg_dsn) == 0, 60, "the successor to take over and deliver", successor
    )

    zombie.proc.send_signal(signal.SIGCONT)  # wakes up, believes it still owns
    wait_for(lambda: "fenced" in zombie.output(), 60, "the zombie to learn it was fenced", zombie)
    assert zombie.terminate() == 0, zombie.output()
    assert successor.terminate() == 0, successor.output()
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)


def test_a_relay_switched_back_to_a_marker_topic_used_before_stops_instead_of_sending_twice(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Any],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """The relays moved to another marker topic (shard_lease emptied, as the refusal of a
    changed topic says), then back: the offset recorded in the second topic, read in the first
    (which had run past it), found none of the markers of the batch in doubt, which went
    again."""
    topic, used_before = topic_factory(), topic_factory(partitions=2)
    publish(pg_dsn, topic_factory(), transactions=2, per_tx=1)
    relay = relay_factory(op_marker_topic=used_before, **FAST)
    recovered(relay, pg_dsn, "the first topic's deliveries")
    relay.stop()
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM outbox.shard_lease")
    sent, doomed = in_doubt(pg_dsn, topic, relay_process)  # markers in the relays' second topic
    second = doomed.settings.relay
    back = doomed.settings.model_copy(
        update={"relay": second.model_copy(update={"op_marker_topic": used_before})}
    )
    wrong = relay_factory(back)
    with pytest.raises(RelayConfigError, match=rf"in topic {second.op_marker_topic}, not"):
        # the shard is taken once the killed relay's lease ran out
        wait_for(lambda: wrong.run_once().shards, 60, "the killed relay's lease to run out")
    wrong.stop()  # the sidecar's way: it stops, and hands its shard back
    recovered(relay_factory(doomed.settings), pg_dsn)
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), sent)


def test_two_relays_share_the_shards_and_deliver_each_record_once(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = topic_factory(partitions=3)
    one = relay_process(shards=4, **FAST)
    two = relay_process(shards=4, **FAST)

    def owners() -> set[Any]:
        with psycopg.connect(pg_dsn) as conn:
            return {r[0] for r in conn.execute("SELECT owner FROM outbox.shard_lease")}

    wait_for(lambda: len(owners() - {None}) == 2, 60, "both relays to hold shards", one, two)

    def write() -> None:  # keys over all the shards: a transaction goes from its home shard
        with psycopg.connect(pg_dsn) as conn:
            for t in range(60):
                with conn.transaction():
                    outbox.publish(conn, topic, f"w{t}", key=f"key-{t}")
                expected.append(f"w{t}".encode())

    expected: list[bytes] = []
    writer = threading.Thread(target=write)
    writer.start()
    writer.join(120)
    assert not writer.is_alive()
    wait_for(lambda: undelivered(pg_dsn) == 0, 90, "everything to be delivered", one, two)
    assert one.terminate() == 0, one.output()
    assert two.terminate() == 0, two.output()
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)
    marker_topic = one.settings.relay.op_marker_topic
    relays = {
        m.relay
        for msg in consume_all(kafka_bootstrap, marker_topic, "read_committed")
        for m in decode_markers(msg.value() or b"")
    }
    assert len(relays) == 2  # both delivered a share
