"""A marker message the broker refuses while records of the batch are still in flight: the
client purges them with the transaction, and the refusal is the markers' own (pure logic: the
refusal's timing against the records' reports cannot be staged on a real broker)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.config import RelaySettings
from relay.kafka import Sent
from relay.leases import Lease
from relay.shard import Row, ShardWorker, _Batch


class _Topics:
    """Every topic there, writable, of 3 partitions."""

    def partitions(self, name: str, *, refresh: bool = False) -> int:
        return 3

    def known_partitions(self, name: str) -> int:
        return 3

    def denied(self, name: str) -> bool:
        return False

    def writable(self, name: str, *, refresh: bool = False) -> bool:
        return True


class _MarkersRefused:
    """A shard producer whose marker messages the broker refuses as too large; once one is, the
    records reported after `reported_first` come back purged, as librdkafka purges what is in
    flight when a transaction fails."""

    transactional_id = "test-0"
    timeout_s = 60.0
    abortable = True

    def __init__(self, reported_first: int) -> None:
        self.reported_first = reported_first
        self.sent: list[Sent] = []
        self.aborted = 0

    def begin(self) -> None:
        pass

    def open_for(self) -> float:
        return 1.0

    def send(self, topic: str, value: Any, key: Any, headers: Any, partition: Any = None,
             tag: Any = None) -> Sent:  # fmt: skip
        self.sent.append(Sent(tag, topic=topic))
        return self.sent[-1]

    def send_queued(self) -> None:
        pass

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

    def abort(self, timeout_s: float | None = None) -> None:
        self.aborted += 1

    def commit(self, waiting: Any = None) -> float:
        raise AssertionError("a batch whose markers were refused is never committed")


def worker(producer: _MarkersRefused) -> ShardWorker:
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
    assert producer.aborted == 1
