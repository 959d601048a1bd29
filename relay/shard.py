"""One shard's delivery: claim in commit order, one Kafka transaction, then end the rows.

Per round, for a shard it holds:
1. claim the next committed transactions in commit order (all records of a transaction, even
   across shards, go in one Kafka transaction), and the rolled back / discarded / parked rows
   whose op marker is not out yet. In a drain, the relay's claimer makes this claim while the
   batch before it waits for Kafka (deliver_once);
2. in one Kafka transaction: the records on their topics (with outbox-id and outbox-tx-id
   headers), dead-letter copies of discarded and parked records, and an op marker for each;
3. after the commit, in one Postgres transaction that re-checks the lease: end the rows (delete
   or archive) and move the shard's op-marker offset past the new markers. The relay's ender
   does this while the next batch is claimed (its rows kept out) and produced; the next commit
   waits for it.
A crash between 2 and 3 leaves rows whose markers are committed: `recover()` reads the markers
from the stored offset (read_committed) and ends those rows instead of sending them again.

Multi-shard transactions: the shard of its lowest record id is its home. The home relay sends
it once no other shard holds an earlier-committed record of its keys; the other shards hold it,
and their later transactions of its keys, back until it is gone (_claim). Per-key commit order
therefore holds across shards. Gone means ended, or committed in Kafka by another shard of the
same relay whose end is pending (_out_elsewhere).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import logging
import operator
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox import sql as queries
from outbox import wakeup_channel
from outbox._records import RESERVED_HEADER_PREFIX
from relay import _failpoints, metrics, pgarray
from relay.background import BackgroundConnection
from relay.config import RelaySettings
from relay.kafka import (
    PERMANENT_RECORD_ERRORS,
    REPORT_STALL_S,
    STOP_ABORT_S,
    TOPIC_REFUSED_ERRORS,
    Fenced,
    OutcomeUnknown,
    ProducerFailed,
    ProducerMisconfigured,
    Sent,
    ShardProducer,
    ShuttingDown,
    Topics,
    TransactionTimedOut,
    dead_letter_topic_config,
    recovery_consumer_conf,
)
from relay.leases import Lease
from relay.markers import (
    MARKER_MESSAGE_MARGIN,
    MAX_MARKER_REASON_CHARS,
    OUTBOX_ID_HEADER,
    OUTBOX_NAME_HEADER,
    OUTBOX_PRODUCER_GROUP_HEADER,
    OUTBOX_REASON_HEADER,
    OUTBOX_TX_ID_HEADER,
    OUTBOX_VALUE_OMITTED_HEADER,
    Ended,
    MarkerBatcher,
    MarkerFormatError,
    MarkerTooNew,
    Op,
    OpMarker,
    decode_markers,
    marker_entry,
    marker_partition,
)
from relay.pipelined import pipelined_transaction
from relay.sharding import shard_of, shard_range

logger = logging.getLogger(__name__)


_SIZE_ERRORS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
# What librdkafka reports for the records it drops after another one failed the transaction.
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
END_DEADLOCK_ATTEMPTS = 3  # an end chosen by Postgres to break a deadlock is made again
# The fewest rows of its own a claim reads after a round that held transactions back (see
# ShardWorker._next_claim_limit)
MIN_CLAIM_LIMIT = 100
DEAD_LETTER_RETRY_S = 30.0  # a dead-letter topic that refused everything is tried again then
PARKED_IDS_LOGGED = 20  # ids named in a parking's log line; the rest are counted
# An idle shard moves its recorded marker offset to the partition's end this often: else the
# markers from it on, other shards' included, could pass op_marker_retention, and a recovery
# would have to refuse for want of them (see _read_markers).
MARKER_OFFSET_REFRESH_S = 3600.0
# The forms of a dead-letter copy, each smaller than the one before: what a refusal falls to;
# the last, none at all. Their metric labels are metrics.DEAD_LETTER_FORMS, in this order.
_FULL, _NO_VALUE, _BARE, _NO_COPY = range(len(metrics.DEAD_LETTER_FORMS))


_by_id = operator.attrgetter("id")


def _shipped_as(marker: Ended | OpMarker) -> str:
    """The state a row had when the relay wrote this marker for it."""
    return "committed" if marker.op is Op.DELIVERED else marker.op.value


def topic_refused(topic: str) -> str:
    """The parking reason of a record whose topic the broker's ACLs keep the relay from."""
    return (
        f"refused by the broker: Topic authorization failed for {topic!r}: the relay's "
        "principal needs DESCRIBE and WRITE on it"
    )


def _reason_kind(reason: str) -> str:
    """A parking reason as a metric label: a few fixed values, never a topic name or number."""
    for prefix, kind in _REASON_KINDS:
        if reason.startswith(prefix):
            return kind
    return "other"


_REASON_KINDS = (
    ("topic ", "unknown_topic"),
    ("partition ", "partition_out_of_range"),
    ("refused by the Kafka client", "refused_by_client"),
    ("refused by the broker", "refused_by_broker"),
    ("its stored headers", "malformed_headers"),
    ("the relay's op-marker topic", "op_marker_topic"),
)
# At 0 from the start: increase() does not see a parking whose series first shows at 1, and a
# first parking since the start is the usual one
for _kind in (*(kind for _, kind in _REASON_KINDS), "other"):
    metrics.PARKED.labels(_kind)


def _transaction_failed(exc: KafkaException) -> bool:
    """produce() refused a record because the transaction already failed in the background."""
    return bool(exc.args[0].code() == KafkaError._STATE)


# The broker's and the client's words for a topic they do not know (deleted, never made).
_UNKNOWN_TOPIC_ERRORS = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


class LeaseLost(Exception):
    """The shard's lease changed hands: its rows are not ours to touch any more."""


class EndFailed(Exception):
    """The ender's database work for a batch failed: this shard's trouble, not the round's (the
    relay's own connection is fine). The shard recovers the batch's rows from its markers."""


class MarkersNotFound(Exception):
    """A shard's markers are not where it recorded them: another topic (renamed in the
    settings, or deleted and made again) than the one they went to, or markers deleted."""


class MarkerTopicRefused(Exception):
    """The op-marker topic refuses the relay's markers for good (their size, its rights):
    nothing can be delivered until an operator changes it."""


class DeadLetterUnwritable(Exception):
    """The dead-letter topic takes nothing from us (missing, no ACL): the batch is aborted and
    goes again, its rows kept."""


class MalformedHeaders(ValueError):
    """A row's stored headers are not [[name, base64 value or null], ...]: it cannot be sent
    as it is, ever (parked), and its dead-letter copy goes without them."""


_RESERVED_LENGTH = len(RESERVED_HEADER_PREFIX)


def _header_fault(headers: Any) -> str:
    """Which stored header is wrong, and how; never its value (headers may carry tokens, and
    this goes into the row's reason, the log, the marker and the dead-letter copy)."""
    for i, item in enumerate(headers or ()):
        if not isinstance(item, list) or len(item) != 2:
            return f"stored headers: item {i} is not a [name, value] pair"
        name, value = item
        if name is not None and not isinstance(name, str):
            return f"stored headers: the name of item {i} is not a string"
        if value is not None:
            try:
                base64.b64decode(value)
            except (TypeError, ValueError):
                return f"stored headers: the value of item {i} is not base64"
    return "stored headers: not [[name, base64 value or null], ...]"


@dataclass(slots=True)  # not frozen: a frozen dataclass is built 3x slower, per record
class Row:
    id: int
    producer_group: str
    tx_id: str
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[list[str | None]] | None  # None: no headers
    partition: int | None
    key_hash: int
    state: str
    committed_xid: str | None = None
    commit_ts: datetime | None = None
    reason: str | None = None
    size: int = 0  # bytes of key, value and headers (as text), as relay.sql's claims count them

    @classmethod
    def from_db(cls, r: tuple[Any, ...], **rest: Any) -> Row:
        """From a query row whose first columns are those of relay.sql's record queries."""
        return cls(
            id=r[0], producer_group=r[1], tx_id=r[2], topic=r[3], key=r[4], value=r[5],
            headers=r[6], partition=r[7], key_hash=r[8], **rest,
        )  # fmt: skip

    def kafka_headers(self, outbox: bytes | None = None) -> list[tuple[str, str | bytes | None]]:
        """The stored headers and the relay's own (`outbox`: the OUTBOX_NAME_HEADER's value).
        Raises MalformedHeaders for stored headers another writer (or a hand) made wrong."""
        try:
            given = [
                (n or "", None if v is None else base64.b64decode(v)) for n, v in self.headers or ()
            ]
        except (TypeError, ValueError):  # not pairs, or not base64
            raise MalformedHeaders(_header_fault(self.headers)) from None
        for i, (name, _) in enumerate(given) if given else ():  # most rows have none
            if type(name) is not str:
                raise MalformedHeaders(_header_fault(self.headers))
            if name[:_RESERVED_LENGTH].lower() == RESERVED_HEADER_PREFIX:
                # A row written without the library: a second outbox-id ahead of the relay's
                # own credited the copy to another record in the reconciliation (which reads
                # the first), and a consumer reading the first one was misled too.
                raise MalformedHeaders(
                    f"stored headers: the name of item {i}, {name!r}, is reserved (the relay "
                    f"sets the {RESERVED_HEADER_PREFIX}* headers)"
                )
        headers: list[tuple[str, str | bytes | None]] = [
            *given,
            (OUTBOX_ID_HEADER, str(self.id).encode()),
            (OUTBOX_TX_ID_HEADER, self.tx_id.encode()),
            (OUTBOX_PRODUCER_GROUP_HEADER, self.producer_group.encode()),
        ]
        if outbox is not None:
            headers.append((OUTBOX_NAME_HEADER, outbox))
        return headers


@dataclass
class ShardRound:
    delivered: int = 0
    ended: int = 0
    parked: int = 0
    full: bool = False  # more is waiting: go again at once
    held_back: bool = False  # transactions wait for another shard's (see ShardWorker._claim)
    unstamped_seen: UnstampedSeen | None = None


@dataclass
class _Batch:
    transactions: list[list[Row]] = field(default_factory=list)
    ended: list[Row] = field(default_factory=list)
    held_back: int = 0  # transactions claimed that wait for another shard (see _claim)
    held_back_bytes: int = 0  # their rows' bytes (Row.size)
    cut_short: bool = False  # claimed fewer than a batch's rows, and there were more
    bytes_full: bool = False  # its records' bytes (Row.size) reached batch_max_bytes
    ended_full: bool = False  # rows to end (relay_unmarked) up to a batch's count or bytes
    unstamped_seen: UnstampedSeen | None = None
    # (commit time, xid8) of the last transaction taken before any held back: once this batch
    # is committed in Kafka, the shard's next claims start past it (ShardWorker._claimed_past)
    claimed_through: tuple[datetime, str] | None = None

    @property
    def committed(self) -> list[Row]:
        return [r for tx in self.transactions for r in tx]

    def full(self, batch_size: int) -> bool:
        """A whole batch of records, by count or by bytes: more may be waiting."""
        return self.bytes_full or sum(len(tx) for tx in self.transactions) >= batch_size


@dataclass(frozen=True)
class Unstamped:
    """The usual round's claim, which stamps nothing (relay.sql, relay_claim with `inline`): it
    reads the shard's committed rows from `since` up to the xid horizon unstamped, with their
    commit times looked up, and holds back by the unstamped rows of the owned shards (`lo`,
    `hi`) above that horizon. Then it counts what is left unstamped below (UnstampedSeen)."""

    since: str  # xid8: every committed row of the owned shards below it is stamped
    lo: list[int]
    hi: list[int]
    limit: int  # more unstamped rows than this below the horizon: a backlog, to be stamped
    resets: int  # the relay's count of stamp resets when it was made (Relay._stamp_all_again)


@dataclass(frozen=True)
class UnstampedSeen:
    """What an unstamped claim left unstamped below the xid horizon of its pipeline's last
    statement: more rows than the limit (`backlog`) or not, and the lowest transaction id."""

    horizon: str  # xid8
    lowest: str | None  # xid8; None: nothing
    backlog: bool
    resets: int
    held_by_horizon: bool = False  # committed rows wait above the horizon


@dataclass(frozen=True)
class OutElsewhere:
    """Transactions other shards of the relay committed in Kafka, whose rows are being ended."""

    spanning: list[str]  # with rows in more than one shard: the claims leave them out
    all: list[str]  # every one: no transaction waits for them (ShardWorker._may_send)


@dataclass
class _ClaimAhead:
    """The next claim, made on the claimer's connection while a full batch waits for Kafka."""

    batch: Future[_Batch]
    valid: bool = False  # set once the batch before it is committed in Kafka


@dataclass
class _Ending:
    """A batch committed in Kafka whose rows are being ended (relay/background.py)."""

    markers: list[Ended]
    next_offset: int  # in the marker partition, past its markers
    lease_params: dict[str, Any]
    xids: list[str]  # its transactions and rows, kept out of the next claim meanwhile
    ids: list[int]
    # Those of `xids` whose records all went (none parked), and of those, the ones with rows
    # in other shards too: what the relay's other shards count as out (OutElsewhere). One
    # with a parked record is left out, as when the end parked it: the other shards wait for
    # its end, a wait at most, now that its poison is parked before its Kafka commit.
    out: list[str]
    spanning: list[str]
    wake_relays: bool = False  # the end wakes the other relays (ShardWorker.wake_relays)
    changed: Future[int] | None = None  # rows changed by hand meanwhile, once ended


def _range_params(shard: int, shards: int) -> dict[str, int]:
    lo, hi = shard_range(shard, shards)
    return {"lo": lo, "hi": hi}


def _partitions_now(topics: Topics, topic: str, looked_up: dict[str, int]) -> int:
    """The topic's partitions as the broker says them now (0: none; -1: no answer to trust, so
    the broker's own words stand), looked up once a batch."""
    if topic not in looked_up:
        try:
            looked_up[topic] = topics.partitions(topic, refresh=True)
        except KafkaException:
            looked_up[topic] = -1
    return looked_up[topic]


class ShardWorker:
    def __init__(
        self,
        lease: Lease,
        settings: RelaySettings,
        schema: str,
        relay_id: str,
        kafka_conf: dict[str, Any],
        topics: Topics,
        ender: BackgroundConnection | None = None,
        claimer: BackgroundConnection | None = None,
        outbox: str | None = None,
        *,
        ending_elsewhere: Callable[[], OutElsewhere],
        stopping: Callable[[], bool] = lambda: False,
        marks_shipping: bool = True,
    ) -> None:
        # Its epoch only: where its markers are recorded up to is read from the lease row
        # (_lock_lease), which batch ends and idle moves keep current.
        self.lease = lease
        self.outbox = outbox  # the `outbox` of its marker messages (relay/markers.py)
        self._outbox_header = None if outbox is None else outbox.encode()  # and of its records
        self.shard = lease.shard
        self.settings = settings
        self.schema = schema
        self.relay_id = relay_id
        self.kafka_conf = kafka_conf
        self.topics = topics
        self.marker_partition = marker_partition(self.shard, settings.op_marker_partitions)
        self.key_range = _range_params(self.shard, settings.shards)
        self.producer = ShardProducer(
            kafka_conf,
            f"{settings.transactional_id_prefix}-{self.shard}",
            settings.kafka_transaction_timeout,
        )
        # the relay stops: a recovery's waits (the producer's init, a marker read stuck behind
        # an open transaction), each up to kafka_transaction_timeout, are cut short
        self._stopping = stopping
        # the schema has shipping_since (SHIPPING_CLAIM_VERSION): discarded rows are marked as
        # they are taken, so that no re-arm or resolve sends them out a second time. Set by the
        # relay once a migration brought it (a claim ahead reads it on its thread: a bool)
        self.marks_shipping = marks_shipping
        self.needs_recovery = True
        self.closed = False  # handed over or dropped: a heartbeat may do it mid-recovery
        self.failures = 0  # rounds failed in a row; the relay backs this shard off until retry_at
        self.retry_at = 0.0
        # dead-letter copies refused, by row id: (the form to send next, why the larger one was
        # refused); kept until the row's marker is committed, whatever aborts meanwhile
        self._copy_refused: dict[int, tuple[int, str | None]] = {}
        self._copy_form: dict[int, tuple[int, str | None]] = {}  # of each copy in the transaction
        # The dead-letter copies' forms (by row id) of a batch whose commit's outcome is
        # unknown: counted by the recovery that finds the batch's markers committed.
        self._copies_in_doubt: dict[int, int] = {}
        # records refused in a batch too large for their topic: each goes again in a batch of
        # its own, and only one refused alone is parked
        self._alone: set[int] = set()
        # records the broker refused as of an unknown topic that was there once looked up (made
        # again meanwhile): each goes again once, and is parked only if refused so again
        self._unknown_topic_retried: set[int] = set()
        self._markers_alone = False  # each marker message in a batch of its own (_markers_refused)
        self._marker_topic_id: str | None = None  # as recovery found it; recorded with offsets
        # Until then the dead-letter topic is taken to refuse everything (DeadLetterUnwritable):
        # the rows that need a copy there wait, and the rest of the shard goes on.
        self._dead_letter_blocked_until = 0.0
        self.ender = ender  # None: each batch's rows are ended before deliver_once returns
        self.claimer = claimer  # None: no claim is made ahead (see deliver_once)
        # the other shards' out_for_other_shards() (see _out_elsewhere)
        self._ending_elsewhere = ending_elsewhere
        # Set by the relay while other relays hold shards: each end wakes them, as one may hold
        # a transaction back for this batch (waiting, it would poll, ever longer while it sends
        # nothing: two relays drained small transactions spanning their shards 5x slower than one).
        self.wake_relays = False
        self._ending: _Ending | None = None  # the last batch, while the ender ends its rows
        self._claim_ahead: _ClaimAhead | None = None  # the next claim, made during the last batch
        # Where the usual round's claim starts reading stamped rows (relay.sql, relay_claim's
        # `after_ts`): past the transactions of batches committed in Kafka. Only a stamp can put
        # a row before it (rows that became visible after a later commit, or put back by hand),
        # and a round that stamps claims from the first row; so does a shard after recovery.
        self._claimed_past: tuple[datetime, str] | None = None
        self._claim_limit = settings.batch_size  # rows of its own the next claim reads
        self._claim_bytes = settings.batch_max_bytes  # and their bytes (_next_claim_bytes)
        self._marker_offset_moved_at = time.monotonic()
        if lease.marker_partition not in (None, self.marker_partition):
            raise RuntimeError(
                f"shard {self.shard} recorded its op markers in partition "
                f"{lease.marker_partition}, now it would be {self.marker_partition}: "
                "op_marker_partitions must not change while records are in flight"
            )

    def _q(self, name: str) -> bytes:
        return queries.query(name, self.schema)

    def _lease_params(self) -> dict[str, Any]:
        return {"shard": self.shard, "owner": self.relay_id, "epoch": self.lease.epoch}

    # --- recovery ---------------------------------------------------------------------------

    def recover(
        self, conn: psycopg.Connection[Any], keep_alive: Callable[[], None] | None = None
    ) -> int:
        """Fence older producers of this shard, then end the rows whose markers are committed."""
        self.settle_quietly()  # its rows end either way: there, or from its markers here
        with conn.transaction():  # first: a relay that lost the lease must not fence its heir
            # As recorded now, not when the lease was taken: batch ends and idle shards have
            # moved it on since, and the markers before it may be gone (retention).
            recorded_partition, recorded_offset = self._lock_lease(conn)
            row = conn.execute(self._q("relay_marker_writer"), {"shard": self.shard}).fetchone()
            recorded_outbox, recorded_producer, recorded_topic, recorded_id = row or (None,) * 4
        topic = self.settings.op_marker_topic
        if recorded_partition is not None and recorded_topic not in (None, topic):
            # its offset would be read in another log: one that ran past it (a topic used
            # before, switched back to) yields none of the markers of a batch in doubt
            raise MarkersNotFound(
                f"shard {self.shard} recorded its op markers in topic {recorded_topic}, not "
                f"{topic}: relay.op_marker_topic changed. Run the relays with the topic they "
                "wrote to; to go on with this one, accepting that a batch in doubt may go "
                "again (none is if every relay stopped cleanly), stop every relay and empty "
                "shard_lease"
            )
        self._marker_topic_id = self.topics.topic_id(topic)
        recorded = recorded_partition is not None and recorded_id is not None
        if recorded and self._marker_topic_id is None:
            if self.topics.partitions(topic, refresh=True):
                # The two look-ups disagree (a broker's metadata still settling, say): this
                # recovery fails and goes again, where a refusal would stop the relay for good.
                raise KafkaException(
                    KafkaError(
                        KafkaError.UNKNOWN_TOPIC_OR_PART,
                        f"op-marker topic {topic}: described as missing, listed as there; "
                        "recovery goes again",
                    )
                )
            raise MarkersNotFound(
                f"shard {self.shard} recorded its op markers in topic {topic}, which is "
                "missing (or the relay's principal may no longer see it: its ACLs); if it "
                "was deleted, the markers of a batch in doubt went with it. To go on, "
                "accepting that such a batch may go again (none is if every relay stopped "
                "cleanly), stop every relay and empty shard_lease"
            )
        if recorded_partition is not None and recorded_id not in (None, self._marker_topic_id):
            raise MarkersNotFound(
                f"shard {self.shard} recorded its op markers in topic {topic} of id "
                f"{recorded_id}, and the topic of that name now has id {self._marker_topic_id}: "
                "it was deleted and made again, and the markers of a batch in doubt went with "
                "it. To go on, accepting that such a batch may go again (none is if every "
                "relay stopped cleanly), stop every relay and empty shard_lease"
            )
        if keep_alive is not None:
            keep_alive = self._while_held(keep_alive)
        if recorded_producer not in (None, self.producer.transactional_id):
            self._fence_earlier_producer(recorded_producer, keep_alive)
        self.producer.init(self._stopping, keep_alive)
        # A lease that never recovered never shipped: no marker is this shard's yet (a new
        # lease row, or one made anew for a new shard count), and its offset 0 would mean
        # reading the partition's whole history, other shards' traffic included.
        first = recorded_partition is None
        start_offset = None if first else recorded_offset
        renamed = recorded_outbox if recorded_outbox not in (None, self.outbox) else None
        if renamed is not None:
            logger.warning(
                "shard %s: its op markers were written as outbox %s, which is now %s (the "
                "database or schema renamed): they are still its own",
                self.shard,
                renamed,
                self.outbox,
            )
        markers, end_offset = self._read_markers(start_offset, keep_alive, renamed)
        by_kind: dict[tuple[Op, str], list[OpMarker]] = {}
        for marker in markers:
            by_kind.setdefault((marker.op, marker.topic), []).append(marker)
        ended_by_kind: Counter[tuple[Op, str]] = Counter()
        unmatched: list[OpMarker] = []
        with conn.transaction():
            self._lock_lease(conn)
            # Rows ended before the crash or changed by hand since do not count; by kind, so
            # that the records these ends deliver are counted as a batch end counts its own
            # (uncounted, a recovery's showed nowhere in the delivered and ended totals).
            for kind, of_kind in by_kind.items():
                ended, other = self._end_recovered(conn, of_kind)
                ended_by_kind[kind] += ended
                unmatched += other
            self._say_other_records(conn, unmatched)
            if not first:  # no markers read: a mark may stand for copies sent
                self._unmark_not_shipped(conn)
            conn.execute(
                self._q("relay_set_marker_offset"),
                {
                    **self._lease_params(),
                    "partition": self.marker_partition,
                    "offset": end_offset,
                    "outbox": self.outbox,
                    "transactional_id": self.producer.transactional_id,
                    "topic": self.settings.op_marker_topic,
                    "topic_id": self._marker_topic_id,
                },
            )
        for (op, topic), count in ended_by_kind.items():
            if count and op is Op.DELIVERED:
                metrics.DELIVERED.labels(topic).inc(count)
            if count:
                metrics.ENDED.labels(op.value).inc(count)
        ended = ended_by_kind.total()
        # A Kafka transaction is whole: one marker of the batch in doubt read back (from the
        # offset recorded at the last batch's end, so not an earlier marker of its ids) says it
        # committed, copies and all; none, that it was aborted, and its copies go again.
        if self._copies_in_doubt and not {m.id for m in markers} & self._copies_in_doubt.keys():
            self._copies_in_doubt = {}
        self._count_copies()
        self.needs_recovery = False
        self._claimed_past = None  # the rows of a batch that failed go again
        metrics.RECOVERIES.inc()
        logger.info(
            "shard %s recovered: %s committed markers from offset %s, %s rows ended by them",
            self.shard,
            len(markers),
            start_offset,
            ended,
        )
        return len(markers)

    def _while_held(self, keep_alive: Callable[[], None]) -> Callable[[], None]:
        """`keep_alive`, then LeaseLost if it handed this shard over or dropped it (a heartbeat
        rebalances): the init waiting meanwhile is given up, else it fenced the next owner's
        producer when it ended."""

        def kept() -> None:
            keep_alive()
            if self.closed:
                raise LeaseLost(f"shard {self.shard} was handed over during its recovery")

        return kept

    def _fence_earlier_producer(
        self, transactional_id: str, keep_alive: Callable[[], None] | None = None
    ) -> None:
        """Fence the producer the shard's markers were last written with, another than ours
        (relay.transactional_id_prefix changed): Kafka fences only a producer of the same
        transactional.id, and a relay of the old prefix, paused with a batch claimed, woke
        after the lease moved, committed that batch, and its records went out twice."""
        logger.warning(
            "shard %s: its op markers were last written by producer %s, this relay's is %s "
            "(relay.transactional_id_prefix changed): fencing that one first",
            self.shard,
            transactional_id,
            self.producer.transactional_id,
        )
        earlier = ShardProducer(
            self.kafka_conf, transactional_id, self.settings.kafka_transaction_timeout
        )
        try:
            earlier.init(self._stopping, keep_alive)  # aborts its open transaction, fences it
        except ProducerMisconfigured as exc:
            raise ProducerMisconfigured(
                f"shard {self.shard} cannot go on until the producer its op markers were last "
                f"written with, {transactional_id} (of the relay.transactional_id_prefix before "
                "it changed), is fenced, and Kafka refuses the relay that: "
                f"{exc}. Keep the relay's principal allowed WRITE and DESCRIBE on the old "
                "transactional ids until every relay has taken its shards over once"
            ) from exc
        finally:
            earlier.close()

    def _read_markers(
        self,
        start: int | None,
        keep_alive: Callable[[], None] | None = None,
        former_name: str | None = None,
    ) -> tuple[list[OpMarker], int]:
        """This shard's committed markers from `start` to the end of the log, and that end;
        those named `former_name` are its own too (written before a rename)."""
        tp = TopicPartition(self.settings.op_marker_topic, self.marker_partition)
        consumer: Consumer | None = None
        try:
            # Not the consumer's watermark: read_committed, that stops at the first open
            # transaction (another shard's, another relay's), and this batch's markers after
            # it were never read: the batch went again.
            high = self.topics.log_end(tp.topic, tp.partition)
            if start is not None and start > high:
                # Read from here, it would find none of the markers of a batch in doubt, and
                # send that batch again.
                raise MarkersNotFound(
                    f"shard {self.shard} recorded its op markers up to offset {start} of "
                    f"{tp.topic}:{tp.partition}, which ends at {high}: this is not the topic they "
                    "went to (relay.op_marker_topic changed, or the topic was made anew). Run the "
                    "relays with the topic they wrote to; to go on with this one, accepting that "
                    "a batch in doubt may go again, stop every relay and empty shard_lease"
                )
            if start is not None and start < high:
                low = self.topics.log_start(tp.topic, tp.partition)
                if start < low:
                    # The markers of a batch in doubt may be among those gone: read from the
                    # log start, that batch went again; read from `start`, the consumer was
                    # stuck for good behind green probes.
                    raise MarkersNotFound(
                        f"shard {self.shard} recorded its op markers from offset {start} of "
                        f"{tp.topic}:{tp.partition}, which now starts at {low}: markers were "
                        "deleted (the topic's retention.ms passed while no relay ran, or "
                        "delete-records), and a batch sent before the stop could go again. "
                        "Keep op_marker_retention above the longest outage. To go on, accepting "
                        "that such a batch may go again (none is in doubt if every relay "
                        "stopped cleanly), stop every relay and empty shard_lease"
                    )
            if start is None or start >= high:
                return [], high
            group = f"{self.settings.recovery_group_prefix}{uuid.uuid4().hex}"
            consumer = Consumer(recovery_consumer_conf(self.kafka_conf, group))
            consumer.assign([TopicPartition(tp.topic, tp.partition, start)])
            markers: list[OpMarker] = []
            wait = self.settings.kafka_transaction_timeout.total_seconds()
            deadline, last = time.monotonic() + wait, None
            # read_committed stops at the last stable offset: wait until every transaction
            # below the high watermark (ours and other shards') is decided. Stuck means no
            # progress for that long, not a long read: a first recovery reads the partition's
            # history, which other shards' traffic can make days long.
            while True:
                position = consumer.position([tp])[0].offset
                if position >= high:
                    break
                if position != last:
                    deadline, last = time.monotonic() + wait, position
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"op markers of shard {self.shard} not readable up to {high} "
                        f"(stuck at {position}): a transaction on the marker topic stays open"
                    )
                if keep_alive is not None:
                    keep_alive()  # a long read must not let this relay's leases lapse
                if self._stopping():
                    raise ShuttingDown("the relay stops: this shard's recovery is left to the next")
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    if error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
                        # The group is only named (the Python client will not make a consumer
                        # without one); an assignment at an offset fetches without it, and
                        # commits nothing. Its coordinator's look-up, refused, came in at
                        # random against the read: some recoveries stopped the relay for an
                        # ACL they did not need, others went on.
                        continue
                    if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                        raise MarkerTopicRefused(  # for every shard: stop, saying so
                            f"a recovery cannot read the op markers back ({error.str()}): the "
                            f"relay's principal needs READ on {tp.topic}"
                        )
                    raise KafkaException(error)
                foreign = False
                try:
                    found = decode_markers(msg.value() or b"", self.shard)
                except MarkerTooNew as exc:
                    if exc.outbox not in (None, self.outbox or exc.outbox, former_name):
                        found = []  # another outbox's: said below as its other markers are
                        foreign = True
                    else:
                        raise MarkerTooNew(
                            f"shard {self.shard}: message {tp.partition}:{msg.offset()} of the "
                            f"op-marker topic {tp.topic}: {exc}. The rows it ends cannot be "
                            "told, and sending them again would send them twice: the shard "
                            "waits until this relay is upgraded, or the newer relays rolled "
                            "back (or, accepting that a batch in doubt may go again, stop "
                            "every relay and empty shard_lease)",
                            exc.outbox,
                        ) from None
                except MarkerFormatError as exc:
                    # Not written by a relay (Kafka checks each message's CRC, so not a damaged
                    # one of ours): it ends no row. Stopping here would stop the shard for good.
                    logger.warning(
                        "skipped message %s:%s of the op-marker topic: %s",
                        tp.partition,
                        msg.offset(),
                        exc,
                    )
                    metrics.ERRORS.labels("marker_format").inc()
                    continue
                ours = [
                    m for m in found if m.outbox in (None, self.outbox or m.outbox, former_name)
                ]
                if len(ours) < len(found) or foreign:
                    # Another outbox's, on a marker topic shared by mistake: its ids are not
                    # ours, and ending our rows by them dropped records never sent.
                    logger.error(
                        "shard %s: op markers of another outbox at %s:%s of %s: give each "
                        "outbox its own op-marker topic; they end none of this one's rows (if "
                        "this outbox's database or schema was renamed before its relays "
                        "recorded its name, stop them cleanly before a rename)",
                        self.shard,
                        tp.partition,
                        msg.offset(),
                        tp.topic,
                    )
                    metrics.ERRORS.labels("foreign_markers").inc()
                markers.extend(ours)
            return markers, high
        finally:
            if consumer is not None:
                consumer.close()

    # --- claim ------------------------------------------------------------------------------

    def _claim(
        self,
        conn: psycopg.Connection[Any],
        hold_back: datetime | None,
        skip_xids: list[str],
        skip_ids: list[int],
        unstamped: Unstamped | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int | None = None,
        out_elsewhere: OutElsewhere | None = None,
        max_bytes: int | None = None,
    ) -> _Batch:
        """The next committed transactions in commit order, and the rows waiting for their op
        marker (rolled back, discarded, parked), leaving out `skip_xids` (transactions) and
        `skip_ids` (rows waiting for their marker) of batches committed, or being committed,
        in Kafka whose rows are not ended yet, and stamped rows up to `after` (commit time,
        xid8; see _claimed_past). `limit`: how many rows of this shard pick the transactions
        (the batch size when None). `out_elsewhere`: see _out_elsewhere. Thread-safe: reads
        no state that changes but the dead-letter topic's back-off (a float: see _taken).
        Raises LeaseLost if the lease was taken and it read discarded rows (see _taken).

        A transaction that must wait (another shard sends it, or an earlier row of one of its
        keys is still to go out from another shard) is held back, and so is every later one
        that shares a key with it; the others go. Per-key order is commit order either way."""
        s = self.settings
        batch = _Batch()
        out = out_elsewhere or OutElsewhere([], [])
        by_tx: dict[str, list[Row]] = {}  # in commit order: the query sorts, dicts keep order
        # For the claim's own hold-back, read before its snapshot. Also for a claim given its
        # hold-back: its generic plan has both branches, and planning reads the list's length.
        conn.execute(self._q("relay_running_xids"))
        conn.execute(self._q("relay_claim_plan"))
        # Prepared as psycopg prepares (its 5th run on a connection), then run with a generic
        # plan (see relay_claim_plan): planned once, not per claim.
        claimed = conn.execute(
            self._q("relay_claim"),
            {
                **self.key_range,
                "hold_back": hold_back,
                "limit": limit or s.batch_size,
                "max_bytes": max_bytes or s.batch_max_bytes,
                # only those that may have rows here: a generic plan checks each row it reads
                # against the whole array (Postgres hashes only a constant one)
                "ending": pgarray.words(skip_xids + out.spanning),
                "inline": unstamped is not None,
                "stamped_below": unstamped.since if unstamped else "0",
                "lo_all": unstamped.lo if unstamped else [],
                "hi_all": unstamped.hi if unstamped else [],
                "after_ts": after[0] if after else "-infinity",
                "after_xid": after[1] if after else "0",
            },
            binary=True,
        )
        conn.execute(self._q("relay_claim_planned"))
        unmarked = self._unmarked(conn, skip_ids)  # in a pipeline: one round trip with the claim
        seen = None
        if unstamped is not None:
            seen = conn.execute(
                self._q("relay_unstamped_below"),
                {
                    "lo": unstamped.lo,
                    "hi": unstamped.hi,
                    "stamped_below": unstamped.since,
                    "limit": unstamped.limit,
                    "ending": pgarray.words(skip_xids + out.all),
                },
                prepare=False,
            )
        rows = claimed.fetchall()  # one call into the C loader, not one per row
        for r in rows:
            row = Row.from_db(r, state="committed", committed_xid=r[9], commit_ts=r[10], size=r[12])
            by_tx.setdefault(r[9], []).append(row)
        if limit is not None and limit < s.batch_size:
            lo, hi = self.key_range["lo"], self.key_range["hi"]
            batch.cut_short = sum(1 for r in rows if lo <= r[8] <= hi) >= limit
        earliest = self._earliest_elsewhere(conn, by_tx, skip_xids + out.all)
        waiting_keys: set[int] = set()  # keys of the transactions held back
        count = size = 0
        for xid, tx_rows in by_tx.items():
            commit_ts = tx_rows[0].commit_ts
            assert commit_ts is not None  # the claim gives every row its transaction's
            keys = {r.key_hash for r in tx_rows}
            if not waiting_keys.isdisjoint(keys) or not self._may_send(
                tx_rows, (commit_ts, int(xid)), earliest
            ):
                waiting_keys |= keys
                batch.held_back += 1
                batch.held_back_bytes += sum(r.size for r in tx_rows)
                continue
            for row in tx_rows:  # rows another shard's relay has not stamped: the same time
                row.commit_ts = commit_ts
            batch.transactions.append(tx_rows)
            if not batch.held_back:  # none before it is left behind
                batch.claimed_through = (commit_ts, xid)
            count += len(tx_rows)
            size += sum(r.size for r in tx_rows)
            if size >= s.batch_max_bytes:
                batch.bytes_full = True
                break
            if count >= s.batch_size:
                break
        batch.ended = self._taken(
            conn, [Row.from_db(r, state=r[9], reason=r[10], size=r[11]) for r in unmarked]
        )
        batch.ended_full = len(batch.ended) >= s.batch_size or (
            sum(r.size for r in batch.ended) >= s.batch_max_bytes
        )
        if seen is not None and unstamped is not None:
            horizon, left, lowest, above = seen.fetchone()  # type: ignore[misc]
            batch.unstamped_seen = UnstampedSeen(
                horizon, lowest, left > unstamped.limit, unstamped.resets, bool(above)
            )
        return batch

    def _taken(self, conn: psycopg.Connection[Any], ended: list[Row]) -> list[Row]:
        """The rows to end, less the discarded ones an operator re-armed or resolved since the
        claim read them, or is changing right now (shipped in a later round if they are still
        discarded then); those left are marked as taken (shipping_mark). A round trip more,
        only in a claim that read discarded rows."""
        discarded = [r.id for r in ended if r.state == "discarded"]
        if not discarded or not self.marks_shipping:
            return ended
        if self._dead_letter_blocked_until > time.monotonic():
            # Not shipped now (_ship leaves them): marked, they were refused to operators for
            # as long as the topic refused their copies. Left out here, not in _ship only: a
            # claim ahead must not leave them unmarked for a _ship the block has ended by.
            return [r for r in ended if r.state != "discarded"]
        conn.execute(self._q("relay_shipping_mark_waits"))  # in the claim's pipeline: no round trip
        marking = conn.execute(
            self._q("shipping_mark"),
            {"ids": pgarray.integers(discarded), **self._lease_params()},
            prepare=False,
        ).fetchone()
        held, marked = marking if marking is not None else (False, [])
        if not held:  # the heir's rows now: its recovery unmarked what it does not ship
            raise LeaseLost(f"shard {self.shard} (epoch {self.lease.epoch}) is no longer ours")
        taken = {int(i) for i in marked}
        if len(taken) < len(discarded):
            logger.info(
                "shard %s: discarded records %s not shipped now: an operator is changing them, "
                "or has (re-armed or resolved)",
                self.shard,
                sorted(set(discarded) - taken),
            )
        return [r for r in ended if r.state != "discarded" or r.id in taken]

    def _unmark_not_shipped(self, conn: psycopg.Connection[Any]) -> None:
        """At recovery: the shard's discarded rows marked as taken (_taken) in a Kafka
        transaction that did not commit, aborted or fenced by now. A dead-letter topic that
        refuses copies for good (its ACL) left them marked, and operators' re-arms and resolves
        refused, for as long as it refused (shipping_unmark)."""
        if not self.marks_shipping:
            return
        unmarked = conn.execute(self._q("shipping_unmark"), self.key_range).fetchall()
        if unmarked:
            logger.info(
                "shard %s: discarded records %s were taken to ship in a Kafka transaction that "
                "did not commit: operators may change them again until they are shipped",
                self.shard,
                sorted(int(i) for (i,) in unmarked),
            )

    def _earliest_elsewhere(
        self, conn: psycopg.Connection[Any], by_tx: dict[str, list[Row]], skip_xids: list[str]
    ) -> dict[int, tuple[datetime, int]]:
        """For the keys of other shards in the transactions this shard would send: the earliest
        committed row of each key that is neither in this claim nor in `skip_xids`."""
        n = self.settings.shards
        keys: set[int] = set()
        until: tuple[datetime | None, str] | None = None
        for xid, tx_rows in by_tx.items():
            elsewhere = {r.key_hash for r in tx_rows if shard_of(r.key_hash, n) != self.shard}
            if elsewhere and self._home(tx_rows) == self.shard:
                keys |= elsewhere
                until = (tx_rows[0].commit_ts, xid)
        if until is None:
            return {}
        rows = conn.execute(
            self._q("relay_earliest_of_keys"),
            {
                "keys": pgarray.integers(sorted(keys)),
                "until_ts": until[0],
                "until_xid": until[1],
                "skip": pgarray.words([*by_tx, *skip_xids]),
            },
            prepare=False,
        ).fetchall()
        return {key_hash: (ts, int(xid)) for key_hash, ts, xid in rows}

    def _own(self, tx_rows: list[Row]) -> bool:
        """Whether all of a transaction's rows are in this shard."""
        n = self.settings.shards
        return all(shard_of(r.key_hash, n) == self.shard for r in tx_rows)

    def _home(self, tx_rows: list[Row]) -> int:
        """The shard that sends a transaction: that of its first row (the same for every relay)."""
        return shard_of(min(tx_rows, key=lambda r: r.id).key_hash, self.settings.shards)

    def _unmarked(self, conn: psycopg.Connection[Any], skip_ids: list[int]) -> psycopg.Cursor[Any]:
        return conn.execute(
            self._q("relay_unmarked"),
            {
                **self.key_range,
                "limit": self.settings.batch_size,
                "max_bytes": self.settings.batch_max_bytes,
                "ending": pgarray.integers(skip_ids),
            },
            binary=True,
            prepare=False,
        )

    def _may_send(
        self,
        tx_rows: list[Row],
        at: tuple[datetime, int],
        earliest: dict[int, tuple[datetime, int]],
    ) -> bool:
        """Whether this shard sends the transaction now: it is this shard's alone, or this shard
        is its home and no earlier row of its keys in other shards is still to go out."""
        if self._own(tx_rows):
            return True
        if self._home(tx_rows) != self.shard:
            return False  # its home shard sends it; its keys here wait behind it
        for row in tx_rows:
            first = earliest.get(row.key_hash)
            if first is not None and first < at:
                return False
        return True

    # --- delivery ---------------------------------------------------------------------------

    def deliver_once(
        self,
        conn: psycopg.Connection[Any],
        hold_back: datetime | None,
        keep_alive: Callable[[], None] | None = None,
        *,
        claim_ahead: bool = False,
        unstamped: Unstamped | None = None,
        while_shipping: Callable[[], None] | None = None,
    ) -> ShardRound:
        """One batch: claim (or take the claim made during the last batch), send, commit.

        `claim_ahead` (the relay's loop, in a drain): while a full batch waits for Kafka's reports
        and commit, the claimer claims the next one, which the next round takes if that batch
        committed. `unstamped`: the usual round, which stamps nothing (see Unstamped).
        `while_shipping` is called while the batch waits for Kafka's reports, and before its commit;
        `keep_alive` in a recovery's long reads."""
        if self._ending is not None and self._ending.changed and self._ending.changed.done():
            self.settle_quietly()  # if it failed, recovery now, not a batch claimed around it
        batch = self._take_claim_ahead()
        if self.needs_recovery:
            self.recover(conn, keep_alive)
        if unstamped is None:  # a round that stamped: rows may be stamped before _claimed_past
            self._claimed_past = None
            if batch is not None:  # claimed before that stamp
                batch.claimed_through = None
        if batch is None:
            with pipelined_transaction(conn):  # 2 round trips
                skips = self._ending_skips()
                batch = self._claim(
                    conn,
                    hold_back,
                    *skips,
                    unstamped,
                    self._claimed_past,
                    self._claim_limit,
                    self._out_elsewhere(),
                    self._claim_bytes,
                )
        self._claim_limit = self._next_claim_limit(batch)
        self._claim_bytes = self._next_claim_bytes(batch)
        claim_next = None
        if claim_ahead and self.claimer is not None:
            claim_next = functools.partial(self._start_claim_ahead, hold_back, unstamped, batch)
        try:
            return self._ship(conn, batch, claim_next, while_shipping)
        except Exception as exc:
            kafka = isinstance(exc, (KafkaException, OutcomeUnknown, Fenced, ProducerFailed))
            too_long = self.producer.open_for() > self.producer.timeout_s
            gone = (Fenced, ProducerFailed, ShuttingDown)  # dead, or aborted already
            if self.producer.abortable and not isinstance(exc, gone):
                # Left open until the shard recovers, after its backoff (or, the relay stopped,
                # until the broker's timeout), it held back the stable offset of its partitions:
                # read_committed consumers saw nothing there, other shards' records included.
                self._abort(timeout_s=STOP_ABORT_S)
            if kafka and batch.transactions and too_long:
                # Whatever Kafka said (a delivery report missing, a message timed out, a fencing
                # by the coordinator's abort), the cause is the transaction's length.
                raise self._timed_out(batch, exc) from exc
            raise

    def _timed_out(self, batch: _Batch, exc: Exception) -> TransactionTimedOut:
        """Says what the batch held. A batch larger than batch_size holds a transaction that
        large (a claim stops at batch_size, but takes a transaction whole): the next claim
        then takes the first transaction alone (a limit of one row picks one transaction)."""
        timeout = f"{self.producer.timeout_setting} ({self.producer.timeout_s:g}s)"
        seen = exc.symptom if isinstance(exc, TransactionTimedOut) else str(exc)
        records = sum(len(tx) for tx in batch.transactions)
        if records <= self.settings.batch_size:  # as any batch: Kafka is slow, not the batch
            return TransactionTimedOut(
                f"a batch of {records:,} records was not sent within {timeout} ({seen}): Kafka "
                f"was slow or unreachable, or batch_size ({self.settings.batch_size}) is too "
                "large for the timeout"
            )
        self._claim_limit = 1
        largest = max(batch.transactions, key=len)
        size = sum(len(r.key or b"") + len(r.value or b"") for r in largest)
        what = (
            f"outbox transaction {largest[0].tx_id!r} of producer group "
            f"{largest[0].producer_group!r} ({len(largest):,} records, {size:,} bytes of keys "
            "and values)"
        )
        if len(batch.transactions) > 1:
            return TransactionTimedOut(
                f"a batch of {records:,} records of {len(batch.transactions)} outbox "
                f"transactions was not sent within {timeout} ({seen}). The largest was {what}; "
                "the next round sends the first one alone"
            )
        return TransactionTimedOut(
            f"{what} was not sent within {timeout}, in a batch of its own ({seen}). All the "
            "records of an outbox transaction go in one Kafka transaction: it goes again every "
            "round, and this shard's later records wait behind it. Raise "
            f"{self.producer.timeout_setting} (up to the broker's transaction.max.timeout.ms, "
            "15 minutes by default), or send such records in smaller transactions"
        )

    def _keep_marker_offset_recent(
        self, conn: psycopg.Connection[Any], *, now: bool = False, timeout_s: float = 10.0
    ) -> bool:
        """With no batch of this shard between its Kafka commit and its end, none of its
        markers is needed from before the partition's end: record that end (every hour, or
        `now`). Only forward, so a topic made anew is still told apart by recovery. False when
        Kafka or Postgres failed it."""
        if (
            self._ending is not None
            or self.needs_recovery
            or (
                not now
                and time.monotonic() - self._marker_offset_moved_at < MARKER_OFFSET_REFRESH_S
            )
        ):
            return True
        self._marker_offset_moved_at = time.monotonic()  # tried again in as long if it fails
        try:
            end = self.topics.log_end(
                self.settings.op_marker_topic, self.marker_partition, timeout_s=timeout_s
            )
            with conn.transaction():
                conn.execute(
                    self._q("relay_advance_marker_offset"),
                    {**self._lease_params(), "partition": self.marker_partition, "offset": end},
                )
        except (KafkaException, psycopg.Error) as exc:
            logger.warning("shard %s: its marker offset was not moved on: %s", self.shard, exc)
            return False
        return True

    def _next_claim_limit(self, batch: _Batch) -> int:
        """How many rows of this shard the next claim reads. All of a batch when nothing was
        held back; after a round that held transactions back, twice what it sent, or, when it
        sent nothing, twice as many as it read if they filled it (else as many). A load whose
        transactions span shards holds most of a claim back (each transaction is sent by one
        shard, and the later ones of its keys wait behind it): reading a whole batch's
        transactions, with their rows in every shard, to send a few of them made each round
        read many times what it sent. A shorter claim is the same prefix in commit order, so
        what goes out, and in which order, does not change; only how much a round reads."""
        size = self.settings.batch_size
        if not batch.held_back:
            return size if self._claim_limit >= size // 2 else self._claim_limit * 2
        if not batch.committed:
            # Held-back transactions filled the whole claim: the shard's other keys, behind
            # them, were never read while those waited (a large transaction of another shard's
            # relay, or one dead until its lease expires). Read further each round instead,
            # and as far again while they wait (shrunk, it grew back every held-back wait).
            return min(size, 2 * self._claim_limit) if batch.cut_short else self._claim_limit
        return max(min(MIN_CLAIM_LIMIT, size), min(size, 2 * len(batch.committed)))

    def _next_claim_bytes(self, batch: _Batch) -> int:
        """The next claim's batch_max_bytes. The claim counts the bytes of transactions it then
        holds back (they wait for another shard): a large one that waited took the whole budget,
        and the shard's other keys never reached the claim. So the next claim reads past what
        this one held back, up to twice the budget (memory stays bounded; beyond that, as with
        batch_size, the other keys wait with it)."""
        budget = self.settings.batch_max_bytes
        return budget + min(batch.held_back_bytes, budget)

    def _ending_skips(self) -> tuple[list[str], list[int]]:
        """What the next claim leaves out: the batch whose rows are being ended."""
        ending = self._ending
        return ([], []) if ending is None else (list(ending.xids), list(ending.ids))

    def _out_elsewhere(self) -> OutElsewhere:
        """Transactions the relay's other shards committed in Kafka and are ending the rows
        of: out, so not waited for. Without them, in a load of small transactions spanning
        shards, each wait for another shard cost a round more (that shard's end had not run
        yet), and a pause of HELD_BACK_POLL_S when no shard sent anything."""
        return self._ending_elsewhere()

    def out_for_other_shards(self) -> OutElsewhere:
        """Transactions of the batch committed in Kafka whose rows are being ended, all of whose
        records went (see _Ending.out)."""
        ending = self._ending
        return OutElsewhere([], []) if ending is None else OutElsewhere(ending.spanning, ending.out)

    def backoffs(self) -> list[float]:
        """When (time.monotonic()) this shard's backoffs end: its own after a failure (the relay
        skips it until then), a dead-letter topic's that refused copies (rows to end wait)."""
        return [self.retry_at, self._dead_letter_blocked_until]

    def _take_claim_ahead(self) -> _Batch | None:
        """The claim made during the last batch, if it may go: that batch committed in Kafka,
        nothing needs recovery, and it came full. A claim that did not come full is made again:
        a round that ends short must have seen every row its own stamp stamped, or rows
        committed meanwhile would wait for the poll interval. (A lease lost and gained again
        gets a new worker, so a claim is never taken under another lease.)"""
        ahead, self._claim_ahead = self._claim_ahead, None
        if ahead is None:
            return None
        if not ahead.valid or self.needs_recovery:
            return None  # made in vain; it may still run on the claimer: nothing waits for it
        try:
            batch = ahead.batch.result()
        except Exception as exc:  # the claim is made again, on the relay's connection
            logger.info("shard %s: the claim made in the background failed: %s", self.shard, exc)
            return None
        if not batch.full(self.settings.batch_size):
            return None
        return batch

    def await_claim_ahead(self) -> None:
        """Wait until the claim made ahead has run (it is then taken or dropped as usual).

        The relay calls this before its next stamp: a claim made with a stamp's hold-back
        must not see rows the next stamp stamps. With hold-back None nothing else bounds it, and a
        row stamped then can have committed after a row still unstamped of the same key."""
        if self._claim_ahead is not None:
            futures.wait([self._claim_ahead.batch])

    def _start_claim_ahead(
        self, hold_back: datetime | None, unstamped: Unstamped | None, batch: _Batch
    ) -> None:
        """Claim the batch after `batch` (sent, not committed yet) on the claimer's connection.
        It leaves out the rows of `batch` and of the batch before it, whose end may still run;
        valid once `batch` is committed. Made in a round that stamped, it claims as of that
        stamp and hold-back, so it must run before the next stamp (await_claim_ahead): then
        every row stamped later committed after the rows it returns (relay.sql,
        relay_hold_back). Made in a round that did not stamp, it bounds itself (Unstamped)."""
        assert self.claimer is not None
        skip_xids, skip_ids = self._ending_skips()
        skip_xids += [xid for tx in batch.transactions if (xid := tx[0].committed_xid)]
        skip_ids += [r.id for r in batch.ended]
        # past `batch` too: the claim is taken only if `batch` commits
        after = batch.claimed_through or self._claimed_past
        out_elsewhere = self._out_elsewhere()  # here: the claimer's thread must not read workers

        def claim(conn: psycopg.Connection[Any]) -> _Batch:
            with pipelined_transaction(conn):
                return self._claim(
                    conn, hold_back, skip_xids, skip_ids, unstamped, after, None, out_elsewhere
                )

        self._claim_ahead = _ClaimAhead(self.claimer.submit(claim))

    def _ship(
        self,
        conn: psycopg.Connection[Any],
        batch: _Batch,
        claim_next: Callable[[], None] | None = None,
        waiting: Callable[[], None] | None = None,
    ) -> ShardRound:
        """`claim_next`: starts the next claim, called once a full batch is produced. `waiting`:
        called while Kafka's reports are waited for, and before the commit."""
        committed, ended = batch.committed, batch.ended
        if self._dead_letter_blocked_until > time.monotonic():
            # Not ended, they are read again next round; other keys' records go meanwhile.
            ended = [r for r in ended if r.state not in ("discarded", "parked")]
        # Held back, but some went: those sent may be what the held-back ones wait for (when
        # this relay owns the other shard too, its round right after sends them).
        result = ShardRound(
            full=batch.full(self.settings.batch_size)
            # rows to end up to a batch, all of them ended now (a dead-letter topic that
            # refuses copies leaves some for later: no round at once for those)
            or (batch.ended_full and len(ended) == len(batch.ended))
            or bool(batch.held_back and committed)
            # more was left unread (held back and nothing sent: the next claim reads further,
            # up to a batch, where it is no longer cut short: no spinning)
            or batch.cut_short,
            held_back=batch.held_back > 0,
            unstamped_seen=batch.unstamped_seen,
        )
        if not committed and not ended:
            self._keep_marker_offset_recent(conn)
            return result

        self._check_writable(ended)
        poison = self._preflight(committed)
        _failpoints.hit(_failpoints.BEFORE_PRODUCE)
        self.producer.begin()
        sent: dict[int, Sent] = {}  # records and dead-letter copies, by row id
        # Set when the transaction failed in the background (a record the broker refused):
        # produce() then refuses everything; the refused record's report says which it was.
        doomed = False

        stop_aborted = False  # a stop met while sending aborts the batch once

        def stop_abort() -> None:
            nonlocal stop_aborted
            self.needs_recovery = True
            if not stop_aborted:
                stop_aborted = True
                self._abort(timeout_s=STOP_ABORT_S)

        def send_queued() -> None:
            try:
                self.producer.send_queued(waiting)
            except ShuttingDown:  # as in the wait for reports
                stop_abort()
                raise

        for row in committed:
            if row.id in poison:
                continue
            alone = row.id in self._alone
            try:
                if alone:
                    send_queued()  # what came before goes in batches of its own
                headers = row.kafka_headers(self._outbox_header)
                sent[row.id] = self.producer.send(
                    row.topic, row.value, row.key, headers, row.partition, tag=row
                )
                if alone:
                    send_queued()  # and this record in a batch alone
            except MalformedHeaders as exc:
                poison[row.id] = f"its {exc}"
            except KafkaException as exc:
                if _transaction_failed(exc):
                    doomed = True
                    break
                if exc.args[0].code() not in PERMANENT_RECORD_ERRORS:
                    raise
                poison[row.id] = (
                    topic_refused(row.topic)
                    if exc.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
                    else f"refused by the Kafka client: {exc.args[0].str()}"
                )
        self._copy_form.clear()
        for row in ended if not doomed else ():
            if row.state in ("discarded", "parked"):
                alone = row.id in self._alone
                try:
                    if alone:
                        send_queued()
                    copy = self._send_dead_letter(row)
                    if alone:
                        send_queued()
                except DeadLetterUnwritable:
                    self._abort()  # one that fails is logged: this is what to say
                    raise
                except KafkaException as exc:
                    if not _transaction_failed(exc):
                        raise
                    doomed = True
                    break
                if copy is not None:  # None: no form of it fits; its marker goes alone
                    sent[row.id] = copy

        # Each marker is written as soon as its record's report says where the record landed
        # (rows with nothing on a topic, rolled back, at once), many to a message; the last
        # message goes when the last report is in.
        markers: list[Ended] = []
        marker_sends: list[Sent] = []
        batcher = MarkerBatcher(
            shard=self.shard,
            relay=self.relay_id,
            epoch=self.lease.epoch,
            max_bytes=self.settings.op_marker_message_bytes,
            outbox=self.outbox,
        )

        def send_markers(message: bytes | None) -> None:
            nonlocal doomed
            if message is None or doomed:
                return
            try:
                if self._markers_alone:
                    send_queued()
                marker_sends.append(
                    self.producer.send(
                        self.settings.op_marker_topic,
                        message,
                        batcher.key,
                        [],
                        self.marker_partition,
                    )
                )
                if self._markers_alone:
                    send_queued()
            except KafkaException as exc:
                if not _transaction_failed(exc):
                    raise
                doomed = True

        def mark(row: Row, report: Sent | None) -> None:
            ended_as = self._ended(row, report)
            markers.append(ended_as)
            send_markers(batcher.add(self._marker_entry(row, ended_as)))

        for row in ended:
            if row.id not in sent:
                mark(row, None)
        awaiting = len(sent)  # records and dead-letter copies without a report yet
        if claim_next is not None and batch.full(self.settings.batch_size) and not doomed:
            claim_next()  # a drain: the next claim meanwhile (Kafka's reports and commit)
        if not awaiting:
            send_markers(batcher.take())
        failed: list[Sent] = []

        def stalled(waiting: list[Sent]) -> bool:
            # Failed, the transaction is aborted: what has no report yet (a marker queued
            # after the failure got none until the timeout, 60 s) is purged, and goes again.
            return doomed or self._look_up_waiting_topics(waiting)

        try:
            for report in self.producer.reports(stalled, waiting):
                if report.tag is None:  # a marker message
                    if report.error is not None and report.error.code() not in _PURGED:
                        doomed = True
                    continue
                awaiting -= 1
                if report.error is not None:
                    failed.append(report)
                    doomed = True
                elif not doomed:
                    mark(report.tag, report)
                if not awaiting:
                    send_markers(batcher.take())
        except ShuttingDown:  # from `waiting`, or a marker going alone (send_queued)
            stop_abort()
            raise
        fatal = next(
            (
                sent.error
                for sent in (*failed, *marker_sends)
                if sent.error is not None and sent.error.code() == KafkaError._FATAL
            ),
            None,
        )
        if fatal is not None:  # the producer's failure, not the markers' nor a record's
            self.needs_recovery = True
            raise self._abort_failed(KafkaException(fatal))
        marker_error = next(
            (
                m.error
                for m in marker_sends
                if m.error is not None and m.error.code() not in _PURGED
            ),
            None,
        )
        if marker_error is not None and all(
            r.error is not None and r.error.code() in _PURGED for r in failed
        ):
            # The markers' own fault: the records that failed were purged with the transaction
            # the refusal doomed (taken for their own failure, the batch went again every
            # round, the markers never sent alone nor the relay stopped).
            self._abort()
            self.needs_recovery = True
            raise self._markers_refused(marker_error)
        refused = any(
            r.error is not None and r.error.code() in PERMANENT_RECORD_ERRORS for r in failed
        )
        unwritable: KafkaError | None = None
        looked_up: dict[str, int] = {}  # topic -> its partitions (-1: unknown), asked once a batch
        for report in failed:
            error, row = report.error, report.tag
            if error is not None and error.code() in _PURGED and refused:
                continue  # dropped because another record failed: it goes again
            if error is None or error.code() not in PERMANENT_RECORD_ERRORS:
                raise self._abort_failed(KafkaException(error))
            if (
                row.state == "committed"
                and row.id not in self._unknown_topic_retried
                and self._there_again(row, error, looked_up)
            ):
                # The topic was deleted and made again while the record was in flight: it goes
                # again with the batch (doomed), not parked for a topic that is there.
                self._unknown_topic_retried.add(row.id)
                continue
            if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                reason = topic_refused(row.topic)
            elif row.state == "committed" and self._gone(row.topic, error, looked_up):
                reason = f"topic {row.topic!r} does not exist"
            else:
                reason = f"refused by the broker: {error.str()}"
            if row.state != "committed" and error.code() in TOPIC_REFUSED_ERRORS:
                unwritable = error  # the topic's fault, not the copy's: no smaller form
            elif row.state != "committed":  # its dead-letter copy
                form, why = self._copy_form.get(row.id, (_FULL, None))
                if error.code() in _SIZE_ERRORS and row.id not in self._alone:
                    self._alone.add(row.id)  # maybe a batch-mate's fault: alone, as it was
                    self._copy_refused[row.id] = (form, why)
                else:  # refused alone: the next goes smaller
                    self._copy_refused[row.id] = (form + 1, reason)
            elif error.code() in _SIZE_ERRORS and row.id not in self._alone:
                # The broker checks a whole batch of records against the topic's
                # max.message.bytes, and refuses all of it: each goes again alone.
                self._alone.add(row.id)
            else:  # too large alone, or the topic refuses them all (authorisation, policy)
                poison[row.id] = reason
        if unwritable is not None:
            self._abort()
            raise self._dead_letter_refused(unwritable)
        if doomed:
            # A record failed in flight: the transaction is lost. Abort, park, go again, with
            # a new producer: after a broker's refusal librdkafka bumps the producer epoch and
            # purges what the next transaction queues meanwhile.
            self.needs_recovery = True
            if not failed:
                raise self._abort_failed(
                    KafkaException(KafkaError(KafkaError._STATE, "the transaction failed"))
                )
            self._abort()
            self._park(conn, poison)
            self._alone.difference_update(poison)
            self._unknown_topic_retried.difference_update(poison)
            result.parked = len(poison)
            # At once, not after the poll interval: the batch's other records (purged with
            # it) go again, and the refused one alone or parked; each pass settles one of them.
            result.full = True
            return result
        if not markers:  # only poison: nothing to send
            self._abort()
            self._park(conn, poison)
            self._alone.difference_update(poison)
            self._unknown_topic_retried.difference_update(poison)
            result.parked = len(poison)
            result.full = True  # their dead-letter copies and markers, next round
            return result
        if any(m.error is not None for m in marker_sends):  # purged, with nothing failed
            raise self._abort_failed(
                KafkaException(KafkaError(KafkaError._STATE, "the op markers were not sent"))
            )
        _failpoints.hit(_failpoints.AFTER_PRODUCE)
        self._settle_before_commit()
        if poison:
            # Parked before the commit, not by the end: an end that failed left them committed,
            # with no marker for the recovery to end them by, and a record refused here (its
            # partition or topic missing) went out later, once they existed, after the records
            # of its key this batch sent. A lease lost raises here: the batch is aborted.
            self._park(conn, poison)
            self._alone.difference_update(poison)
            self._unknown_topic_retried.difference_update(poison)
        if waiting is not None:
            # A stop lets the commit begin: every report is in, and a commit ends the batch as
            # soon as an abort. It is given up (left to the next owner) only if it outlasts
            # what is left of the grace.
            with contextlib.suppress(ShuttingDown):
                waiting()
        self._copies_in_doubt = self._copy_forms(ended, sent)
        try:
            took = self.producer.commit(waiting)  # its own latency, not the renewals meanwhile
        except Exception:
            self.needs_recovery = True  # outcome unknown: settle it from the markers
            raise
        metrics.COMMIT_SECONDS.observe(took)
        metrics.BATCH_SIZE.observe(len(sent))
        self._count_copies()
        self._observe_lag(batch, sent)
        if batch.claimed_through is not None:
            self._claimed_past = batch.claimed_through
        _failpoints.hit(_failpoints.AFTER_KAFKA_COMMIT)

        sent_whole = {  # by xid: the transactions of which no record is parked
            xid: tx
            for tx in batch.transactions
            if (xid := tx[0].committed_xid) and not any(r.id in poison for r in tx)
        }
        ending = _Ending(
            markers=markers,
            next_offset=max(s.offset for s in marker_sends if s.offset is not None) + 1,
            lease_params=self._lease_params(),
            xids=[xid for tx in batch.transactions if (xid := tx[0].committed_xid)],
            ids=[r.id for r in ended],
            out=list(sent_whole),
            spanning=[xid for xid, tx in sent_whole.items() if not self._own(tx)],
            # only what committed rows: rolled back, discarded or parked ones hold nothing back
            wake_relays=self.wake_relays and bool(batch.transactions),
        )
        if self.ender is None:
            self._end_or_recover(ending, conn)
            self._after_end(ending)
        else:  # ended while the next batch is claimed and produced; settle() waits for it
            ending.changed = self.ender.submit(functools.partial(self._end_or_recover, ending))
            self._ending = ending
        if self._claim_ahead is not None:
            self._claim_ahead.valid = True  # what it left out is committed in Kafka
        result.delivered = sum(1 for r in committed if r.id in sent)
        result.ended = len(ended)
        result.parked = len(poison)
        return result

    @staticmethod
    def _observe_lag(batch: _Batch, sent: dict[int, Sent]) -> None:
        """Each transaction of which a record went: its delivery lag. A relay clock behind the
        database server's counts 0, not a negative lag."""
        now = time.time()
        for tx in batch.transactions:
            committed_at = tx[0].commit_ts
            if committed_at is not None and any(r.id in sent for r in tx):
                metrics.DELIVERY_LAG.observe(max(0.0, now - committed_at.timestamp()))

    # --- ending a batch committed in Kafka ------------------------------------------------------

    def _end_or_recover(self, ending: _Ending, conn: psycopg.Connection[Any]) -> int:
        try:
            for attempt in range(1, END_DEADLOCK_ATTEMPTS + 1):
                try:
                    return self._end_batch(conn, ending)
                except psycopg.errors.DeadlockDetected:
                    # With another relay's stamp (relay_stamp_plan): rolled back, and ending
                    # only rows still in their state, the end can be made again at once.
                    if attempt == END_DEADLOCK_ATTEMPTS:
                        raise
                    metrics.ERRORS.labels("end_deadlock").inc()
            raise AssertionError("unreachable")
        except Exception:
            self.needs_recovery = True  # the markers are committed: recovery ends these rows
            raise

    def _end_batch(self, conn: psycopg.Connection[Any], ending: _Ending) -> int:
        """In one Postgres transaction that re-checks the lease: end the batch's rows and move
        the shard's marker offset past its markers (its poison was parked before its commit).
        Returns how many rows were changed by hand meanwhile. Thread-safe: the ender runs it."""
        markers = ending.markers
        # Pipelined (2 round trips, not 5): the lease is checked before the commit, and the
        # LeaseLost it raises rolls back what was sent after it.
        with pipelined_transaction(conn):
            lease = conn.execute(self._q("relay_lock_lease"), ending.lease_params)
            cursors = self._end_rows(conn, markers)
            conn.execute(
                self._q("relay_set_marker_offset"),
                {
                    **ending.lease_params,
                    "partition": self.marker_partition,
                    "offset": ending.next_offset,
                    "outbox": self.outbox,
                    "transactional_id": self.producer.transactional_id,
                    "topic": self.settings.op_marker_topic,
                    "topic_id": self._marker_topic_id,
                },
            )
            if ending.wake_relays:
                conn.execute(
                    self._q("relay_wake_relays"),
                    {"channel": wakeup_channel(self.schema), "relay_id": self.relay_id},
                )
            self._check_lease(lease)
        changed = self._count_changed(markers, cursors)
        if changed:
            logger.warning(
                "shard %s: %s rows were changed by hand (resolve, rearm, redrive) while their "
                "op markers were being written; they stay as they are now",
                self.shard,
                changed,
            )
        for topic, count in Counter(m.topic for m in markers if m.op is Op.DELIVERED).items():
            metrics.DELIVERED.labels(topic).inc(count)
        for op, count in Counter(m.op.value for m in markers).items():
            metrics.ENDED.labels(op).inc(count)
        return changed

    def _after_end(self, ending: _Ending) -> None:
        """What this worker keeps about rows, once they ended (in its own thread)."""
        if self._unknown_topic_retried:
            self._unknown_topic_retried.difference_update(m.id for m in ending.markers)
        if self._alone:
            self._alone.difference_update(m.id for m in ending.markers)
        if self._copy_refused:
            for m in ending.markers:
                self._copy_refused.pop(m.id, None)

    def settle(self) -> None:
        """Wait until the last batch's rows are ended. Its error is raised here, and the shard
        recovers before it goes on (its markers are committed: they end those rows)."""
        ending, self._ending = self._ending, None
        if ending is None or ending.changed is None:
            return
        try:
            ending.changed.result()
        except Exception as exc:
            self.needs_recovery = True  # whatever failed, even connecting: the markers say
            if isinstance(exc, psycopg.Error):
                raise EndFailed(f"shard {self.shard}: ending a delivered batch: {exc}") from exc
            raise
        self._after_end(ending)

    def _abort(self, timeout_s: float | None = None) -> Exception | None:
        """Abort the batch's Kafka transaction. An abort that fails (a timeout, a fencing) is
        logged, not raised: what the failed batch leaves to do (park its poison, send markers
        alone) must not wait for an abort that may keep failing, every round aborted again.
        The transaction cannot commit: recovery, next, fences it with the producer. While the
        relay stops, it waits STOP_ABORT_S at most, as a stop's own abort, a stop that comes
        during a longer abort too: the broker aborts the rest at its timeout, and a longer wait
        overran the grace. Returns what made it fail, if anything."""
        if timeout_s is None and self._stopping():
            timeout_s = STOP_ABORT_S
        try:
            self.producer.abort(timeout_s, self._stopping)
        except Exception as exc:
            self.needs_recovery = True
            logger.warning("shard %s: the abort failed (recovery fences it): %s", self.shard, exc)
            return exc
        return None

    def _abort_failed(self, exc: Exception) -> Exception:
        """Abort a batch that failed in flight; returns what to raise: the abort's own fencing
        or fatal error where it met one, else `exc`. After a fatal error librdkafka reports
        what was in flight as _FATAL or purged, the flag on the producer, not the reports:
        taken for the batch's own failure, a fencing was counted as kind kafka and logged as
        'Fatal error'."""
        failure = self._abort()
        return failure if isinstance(failure, Fenced | ProducerFailed) else exc

    def _settle_before_commit(self) -> None:
        """At most one batch in doubt per shard: the last one's rows end before the next
        commits. If they cannot, this batch's Kafka transaction is aborted."""
        try:
            self.settle()
        except BaseException:
            self._abort()  # settle() marked the shard for recovery, which fences it anyway
            raise

    def settle_quietly(self) -> None:
        """settle(), with its error logged: the shard recovers before its next batch."""
        try:
            self.settle()
        except Exception as exc:
            logger.warning("shard %s: the last batch's rows did not end here: %s", self.shard, exc)

    def _copy_forms(self, ended: list[Row], sent: dict[int, Sent]) -> dict[int, int]:
        """The form of each discarded or parked row's dead-letter copy in this transaction."""
        return {
            row.id: self._copy_form[row.id][0] if row.id in sent else _NO_COPY
            for row in ended
            if row.state in ("discarded", "parked")
        }

    def _count_copies(self) -> None:
        """Count the copies of the batch just committed, by form (a copy in an aborted batch is
        not out: it goes again, maybe in another form, and is counted then)."""
        forms, self._copies_in_doubt = Counter(self._copies_in_doubt.values()), {}
        for form, count in forms.items():
            metrics.DEAD_LETTER_COPIES.labels(metrics.DEAD_LETTER_FORMS[form]).inc(count)

    def _send_dead_letter(self, row: Row) -> Sent | None:
        """A copy on the dead-letter topic, with the reason. When the client, or the broker the
        round before, refused it (too large for the dead-letter topic), a smaller form goes:
        without the value, then also without the key and the record's own headers. None when
        even that is refused: the marker then goes without a copy, rather than the refusal
        aborting the shard's batch every round."""
        form, refused = self._copy_refused.get(row.id, (_FULL, None))
        while form <= _BARE:
            try:
                copy = self._dead_letter_copy(row, form, refused)
            except MalformedHeaders:  # what parked it, most likely: the copy goes without them
                row = dataclasses.replace(row, headers=None)
                continue
            try:
                sent = self.producer.send(*copy, tag=row)
            except KafkaException as exc:
                if exc.args[0].code() in TOPIC_REFUSED_ERRORS:
                    raise self._dead_letter_refused(exc.args[0]) from exc
                if exc.args[0].code() not in PERMANENT_RECORD_ERRORS:
                    raise
                form, refused = form + 1, f"refused by the Kafka client: {exc.args[0].str()}"
                continue
            self._copy_form[row.id] = (form, refused)
            return sent
        logger.warning(
            "shard %s: no dead-letter copy of row %s fits %s (%s); its op marker goes alone",
            self.shard,
            row.id,
            self.settings.dead_letter_topic,
            refused,
        )
        metrics.ERRORS.labels("dead_letter_refused").inc()
        return None

    def _look_up_waiting_topics(self, waiting: list[Sent]) -> bool:
        """Records without a delivery report for a while (ShardProducer.reports). The client
        keeps a record for a topic deleted (or made again with fewer partitions) since it
        learned of it queued until the transaction's timeout: the whole shard stalled on it,
        60 s by default, said to be Kafka's slowness. Found so, the transaction is given up at
        once: the next round's preflight parks the records of a topic gone, a dead-letter topic
        is made again, and the recovery's new producer reads the topic's metadata afresh.
        False: none found so (waited for, as any slowness)."""
        # The broker unreachable, each look-up waits 10 s: the records' topics one after
        # another held the shard (and its lease) that long each.
        give_up_at = time.monotonic() + REPORT_STALL_S
        for topic in sorted({sent.topic for sent in waiting}):
            if time.monotonic() > give_up_at:
                return False
            before = self.topics.known_partitions(topic)
            try:
                now = self.topics.partitions(topic, refresh=True)
            except KafkaException:
                continue  # a partition without a leader, say: waited for, as any slowness
            if now and (before is None or now >= before):
                continue
            # Not aborted here (its abort failed, fatal, the transaction's state invalid): the
            # recovery's new producer ends it.
            if now == 0 and topic == self.settings.dead_letter_topic:
                raise self._dead_letter_refused(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
            what = "was deleted" if now == 0 else f"has {now} partitions now, not {before}"
            raise KafkaException(
                KafkaError(
                    KafkaError.UNKNOWN_TOPIC_OR_PART if now == 0 else KafkaError._UNKNOWN_PARTITION,
                    f"topic {topic} {what} while this shard's batch was sent to it: the batch "
                    "goes again (the records of a topic gone are parked)",
                )
            )
        return False

    def _markers_refused(self, err: KafkaError) -> Exception:
        """The op-marker topic refused a marker message. For its size or the relay's rights,
        every round aborted the same way for ever, said as a bare RuntimeError, behind green
        probes: the relay stops instead, as when the start-up check finds it so. A topic gone
        is for the relay to tell (Relay._marker_topic_gone); anything else goes again."""
        topic = self.settings.op_marker_topic
        said = f"op markers could not be written to {topic}: {err.str()}"
        if err.code() in _SIZE_ERRORS and not self._markers_alone:
            # The broker checks a whole batch against max.message.bytes, and the client puts
            # several marker messages in one: from now on each goes alone, as refused records do.
            self._markers_alone = True
            logger.warning(
                "shard %s: %s; marker messages go one at a time from now on", self.shard, said
            )
            return KafkaException(KafkaError(err.code(), f"{said}: they go one at a time"))
        if err.code() in _SIZE_ERRORS:
            return MarkerTopicRefused(
                f"{said}. Its max.message.bytes must stay at least relay.op_marker_message_bytes "
                f"({self.settings.op_marker_message_bytes}) plus {MARKER_MESSAGE_MARGIN} bytes"
            )
        if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            return MarkerTopicRefused(f"{said}. The relay's principal needs WRITE on it")
        if err.code() == KafkaError.POLICY_VIOLATION:
            return MarkerTopicRefused(f"{said}, by a policy of the broker")
        return KafkaException(KafkaError(err.code(), said))

    def _gone(self, topic: str, error: KafkaError, looked_up: dict[str, int]) -> bool:
        """Whether a record refused as of an unknown topic was refused because its topic is
        gone: deleted after the relay last looked, so the check before the transaction passed
        it. Said as that check says it ("does not exist", counted as unknown_topic), not as
        whichever of the two found it first."""
        if error.code() not in _UNKNOWN_TOPIC_ERRORS:
            return False
        return _partitions_now(self.topics, topic, looked_up) == 0 and not self.topics.denied(topic)

    def _there_again(self, row: Row, error: KafkaError, looked_up: dict[str, int]) -> bool:
        """Whether a record refused as of an unknown topic has its topic, and its partition,
        there now: the topic was made again while the record was in flight."""
        if error.code() not in _UNKNOWN_TOPIC_ERRORS:
            return False
        partitions = _partitions_now(self.topics, row.topic, looked_up)
        return partitions > 0 and (row.partition is None or row.partition < partitions)

    def _dead_letter_refused(self, err: KafkaError) -> DeadLetterUnwritable:
        """The dead-letter topic refused a copy for what it is, not for the copy's size. Made
        smaller down to no copy at all, as before, a discarded record's payload was then lost
        with its row. A missing topic is made again, as at start."""
        topic = self.settings.dead_letter_topic
        self._dead_letter_blocked_until = time.monotonic() + DEAD_LETTER_RETRY_S
        if err.code() in _UNKNOWN_TOPIC_ERRORS:
            try:
                # its creation not waited for: a Kafka transaction may be open, the shard's
                # lease unrenewed, and the rows wait DEAD_LETTER_RETRY_S anyway
                config = dead_letter_topic_config(self.kafka_conf)
                self.topics.ensure(topic, 1, config, await_leaders=False)
            except (KafkaException, TimeoutError) as exc:  # the metadata's look-up, timed out
                logger.warning("shard %s: could not create %s: %s", self.shard, topic, exc)
        return DeadLetterUnwritable(
            f"the dead-letter topic {topic} takes no copies ({err.str()}): the batch goes "
            f"again without the rows that need one, tried again in {DEAD_LETTER_RETRY_S:.0f} s"
        )

    def _dead_letter_copy(
        self, row: Row, form: int, refused: str | None
    ) -> tuple[str, bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]:
        """(topic, value, key, headers) of a dead-letter copy in the given form."""
        topic, why = self.settings.dead_letter_topic, (row.reason or "")
        if form == _FULL:
            headers = [*row.kafka_headers(self._outbox_header), (OUTBOX_REASON_HEADER, why)]
            return topic, row.value, row.key, headers
        omitted = (OUTBOX_VALUE_OMITTED_HEADER, refused or "")
        if form == _NO_VALUE:
            headers = [
                *row.kafka_headers(self._outbox_header),
                (OUTBOX_REASON_HEADER, why),
                omitted,
            ]
            return topic, None, row.key, headers
        bare = dataclasses.replace(row, headers=None)  # only the outbox headers, a short reason
        why = why[:MAX_MARKER_REASON_CHARS]
        headers = [*bare.kafka_headers(self._outbox_header), (OUTBOX_REASON_HEADER, why), omitted]
        return topic, None, None, headers

    def _preflight(self, rows: list[Row]) -> dict[int, str]:
        """Records that can never be delivered as they are: unknown topic, bad partition, the
        op-marker topic (recovery ends the rows a committed marker names: a record there, in a
        marker's form, made the relay delete records it never sent)."""
        poison: dict[int, str] = {}
        refreshed: set[str] = set()
        asked_again: set[str] = set()
        # Per topic once a batch: a batch's rows share a few topics, and each look-up polls
        # the admin client, a release of the GIL to the end and claim threads, per row.
        counts: dict[str, int] = {}
        writable: dict[str, bool] = {}
        for row in rows:
            if row.topic == self.settings.op_marker_topic:
                poison[row.id] = f"the relay's op-marker topic {row.topic!r} takes only markers"
                continue
            partitions = counts.get(row.topic)
            if partitions is None:
                partitions = counts[row.topic] = self.topics.partitions(row.topic)
            too_few = partitions == 0 or (row.partition or 0) >= partitions
            if too_few and row.topic not in refreshed:
                # A cached count may be older than the topic or its partitions: asked again
                # (once a round a topic) before a record is parked for it.
                refreshed.add(row.topic)
                partitions = counts[row.topic] = self.topics.partitions(row.topic, refresh=True)
            hidden = partitions == 0 and self.topics.denied(row.topic)
            may = writable.get(row.topic) if partitions else True
            if may is None:
                may = writable[row.topic] = self._may_write(row.topic, asked_again)
            if hidden or not may:
                poison[row.id] = topic_refused(row.topic)
            elif partitions == 0:
                poison[row.id] = f"topic {row.topic!r} does not exist"
            elif row.partition is not None and row.partition >= partitions:
                poison[row.id] = (
                    f"partition {row.partition} out of range: {row.topic!r} has {partitions}"
                )
        return poison

    def _check_writable(self, ended: list[Row]) -> None:
        """The op-marker and dead-letter topics the broker's ACLs let the relay see but not
        write to, found before the transaction: the client failed the whole transaction as
        such a topic joined it, and the shard retried the same batch for as long as the ACL
        stayed, saying only INVALID_TXN_STATE. Refused as a refusal at produce time is."""
        markers = self.settings.op_marker_topic
        if not self._may_write(markers, set()):
            raise MarkerTopicRefused(
                f"the op-marker topic {markers} refuses the relay's writes (Topic "
                "authorization failed): the relay's principal needs WRITE on it"
            )
        copies = any(r.state in ("discarded", "parked") for r in ended)
        if copies and not self._may_write(self.settings.dead_letter_topic, set()):
            raise self._dead_letter_refused(
                KafkaError(
                    KafkaError.TOPIC_AUTHORIZATION_FAILED,
                    "Topic authorization failed: the relay's principal needs WRITE on it",
                )
            )

    def _may_write(self, topic: str, asked_again: set[str]) -> bool:
        """Whether the broker's ACLs let the relay write to `topic`; a cached no is asked
        again (once a round a topic) before a record is parked for it."""
        if self.topics.writable(topic):
            return True
        if topic in asked_again:
            return False
        asked_again.add(topic)
        return self.topics.writable(topic, refresh=True)

    @staticmethod
    def _ended(row: Row, sent: Sent | None) -> Ended:
        op = Op.DELIVERED if row.state == "committed" else Op(row.state)
        if sent is None:
            return Ended(op, row.id, row.topic, None, None)
        return Ended(op, row.id, row.topic, sent.partition, sent.offset)

    @staticmethod
    def _marker_entry(row: Row, ended: Ended) -> str:
        return marker_entry(
            ended.op,
            id=row.id,
            tx_id=row.tx_id,
            producer_group=row.producer_group,
            topic=row.topic,
            key=row.key,
            partition=ended.partition,
            offset=ended.offset,
            commit_ts=row.commit_ts,
            reason=row.reason,
            xid=None if row.committed_xid is None else int(row.committed_xid),
        )

    # --- database side ----------------------------------------------------------------------

    def _lock_lease(self, conn: psycopg.Connection[Any]) -> tuple[int | None, int]:
        """The lease row locked, if still ours: where its markers are recorded up to."""
        return self._check_lease(conn.execute(self._q("relay_lock_lease"), self._lease_params()))

    def _check_lease(self, locked: psycopg.Cursor[Any]) -> tuple[int | None, int]:
        row = locked.fetchone()
        if row is None:
            raise LeaseLost(f"shard {self.shard} (epoch {self.lease.epoch}) is no longer ours")
        return row[0], row[1]

    def _end_recovered(
        self, conn: psycopg.Connection[Any], markers: list[OpMarker]
    ) -> tuple[int, list[OpMarker]]:
        """End the rows of markers read back, each only if it is the marker's record, not only
        of its id (relay_recovered_rows): how many ended, and the markers that matched none."""
        mine = {
            int(r[0])
            for r in conn.execute(
                self._q("relay_recovered_rows"),
                {
                    "ids": [m.id for m in markers],
                    "states": [_shipped_as(m) for m in markers],
                    "tx_ids": [m.tx_id for m in markers],
                    "producer_groups": [m.producer_group for m in markers],
                    "topics": [m.topic for m in markers],
                    "keys": [m.key for m in markers],
                    "xids": [None if m.xid is None else str(m.xid) for m in markers],
                },
            )
        }
        cursors = self._end_rows(conn, [m for m in markers if m.id in mine])
        return sum(max(c.rowcount, 0) for c in cursors), [m for m in markers if m.id not in mine]

    def _say_other_records(self, conn: psycopg.Connection[Any], markers: list[OpMarker]) -> None:
        """Markers whose ids another record now has (the database restored from a backup
        taken before they were written): that record is left for delivery, and said."""
        if not markers:
            return
        row = conn.execute(
            self._q("relay_other_records_of_ids"),
            {
                "ids": [m.id for m in markers],
                "tx_ids": [m.tx_id for m in markers],
                "producer_groups": [m.producer_group for m in markers],
                "topics": [m.topic for m in markers],
                "keys": [m.key for m in markers],
            },
        ).fetchone()
        others = int(row[0]) if row else 0
        if others:
            metrics.ERRORS.labels("marker_id_reused").inc()
            logger.error(
                "shard %s: %s rows waiting for delivery have the ids of records whose op "
                "markers are committed, but are other records (another tx id, topic or key): "
                "the database was restored from a backup taken before those were delivered, "
                "and the ids were given again. The rows are left for delivery; what was "
                "delivered after the backup is in Kafka but no longer in the outbox",
                self.shard,
                others,
            )

    def _end_rows(
        self, conn: psycopg.Connection[Any], markers: Sequence[Ended | OpMarker]
    ) -> list[psycopg.Cursor[Any]]:
        """End the rows of committed markers: delete them, or keep them for the archive.

        Each row only in the state its marker was written for (relay.sql, relay_end_rows); the
        cursors' row counts say how many ended (read them once a pipeline has synced).
        """
        if self.settings.delivered_retention:
            kept, deleted = list(markers), []
        else:  # parked rows stay for inspection and redrive, archive or not
            kept = [m for m in markers if m.op is Op.PARKED]
            deleted = [m for m in markers if m.op is not Op.PARKED]
        # In id order, which is close to the order another relay's stamp locks them in (by
        # transaction id), and far from report order: fewer deadlocks with that stamp.
        kept.sort(key=_by_id)
        deleted.sort(key=_by_id)
        cursors = []
        if deleted:
            cursors.append(
                conn.execute(
                    self._q("relay_delete_rows"),
                    {
                        "ids": pgarray.integers([m.id for m in deleted]),
                        "states": pgarray.words([_shipped_as(m) for m in deleted]),
                    },
                )
            )
        if kept:
            cursors.append(
                conn.execute(
                    self._q("relay_end_rows"),
                    {
                        "ids": pgarray.integers([m.id for m in kept]),
                        "states": pgarray.words([_shipped_as(m) for m in kept]),
                        "partitions": pgarray.integers([m.partition for m in kept]),
                        "offsets": pgarray.integers([m.offset for m in kept]),
                    },
                )
            )
        return cursors

    @staticmethod
    def _count_changed(
        markers: Sequence[Ended | OpMarker], ended: list[psycopg.Cursor[Any]]
    ) -> int:
        """Rows whose marker is out but that an operator changed meanwhile (resolve, rearm,
        redrive): they stay as they are now, and the next rounds ship what they became."""
        changed = len(markers) - sum(max(c.rowcount, 0) for c in ended)
        if changed > 0:
            metrics.ERRORS.labels("changed_while_shipped").inc(changed)
        return changed

    def _park(self, conn: psycopg.Connection[Any], poison: dict[int, str]) -> None:
        """Park the rows of `poison` (by id: why), in a transaction that checks the lease: a
        relay that lost it must not park the heir's rows (nor say it parked them)."""
        with conn.transaction():
            self._lock_lease(conn)
            # By reason: a transaction's records for a missing topic share one. One statement
            # and one log line each: 80,000 such records took 30 s to park, in 80,000 lines.
            by_reason: dict[str, list[int]] = {}
            for row_id, reason in poison.items():
                by_reason.setdefault(reason, []).append(row_id)
            for reason, ids in by_reason.items():
                conn.execute(self._q("relay_park"), {"ids": ids, "reason": reason})
        self._parked([(ids, reason) for reason, ids in by_reason.items()])

    def _parked(self, parked: list[tuple[list[int], str]]) -> None:
        for ids, reason in parked:
            shown = ", ".join(map(str, ids[:PARKED_IDS_LOGGED]))
            more = len(ids) - PARKED_IDS_LOGGED
            logger.warning(
                "parked %s record(s) %s%s: %s",
                len(ids),
                shown,
                f" and {more} more" if more > 0 else "",
                reason,
            )
            metrics.PARKED.labels(_reason_kind(reason)).inc(len(ids))

    def close(self) -> None:
        self.closed = True
        self.settle_quietly()
        self.producer.close()

    def close_and_hand_over(
        self, conn: psycopg.Connection[Any] | None, timeout_s: float = 3.0
    ) -> bool:
        """close(), and with its last batch ended, its marker offset moved on to the partition's
        end: a batch end records the offset of its own commit marker, one below the end, and a
        relay stopped cleanly for longer than op_marker_retention was refused at its restart.
        Without a connection (the database gone), close() alone. False when the move failed."""
        self.close()
        if conn is None:
            return False
        return self._keep_marker_offset_recent(conn, now=True, timeout_s=timeout_s)
