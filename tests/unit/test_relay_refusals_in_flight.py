"""Refusals that come back while a batch is in flight (pure logic: their timing against the
other reports cannot be staged on a real broker): a marker message refused while records of the
batch are purged with the transaction; a record refused as of an unknown topic that is there
again once looked up."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.config import RelaySettings
from relay.kafka import STOP_ABORT_S, Fenced, ProducerFailed, Sent, ShuttingDown
from relay.leases import Lease
from relay.shard import Row, ShardWorker, _Batch


class _Topics:
    """Every topic there, writable, of 3 partitions."""

    asked = 0

    def partitions(self, name: str, *, refresh: bool = False) -> int:
        self.asked += refresh
        return 3

    def known_partitions(self, name: str) -> int:
        return 3

    def denied(self, name: str) -> bool:
        return False

    def writable(self, name: str, *, refresh: bool = False) -> bool:
        return True


class _Producer:
    """A shard producer that keeps what is sent, for `reports` to answer; counts aborts and
    commits."""

    transactional_id = "test-0"
    timeout_s = 60.0
    abortable = True

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.aborted = self.committed = 0

    def begin(self) -> None:
        self.sent = []

    def open_for(self) -> float:
        return 1.0

    def send(self, topic: str, value: Any, key: Any, headers: Any, partition: Any = None,
             tag: Any = None) -> Sent:  # fmt: skip
        self.sent.append(Sent(tag, topic=topic))
        return self.sent[-1]

    def send_queued(self, waiting: Any = None) -> None:
        pass

    def abort(self, timeout_s: float | None = None, stopping: Any = None) -> None:
        self.aborted += 1

    def commit(self, waiting: Any = None) -> float:
        self.committed += 1
        return 0.0


class _MarkersRefused(_Producer):
    """Its marker messages the broker refuses as too large; once one is, the records reported
    after `reported_first` come back purged, as librdkafka purges what is in flight when a
    transaction fails."""

    def __init__(self, reported_first: int) -> None:
        super().__init__()
        self.reported_first = reported_first

    def reports(self, stalled: Any = None, waiting: Any = None) -> Iterator[Sent]:
        reported = 0
        while True:
            unreported = [s for s in self.sent if not s.reported]
            # a marker message as soon as it is sent: it fills while records are reported
            marker = next((s for s in unreported if s.tag is None), None)
            record = next((s for s in unreported if s.tag is not None), None)
            sent = marker or record
            if sent is None:
                return
            sent.reported = True
            if sent is marker:
                sent.error = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
            elif reported >= self.reported_first:
                sent.error = KafkaError(KafkaError._PURGE_INFLIGHT)
            else:
                sent.partition, sent.offset = 0, reported
            reported += sent is record
            yield sent


def worker(producer: _Producer) -> ShardWorker:
    settings = RelaySettings(op_marker_message_bytes=1024)
    shard = ShardWorker(
        Lease(0, 1, None, 0), settings, "outbox", "relay-1", {}, _Topics(),  # type: ignore[arg-type]
        ending_elsewhere=lambda: None,  # type: ignore[arg-type,return-value]
    )  # fmt: skip
    shard.producer = producer  # type: ignore[assignment]
    return shard


def batch(records: int) -> _Batch:
    rows = [
        Row(i, "orders", f"tx{i}", "orders.paid", b"k%d" % i, b"v", None, None, 0, "committed",
            committed_xid=str(100 + i))
        for i in range(1, records + 1)
    ]  # fmt: skip
    return _Batch(transactions=[[r] for r in rows])


@pytest.mark.parametrize("reported_first", [10**9, 8], ids=["nothing purged", "records purged"])
def test_a_marker_message_refused_as_too_large_makes_the_markers_go_alone(
    reported_first: int,
) -> None:
    """With records purged with the transaction, their purge was taken for the batch's failure:
    aborted and sent again every round, the markers never sent one at a time, and a topic too
    small for them never stopped the relay."""
    producer = _MarkersRefused(reported_first)
    shard = worker(producer)
    with pytest.raises(KafkaException, match="they go one at a time"):
        shard._ship(None, batch(20))  # type: ignore[arg-type]
    assert shard._markers_alone
    assert shard.needs_recovery
    assert (producer.aborted, producer.committed) == (1, 0)


class _UnknownTopicInFlight(_Producer):
    """Its first record the broker refuses as of an unknown topic (deleted and made again while
    it was in flight), in `refusals` batches in a row; the others go (purged with it)."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    def reports(self, stalled: Any = None, waiting: Any = None) -> Iterator[Sent]:
        refused = self.refusals > 0
        self.refusals -= refused
        for i, sent in enumerate(self.sent):
            sent.reported = True
            if sent.tag is not None and sent.tag.id == 1 and refused:
                sent.error = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            elif refused and sent.tag is not None:
                sent.error = KafkaError(KafkaError._PURGE_INFLIGHT)
            else:
                sent.partition, sent.offset = 0, i
            yield sent


@pytest.mark.parametrize("refusals", [1, 2])
def test_a_record_refused_as_of_a_topic_made_again_in_flight_goes_again_once(
    refusals: int,
) -> None:
    """Refused as of an unknown topic that a look-up found there (deleted and made again while
    the record was in flight), it was parked, to wait for a redrive by hand. It goes again
    with its batch now; refused so a second time, it is parked."""
    producer = _UnknownTopicInFlight(refusals)
    shard = worker(producer)
    parked: list[dict[int, str]] = []
    shard._park = lambda conn, poison: parked.append(dict(poison))  # type: ignore[method-assign]
    ended: list[list[int]] = []  # the rows' end in Postgres, once committed in Kafka
    shard._end_or_recover = lambda ending, conn: ended.append([m.id for m in ending.markers])  # type: ignore[method-assign]
    first = shard._ship(None, batch(3))  # type: ignore[arg-type]
    assert (first.full, parked, producer.aborted) == (True, [{}], 1)  # all go again at once
    second = shard._ship(None, batch(3))  # type: ignore[arg-type]
    if refusals == 1:
        assert (producer.committed, ended) == (1, [[1, 2, 3]])
    else:
        assert second.parked == 1
        assert parked[-1] == {1: "refused by the broker: Broker: Unknown topic or partition"}
        assert not shard._unknown_topic_retried  # redriven, it is given its one retry again


class _FatalInFlight(_Producer):
    """A producer failed for good while its records were in flight: librdkafka reports them
    with _FATAL alone, or purged (`reported`); the abort, refused, raises what the fatal error
    was (`abort_raises`)."""

    def __init__(self, abort_raises: Exception | None, reported: int = KafkaError._FATAL) -> None:
        super().__init__()
        self.abort_raises = abort_raises
        self.reported = reported

    def reports(self, stalled: Any = None, waiting: Any = None) -> Iterator[Sent]:
        for sent in self.sent:
            sent.reported = True
            sent.error = KafkaError(self.reported, "in flight at a fatal error")
            yield sent

    def abort(self, timeout_s: float | None = None, stopping: Any = None) -> None:
        super().abort(timeout_s, stopping)
        if self.abort_raises is not None:
            raise self.abort_raises


@pytest.mark.parametrize("reported", [KafkaError._FATAL, KafkaError._PURGE_QUEUE])
@pytest.mark.parametrize(
    ("abort_raises", "raised"),
    [
        (Fenced("Broker: Producer fenced"), Fenced),
        (ProducerFailed("the shard's producer failed for good"), ProducerFailed),
        (None, KafkaException),
    ],
    ids=["fenced", "failed", "abort taken"],
)
def test_records_failed_by_a_fatal_error_say_which_it_was(
    abort_raises: Exception | None, raised: type[Exception], reported: int
) -> None:
    """Reported _FATAL or purged in flight (the fatal flag is the producer's, not the
    reports'), a fencing was raised as a plain KafkaException: counted as kind kafka, said as
    'Fatal error', nothing parked."""
    producer = _FatalInFlight(abort_raises, reported)
    shard = worker(producer)
    parked: list[dict[int, str]] = []
    shard._park = lambda conn, poison: parked.append(dict(poison))  # type: ignore[method-assign]
    with pytest.raises(raised) as caught:
        shard._ship(None, batch(3))  # type: ignore[arg-type]
    if abort_raises is not None:
        assert caught.value is abort_raises
    assert shard.needs_recovery
    assert (producer.aborted, producer.committed, parked) == (1, 0, [])


class _StopWhileAlone(_Producer):
    """The relay stops while a record that goes alone waits for its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.abort_timeouts: list[float | None] = []

    def send_queued(self, waiting: Any = None) -> None:
        waiting()

    def abort(self, timeout_s: float | None = None, stopping: Any = None) -> None:
        super().abort(timeout_s, stopping)
        self.abort_timeouts.append(timeout_s)


class _StopWhileMarkersGoAlone(_StopWhileAlone):
    """The relay stops while a marker message that goes alone waits for its batch (in the
    wait for reports): records reported, markers sent one at a time."""

    def send_queued(self, waiting: Any = None) -> None:
        if any(s.tag is not None and s.reported for s in self.sent):
            waiting()

    def reports(self, stalled: Any = None, waiting: Any = None) -> Iterator[Sent]:
        for i, sent in enumerate(list(self.sent)):
            sent.reported = True
            sent.partition, sent.offset = 0, i
            yield sent


@pytest.mark.parametrize("markers", [False, True], ids=["a record alone", "markers alone"])
def test_a_stop_while_something_waits_to_go_alone_aborts_the_batch_once_briefly(
    markers: bool,
) -> None:
    """Waiting to go alone, a record or marker message did not heed the stop. Once it did, a
    marker's wait aborted the batch, then the wait for reports aborted it again: the second
    found none, and logged a false 'the abort failed'."""
    producer = _StopWhileMarkersGoAlone() if markers else _StopWhileAlone()
    shard = worker(producer)
    if markers:
        shard._markers_alone = True
    else:
        shard._alone.add(2)

    def stopping() -> None:
        raise ShuttingDown("the relay stops")

    with pytest.raises(ShuttingDown):
        shard._ship(None, batch(3), waiting=stopping)  # type: ignore[arg-type]
    assert shard.needs_recovery
    assert (producer.abort_timeouts, producer.committed) == ([STOP_ABORT_S], 0)
