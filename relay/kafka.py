"""The relay's Kafka side: one transactional producer per shard, and topic administration.

A row is marked done only after its delivery report and the committed Kafka transaction, never
when `produce()` returns (quix-streams' internal producer keeps the same rule).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    AdminClient,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from relay.logs import Outage, RepeatFilter

logger = logging.getLogger(__name__)
# how often a wait for an init or a commit asks whether to go on (and renews the leases)
WAIT_POLL_S = 0.1
# librdkafka's own lines (connection failures, fatal errors), through logging: written to stderr
# by the C library they broke the sidecar's one-JSON-object-per-line logs. A client passes them
# on when it is polled (Topics polls its admin client at each call).
CLIENT_LOGGER = logging.getLogger("relay.librdkafka")
CLIENT_REPEATS_S = 60.0  # a failed connection's line, alike from every client, once a minute
CLIENT_LOGGER.addFilter(
    RepeatFilter(
        CLIENT_REPEATS_S,
        # alike: from any client instance of ours, whatever the milliseconds it says
        lambda text: re.sub(r"#(producer|consumer)-\d+|\d+ms\b", "#", text),
    )
)

# Errors after which retrying the same record can never succeed: the record is parked.
PERMANENT_RECORD_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.POLICY_VIOLATION,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._INVALID_ARG,
    }
)
# What produce() says from the client's own metadata, which may be older than the topic.
_STALE_METADATA_ERRORS = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC})
# Errors that say a topic takes nothing from us (missing, not ours to write, a bad name), as
# opposed to a record it will not take: a dead-letter copy refused so is not made smaller.
TOPIC_REFUSED_ERRORS = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
    }
)
DEAD_LETTER_TOPIC_CONFIG = {"cleanup.policy": "delete"}
# What the broker's default max.message.bytes (1 MiB and 12 bytes) leaves above librdkafka's
# default message.max.bytes: a copy's own headers (its reason) and its batch's framing.
DEAD_LETTER_HEADROOM = 48_588
STOP_ABORT_S = 2.0  # a stop's abort of the batch in flight: the broker times out the rest
_ANY_PARTITION = -1  # librdkafka's RD_KAFKA_PARTITION_UA: the partitioner chooses
_FENCED_ERRORS = frozenset(
    {KafkaError._FENCED, KafkaError.INVALID_PRODUCER_EPOCH, KafkaError.PRODUCER_FENCED}
)


# What init_transactions refuses for good until the settings or the broker's ACLs change, and
# what to change.
_MISCONFIGURED = {
    KafkaError.INVALID_TRANSACTION_TIMEOUT: (
        "relay.kafka_transaction_timeout (or transaction.timeout.ms in kafka.extra) must not "
        "exceed the broker's transaction.max.timeout.ms"
    ),
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: (
        "the relay's principal needs WRITE and DESCRIBE on its transactional ids "
        "(relay.transactional_id_prefix, then -<shard>)"
    ),
}

_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"  # the zero Uuid, as confluent-kafka prints it
TOPIC_READY_S = 30.0  # how long a topic the relay made may take to have its partitions led

# Seconds without a delivery report after which the topics of the records still waiting are
# looked up (ShardProducer.reports): the client keeps a record for a topic deleted since it
# learned of it queued until the transaction's timeout.
REPORT_STALL_S = 5.0

# A topic just made has these until every broker knows it and its partitions are led.
_PROPAGATING = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.LEADER_NOT_AVAILABLE})

# Metadata errors that say the topic is not there for us; any other one passes.
_TOPIC_MISSING = frozenset(
    {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_AUTHORIZATION_FAILED}
)


class ShuttingDown(Exception):
    """The relay stops, and the batch in flight cannot finish within its grace: it is aborted
    (its rows go again, from the next owner), not left open to pin its partitions' stable
    offset until the broker's timeout. Or a recovery is cut short: the next owner's does it."""


class Fenced(Exception):
    """Kafka refuses this producer's epoch: another producer with our transactional.id took
    over, or the coordinator aborted a transaction that outran its timeout (which bumps the
    epoch too). The shard recovers: if its lease is gone, recovery drops it (LeaseLost); if the
    lease is still ours, a new producer goes on. Dropped at once, a shard whose lease was still
    ours sat idle until that lease ran out."""


class OutcomeUnknown(Exception):
    """commit_transaction failed in a way that leaves its outcome unknown: recover from markers."""


class TransactionTimedOut(OutcomeUnknown):
    """A batch's Kafka transaction was not done within relay.kafka_transaction_timeout, after
    which the broker aborts it: a batch that large fails every round the same way."""

    def __init__(self, message: str, symptom: str | None = None) -> None:
        super().__init__(message)
        self.symptom = symptom or message  # what was seen, without the timeout's name


class ProducerMisconfigured(ValueError):
    """Kafka refuses this transactional producer for a reason no retry mends."""


class ProducerFailed(Exception):
    """A fatal error of this producer instance that is not a fencing (an idempotence sequence
    gone wrong, say): it can do nothing more, but the shard is still ours. The shard backs off
    and recovers, which makes a new producer. Taken for a fencing, the shard was dropped and sat
    idle under its own lease until the lease ran out."""


@dataclass(eq=False)
class Sent:
    """One produced record and, once its delivery report arrived, where it went or why not."""

    tag: Any = None  # the caller's: what this record stands for
    partition: int | None = None
    offset: int | None = None
    error: KafkaError | None = None
    topic: str = ""
    reported: bool = False


# What exactly-once needs of every shard producer, whatever kafka.extra says...
_REQUIRED_VALUES: dict[str, Any] = {"enable.idempotence": True, "acks": "all"}
_REQUIRED = {"enable.idempotence": {"true"}, "acks": {"all", "-1"}}  # as written, same meaning
# ...and the relay's defaults for the rest, measured with bench/relay.py.
_TUNABLE_DEFAULTS: dict[str, Any] = {
    "linger.ms": 2,
    "queue.buffering.max.messages": 1_000_000,
    # Unknown topics are caught before producing; do not wait long on metadata.
    "topic.metadata.propagation.max.ms": 5_000,
    # The Java client's partitioner: a key lands where a Java producer (Kafka Connect, Debezium)
    # puts it, and an empty key is hashed like any other. librdkafka's default scattered empty
    # keys at random, and the relay, which orders them as one key, lost their order.
    "partitioner": "murmur2_random",
}


def producer_conf(
    conf: dict[str, Any], transactional_id: str, timeout: timedelta
) -> dict[str, Any]:
    """A shard producer's librdkafka settings: the relay's defaults, `conf` over them, and what
    transactions need over that."""
    # The tunables are defaults that kafka.extra may change (they were overwritten unsaid).
    return {
        **_TUNABLE_DEFAULTS,
        # The broker aborts a transaction left open this long (a relay paused or cut off
        # mid-batch): the same bound the relay's own waits on Kafka keep.
        "transaction.timeout.ms": int(timeout.total_seconds() * 1000),
        "logger": CLIENT_LOGGER,
        **conf,
        "transactional.id": transactional_id,
        **_REQUIRED_VALUES,
    }


# librdkafka's consumer defaults of the sizes its constructor checks against each other
_FETCH_MAX_BYTES = 52_428_800
_RECEIVE_MAX_BYTES = 100_000_000
_MESSAGE_MAX_BYTES = 1_000_000


def _size(conf: dict[str, Any], name: str, default: int) -> int | None:
    try:
        return int(conf.get(name, default))
    except (TypeError, ValueError):
        return None  # librdkafka says what is wrong with it


def dead_letter_topic_config(producer: dict[str, Any]) -> dict[str, str]:
    """The dead-letter topic's settings when the relay makes it: room for a copy of the largest
    record the producer sends where `message.max.bytes` was raised for large records. Made
    with the broker's default, it refused their copies: a discarded record's went without its
    value, and with no archive its row was deleted, the value lost."""
    message = _size(producer, "message.max.bytes", _MESSAGE_MAX_BYTES)
    if message is None or message <= _MESSAGE_MAX_BYTES:  # the broker's default has room
        return dict(DEAD_LETTER_TOPIC_CONFIG)
    return {**DEAD_LETTER_TOPIC_CONFIG, "max.message.bytes": str(message + DEAD_LETTER_HEADROOM)}


def recovery_consumer_conf(conf: dict[str, Any], group_id: str) -> dict[str, Any]:
    """A recovery's consumer of the op markers: the relay's Kafka settings (kafka.extra too),
    with what reading the markers back needs over them.

    A consumer checks sizes a producer does not: `message.max.bytes` raised for large records
    (with `receive.message.max.bytes`, as the producer needs) made every recovery's consumer
    refuse its settings, and no shard was ever delivered. Its fetch sizes are raised to fit."""
    consumer: dict[str, Any] = {"logger": CLIENT_LOGGER, **conf}
    message = _size(conf, "message.max.bytes", _MESSAGE_MAX_BYTES)
    fetch = _size(conf, "fetch.max.bytes", _FETCH_MAX_BYTES)
    receive = _size(conf, "receive.message.max.bytes", _RECEIVE_MAX_BYTES)
    if message is not None and fetch is not None and receive is not None:
        fetch = max(fetch, message)
        consumer["fetch.max.bytes"] = fetch
        consumer["receive.message.max.bytes"] = max(receive, fetch + 512)
    return {
        **consumer,
        "group.id": group_id,
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        # never a silent jump past markers gone (see the log start check of the recovery)
        "auto.offset.reset": "error",
    }


_QUIET = logging.getLogger("relay.librdkafka.settings-check")
_QUIET.propagate = False  # its client has no broker to reach, and says so: not worth a line
_QUIET.addHandler(logging.NullHandler())


def check_client_settings(conf: dict[str, Any], timeout: timedelta) -> None:
    """Build, and drop, a shard producer and a recovery's consumer of these settings with no
    broker to reach: settings librdkafka refuses (an unknown property, values that contradict
    each other) are refused at start and by `outboxctl config`, naming them, not found by a
    client made later on one of the relay's threads. ProducerMisconfigured when refused."""
    unconnected = dict(conf)
    unconnected.pop("bootstrap.servers", None)  # no connection: nothing but the settings tried
    if str(unconnected.get("sasl.oauthbearer.method", "")).lower() == "oidc":
        # an OIDC client fetches its token when made: no credentials sent for a check
        unconnected["sasl.oauthbearer.method"] = "default"
    producer = {**producer_conf(unconnected, "outbox-settings-check", timeout), "logger": _QUIET}
    consumer = {**recovery_consumer_conf(unconnected, "outbox-settings-check"), "logger": _QUIET}
    try:
        Producer(producer)
    except KafkaException as exc:
        raise ProducerMisconfigured(
            f"kafka: the Kafka client refuses these settings: {exc.args[0].str()}"
        ) from None
    try:
        Consumer(consumer).close()
    except KafkaException as exc:
        raise ProducerMisconfigured(
            "kafka: the Kafka client refuses these settings for the consumer that reads the op "
            f"markers back in a recovery: {exc.args[0].str()}"
        ) from None


def _seconds_of_ms(value: Any) -> float | None:
    """A librdkafka milliseconds setting in seconds; None where the client will refuse it."""
    try:
        return int(value) / 1000
    except (TypeError, ValueError):
        return None


class ShardProducer:
    """A transactional producer with transactional.id `<prefix>-<shard>`."""

    def __init__(self, conf: dict[str, Any], transactional_id: str, timeout: timedelta) -> None:
        self.transactional_id = transactional_id
        for name, allowed in _REQUIRED.items():
            if name in conf and str(conf[name]).lower() not in allowed:
                logger.warning(
                    "kafka.extra %s=%s ignored: a transactional producer needs %s",
                    name,
                    conf[name],
                    _REQUIRED_VALUES[name],
                )
        if "transactional.id" in conf:
            logger.warning(
                "kafka.extra transactional.id ignored: each shard's producer has its own, "
                "from relay.transactional_id_prefix"
            )
        self._conf = producer_conf(conf, transactional_id, timeout)
        # The relay's waits on Kafka end when the broker aborts the transaction: a shorter
        # transaction.timeout.ms in kafka.extra ended it first, and its symptoms (a fencing, a
        # message timed out) were counted as other errors, never as a batch too long.
        self.timeout_s = timeout.total_seconds()
        self.timeout_setting = "relay.kafka_transaction_timeout"
        broker_s = _seconds_of_ms(self._conf["transaction.timeout.ms"])
        if broker_s is not None and broker_s < self.timeout_s:
            self.timeout_s = broker_s
            self.timeout_setting = "transaction.timeout.ms in kafka.extra"
        self._producer: Producer | None = None
        self._sent: list[Sent] = []
        self._reported: deque[Sent] = deque()
        self._began = float("inf")  # when the transaction open now began
        # its commit was asked for (its outcome may be unknown), or an abort of it failed: only
        # a recovery settles it
        self._settled_by_recovery = False

    def init(
        self,
        stopping: Callable[[], bool] | None = None,
        keep_alive: Callable[[], None] | None = None,
    ) -> None:
        """(Re)create the producer and init transactions: fences any older instance of us.
        With `stopping`, given up once it says so (the producer left to finish its init on a
        thread of its own, and never used): with the coordinator unreachable, the wait alone,
        up to the transaction timeout, overran a stop's grace. `keep_alive` is called while it
        waits (what it raises gives the init up too): a wait longer than the lease let every
        lease of the relay lapse, another relay took the shards, and this init, ending, fenced
        that one's producer. Not in slices: a timed-out init called again failed with
        CONCURRENT_TRANSACTIONS where one call rode it out."""
        self.close()
        self._began = float("inf")
        try:
            producer = self._producer = Producer(self._conf)
        except KafkaException as exc:  # settings librdkafka refuses, e.g. a message.timeout.ms
            # in kafka.extra above transaction.timeout.ms: never good, for any shard
            raise ProducerMisconfigured(
                f"the Kafka client refuses the producer's settings: {exc.args[0].str()}"
            ) from exc
        try:
            if stopping is None and keep_alive is None:
                producer.init_transactions(self.timeout_s)
            else:
                self._init_beside(producer, stopping, keep_alive)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            hint = _MISCONFIGURED.get(err.code())
            if hint is not None:
                raise ProducerMisconfigured(
                    f"Kafka refuses the transactional producer {self.transactional_id}: "
                    f"{err.str()}; {hint}"
                ) from exc
            _raise_if_fenced_or_fatal(err, exc)
            raise

    def _init_beside(
        self,
        producer: Producer,
        stopping: Callable[[], bool] | None,
        keep_alive: Callable[[], None] | None,
    ) -> None:
        def meanwhile() -> None:
            if stopping is not None and stopping():
                # Its init may yet finish after the shard is handed back (the coordinator back
                # within the process's last seconds) and fence the next owner's producer once:
                # that one recovers and goes on.
                raise ShuttingDown("the relay stops: the producer's init is left to the next owner")
            if keep_alive is not None:
                keep_alive()

        self._beside(lambda: producer.init_transactions(self.timeout_s), "init", meanwhile)

    def _beside(self, call: Callable[[], object], name: str, meanwhile: Callable[[], None]) -> None:
        """`call` on a thread of its own, `meanwhile` called every WAIT_POLL_S while it runs.
        What `meanwhile` raises gives the call up: its thread goes on alone, and the producer
        with it is never used again (the next init makes a new one)."""
        failed: list[Exception] = []
        done: list[bool] = []

        def run() -> None:
            try:
                call()
                done.append(True)
            except Exception as exc:  # raised again on the caller's thread
                failed.append(exc)

        waiting = threading.Thread(target=run, name=f"{name}-{self.transactional_id}", daemon=True)
        waiting.start()
        while waiting.is_alive():
            waiting.join(WAIT_POLL_S)
            if waiting.is_alive():
                try:
                    meanwhile()
                except BaseException:
                    self._producer = None
                    raise
        if failed:
            raise failed[0]
        if not done:  # its thread ended by a BaseException: no outcome, not a success
            raise ProducerFailed(f"the producer's {name} on its thread ended without an outcome")

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            raise RuntimeError("ShardProducer.init() was not called")
        return self._producer

    def begin(self) -> None:
        self._sent = []
        self._reported.clear()
        self._call(self.producer.begin_transaction)
        self._began = time.monotonic()
        self._settled_by_recovery = False

    def open_for(self) -> float:
        """Seconds since the transaction open now began (-inf with none open)."""
        return time.monotonic() - self._began

    @property
    def abortable(self) -> bool:
        """A transaction is open, its commit not asked for (after that, only the markers
        tell whether it committed) nor an abort failed, and not past its timeout (the broker
        aborts it)."""
        return not self._settled_by_recovery and 0 <= self.open_for() <= self.timeout_s

    def _past_timeout(self, doing: str) -> None:
        # The broker aborts the transaction once it is open this long: what is still produced
        # or awaited after that is lost work (and the relay's waits are bounded by it too).
        if self.open_for() > self.timeout_s:
            symptom = f"{doing} {self.open_for():.1f}s after the Kafka transaction began"
            raise TransactionTimedOut(
                f"{symptom}, past {self.timeout_setting} ({self.timeout_s:g}s)", symptom
            )

    def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, str | bytes | None]],
        partition: int | None = None,
        tag: Any = None,
    ) -> Sent:
        """Produce one record; raises KafkaException at once for what librdkafka refuses locally,
        and TransactionTimedOut once the transaction is open longer than its timeout."""
        self._past_timeout("still producing")
        sent = Sent(tag, topic=topic)
        reported = self._reported

        def report(err: KafkaError | None, msg: Message) -> None:
            sent.reported = True
            sent.error = err
            if err is None:
                sent.partition, sent.offset = msg.partition(), msg.offset()
            reported.append(sent)

        refreshed = False
        while True:
            try:
                self.producer.produce(
                    topic,
                    value,
                    key,
                    _ANY_PARTITION if partition is None else partition,
                    on_delivery=report,
                    headers=headers,
                )
                break
            except BufferError:  # local queue full: let deliveries drain
                self._call(self.producer.poll, 0.05)
                self._past_timeout("still producing")
            except KafkaException as exc:  # a fencing told apart, as for the other calls
                _raise_if_fenced_or_fatal(exc.args[0], exc)
                if exc.args[0].code() not in _STALE_METADATA_ERRORS or refreshed:
                    raise
                # The client's metadata may be older than the topic or its partitions (it
                # refreshes every 5 minutes): asked again once, then the refusal stands.
                refreshed = True
                self.producer.list_topics(topic, timeout=min(self.timeout_s, 10.0))
        self._sent.append(sent)
        return sent

    def send_queued(self, waiting: Callable[[], None] | None = None) -> None:
        """Send what is queued now and wait for it: what is produced next goes in new batches.
        `waiting` is called every WAIT_POLL_S of the wait, as by `reports` (the relay renews
        its leases, and gives the batch up when it stops, from it): one flush up to the
        transaction timeout let a slow broker lapse every lease and overrun a stop's grace."""
        while self._call(self.producer.flush, WAIT_POLL_S) > 0:
            self._past_timeout("queued records still not sent")
            if waiting is not None:
                waiting()

    def reports(
        self,
        stalled: Callable[[list[Sent]], bool] | None = None,
        waiting: Callable[[], None] | None = None,
    ) -> Iterator[Sent]:
        """Each record of this transaction as its delivery report arrives, until all have one.

        Records the caller sends while iterating are waited for too: a caller can send what
        depends on a report (an op marker needs its record's offset) without a second flush.
        `stalled` gets the records still waiting after REPORT_STALL_S without any report, and
        again after each such stretch: it may raise to give the transaction up, or return
        True to stop waiting (those records then have no report). `waiting` is called every
        ~0.1 s of the wait (the relay renews its leases from it).
        """
        done = 0
        last_report = time.monotonic()
        while done < len(self._sent):
            while self._reported:
                done += 1
                last_report = time.monotonic()
                yield self._reported.popleft()
            if done >= len(self._sent):
                break
            self._past_timeout(f"{len(self._sent) - done} records had no delivery report")
            if stalled is not None and time.monotonic() - last_report > REPORT_STALL_S:
                if stalled([sent for sent in self._sent if not sent.reported]):
                    return
                last_report = time.monotonic()
            # flush, not poll: a flush sends what is queued at once instead of after linger.ms
            self._call(self.producer.flush, 0.1)
            if waiting is not None:
                waiting()

    def commit(self, waiting: Callable[[], None] | None = None) -> float:
        """Commit; retriable errors are retried within the timeout, then the outcome is unknown.

        With `waiting`, it is called every WAIT_POLL_S while the commit runs on a thread of its
        own: the relay renews its leases (a commit longer than lease_duration lost them, and the
        next owner fenced the batch), and a stop near the end of its grace raises ShuttingDown,
        which leaves the commit to finish alone and its outcome to the next owner's recovery
        (a stop waited out a coordinator that did not answer, up to the transaction timeout).
        Returns the seconds the commit itself took (not the renewals meanwhile)."""
        self._settled_by_recovery = True
        producer = self.producer
        took: list[float] = []
        try:
            if waiting is None:
                took.append(self._commit(producer))
            else:
                self._beside(lambda: took.append(self._commit(producer)), "commit", waiting)
        except ShuttingDown as exc:
            raise ShuttingDown(
                "the relay stops: the batch's commit is left to finish alone, its outcome to the "
                "next owner's recovery"
            ) from exc
        except KafkaException as exc:
            if exc.args[0].txn_requires_abort():
                # Known not committed: aborted now (the caller's), not left open until a
                # recovery, holding back the stable offset of its partitions meanwhile.
                self._settled_by_recovery = False
            raise
        self._began = float("inf")
        return took[0]

    def _commit(self, producer: Producer) -> float:
        """On any thread: touches none of this object's state. Returns the seconds it took."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                producer.commit_transaction(max(1.0, deadline - time.monotonic()))
                return time.perf_counter() - started
            except KafkaException as exc:
                err: KafkaError = exc.args[0]
                _raise_if_fenced_or_fatal(err, exc)
                if err.txn_requires_abort():
                    raise
                if err.retriable() and time.monotonic() < deadline:
                    continue
                raise OutcomeUnknown(str(err)) from exc

    def abort(
        self, timeout_s: float | None = None, stopping: Callable[[], bool] | None = None
    ) -> None:
        """With `stopping`, given up (the producer left to its thread, never used again) once
        it says so and the abort has had STOP_ABORT_S: up to the transaction timeout with the
        coordinator unreachable, a stop that came meanwhile overran its grace."""
        timeout_s = timeout_s or self.timeout_s
        try:
            if stopping is None:
                self._call(self.producer.abort_transaction, timeout_s)
            else:
                self._abort_unless_stopping(timeout_s, stopping)
        except Exception as exc:  # a fencing too
            self._settled_by_recovery = True
            if isinstance(exc, KafkaException):
                raise OutcomeUnknown(f"abort failed: {exc}") from exc
            raise
        self._began = float("inf")

    def _abort_unless_stopping(self, timeout_s: float, stopping: Callable[[], bool]) -> None:
        producer = self.producer
        began = time.monotonic()

        def unless_stopping() -> None:
            if stopping() and time.monotonic() - began >= STOP_ABORT_S:
                # the broker aborts the transaction at its timeout, and the next owner's
                # init fences this producer
                raise ShuttingDown("the relay stops: the abort is left to the broker")

        self._beside(
            lambda: self._call(producer.abort_transaction, timeout_s), "abort", unless_stopping
        )

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.flush(0)
            except KafkaException as exc:  # fenced or failed for good: it can only be dropped
                logger.info("producer %s dropped: %s", self.transactional_id, exc)
            self._producer = None

    def _call(self, fn: Any, *args: Any) -> Any:
        """A call of the producer; a fencing or a fatal error (which flush and poll raise too:
        a fencing in the wait for reports was counted as kind kafka) told apart."""
        try:
            return fn(*args)
        except KafkaException as exc:
            _raise_if_fenced_or_fatal(exc.args[0], exc)
            raise


def _raise_if_fenced_or_fatal(err: KafkaError, exc: KafkaException) -> None:
    if err.code() in _FENCED_ERRORS:
        raise Fenced(str(err)) from exc
    if err.fatal():
        raise ProducerFailed(f"the shard's producer failed for good: {err}") from exc


def _said_created(name: str, partitions: int, done: Future[None]) -> None:
    exc = done.exception()
    if exc is None:
        logger.info("created topic %s (%s partitions)", name, partitions)
    elif not (
        isinstance(exc, KafkaException) and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS
    ):
        logger.warning("could not create topic %s: %s", name, exc)


class Topics:
    """Creates the relay's own topics and answers "does this topic exist?" from cached metadata."""

    def __init__(self, conf: dict[str, Any], ttl: timedelta = timedelta(seconds=30)) -> None:
        admin_conf: dict[str, Any] = {**conf, "logger": CLIENT_LOGGER}
        try:
            self._admin = AdminClient(admin_conf)
        except KafkaException as exc:
            raise ProducerMisconfigured(
                f"kafka: the Kafka client refuses these settings: {exc.args[0].str()}"
            ) from None
        self._ttl = ttl.total_seconds()
        self._known: dict[str, tuple[float, int]] = {}  # topic -> (checked at, partitions)
        self._denied: set[str] = set()  # topics the broker's ACLs hid at the last look
        self._writable: dict[str, tuple[float, bool]] = {}  # topic -> (checked at, may write)
        self._outage = Outage(logger, "the relay's readiness probe: the broker")

    def ensure(
        self, name: str, partitions: int, config: dict[str, str], *, await_leaders: bool = True
    ) -> None:
        """Create `name` if missing (the broker's default replication factor), and return once
        its partitions have leaders (`await_leaders`)."""
        if self.partitions(name, refresh=True):
            return
        futures = self._admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=-1, config=config)]
        )
        self._known.pop(name, None)
        if not await_leaders:
            # Not waited for at all (a Kafka transaction may be open): said when it is done.
            futures[name].add_done_callback(lambda done: _said_created(name, partitions, done))
            return
        try:
            futures[name].result(30)
            logger.info("created topic %s (%s partitions)", name, partitions)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        self._known.pop(name, None)
        self._await_leaders(name)

    def _await_leaders(self, name: str) -> None:
        """A topic just made is in the metadata, and its partitions led, some time after the
        broker says it is made (seconds on a busy machine). Looked up meanwhile, the relay's
        first recovery found no leader for the marker partition, then no topic at all, and
        stopped for good: "deleted while the relay ran". Raises KafkaException (the setup
        goes again) if that takes longer than TOPIC_READY_S. Any other error of the topic's
        (not authorised to see it, say) is for the caller's checks to say, at once."""
        deadline = time.monotonic() + TOPIC_READY_S
        while True:
            topic = self._admin.list_topics(name, timeout=10).topics.get(name)
            error = None if topic is None else topic.error
            if error is not None and error.code() not in _PROPAGATING:
                return
            if (
                topic is not None
                and error is None
                and topic.partitions
                and all(p.leader >= 0 for p in topic.partitions.values())
            ):
                return
            if time.monotonic() > deadline:
                raise KafkaException(
                    KafkaError(
                        KafkaError.LEADER_NOT_AVAILABLE,
                        f"topic {name} was made, but its partitions had no leaders after "
                        f"{TOPIC_READY_S:g}s",
                    )
                )
            time.sleep(0.1)

    def partitions(self, name: str, *, refresh: bool = False) -> int:
        """Partition count of `name`, 0 when it does not exist (or we may not see it).

        Raises KafkaException for any other error in the metadata (a partition without a
        leader, just after the topic was created or during an election): that passes, and a 0
        would have parked the topic's records for good.
        """
        self._admin.poll(0)  # its log lines (see CLIENT_LOGGER)
        now = time.monotonic()
        cached = self._known.get(name)
        if cached and not refresh and now - cached[0] < self._ttl:
            return cached[1]
        topic = self._admin.list_topics(name, timeout=10).topics.get(name)
        denied = False
        if topic is not None and topic.error is not None:
            if topic.error.code() not in _TOPIC_MISSING:
                raise KafkaException(topic.error)
            denied = topic.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
            topic = None
        count = 0 if topic is None else len(topic.partitions)
        self._known[name] = (now, count)
        if denied:
            self._denied.add(name)
        else:
            self._denied.discard(name)
        return count

    def writable(self, name: str, *, refresh: bool = False) -> bool:
        """False when the broker's ACLs let the relay's principal see `name` but not write
        to it. The client then fails the whole Kafka transaction as the topic joins it (every
        report purged, the abort fatal), and one record for such a topic held its shard's
        every other record back for as long as the ACL stayed: asked before, and parked.
        True where it is not known (no authorizer answers, any error: produce says)."""
        now = time.monotonic()
        cached = self._writable.get(name)
        if cached and not refresh and now - cached[0] < self._ttl:
            return cached[1]
        self._admin.poll(0)
        may = True
        try:
            described = self._admin.describe_topics(
                TopicCollection([name]), request_timeout=10, include_authorized_operations=True
            )[name].result(15)
            granted = described.authorized_operations
            may = granted is None or bool({AclOperation.WRITE, AclOperation.ALL} & set(granted))
        except KafkaException:
            pass
        self._writable[name] = (now, may)
        return may

    def denied(self, name: str) -> bool:
        """Whether the last look at `name` was refused by the broker's ACLs (partitions() said
        0): the topic may well exist, and the reason must not say it does not."""
        return name in self._denied

    def topic_id(self, name: str, *, timeout_s: float = 10.0) -> str | None:
        """The topic's id: a topic deleted and made again under its name has another. None
        when it is missing."""
        try:
            future = self._admin.describe_topics(TopicCollection([name]), request_timeout=timeout_s)
            described = future[name].result(timeout_s + 5)
        except KafkaException as exc:
            if exc.args[0].code() in _TOPIC_MISSING:
                return None
            raise
        # A cluster still in ZooKeeper mode (mid-upgrade) may give a topic no id: all zeros.
        given = None if described.topic_id is None else str(described.topic_id)
        return None if given == _NO_TOPIC_ID else given

    def known_partitions(self, name: str) -> int | None:
        """The partition count last looked up for `name`, however old; None if never."""
        cached = self._known.get(name)
        return None if cached is None else cached[1]

    def log_end(self, name: str, partition: int, *, timeout_s: float = 10.0) -> int:
        """The partition's log end offset, open transactions included. A read_committed
        consumer's high watermark is the last stable offset instead: it stops at the first
        transaction still open, whatever was committed after it."""
        return self._offset(name, partition, OffsetSpec.latest(), timeout_s)  # type: ignore[no-untyped-call]

    def log_start(self, name: str, partition: int) -> int:
        """The partition's first offset still kept (retention and delete-records move it)."""
        return self._offset(name, partition, OffsetSpec.earliest())  # type: ignore[no-untyped-call]

    def _offset(self, name: str, partition: int, spec: OffsetSpec, timeout_s: float = 10.0) -> int:
        self._admin.poll(0)
        tp = TopicPartition(name, partition)
        found = self._admin.list_offsets(
            {tp: spec}, isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=timeout_s
        )
        return int(found[tp].result().offset)

    def config(self, name: str) -> dict[str, str] | None:
        """The topic's configuration; None when the broker does not tell (no permission)."""
        self._admin.poll(0)
        resource = ConfigResource(ResourceType.TOPIC, name)
        try:
            configs = self._admin.describe_configs([resource])[resource].result(10)
        except KafkaException as exc:
            denied = exc.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
            logger.warning(
                "could not read the configuration of topic %s, so it is not checked: %s%s",
                name,
                exc.args[0].str(),
                " (the relay's principal needs DESCRIBE_CONFIGS on it)" if denied else "",
            )
            return None
        return {key: entry.value for key, entry in configs.items() if entry.value is not None}

    def reachable(self) -> bool:
        self._admin.poll(0)  # the readiness probe's: the lines of an outage come out as it goes
        try:
            # Metadata of the brokers only: list_topics() asked for every topic's, at every probe
            # of every pod (a large response, a load on the broker, on a cluster of many topics).
            cluster = self._admin.describe_cluster(request_timeout=3).result(timeout=4)
        except KafkaException as exc:
            return self._say_down(exc.args[0].str())
        except TimeoutError:
            return self._say_down("no answer within 4 s")
        if not cluster.nodes:
            return self._say_down("the cluster described no broker")
        self._outage.up()
        return True

    def _say_down(self, why: str) -> bool:
        """False, with why logged (once an outage): /readyz says only `"broker": false`."""
        self._outage.down(why)
        return False
