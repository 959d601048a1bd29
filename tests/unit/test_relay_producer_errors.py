"""Which producer errors are a fencing (Fenced: maybe another owner, the lease decides) and
which a fatal error of this producer instance only (ProducerFailed)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.config import RelaySettings
from relay.kafka import (
    Fenced,
    OutcomeUnknown,
    ProducerFailed,
    ProducerMisconfigured,
    ShardProducer,
    ShuttingDown,
    TransactionTimedOut,
)
from relay.leases import Lease
from relay.shard import STOP_ABORT_S, LeaseLost, ShardWorker


class _Failing:
    """A librdkafka producer whose transactional calls all fail with one error."""

    def __init__(self, error: KafkaError) -> None:
        self.error = error

    def begin_transaction(self) -> None:
        raise KafkaException(self.error)

    def commit_transaction(self, timeout: float) -> None:
        raise KafkaException(self.error)

    def produce(self, *args: Any, **kwargs: Any) -> None:
        raise KafkaException(self.error)


def producer_failing_with(error: KafkaError) -> ShardProducer:
    producer = ShardProducer({}, "test-0", timedelta(seconds=1))
    producer._producer = _Failing(error)  # type: ignore[assignment]
    return producer


FENCED = [
    KafkaError(KafkaError._FENCED, fatal=True),
    KafkaError(KafkaError.PRODUCER_FENCED, fatal=True),
    KafkaError(KafkaError.INVALID_PRODUCER_EPOCH),
]
FATAL = KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True)


CALLS = {  # a fencing reported by produce() was a plain KafkaException: counted as "kafka"
    "begin": lambda p: p.begin(),
    "commit": lambda p: p.commit(),
    "send": lambda p: p.send("t", b"v", None, []),
}


@pytest.mark.parametrize("error", FENCED, ids=lambda e: e.name())
@pytest.mark.parametrize("call", list(CALLS))
def test_a_fencing_is_told_apart(error: KafkaError, call: str) -> None:
    with pytest.raises(Fenced):
        CALLS[call](producer_failing_with(error))


@pytest.mark.parametrize("call", list(CALLS))
def test_a_fatal_error_that_is_not_a_fencing_is_the_producer_s_own(call: str) -> None:
    with pytest.raises(ProducerFailed, match="OUT_OF_ORDER_SEQUENCE_NUMBER") as failed:
        CALLS[call](producer_failing_with(FATAL))
    assert not isinstance(failed.value, Fenced)


def test_a_record_refused_by_the_client_stays_a_kafka_error() -> None:
    """What _ship parks (too large) or takes for a failed transaction (_STATE) is unchanged."""
    for code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError._STATE):
        with pytest.raises(KafkaException):
            CALLS["send"](producer_failing_with(KafkaError(code)))


def test_a_retriable_commit_error_past_the_timeout_leaves_the_outcome_unknown() -> None:
    error: Any = KafkaError(KafkaError._TIMED_OUT, retriable=True)
    with pytest.raises(OutcomeUnknown):
        producer_failing_with(error).commit()


def test_a_commit_refused_as_must_abort_leaves_the_transaction_to_be_aborted() -> None:
    """Its outcome is known (not committed): left open until the shard's recovery after its
    backoff, it held back the stable offset of its partitions, the op-marker partition other
    shards share included."""
    error: Any = KafkaError(KafkaError._STATE, txn_requires_abort=True)
    producer = producer_failing_with(error)
    producer._began = time.monotonic()  # a transaction open since now
    with pytest.raises(KafkaException):
        producer.commit()
    assert producer.abortable


def test_a_commit_of_unknown_outcome_is_not_aborted() -> None:
    """Only a recovery settles it: its markers say whether it committed."""
    error: Any = KafkaError(KafkaError._TIMED_OUT, retriable=True)
    producer = producer_failing_with(error)
    producer._began = time.monotonic()
    with pytest.raises(OutcomeUnknown):
        producer.commit()
    assert not producer.abortable


class _CoordinatorUnreachable:
    """A librdkafka producer whose init_transactions waits its whole timeout, then fails."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.asked: list[float] = []

    def init_transactions(self, timeout: float) -> None:
        self.asked.append(timeout)
        time.sleep(timeout)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, retriable=True))

    def flush(self, timeout: float) -> int:
        return 0


def test_a_stop_cuts_an_init_waiting_for_an_unreachable_coordinator_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init_transactions waited up to the transaction timeout (60 s) whatever a stop said: a
    SIGTERM in a broker outage, landing in a shard's recovery, overran the grace."""
    monkeypatch.setattr("relay.kafka.Producer", _CoordinatorUnreachable)
    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    stop_at = time.monotonic() + 0.3
    with pytest.raises(ShuttingDown):
        producer.init(stopping=lambda: time.monotonic() >= stop_at)
    assert time.monotonic() - stop_at < 1
    assert not producer.abortable
    with pytest.raises(RuntimeError, match="init"):
        producer.begin()  # left to its init's thread, never used again
    # Not stopped, the init's outcome is the caller's, as without a stop to heed
    unstopped = ShardProducer({}, "test-0", timedelta(seconds=0.3))
    with pytest.raises(KafkaException, match="_TIMED_OUT"):
        unstopped.init(stopping=lambda: False)
    with pytest.raises(KafkaException, match="_TIMED_OUT"):
        unstopped.init()
    assert unstopped.producer.asked == [0.3]  # type: ignore[attr-defined]


def test_a_recovery_whose_heartbeat_hands_the_shard_over_gives_its_init_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The init went on waiting (up to the transaction timeout) after the heartbeat it called
    gave the shard to another relay, and once it ended, fenced that relay's producer."""
    monkeypatch.setattr("relay.kafka.Producer", _CoordinatorUnreachable)
    shard = ShardWorker(
        Lease(0, 1, None, 0), RelaySettings(), "outbox", "relay-1", {}, None,  # type: ignore[arg-type]
        ending_elsewhere=lambda: None,  # type: ignore[arg-type,return-value]
    )  # fmt: skip
    beats: list[float] = []

    def heartbeat() -> None:  # the second one rebalances: this shard goes to another relay
        beats.append(time.monotonic())
        if len(beats) == 2:
            shard.close()

    began = time.monotonic()
    with pytest.raises(LeaseLost, match="shard 0 was handed over during its recovery"):
        shard.producer.init(lambda: False, shard._while_held(heartbeat))
    assert time.monotonic() - began < 5  # not the 60 s of the init's wait
    assert len(beats) == 2
    kept = shard._while_held(lambda: None)
    with pytest.raises(LeaseLost):
        kept()  # closed: every later keep-alive of the recovery says so too


class _SlowCommit:
    """A librdkafka producer whose commit_transaction answers after `takes` seconds."""

    def __init__(self, takes: float) -> None:
        self.takes = takes
        self.committed = threading.Event()

    def commit_transaction(self, timeout: float) -> None:
        time.sleep(self.takes)
        self.committed.set()

    def flush(self, timeout: float) -> int:
        return 0


def test_a_commit_calls_its_waiting_hook_while_it_runs() -> None:
    """The relay renews its leases from it: renewed only before the commit, a commit longer
    than lease_duration lost them, and another relay fenced the batch."""
    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    slow = _SlowCommit(1.0)
    producer._producer = slow  # type: ignore[assignment]
    producer._began = time.monotonic()
    called: list[float] = []

    def renewing() -> None:
        called.append(time.monotonic())
        time.sleep(0.05)  # a renewal's round trip: not the commit's latency

    took = producer.commit(renewing)
    assert slow.committed.is_set()
    assert len(called) >= 3, called  # every 0.1 s of the 1 s
    assert 1.0 <= took < 1.0 + 0.05 * len(called)  # the commit's own time
    assert producer.open_for() < 0  # none open


class _SlowAbort:
    """A librdkafka producer whose abort_transaction answers after `takes` seconds."""

    def __init__(self, takes: float) -> None:
        self.takes = takes
        self.asked: list[float] = []
        self.aborted = threading.Event()

    def abort_transaction(self, timeout: float) -> None:
        self.asked.append(timeout)
        time.sleep(self.takes)
        self.aborted.set()

    def flush(self, timeout: float) -> int:
        return 0


def test_a_stop_during_an_abort_the_coordinator_does_not_answer_gives_it_up() -> None:
    """An abort begun before the stop waited up to the transaction timeout (60 s) whatever the
    stop said: a SIGTERM in a Kafka incident, landing in a failed batch's abort, overran the
    grace. It gets STOP_ABORT_S, as a stop's own abort does."""
    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    stuck = _SlowAbort(30)
    producer._producer = stuck  # type: ignore[assignment]
    producer._began = time.monotonic()
    began = time.monotonic()
    stop_at = began + 0.3
    with pytest.raises(ShuttingDown, match="left to the broker"):
        producer.abort(stopping=lambda: time.monotonic() >= stop_at)
    took = time.monotonic() - began
    assert STOP_ABORT_S <= took < STOP_ABORT_S + 1, took
    assert stuck.asked == [30]
    assert not stuck.aborted.is_set()
    assert not producer.abortable  # only a recovery settles it
    with pytest.raises(RuntimeError, match="init"):
        producer.begin()  # left to its abort's thread, never used again
    # Not stopped, the abort ends as the coordinator answers
    answering = ShardProducer({}, "test-0", timedelta(seconds=30))
    answering._producer = _SlowAbort(0.3)  # type: ignore[assignment]
    answering._began = time.monotonic()
    answering.abort(5.0, stopping=lambda: False)
    assert answering._producer.aborted.is_set()  # type: ignore[attr-defined]
    assert answering.open_for() < 0  # none open


class _QueueStuck:
    """A librdkafka producer whose queue never drains (the broker does not answer)."""

    def __init__(self) -> None:
        self.flushed: list[float] = []

    def flush(self, timeout: float) -> int:
        self.flushed.append(timeout)
        time.sleep(timeout)
        return 1


def test_a_record_sent_alone_waits_for_its_batch_renewing_and_heeding_a_stop() -> None:
    """A record that goes alone (send_queued) waited in one flush up to the transaction timeout,
    without the waiting hook: a slow broker let every lease of the relay lapse, and a stop
    meanwhile overran its grace. It waits in slices now, calling the hook between them, and
    gives up at the transaction's timeout as the wait for reports does."""
    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    stuck = _QueueStuck()
    producer._producer = stuck  # type: ignore[assignment]
    producer._began = time.monotonic()
    calls: list[float] = []

    def stop_after_three() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise ShuttingDown("the relay stops")

    began = time.monotonic()
    with pytest.raises(ShuttingDown):
        producer.send_queued(stop_after_three)
    assert len(calls) == 3
    assert time.monotonic() - began < 1.0  # not the transaction's 30 s
    assert max(stuck.flushed) <= 0.1
    # past the transaction's timeout, it is said so, not waited out again
    producer._began = time.monotonic() - 31
    with pytest.raises(TransactionTimedOut, match="queued records still not sent"):
        producer.send_queued(lambda: None)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_commit_whose_thread_ends_without_an_outcome_is_no_success() -> None:
    class _Interrupted:
        def commit_transaction(self, timeout: float) -> None:
            raise SystemExit  # a BaseException: its thread just ends, silently

    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    producer._producer = _Interrupted()  # type: ignore[assignment]
    producer._began = time.monotonic()
    with pytest.raises(ProducerFailed, match="commit on its thread ended without an outcome"):
        producer.commit(lambda: None)


def test_a_stop_leaves_a_commit_the_coordinator_does_not_answer_to_finish_alone() -> None:
    """commit_transaction waited up to the transaction timeout whatever a stop said."""
    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    stuck = _SlowCommit(30)
    producer._producer = stuck  # type: ignore[assignment]
    producer._began = time.monotonic()
    stop_at = time.monotonic() + 0.3

    def waiting() -> None:
        if time.monotonic() >= stop_at:
            raise ShuttingDown("the relay stops")

    with pytest.raises(ShuttingDown, match="next owner's recovery"):
        producer.commit(waiting)
    assert time.monotonic() - stop_at < 1
    assert not stuck.committed.is_set()
    assert not producer.abortable  # its outcome is unknown: only a recovery settles it
    with pytest.raises(RuntimeError, match="init"):
        producer.begin()  # left to its commit's thread, never used again


def test_extra_may_tune_the_producer_but_not_loosen_exactly_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kafka.extra's linger.ms and the like were overwritten without a word; acks and
    idempotence stay as transactions need them, and an extra that says otherwise is named."""
    extra = {"linger.ms": 20, "acks": "1", "enable.idempotence": "false", "client.id": "x"}
    conf = ShardProducer(extra, "test-0", timedelta(seconds=1))._conf
    assert (conf["linger.ms"], conf["client.id"]) == (20, "x")
    assert (conf["acks"], conf["enable.idempotence"], conf["transactional.id"]) == (
        "all",
        True,
        "test-0",
    )
    assert "kafka.extra acks=1 ignored" in caplog.text
    assert "kafka.extra enable.idempotence=false ignored" in caplog.text
    defaults = ShardProducer({"acks": "-1"}, "test-0", timedelta(seconds=1))._conf
    assert defaults["linger.ms"] == 2
    assert "acks=-1" not in caplog.text  # the same as all


def test_the_kafka_transaction_timeout_is_the_brokers_too() -> None:
    """relay.kafka_transaction_timeout bounded only the relay's own waits: the broker kept
    librdkafka's 60 s for a transaction a paused relay left open."""
    conf = ShardProducer({}, "test-0", timedelta(seconds=5))._conf
    assert conf["transaction.timeout.ms"] == 5000
    extra = {"transaction.timeout.ms": 90_000}  # kafka.extra may set it apart
    longer = ShardProducer(extra, "test-0", timedelta(seconds=5))
    assert longer._conf == {**conf, "transaction.timeout.ms": 90_000}
    assert longer.timeout_s == 5  # the relay's own waits


def test_a_shorter_transaction_timeout_in_extra_ends_the_relays_waits_and_is_named() -> None:
    """The broker aborted the batch at kafka.extra's 10 s while the relay waited 60 s: what
    it saw then (a fencing, a message timed out) was counted as another error, never as a batch
    past its timeout."""
    extra = {"transaction.timeout.ms": "10000"}  # as a config file or the environment give it
    producer = ShardProducer(extra, "test-0", timedelta(seconds=60))
    assert producer.timeout_s == 10
    producer._began = time.monotonic() - 11
    assert not producer.abortable  # the broker has aborted it
    with pytest.raises(
        TransactionTimedOut, match=r"past transaction\.timeout\.ms in kafka\.extra \(10s\)"
    ):
        producer._past_timeout("waiting for reports")


def test_producer_settings_the_client_refuses_stop_the_relay() -> None:
    """A message.timeout.ms in kafka.extra above transaction.timeout.ms: the client refuses to
    make the producer, for every shard, round after round; a misconfiguration (the relay stops
    with it, exit 1), not a shard's passing trouble."""
    producer = ShardProducer({"message.timeout.ms": 45_000}, "test-0", timedelta(seconds=30))
    with pytest.raises(ProducerMisconfigured, match=r"message\.timeout\.ms"):
        producer.init()


class _Topics:
    """The relay's topic metadata: what a fresh look-up finds, and how often it was asked."""

    def __init__(self, partitions: int | Exception, denied: bool = False) -> None:
        self.found, self.is_denied, self.asked = partitions, denied, 0

    def partitions(self, name: str, *, refresh: bool = False) -> int:
        assert refresh, "a cached count is what let the record through"
        self.asked += 1
        if isinstance(self.found, Exception):
            raise self.found
        return self.found

    def denied(self, name: str) -> bool:
        return self.is_denied


@pytest.mark.parametrize(
    ("error", "topics", "gone"),
    [
        (KafkaError.UNKNOWN_TOPIC_OR_PART, _Topics(0), True),  # deleted since the relay looked
        (KafkaError._UNKNOWN_TOPIC, _Topics(0), True),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, _Topics(3), False),  # there: the broker's words
        (KafkaError.UNKNOWN_TOPIC_OR_PART, _Topics(0, denied=True), False),  # hidden, not gone
        (KafkaError.UNKNOWN_TOPIC_OR_PART, _Topics(KafkaException(KafkaError._TIMED_OUT)), False),
        (KafkaError.MSG_SIZE_TOO_LARGE, _Topics(0), False),  # not about the topic at all
    ],
)
def test_a_record_refused_for_a_topic_deleted_since_is_parked_as_of_a_missing_topic(
    error: int, topics: _Topics, gone: bool
) -> None:
    """Deleted after the relay last looked, the topic passed the check before the transaction;
    the broker then refused the record, and it was parked "refused by the broker: Unknown
    topic or partition" (counted as refused_by_broker), or "does not exist" (unknown_topic)
    when a look-up in between won the race. Said the one way now, looked up once a batch."""
    from types import SimpleNamespace

    from relay.shard import ShardWorker

    worker: Any = SimpleNamespace(topics=topics)
    looked_up: dict[str, int] = {}
    for _ in range(2):  # two records of the topic in one batch
        assert ShardWorker._gone(worker, "orders", KafkaError(error), looked_up) is gone
    assert topics.asked == (0 if error == KafkaError.MSG_SIZE_TOO_LARGE else 1)


class _AbortTimesOut:
    """A librdkafka producer whose abort_transaction waits its whole timeout, then fails."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def abort_transaction(self, timeout: float) -> None:
        self.asked.append(timeout)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, retriable=True))


@pytest.mark.parametrize(("stopping", "waited"), [(True, STOP_ABORT_S), (False, 30.0)])
def test_a_shards_abort_waits_briefly_once_the_relay_stops(stopping: bool, waited: float) -> None:
    """An abort after a failed batch waited up to the transaction timeout whatever the stop
    said, as the commit did: in a Kafka incident, past the stop's grace."""
    producer = ShardProducer({}, "test-0", timedelta(seconds=30))
    librdkafka = _AbortTimesOut()
    producer._producer = librdkafka  # type: ignore[assignment]
    worker: Any = SimpleNamespace(
        producer=producer, shard=0, needs_recovery=False, _stopping=lambda: stopping
    )
    ShardWorker._abort(worker)  # a failed abort is logged, not raised
    assert librdkafka.asked == [waited]
    assert worker.needs_recovery  # recovery fences what the abort left
