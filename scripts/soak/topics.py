"""The soak's topics: made fresh for a run, read back at its end with `read_committed`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.markers import (
    OUTBOX_ID_HEADER,
    OUTBOX_REASON_HEADER,
    OUTBOX_TX_ID_HEADER,
    MarkerFormatError,
    MarkerTooNew,
    decode_markers,
)
from scripts.soak.checks import Delivered, Marker
from scripts.soak.settings import DEAD_LETTER_TOPIC, MARKER_TOPIC, TOPICS, Settings

TIMEOUT_S = 30


def create(settings: Settings) -> None:
    """Delete the soak's topics of an earlier run (the relays make the marker and dead-letter
    topics again, as they would in production) and make the record topics anew."""
    # log_level 4: not librdkafka's notice of events left in its queue when the client goes
    admin = AdminClient({"bootstrap.servers": settings.bootstrap, "log_level": 4})
    names = {*TOPICS, MARKER_TOPIC, DEAD_LETTER_TOPIC}
    old = [n for n in admin.list_topics(timeout=TIMEOUT_S).topics if n in names]
    for future in admin.delete_topics(old).values() if old else ():
        future.result(TIMEOUT_S)
    # a deletion completes in the background; the name is refused until it has
    deadline = time.monotonic() + TIMEOUT_S
    while names & set(admin.list_topics(timeout=TIMEOUT_S).topics):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the soak's old topics were not deleted within {TIMEOUT_S}s")
        time.sleep(0.5)
    new = [NewTopic(t, num_partitions=p, replication_factor=1) for t, p in TOPICS.items()]
    for future in admin.create_topics(new).values():
        future.result(TIMEOUT_S)


@dataclass
class Read:
    """What the topics hold, as plain data for the checks."""

    delivered: list[Delivered] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    dead_letters: list[str] = field(default_factory=list)  # each copy's reason
    unread: list[str] = field(default_factory=list)  # "topic:partition" not read to its end


def read(settings: Settings, stall_s: float = 90) -> Read:
    """Every committed message of the soak's topics. A partition counts as read once the
    consumer's position reaches its high watermark: `read_committed` stops before an open
    transaction, so one left open (a killed relay's, until the broker aborts it after the
    relay's transaction timeout) holds the read back; `stall_s` without progress gives up."""
    out = Read()
    handlers: dict[str, Callable[[Message], None]] = {
        **{t: lambda m: out.delivered.append(_delivered(m)) for t in TOPICS},
        MARKER_TOPIC: lambda m: out.markers.extend(_markers(m)),
        DEAD_LETTER_TOPIC: lambda m: out.dead_letters.append(str(_header(m, OUTBOX_REASON_HEADER))),
    }
    consumer = Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": f"soak-read-{uuid.uuid4().hex[:8]}",  # never committed: assign() below
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        listed = consumer.list_topics(timeout=TIMEOUT_S).topics
        ends: dict[tuple[str, int], int] = {}
        for topic in handlers:
            for p in listed[topic].partitions if topic in listed else ():
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), TIMEOUT_S)
                if high > 0:
                    ends[(topic, p)] = high
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends])
        progress, last_progress = -1, time.monotonic()
        while ends and time.monotonic() - last_progress < stall_s:
            for msg in consumer.consume(1000, 1.0):
                if msg.error() is None:
                    handlers[msg.topic() or ""](msg)
            positions = consumer.position([TopicPartition(t, p) for t, p in ends])
            for tp in positions:
                if tp.offset >= ends[(tp.topic, tp.partition)]:
                    del ends[(tp.topic, tp.partition)]
            moved = sum(max(tp.offset, 0) for tp in positions)
            if moved != progress:
                progress, last_progress = moved, time.monotonic()
        out.unread = [f"{t}:{p}" for t, p in sorted(ends)]
    finally:
        consumer.close()
    return out


def _header(msg: Message, name: str) -> str | None:
    value = dict(msg.headers() or []).get(name)
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _delivered(msg: Message) -> Delivered:
    try:
        value: Any = json.loads(msg.value() or b"")
    except ValueError:
        value = None
    value = value if isinstance(value, dict) else {}  # not a soak writer's: no ids
    outbox_id = _header(msg, OUTBOX_ID_HEADER)
    key = msg.key()
    return Delivered(
        topic=msg.topic() or "",
        partition=msg.partition() or 0,
        offset=msg.offset() or 0,
        key=None if key is None else bytes(key).decode(errors="replace"),
        outbox_id=int(outbox_id) if outbox_id and outbox_id.isdigit() else None,
        outbox_tx_id=_header(msg, OUTBOX_TX_ID_HEADER),
        uid=value.get("uid"),
        tx=value.get("tx"),
        seq=value.get("seq"),
    )


def _markers(msg: Message) -> list[Marker]:
    try:
        found = decode_markers(msg.value() or b"")
    except (MarkerFormatError, MarkerTooNew):  # not a marker this build reads: reported
        return [Marker("unreadable", -1, MARKER_TOPIC, msg.partition(), msg.offset(), None)]
    return [Marker(m.op.value, m.id, m.topic, m.partition, m.offset, m.outbox) for m in found]
